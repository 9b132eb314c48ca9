"""The planned contrasts with held-out documents treated as sampled too: an interval over seeds and documents.

Each run's ``eval_samples.jsonl`` holds, at every evaluation, every held-out sample's Σw·CE and Σw
(:mod:`harness.train.loop.evaluator`). At a run's final evaluation its held-out loss is ``Σ_i ce_i / Σ_i w_i``,
and ``w_i`` is the same under every strategy and seed (one fixed held-out plan, anchors from the held-out seed).
So for a contrast A vs B over seeds ``s`` the per-sample differences ``d_si = ce_A,si − ce_B,si`` give back the
primary effect exactly, ``Σ_s Σ_i d_si / (S · Σ_i w_i)`` = the mean over seeds of final_eval_loss(A) − (B).

The primary (seed-only) interval treats the held-out documents as fixed. :func:`crossed_interval` treats seeds and
documents as two crossed random samples (a two-way random-effects model, seed × document, on each pair's
linearised per-document effects) and adds the documents' variance component to the seeds'. Its seed part is the
paired t's exactly. Written by hand: for a balanced crossed design the method-of-moments components are closed
form (REML's, where both are positive: tested against statsmodels' ``MixedLM``), and the interval needs
Satterthwaite's degrees of freedom, where ``MixedLM`` gives a normal (Wald) interval, too narrow over a few seeds.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

#: the per-sample file of a run directory (harness.train.loop.evaluator.EVAL_SAMPLES_FILE; analysis never
#: imports the trainer)
EVAL_SAMPLES_FILE = "eval_samples.jsonl"
#: the intervals' confidence level
LEVEL = 0.95
#: the report's table of every run's final held-out samples (what a study commits beside its runs.csv)
SAMPLES_CSV = "heldout_samples.csv.gz"
SAMPLE_COLUMNS = ["strategy", "seed", "sample", "weighted_ce_sum", "weight_sum"]


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
class CrossedInterval:
    """A mean effect's interval with seeds alone random (the paired t's) and with seeds and documents random."""
    effect: float
    seed_interval: tuple[float, float]
    """The paired t interval over seeds (df S − 1): documents fixed."""
    interval: tuple[float, float]
    """Seeds and documents random: t with Satterthwaite's df on the two variance components."""
    standard_error: float
    """The crossed interval's standard error: ``sqrt`` of the seeds' variance plus the documents'."""
    df: float
    """The crossed interval's degrees of freedom (S − 1 when the documents' component estimates to zero)."""
    document_share: float
    """The documents' part of the crossed variance, in [0, 1)."""


def crossed_interval(diffs: np.ndarray, weights: np.ndarray, level: float = LEVEL) -> CrossedInterval:
    """``diffs`` ``[S, N]``: A − B of Σw·CE per seed and document; ``weights`` ``[N]``: each document's Σw.

    The effect is ``Σ diffs / (S · Σ w)``; each document's share of it is linearised (the delta method for a ratio
    of sums), ``x_si = (d_si − effect · w_i) · N / Σw + effect``, so that row means are the per-seed effects. On
    ``x``: ``Var = (MS_seed + MS_doc − MS_err) / (S · N)``, the documents' part ``(MS_doc − MS_err) / (S · N)``
    floored at 0. Needs S ≥ 2 and N ≥ 2.
    """
    from scipy import stats

    diffs = np.asarray(diffs, dtype=np.float64)
    weights = np.asarray(weights, dtype=np.float64)
    seeds, documents = diffs.shape
    if seeds < 2 or documents < 2 or weights.shape != (documents,):
        raise ValueError(f"a crossed interval needs diffs [seeds >= 2, documents >= 2] and weights [documents], got "
                         f"{diffs.shape} and {weights.shape}")
    total = weights.sum()
    effect = float(diffs.sum() / (seeds * total))
    x = (diffs - effect * weights) * (documents / total) + effect
    rows, columns = x.mean(axis=1), x.mean(axis=0)
    ms_seed = documents * float(((rows - effect) ** 2).sum()) / (seeds - 1)
    ms_document = seeds * float(((columns - effect) ** 2).sum()) / (documents - 1)
    residual = x - rows[:, None] - columns[None, :] + effect
    ms_error = float((residual ** 2).sum()) / ((seeds - 1) * (documents - 1))
    cells = seeds * documents
    seed_variance = ms_seed / cells
    document_variance = max(0.0, (ms_document - ms_error) / cells)
    quantile = 0.5 + level / 2
    seed_half = float(stats.t.ppf(quantile, seeds - 1)) * math.sqrt(seed_variance)
    if document_variance > 0:
        terms = [(ms_seed, seeds - 1), (ms_document, documents - 1), (-ms_error, (seeds - 1) * (documents - 1))]
        df = (ms_seed + ms_document - ms_error) ** 2 / sum(term ** 2 / dof for term, dof in terms)
    else:
        df = float(seeds - 1)
    variance = seed_variance + document_variance
    half = float(stats.t.ppf(quantile, df)) * math.sqrt(variance)
    return CrossedInterval(effect, (effect - seed_half, effect + seed_half), (effect - half, effect + half),
                           math.sqrt(variance), float(df),
                           document_variance / variance if variance > 0 else 0.0)


