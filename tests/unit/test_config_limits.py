"""Inputs a user sweep found escaping validation (issue 40): each is refused before any
training, in one line that names the file or field, the value or limit, and the fix."""

from __future__ import annotations

import os
import textwrap
import time
from pathlib import Path

import pytest

from det_tasks.config import parse_config
from det_tasks.config.grid import MAX_GRID_TRIALS
from det_tasks.config.loader import MAX_EXPANDED_NODES, parse_yaml_text
from det_tasks.config.storage_paths import check_checkpoint_storage
from det_tasks.errors import ConfigError
from det_tasks.runner.cli import main
from det_tasks.searchers.choose import make_searcher

TRIAL = textwrap.dedent(
    """
    from det_tasks.pytorch import PyTorchTrial

    class T(PyTorchTrial):
        def __init__(self, context): pass
        def train_batch(self, batch, epoch_idx, batch_idx): return {}
        def evaluate_batch(self, batch): return {}
        def build_training_data_loader(self): pass
        def build_validation_data_loader(self): pass
    """
)
HEAD = """\
entrypoint: model_def:T
searcher: {name: single, metric: loss, max_length: {batches: 1}}
"""


def base(**fields: object) -> dict[str, object]:
    raw: dict[str, object] = {
        "entrypoint": "model_def:T",
        "hyperparameters": {"global_batch_size": 1},
        "searcher": {"name": "single", "metric": "loss", "max_length": {"batches": 1}},
    }
    raw.update(fields)
    return raw


def refused(raw: dict[str, object]) -> str:
    with pytest.raises(ConfigError) as caught:
        parse_config(raw, source="c.yaml")
    message = str(caught.value)
    assert "\n" not in message and message.startswith("c.yaml: "), message
    return message


def alias_bomb(section: str, depth: int = 10, width: int = 9) -> str:
    """``width`` aliases per level, ``depth`` levels: width**depth values from ~1 KB."""
    lines = [f"  a0: &a0 [{', '.join(['1'] * width)}]"]
    lines += [f"  a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * width)}]" for i in range(1, depth)]
    return f"{section}:\n" + "\n".join(lines) + "\n"


@pytest.mark.parametrize("section", ["data", "hyperparameters"])
def test_alias_bomb_is_refused_in_under_a_second(tmp_path, capsys, section):
    text = HEAD + alias_bomb(section)
    if section == "data":
        text += "hyperparameters: {global_batch_size: 1}\n"
    assert len(text) < 1100 and text.count("*") == 81  # under the alias cap (100)
    (tmp_path / "model_def.py").write_text(TRIAL)
    path = tmp_path / "bomb.yaml"
    path.write_text(text)
    started = time.perf_counter()
    code = main(["check-config", str(path), str(tmp_path)])
    took = time.perf_counter() - started
    err = capsys.readouterr().err
    assert code == 1 and took < 1.0, (code, took)
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert str(path) in err and f"{MAX_EXPANDED_NODES:,}" in err
    assert "write the values out" in err


def test_shared_values_count_each_time_they_are_used_and_small_ones_pass():
    x = "x: &x [" + ", ".join(["1"] * 999) + "]\n"  # 1,000 values with the list itself
    text = x + "y: [" + ", ".join(["*x"] * 99) + "]\n"  # 99,001 more: fine
    assert parse_yaml_text(text, "ok.yaml")["y"][98][998] == 1
    y = "y: &y [" + ", ".join(["*x"] * 40) + "]\n"  # 40,001
    z = "z: [" + ", ".join(["*y"] * 30) + "]\n"  # 1,200,031: 70 aliases, 17 KB
    with pytest.raises(ConfigError, match=r"big\.yaml: .* expand to more than 1,000,000 values"):
        parse_yaml_text(x + y + z, "big.yaml")


