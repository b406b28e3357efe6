"""Issue 52 (first slice): ``determined.core`` on the one services object. The counter
scripts of examples/core_api have closed-form answers: after ``n`` batches ``x`` is
``n * increment_by``, and a run stopped and continued ends where an uninterrupted one does."""

from __future__ import annotations

import importlib.util
import json
import runpy
import threading
from pathlib import Path
from typing import Any

import pytest

from det_tasks import compat, core, run_services
from det_tasks.checkpoints.store import LocalDirectoryStore
from det_tasks.cluster_info import ClusterInfo, TrialInfo, launched
from det_tasks.distributed import DistributedContext
from det_tasks.errors import ConfigError, InvalidHP
from det_tasks.sinks import InMemoryMetricsSink

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "core_api"


def _example(name: str) -> dict[str, Any]:
    compat.install()  # the scripts `import determined`
    return runpy.run_path(str(EXAMPLES / name), run_name="example")


def _info(tmp_path: Path, hparams: dict[str, Any], **more: Any) -> ClusterInfo:
    conf = {"searcher": {"name": "single", "metric": "x", "smaller_is_better": False}}
    conf["searcher"].update(more.pop("searcher", {}))
    return ClusterInfo(
        trial=TrialInfo(trial_id=7, experiment_id=3, hparams=hparams, config=conf, trial_seed=0),
        latest_checkpoint=more.pop("latest_checkpoint", None),
        checkpoint_dir=str(tmp_path / "unused"),
        **more,
    )


def _services(tmp_path: Path, info: ClusterInfo | None = None, **more: Any) -> Any:
    return run_services.RunServices(
        metrics_sink=InMemoryMetricsSink(),
        checkpoint_store=LocalDirectoryStore(tmp_path / "checkpoints"),
        cluster_info=info,
        searcher_length=info.searcher_length if info else None,
        **more,
    )


def test_metrics_reach_the_provided_sink_with_their_closed_form_values(tmp_path):
    services = _services(tmp_path, _info(tmp_path, {"increment_by": 3}))
    with run_services.provide(services), core.init() as core_context:
        assert core_context.info is services.cluster_info
        _example("1_metrics.py")["main"](core_context, 3, batches=50)
    sink = services.metrics_sink
    assert sink.training == [(n, {"x": 3 * n}) for n in (10, 20, 30, 40, 50)]
    assert sink.validation == [(50, {"x": 150})]
    assert services.control.steps_completed == 50


def test_stop_request_checkpoints_and_the_restored_run_continues_exactly(tmp_path):
    main = _example("2_checkpoints.py")["main"]
    hparams = {"increment_by": 2, "batches": 50}
    first = _services(tmp_path, _info(tmp_path, hparams))
    first.control.request_stop()  # a pause before the first boundary: stop at batch 10
    with run_services.provide(first), core.init() as core_context:
        main(core_context, None, 7, hparams)
    assert first.control.acknowledged and first.control.claimed
    (stored,) = first.metrics_sink.checkpoints
    assert (stored.steps_completed, first.metrics_sink.training) == (10, [(10, {"x": 20})])
    assert stored.metadata["trial_id"] == "7"

    info = _info(tmp_path, hparams, latest_checkpoint=stored.uuid)
    second = _services(tmp_path, info)
    with run_services.provide(second), core.init() as core_context:
        main(core_context, info.latest_checkpoint, 7, hparams)
    assert second.metrics_sink.training == [(n, {"x": 2 * n}) for n in (20, 30, 40, 50)]
    assert second.metrics_sink.validation == [(50, {"x": 100})]
    assert not second.control.acknowledged


def test_operations_yield_the_searchers_length_and_record_the_trials_position(tmp_path):
    positions: list[tuple[int, int | None, bool]] = []
    sink = InMemoryMetricsSink()
    sink.record_position = lambda *args: positions.append(args)  # type: ignore[attr-defined]
    info = _info(tmp_path, {"increment_by": 1}, searcher_length={"batches": 30})
    services = run_services.RunServices(
        metrics_sink=sink,
        checkpoint_store=LocalDirectoryStore(tmp_path / "c"),
        cluster_info=info,
        searcher_length=info.searcher_length,
    )
    with run_services.provide(services), core.init() as core_context:
        _example("3_hpsearch.py")["main"](core_context, None, 7, info.trial.hparams)
    assert [s for s, _ in sink.training] == [10, 20, 30]
    assert sink.validation == [(30, {"x": 30})]
    assert positions == [(10, 30, False), (20, 30, False), (30, 30, False), (30, 30, False)]


