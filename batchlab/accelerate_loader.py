"""accelerate's ``prepare`` for a loader whose batch sampler already yields this rank's micro-batches: not sharded twice.

``Accelerator.prepare(loader)`` wraps a batch sampler in ``BatchSamplerShard``, which hands process ``i`` the batches
``i, i + n, ...``: right for a sampler that yields every rank's batches, wrong for batchlab's, which each rank plans for
itself (a rank would train on a ``1/n`` of its own share). :func:`prepare_dataloader` prepares the loader (device
placement, RNG sync, end-of-loader tracking stay accelerate's) and makes that wrapper a passthrough, as the Hugging Face
``Trainer`` does for its own rank-aware ``BatchRebalanceSampler``.
"""

from __future__ import annotations

from typing import Any


def prepare_dataloader(accelerator: Any, dataloader: Any) -> Any:
    """``accelerator.prepare(dataloader)`` keeping its rank-aware batch sampler's own batches on every process."""
    prepared = accelerator.prepare(dataloader)
    keep_rank_batches(prepared, dataloader.batch_sampler)
    return prepared


def keep_rank_batches(prepared: Any, batch_sampler: Any) -> None:
    """Make the ``BatchSamplerShard`` that ``prepare`` put around ``batch_sampler`` yield every batch of it."""
    from accelerate.data_loader import BatchSamplerShard, DataLoaderDispatcher

    if isinstance(prepared, DataLoaderDispatcher):
        raise ValueError(
            "accelerate prepared this loader with dispatch_batches=True, which reads batches on process 0 and sends "
            "them to the others; batchlab's sampler plans every rank's batches on that rank. Create the Accelerator "
            "with DataLoaderConfiguration(dispatch_batches=False)"
        )
    shard = getattr(prepared, "batch_sampler", None)
    if isinstance(shard, BatchSamplerShard):
        if shard.batch_sampler is not batch_sampler:
            raise ValueError("the prepared loader does not wrap the batch sampler it was given; prepare it once only")
        shard.num_processes, shard.process_index = 1, 0
    elif shard is not batch_sampler:
        raise ValueError(
            f"the prepared loader iterates {type(shard).__name__}, not the batch sampler it was given; pass the "
            "sampler as DataLoader(batch_sampler=...) and prepare the loader once"
        )
