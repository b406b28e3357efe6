"""The Dask runtime: warm worker processes that hold trials between steps.

- ``startup``: start an embedded cluster or connect to the stack's, and register the
  worker plugins; ``environment``: the variables that name it (light, no Dask import).
- ``held_trials``: the worker plugin that keeps one trial in memory, and ``run_step``,
  the one function every step runs; ``steps``: where every step is submitted and watched;
  ``placement``: which worker a trial's next step prefers.
- ``stop_requests``: the stop request an experiment reads from the scheduler's metadata.
- ``job_queue`` (the scheduler plugin), ``fair_share`` (its decision: priorities,
  weights, caps, preemption), ``job_slots`` (a flow's seat in it), ``queue_http`` (its
  routes on the scheduler's HTTP server), ``job_requests`` (``det``'s HTTP requests to them),
  ``pools`` (resource pools); ``worker_calls``: what the flow asks of every worker (stop,
  preempt, release).
- ``recycling``, ``worker_process``, ``worker_deaths``, ``worker_heap``,
  ``warm_forkserver``, ``forkserver_heap``: the worker processes' own life (restart
  between trials, signals, how one died, memory, a warm start).
- ``batch_shards`` / ``batch_data``: batch inference's shards on the same workers.

The package that imports ``distributed`` and ``dask``; import-linter checks it, with one
declared exception in pyproject.toml's ``ignore_imports``: ``infra.dask_cluster`` imports
``distributed`` to start the stack's scheduler and ask it for its workers. It calls
``det_tasks`` and ``registry``, and knows nothing of Prefect.
"""

__all__: list[str] = []
