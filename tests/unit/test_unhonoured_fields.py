"""Issue 15 item 14: nothing accepted and silently ignored. Each Determined field either
works (known answer), warns naming the field, or is refused; a resume whose checkpoint
holds a different number of optimizers/schedulers than the trial wraps is an error."""

from __future__ import annotations

import warnings

import pytest
import torch

from det_tasks import pytorch
from det_tasks.config import parse_config
from det_tasks.config.horovod import horovod_tuning_env
from det_tasks.config.unhonoured import UnhonouredFieldWarning
from det_tasks.errors import CheckpointError
from det_tasks.pytorch._loop.restore import load_state

BASE = {
    "entrypoint": "model_def:Trial",
    "hyperparameters": {"global_batch_size": 4},
    "searcher": {
        "name": "adaptive_asha",
        "metric": "loss",
        "max_length": {"batches": 64},
        "max_trials": 4,
    },
}


def _warnings_for(**sections: dict) -> list[str]:
    raw = {**BASE, **{k: {**BASE.get(k, {}), **v} for k, v in sections.items()}}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        parse_config(raw, source="exp.yaml")
    return [str(w.message) for w in caught if w.category is UnhonouredFieldWarning]


@pytest.mark.parametrize(
    ("section", "field", "value"),
    [
        ("resources", "shm_size", "4G"),
    ],
)
def test_unhonoured_field_warns_naming_it(section, field, value):
    messages = _warnings_for(**{section: {field: value}})
    assert len(messages) == 1
    assert f"`{section}.{field}` = {value!r}" in messages[0]
    assert messages[0].startswith("exp.yaml: ")


def test_the_job_queues_fields_are_honoured_without_a_warning():
    # cluster.job_queue acts on them (issue 43): no warning that they are ignored.
    resources = {"max_slots": 8, "priority": 10, "weight": 3, "resource_pool": "gpu"}
    assert _warnings_for(resources=resources) == []


@pytest.mark.parametrize(
    ("field", "value"), [("priority", 0), ("priority", 100), ("weight", 0), ("max_slots", 0)]
)
def test_the_job_queues_fields_out_of_range_are_refused_naming_them(field, value):
    raw = {**BASE, "resources": {field: value}}
    with pytest.raises(Exception, match=f"resources.{field}"):
        parse_config(raw, source="exp.yaml")


def test_plain_config_warns_nothing():
    assert _warnings_for() == []
    assert _warnings_for(searcher={"stop_once": True, "bracket_rungs": [3, 2]}) == []


def test_tensor_fusion_fields_become_horovod_environment():
    env = horovod_tuning_env(
        {
            "tensor_fusion_threshold": 32,
            "tensor_fusion_cycle_time": 7,
            "auto_tune_tensor_fusion": True,
        }
    )
    assert env == {
        "HOROVOD_FUSION_THRESHOLD": str(32 * 1024 * 1024),
        "HOROVOD_CYCLE_TIME": "7",
        "HOROVOD_AUTOTUNE": "1",
    }
    assert horovod_tuning_env({}) == {}


def _context(**conf) -> pytorch.PyTorchTrialContext:
    return pytorch.init(hparams={"global_batch_size": 2}, exp_conf=conf or None)


def test_gradient_compression_reaches_wrap_optimizer():
    ctx = _context(optimizations={"gradient_compression": True})
    assert ctx._gradient_compression() is True
    assert _context()._gradient_compression() is False


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"num_losses": 2}, "num_losses=2"),
        ({"keep_batchnorm_fp32": False}, "keep_batchnorm_fp32=False"),
        ({"patch_torch_functions": False}, "patch_torch_functions=False"),
        ({"verbosity": 2}, "verbosity=2"),
    ],
)
def test_apex_arguments_native_amp_cannot_honour_warn(kwargs, named):
    ctx = _context()
    model = ctx.wrap_model(torch.nn.Linear(2, 1))
    opt = ctx.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.warns(UserWarning, match=named):
        ctx.configure_apex_amp(model, opt, enabled=False, **kwargs)


def test_apex_arguments_autocast_honours_pass_quietly():
    ctx = _context()
    model = ctx.wrap_model(torch.nn.Linear(2, 1))
    opt = ctx.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ctx.configure_apex_amp(
            model,
            opt,
            enabled=False,
            keep_batchnorm_fp32=True,
            patch_torch_functions=True,
            master_weights=True,
            num_losses=1,
            verbosity=0,
        )


def _one_of_each() -> tuple[pytorch.PyTorchTrialContext, dict]:
    ctx = _context()
    model = ctx.wrap_model(torch.nn.Linear(2, 1))
    opt = ctx.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
    ctx.wrap_lr_scheduler(sched, pytorch.LRScheduler.StepMode.MANUAL_STEP)
    state = {
        "models_state_dict": [model.state_dict()],
        "optimizers_state_dict": [opt.state_dict()],
        "lr_schedulers_state_dict": [sched.state_dict()],
    }
    return ctx, state


def test_resume_with_matching_counts_loads():
    ctx, state = _one_of_each()
    load_state(ctx, {}, state)


@pytest.mark.parametrize(
    ("key", "kind"),
    [("optimizers_state_dict", "optimizer"), ("lr_schedulers_state_dict", "LR scheduler")],
)
def test_resume_with_extra_optimizer_or_scheduler_is_an_error(key, kind):
    ctx, state = _one_of_each()
    state[key] = state[key] * 2
    with pytest.raises(
        CheckpointError, match=f"holds 2 {kind} state dicts but the trial wrapped 1"
    ):
        load_state(ctx, {}, state)
