"""`det`: Determined's CLI spelling parses to the platform's commands; what is not supported
says so in one line and exits non-zero; bad ids and an absent platform are one line."""

from __future__ import annotations

import importlib.metadata
import uuid
from pathlib import Path

import pytest

from det_cli import main as det
from det_cli import master as master_lib
from det_cli.dispatch import build_parser
from det_cli.ids import parse_trial_ref, short_id
from det_tasks.errors import DetTasksError

EXP = "1a2b3c4d"

PARSES = [
    (["experiment", "create", "const.yaml", "."], "cmd_create"),
    (["e", "create", "c.yaml", ".", "-f", "--config", "a.b=1", "--config", "c=2"], "cmd_create"),
    (["e", "create", "c.yaml", ".", "--follow"], "cmd_create"),
    (["experiment", "list"], "cmd_list"),
    (["e", "ls", "--limit", "3"], "cmd_list"),
    (["e", "describe", EXP], "cmd_describe"),
    (["e", "list-trials", EXP], "cmd_list_trials"),
    (["e", "lt", EXP], "cmd_list_trials"),
    (["e", "list-checkpoints", EXP], "cmd_list_checkpoints"),
    (["e", "lc", EXP, "--best", "2"], "cmd_list_checkpoints"),
    (["e", "logs", EXP], "cmd_logs"),
    (["e", "logs", EXP, "-f"], "cmd_logs"),
    (["e", "pause", EXP], "cmd_lifecycle"),
    (["e", "activate", EXP], "cmd_lifecycle"),
    (["e", "unpause", EXP], "cmd_lifecycle"),
    (["e", "cancel", EXP], "cmd_lifecycle"),
    (["e", "kill", EXP], "cmd_lifecycle"),
    (["e", "wait", EXP, "--polling-interval", "1"], "cmd_wait"),
    (["e", "continue", EXP], "cmd_continue"),
    (["e", "continue", EXP, "--config", "searcher.max_length.batches=9", "-f"], "cmd_continue"),
    (["e", "continue", EXP, "--config-file", "more.yaml"], "cmd_continue"),
    (["e", "download", EXP, "-o", "out", "--top-n", "2", "-q"], "cmd_download"),
    (["e", "set", "description", EXP, "new words"], "cmd_set_description"),
    (["e", "set", "name", EXP, "renamed"], "cmd_set_name"),
    (["e", "label", "add", EXP, "baseline"], "cmd_label"),
    (["e", "label", "remove", EXP, "baseline"], "cmd_label"),
    (["e", "delete", EXP, "--yes"], "cmd_delete"),
    (["trial", "describe", f"{EXP}/1"], "cmd_describe"),
    (["t", "logs", f"{EXP}/1", "-f"], "cmd_logs"),
    (["t", "kill", f"{EXP}/2"], "cmd_kill"),
    (["checkpoint", "describe", "0f1e2d3c-aaaa"], "cmd_checkpoint_describe"),
    (["checkpoint", "download", "0f1e2d3c-aaaa", "-o", "x"], "cmd_checkpoint_download"),
    (["model", "create", "mnist"], "cmd_model_create"),
    (["m", "register-version", "mnist", "0f1e2d3c-aaaa"], "cmd_model_register_version"),
    (["m", "list"], "cmd_model_list"),
    (["m", "describe", "mnist"], "cmd_model_describe"),
    (["job", "run", "batch_inference.yaml", "."], "_job_run"),
    (["-m", "host:4200", "e", "ls"], "cmd_list"),
]


@pytest.mark.parametrize(
    ("argv", "function"), PARSES, ids=lambda v: " ".join(v) if isinstance(v, list) else v
)
def test_every_verb_and_short_form_parses(argv, function):
    args = build_parser().parse_args(argv)
    assert args.func.__name__ == function


def test_parsed_values_reach_the_commands():
    args = build_parser().parse_args(
        ["e", "create", "const.yaml", ".", "--config", "a.b=1", "--config", "c=2", "-f"]
    )
    assert args.param == ["a.b=1", "c=2"] and args.follow
    assert args.config == Path("const.yaml") and args.model_dir == Path(".")
    assert args.deployment == "experiment/submitted"
    assert build_parser().parse_args(["e", "lc", EXP, "--best", "3"]).best == 3
    assert build_parser().parse_args(["e", "activate", EXP]).lifecycle == "activate"
    assert build_parser().parse_args(["e", "unpause", EXP]).lifecycle == "activate"


UNSUPPORTED = [
    ["e", "archive", EXP],
    ["e", "unarchive", EXP],
    ["e", "move", EXP, "--project-id", "3"],
    ["e", "download-model-def", EXP],
    ["e", "set", "gc-policy", EXP, "--save-trial-best", "1"],
    ["e", "set", "log-retention", EXP, "7"],
    ["e", "create", "const.yaml", ".", "--test"],
    ["e", "create", "const.yaml", ".", "--paused"],
    ["e", "create", "const.yaml", ".", "--local", "--test"],
    ["e", "create", "const.yaml", ".", "--template", "t"],
    ["notebook", "start"],
    ["shell", "start"],
    ["cmd", "run", "nvidia-smi"],
    ["tensorboard", "start", EXP],
    ["agent", "list"],
    ["user", "login"],
    ["m", "delete", "mnist"],
    ["checkpoint", "delete", "0f1e2d3c-aaaa"],
]


