"""Held-out evaluation: loss, accuracy per position and τ on one fixed plan, and real acceptance by speculative decoding.

The held-out set is evaluated in length terciles (:attr:`EpochData.eval_groups`: short, mid, long; each one
padded, sorted plan with fixed anchors, the same for every strategy and seed): the overall numbers and each
tercile's loss and τ, so that forgetting of one length range shows while the overall loss falls. Every rank
evaluates its share and the sums are all-reduced, so the result does not depend on the world size. Real acceptance (``eval_tau_real``) lets the drafter propose against the target's
own greedy continuation of fixed held-out prompts, as a speculative decoder would.

Per sample (``eval.per_sample``, on by default): every evaluation also appends to ``eval_samples.jsonl`` in the
run directory one line per held-out sample (``kind: "sample"``: its Σw·CE, Σw, Σ τ and blocks, from the same
logits as the pooled sums) and one per real-acceptance prompt (``kind: "prompt"``: the tokens each verification
forward accepted), each with the step. Pooled numbers hide which samples a strategy helps; a secondary analysis
with sample effects reads these. A resumed run first drops the lines after its checkpoint's step, as
``metrics.jsonl`` does.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

from harness.models.drafter_loss import DrafterLoss
from harness.train.batch import BatchCollator, RankMicroBatches, TrainingBatch
from harness.train.loop.metrics import json_value, restart_step_file
from harness.train.loop.step_stats import reduce_sum

#: the per-sample evaluation file in the run directory
EVAL_SAMPLES_FILE = "eval_samples.jsonl"


#: the words for the rows a run evaluates (eval.split), in its bar and the run's closing line
EVALUATED_ROWS = {"heldout": "held-out", "validation": "validation"}


class Evaluator:
    def __init__(self, *, data: Any, collate: BatchCollator, model: Any, comm: Any, status: Any,
                 eval_config: Any, gdn_backend: str, device: torch.device, progress: bool = False,
                 run_dir: Path | None = None, resumed_step: int | None = None,
                 replay_cache: tuple[Path, dict[str, Any]] | None = None, feature_store: Any = None) -> None:
        self.data = data
        self.collate = collate
        self.model = model
        self.comm = comm
        self.status = status
        self.settings = eval_config  # the run's eval section (harness.train.config.EvalConfig)
        self.gdn_backend = gdn_backend
        self.device = device
        self.progress = progress  # a bar of its own while it runs (the training bar stands still meanwhile)
        self._real_prompts: list | None = None
        self._replay: list | None = None  # eval.real_replay: this rank's prompts, the target's side cached
        # (cache directory, the target's identity): the target's side kept in the batchlab cache for every run
        # that replays the same prompts against the same target (None: computed by each run)
        self.replay_cache = replay_cache
        # eval.target_features=cached: the evaluated rows' features read from the cache (FeatureStore), not computed
        self.feature_store = feature_store
        # rank 0 writes the per-sample lines (a resumed run drops those after its checkpoint, a fresh one starts anew)
        self.samples_path = (Path(run_dir) / EVAL_SAMPLES_FILE
                             if run_dir is not None and comm.env.is_main and eval_config.per_sample else None)
        if self.samples_path is not None:
            restart_step_file(self.samples_path, resumed_step)

    @torch.no_grad()
    def __call__(self, global_step: int) -> dict[str, Any]:
        """Every held-out metric after optimizer step ``global_step`` (a collective: every rank calls it)."""
        groups = self.data.eval_groups
        if not groups:
            return {}
        self.status.stage("eval", global_step)
        shares = [RankMicroBatches(group.plan, self.comm.env.rank, 0, group.rows, self.collate, anchor_epoch=0)
                  for group in groups]
        bar = self._bar(sum(len(share) for share in shares))
        samples: list[dict[str, Any]] | None = [] if self.settings.per_sample else None  # only when written
        sums = [self._group_sums(share, bar, samples) for share in shares]
        total = sums[0]
        for more in sums[1:]:
            total = total + more
        record = self._metrics(total)
        record.update({
            "eval_loss_by_length": [self._metrics(s)["eval_loss"] for s in sums],
            "eval_tau_by_length": [self._metrics(s)["eval_tau"] for s in sums],
            "eval_length_groups": [group.name for group in groups],
        })
        if bar is not None:
            bar.set_description("eval: speculative decoding")
        real = self.real_acceptance()
        prompts = real.pop("eval_accepted_per_prompt", [])
        record.update(real)
        if bar is not None:
            bar.close()
        if samples is not None:
            self._write_samples(global_step, samples, prompts)
        return record

    def _write_samples(self, global_step: int, samples: list[dict[str, Any]],
                       prompts: list[tuple[int, list[int]]]) -> None:
        """Every rank's per-sample and per-prompt lines, gathered and appended by rank 0 (sample, then prompt
        order)."""
        gathered = self.comm.all_gather_object((samples, prompts))
        if self.samples_path is None:
            return
        all_samples = sorted((s for mine, _ in gathered for s in mine), key=lambda s: s["sample"])
        all_prompts = sorted((p for _, mine in gathered for p in mine), key=lambda p: p[0])
        lines = [{"step": global_step, "kind": "sample", **s} for s in all_samples]
        lines += [{"step": global_step, "kind": "prompt", "prompt": index, "accepted": accepted,
                   "tau_real": sum(accepted) / len(accepted) if accepted else math.nan}
                  for index, accepted in all_prompts]
        with self.samples_path.open("a") as handle:
            handle.write("".join(json.dumps(json_value(line), sort_keys=True) + "\n" for line in lines))

    def _bar(self, micro_batches: int) -> Any:
        """This rank's bar over its held-out micro-batches (None without progress, or on another rank than 0)."""
        if not (self.progress and self.comm.env.is_main):
            return None
        from tqdm.auto import tqdm

        return tqdm(total=micro_batches, desc=f"eval: {EVALUATED_ROWS[self.settings.split]} loss", unit="mb",
                    leave=False, dynamic_ncols=True)

    def _group_sums(self, dataset: RankMicroBatches, bar: Any = None,
                    samples: list[dict[str, Any]] | None = None) -> DrafterLoss:
        """One tercile's loss sums over every rank's share of its plan (fp64, on the host); this rank's samples'
        own sums are appended to ``samples``."""
        drafter, target = self.model.drafter, self.model.target
        total = None
        for item in range(len(dataset)):
            batch = dataset[item].to(self.device)
            if not batch.empty:
                if self.feature_store is not None:
                    features = self.feature_store.batch_features(batch, self.device, target.dtype)
                else:
                    features = target(batch.tokens, gdn_backend=self.gdn_backend,
                                      tap_layer_ids=drafter.target_layer_ids)
                with self.model.autocast():
                    blocks = drafter.prepared_block_losses(batch.drafter,
                                                           drafter.forward_prepared(batch.drafter, features))
                sums = _host_sums(blocks)
                if samples is not None:
                    samples.extend(_per_sample(batch, blocks))
                total = sums if total is None else total + sums
            if bar is not None:
                bar.update(1)
        # a rank whose share of the tercile is empty adds zeros
        return reduce_sum(total if total is not None else DrafterLoss.zeros(drafter.block_size - 1), self.comm)

    @staticmethod
    def _metrics(total: DrafterLoss) -> dict[str, Any]:
        weight, count, blocks = float(total.weight_sum), float(total.label_count), float(total.block_count)
        return {
            "eval_loss": float(total.weighted_ce_sum) / weight if weight else math.nan,
            "eval_accuracy": float(total.correct_sum) / count if count else math.nan,
            "eval_draft_vocab_miss_rate": float(total.draft_vocab_misses) / count if count else math.nan,
            "eval_accuracy_per_position": (total.correct_per_position / total.count_per_position.clamp_min(1)).tolist(),
            "eval_tau": float(total.tau_sum) / blocks if blocks else math.nan,
            "eval_blocks": int(blocks),
        }

    @torch.no_grad()
    def real_acceptance(self) -> dict[str, Any]:
        """``eval_tau_real``: greedy speculative decoding of fixed held-out prompts, shared over the ranks."""
        settings, data = self.settings, self.data
        if settings.real_prompts == 0 or data.eval_rows.size == 0:
            return {}
        from harness.eval.speculative import evaluate_acceptance, heldout_prompts

        if self._real_prompts is None:
            self._real_prompts = heldout_prompts(data.samples, data.eval_rows, settings.real_prompt_tokens,
                                                 settings.real_prompts)
        env = self.comm.env
        mine = self._real_prompts[env.rank::env.world_size]
        block = self.model.drafter.block_size
        vector = torch.zeros(block + 2, dtype=torch.float64)  # [forwards gaining 1..B tokens, tokens, forwards]
        per_prompt: list[tuple[int, list[int]]] = []  # (prompt index, tokens gained per forward), this rank's
        if mine:
            if settings.real_replay:  # the target's part once per run, then the drafter alone
                from harness.eval.replay import cached_replay, prepare_replay, replay_acceptance

                taps = self.model.drafter.target_layer_ids
                with self.model.target_autocast():
                    if self._replay is None and self.replay_cache is not None:
                        cache_dir, identity = self.replay_cache
                        self._replay = cached_replay(cache_dir, identity, lambda: self.model.target, mine,
                                                     settings.real_new_tokens, taps, gdn_backend=self.gdn_backend)
                    elif self._replay is None:
                        self._replay = prepare_replay(self.model.target, mine, settings.real_new_tokens, taps,
                                                      gdn_backend=self.gdn_backend)
                with self.model.autocast():
                    result = replay_acceptance(self.model.drafter, self._replay, settings.real_new_tokens)
            else:
                with self.model.target_autocast():
                    result = evaluate_acceptance(self.model.target, self.model.drafter, mine,
                                                 settings.real_new_tokens, gdn_backend=self.gdn_backend,
                                                 drafter_context=self.model.autocast)
            vector[:block] = torch.tensor(result["eval_tau_real_hist"], dtype=torch.float64)
            vector[block] = result["eval_real_tokens"]
            vector[block + 1] = result["eval_real_target_forwards"]
            per_prompt = [(env.rank + k * env.world_size, accepted)
                          for k, accepted in enumerate(result["eval_accepted_per_prompt"])]
        vector = self.comm.all_reduce_sum(vector)
        hist, tokens, forwards = vector[:block], float(vector[block]), float(vector[block + 1])
        gains = float(hist.sum())
        return {
            "eval_tau_real": float((hist * torch.arange(1, block + 1, dtype=torch.float64)).sum()) / gains
            if gains else math.nan,
            "eval_tau_real_hist": [int(v) for v in hist.tolist()],
            "eval_speedup_bound": tokens / forwards if forwards else math.nan,
            "eval_real_prompts": len(self._real_prompts),
            "eval_accepted_per_prompt": per_prompt,  # taken out of the record for eval_samples.jsonl
        }


