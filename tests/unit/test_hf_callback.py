"""``determined.transformers.DetCallback`` (det_tasks.transformers) against a fake Core API
context and the Trainer's real state objects: what it reports, stores, restores and asks
the Trainer to do."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import Any

import pytest

transformers = pytest.importorskip("transformers", reason="the transformers extra is not installed")

from det_tasks.cluster_info import ClusterInfo, TrialInfo, launched  # noqa: E402
from det_tasks.errors import ConfigError  # noqa: E402
from det_tasks.transformers import DetCallback, get_metric_type  # noqa: E402


class _Op:
    def __init__(self, length: int | None) -> None:
        self.length = length
        self.progress: list[float] = []
        self.completed: list[Any] = []

    def report_progress(self, value: float) -> None:
        self.progress.append(value)

    def report_completed(self, value: Any) -> None:
        self.completed.append(value)


class _Context:
    """The parts of core.Context the callback uses, recording every call."""

    def __init__(self, length: int | None = 12, stop: bool = False) -> None:
        self.op = _Op(length)
        self.stop = stop
        self.training: list[tuple[int, dict[str, Any]]] = []
        self.validation: list[tuple[int, dict[str, Any]]] = []
        self.uploads: list[tuple[list[str], dict[str, Any]]] = []
        self.downloads: list[tuple[str, str]] = []
        self.train = self.checkpoint = self.preempt = self.searcher = self

    def report_training_metrics(self, steps_completed: int, metrics: dict[str, Any]) -> None:
        self.training.append((steps_completed, dict(metrics)))

    def report_validation_metrics(self, steps_completed: int, metrics: dict[str, Any]) -> None:
        self.validation.append((steps_completed, dict(metrics)))

    def operations(self) -> Any:
        if self.op.length is None:  # as core's searcher without a length
            raise ConfigError("searcher.operations() needs a length")
        return iter([self.op])

    def should_preempt(self) -> bool:
        return self.stop

    def upload(self, ckpt_dir: str, metadata: dict[str, Any], shard: bool, selector: Any) -> str:
        root = Path(ckpt_dir)
        files = sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())
        self.uploads.append(([f for f in files if selector(f)], metadata))
        return "storage-id"

    def download(self, storage_id: str, ckpt_dir: str) -> None:
        self.downloads.append((storage_id, ckpt_dir))
        (Path(ckpt_dir) / "checkpoint-8").mkdir(parents=True)
        (Path(ckpt_dir) / "checkpoint-8" / "trainer_state.json").write_text("{}")


def _info(
    tmp_path: Path, max_length: dict[str, int] | None, latest: str | None = None
) -> ClusterInfo:
    searcher: dict[str, Any] = {"name": "single", "metric": "eval_loss"}
    if max_length is not None:
        searcher["max_length"] = max_length
    return ClusterInfo(
        trial=TrialInfo(7, 3, {}, {"searcher": searcher}, 0),
        latest_checkpoint=latest,
        checkpoint_dir=str(tmp_path / "unused"),
    )


def _args(tmp_path: Path, **more: Any) -> Any:
    return transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), use_cpu=True, report_to=[], **more
    )


def _state(step: int, epoch: float = 1.0) -> Any:
    state = transformers.TrainerState()
    state.global_step, state.epoch = step, epoch
    return state


def _callback(tmp_path: Path, context: _Context, **kwargs: Any) -> tuple[DetCallback, Any]:
    args = _args(tmp_path, max_steps=12)
    with launched(_info(tmp_path, {"batches": 12})):
        return DetCallback(context, args, **kwargs), args


def test_metric_types_follow_the_first_key_as_determined():
    assert get_metric_type({"eval_loss": 1.0, "epoch": 1}) == "eval_"
    assert get_metric_type({"test_loss": 1.0}) == "test_"
    assert get_metric_type({"train_runtime": 1.0, "train_loss": 2.0}) == "train_"
    assert get_metric_type({"loss": 1.0, "learning_rate": 0.1}) == "train_progress"
    assert get_metric_type({}) == "train_progress"


def test_training_and_evaluation_logs_are_reported_once_per_step(tmp_path):
    context = _Context()
    callback, args = _callback(tmp_path, context)
    control = transformers.TrainerControl()
    callback.on_log(args, _state(4), control, logs={"loss": 2.5, "learning_rate": 0.1})
    callback.on_log(args, _state(4), control, logs={"eval_loss": 2.0, "epoch": 0.5})
    callback.on_log(args, _state(4), control, logs={"loss": 9.0})  # same step: not again
    callback.on_log(args, _state(12), control, logs={"train_runtime": 1.0, "train_loss": 2.2})
    assert context.training == [(4, {"loss": 2.5, "learning_rate": 0.1})]
    assert context.validation == [(4, {"eval_loss": 2.0, "epoch": 0.5})]
    assert not control.should_save


def test_filter_metrics_keeps_only_the_names_containing_one(tmp_path):
    context = _Context()
    callback, args = _callback(tmp_path, context, filter_metrics=["loss"])
    control = transformers.TrainerControl()
    callback.on_log(args, _state(1), control, logs={"loss": 2.5, "learning_rate": 0.1})
    assert context.training == [(1, {"loss": 2.5})]


def test_a_stop_request_makes_the_trainer_save_then_stop(tmp_path):
    context = _Context(stop=True)
    callback, args = _callback(tmp_path, context, user_data={"k": 1})
    control = transformers.TrainerControl()
    callback.on_log(args, _state(5), control, logs={"loss": 1.0})
    assert control.should_save and not control.should_training_stop
    out = Path(args.output_dir)
    for name in ("checkpoint-4/model.safetensors", "checkpoint-5/model.safetensors", "runs/ev"):
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text("x")
    callback.on_save(args, _state(5), control)
    files, metadata = context.uploads[0]
    assert files == ["checkpoint-5/model.safetensors", "checkpoint-5/my_data.json", "runs/ev"]
    assert metadata == {"steps_completed": 5, "trial_id": 7}
    assert control.should_training_stop


def test_without_a_stop_request_saving_does_not_stop_training(tmp_path):
    context = _Context()
    callback, args = _callback(tmp_path, context)
    (Path(args.output_dir) / "checkpoint-4").mkdir(parents=True)
    control = transformers.TrainerControl()
    callback.on_save(args, _state(4), control)
    assert len(context.uploads) == 1 and not control.should_training_stop


def test_the_searcher_operation_completes_with_its_metric_and_training_stops(tmp_path):
    context = _Context(length=12)
    callback, args = _callback(tmp_path, context)
    control = transformers.TrainerControl()
    callback.on_step_end(args, _state(11), control)
    assert context.op.progress == [11] and not context.op.completed
    callback.on_step_end(args, _state(12), control)  # the length, its metrics not in yet
    assert control.should_evaluate and control.should_log and control.should_save
    assert not context.op.completed
    callback.on_log(args, _state(12), control, logs={"loss": 1.5})
    assert not context.op.completed
    callback.on_log(args, _state(12), control, logs={"eval_loss": 1.25})
    assert context.op.completed == [1.25] and control.should_training_stop


def test_without_a_searcher_length_the_trainer_trains_its_own_and_a_stop_still_stops_it(
    tmp_path,
):
    context = _Context(length=None)  # Determined 0.38's form: time_metric/max_time, no length
    with launched(_info(tmp_path, None)):
        callback = DetCallback(context, _args(tmp_path, num_train_epochs=2))
    args, control = _args(tmp_path, max_steps=12), transformers.TrainerControl()
    callback.on_step_end(args, _state(12), control)
    callback.on_epoch_end(args, _state(12, epoch=2.0), control)
    assert not context.op.progress and not control.should_training_stop
    context.stop = True  # an ASHA rung's stop arrives as a stop request
    callback.on_log(args, _state(12), control, logs={"loss": 1.0})
    assert control.should_save


def test_a_trainer_length_other_than_the_searchers_is_refused_naming_both(tmp_path):
    with launched(_info(tmp_path, {"batches": 12})):
        with pytest.raises(ValueError, match=r"batches=10 must match .* batches=12"):
            DetCallback(_Context(), _args(tmp_path, max_steps=10))
        with pytest.raises(ValueError, match=r"epochs=3 must match .* batches=12"):
            DetCallback(_Context(), _args(tmp_path, num_train_epochs=3))
    with launched(_info(tmp_path, {"epochs": 2})):
        DetCallback(_Context(), _args(tmp_path, num_train_epochs=2))  # matches


def test_latest_checkpoint_is_downloaded_and_set_to_resume_from(tmp_path):
    context = _Context()
    args = _args(tmp_path, max_steps=12)
    with launched(_info(tmp_path, {"batches": 12}, latest="runs:/abc/checkpoints/u")):
        DetCallback(context, args)
    assert context.downloads == [("runs:/abc/checkpoints/u", args.output_dir)]
    assert args.resume_from_checkpoint == str(Path(args.output_dir) / "checkpoint-8")


def test_outside_a_launched_trial_the_callback_says_how_to_run_it(tmp_path):
    with pytest.raises(RuntimeError, match="det-tasks run"):
        DetCallback(_Context(), _args(tmp_path, max_steps=12))


def test_without_transformers_the_import_names_the_extra(monkeypatch):
    for name in [m for m in sys.modules if m.startswith("det_tasks.transformers")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(ImportError, match=r"pip install -e '\.\[transformers\]'"):
        importlib.import_module("det_tasks.transformers")