@pytest.mark.parametrize("argv", UNSUPPORTED, ids=" ".join)
def test_unsupported_verbs_say_so_in_one_line_and_what_to_use(argv, capsys, monkeypatch):
    def no_platform(flag):
        raise AssertionError("an unsupported verb must not reach the platform")

    monkeypatch.setattr("det_cli.dispatch.use_master", no_platform)
    assert det(argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and captured.out == ""
    assert "not supported here: " in lines[0] and len(lines[0].split(": ", 2)[-1]) > 10


def test_create_test_and_paused_name_the_alternative(capsys):
    assert det(["e", "create", "const.yaml", ".", "--test"]) == 2
    assert "det-tasks run CONFIG MODEL_DIR --test" in capsys.readouterr().err
    assert det(["e", "create", "const.yaml", ".", "--paused"]) == 2
    assert "det experiment pause ID" in capsys.readouterr().err


def test_usage_mistakes_are_one_line(capsys):
    for argv in (["e", "frobnicate"], ["e", "describe"], ["e", "lc", EXP, "--best", "x"]):
        with pytest.raises(SystemExit) as exit_info:
            det(argv)
        assert exit_info.value.code == 2
        assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_unknown_experiment_id_is_one_line(capsys, monkeypatch):
    monkeypatch.setattr("det_cli.dispatch.use_master", lambda flag: None)
    known = [type("Run", (), {"id": uuid.UUID(int=7 << 120)})()]
    monkeypatch.setattr("det_cli.submission.experiment_runs", lambda limit: known)
    for verb in ("describe", "lt", "lc", "pause", "kill", "wait", "logs"):
        assert det(["e", verb, "ffffffff"]) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert err == ["det: error: no experiment runs match 'ffffffff': give more characters"]
    assert det(["e", "describe", "07"]) == 1
    assert "too short: give 8+ characters" in capsys.readouterr().err


def test_no_reachable_platform_names_the_address_and_make_up(capsys, monkeypatch):
    monkeypatch.delenv("DET_MASTER", raising=False)
    assert det(["-m", "127.0.0.1:1", "e", "ls"]) == 1
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "http://127.0.0.1:1/api (from -m/--master)" in line and "make up" in line
    monkeypatch.setenv("DET_MASTER", "http://127.0.0.1:1")
    assert det(["e", "describe", EXP]) == 1
    assert "(from DET_MASTER)" in capsys.readouterr().err


def test_master_precedence_and_the_stack_env(tmp_path, monkeypatch):
    stack = tmp_path / ".stack"
    stack.mkdir()
    (stack / "env").write_text(
        "export PREFECT_API_URL=http://10.0.0.5:4300/api\nexport MLFLOW_TRACKING_URI=http://m\n"
    )
    deep = tmp_path / "examples" / "mnist"
    deep.mkdir(parents=True)
    found = master_lib.find_stack_env({}, deep)
    assert found == stack / "env"
    assert found is not None
    values = master_lib.read_env_file(found)
    assert values["MLFLOW_TRACKING_URI"] == "http://m"
    resolve = master_lib.resolve_master
    assert resolve(None, {}, values, "S").api_url == "http://10.0.0.5:4300/api"
    assert resolve(None, {"PREFECT_API_URL": "http://p:1/api"}, values, "S").api_url == (
        "http://p:1/api"
    )
    env = {"PREFECT_API_URL": "http://p:1/api", "DET_MASTER": "gpu-box"}
    assert resolve(None, env, values, "S") == master_lib.Master(
        "http://gpu-box:4200/api", "DET_MASTER"
    )
    assert resolve("https://h:99/api/", env, values, "S").api_url == "https://h:99/api"
    assert master_lib.find_stack_env({"DET_TASKS_STACK_DIR": str(tmp_path / "no")}, deep) is None


def test_short_ids_and_trial_refs():
    full = uuid.UUID("1a2b3c4d-0000-4000-8000-000000000000")
    assert short_id(full) == EXP
    ref = parse_trial_ref(f"{EXP.upper()}/3")
    assert (ref.experiment, ref.number, ref.mlflow_run_id) == (EXP, "3", None)
    assert parse_trial_ref("ab" * 16).mlflow_run_id == "ab" * 16
    for bad in ("3", f"{EXP}/x", "1a2b/1"):
        with pytest.raises(DetTasksError, match="EXPERIMENT/N"):
            parse_trial_ref(bad)


def test_a_real_determined_beside_it_is_named(capsys, monkeypatch):
    real = importlib.metadata.version

    def version(name):
        return "0.38.1" if name == "determined" else real(name)

    monkeypatch.setattr(importlib.metadata, "version", version)
    assert det(["shell"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0] == (
        "note: this `det` is det-tasks' (Prefect/MLflow platform); Determined 0.38.1's CLI "
        "is `python -m determined.cli`"
    )
