"""Prefect flows and tasks: experiments as train/validate/checkpoint DAGs, batch inference.

The only package that imports prefect; it calls det_tasks and registry.
"""

__all__: list[str] = []
