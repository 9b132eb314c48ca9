"""A process of the Trainer and loop tests: trains a tiny random Llama on batchlab's batches and logs what it trained.

``python trainer_worker.py OUT MODE [options]`` (alone, or each rank under torchrun). Every rank appends one JSON line
per micro-batch it trained to ``OUT/rank-<r>.jsonl``: the run, the epoch, the optimizer step, the documents (as token
tuples, which the test maps back to sample indices) and the loss. Modes:

- ``trainer``: ``BatchlabTrainer`` for each ``--strategies``; ``--kill-at N`` SIGKILLs the process right after the
  checkpoint of step N; ``--resume`` resumes from the last checkpoint in ``OUT/<strategy>``;
- ``loops``: the same sampler under a plain DDP loop, accelerate's ``prepare_dataloader`` and torchdata's
  ``StatefulDataLoader`` (checkpointed mid-epoch and resumed into a fresh loader).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
from pathlib import Path

import numpy as np
import torch

from harness.cli.process_exit import exits_fast

SAMPLES, VOCAB, EPOCHS, MAX_TOKENS = 48, 97, 2, 160


def dataset() -> list[dict]:
    """Samples of 4..60 random tokens, each a distinct token sequence (so a trained document names its sample)."""
    rng = np.random.default_rng(7)
    lengths = rng.integers(4, 61, SAMPLES)
    return [{"input_ids": [1 + i % (VOCAB - 1), *rng.integers(1, VOCAB, n - 1).tolist()]} for i, n in enumerate(lengths)]


def tiny_llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256))


def documents(inputs: dict) -> list[list[int]]:
    """The documents of a collated micro-batch: a packed row split where positions restart, or the unpadded rows."""
    if "batchlab_empty" in inputs:
        return []
    ids = inputs["input_ids"].tolist()
    if "attention_mask" in inputs:
        return [[t for t, m in zip(row, mask) if m] for row, mask in zip(ids, inputs["attention_mask"].tolist())]
    starts = [i for i, p in enumerate(inputs["position_ids"][0].tolist()) if p == 0] + [len(ids[0])]
    return [ids[0][a:b] for a, b in zip(starts, starts[1:])]


class Log:
    def __init__(self, out: Path, rank: int) -> None:
        self.handle = (out / f"rank-{rank}.jsonl").open("a")

    def write(self, **record) -> None:
        record["world_size"] = int(os.environ.get("WORLD_SIZE", "1"))
        self.handle.write(json.dumps(record) + "\n")
        self.handle.flush()


def run_trainer(out: Path, strategy: str, kill_at: int | None, resume: bool, log: Log) -> None:
    from transformers import TrainerCallback, TrainingArguments

    from batchlab import BatchlabTrainer

    class Recording(BatchlabTrainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            docs = documents(inputs)
            loss = super().training_step(model, inputs, num_items_in_batch)
            log.write(run=strategy, epoch=int(self.run_batches.epoch_progress(self.state.global_step)),
                      step=self.state.global_step + 1, docs=docs, loss=float(loss))
            return loss

    class KillAfterSave(TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            if state.global_step == kill_at:
                torch.distributed.barrier() if torch.distributed.is_initialized() else None
                os.kill(os.getpid(), signal.SIGKILL)

    args = TrainingArguments(str(out / strategy), num_train_epochs=EPOCHS, learning_rate=3e-3, warmup_steps=2,
                             gradient_accumulation_steps=2, save_steps=kill_at or 10_000, logging_steps=1,
                             report_to=[], use_cpu=True, disable_tqdm=True, seed=3, save_only_model=False)
    trainer = Recording(model=tiny_llama(), args=args, train_dataset=dataset(), strategy=strategy,
                        max_tokens=MAX_TOKENS, callbacks=[KillAfterSave()] if kill_at else None)
    trainer.train(resume_from_checkpoint=True if resume else None)


def run_loops(out: Path, log: Log) -> None:
    """A plain DDP loop, accelerate's prepared loader, and a StatefulDataLoader resumed mid-epoch, all packed."""
    import torch.distributed as dist
    from accelerate import Accelerator
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader
    from torchdata.stateful_dataloader import StatefulDataLoader

    from batchlab import EMPTY_KEY, StrategyBatchSampler, empty_loss, prepare_dataloader

    data = dataset()
    accelerator = Accelerator(cpu=True)  # joins the process group torchrun's environment describes
    model = DistributedDataParallel(tiny_llama()) if dist.is_initialized() else tiny_llama()
    sampler = StrategyBatchSampler(dataset=data, max_tokens=MAX_TOKENS, strategy="packed", seed=5, grad_accum=2)
    loader = DataLoader(data, batch_sampler=sampler, collate_fn=sampler.collator())
    for epoch in range(EPOCHS):  # the plain loop: every rank runs the same steps, empty micro-batches included
        sampler.set_epoch(epoch)
        bounds = sampler.step_boundaries()
        for position, batch in enumerate(loader):
            step = int(np.searchsorted(bounds, position, side="right"))
            docs = documents(batch)
            loss = empty_loss(model, batch) if EMPTY_KEY in batch else model(**batch).loss
            loss.backward()
            log.write(run="ddp", epoch=epoch, step=step, docs=docs, loss=loss.item())
    prepared = prepare_dataloader(accelerator, DataLoader(data, batch_sampler=sampler, collate_fn=sampler.collator()))
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        for batch in prepared:
            log.write(run="accelerate", epoch=epoch, step=0, docs=documents(batch), loss=0.0)
    # torchdata: stop after 3 micro-batches of epoch 1, then a fresh sampler and loader continue from the state
    sampler.set_epoch(1)
    stateful = StatefulDataLoader(data, batch_sampler=sampler, collate_fn=sampler.collator())
    for position, batch in enumerate(stateful):
        log.write(run="stateful", epoch=1, step=0, docs=documents(batch), loss=0.0)
        if position == 2:
            break
    state = stateful.state_dict()
    fresh = StrategyBatchSampler(dataset=data, max_tokens=MAX_TOKENS, strategy="packed", seed=5, grad_accum=2)
    resumed = StatefulDataLoader(data, batch_sampler=fresh, collate_fn=fresh.collator())
    resumed.load_state_dict(state)
    for batch in resumed:
        log.write(run="stateful", epoch=1, step=1, docs=documents(batch), loss=0.0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("mode", choices=["trainer", "loops"])
    parser.add_argument("--strategies", default="packed")
    parser.add_argument("--kill-at", type=int)
    parser.add_argument("--resume", action="store_true")
    options = parser.parse_args()
    torch.set_num_threads(1)
    log = Log(options.out, int(os.environ.get("RANK", "0")))
    if options.mode == "loops":
        run_loops(options.out, log)
    else:
        for strategy in options.strategies.split(","):
            run_trainer(options.out, strategy, options.kill_at, options.resume, log)
    # a process group left to the interpreter's teardown can abort it (gloo's threads: "terminate called without an
    # active exception", SIGABRT after every strategy had trained): end it here, as a training script should
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    # and no teardown at all, as batchlab's own commands end: the abort came back once the group was destroyed
    # (1 of 2 fresh-clone runs of the suite on 2026-12-08), from what the interpreter's teardown still frees
    exits_fast(main)()
