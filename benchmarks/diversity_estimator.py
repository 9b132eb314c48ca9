"""Validates the gradient-diversity estimators on synthetic per-sample gradients whose answer is known.

The trainer estimates, per measured step, |G|² and tr Σ from the step's small batches (micro-batches or ranks;
``harness/train/loop/grad_stats.py``) and reports two diversities from the noise scale ``B = tr Σ / |G|²``:

* ``grad_diversity`` = Yin et al.'s Δ of the step's ``W`` unit-weight samples, ``(1 + B) / (W + B)``: it falls as a
  step holds more weight, so a strategy whose steps hold fewer documents (sorted: few long ones) looks more
  diverse whatever its gradients;
* ``grad_sample_diversity`` = ``1 + B`` = E|g|² / |E g|² of one unit of loss weight: 1 when every sample's
  gradient is the step's mean, larger as they disagree; no step size in it.

Two synthetic worlds, each with two arms that differ in how samples are grouped into equal-token steps: a step
holds 32 short samples or 8 long ones (sorted) or 16 and 4 (mixed), split in two micro-batches; every sample weighs
1, as the trainer's documents weigh about alike (anchors are capped per document), so a step's weight follows its
sample count:

* ``length``: a sample's gradient follows its length (short ones around one direction, long ones around an
  orthogonal one). The *sorted* arm's steps hold one length each, so their samples agree; the *mixed* arm's
  steps hold both lengths and disagree more. Known answer: sorted less diverse than mixed.
* ``topic``: a sample's gradient follows a topic independent of its length. The *sorted* arm's steps hold one
  length and both topics; the *mixed* arm's steps hold both lengths of one topic. Known answer: sorted more
  diverse than mixed (the reverse).

A third arm, *stratified*, lays a step out as the real sorted, bucketed and length_grouped steps are: a step holds
both lengths (16 short, 4 long, as mixed), but each micro-batch holds one length (those strategies fill a
micro-batch from one stretch of sorted lengths). The estimators assume a step's small batches are random splits of
its samples; here they are not. In the length world its known answer is the mixed arm's, and the estimate is far off
it (the micro-batches' disagreement reads as sample noise and |G|² is estimated near 0): the reason the report's
diversity figure is the plan's length-mix excess, not 1 + B.

The known answer is the generating distribution's own ``1 + E tr Σ_step / E |μ_step|²`` over the arm's steps.
Both estimators see exactly the small-batch norms the trainer sees (``GradientStatistics``'s estimates and
``GradientNoise``), averaged over the measured steps as the run summary averages them
(``harness/step_averages.py``).

    python benchmarks/diversity_estimator.py            # the table over 10 seeds
    python benchmarks/diversity_estimator.py --write    # also rewrite its section of RESULTS.md
"""

from __future__ import annotations

import argparse
import datetime
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness.train.loop.grad_stats import GradientNoise, GradientStatistics  # noqa: E402
from results_file import cpu_model, write_section  # noqa: E402

WORLDS = ("length", "topic")
ARMS = ("sorted", "mixed", "stratified")
DIM = 256
SHORT_WEIGHT, LONG_WEIGHT = 1.0, 1.0  # anchors are capped per document: a document's Σw hardly follows its length
NOISE = 0.8  # per-sample spread around its class mean, in units of |mean| = 1


@dataclass(frozen=True)
class Outcome:
    world: str
    arm: str
    seed: int
    truth: float  # 1 + E tr Σ_step / E |μ_step|² of the generating distribution
    sample_diversity: float  # mean over steps of 1 + B (grad_sample_diversity)
    yin_delta: float  # mean over steps of (1 + B) / (W + B) (grad_diversity)
    mean_step_weight: float
    floored: float = 0.0  # share of steps whose |G|² estimate was held at its floor (GradientNoise.G2_FLOOR)


