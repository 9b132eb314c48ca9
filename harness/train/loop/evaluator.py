"""Held-out evaluation: loss, accuracy per position and τ on one fixed plan, and real acceptance by speculative decoding.

The held-out set is evaluated in length terciles (:attr:`EpochData.eval_groups`: short, mid, long; each one
padded, sorted plan with fixed anchors, the same for every strategy and seed): the overall numbers and each
tercile's loss and τ, so that forgetting of one length range shows while the overall loss falls. Every rank
evaluates its share and the sums are all-reduced, so the result does not depend on the world size. Real acceptance (``eval_tau_real``) lets the drafter propose against the target's
own greedy continuation of fixed held-out prompts, as a speculative decoder would.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from harness.models.drafter_loss import DrafterLoss
from harness.train.batch import BatchCollator, RankMicroBatches
from harness.train.loop.step_stats import reduce_sum


class Evaluator:
    def __init__(self, *, data: Any, collate: BatchCollator, model: Any, comm: Any, status: Any,
                 eval_config: Any, gdn_backend: str, device: torch.device, progress: bool = False) -> None:
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
        sums = [self._group_sums(share, bar) for share in shares]
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
        record.update(self.real_acceptance())
        if bar is not None:
            bar.close()
        return record

    def _bar(self, micro_batches: int) -> Any:
        """This rank's bar over its held-out micro-batches (None without progress, or on another rank than 0)."""
        if not (self.progress and self.comm.env.is_main):
            return None
        from tqdm.auto import tqdm

        return tqdm(total=micro_batches, desc="eval: held-out loss", unit="mb", leave=False, dynamic_ncols=True)

    def _group_sums(self, dataset: RankMicroBatches, bar: Any = None) -> DrafterLoss:
        """One tercile's loss sums over every rank's share of its plan (fp64, on the host)."""
        drafter, target = self.model.drafter, self.model.target
        total = None
        for item in range(len(dataset)):
            batch = dataset[item].to(self.device)
            if not batch.empty:
                features = target(batch.tokens, gdn_backend=self.gdn_backend, tap_layer_ids=drafter.target_layer_ids)
                with self.model.autocast():
                    sums = drafter.prepared_loss(batch.drafter,
                                                 drafter.forward_prepared(batch.drafter, features)).detach()
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
            "eval_accuracy_per_position": (total.correct_per_position / total.count_per_position.clamp_min(1)).tolist(),
            "eval_tau": float(total.tau_sum) / blocks if blocks else math.nan,
            "eval_blocks": int(blocks),
        }

    @torch.no_grad()
    def real_acceptance(self) -> dict[str, Any]:
        """``eval_tau_real``: greedy speculative decoding of fixed held-out prompts, shared over the ranks."""
        settings, data = self.settings, self.data
        if settings.real_prompts == 0 or data.heldout_rows.size == 0:
            return {}
        from harness.eval.speculative import evaluate_acceptance, heldout_prompts

        if self._real_prompts is None:
            self._real_prompts = heldout_prompts(data.samples, data.heldout_rows, settings.real_prompt_tokens,
                                                 settings.real_prompts)
        env = self.comm.env
        mine = self._real_prompts[env.rank::env.world_size]
        block = self.model.drafter.block_size
        vector = torch.zeros(block + 2, dtype=torch.float64)  # [forwards gaining 1..B tokens, tokens, forwards]
        if mine:
            with self.model.autocast():
                result = evaluate_acceptance(self.model.target, self.model.drafter, mine, settings.real_new_tokens,
                                             gdn_backend=self.gdn_backend)
            vector[:block] = torch.tensor(result["eval_tau_real_hist"], dtype=torch.float64)
            vector[block] = result["eval_real_tokens"]
            vector[block + 1] = result["eval_real_target_forwards"]
        vector = self.comm.all_reduce_sum(vector)
        hist, tokens, forwards = vector[:block], float(vector[block]), float(vector[block + 1])
        gains = float(hist.sum())
        return {
            "eval_tau_real": float((hist * torch.arange(1, block + 1, dtype=torch.float64)).sum()) / gains
            if gains else math.nan,
            "eval_tau_real_hist": [int(v) for v in hist.tolist()],
            "eval_speedup_bound": tokens / forwards if forwards else math.nan,
            "eval_real_prompts": len(self._real_prompts),
        }
