"""Reaching MLflow and S3: where they are (``settings``), MLflow's REST API and errors read
with the standard library, S3 transfers (``s3``, or a local folder standing in), keeping a
reference inside the place it names, and the shared local database created once (from a
template of its schema, when this installation has one)."""

__all__: list[str] = []
