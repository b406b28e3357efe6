"""A failed trial's message: torchrun's closing summary names the rank that failed first but
not its error, so the rank's own last lines come before it."""

from __future__ import annotations

from cluster.held_trials import last_output

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


AGENT = "\n".join(
    [
        "Traceback (most recent call last):",
        '  File "<frozen runpy>", line 198, in _run_module_as_main',
        '  File "/venv/lib/python3.11/site-packages/torch/distributed/run.py", line 1032',
        "    main()",
        '  File "/venv/lib/python3.11/site-packages/torch/distributed/launcher/api.py", line 383',
        "    raise ChildFailedError(",
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ",  # as printed
        "============================================================",
    ]
)


def test_torchruns_own_traceback_does_not_push_the_ranks_error_out() -> None:
    # As torchrun prints it: the ranks' lines, its log line naming the failed rank, its own
    # traceback, then the summary (from a real run, shortened).
    noise = [f"[rank0]: step {i}" for i in range(30)]
    trace = [
        "[rank1]: Traceback (most recent call last):",
        "[rank1]: RuntimeError: the real reason",
        "E1126 10:11:31.172000 23420 torch/distributed/elastic/multiprocessing/api.py:1002] "
        "failed (exitcode: 1) local_rank: 1 (pid: 23425) of binary: /venv/bin/python",
    ]
    text = "\n".join([*noise, *trace, AGENT, SUMMARY])
    message = last_output(text, lines=4)
    assert message.splitlines()[:4] == [noise[-1], *trace]
    assert "ChildFailedError" not in message
    assert message.endswith(SUMMARY.splitlines()[-1])


def test_a_cut_torchrun_traceback_is_not_mistaken_for_the_ranks() -> None:
    # torchrun's header line lost (cut or garbled output): the rank's own unprefixed
    # traceback above must still be shown, and torchrun's frames are left out.
    rank = ["Traceback (most recent call last):", '  File "model_def.py", line 9', "OSError: why"]
    frames = AGENT.splitlines()[1:]
    text = "\n".join([*rank, *frames, SUMMARY])
    message = last_output(text, lines=3)
    assert message.splitlines()[:3] == rank
    assert "launch_agent" not in message and "ChildFailedError(" not in message
