"""An infinite ``IterableDataset`` as Determined runs it (issue 50, item 4): through a plain
torch DataLoader once ``disable_dataset_reproducibility_checks()`` is called, it trains for
a length in batches or records; a length in epochs needs ``records_per_epoch``, and without
it is refused when the trial starts with one line naming it (not a TypeError). The errors
on the way there name the call that works. The trial is the corpus's ``iterable_stream``
(every record is x=1, y=1: the weight after n batches is ``1 - (1 - 2 lr) ** n``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from det_tasks import pytorch
from det_tasks.errors import TrialError
from det_tasks.runner import run_trial
from det_tasks.runner.cli import main
from tests.fixtures.trials import OneVarTrial

STREAM = Path(__file__).resolve().parents[1] / "fixtures" / "corpus" / "iterable_stream"
LR = 0.05


def _weight_after(batches: int) -> float:
    return 1 - (1 - 2 * LR) ** batches


def _run(tmp_path: Path, config: str = "const.yaml", **kwargs: Any) -> Any:
    return run_trial(
        STREAM / config, checkpoint_dir=tmp_path / "checkpoints", progress=False, **kwargs
    )


def test_an_infinite_stream_trains_for_a_length_in_batches(tmp_path: Path) -> None:
    result = _run(tmp_path)
    assert result.batches_trained == 60
    assert result.validation_metrics["weight"] == pytest.approx(_weight_after(60), rel=1e-5)
    assert [step for step, _ in result.sink.validation] == [20, 40, 60]


def test_a_length_in_records_counts_global_batches(tmp_path: Path) -> None:
    result = _run(tmp_path, overrides=["searcher.max_length={records: 40}"])
    assert result.batches_trained == 10  # 40 records / global_batch_size 4
    assert result.validation_metrics["weight"] == pytest.approx(_weight_after(10), rel=1e-5)


def test_epochs_with_records_per_epoch_train_that_many_batches(tmp_path: Path) -> None:
    result = _run(tmp_path, "epochs.yaml", overrides=["records_per_epoch=48"])
    assert result.batches_trained == 12  # one epoch of 48 records in batches of 4
    assert result.validation_metrics["weight"] == pytest.approx(_weight_after(12), rel=1e-5)


def test_a_resumed_stream_reaches_the_same_weight(tmp_path: Path) -> None:
    first = _run(tmp_path, max_batches=30)
    assert first.batches_trained == 30 and first.checkpoint_uuid
    resumed = _run(tmp_path, latest_checkpoint=first.checkpoint_uuid)
    assert resumed.batches_trained == 60
    assert resumed.validation_metrics["weight"] == pytest.approx(_weight_after(60), rel=1e-5)


@pytest.mark.parametrize(
    "config, overrides, named",
    [
        ("epochs.yaml", [], "searcher.max_length = Epoch(1)"),
        ("const.yaml", ["min_validation_period={epochs: 1}"], "min_validation_period = Epoch(1)"),
        ("const.yaml", ["min_checkpoint_period={epochs: 2}"], "min_checkpoint_period = Epoch(2)"),
    ],
)
def test_epochs_without_records_per_epoch_are_refused_in_one_line(
    tmp_path: Path, capsys: Any, config: str, overrides: list[str], named: str
) -> None:
    argv = ["run", str(STREAM / config), "--no-progress"]
    argv += [f"--checkpoint-dir={tmp_path}", *(f"-p={o}" for o in overrides)]
    assert main(argv) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert named in err[0] and "records_per_epoch" in err[0] and "Stream" in err[0]
    assert "TypeError" not in err[0]
    assert not list(tmp_path.iterdir())  # refused before any batch or checkpoint


def test_the_test_mode_refuses_it_too(tmp_path: Path) -> None:
    """`det experiment create --test` (`det-tasks run --test`) builds the loaders: the
    check that the config alone cannot make takes seconds, not a run's start."""
    with pytest.raises(TrialError, match="records_per_epoch"):
        _run(tmp_path, "epochs.yaml", test_mode=True)


class _Stream(torch.utils.data.IterableDataset):
    def __iter__(self) -> Any:
        while True:
            yield torch.ones(1), torch.ones(1)


def test_det_dataloader_names_the_plain_loader_and_the_call() -> None:
    with pytest.raises(TypeError) as err:
        pytorch.DataLoader(_Stream(), batch_size=4)
    message = str(err.value)
    assert "_Stream is an IterableDataset" in message
    assert "plain torch.utils.data.DataLoader" in message
    assert "context.experimental.disable_dataset_reproducibility_checks()" in message


def test_a_plain_loader_over_a_stream_names_only_the_call_that_works(tmp_path: Path) -> None:
    """The second error used to send the user back to det_tasks.pytorch.DataLoader, which
    refuses iterables: now it names the one call, and following it trains."""

    class StreamTrial(OneVarTrial):
        def build_training_data_loader(self) -> Any:
            return torch.utils.data.DataLoader(_Stream(), batch_size=4)

    ctx = pytorch.init(hparams={"learning_rate": LR, "global_batch_size": 4})
    with pytest.raises(TrialError) as err:
        pytorch.Trainer(StreamTrial(ctx), ctx).fit(max_length=pytorch.Batch(3))
    message = str(err.value)
    assert "context.experimental.disable_dataset_reproducibility_checks()" in message
    assert "return det_tasks.pytorch.DataLoader" not in message
    ctx = pytorch.init(hparams={"learning_rate": LR, "global_batch_size": 4})
    ctx.experimental.disable_dataset_reproducibility_checks()
    trial = StreamTrial(ctx)
    fitted = pytorch.Trainer(trial, ctx).fit(max_length=pytorch.Batch(3), checkpoint_policy="all")
    assert fitted.batches_trained == 3
    assert trial.weights[-1] == pytest.approx(_weight_after(3), rel=1e-5)
