"""cluster.slurm_workers without a Slurm: the slots the queue wants, the settings' round
trip and refusals, and the job script a worker job is submitted with."""

from __future__ import annotations

import dataclasses
import shlex
from pathlib import Path

import pytest

from cluster.slurm_workers import SlurmWorkerSettings, wanted_slots


@dataclasses.dataclass
class _Job:
    pool: str = "default"
    need: int = 1
    running: dict[int, float] = dataclasses.field(default_factory=dict)
    waiting: tuple[int, ...] = ()
    paused: bool = False
    max_slots: int | None = None
    slurm: dict | None = None


def test_wanted_slots_count_running_and_waiting_trials_within_max_slots() -> None:
    jobs = [
        _Job(running={1: 0.0}, waiting=(2, 3)),  # 3
        _Job(need=2, running={1: 0.0}, waiting=(2,), max_slots=2),  # 4, capped at 2
        _Job(waiting=(1, 2), paused=True),  # paused: none
        _Job(pool="gpu", waiting=(1,)),  # another pool
    ]
    assert wanted_slots(jobs, "default") == 5  # type: ignore[arg-type]
    assert wanted_slots(jobs, "gpu") == 1  # type: ignore[arg-type]
    assert wanted_slots([], "default") == 0


def test_settings_round_trip_and_an_unknown_setting_is_named() -> None:
    settings = SlurmWorkerSettings(partition="batch", sbatch_args=("--exclusive",), env={"A": "1"})
    assert SlurmWorkerSettings.from_json(settings.to_json()) == settings
    with pytest.raises(ValueError, match=r"unknown setting\(s\) \['partiton'\]"):
        SlurmWorkerSettings.from_json('{"partiton": "batch"}')


def test_directives_carry_account_qos_gres_warning_and_the_sites_own_args() -> None:
    settings = SlurmWorkerSettings(
        account="ml", qos="high", gpus=2, gpu_type="a100", warning_s=90,
        sbatch_args=("--exclusive", "--constraint=ib"),
    )  # fmt: skip
    assert settings.directives() == [
        "--signal=B:USR1@90", "--account=ml", "--qos=high", "--gres=gpu:a100:2",
        "--exclusive", "--constraint=ib",
    ]  # fmt: skip


def _job_script(settings: SlurmWorkerSettings, slurm: dict | None = None) -> str:
    from types import SimpleNamespace

    from cluster.slurm_workers import SlurmWorkers, shape_of

    plugin = SlurmWorkers(settings)
    plugin.scheduler = SimpleNamespace(address="tcp://10.0.0.1:8786")  # type: ignore[assignment]
    return str(plugin.job_for(shape_of(slurm), "det-worker-1").job_script())


def test_the_job_script_runs_one_det_tasks_worker_in_place_of_its_shell() -> None:
    settings = SlurmWorkerSettings(
        partition="batch", walltime="00:30:00", env={"MLFLOW_TRACKING_URI": "http://h:5000"}
    )
    script = _job_script(settings)
    assert "#SBATCH -J det-worker-1" in script
    assert "#SBATCH -p batch" in script and "#SBATCH -t 00:30:00" in script
    assert "#SBATCH --signal=B:USR1@120" in script
    assert "export MLFLOW_TRACKING_URI=http://h:5000" in script
    command = next(line for line in script.splitlines() if "dask_worker" in line)
    argv = shlex.split(command)
    assert argv[0] == "exec"
    spec = settings.worker_spec()
    # The spec's options come after dask-jobqueue's own, so they win; then the warning's.
    tail = [*spec.cli_args(), "--preload", "cluster.slurm_warning"]
    assert argv[-len(tail) - 2 : -2] == tail
    assert argv[-2:] == ["--preload-nanny", "cluster.slurm_warning"]
    assert "cluster.held_trials" in argv and "pool-default=1" in command


def test_an_experiments_slurm_section_shapes_its_jobs() -> None:
    site = SlurmWorkerSettings(partition="batch", sbatch_args=("--exclusive",))
    cpu = site.for_experiment({"slots_per_node": 2, "sbatch_args": ["--constraint=ib"]})
    assert (cpu.cores, cpu.gpus) == (2, 0)
    assert cpu.directives()[-2:] == ["--exclusive", "--constraint=ib"]  # the site's first
    gpu = site.for_experiment({"slots_per_node": 4, "gpu_type": "a100", "sbatch_args": []})
    assert (gpu.cores, gpu.gpus) == (1, 4)
    assert "--gres=gpu:a100:4" in gpu.directives()
    script = _job_script(site, {"gpu_type": "a100", "slots_per_node": 4, "sbatch_args": []})
    assert "#SBATCH --gres=gpu:a100:4" in script and "GPU=4" in script
    assert site.for_experiment(None) is site


def test_wanted_jobs_are_counted_per_shape() -> None:
    from cluster.slurm_workers import shape_of, wanted_by_shape

    wide = {"slots_per_node": 2, "gpu_type": None, "sbatch_args": []}
    jobs = [_Job(waiting=(1, 2)), _Job(waiting=(1,), running={2: 0.0}), _Job(waiting=(1,))]
    jobs[1].slurm = wide
    assert wanted_by_shape(jobs, "default") == {shape_of(None): 3, shape_of(wide): 2}  # type: ignore[arg-type]


