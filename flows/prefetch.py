"""Import a flow's heavy modules (torch, MLflow, Dask, boto3: about 3 s on one core) on a
thread while Prefect's engine starts the flow run.

A worker's flow run is a fresh ``python -m prefect.engine`` process. Its engine imports the
flow's module, then sets the run Running and calls the flow: round trips to the server
that leave this process idle. The flow module imports only what its decorator needs
(flows.experiment) and starts a ``Prefetch`` of the rest; the flow's body waits for it
before it touches them, so no module is imported by two threads at once.
"""

from __future__ import annotations

import importlib
import os
import threading
from collections.abc import Sequence

__all__ = ["FLOW_RUN_ENV", "Prefetch"]

# Set by Prefect's workers for the engine process of each flow run they start.
FLOW_RUN_ENV = "PREFECT__FLOW_RUN_ID"


class Prefetch:
    """``modules`` imported in order on a daemon thread, started only in a worker's flow-run
    process (``FLOW_RUN_ENV`` set) unless ``start`` says otherwise; ``wait`` joins it (at
    once when it never started). A module that fails to import ends the thread quietly:
    the flow's own import of it raises the error where it is needed."""

    def __init__(self, modules: Sequence[str], start: bool | None = None) -> None:
        self.modules = tuple(modules)
        self._thread: threading.Thread | None = None
        if os.environ.get(FLOW_RUN_ENV) if start is None else start:
            self._thread = threading.Thread(target=self._load, name="flow-prefetch", daemon=True)
            self._thread.start()

    def _load(self) -> None:
        for name in self.modules:
            try:
                importlib.import_module(name)
            except BaseException:  # raised again where the flow imports it
                return

    @property
    def started(self) -> bool:
        return self._thread is not None

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