@dataclass(frozen=True)
class SampleContrast:
    """A vs B from the held-out samples: the pooled effect (the primary's), its intervals over seeds alone and over
    seeds and documents, and the share of samples on which A's loss is lower."""
    a: str
    b: str
    seeds: tuple[int, ...]
    samples: int
    crossed: CrossedInterval
    share_a_lower: float

    @property
    def effect(self) -> float:
        return self.crossed.effect


def run_samples(per_run: pd.DataFrame) -> dict[tuple[str, int], pd.DataFrame | None]:
    """Every run's :func:`final_samples` by ``(strategy, seed)``, each file read once (None: no per-sample lines,
    or no ``path``)."""
    return {(row.strategy, int(row.seed)): final_samples(row.path) if isinstance(getattr(row, "path", None), str)
            else None for row in per_run.itertuples(index=False)}


def sample_contrast(per_run: pd.DataFrame, a: str, b: str,
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
    crossed = crossed_interval(diffs, weights)
    per_sample = diffs.mean(axis=0)
    counted = weights > 0
    share = float((per_sample[counted] < 0).mean()) if counted.any() else math.nan
    return SampleContrast(a, b, seeds, int(weights.size), crossed, share)


def samples_table(samples: dict[tuple[str, int], pd.DataFrame | None]) -> pd.DataFrame | None:
    """:func:`run_samples` as one table (:data:`SAMPLE_COLUMNS`); None when no run wrote per-sample lines."""
    frames = [frame.assign(strategy=strategy, seed=seed) for (strategy, seed), frame in samples.items()
              if frame is not None]
    return pd.concat(frames, ignore_index=True)[SAMPLE_COLUMNS] if frames else None


def samples_from_table(table: pd.DataFrame) -> dict[tuple[str, int], pd.DataFrame]:
    """A :func:`samples_table` read back into :func:`run_samples`' form."""
    return {(str(strategy), int(seed)): group[SAMPLE_COLUMNS[2:]].sort_values("sample").reset_index(drop=True)
            for (strategy, seed), group in table.groupby(["strategy", "seed"])}


def read_samples_table(path: str | Path) -> dict[tuple[str, int], pd.DataFrame]:
    """A committed :data:`SAMPLES_CSV`, by ``(strategy, seed)``."""
    return samples_from_table(pd.read_csv(path, float_precision="round_trip"))


def crossed_lines(per_run: pd.DataFrame, plan: Any,
                  samples: dict[tuple[str, int], pd.DataFrame | None] | None = None) -> list[str]:
    """The planned contrasts' intervals over seeds and documents (on the confirmatory seeds where the runs hold
    them, as the verdicts), a heading first; none when the runs wrote no per-sample lines."""
    from analysis.planned import INTERVALS

    samples = run_samples(per_run) if samples is None else samples
    confirmatory = {s for (_, s) in samples} & set(plan.confirmatory_seeds)
    if confirmatory:
        samples = {key: frame for key, frame in samples.items() if key[1] in confirmatory}
    lines = sample_sentences(per_run, [(c.a, c.b) for c in plan.contrasts], samples)
    if not lines:
        return []
    return [f"The same contrasts with the held-out documents treated as a sample too (secondary: the verdicts above "
            f"are decided {INTERVALS[plan.interval]}, as the preregistration declares; analysis/per_sample.py):", "",
            *(f"- {line}" for line in lines)]


def sample_sentences(per_run: pd.DataFrame, contrasts: list[tuple[str, str]],
                     samples: dict[tuple[str, int], pd.DataFrame | None] | None = None) -> list[str]:
    """One sentence per planned contrast the runs can answer per sample (none when they wrote no per-sample lines);
    ``samples``: their :func:`run_samples` (read from the runs' directories when not given)."""
    sentences = []
    samples = run_samples(per_run) if samples is None else samples
    for a, b in contrasts:
        result = sample_contrast(per_run, a, b, samples=samples)
        if result is None:
            continue
        crossed = result.crossed
        (seed_low, seed_high), (low, high) = crossed.seed_interval, crossed.interval
        sentences.append(
            f"{a} vs {b}: held-out loss {crossed.effect:+.3f}; {LEVEL:.0%} interval over the {len(result.seeds)} "
            f"seeds {seed_low:+.3f} to {seed_high:+.3f} (documents fixed), over seeds and the {result.samples} "
            f"documents {low:+.3f} to {high:+.3f} (df {crossed.df:.1f}, documents {crossed.document_share:.0%} of "
            f"its variance); {a} is lower on {result.share_a_lower:.0%} of the documents.")
    return sentences
