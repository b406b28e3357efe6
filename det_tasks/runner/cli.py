"""det-tasks: train Determined PyTorchTrial code locally or on the platform (MLflow, S3,
Prefect), and browse what it recorded."""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import json
import logging
import os
import signal
import sys
import tempfile
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from det_tasks import plugins
from det_tasks.errors import EXIT_INVALID_HP, ConfigError, DetTasksError, InvalidHP
from det_tasks.loader_failures import loader_worker_death, worker_traceback
from det_tasks.runner.library_logs import quiet_library_loggers
from det_tasks.runner.stop_requests import RequestedStop
from det_tasks.runner.stop_signals import SignalStop, StoppedAtOnce, StopSignals, resume_command
from det_tasks.user_frames import error_text, innermost_user_frame, user_traceback

if TYPE_CHECKING:
    from det_tasks.config.entered import EnteredConfig

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    # User mistakes print one paragraph (no traceback) and exit 1.
    parser = argparse.ArgumentParser(prog="det-tasks", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="train one trial in this process from an experiment config")
    run.add_argument("config", help="experiment config YAML (Determined's format)")
    run.add_argument(
        "model_dir",
        nargs="?",
        help="directory with the entrypoint's code (default: the config's directory)",
    )
    run.add_argument(
        "--test",
        action="store_true",
        help="test mode: one training batch, one validation batch, one checkpoint",
    )
    run.add_argument(
        "--param",
        "-p",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config field, e.g. hyperparameters.learning_rate=0.5",
    )
    run.add_argument(
        "--checkpoint-dir", help="write checkpoints here instead of the config's storage"
    )
    run.add_argument(
        "--resume",
        metavar="UUID_OR_PATH",
        action="append",
        help="continue from this checkpoint; repeat to list fallbacks, newest first (the "
        "first intact one is used)",
    )
    run.add_argument("--device", help="torch device, e.g. cpu or cuda:1 (default: auto)")
    run.add_argument("--no-progress", action="store_true", help="no progress bar")
    run.add_argument(
        "--max-batches", type=_positive_int, help="train until this many batches in total"
    )
    # Flags the experiment flow passes to each trial's process: not for people, not in --help.
    run.add_argument("--hparams", help=argparse.SUPPRESS)
    run.add_argument("--trial-id", default="1", help=argparse.SUPPRESS)
    run.add_argument("--experiment-run", help=argparse.SUPPRESS)
    run.add_argument("--summary-file", help=argparse.SUPPRESS)
    run.add_argument("--experiment-best", type=float, help=argparse.SUPPRESS)
    run.add_argument("--entered-config", help=argparse.SUPPRESS)  # config.entered's file
    check = sub.add_parser(
        "check-config",
        help="validate an experiment config, import its entrypoint, and print the config",
    )
    check.add_argument("config")
    check.add_argument(
        "model_dir", nargs="?", help="directory with the entrypoint's code (default: the config's)"
    )
    for register in plugins.load_all("det_tasks.cli").values():
        register(sub)
    return parser


