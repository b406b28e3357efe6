"""Determined's ``hf_trainer_api`` example in miniature: a Hugging Face ``Trainer`` reports
through ``DetCallback``; nothing is downloaded.

The model is a 2-layer GPT-2 built from a config in code (tiny dims, no dropout), the data
synthetic token sequences from a seeded generator. The callback reports the Trainer's logs
(``loss``, ``learning_rate``...; ``eval_loss``...), stores each checkpoint the Trainer saves,
stops training at a pause or preemption after a checkpoint, and on activate downloads
``latest_checkpoint`` so ``trainer.train(resume_from_checkpoint=...)`` continues.

    det-tasks run examples/hf_trainer/const.yaml
"""

import logging
import tempfile
import time

import determined as det
import torch
import transformers
from determined.transformers import DetCallback


class TokenSequences(torch.utils.data.Dataset):
    """``count`` random sequences of ``length`` tokens; each is its own label (a language
    model's next-token loss)."""

    def __init__(self, count: int, length: int, vocab: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(0, vocab, (count, length), generator=generator)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> dict:
        return {"input_ids": self.tokens[index], "labels": self.tokens[index]}


class SlowSteps(transformers.TrainerCallback):
    """Sleeps after each step (a stop request then arrives mid-training in a demo)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_step_end(self, args, state, control, **kwargs) -> None:
        time.sleep(self.seconds)


def tiny_gpt2(hparams: dict) -> transformers.GPT2LMHeadModel:
    config = transformers.GPT2Config(
        vocab_size=hparams["vocab_size"],
        n_positions=hparams["sequence_length"],
        n_embd=hparams["hidden_size"],
        n_layer=2,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    torch.manual_seed(hparams["seed"])
    return transformers.GPT2LMHeadModel(config)


def training_arguments(hparams: dict, output_dir: str) -> transformers.TrainingArguments:
    return transformers.TrainingArguments(
        output_dir=output_dir,
        max_steps=hparams["max_steps"],
        per_device_train_batch_size=hparams["batch_size"],
        per_device_eval_batch_size=hparams["batch_size"],
        learning_rate=hparams["learning_rate"],
        logging_steps=1,
        eval_strategy="steps",
        eval_steps=hparams["eval_steps"],
        save_steps=hparams["save_steps"],
        seed=hparams["seed"],
        use_cpu=True,
        report_to=[],
        disable_tqdm=True,
        dataloader_num_workers=0,
    )


def main(core_context: det.core.Context, hparams: dict) -> None:
    args = training_arguments(hparams, tempfile.mkdtemp(prefix="hf-trainer-"))
    callback = DetCallback(core_context, args, user_data={"example": "hf_trainer"})
    length, vocab = hparams["sequence_length"], hparams["vocab_size"]
    trainer = transformers.Trainer(
        model=tiny_gpt2(hparams),
        args=args,
        train_dataset=TokenSequences(64, length, vocab, seed=1),
        eval_dataset=TokenSequences(16, length, vocab, seed=2),
        callbacks=[callback, SlowSteps(hparams.get("step_seconds", 0.0))],
    )
    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format=det.LOG_FORMAT)
    info = det.get_cluster_info()
    assert info is not None, "run it with `det-tasks run const.yaml`"
    with det.core.init() as core_context:
        main(core_context, info.trial.hparams)
