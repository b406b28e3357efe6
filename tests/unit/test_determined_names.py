"""Determined 0.38's public names that user code touches: served, or refused saying what
to use instead (never a bare AttributeError deep inside a trial)."""

from __future__ import annotations

import logging

import pytest
import torch

from det_tasks import compat, pytorch
from det_tasks.checkpoints.store import LocalDirectoryStore
from det_tasks.pytorch import samplers
from det_tasks.sinks import InMemoryMetricsSink
from tests.fixtures.trials import OneVarTrial


@pytest.fixture()
def det():
    compat.install()
    import determined

    return determined


def test_log_format_is_determineds_and_formats_a_record(det):
    assert det.LOG_FORMAT == "%(levelname)s: [%(process)s] %(name)s: %(message)s"
    record = logging.LogRecord("trial", logging.INFO, __file__, 1, "hello", None, None)
    record.process = 42
    assert logging.Formatter(det.LOG_FORMAT).format(record) == "INFO: [42] trial: hello"


def test_served_top_level_names(det):
    assert det.TrialInfo is not None and det.ClusterInfo is not None
    assert det.LegacyTrial is pytorch.PyTorchTrial
    assert issubclass(det.errors.InvalidExperimentException, Exception)
    with pytest.raises(det.errors.InvalidExperimentException, match="bad"):
        raise det.errors.InvalidExperimentException("bad")


@pytest.mark.parametrize("name", ["EnvContext", "RendezvousInfo", "TrialController", "Double"])
def test_unsupported_names_refuse_when_used_and_say_what_to_use(det, name):
    stand_in = getattr(det, name)
    with pytest.raises(NotImplementedError, match=f"determined.{name} is not supported.*: "):
        stand_in()


def test_unknown_names_list_what_is_served(det):
    with pytest.raises(AttributeError, match="TFKerasTrial is not supported"):
        det.keras  # noqa: B018
    with pytest.raises(AttributeError, match="Lightning adapter is not supported"):
        det.pytorch.lightning  # noqa: B018
    with pytest.raises(AttributeError, match=r"serves .*PyTorchTrial"):
        det.pytorch.DeepSpeedTrial  # noqa: B018


class ReducerOnContextTrial(OneVarTrial):
    """Registers its reducer on the context itself, as 0.38 trials do."""

    def __init__(self, context):
        super().__init__(context)
        self.seen = context.wrap_reducer(lambda xs: sum(xs), name="records")
        self.initial_batch_in_fit: list[int] = []

    def train_batch(self, batch, epoch_idx, batch_idx):
        self.seen.update(len(batch[0]))
        self.initial_batch_in_fit.append(self.context.get_initial_batch())
        return super().train_batch(batch, epoch_idx, batch_idx)


def test_wrap_reducer_and_get_initial_batch_on_the_context(tmp_path):
    store = LocalDirectoryStore(tmp_path)

    def fit(batches, latest=None):
        sink = InMemoryMetricsSink()
        ctx = pytorch.init(
            hparams={"learning_rate": 0.1, "global_batch_size": 4},
            metrics_sink=sink,
            checkpoint_store=store,
        )
        trial = ReducerOnContextTrial(ctx)
        assert ctx.get_initial_batch() == 0
        result = pytorch.Trainer(trial, ctx).fit(
            max_length=pytorch.Batch(batches),
            reporting_period=pytorch.Batch(3),
            checkpoint_policy="none",
            latest_checkpoint=latest,
        )
        return trial, sink, result

    _, sink, first = fit(3)
    assert [m["records"] for _, m in sink.training] == [12]
    trial, sink, _ = fit(6, latest=first.checkpoint_uuid)
    assert set(trial.initial_batch_in_fit) == {3}
    assert [m["records"] for _, m in sink.training] == [12]


def test_adapt_batch_sampler_repeats_shards_then_skips():
    base = torch.utils.data.BatchSampler(range(8), batch_size=2, drop_last=False)
    adapted = pytorch.adapt_batch_sampler(base, repeat=True, skip=1, num_replicas=2, rank=1)
    assert isinstance(adapted, samplers.SkipBatchSampler)
    it = iter(adapted)
    # Rank 1 of 2 gets batches 1, 3, 1, 3, ... of [0,1] [2,3] [4,5] [6,7]; skip the first.
    assert [next(it) for _ in range(3)] == [[6, 7], [2, 3], [6, 7]]
