"""The planned contrasts per held-out sample: a secondary analysis beside the primary per-seed test, never instead.

Each run's ``eval_samples.jsonl`` holds, at every evaluation, every held-out sample's Σw·CE and Σw
(:mod:`harness.train.loop.evaluator`). At a run's final evaluation its held-out loss is ``Σ_i ce_i / Σ_i w_i``,
and ``w_i`` is the same under every strategy and seed (one fixed held-out plan, anchors from the held-out seed).
So for a contrast A vs B over seeds ``s`` the per-sample differences ``d_si = ce_A,si − ce_B,si`` give back the
primary effect exactly, ``Σ_s Σ_i d_si / (S · Σ_i w_i)`` = the mean over seeds of final_eval_loss(A) − (B).

What they add is an interval that carries both spreads: a hierarchical bootstrap (seeds resampled with
replacement, then held-out samples, :data:`ROUNDS` rounds from a fixed generator), and the share of held-out samples
whose loss over the seeds is lower under A (how widely an effect is shared). Over few seeds the seed level still
dominates, and resampling 3 seeds understates their spread (a bootstrap of n values has (n − 1)/n of their
variance and few distinct draws): the interval is no substitute for the primary t interval, and no test is made.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

#: the per-sample file of a run directory (harness.train.loop.evaluator.EVAL_SAMPLES_FILE; analysis never
#: imports the trainer)
EVAL_SAMPLES_FILE = "eval_samples.jsonl"
#: bootstrap rounds and the generator's seed
ROUNDS = 2000
BOOTSTRAP_SEED = 20261206


def final_samples(run_dir: str | Path) -> pd.DataFrame | None:
    """The held-out samples' Σw·CE and Σw at a run's last evaluation (columns sample, weighted_ce_sum, weight_sum),
    or None when the run wrote no ``eval_samples.jsonl``."""
    path = Path(run_dir) / EVAL_SAMPLES_FILE
    if not path.exists():
        return None
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    samples = [line for line in lines if line.get("kind") == "sample"]
    if not samples:
        return None
    last = max(line["step"] for line in samples)
    frame = pd.DataFrame([line for line in samples if line["step"] == last])
    return frame[["sample", "weighted_ce_sum", "weight_sum"]].sort_values("sample").reset_index(drop=True)


@dataclass(frozen=True)
class SampleContrast:
    """A vs B from the held-out samples: the pooled effect (the primary's), its hierarchical-bootstrap interval,
    and the share of samples on which A's loss is lower."""
    a: str
    b: str
    seeds: tuple[int, ...]
    samples: int
    effect: float
    interval: tuple[float, float]
    share_a_lower: float


def run_samples(per_run: pd.DataFrame) -> dict[tuple[str, int], pd.DataFrame | None]:
    """Every run's :func:`final_samples` by ``(strategy, seed)``, each file read once (None: no per-sample lines,
    or no ``path``)."""
    return {(row.strategy, int(row.seed)): final_samples(row.path) if isinstance(getattr(row, "path", None), str)
            else None for row in per_run.itertuples(index=False)}


def sample_contrast(per_run: pd.DataFrame, a: str, b: str, rounds: int = ROUNDS, seed: int = BOOTSTRAP_SEED,
                    samples: dict[tuple[str, int], pd.DataFrame | None] | None = None) -> SampleContrast | None:
    """``per_run``: one row per run with ``strategy``, ``seed`` and ``path`` (its directory); ``samples``: their
    :func:`run_samples`, when already read. None when a run of the pair lacks per-sample lines or the two
    strategies share fewer than two seeds."""
    samples = run_samples(per_run) if samples is None else samples
    tables = {key: frame for key, frame in samples.items() if key[0] in (a, b)}
    if any(frame is None for frame in tables.values()):
        return None
    seeds = tuple(sorted({s for (strategy, s) in tables if strategy == a} & {s for (strategy, s) in tables if strategy == b}))
    if len(seeds) < 2:
        return None
    reference = tables[a, seeds[0]]
    for key, frame in tables.items():
        if not (frame["sample"].equals(reference["sample"]) and np.allclose(frame["weight_sum"], reference["weight_sum"])):
            raise ValueError(f"run {key}: its held-out samples or their weights differ from {a}, seed {seeds[0]}'s; "
                             "the runs were not evaluated on one held-out plan")
    weights = reference["weight_sum"].to_numpy(dtype=np.float64)
    diffs = np.stack([tables[a, s]["weighted_ce_sum"].to_numpy(dtype=np.float64)
                      - tables[b, s]["weighted_ce_sum"].to_numpy(dtype=np.float64) for s in seeds])  # [S, N]
    effect = float(diffs.sum() / (len(seeds) * weights.sum()))
    rng = np.random.default_rng(seed)
    estimates = np.empty(rounds)
    for k in range(rounds):
        pick_seeds = rng.integers(0, len(seeds), len(seeds))
        pick_samples = rng.integers(0, weights.size, weights.size)
        estimates[k] = diffs[np.ix_(pick_seeds, pick_samples)].sum() / (len(seeds) * weights[pick_samples].sum())
    low, high = np.quantile(estimates, [0.025, 0.975])
    per_sample = diffs.mean(axis=0)
    counted = weights > 0
    share = float((per_sample[counted] < 0).mean()) if counted.any() else math.nan
    return SampleContrast(a, b, seeds, int(weights.size), effect, (float(low), float(high)), share)


def sample_sentences(per_run: pd.DataFrame, contrasts: list[tuple[str, str]]) -> list[str]:
    """One sentence per planned contrast the runs can answer per sample (none when they wrote no per-sample lines)."""
    sentences = []
    samples = run_samples(per_run)
    for a, b in contrasts:
        result = sample_contrast(per_run, a, b, samples=samples)
        if result is None:
            continue
        low, high = result.interval
        sentences.append(
            f"{a} vs {b}, per held-out sample (secondary): held-out loss {result.effect:+.3f} (95% hierarchical "
            f"bootstrap over {len(result.seeds)} seeds and {result.samples} samples {low:+.3f} to {high:+.3f}); "
            f"{a} is lower on {result.share_a_lower:.0%} of the samples.")
    return sentences
