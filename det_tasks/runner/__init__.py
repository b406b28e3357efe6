"""The local runner: ``det-tasks run CONFIG [MODEL_DIR]`` trains one trial in-process."""

from det_tasks.runner.entrypoint import load_trial_class
from det_tasks.runner.local import RunResult, run_trial

__all__ = ["RunResult", "load_trial_class", "run_trial"]