def test_an_alias_inside_its_own_anchor_is_refused():
    with pytest.raises(ConfigError, match=r"cycle"):
        parse_yaml_text("a: &a [1, *a]\n", "loop.yaml")


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("n" * 501, "501 characters; MLflow refuses experiment names over 500"),
        ("ü" * 600, "600 characters; MLflow refuses"),
        ("bad\x00name", "control character '\\x00'"),
        ("tab\tname", "control character '\\t'"),
        ("line\nbreak", "control character '\\n'"),
        ("   ", "it is empty"),
    ],
)
def test_experiment_names_mlflow_or_the_file_system_refuse(name, expected):
    message = refused(base(name=name))
    assert "`name` = " in message and expected in message, message


@pytest.mark.parametrize("name", ["mnist-const", "team/mnist v2: lr 0.1", "ü" * 500, "n" * 500])
def test_names_within_the_limits_pass(name):
    assert parse_config(base(name=name)).name == name


@pytest.mark.parametrize(
    ("hparams", "expected"),
    [
        ({"lr 🙂": 0.1}, "`hyperparameters.lr 🙂`: MLflow refuses param key 'hp.lr 🙂' ('🙂'"),
        ({"opt": {"lr@2": 0.1}}, "'hp.opt.lr@2' ('@' is not allowed)"),
        ({"a//b": 1}, "as a path it would read 'hp.a/b'"),
        ({"x" * 248: 1}, "(251 characters, over its 250)"),
        ({"c": {"type": "categorical", "vals": [{"ok": 1}, {"b!": 2}]}}, "'hp.c.b!'"),
        ({"k": {"type": "const", "val": {"€uro": 1}}}, "'hp.k.€uro' ('€'"),
    ],
)
def test_hyperparameter_names_mlflow_refuses_as_param_keys(hparams, expected):
    message = refused(base(hyperparameters={"global_batch_size": 1, **hparams}))
    assert expected in message, message


def test_hyperparameter_names_mlflow_takes_pass():
    space = {"global_batch_size": 1, "opt": {"lr-max/β 1:2": 0.1}, "x" * 247: 1}
    config = parse_config(base(hyperparameters=space))
    assert "lr-max/β 1:2" in config.hyperparameters["opt"]


def test_log_base_one_is_refused_and_below_one_is_determineds_log_uniform():
    log = {"type": "log", "minval": -3, "maxval": -1}
    message = refused(base(hyperparameters={"global_batch_size": 1, "lr": {**log, "base": 1}}))
    assert "`hyperparameters.lr`: base 1 makes every value 1.0" in message
    assert "use base 10" in message
    assert "finite" in refused(
        base(hyperparameters={"global_batch_size": 1, "lr": {**log, "base": float("inf")}})
    )
    # Determined's schema takes any base > 0; 0.5 ** [-3, -1] spans 2..8.
    config = parse_config(
        base(hyperparameters={"global_batch_size": 1, "lr": {**log, "base": 0.5}})
    )
    assert config.hyperparameters["lr"].base == 0.5


def grid(count: int, max_trials: int | None = None) -> dict[str, object]:
    searcher = {"name": "grid", "metric": "loss", "max_length": {"batches": 1}}
    if max_trials is not None:
        searcher["max_trials"] = max_trials
    space = {
        "global_batch_size": 1,
        "a": {"type": "int", "minval": 1, "maxval": 100, "count": 100},
        "b": {"type": "double", "minval": 0, "maxval": 1, "count": count},
    }
    return base(searcher=searcher, hyperparameters=space)


def test_grid_larger_than_the_limit_names_its_size_and_how_to_run_it():
    message = refused(grid(100))
    assert f"makes 10,000 trials, over the {MAX_GRID_TRIALS:,}" in message
    assert "`searcher.max_trials: 10000` to run them all" in message


def test_grid_within_the_limit_or_with_max_trials_runs():
    assert len(make_searcher(parse_config(grid(10))).start()) == 1000
    assert len(make_searcher(parse_config(grid(100, max_trials=10_000))).start()) == 10_000
    first = make_searcher(parse_config(grid(100, max_trials=3))).start()
    assert [w.hparams["b"] for w in first] == [0.0, 1 / 99, 2 / 99]


def test_one_huge_value_list_is_refused_without_being_made():
    started = time.perf_counter()
    message = refused(grid(10**9, max_trials=5))
    assert "`hyperparameters.b` has 1,000,000,000 grid values" in message
    assert time.perf_counter() - started < 1.0


