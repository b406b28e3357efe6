"""Pins the public API (as Composer does): it changes only on purpose, with this test."""

from __future__ import annotations

import inspect

from det_tasks import compat, pytorch
from det_tasks.pytorch import PyTorchCallback, PyTorchTrial, PyTorchTrialContext

PYTORCH_ALL = {
    "Batch",
    "CheckpointLoadContext",
    "DataLoader",
    "Epoch",
    "FitResult",
    "LRScheduler",
    "MetricReducer",
    "PyTorchCallback",
    "PyTorchExperimentalContext",
    "PyTorchTrial",
    "PyTorchTrialContext",
    "Reducer",
    "TorchData",
    "TrainUnit",
    "Trainer",
    "adapt_batch_sampler",
    "data_length",
    "init",
    "load_trial_from_checkpoint_path",
    "reset_parameters",
    "samplers",
    "to_device",
}

CONTEXT_METHODS = {
    "autocast_forward_pass",
    "backward",
    "build_trial",
    "configure_apex_amp",
    "current_train_batch",
    "current_train_epoch",
    "fit",
    "get_data_config",
    "get_enable_tensorboard_logging",
    "get_experiment_config",
    "get_experiment_id",
    "get_global_batch_size",
    "get_hparam",
    "get_hparams",
    "get_initial_batch",
    "get_optimizer",
    "get_per_slot_batch_size",
    "get_stop_requested",
    "get_tensorboard_path",
    "get_tensorboard_writer",
    "get_trial_id",
    "get_trial_seed",
    "is_epoch_end",
    "is_epoch_start",
    "load_checkpoint_trial",
    "predict",
    "reduce_metrics",
    "reset_reducers",
    "set_enable_tensorboard_logging",
    "set_profiler",
    "set_stop_requested",
    "step_optimizer",
    "to_device",
    "train",
    "wrap_lr_scheduler",
    "wrap_model",
    "wrap_optimizer",
    "wrap_reducer",
    "wrap_scaler",
}

CALLBACK_HOOKS = {
    "on_trial_startup",
    "on_trial_shutdown",
    "on_training_start",
    "on_training_epoch_start",
    "on_training_epoch_end",
    "on_training_workload_end",
    "on_validation_start",
    "on_validation_epoch_start",
    "on_validation_epoch_end",
    "on_validation_end",
    "on_validation_step_start",
    "on_validation_step_end",
    "on_checkpoint_load_start",
    "on_checkpoint_save_start",
    "on_checkpoint_end",
    "on_checkpoint_write_end",
    "on_checkpoint_upload_end",
    "on_before_optimizer_step",
    "state_dict",
    "load_state_dict",
}


def public(cls: type) -> set[str]:
    return {n for n, _ in inspect.getmembers(cls) if not n.startswith("_")}


def test_pytorch_module_exports():
    assert set(pytorch.__all__) == PYTORCH_ALL


def test_context_methods():
    methods = {n for n in public(PyTorchTrialContext) if callable(getattr(PyTorchTrialContext, n))}
    assert methods == CONTEXT_METHODS


def test_callback_hooks():
    assert public(PyTorchCallback) == CALLBACK_HOOKS


def test_trial_overridables():
    assert public(PyTorchTrial) >= {
        "train_batch",
        "build_training_data_loader",
        "build_validation_data_loader",
        "build_callbacks",
        "evaluate_batch",
        "evaluation_reducer",
        "evaluate_full_dataset",
        "get_batch_length",
    }


def test_step_modes_and_reducers():
    assert [m.name for m in pytorch.LRScheduler.StepMode] == [
        "STEP_EVERY_EPOCH",
        "STEP_EVERY_BATCH",
        "MANUAL_STEP",
        "STEP_EVERY_OPTIMIZER_STEP",
    ]
    assert [r.name for r in pytorch.Reducer] == ["AVG", "SUM", "MAX", "MIN"]


def test_determined_alias():
    compat.install()
    import determined
    import determined.pytorch

    assert determined.pytorch.PyTorchTrial is PyTorchTrial
    assert determined.TrialContext is PyTorchTrialContext
    assert determined.get_cluster_info() is None
    assert determined.pytorch.samplers.DistributedBatchSampler is not None
    assert {"Batches", "Epochs", "core", "InvalidHP"} <= set(vars(determined))


BATCH_CONTEXT_METHODS = {
    "get_distributed_rank",
    "get_distributed_size",
    "get_hparams",
    "get_tensorboard_path",
    "prepare_model_for_inference",
    "report_metrics",
    "report_task_using_checkpoint",
    "report_task_using_model_version",
    "run_cross_slot_reduction",
    "to_device",
    "upload_path",
    "wrap_reducer",
}


def test_batch_processing_api():
    from det_tasks.pytorch import experimental

    assert set(experimental.__all__) == {
        "BatchJobServices",
        "LocalJobServices",
        "TorchBatchProcessor",
        "TorchBatchProcessorContext",
        "torch_batch_process",
    }
    assert public(experimental.TorchBatchProcessorContext) == BATCH_CONTEXT_METHODS
    assert public(experimental.TorchBatchProcessor) == {
        "process_batch",
        "on_checkpoint_start",
        "on_finish",
    }
