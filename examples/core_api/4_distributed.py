"""Stage 4 of the Core API tutorial: the counter on several processes.

``entrypoint: python3 -m determined.launch.torch_distributed python3 4_distributed.py``
with ``resources.slots_per_trial: 2`` starts two processes (torchrun, Gloo on CPU);
``python3 -m determined.launch.horovod python3 4_distributed.py`` (``distributed_horovod.yaml``)
starts them with horovodrun, and the script joins through ``from_horovod(hvd)``. Rank
``r`` adds ``increment_by * (r + 1)`` each batch; every 10 batches the ranks sum their
counters (``allgather``) and the chief reports the sum; every rank stores its own counter
in one sharded checkpoint (``store_path(shard=True)``) and asks ``should_preempt()`` in step
(``PreemptMode.WorkersAskChief``). A continued run's ranks all open the checkpoint
(``restore_path``: the node's chief fetches it) and take their own counter back."""

import logging
import os

import determined as det


def main(core_context: det.core.Context, latest_checkpoint, hparams: dict) -> None:
    dist = core_context.distributed
    increment_by, batches = hparams["increment_by"], hparams.get("batches", 30)
    start, x = 0, 0
    if latest_checkpoint is not None:  # every rank, in step: the node's chief fetches it
        with core_context.checkpoint.restore_path(latest_checkpoint) as path:
            start, x = (int(v) for v in path.joinpath(f"state-{dist.rank}").read_text().split(","))
    for batch in range(start, batches):
        x += increment_by * (dist.rank + 1)
        steps_completed = batch + 1
        if steps_completed % 10 == 0:
            everyone = dist.allgather(x)
            if dist.rank == 0:
                core_context.train.report_training_metrics(steps_completed, {"x": sum(everyone)})
            # Every rank stores its own share: one checkpoint of two parts (shard=True).
            metadata = {"steps_completed": steps_completed}
            with core_context.checkpoint.store_path(metadata, shard=True) as (path, _):
                path.joinpath(f"state-{dist.rank}").write_text(f"{steps_completed},{x}")
            if core_context.preempt.should_preempt():
                return
    everyone = dist.allgather(x)
    if dist.rank == 0:
        core_context.train.report_validation_metrics(batches, {"x": sum(everyone)})


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format=det.LOG_FORMAT)
    info = det.get_cluster_info()
    assert info is not None, "run it with det-tasks run distributed.yaml"
    if "HOROVOD_RANK" in os.environ:  # python3 -m determined.launch.horovod python3 ...
        import horovod.torch as hvd

        hvd.init()
        distributed = det.core.DistributedContext.from_horovod(hvd)
    else:
        distributed = det.core.DistributedContext.from_torch_distributed()
    with det.core.init(distributed=distributed) as core_context:
        main(core_context, info.latest_checkpoint, info.trial.hparams)
