"""Benchmarks: scripts run as ``python bench/NAME.py``, measuring side by side in one run.
A package only so the import contracts see them: nothing in the platform imports bench."""
