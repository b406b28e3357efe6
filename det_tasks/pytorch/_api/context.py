"""``PyTorchTrialContext``: what a trial sees of the harness (hparams, devices, wrapping).

The context owns the wrapped models/optimizers/schedulers so the loop can checkpoint and
step them; it holds no global state, so several contexts can live in one process.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from det_tasks.distributed import DistributedContext
from det_tasks.errors import ConfigError, TrialError
from det_tasks.pytorch._api import amp as _amp
from det_tasks.pytorch._api import parallel as _parallel
from det_tasks.pytorch._api.lr_scheduler import LRScheduler
from det_tasks.pytorch._api.nonfinite import NonFiniteGuard
from det_tasks.pytorch._api.reducer import MetricReducer, as_metric_reducer, to_python
from det_tasks.pytorch._api.trainer_api import TrainerAPIMixin
from det_tasks.pytorch._data.loader import to_device

if TYPE_CHECKING:
    from det_tasks.checkpoints.store import CheckpointStore
    from det_tasks.sinks import MetricsSink

__all__ = ["PyTorchExperimentalContext", "PyTorchTrialContext", "TrialSettings"]

log = logging.getLogger(__name__)
_NO_SYNC_TO_SKIP = contextlib.nullcontext()  # one process: step as it is, nothing to skip


@dataclasses.dataclass(frozen=True)
class TrialSettings:
    """Everything fixed for one trial run; built once by init() or the runner."""

    hparams: dict[str, Any]
    exp_conf: dict[str, Any] | None = None
    aggregation_frequency: int = 1
    average_aggregated_gradients: bool = True
    average_training_metrics: bool = True
    seed: int = 0
    trial_id: int | str = "local"
    experiment_id: int | str = "local"
    device: str | None = None
    model_dir: Path | None = None
    tensorboard_path: Path | None = None
    enable_tensorboard_logging: bool = True
    managed_training: bool = True
    nonfinite_loss: str = "warn"


class PyTorchExperimentalContext:
    """``context.experimental``: AMP shortcut, custom reducers, auto-to-device switch."""

    def __init__(self, parent: PyTorchTrialContext) -> None:
        self._parent = parent
        self._auto_amp = False
        self._auto_to_device = True
        self._data_repro_checks = True
        self._reducers: list[tuple[MetricReducer, str | None, bool, bool]] = []

    def use_amp(self) -> None:
        """Autocast every wrapped model's forward, scale losses, unscale before clipping."""
        parent = self._parent
        parent.wrap_scaler(_amp.make_grad_scaler(parent.device))
        self._auto_amp = True
        parent.models[:] = [parent._autocast(m) for m in parent.models]

    def disable_auto_to_device(self) -> None:
        """Batches reach train_batch/evaluate_batch as the loader made them (on CPU)."""
        self._auto_to_device = False

    def disable_dataset_reproducibility_checks(self) -> None:
        """Allow plain torch DataLoaders (resume then replays data instead of skipping)."""
        self._data_repro_checks = False

    def wrap_reducer(
        self,
        reducer: Callable[[list[Any]], Any] | MetricReducer,
        name: str | None = None,
        for_training: bool = True,
        for_validation: bool = True,
    ) -> MetricReducer:
        """Register a reducer whose result joins the training and/or validation metrics."""
        reducer = as_metric_reducer(reducer)
        if not (for_training or for_validation):
            raise ValueError("wrap_reducer: for_training and for_validation are both False")
        self._reducers.append((reducer, name, for_training, for_validation))
        return reducer

    def reset_reducers(self) -> None:
        for reducer, *_ in self._reducers:
            reducer.reset()

    def reduce_metrics(self, for_training: bool) -> dict[str, Any]:
        """Per-slot then cross-slot reduction of every registered reducer."""
        out: dict[str, Any] = {}
        dist = self._parent.distributed
        for reducer, name, training, validation in self._reducers:
            if not (training if for_training else validation):
                continue
            per_slot = dist.allgather(reducer.per_slot_reduce())
            value = reducer.cross_slot_reduce(per_slot)
            if name is None:
                if not isinstance(value, dict):
                    raise TrialError(
                        f"reducer {type(reducer).__name__} was wrapped without a name, so "
                        f"cross_slot_reduce must return a dict of metrics; got {value!r}"
                    )
                out.update({k: to_python(v) for k, v in value.items()})
            else:
                if isinstance(value, dict):
                    raise TrialError(
                        f"reducer {name!r} returned a dict; wrap it with name=None to report "
                        "several metrics, or return a single value"
                    )
                out[name] = to_python(value)
        return out


