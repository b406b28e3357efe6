"""``determined.experimental.core_v2`` (det_tasks.core_v2): the config Determined's
unmanaged mode takes, the singleton's globals, the run's end (complete, or the exception
handed to the platform's services) and what is refused; with a fake platform factory."""

from __future__ import annotations

import contextlib
import re
from pathlib import Path
from typing import Any

import pytest

from det_tasks import compat, core, core_v2, plugins
from det_tasks.checkpoints.store import LocalDirectoryStore
from det_tasks.cluster_info import ClusterInfo, TrialInfo, launched
from det_tasks.core_v2 import _config
from det_tasks.errors import ConfigError
from det_tasks.run_services import RunServices


class _PositionSink:
    """An in-memory sink that also keeps the position the run ends at."""

    def __init__(self) -> None:
        self.training: list[tuple[int, dict[str, Any]]] = []
        self.validation: list[tuple[int, dict[str, Any]]] = []
        self.checkpoints: list[tuple[int, str]] = []
        self.position: tuple[int, int | None, bool] | None = None

    def report_training(self, steps: int, metrics: dict[str, Any]) -> None:
        self.training.append((steps, dict(metrics)))

    def report_validation(self, steps: int, metrics: dict[str, Any]) -> None:
        self.validation.append((steps, dict(metrics)))

    def report_checkpoint(self, steps: int, uuid: str, metadata: dict[str, Any]) -> None:
        self.checkpoints.append((steps, uuid))

    def record_position(self, trained: int, length: int | None, stop_requested: bool) -> None:
        self.position = (trained, length, stop_requested)

    def close(self) -> None:
        """Nothing is buffered."""