def _steps(world: str, arm: str) -> list[list[tuple[float, int, int]]]:
    """Every step as (weight, class, length) of its samples; a class is a gradient direction (0 or 1), a length 0
    (short) or 1 (long)."""
    if world == "length":  # class = length
        if arm == "sorted":
            return [[(SHORT_WEIGHT, 0, 0)] * 32, [(LONG_WEIGHT, 1, 1)] * 8] * 40
        return [[(SHORT_WEIGHT, 0, 0)] * 16 + [(LONG_WEIGHT, 1, 1)] * 4] * 80  # mixed and stratified
    # topic world: class = topic, independent of length
    if arm == "sorted":  # one length, both topics
        return [[(SHORT_WEIGHT, k % 2, 0) for k in range(32)], [(LONG_WEIGHT, k % 2, 1) for k in range(8)]] * 40
    if arm == "stratified":  # both lengths and both topics, micro-batches by length
        return [[(SHORT_WEIGHT, k % 2, 0) for k in range(16)] + [(LONG_WEIGHT, k % 2, 1) for k in range(4)]] * 80
    return [[(SHORT_WEIGHT, t, 0)] * 16 + [(LONG_WEIGHT, t, 1)] * 4 for t in (0, 1)] * 40  # one topic, both lengths


def _truth(steps: list[list[tuple[float, int, int]]], means: np.ndarray) -> float:
    """1 + Σ_steps E tr Σ / Σ_steps |μ|², the step's population: its classes in its weight proportions."""
    trace_sum = g2_sum = 0.0
    for step in steps:
        weights = np.array([w for w, _, _ in step])
        classes = np.array([c for _, c, _ in step])
        shares = np.array([weights[classes == c].sum() for c in (0, 1)]) / weights.sum()
        mu = shares @ means
        between = float(sum(s * np.sum((means[c] - mu) ** 2) for c, s in enumerate(shares)))
        trace_sum += NOISE ** 2 + between
        g2_sum += float(mu @ mu)
    return 1.0 + trace_sum / g2_sum


def simulate(world: str, arm: str, seed: int) -> Outcome:
    """One synthetic run of ``world`` under ``arm``: every step's small-batch norms through the trainer's
    estimators."""
    rng = np.random.default_rng([seed, WORLDS.index(world), ARMS.index(arm)])
    means = np.zeros((2, DIM))
    means[0, 0] = means[1, 1] = 1.0  # two orthogonal unit directions
    steps = _steps(world, arm)
    noise = GradientNoise(ema=0.9)
    sample_div, yin, floored = [], [], []
    for step in steps:
        order = rng.permutation(len(step))
        weights = np.array([step[i][0] for i in order])
        classes = np.array([step[i][1] for i in order])
        lengths = np.array([step[i][2] for i in order])
        grads = means[classes] + rng.normal(size=(len(step), DIM)) * (NOISE / np.sqrt(DIM))
        total = weights.sum()
        if arm == "stratified":  # one micro-batch per length, as sorted-like strategies fill them
            parts = [np.flatnonzero(lengths == length) for length in (0, 1)]
        else:  # two random halves: what the estimators assume
            parts = np.array_split(np.arange(len(step)), 2)
        contributions = [(weights[part, None] * grads[part]).sum(0) / total for part in parts]
        small = [(float(c @ c), float(weights[part].sum())) for c, part in zip(contributions, parts)]
        big = sum(contributions)
        stats = noise.update(*GradientStatistics._estimate(small, float(big @ big), total), float(big @ big), total)
        sample_div.append(stats["grad_sample_diversity"])
        yin.append(stats["grad_diversity"])
        floored.append(stats["grad_noise_floored"])
    return Outcome(world, arm, seed, _truth(steps, means), float(np.mean(sample_div)), float(np.mean(yin)),
                   float(np.mean([sum(w for w, _, _ in s) for s in steps])), float(np.mean(floored)))