class PyTorchTrialContext(TrainerAPIMixin):
    """Runtime information and wrapping for one trial (Determined's API, 0.38)."""

    def __init__(
        self,
        settings: TrialSettings,
        distributed: DistributedContext | None = None,
        *,
        metrics_sink: MetricsSink | None = None,
        checkpoint_store: CheckpointStore | None = None,
        trainer: Callable[[Any, Any], Any] | None = None,
        checkpoint_loader: Callable[..., Any] | None = None,
    ) -> None:
        """``trainer`` (the Trainer class) and ``checkpoint_loader`` serve the Trainer API's
        ``context.train`` and ``context.load_checkpoint_trial``; init() passes them, so this
        module needs neither the loop nor the loader (they import it)."""
        self._settings = settings
        self._trainer = trainer
        self._checkpoint_loader = checkpoint_loader
        self.distributed = distributed or DistributedContext()
        self.device = _pick_device(settings.device, self.distributed.local_rank)
        self.models: list[torch.nn.Module] = []
        self.optimizers: list[torch.optim.Optimizer] = []
        self.lr_schedulers: list[LRScheduler] = []
        self.experimental = PyTorchExperimentalContext(self)
        self.profiler: Any = None
        self._scaler: torch.amp.GradScaler | None = None
        self._backward_passes: dict[int, int] = {}
        # Optimizers with Horovod's synchronize(): found once, not looked up per step.
        self._synchronizing: set[int] = set()
        self._current_batch_idx = 0
        self._epoch_len: int | None = None
        self._stop_requested = False
        self._before_step_hooks: list[Callable[[Iterator[Any]], None]] = []
        self._metrics_sink = metrics_sink
        self._checkpoint_store = checkpoint_store
        self._tensorboard_writer: Any = None
        self._initial_batch = 0
        self._cpu_amp_noted = False
        self._warm_started = False  # searcher.source_* applied (see _warm_start.py)
        self._nonfinite = NonFiniteGuard(
            settings.nonfinite_loss, self.device, self.distributed.size
        )

    def __enter__(self) -> PyTorchTrialContext:
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        # After an error, do not wait at a barrier the failed ranks will never reach.
        self._close(clean=exc_type is None)

    # ---- configuration and hyperparameters -------------------------------------------
    @property
    def hparams(self) -> dict[str, Any]:
        return self._settings.hparams

    @property
    def _aggregation_frequency(self) -> int:
        """``optimizations.aggregation_frequency`` under Determined's private name, which its
        own fixtures (the one-variable AMP trials) read to size their data."""
        return self._settings.aggregation_frequency

    def get_hparams(self) -> dict[str, Any]:
        return dict(self._settings.hparams)

    def get_hparam(self, name: str) -> Any:
        if name not in self._settings.hparams:
            known = ", ".join(sorted(self._settings.hparams)) or "none"
            raise ConfigError(  # a ValueError, as in Determined
                f"hyperparameter {name!r} is not defined; the experiment config defines: "
                f"{known}. Add it under `hyperparameters:`"
            )
        return self._settings.hparams[name]

    def get_experiment_config(self) -> dict[str, Any]:
        if self._settings.exp_conf is None:
            raise ValueError(
                "no experiment config: pass exp_conf=... to det.pytorch.init() to use "
                "get_experiment_config() in local training"
            )
        return self._settings.exp_conf

    def get_data_config(self) -> dict[str, Any]:
        return dict((self._settings.exp_conf or {}).get("data") or {})

    def get_global_batch_size(self) -> int:
        if "global_batch_size" not in self._settings.hparams:
            raise ValueError(
                "global_batch_size is not a hyperparameter of this trial; add "
                "`global_batch_size: N` under `hyperparameters:` (or pass it in init(hparams=))"
            )
        return int(self._settings.hparams["global_batch_size"])

    def get_per_slot_batch_size(self) -> int:
        return self.distributed.shard_batch_size(self.get_global_batch_size())

    def get_trial_id(self) -> int | str:
        return self._settings.trial_id

    def get_experiment_id(self) -> int | str:
        return self._settings.experiment_id

    def get_trial_seed(self) -> int:
        return self._settings.seed

    def get_stop_requested(self) -> bool:
        return self._stop_requested

    def get_initial_batch(self) -> int:
        """The batch training starts from: 0, or the batches trained by the checkpoint that
        ``fit()`` resumes from (known once fit() has restored it, as Determined's local mode
        knows it only from the checkpoint)."""
        return self._initial_batch

    def set_stop_requested(self, stop_requested: bool) -> None:
        """Ask the loop to checkpoint and stop after the current batch."""
        if not isinstance(stop_requested, bool):
            raise TypeError(f"set_stop_requested takes a bool, got {stop_requested!r}")
        self._stop_requested = stop_requested

    # ---- position in training ---------------------------------------------------------
    def current_train_batch(self) -> int:
        return self._current_batch_idx

    def current_train_epoch(self) -> int:
        return self._current_batch_idx // self._require_epoch_len()

    def is_epoch_start(self) -> bool:
        return self._current_batch_idx % self._require_epoch_len() == 0

    def is_epoch_end(self) -> bool:
        return (self._current_batch_idx + 1) % self._require_epoch_len() == 0

    def _require_epoch_len(self) -> int:
        if self._epoch_len is None:
            raise RuntimeError("epoch position is only known while the Trainer is training")
        return self._epoch_len

    # ---- custom metric reducers (Determined's context inherits its reducer context) ------
    def wrap_reducer(
        self,
        reducer: Callable[[list[Any]], Any] | MetricReducer,
        name: str | None = None,
        for_training: bool = True,
        for_validation: bool = True,
    ) -> MetricReducer:
        """Register a reducer whose result joins the training and/or validation metrics."""
        return self.experimental.wrap_reducer(reducer, name, for_training, for_validation)

    def reset_reducers(self) -> None:
        self.experimental.reset_reducers()

    def reduce_metrics(self, for_training: bool) -> dict[str, Any]:
        return self.experimental.reduce_metrics(for_training)

    # ---- wrapping ---------------------------------------------------------------------
    def wrap_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """Move the model to this trial's device (and wrap it for data parallelism)."""
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"wrap_model takes a torch.nn.Module, got {type(model).__name__}")
        model = model.to(self.device)
        if self.experimental._auto_amp:
            model = self._autocast(model)
        model = _parallel.wrap_model(model, self.distributed, self.device)
        self.models.append(model)
        return model

    def wrap_optimizer(
        self,
        optimizer: torch.optim.Optimizer,
        backward_passes_per_step: int = 1,
        fp16_compression: bool = False,
        average_aggregated_gradients: bool | None = None,
    ) -> torch.optim.Optimizer:
        """Register an optimizer (a Horovod DistributedOptimizer under Horovod)."""
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"wrap_optimizer takes a torch.optim.Optimizer, got {type(optimizer).__name__}"
            )
        if backward_passes_per_step < 1:
            raise ValueError(
                f"backward_passes_per_step must be >= 1, got {backward_passes_per_step}"
            )
        if average_aggregated_gradients is not None and (
            average_aggregated_gradients != self._settings.average_aggregated_gradients
        ):
            raise ValueError(
                "average_aggregated_gradients is set once per trial: use "
                "optimizations.average_aggregated_gradients in the experiment config"
            )
        optimizer = _parallel.wrap_optimizer(
            optimizer,
            self.distributed,
            self.models,
            backward_passes_per_step * self._settings.aggregation_frequency,
            fp16_compression or self._gradient_compression(),
        )
        self._backward_passes[id(optimizer)] = backward_passes_per_step
        if _parallel.synchronizes(optimizer):
            self._synchronizing.add(id(optimizer))
        self.optimizers.append(optimizer)
        return optimizer

    def _gradient_compression(self) -> bool:
        """``optimizations.gradient_compression``: fp16 compression of Horovod's allreduce."""
        optimizations = (self._settings.exp_conf or {}).get("optimizations") or {}
        return bool(optimizations.get("gradient_compression", False))

    def wrap_lr_scheduler(
        self,
        lr_scheduler: torch.optim.lr_scheduler.LRScheduler,
        step_mode: LRScheduler.StepMode,
        frequency: int = 1,
    ) -> torch.optim.lr_scheduler.LRScheduler:
        """Register a scheduler to checkpoint and step per ``step_mode``; returns it."""
        opt = getattr(lr_scheduler, "optimizer", None)
        if opt is not None and not any(opt is o for o in self.optimizers):
            raise TrialError(
                "wrap_lr_scheduler: the scheduler's optimizer was not returned by "
                "context.wrap_optimizer(); wrap the optimizer first and build the scheduler on it"
            )
        self.lr_schedulers.append(LRScheduler(lr_scheduler, step_mode, frequency))
        return lr_scheduler

    def wrap_scaler(self, scaler: torch.amp.GradScaler) -> torch.amp.GradScaler:
        """Register a GradScaler so it is checkpointed; pass it to step_optimizer(scaler=)."""
        if self._scaler is not None and self._scaler is not scaler:
            raise TrialError("only one GradScaler per trial can be wrapped")
        self._scaler = scaler
        return scaler

    def autocast_forward_pass(self, to_wrap: torch.nn.Module) -> torch.nn.Module:
        """Run the module's forward under torch.autocast for this trial's device."""
        return self._autocast(to_wrap)

    def configure_apex_amp(
        self,
        models: torch.nn.Module | list[torch.nn.Module],
        optimizers: torch.optim.Optimizer | list[torch.optim.Optimizer],
        enabled: bool | None = True,
        opt_level: str | None = "O1",
        cast_model_type: torch.dtype | None = None,
        patch_torch_functions: bool | None = None,
        keep_batchnorm_fp32: bool | str | None = None,
        master_weights: bool | None = None,
        loss_scale: float | str | None = None,
        cast_model_outputs: torch.dtype | None = None,
        num_losses: int | None = 1,
        verbosity: int | None = 1,
        min_loss_scale: float | None = None,
        max_loss_scale: float | None = 2.0**24,
    ) -> tuple[Any, Any]:
        """apex.amp.initialize's signature, mapped onto native torch.amp (see _amp.py)."""
        unsupported = {
            "cast_model_type": cast_model_type,
            "cast_model_outputs": cast_model_outputs,
            "master_weights": False if master_weights is False else None,
        }
        for arg, value in unsupported.items():
            if value is not None:
                raise ValueError(
                    f"configure_apex_amp({arg}=...) is not supported without apex; drop it, "
                    "or cast explicitly and use context.wrap_scaler()"
                )
        _amp.check_apex_options(
            patch_torch_functions, keep_batchnorm_fp32, master_weights, num_losses, verbosity
        )
        model_list = models if isinstance(models, list) else [models]
        opt_list = optimizers if isinstance(optimizers, list) else [optimizers]
        for m in model_list:
            if not any(m is w for w in self.models):
                raise TrialError("configure_apex_amp: call it with models returned by wrap_model()")
        for o in opt_list:
            if not any(o is w for w in self.optimizers):
                raise TrialError(
                    "configure_apex_amp: call it with optimizers returned by wrap_optimizer()"
                )
        if _amp.plan_apex_amp(opt_level, enabled):
            self.wrap_scaler(
                _amp.make_grad_scaler(self.device, loss_scale, min_loss_scale, max_loss_scale)
            )
            self.experimental._auto_amp = True
            for m in model_list:
                self._autocast(m)
        return models, optimizers

    def _autocast(self, module: torch.nn.Module) -> torch.nn.Module:
        """Autocast on CUDA; elsewhere fp32, as Determined (its AMP is CUDA-only), noted once."""
        if self.device.type == "cuda":
            return _amp.autocast_module(module, self.device)
        if not self._cpu_amp_noted:
            self._cpu_amp_noted = True
            log.warning(
                "automatic mixed precision is off on %s: training runs in fp32, as "
                "Determined does (its AMP is CUDA-only). Autocast yourself with "
                "torch.autocast('cpu', dtype=torch.bfloat16) for bf16 on CPU",
                self.device,
            )
        return module

    # ---- the training step ------------------------------------------------------------
    def backward(
        self,
        loss: torch.Tensor,
        gradient: torch.Tensor | None = None,
        retain_graph: bool = False,
        create_graph: bool = False,
    ) -> None:
        """loss.backward(), scaled when AMP is automatic."""
        if not isinstance(loss, torch.Tensor):
            raise TypeError(f"context.backward takes a tensor, got {type(loss).__name__}")
        if not self._nonfinite.admit(loss, self._current_batch_idx):
            return
        if self.experimental._auto_amp and self._scaler is not None:
            loss = self._scaler.scale(loss)
        loss.backward(gradient=gradient, retain_graph=retain_graph, create_graph=create_graph)

    def _should_communicate_and_update(self) -> bool:
        return (self._current_batch_idx + 1) % self._settings.aggregation_frequency == 0

    def step_optimizer(
        self,
        optimizer: torch.optim.Optimizer,
        clip_grads: Callable[[Iterator[Any]], None] | None = None,
        auto_zero_grads: bool = True,
        scaler: torch.amp.GradScaler | None = None,
    ) -> None:
        """Step (and zero) the optimizer once every ``aggregation_frequency`` batches."""
        if id(optimizer) not in self._backward_passes:  # keyed by every wrapped optimizer
            raise TrialError(
                "step_optimizer: this optimizer was not returned by context.wrap_optimizer()"
            )
        agg = self._settings.aggregation_frequency
        if agg > 1 and not auto_zero_grads:
            raise TrialError(
                "step_optimizer(auto_zero_grads=False) cannot be combined with "
                f"optimizations.aggregation_frequency={agg}: gradients must be zeroed by the "
                "harness after each aggregated step"
            )
        if not self._should_communicate_and_update():
            return
        if not self._nonfinite.allow_step():  # every batch of this step had a NaN/inf loss
            optimizer.zero_grad()
            return
        synchronizing = id(optimizer) in self._synchronizing
        if synchronizing:
            _parallel.synchronize(optimizer)
        if agg > 1 and self._settings.average_aggregated_gradients:
            for p in _params(optimizer):
                if p.grad is not None:
                    p.grad.div_(agg)
        if scaler is None and self.experimental._auto_amp:
            scaler = self._scaler
        if clip_grads is not None or self._before_step_hooks:
            if scaler is not None:
                scaler.unscale_(optimizer)
            if clip_grads is not None:
                clip_grads(iter(_params(optimizer)))
            for hook in self._before_step_hooks:
                hook(iter(_params(optimizer)))
        with _parallel.skip_synchronize(optimizer) if synchronizing else _NO_SYNC_TO_SKIP:
            if scaler is not None:
                scaler.step(optimizer)
            else:
                optimizer.step()
        if auto_zero_grads:
            optimizer.zero_grad()

    def to_device(self, data: Any) -> Any:
        """Move generated data (tensors, numpy arrays, nested containers) to this device."""
        return to_device(data, self.device)

    def get_optimizer(self) -> torch.optim.Optimizer:
        """Deprecated: the single wrapped optimizer (as the ReduceLROnPlateau example uses)."""
        warnings.warn(
            "context.get_optimizer() is deprecated; keep the optimizer that "
            "wrap_optimizer() returned",
            DeprecationWarning,
            stacklevel=2,
        )
        if len(self.optimizers) != 1:
            raise TrialError(
                f"get_optimizer() needs exactly one wrapped optimizer, found "
                f"{len(self.optimizers)}; keep references from wrap_optimizer() instead"
            )
        return self.optimizers[0]

    # ---- profiling and tensorboard ----------------------------------------------------
    def set_profiler(self, *args: Any, **kwargs: Any) -> None:
        """Run torch.profiler.profile(*args, **kwargs) over training, stepped per batch."""
        self.profiler = torch.profiler.profile(*args, **kwargs)

    def get_enable_tensorboard_logging(self) -> bool:
        return self._settings.enable_tensorboard_logging

    def set_enable_tensorboard_logging(self, enable_tensorboard_logging: bool) -> None:
        if not isinstance(enable_tensorboard_logging, bool):
            raise TypeError(
                f"set_enable_tensorboard_logging takes a bool, got {enable_tensorboard_logging!r}"
            )
        self._settings = dataclasses.replace(
            self._settings, enable_tensorboard_logging=enable_tensorboard_logging
        )

    def get_tensorboard_path(self) -> Path:
        path = self._settings.tensorboard_path or Path("runs") / str(self._settings.trial_id)
        return Path(path)

    def get_tensorboard_writer(self) -> Any:
        """A torch SummaryWriter writing under get_tensorboard_path()."""
        if self._tensorboard_writer is None:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise TrialError(
                    "get_tensorboard_writer() needs the tensorboard package: "
                    "pip install tensorboard"
                ) from None
            self._tensorboard_writer = SummaryWriter(log_dir=str(self.get_tensorboard_path()))
        return self._tensorboard_writer

    def _close(self, clean: bool = True) -> None:
        # Leaving the process group explicitly: a rank that exits with Gloo's threads still
        # running can abort ("terminate called without an active exception").
        self.distributed.close(wait_for_others=clean)
        if self._tensorboard_writer is not None:
            self._tensorboard_writer.close()
            self._tensorboard_writer = None
        if self._metrics_sink is not None:
            self._metrics_sink.close()


def _params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _pick_device(requested: str | None, local_rank: int) -> torch.device:
    if requested:
        device = torch.device(requested)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device {requested!r} was asked for but CUDA is not available")
        return device
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank % max(torch.cuda.device_count(), 1))
    return torch.device("cpu")
