"""The stack's work pool template: Prefect's own, its command the engine in one interpreter
(``flows.engine_session``)."""

from __future__ import annotations

import shlex

from prefect.workers.process import ProcessWorker

from flows.work_pool import engine_command, process_pool_template


def test_the_command_starts_the_engine_session_in_the_given_interpreter() -> None:
    python = "/opt/a folder with spaces/bin/python"
    assert shlex.split(engine_command(python)) == [python, "-m", "flows.engine_session"]


def test_the_template_is_prefects_own_but_for_the_commands_default() -> None:
    ours = process_pool_template("/usr/bin/python3")
    prefects = ProcessWorker.get_default_base_job_template()
    assert prefects["variables"]["properties"]["command"]["default"] is None
    command = ours["variables"]["properties"].pop("command")
    assert command.pop("default") == "/usr/bin/python3 -m flows.engine_session"
    prefects_command = prefects["variables"]["properties"].pop("command")
    prefects_command.pop("default")
    assert command == prefects_command
    assert ours == prefects  # the rest untouched: env, labels, stream_output, working_dir
    assert ours["job_configuration"]["command"] == "{{ command }}"