@pytest.fixture
def platform(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """A fake ``det_tasks.unmanaged_runs`` factory recording what it was given and how its
    run ended."""
    seen: dict[str, Any] = {"sink": _PositionSink()}

    @contextlib.contextmanager
    def factory(raw: dict[str, Any], hparams: dict[str, Any], **kwargs: Any) -> Any:
        seen.update(raw=raw, hparams=hparams, **kwargs)
        info = ClusterInfo(
            trial=TrialInfo(
                trial_id=1, experiment_id="k", hparams=hparams, config=raw, trial_seed=0
            ),
            latest_checkpoint=None,
            checkpoint_dir=str(tmp_path / "unused"),
        )
        try:
            yield RunServices(
                metrics_sink=seen["sink"],
                checkpoint_store=LocalDirectoryStore(tmp_path / "checkpoints"),
                cluster_info=info,
                run_url="http://mlflow/#/experiments/1/runs/abc",
            )
            seen["ended"] = "complete"
        except BaseException as err:
            seen["ended"] = err
            raise

    real = plugins.load_one
    monkeypatch.setattr(
        plugins,
        "load_one",
        lambda group, name: factory if group == "det_tasks.unmanaged_runs" else real(group, name),
    )
    monkeypatch.setattr(core_v2, "_install_exit_hooks", lambda: None)  # no atexit in tests
    yield seen
    core_v2.close()


def test_init_reports_through_the_module_globals_and_close_ends_the_run_complete(platform):
    config = core_v2.Config(name="counter", hparams={"increment_by": 3})
    core_v2.init(config=config)
    assert platform["raw"]["name"] == "counter" and platform["hparams"] == {"increment_by": 3}
    assert platform["script"] is None or isinstance(platform["script"], Path)
    assert core_v2.info is not None and core_v2.info.trial.hparams == {"increment_by": 3}
    for steps in (10, 20, 30):
        core_v2.train.report_training_metrics(steps_completed=steps, metrics={"x": 3 * steps})
    with core_v2.checkpoint.store_path({"steps_completed": 30}) as (path, storage_id):
        (path / "state").write_text("90")
    assert core_v2.preempt.should_preempt() is False  # unmanaged: never preempted
    assert core_v2.url_reverse_webui_exp_view().endswith("/runs/abc")
    core_v2.close()
    sink = platform["sink"]
    assert sink.training == [(10, {"x": 30}), (20, {"x": 60}), (30, {"x": 90})]
    assert sink.checkpoints == [(30, storage_id)]
    assert platform["ended"] == "complete" and sink.position == (30, 30, False)
    assert core_v2.train is None and core_v2.checkpoint is None and core_v2.info is None
    core_v2.close()  # a second close is a no-op


def test_an_exception_in_the_block_reaches_the_platform_and_the_run_is_not_complete(platform):
    opened = core_v2.init_context(config=core_v2.Config(name="fails"))
    with pytest.raises(RuntimeError, match="boom"), opened as context:
        context.train.report_training_metrics(5, {"x": 5})
        raise RuntimeError("boom")
    assert isinstance(platform["ended"], RuntimeError)
    assert platform["sink"].position is None  # never recorded complete


def test_an_uncaught_exception_remembered_by_the_hook_ends_the_singleton_run_error(platform):
    core_v2.init(config=core_v2.Config(name="uncaught"))
    error = ValueError("uncaught")
    core_v2._uncaught = (ValueError, error, None)
    try:
        core_v2.close()
    finally:
        core_v2._uncaught = None
    assert platform["ended"] is error


def test_external_ids_reach_the_platform(platform):
    config = core_v2.Config(external_experiment_id="exp-a", external_trial_id="t-1")
    core_v2.init(config=config)
    assert (platform["external_experiment_id"], platform["external_trial_id"]) == ("exp-a", "t-1")


def test_the_default_config_is_determineds():
    raw = _config.raw_config(core_v2.Config())
    assert re.fullmatch(r"unmanaged-[0-9a-f]{8}", raw["name"])
    assert raw["searcher"] == {"name": "single", "metric": "unmanaged", "max_length": 100000000}
    full = core_v2.Config(
        name="n", description="d", labels=["a"], data={"k": 1}, workspace="w", project="p"
    )
    raw = _config.raw_config(full)
    assert (raw["description"], raw["labels"], raw["data"]) == ("d", ["a"], {"k": 1})
    assert (raw["workspace"], raw["project"]) == ("w", "p")


def test_deprecated_defaults_and_unmanaged_merge_with_a_warning():
    with pytest.warns(FutureWarning):
        defaults = core_v2.DefaultConfig(name="n")
    with pytest.warns(FutureWarning):
        unmanaged = core_v2.UnmanagedConfig(project="p", external_trial_id="t")
    with pytest.warns(FutureWarning, match="deprecated"):
        merged = _config.merge_config(None, defaults, unmanaged)
    assert (merged.name, merged.project, merged.external_trial_id) == ("n", "p", "t")
    given = core_v2.Config(name="given")
    assert _config.merge_config(given, None, None) is given


def test_no_config_off_the_platform_is_refused_naming_config():
    with pytest.raises(ValueError, match=r"specify `defaults` or `config`"):
        core_v2.init_context()


def test_client_and_checkpoint_storage_are_refused_saying_what_to_do(platform):
    with pytest.raises(NotImplementedError, match=r"client=.*MLFLOW_TRACKING_URI"):
        core_v2.init_context(config=core_v2.Config(), client=object())
    with pytest.raises(ConfigError, match=r"checkpoint_storage.*S3 store"):
        core_v2.init_context(config=core_v2.Config(checkpoint_storage="/tmp/x"))
    with pytest.raises(ConfigError, match=r"checkpoint_storage.*S3 store"):
        core_v2.init_context(config=core_v2.Config(), checkpoint_storage="/tmp/x")
    assert "raw" not in platform  # refused before any run was made


def test_in_a_launched_trial_the_trials_context_is_used_and_the_config_ignored(tmp_path):
    info = ClusterInfo(
        trial=TrialInfo(trial_id=4, experiment_id=2, hparams={"a": 1}, config={}, trial_seed=0),
        latest_checkpoint=None,
        checkpoint_dir=str(tmp_path),
    )
    with launched(info):
        context = core_v2.init_context(config=core_v2.Config(name="ignored"))
    assert type(context) is core.Context and context.info is not None
    assert context.info.trial.trial_id == 4


def test_without_the_platform_env_the_registry_factory_says_what_to_set(monkeypatch):
    pytest.importorskip("mlflow")
    from registry.jobs.unmanaged_runs import unmanaged_services

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    opened = unmanaged_services({"name": "n"}, {}, script=None)
    with pytest.raises(ConfigError, match="set MLFLOW_TRACKING_URI"), opened:
        pass


def test_the_determined_alias_serves_core_v2_itself():
    compat.install()
    from determined.experimental import core_v2 as aliased

    assert aliased is core_v2
    import determined.experimental

    with pytest.raises(AttributeError, match="client is not supported"):
        determined.experimental.Determined  # noqa: B018