def test_the_queue_lists_a_pool_workers_are_started_for_on_demand_with_no_slot_yet() -> None:
    """A flow refuses a pool the cluster does not have; a pool whose workers Slurm starts
    when the queue wants them exists before its first worker does."""
    from types import SimpleNamespace

    from cluster.job_queue import JobQueue
    from cluster.slurm_workers import SLURM_WORKERS_NAME, SlurmWorkers

    queue = JobQueue()
    queue.scheduler = SimpleNamespace(workers={}, plugins={})  # type: ignore[assignment]
    assert queue.pools() == {}
    elastic = SlurmWorkers(SlurmWorkerSettings(pool="hpc"))
    queue.scheduler.plugins[SLURM_WORKERS_NAME] = elastic  # type: ignore[union-attr]
    assert queue.pools() == {"hpc": 0}


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ('{"partiton": "batch"}', r"unknown setting\(s\) \['partiton'\]; known: partition"),
        ("partition=batch", "is not JSON"),
        ('["batch"]', "must be a JSON object"),
        ('{"max_jobs": 0}', "max_jobs must be a whole number >= 1, got 0"),
    ],
)
def test_make_up_refuses_bad_worker_job_settings_before_starting_anything(
    tmp_path: Path, text: str, said: str
) -> None:
    from infra.services import ServiceError
    from infra.stack import StackConfig, stack_services

    config = StackConfig(root=tmp_path, slurm_workers=text)
    with pytest.raises(ServiceError, match=said):
        stack_services(config)
    assert not (tmp_path / "pids").exists()


def test_det_job_list_shows_the_slurm_job_ids_of_each_experiments_workers(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A step's Dask key names its trial; the plugin notes the worker (job) that runs it,
    and the queue's HTTP route adds the Slurm job ids of each experiment's running trials."""
    import argparse
    import asyncio
    from types import SimpleNamespace

    import dask.config
    from distributed import Scheduler

    from cluster import job_requests
    from cluster.environment import SCHEDULER_ENV
    from cluster.job_queue import JOB_QUEUE_NAME
    from cluster.queue_http import ROUTES_SETTING, route_modules
    from cluster.slurm_workers import SLURM_WORKERS_NAME, SlurmWorkers, trial_of_step_key
    from cluster.steps import step_key_prefix
    from det_cli.job_verbs import cmd_job_list

    key = "aaaa1111bbbb"
    step = f"{step_key_prefix(key, 3)}train-30-0123abcd"
    assert trial_of_step_key(step) == ("aaaa1111", 3)
    assert trial_of_step_key("finalize-0123") is None and trial_of_step_key(("x", 1)) is None
    plugin = SlurmWorkers(SlurmWorkerSettings())
    on = SimpleNamespace(processing_on=SimpleNamespace(name="det-worker-9-2"))
    plugin.scheduler = SimpleNamespace(tasks={step: on})  # type: ignore[assignment]
    plugin.jobs = {
        "det-worker-9-1": (SimpleNamespace(job_id=41), "{}"),
        "det-worker-9-2": (SimpleNamespace(job_id=42), "{}"),
    }
    plugin.transition(step, "waiting", "processing")
    plugin.transition(f"{step_key_prefix(key, 4)}train-30-x", "processing", "memory")  # not run
    assert plugin.job_ids(key, [3, 4]) == ["42"]

    def calls(scheduler: Scheduler) -> None:
        scheduler.plugins[SLURM_WORKERS_NAME] = plugin
        assert job_requests.list_jobs("tcp://127.0.0.1:1") == []  # installs the queue
        job = {"name": "hpc-search", "user": "ana", "max_trials": 2, "client": "c1"}
        scheduler.plugins[JOB_QUEUE_NAME].sync(key, job, waiting=[], running=[3])
        (row,) = job_requests.list_jobs("tcp://127.0.0.1:1")
        assert row["slurm_jobs"] == ["42"]
        cmd_job_list(argparse.Namespace())

    async def serve() -> None:
        with dask.config.set({ROUTES_SETTING: route_modules()}):
            async with Scheduler(port=0, dashboard_address="127.0.0.1:0") as scheduler:
                http = f"http://127.0.0.1:{scheduler.http_server.port}"
                monkeypatch.setenv(job_requests.HTTP_ENV, http)
                monkeypatch.setenv(SCHEDULER_ENV, "tcp://127.0.0.1:1")
                await asyncio.to_thread(calls, scheduler)

    asyncio.run(serve())
    header, _, row = capsys.readouterr().out.splitlines()
    assert header.endswith("user  slurm jobs"), header
    assert row.split()[1] == "aaaa1111" and row.endswith("  42"), row


def test_an_experiment_offers_the_queue_every_trial_where_workers_come_on_demand() -> None:
    """With no worker yet, a flow offered the queue one trial (one per worker, at least
    one), so Slurm was asked for one job whatever the search's max_concurrent_trials."""
    from types import SimpleNamespace

    from cluster.job_slots import workers_on_demand
    from cluster.slurm_workers import SLURM_WORKERS_NAME, SlurmWorkers

    plugins: dict[str, object] = {}
    scheduler = SimpleNamespace(plugins=plugins)
    client = SimpleNamespace(run_on_scheduler=lambda f, **kw: f(scheduler, **kw))
    assert workers_on_demand(client, "default") is False  # type: ignore[arg-type]
    plugins[SLURM_WORKERS_NAME] = SlurmWorkers(SlurmWorkerSettings(pool="hpc"))
    assert workers_on_demand(client, "hpc") is True  # type: ignore[arg-type]
    assert workers_on_demand(client, "default") is False  # type: ignore[arg-type]