def _host_sums(blocks: Any) -> DrafterLoss:
    """A micro-batch's sums in fp64 on the host, its Σw·CE, Σw and Σ τ summed from the per-block values that the
    per-sample records sum too: the endpoint then equals its records to fp64 rounding, whatever the order."""
    sums = {name: value.detach().double().cpu() for name, value in vars(blocks.sums).items()}
    sums.update(weighted_ce_sum=blocks.weighted_ce.detach().double().sum().cpu(),
                weight_sum=blocks.weight.detach().double().sum().cpu(),
                tau_sum=blocks.tau.detach().double().sum().cpu())
    return DrafterLoss(**sums)


def _per_sample(batch: TrainingBatch, blocks: Any) -> list[dict[str, Any]]:
    """Each document of ``batch``: its dataset row, length, Σw·CE, Σw, Σ τ and kept blocks (host numbers)."""
    layout = batch.drafter.layout
    documents = int(batch.sample_indices.numel())
    doc = layout.doc_index.cpu()

    def per_document(values: torch.Tensor) -> list[float]:
        return torch.zeros(documents, dtype=torch.float64).index_add_(0, doc, values.detach().double().cpu()).tolist()

    ce, weight, tau = (per_document(v) for v in (blocks.weighted_ce, blocks.weight, blocks.tau))
    kept = per_document(layout.keep.double())
    return [{"sample": int(row), "length": int(length), "weighted_ce_sum": ce[d], "weight_sum": weight[d],
             "tau_sum": tau[d], "blocks": int(kept[d])}
            for d, (row, length) in enumerate(zip(batch.sample_indices.tolist(), batch.lengths.tolist()))]
