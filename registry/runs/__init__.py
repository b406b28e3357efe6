"""MLflow experiments and runs as this platform keeps them: one experiment per config name,
a parent run per experiment run, a run per trial; their tags, states, lease, hosts, the
searcher's state and the winner, written and read back."""

__all__: list[str] = []