def test_operations_length_comes_from_the_config_unit_when_the_runner_gives_none(tmp_path):
    info = _info(tmp_path, {}, searcher={"max_length": {"epochs": 4}})
    with run_services.provide(_services(tmp_path, info)), core.init() as core_context:
        with pytest.warns(FutureWarning, match="deprecated in Determined 0.38"):
            (op,) = list(_completing(core_context.searcher.operations()))
        assert op.length == 4
        assert core_context.searcher.get_configured_units() == core.Unit.EPOCHS


def test_operations_without_any_length_on_the_platform_name_the_setting(tmp_path):
    services = _services(tmp_path, _info(tmp_path, {}))
    refused = pytest.raises(ConfigError, match=r"searcher\.max_length in the experiment")
    with run_services.provide(services), core.init() as ctx, refused:
        ctx.searcher.operations()


def _completing(ops: Any) -> Any:
    for op in ops:
        op.report_completed(0)
        yield op


def test_off_the_platform_it_is_determineds_dummy_init(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    caplog.set_level("INFO", logger="determined.core")
    with core.init() as core_context:
        assert core_context.info is None
        assert core_context.preempt.should_preempt() is False
        with pytest.warns(FutureWarning):
            (op,) = list(_completing(core_context.searcher.operations()))
        assert op.length == 1  # Determined's dummy searcher
        core_context.train.report_training_metrics(5, {"loss": 0.5})
        with core_context.checkpoint.store_path() as (path, storage_id):
            (path / "weights").write_text("w")
        assert core_context.checkpoint.get_metadata(storage_id)["steps_completed"] == 5
    folder = tmp_path / "data" / "determined" / storage_id
    assert (folder / "weights").read_text() == "w" and (folder / "metadata.json").is_file()
    assert "report_training_metrics(steps_completed=5" in caplog.text


def test_checkpoint_round_trip_upload_download_metadata_and_delete(tmp_path):
    source = tmp_path / "src"
    (source / "sub").mkdir(parents=True)
    (source / "a.bin").write_bytes(b"abc")
    (source / "sub" / "b.txt").write_text("b")
    with core.init(checkpoint_storage=str(tmp_path / "store")) as core_context:
        checkpoint = core_context.checkpoint
        storage_id = checkpoint.upload(source, {"steps_completed": 3, "note": "hi"})
        assert checkpoint.get_metadata(storage_id)["note"] == "hi"
        checkpoint.download(storage_id, tmp_path / "out", selector=lambda p: p.endswith(".txt"))
        assert sorted(p.name for p in (tmp_path / "out").rglob("*") if p.is_file()) == ["b.txt"]
        with checkpoint.restore_path(storage_id) as path:
            assert (path / "a.bin").read_bytes() == b"abc"
        (tmp_path / "store" / storage_id / "a.bin").write_bytes(b"abd")
        with pytest.raises(Exception, match="corrupted"), checkpoint.restore_path(storage_id):
            pass
        checkpoint.delete(storage_id)
        assert not (tmp_path / "store" / storage_id).exists()


def test_what_is_not_built_is_refused_in_one_line(tmp_path):
    with core.init(checkpoint_storage=str(tmp_path)) as core_context:
        checkpoint = core_context.checkpoint
        across_nodes = core.CheckpointContext(
            LocalDirectoryStore(tmp_path), InMemoryMetricsSink(),
            core.DistributedContext(cross_size=2), run_services.TrialControl(), lambda _: {}, False,
        )  # fmt: skip
        with pytest.raises(NotImplementedError, match=r"shard=True\) across several nodes"):
            across_nodes.store_path({"steps_completed": 1}, shard=True).__enter__()
        with pytest.raises(NotImplementedError, match="globs"):
            checkpoint.delete("x", globs=["*.pt"])
        with pytest.raises(RuntimeError, match="only be used in MANUAL mode"):
            core_context.train.upload_tensorboard_files()
    with pytest.raises(ConfigError, match="cloud URIs are not supported"):
        core.init(checkpoint_storage="s3://bucket/prefix")
    with pytest.raises(ConfigError, match=r"type 's3' needs the registry's store.*leave it out"):
        core.init(checkpoint_storage={"type": "s3", "bucket": "bucket"})
    folder = tmp_path / "fs"
    ctx = core.init(checkpoint_storage={"type": "shared_fs", "host_path": str(folder)})
    with ctx, ctx.checkpoint.store_path({"steps_completed": 1}) as (_, storage_id):
        pass
    assert (folder / storage_id / "metadata.json").is_file()


def test_on_the_platform_a_checkpoint_needs_steps_completed(tmp_path):
    services = _services(tmp_path, _info(tmp_path, {}))
    refused = pytest.raises(ValueError, match="needs 'steps_completed'")
    with run_services.provide(services), core.init() as ctx, refused:
        ctx.checkpoint.store_path({}).__enter__()


def test_checkpoint_metadata_carries_the_validation_of_its_step(tmp_path):
    services = _services(tmp_path, _info(tmp_path, {}))
    with run_services.provide(services), core.init() as ctx:
        ctx.train.report_validation_metrics(4, {"x": 1.5})
        with ctx.checkpoint.store_path({"steps_completed": 4}):
            pass
        with ctx.checkpoint.store_path({"steps_completed": 5}):
            pass
    first, second = services.metrics_sink.checkpoints
    assert first.metadata["validation_metrics"] == {"x": 1.5}
    assert second.metadata["validation_metrics"] is None


def test_preempt_modes_auto_ack_and_start(tmp_path):
    control = run_services.TrialControl()
    preempt = core.PreemptContext(control, core.DummyDistributedContext())
    with pytest.raises(RuntimeError, match=r"before PreemptContext\.start"):
        preempt.should_preempt()
    preempt.start()
    assert control.claimed and not preempt.should_preempt()
    control.set_stop_requested(True)  # what runner.stop_signals does on SIGTERM
    assert preempt.should_preempt(auto_ack=False) and not control.acknowledged
    assert preempt.should_preempt() and control.acknowledged
    chief_only = core.PreemptContext(
        control, core.DummyDistributedContext(), core.PreemptMode.ChiefOnly
    )
    assert chief_only.start().should_preempt() is True


def test_claiming_the_control_tells_the_runner_once():
    claims: list[Any] = []
    control = run_services.TrialControl(on_claim=claims.append)
    control.claim()
    control.claim()
    assert claims == [control]


def test_invalid_hp_in_the_block_is_an_early_exit_with_code_zero(tmp_path):
    services = _services(tmp_path, _info(tmp_path, {}))
    with pytest.raises(SystemExit) as exited, run_services.provide(services), core.init():
        raise InvalidHP("bad lr")
    assert exited.value.code == 0
    assert services.control.early_exit == core.EarlyExitReason.INVALID_HP.value


def test_report_checks_name_the_argument(tmp_path):
    with core.init(checkpoint_storage=str(tmp_path)) as ctx:
        with pytest.raises(TypeError, match="steps_completed must be an int"):
            ctx.train.report_training_metrics(1.5, {"x": 1})
        with pytest.raises(TypeError, match="metrics must be a dict"):
            ctx.train.report_validation_metrics(1, [1])
        with pytest.raises(RuntimeError, match="'x' has no value"):
            ctx.train.report_validation_metrics(1, {"x": None})
        with pytest.raises(ValueError, match="fraction from 0 to 1"):
            ctx.train.report_progress(2)


def test_experiment_best_follows_the_searcher_metric(tmp_path):
    conf = {"searcher": {"metric": "loss", "smaller_is_better": True}}
    info = _info(tmp_path, {})
    info = ClusterInfo(**{**info.__dict__, "trial": TrialInfo(7, 3, {}, conf, 0)})
    with run_services.provide(_services(tmp_path, info)), core.init() as ctx:
        assert ctx.train.get_experiment_best_validation() is None
        for steps, loss in ((1, 0.5), (2, 0.7), (3, 0.2)):
            ctx.train.report_validation_metrics(steps, {"loss": loss})
        assert ctx.train.get_experiment_best_validation() == 0.2


def test_cluster_info_in_the_environment_reaches_core_init_without_services(tmp_path):
    info = _info(tmp_path, {"increment_by": 1})
    with launched(info), core.init() as core_context:
        assert core_context.info.trial.trial_id == 7
        with core_context.checkpoint.store_path({"steps_completed": 1}) as (_, storage_id):
            pass
    assert (tmp_path / "unused" / storage_id / "metadata.json").is_file()


def test_determined_core_alias_serves_the_core_api_and_names_what_it_does_not():
    compat.install()
    import determined as det

    assert det.core.init is core.init and det.core.PreemptMode is core.PreemptMode
    from determined.core import DistributedContext, SearcherOperation  # noqa: F401

    with pytest.raises(AttributeError, match=r"ProfilerContext.*not supported"):
        det.core.ProfilerContext  # noqa: B018
    with pytest.raises(AttributeError, match=r"determined\.core\.Nope is not provided.*init"):
        det.core.Nope  # noqa: B018


def test_the_experiments_best_passed_on_by_a_search_is_the_starting_best(tmp_path):
    info = ClusterInfo.from_json(_info(tmp_path, {}, experiment_best=7.0).to_json())
    assert info.experiment_best == 7.0  # travels in the cluster info file
    with run_services.provide(_services(tmp_path, info)), core.init() as ctx:
        assert ctx.train.get_experiment_best_validation() == 7.0
        ctx.train.report_validation_metrics(10, {"x": 5.0})  # smaller_is_better: false
        assert ctx.train.get_experiment_best_validation() == 7.0
        ctx.train.report_validation_metrics(20, {"x": 9.0})
        assert ctx.train.get_experiment_best_validation() == 9.0


def test_auto_tensorboard_mode_writes_determineds_tags_into_the_platforms_folder(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = tmp_path / "tb"
    services = _services(tmp_path, _info(tmp_path, {}), tensorboard_dir=str(tb))
    with run_services.provide(services), core.init() as ctx:
        assert ctx.train.get_tensorboard_path() == tb
        ctx.train.report_training_metrics(4, {"loss": 0.5}, batch_metrics=[{"loss": 1.0}] * 2)
        ctx.train.report_training_metrics(8, {"loss": 0.25, "lr": 0.1})
        ctx.train.report_validation_metrics(8, {"x": 3, "val_acc": 0.9})
    events = EventAccumulator(str(tb))
    events.Reload()
    scalars = {t: [(e.step, e.value) for e in events.Scalars(t)] for t in events.Tags()["scalars"]}
    assert scalars == {
        "Determined/loss": [(2, 1.0), (3, 1.0), (8, 0.25)],
        "Determined/lr": [(8, pytest.approx(0.1))],
        "Determined/val_x": [(8, 3.0)],
        "Determined/val_acc": [(8, pytest.approx(0.9))],
    }
    manual = _services(tmp_path, _info(tmp_path, {}), tensorboard_dir=str(tmp_path / "tb2"))
    with run_services.provide(manual), core.init(tensorboard_mode=core.TensorboardMode.MANUAL) as c:
        c.train.report_training_metrics(1, {"loss": 1.0})
        c.train.upload_tensorboard_files()
    assert not (tmp_path / "tb2").exists()  # MANUAL: the script writes its own files


@pytest.mark.parametrize(
    ("statement", "says"),
    [
        ("from determined.core import ProfilerContext", "profiler is not supported"),
        ("from determined.core import DummyTrainContext", "use core.init"),
    ],
)
def test_core_names_not_built_are_refused_naming_what_to_use(statement, says):
    compat.install()
    with pytest.raises(ImportError, match=says):
        exec(statement)


class _ThreadRanks:
    """Collectives for ranks that are threads of this process (a barrier and shared slots)."""

    def __init__(self, size: int) -> None:
        self.barrier = threading.Barrier(size)
        self.slots: list[Any] = [None] * size

    def member(self, rank: int) -> Any:
        ranks = self

        class Member:
            def allgather(self, obj: Any) -> list[Any]:
                ranks.slots[rank] = obj
                ranks.barrier.wait()
                out = list(ranks.slots)
                ranks.barrier.wait()
                return out

            def broadcast(self, obj: Any) -> Any:
                return self.allgather(obj)[0]

            def close(self, wait_for_others: bool = True) -> None:
                """Nothing to leave."""

        return Member()


def test_workers_of_a_node_share_the_local_chiefs_restore_and_download(tmp_path):
    stored = LocalDirectoryStore(tmp_path / "chief")
    ctx = core.init(checkpoint_storage=str(tmp_path / "chief"))
    with ctx, ctx.checkpoint.store_path({"steps_completed": 1}) as (path, storage_id):
        (path / "w").write_text("weights")
    ranks, seen = _ThreadRanks(2), {}

    def rank(r: int) -> None:
        dist = core.DistributedContext(
            rank=r, size=2, local_rank=r, local_size=2, collectives=ranks.member(r)
        )
        store = stored if r == 0 else LocalDirectoryStore(tmp_path / f"rank{r}")  # empty
        checkpoint = core.CheckpointContext(
            store, InMemoryMetricsSink(), dist, run_services.TrialControl(), lambda _: {}, False
        )
        with checkpoint.restore_path(storage_id) as path:
            seen[r] = (path / "w").read_text()
        checkpoint.download(storage_id, tmp_path / "shared")

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert seen == {0: "weights", 1: "weights"}
    assert (tmp_path / "shared" / "w").read_text() == "weights"


def _two_ranks(tmp_path: Path, work: Any) -> dict[int, Any]:
    """``work(rank, checkpoint)`` on two thread ranks of one node; what each returned."""
    ranks, out = _ThreadRanks(2), {}
    store = LocalDirectoryStore(tmp_path / "store")

    def rank(r: int) -> None:
        dist = core.DistributedContext(
            rank=r, size=2, local_rank=r, local_size=2, collectives=ranks.member(r)
        )
        checkpoint = core.CheckpointContext(
            store, InMemoryMetricsSink(), dist, run_services.TrialControl(), lambda _: {}, False
        )
        try:
            out[r] = work(r, checkpoint)
        except Exception as err:
            out[r] = err

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    return out


def test_a_sharded_checkpoint_is_every_workers_files_and_metadata_in_one(tmp_path):
    def work(rank: int, checkpoint: Any) -> str:
        metadata = {"steps_completed": 5} if rank == 0 else {"rank1_rows": 7}
        with checkpoint.store_path(metadata, shard=True) as (path, storage_id):
            (path / f"part-{rank}").write_text(str(rank))
        return storage_id

    out = _two_ranks(tmp_path, work)
    assert out[0] == out[1]  # one storage id for both
    folder = tmp_path / "store" / out[0]
    assert {p.name for p in folder.iterdir()} == {"part-0", "part-1", "metadata.json"}
    metadata = json.loads((folder / "metadata.json").read_text())
    assert (metadata["steps_completed"], metadata["rank1_rows"]) == (5, 7)


def test_two_shards_writing_one_file_is_refused_naming_the_ranks(tmp_path):
    def work(rank: int, checkpoint: Any) -> None:
        with checkpoint.store_path({"steps_completed": 1}, shard=True) as (path, _):
            (path / "weights").write_text(str(rank))

    out = _two_ranks(tmp_path, work)
    assert isinstance(out[0], ValueError) and "ranks 0 and 1 both wrote 'weights'" in str(out[0])
    assert list((tmp_path / "store").iterdir()) == []  # nothing published


def test_determineds_distributed_constructors_and_cluster_info_fields(tmp_path, monkeypatch):
    assert issubclass(core.DistributedContext, DistributedContext)  # one class underneath
    if importlib.util.find_spec("deepspeed") is None:
        with pytest.raises(ImportError, match=r"needs DeepSpeed.*from_torch_distributed"):
            core.DistributedContext.from_deepspeed()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    monkeypatch.setenv("GROUP_RANK", "1")
    info = _info(tmp_path, {})
    assert (info.task_type, info.container_rank, info.slot_ids) == ("TRIAL", 1, [2, 3])
    assert info.task_id == "3.7"
