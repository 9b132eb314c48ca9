"""The Hugging Face ``Trainer`` on batchlab's batches: ``BatchlabTrainer(..., strategy="packed", max_tokens=4096)``.

It differs from ``Trainer`` only in where batches come from: each rank's micro-batches of a strategy's plan
(:class:`~batchlab.sampler.StrategyBatchSampler`, ``gradient_accumulation_steps`` of them a step), all epochs as one
sequence (:class:`~batchlab.run_batches.RunBatches`, so epochs of different lengths lose nothing), a collator for the
layout, and ``batchlab_sampler.json`` in every checkpoint: resuming continues mid-epoch with the same batches, also on
another number of processes (the ``Trainer`` skips the steps done as placeholders its loader never collates).
Rationale: docs/design/other-trainers.md.
"""

from __future__ import annotations

import json
import os
from typing import Any

from torch.utils.data import DataLoader
from transformers import Trainer, TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

from .accelerate_loader import keep_rank_batches
from .collate import EMPTY_KEY, empty_loss
from .run_batches import RunBatches
from .sampler import StrategyBatchSampler

#: the file in a checkpoint folder that says where the run's batches stood
STATE_FILE = "batchlab_sampler.json"


class BatchlabTrainer(Trainer):
    """A ``transformers.Trainer`` whose training batches are a batchlab strategy's micro-batches.

    Args (besides the ``Trainer``'s own, ``train_dataset`` required):
        max_tokens: the token budget of one micro-batch (``per_device_train_batch_size`` is not used).
        strategy: a registered strategy name, ``"packed"`` by default.
        strategy_options: the strategy's options by name.
        lengths: the samples' lengths (see :class:`StrategyBatchSampler`); None reads them from the dataset.
        max_samples, oversize, balance, tokens_column: as for :class:`StrategyBatchSampler`.

    The seed is ``args.data_seed`` (else ``args.seed``), the rank and world size are the ``TrainingArguments``'.
    Without a ``data_collator``, the layout's collator is used, padding with the tokenizer's pad token.
    """

    def __init__(self, *args: Any, max_tokens: int, strategy: str = "packed",
                 strategy_options: dict[str, Any] | None = None, lengths: Any = None, max_samples: int | None = None,
                 oversize: str = "error", balance: Any = None, tokens_column: str = "input_ids", **kwargs: Any) -> None:
        user_collator = (args[2] if len(args) > 2 else kwargs.get("data_collator")) is not None
        super().__init__(*args, **kwargs)
        if self.train_dataset is None:
            raise ValueError("BatchlabTrainer needs train_dataset: its batches are planned from the samples' lengths")
        sampling = getattr(self.args, "train_sampling_strategy", None) or (
            "group_by_length" if getattr(self.args, "group_by_length", False) else "random")
        if sampling != "random":
            raise ValueError(
                f"the TrainingArguments ask for {sampling!r} sampling, but BatchlabTrainer's strategy orders and groups "
                "the samples itself; leave the Trainer's sampling at its default and pick strategy= instead"
            )
        self.batch_sampler = StrategyBatchSampler(
            lengths, dataset=self.train_dataset, max_tokens=max_tokens, strategy=strategy,
            strategy_options=strategy_options, max_samples=max_samples, oversize=oversize, balance=balance,
            seed=self.args.data_seed if self.args.data_seed is not None else self.args.seed,
            rank=self.args.process_index, world_size=self.args.world_size,
            grad_accum=self.args.gradient_accumulation_steps, tokens_column=tokens_column)
        if not user_collator:
            self.data_collator = self.batch_sampler.collator(pad_token_id=self._pad_token_id())
        self.run_batches: RunBatches | None = None
        self._resume: dict[str, Any] | None = None
        # first, so the state file is in the checkpoint before any user callback sees the save
        self.callback_handler.callbacks.insert(0, _RunBatchesCallback(self))

    # ---------------------------------------------------------------- what the Trainer calls
    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        if resume_from_checkpoint is True:
            resume_from_checkpoint = get_last_checkpoint(self.args.output_dir)
            if resume_from_checkpoint is None:
                raise ValueError(f"no checkpoint found in output_dir {self.args.output_dir!r} to resume from")
        self._resume = read_checkpoint_state(resume_from_checkpoint) if resume_from_checkpoint else None
        return super().train(resume_from_checkpoint, *args, **kwargs)

    def get_train_dataloader(self) -> DataLoader:
        args = self.args
        self.run_batches = RunBatches(self.batch_sampler, epochs=args.num_train_epochs,
                                      max_steps=args.max_steps if args.max_steps > 0 else None, resume=self._resume)
        loader = DataLoader(
            self.train_dataset, batch_sampler=self.run_batches, collate_fn=self.data_collator,
            num_workers=args.dataloader_num_workers, pin_memory=args.dataloader_pin_memory,
            persistent_workers=args.dataloader_persistent_workers and args.dataloader_num_workers > 0,
            prefetch_factor=args.dataloader_prefetch_factor if args.dataloader_num_workers > 0 else None)
        prepared = self.accelerator.prepare(loader)
        keep_rank_batches(prepared, self.run_batches)
        return prepared

    def set_initial_training_values(self, args: Any, dataloader: Any) -> tuple[int, int, int, int, int, int, int]:
        """The whole run is one ``Trainer`` epoch of :attr:`run_batches`: its steps are exactly the plans' steps."""
        values = super().set_initial_training_values(args, dataloader)
        total_train_batch_size = values[4]
        steps, samples = self.run_batches.steps, len(self.train_dataset)
        return 1, steps, samples, int(samples * args.num_train_epochs), total_train_batch_size, len(dataloader), steps

    def compute_loss(self, model: Any, inputs: dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: Any = None) -> Any:
        if inputs.pop(EMPTY_KEY, None) is not None:  # a rank's empty micro-batch: join the backward with zero
            loss = empty_loss(model, inputs)
            return (loss, None) if return_outputs else loss
        return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                    num_items_in_batch=num_items_in_batch)

    # ---------------------------------------------------------------- helpers
    def _pad_token_id(self) -> int:
        for source in (self.processing_class, getattr(self.model, "config", None)):
            pad = getattr(source, "pad_token_id", None)
            if isinstance(pad, int):
                return pad
        return 0


def read_checkpoint_state(checkpoint: str) -> dict[str, Any]:
    """The run's batch state saved in ``checkpoint`` (a ``Trainer`` checkpoint folder written by ``BatchlabTrainer``)."""
    path = os.path.join(checkpoint, STATE_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"{path} is missing: {checkpoint} was not written by BatchlabTrainer, so where its epoch stood is unknown. "
            "Resume from a BatchlabTrainer checkpoint, or start a fresh run"
        )
    with open(path) as handle:
        return json.load(handle)


class _RunBatchesCallback(TrainerCallback):
    """Writes the batch state into every checkpoint and reports the run's real epoch (not the one long ``Trainer``
    epoch)."""

    def __init__(self, trainer: BatchlabTrainer) -> None:
        self.trainer = trainer

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        state.epoch = self.trainer.run_batches.epoch_progress(state.global_step)

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not state.is_world_process_zero:
            return
        folder = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        path = os.path.join(folder, STATE_FILE)
        with open(path + ".tmp", "w") as handle:
            json.dump(self.trainer.run_batches.checkpoint(state.global_step), handle)
        os.replace(path + ".tmp", path)
