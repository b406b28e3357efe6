"""The services a running job plugs into through the entry points: a trial's (``trial_services``),
an unmanaged ``core_v2`` script's, and a batch-inference job's with its parquet input."""

__all__: list[str] = []
