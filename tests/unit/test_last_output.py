"""A failed trial's message: torchrun's closing summary names the rank that failed first but
not its error, so the rank's own last lines come before it."""

from __future__ import annotations

from flows.workers import last_output

SUMMARY = """det_tasks.runner.cli FAILED
------------------------------------------------------------
Failures:
  <NO_OTHER_FAILURES>
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  rank      : 1 (local_rank: 1)
  exitcode  : 1 (pid: 5227)
============================================================"""


def test_the_failing_ranks_error_comes_before_torchruns_summary() -> None:
    noise = [f"[rank0]: step {i}" for i in range(30)]
    trace = [
        "[rank1]: Traceback (most recent call last):",
        '[rank1]:   File "model_def.py", line 9, in train_batch',
        "[rank1]: RuntimeError: the real reason",
    ]
    text = "\n".join([*noise, *trace, SUMMARY])
    message = last_output(text, lines=5)
    assert message.splitlines()[:5] == [*noise[-2:], *trace]
    assert message.endswith(SUMMARY.splitlines()[-1])
    assert "RuntimeError: the real reason" in message


def test_without_torchrun_it_is_the_last_lines() -> None:
    text = "\n".join(f"line {i}" for i in range(50))
    assert last_output(text, lines=3) == "line 47\nline 48\nline 49"
