"""Determined's launch-layer entrypoints (``python3 -m determined.launch.X ...``) parsed into
our launcher's backend, overrides and script; DeepSpeed refused naming what to use."""

from __future__ import annotations

import sys

import pytest

from det_tasks.errors import ConfigError
from det_tasks.runner.determined_launch_layers import parse_launch_layer
from det_tasks.runner.entrypoint import parse_script_command
from det_tasks.runner.worker_group import launch_command


def test_torch_distributed_with_overrides_and_script():
    layer = parse_launch_layer(
        "python3 -m determined.launch.torch_distributed --master-port 29999 -- "
        "python3 train.py --epochs 1"
    )
    assert layer.backend == "torch"
    assert layer.overrides == ("--master-port", "29999")
    assert layer.script == ("python3", "train.py", "--epochs", "1")
    assert parse_script_command(list(layer.script))[1] == ["--epochs", "1"]


def test_horovod_and_legacy_trial_form():
    layer = parse_launch_layer(["python3", "-m", "determined.launch.horovod", "--trial", "m:T"])
    assert (layer.backend, layer.trial, layer.script) == ("horovod", "m:T", ())
    assert parse_launch_layer(
        "python3 -m determined.launch.horovod --autohorovod python3 a.py"
    ).script == (
        "python3",
        "a.py",
    )


def test_plain_entrypoints_have_no_layer():
    assert parse_launch_layer("python3 train.py").backend is None
    assert (
        parse_script_command("python3 -m determined.launch.torch_distributed python3 t.py")[0].name
        == "t.py"
    )


@pytest.mark.parametrize("module", ["deepspeed", "autodeepspeed"])
def test_deepspeed_is_refused_naming_the_alternative(module):
    with pytest.raises(ConfigError, match=r"DeepSpeed is not supported.*torch_distributed"):
        parse_launch_layer(f"python3 -m determined.launch.{module} python3 train.py")


def test_unknown_layer_and_missing_script_are_refused():
    with pytest.raises(ConfigError, match="not supported"):
        parse_launch_layer("python3 -m determined.launch.slurm python3 t.py")
    with pytest.raises(ConfigError, match="nothing to launch"):
        parse_launch_layer("python3 -m determined.launch.torch_distributed")


def test_overrides_come_after_ours_so_they_win():
    cmd = launch_command(2, "torch", ["-m", "x"], ["--nproc-per-node", "3"])
    assert cmd.index("--nproc-per-node", cmd.index("2") + 1) < cmd.index("--no-python")
    assert cmd[-3:] == [sys.executable, "-m", "x"]
