"""batchlab's strategies where drafters are trained: a batch sampler for a torch ``DataLoader``, collators for a
causal LM, the Hugging Face ``Trainer`` and accelerate.

::

    from batchlab import StrategyBatchSampler
    sampler = StrategyBatchSampler(dataset=train, max_tokens=8192, strategy="packed")   # this rank's micro-batches
    loader = DataLoader(train, batch_sampler=sampler, collate_fn=sampler.collator())

``BatchlabTrainer`` (transformers) and ``prepare_dataloader`` (accelerate) are imported on first use, so
``import batchlab`` needs torch only. Pages: docs/use-in-your-training.md.
"""

from __future__ import annotations

from typing import Any

from .collate import EMPTY_KEY, PackedCollator, PaddedCollator, collator_for, empty_loss
from .lengths import DatasetLengthsError, resolve_lengths
from .run_batches import RunBatches
from .sampler import SamplerStateError, StrategyBatchSampler
from .varlen_attention import use_varlen_attention

_LAZY = {"BatchlabTrainer": "hf_trainer", "prepare_dataloader": "accelerate_loader"}

__all__ = [
    "StrategyBatchSampler", "RunBatches", "PackedCollator", "PaddedCollator", "collator_for", "empty_loss", "EMPTY_KEY",
    "resolve_lengths", "DatasetLengthsError", "SamplerStateError", "use_varlen_attention", *_LAZY,
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from importlib import import_module

        return getattr(import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'batchlab' has no attribute {name!r}")