def _positive_int(text: str) -> int:
    """argparse type: a whole number of at least 1 (0 would train nothing, or everything)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive number; give 1 or more")
    return value


def _checked_device(requested: str | None) -> None:
    """Refuse a device this machine does not have, before a run or a worker exists."""
    if not requested:
        return
    import torch

    try:
        device = torch.device(requested)
    except (RuntimeError, ValueError) as err:
        first = str(err).strip().splitlines()[0]
        raise ConfigError(f"--device {requested!r} is not a torch device ({first})") from None
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ConfigError(
                f"--device {requested!r}: CUDA is not available on this machine (torch "
                f"{torch.__version__}, no usable GPU); use --device cpu, or leave --device "
                "out to pick one"
            )
        if device.index is not None and device.index >= count:
            raise ConfigError(
                f"--device {requested!r}: this machine has {count} CUDA device(s), "
                f"cuda:0 to cuda:{count - 1}"
            )
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigError(f"--device {requested!r}: MPS is not available; use --device cpu")


def main(argv: Sequence[str] | None = None) -> int:
    if hasattr(signal, "SIGUSR1"):  # `kill -USR1 PID` prints every thread's stack: hung ranks
        with contextlib.suppress(OSError, ValueError):  # no real stderr (captured in tests)
            faulthandler.register(signal.SIGUSR1, all_threads=True)
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    quiet_library_loggers()
    warnings.simplefilter("default", DeprecationWarning)
    try:
        if getattr(args, "func", None) is not None:
            return int(args.func(args))
        if args.command == "check-config":
            return _check_config(Path(args.config), args.model_dir)
        from det_tasks.runner import worker_group

        _checked_device(args.device)
        if not worker_group.inside_worker_group():
            workers = _start_workers(args, argv)
            if workers is not None:
                return workers
        if argv is None:  # this process is the command (not a caller of main): see there
            from det_tasks.runner.trial_processes import own_trial_processes

            own_trial_processes()
        result = _train_in_process(args)
    except (SignalStop, StoppedAtOnce) as stopped:  # SIGHUP, SIGTERM
        return _report_signal_stop(stopped, sys.argv[1:] if argv is None else argv)
    except RequestedStop as stopped:  # its starter's request (a flow's pause)
        return _report_requested_stop(stopped, args)
    except DetTasksError as err:
        where = _user_code_location(err)
        print(f"error: {where + ': ' if where else ''}{err}", file=sys.stderr)
        return 1
    except InvalidHP as err:
        return _report_invalid_hp(args, err)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as err:
        if worker_traceback(err) is None and loader_worker_death(err) is None:
            raise  # Python's own traceback: it ends at the user's frame already
        return _report_loader_failure(err, args)
    summary = {
        "batches_trained": result.batches_trained,
        "checkpoint": result.checkpoint_uri,
        "validation": result.validation_metrics,
        "hparams": result.hparams,
    }
    if result.run_url:
        summary["mlflow_run"] = result.run_url
    text = json.dumps(summary, indent=2, default=str)
    if worker_group.worker_rank() != 0:
        return 0  # the chief reports for the trial
    if getattr(args, "summary_file", None):
        Path(args.summary_file).write_text(text)
    print(text)
    return 0


def _start_workers(args: argparse.Namespace, argv: Sequence[str] | None) -> int | None:
    """Check the config against the model directory; then, for a trial of several slots
    (or a launch layer), start its worker group and return its exit code (else None)."""
    from det_tasks.config.entered import ENTERED_CONFIG_FLAG
    from det_tasks.config.storage_paths import check_storage_beside_code
    from det_tasks.runner import worker_group
    from det_tasks.runner.determined_launch_layers import parse_launch_layer

    config_path = Path(args.config)
    entered = _entered(args)
    config = entered.config
    model_dir = Path(args.model_dir) if args.model_dir else config_path.parent
    check_storage_beside_code(config, model_dir, args.checkpoint_dir)
    slots = config.resources.slots_per_trial
    layer = parse_launch_layer(config.entrypoint)
    if slots > 1 or layer.backend is not None:
        backend = worker_group.resolve_backend(
            layer.backend or config.resources.distributed_backend
        )
        argv_ = ["-m", "det_tasks.runner.cli", *(sys.argv[1:] if argv is None else argv)]
        with tempfile.TemporaryDirectory(prefix="det-tasks-config-") as tmp:
            if not args.entered_config:  # each rank reads the config this process entered
                argv_ += [ENTERED_CONFIG_FLAG, str(entered.write(Path(tmp) / "config.pickle"))]
            return worker_group.run_workers(slots, backend, argv_, layer.overrides)
    return None


def _entered(args: argparse.Namespace) -> EnteredConfig:
    """The run's config: the file its starter entered (``--entered-config``: its overrides
    applied already, so ``--param`` is not read again), else the config file with
    ``--param``, entered here (det_tasks.config.entered)."""
    from det_tasks.config.entered import EnteredConfig, enter_file

    if args.entered_config:
        return EnteredConfig.read(Path(args.entered_config))
    return enter_file(Path(args.config), args.param)


def _check_config(config_path: Path, model_dir: str | None) -> int:
    """Validate the config, then import the entrypoint as ``run`` would (class or script)."""
    from det_tasks.config import load_config
    from det_tasks.config.storage_paths import check_checkpoint_storage, check_storage_beside_code

    config = load_config(config_path)  # before importing torch: a bad file is refused at once
    directory = Path(model_dir) if model_dir else config_path.parent
    check_storage_beside_code(config, directory)
    if not os.environ.get("MLFLOW_TRACKING_URI"):  # `run` writes checkpoints there
        check_checkpoint_storage(config, str(config_path))
    from det_tasks.runner.in_process import check_entrypoint

    entry = check_entrypoint(config, directory)
    print(json.dumps(config.model_dump(mode="json"), indent=2, default=str))
    kind = f"script {entry}" if isinstance(entry, Path) else f"trial class {entry.__qualname__}"
    print(f"ok: entrypoint {config.entrypoint!r} loads ({kind})", file=sys.stderr)
    return 0


def _train_in_process(args: argparse.Namespace) -> Any:
    """``run_trial`` of the command line, stopping at a batch boundary (with a checkpoint)
    on SIGHUP and SIGTERM (det_tasks.runner.stop_signals). Not in a rank of a worker group:
    its launcher (torchrun, horovodrun) ends the ranks by SIGTERM when one fails, and a
    rank waiting for a batch boundary its peers never reach would hang until SIGKILL."""
    from det_tasks.runner import worker_group
    from det_tasks.runner.in_process import run_trial

    stop = StopSignals()
    handled = contextlib.nullcontext() if worker_group.inside_worker_group() else stop.handled()
    with handled:
        return run_trial(
            args.config,
            args.model_dir,
            overrides=args.param,
            test_mode=args.test,
            checkpoint_dir=args.checkpoint_dir,
            latest_checkpoint=args.resume,
            device=args.device,
            progress=not args.no_progress,
            hparams=json.loads(args.hparams) if args.hparams else None,
            max_batches=args.max_batches,
            trial_id=args.trial_id,
            experiment_run_key=args.experiment_run,
            stop_signals=stop,
            experiment_best=args.experiment_best,
            entered=_entered(args) if args.entered_config else None,
        )


def _report_signal_stop(stopped: SignalStop | StoppedAtOnce, argv: Sequence[str]) -> int:
    """The run stopped on SIGHUP/SIGTERM: where, and how to continue (128 + the signal)."""
    name = signal.Signals(stopped.signum).name
    if isinstance(stopped, StoppedAtOnce):
        _say(f"stopped at once by {name}: no checkpoint at the stop")
        return 128 + stopped.signum
    if stopped.reference is None:
        _say(f"stopped by {name} at batch {stopped.batches}; no checkpoint was written")
    else:
        _say(
            f"stopped by {name} at batch {stopped.batches}, checkpoint {stopped.reference}; "
            f"continue with: {resume_command(argv, stopped.reference)}"
        )
    return stopped.exit_code


def _report_requested_stop(stopped: RequestedStop, args: argparse.Namespace) -> int:
    """A Core API script stopped on its starter's request: where, in the summary its starter
    reads (``stopped``: the state its run ended in)."""
    summary = {
        "batches_trained": stopped.batches,
        "checkpoint": stopped.reference,
        "stopped": stopped.state,
    }
    if getattr(args, "summary_file", None):
        Path(args.summary_file).write_text(json.dumps(summary, indent=2))
    _say(f"stopped ({stopped.state}) at batch {stopped.batches}, checkpoint {stopped.reference}")
    return 0


def _say(text: str) -> None:
    with contextlib.suppress(OSError):  # a closed terminal (SIGHUP) cannot be written to
        print(text, file=sys.stderr, flush=True)


def _user_code_location(err: BaseException) -> str | None:
    """``file:line`` of the innermost frame of the user's code in the error's traceback."""
    frame = innermost_user_frame(err)
    return frame.location if frame else None


def _report_loader_failure(err: BaseException, args: argparse.Namespace) -> int:
    """A DataLoader worker's failure, as the user's frames (read back from the worker's
    traceback, which torch passes on as text) and one line: no wrapper around it."""
    model_dir = Path(args.model_dir) if getattr(args, "model_dir", None) else None
    base = model_dir or Path(args.config).parent
    shown = user_traceback(err, base)
    if shown:
        print(shown, file=sys.stderr)
    frame = innermost_user_frame(err, base)
    where = f"{frame.location}: in {frame.described}: " if frame else ""
    print(f"error: {where}{error_text(err)}", file=sys.stderr)
    return 1


def _report_invalid_hp(args: argparse.Namespace, err: InvalidHP) -> int:
    """The trial rejected its hyperparameters: say so, and leave a summary the searcher reads
    (``invalid_hp``) so it drops the trial instead of retrying it."""
    from det_tasks.runner import worker_group

    print(f"invalid hyperparameters: {err or type(err).__name__}; the searcher drops this trial",
          file=sys.stderr)  # fmt: skip
    if worker_group.worker_rank() == 0 and getattr(args, "summary_file", None):
        summary = {"invalid_hp": str(err), "hparams": args.hparams and json.loads(args.hparams)}
        Path(args.summary_file).write_text(json.dumps(summary, indent=2, default=str))
    return EXIT_INVALID_HP


if __name__ == "__main__":
    sys.exit(main())
