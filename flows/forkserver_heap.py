"""The last module the warm workers' forkserver imports: it loads what every trial step
needs after fork, then moves all of it into the garbage collector's permanent generation.

Why: a worker forked from the server shares the server's memory until it writes to a page.
Python's cyclic collector writes to every object it scans, so without ``gc.freeze`` each
worker's first collection copies the whole imported heap (~90 MB per worker, measured);
32 trial workers on one host paid ~3 GB for it.
"""

from __future__ import annotations

import gc

import registry.services  # noqa: F401  (opened by every trial step, after fork)

__all__: list[str] = []

gc.collect()
gc.freeze()