def table(seeds: range) -> list[dict[str, float | str]]:
    """Per world and arm: the known answer, each estimator's mean and standard deviation over ``seeds``."""
    rows = []
    for world in WORLDS:
        for arm in ARMS:
            runs = [simulate(world, arm, seed) for seed in seeds]
            sample = np.array([r.sample_diversity for r in runs])
            yin = np.array([r.yin_delta for r in runs])
            rows.append({"world": world, "arm": arm, "truth": runs[0].truth, "sample_mean": sample.mean(),
                         "sample_sd": sample.std(ddof=1), "yin_mean": yin.mean(), "yin_sd": yin.std(ddof=1),
                         "floored": float(np.mean([r.floored for r in runs]))})
    return rows


TITLE = "## Gradient-diversity estimators on synthetic gradients with a known answer"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--write", action="store_true", help="rewrite this benchmark's section of RESULTS.md")
    args = parser.parse_args()
    rows = table(range(args.seeds))
    random_split = [row for row in rows if row["arm"] != "stratified"]
    worst = max(abs(row["sample_mean"] / row["truth"] - 1) for row in random_split)
    stratified = next(row for row in rows if row["arm"] == "stratified" and row["world"] == "length")
    lines = ["| world | arm | known 1 + trΣ/‖μ‖² | grad_sample_diversity 1 + B (mean ± sd) | grad_diversity Δ (mean ± sd) "
             "| steps with ‖G‖² floored |", "|---|---|---:|---:|---:|---:|"]
    for row in rows:
        lines.append(f"| {row['world']} | {row['arm']} | {row['truth']:.3f} | {row['sample_mean']:,.3f} ± "
                     f"{row['sample_sd']:,.3f} | {row['yin_mean']:.3f} ± {row['yin_sd']:.3f} | {row['floored']:.0%} |")
    section = (
        f"{TITLE}\n\n"
        f"Command: `python benchmarks/diversity_estimator.py --write` ({args.seeds} seeds). Machine: {cpu_model()}. "
        f"Date: {datetime.date.today().isoformat()}. Deterministic (the draws follow the seeds).\n\n"
        "Synthetic per-sample gradients (dimension "
        f"{DIM}, spread {NOISE} around unit class means) through the trainer's own estimators "
        "(`GradientStatistics`' small-batch estimates, `GradientNoise`'s EMAs, every step measured), averaged over "
        "the steps as the run summary averages them. *length* world: a sample's gradient follows its length, so the "
        "sorted arm's one-length steps are the less diverse; *topic* world: it follows a topic independent of "
        "length and the mixed arm groups by topic, so the sorted arm is the more diverse. A sorted step holds 32 "
        "short or 8 long samples, a mixed one 16 and 4 (every sample weighs 1), split in two random halves; a "
        "stratified step holds the mixed step's samples with one micro-batch per length (the layout of sorted, "
        "bucketed and length_grouped steps).\n\n" + "\n".join(lines) + "\n\n"
        f"Read: with random halves, 1 + B ranks the arms as the known answer does in both worlds and lands within "
        f"{worst:.0%} of it (above it where a step holds exact halves of two topics: the estimators assume independent "
        "draws). Yin's Δ at the step's weight ranks the sorted arm above the mixed one in both worlds: it follows how "
        "many samples a step holds, not how they disagree. With one micro-batch per length (the stratified arm, the "
        f"real sorted-like layout) 1 + B reads {stratified['sample_mean']:,.0f} in the length world against a known "
        f"{stratified['truth']:.2f}: the micro-batches' disagreement passes for sample noise and |G|² is estimated near "
        f"0 ({stratified['floored']:.0%} of steps floored). So 1 + B cannot compare strategies that fill micro-batches "
        "differently; the report's table and frontier use the plan's length-mix excess instead (exact, "
        "docs/design/metrics.md), and keep 1 + B in the records and the gradient-statistics figure.\n"
    )
    print(section)
    if args.write:
        write_section(section, TITLE)


if __name__ == "__main__":
    main()