def test_grid_without_count_is_refused_by_the_searcher_naming_the_value():
    raw = grid(1)
    del raw["hyperparameters"]["b"]["count"]  # type: ignore[index]
    with pytest.raises(ConfigError, match=r"`hyperparameters\.b`: grid search needs `count`"):
        make_searcher(parse_config(raw))


def storage_refused(storage: dict[str, object]) -> str:
    """The local store's check (``det-tasks run`` without MLflow, and check-config)."""
    with pytest.raises(ConfigError) as caught:
        check_checkpoint_storage(parse_config(base(checkpoint_storage=storage)), "c.yaml")
    message = str(caught.value)
    assert "\n" not in message and message.startswith("c.yaml: "), message
    return message


@pytest.mark.parametrize("host_path", ["/proc", "/proc/ckpt", "/sys/fs/ckpt"])
def test_checkpoint_folder_that_cannot_be_written_is_refused(host_path):
    message = storage_refused({"type": "shared_fs", "host_path": host_path})
    assert f"`checkpoint_storage.host_path` = '{host_path}' cannot hold checkpoints" in message
    assert "point it at a folder you can write" in message


def test_a_cluster_host_path_still_validates_for_the_platform():
    """On the platform checkpoints go to the artifact store: a Determined config naming its
    cluster's mount runs unchanged, so validation itself does not look at the folder."""
    parse_config(base(checkpoint_storage={"type": "shared_fs", "host_path": "/proc/ckpt"}))


def test_checkpoint_folder_under_a_file_is_refused(tmp_path):
    (tmp_path / "afile").write_text("")
    storage = {"type": "directory", "container_path": str(tmp_path / "afile" / "ckpt")}
    assert "is a file, not a folder" in storage_refused(storage)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_read_only_folder_is_refused(tmp_path):
    folder = tmp_path / "ro"
    folder.mkdir(mode=0o555)
    storage = {"type": "shared_fs", "host_path": str(folder), "storage_path": "ckpt"}
    assert "Permission denied" in storage_refused(storage)


def test_writable_folder_passes_and_nothing_stays_behind(tmp_path):
    storage = {"type": "shared_fs", "host_path": str(tmp_path / "new" / "ckpt")}
    check_checkpoint_storage(parse_config(base(checkpoint_storage=storage)), "c.yaml")
    assert list(tmp_path.iterdir()) == []


def test_check_config_refuses_before_loading_anything(tmp_path, capsys):
    path = Path(tmp_path / "c.yaml")
    path.write_text(HEAD + "hyperparameters: {global_batch_size: 1, 'lr 🙂': 0.1}\n")
    assert main(["check-config", str(path), str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "MLflow refuses param key 'hp.lr 🙂'" in err


def test_check_config_refuses_an_unwritable_host_path_where_run_would_use_it(
    tmp_path, capsys, monkeypatch
):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    path = Path(tmp_path / "c.yaml")
    path.write_text(
        HEAD
        + "hyperparameters: {global_batch_size: 1}\n"
        + "checkpoint_storage: {type: shared_fs, host_path: /proc}\n"
    )
    assert main(["check-config", str(path), str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "`checkpoint_storage.host_path` = '/proc' cannot hold" in err


def test_an_override_names_a_hyperparameter_whose_name_holds_dots():
    from det_tasks.config import apply_overrides

    raw = base(hyperparameters={"global_batch_size": 1, "model.hidden": 12})
    out = apply_overrides(raw, ["hyperparameters.model.hidden=16"])
    assert out["hyperparameters"] == {"global_batch_size": 1, "model.hidden": 16}
    nested = apply_overrides(base(), ["hyperparameters.opt.lr=0.1"])
    assert nested["hyperparameters"]["opt"] == {"lr": 0.1}


def test_an_override_that_reads_two_ways_is_refused():
    from det_tasks.config import apply_overrides

    raw = base(hyperparameters={"global_batch_size": 1, "model.hidden": 12, "model": {"x": 1}})
    with pytest.raises(ConfigError, match=r"is ambiguous: the config has both 'model\.hidden'"):
        apply_overrides(raw, ["hyperparameters.model.hidden=16"])
