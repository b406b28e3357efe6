"""The last module the warm workers' forkserver imports: it loads what every trial step
needs after fork, then moves all of it into the garbage collector's permanent generation.
It also sets what every forked worker inherits: a filter for runpy's warning about the main
module it re-runs, and the group signals it ignores (below).

Why: a worker forked from the server shares the server's memory until it writes to a page.
Python's cyclic collector writes to every object it scans, so without ``gc.freeze`` a
worker's first collection made 92 MB of that heap its own (measured in a forked child: 1 MB
with the freeze). Over a whole trial, refcount writes still copy some pages: the workers of
a 6-trial experiment used ~36 MB less each with the freeze.
"""

from __future__ import annotations

import gc
import warnings

import torch._dynamo  # noqa: F401  (a trial's first optimizer imports it: ~1.2 s a worker)

import registry.jobs.trial_services  # noqa: F401  (opened by every trial step, after fork)
from cluster.held_trials import shield_from_group_signals
from registry.runs.tracking import import_tracking_store
from registry.servers.settings import RegistrySettings

__all__: list[str] = []

# The MLflow store module for this experiment's tracking URI (the SQLAlchemy store for a
# database: ~0.7 s a worker), imported, not opened: a connection must not cross fork.
import_tracking_store(RegistrySettings.from_env().tracking_uri or "")

# Every child re-runs the main module as __mp_main__ (multiprocessing's spawn.prepare). The
# forkserver has imported it by name on purpose (cluster.warm_forkserver), so runpy's "found
# in sys.modules ... prior to execution" RuntimeWarning reached the user's terminal from
# every new worker, naming a risk this preload was made to take.
warnings.filterwarnings(
    "ignore",
    message=r"'[\w.]+' found in sys\.modules after import of package",
    category=RuntimeWarning,
)

# SIGINT and SIGTERM sent to the flow's process group (Ctrl-C, ``timeout``, systemd) reach the
# server too: ignored here, the server outlives them (it ends when the flow closes its pipe)
# and every worker it forks is shielded from birth, before its plugin is set up.
shield_from_group_signals()

gc.collect()
gc.freeze()
