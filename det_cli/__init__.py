"""``det``: Determined's command line (``det experiment create const.yaml .`` and the verbs
people script) over this platform's Prefect server, MLflow and S3."""

from det_cli.dispatch import command, main

__all__ = ["command", "main"]
