"""The summary's answer after the verdicts: what each strategy's throughput buys and the mechanism behind the gaps.

The planned contrasts (:mod:`analysis.planned`) say what each strategy costs in convergence. Two stored results
finish the answer to "how much throughput does each strategy buy, and what does it cost", in sentences a reader can
quote, each number with its interval:

- :func:`throughput_sentence`: the interleaved benchmark's rounds (``benchmarks/train_throughput.py --experiment
  strategies --write`` stores them as ``docs/demo/throughput_rounds.csv``: one row per round and strategy, the target
  online). Each round's tokens/s over the same round's reference run, its mean and 95 % t interval over rounds, and
  the deterministic padding each strategy's batches carry.
- :func:`mechanism_sentences`: the normaliser ablation's per-run table (``make ablation-normaliser``'s report
  ``runs.csv``, stored as ``docs/demo/ablation_normaliser_runs.csv``). For every planned contrast between two
  ablated strategies, the primary endpoint's gap under the per-step normaliser split into the part the per-step
  reweighting explains and the part left when every block weighs alike, oriented as the contrast (A − B).

Both are descriptive (intervals one at a time, no family correction): the planned contrasts are the test.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from analysis import ablation as abl
from analysis.stats import MIN_SEEDS, paired_test

#: the columns of a stored throughput-rounds table
ROUND_COLUMNS = ("round", "strategy", "tokens_per_second", "padding_ratio")


def read_throughput_rounds(path: str | Path) -> pd.DataFrame:
    """A stored throughput-rounds table; a ValueError names the missing columns and the command that writes it."""
    rounds = pd.read_csv(path, float_precision="round_trip")
    missing = [c for c in ROUND_COLUMNS if c not in rounds.columns]
    if missing:
        raise ValueError(f"{path} lacks the column(s) {missing}: give the table that "
                         "`python benchmarks/train_throughput.py --experiment strategies --write` stores")
    return rounds


def ratio_interval(ratios: np.ndarray) -> tuple[float, tuple[float, float]]:
    """The mean per-round ratio and its 95 % t interval over rounds (the rounds are the replicates of a speed
    ratio); no interval (nan) from fewer than :data:`MIN_SEEDS` rounds."""
    ratios = np.asarray(ratios, dtype=float)
    if ratios.size < MIN_SEEDS:
        return float(ratios.mean()), (float("nan"), float("nan"))
    low, high = paired_test(ratios)[1]  # the t interval of the mean ratio (the test's p is not used)
    return float(ratios.mean()), (low, high)


def round_ratios(rounds: pd.DataFrame, reference: str = "sorted") -> dict[str, np.ndarray]:
    """Per strategy, each round's tokens/s over the same round's ``reference`` run (rounds in order)."""
    speed = rounds.pivot(index="round", columns="strategy", values="tokens_per_second").sort_index()
    if reference not in speed.columns:
        raise ValueError(f"the throughput rounds have no {reference} run: the ratios are to it")
    return {s: (speed[s] / speed[reference]).to_numpy() for s in speed.columns if s != reference}


def ratio_table(rounds: pd.DataFrame, reference: str = "sorted") -> dict[str, tuple[float, float, float]]:
    """Per strategy but the reference: (mean, low, high) of its per-round ratio to the reference (the frontier
    figure's y-axis, :func:`analysis.figures.frontier`)."""
    return {strategy: (mean, *interval) for strategy, values in round_ratios(rounds, reference).items()
            for mean, interval in [ratio_interval(values)]}


def throughput_sentence(rounds: pd.DataFrame, strategies: list[str], source: str, reference: str = "sorted") -> str:
    """One sentence: each strategy's tokens/s against ``reference`` (mean over rounds and its 95 % t interval) with
    its padding, and which intervals exclude 1."""
    ratios = round_ratios(rounds, reference)
    padding = rounds.groupby("strategy")["padding_ratio"].median()
    parts, faster, slower = [], [], []
    for strategy in [s for s in strategies if s in ratios]:
        mean, (low, high) = ratio_interval(ratios[strategy])
        parts.append(f"{strategy} {mean:.2f}× [{low:.2f}, {high:.2f}] ({100 * padding[strategy]:.1f}% padding)")
        if low > 1.0:
            faster.append(strategy)
        elif high < 1.0:
            slower.append(strategy)
    rounds_count = rounds["round"].nunique()
    verdict = "; ".join(filter(None, [f"faster than {reference}: {', '.join(faster)}" if faster else "",
                                      f"slower: {', '.join(slower)}" if slower else ""]))
    return (f"Throughput each strategy buys (`{source}`: the main job's settings with the target online, "
            f"{rounds_count} interleaved rounds, tokens/s over the same round's {reference} run, 95% t interval over "
            f"rounds; {reference} pads {100 * padding[reference]:.1f}%): " + ", ".join(parts) + ". "
            + (f"Intervals that exclude 1: {verdict}." if verdict else
               f"No interval excludes 1: on this machine no strategy's speed differs from {reference}'s beyond the "
               "rounds' noise.")
            + " The padding is exact on every machine; the speed is this machine's.")


def _oriented(part: abl.StepPart, a: str, b: str) -> tuple[float, tuple, float, tuple, float, tuple]:
    """The part's (gap under the step's Σw, its interval, reweighting part, its interval, the rest, its interval),
    as ``a − b`` whichever way the ablation paired them."""
    sign = 1.0 if (part.a, part.b) == (a, b) else -1.0

    def flip(mean: float, ci: tuple[float, float]) -> tuple[float, tuple[float, float]]:
        low, high = sign * ci[0], sign * ci[1]
        return sign * mean, (min(low, high), max(low, high))

    return (*flip(part.fixed.mean, part.fixed.ci), *flip(part.mean, part.ci), *flip(part.equal.mean, part.equal.ci))


def mechanism_sentences(ablation_runs: pd.DataFrame, contrasts: list[Any], endpoint: str, source: str) -> list[str]:
    """One sentence per planned contrast (``a``, ``b`` attributes) whose two strategies the normaliser ablation ran:
    ``endpoint``'s gap A − B with each step's loss divided by its Σw, the part the per-step reweighting explains and
    what remains with every block weighed alike; each in nats with its 95 % t interval over the ablation's seeds."""
    parts = {frozenset((p.a, p.b)): p for p in abl.step_parts(ablation_runs, abl.NORMALISER) if p.metric == endpoint}
    def number(mean: float, ci: tuple[float, float]) -> str:  # the ablation section's own format, in nats
        return abl._with_interval("{:.3f}", mean, ci)

    sentences = []
    for contrast in contrasts:
        part = parts.get(frozenset((contrast.a, contrast.b)))
        if part is None:
            continue
        gap, gap_ci, reweighting, reweighting_ci, rest, rest_ci = _oriented(part, contrast.a, contrast.b)
        sentences.append(f"{contrast.a} − {contrast.b}: {number(gap, gap_ci)} with each step's loss divided by its "
                         f"Σw; the per-step reweighting accounts for {number(reweighting, reweighting_ci)}, and "
                         f"{number(rest, rest_ci)} remains with every block weighed alike (the steps' homogeneity "
                         "and the order lengths arrive in).")
    if not sentences:
        return []
    seeds = sorted({seed for p in parts.values() for seed in p.seeds})
    heading = (f"The mechanism (`{source}`, {endpoint} on seeds {', '.join(map(str, seeds))}; 95% t intervals one at "
               "a time, descriptive, not a test):")
    return [heading, "", *(f"- {s}" for s in sentences)]


def answer_lines(contrasts: list[Any], endpoint: str, strategies: list[str], throughput: tuple[pd.DataFrame, str]
                 | None = None, mechanism: tuple[pd.DataFrame, str] | None = None) -> list[str]:
    """The lines that follow the verdicts in the summary: the throughput sentence, then the mechanism's (each from
    a stored table and the path it was read from, when given)."""
    lines: list[str] = []
    if throughput is not None:
        lines += [throughput_sentence(throughput[0], strategies, throughput[1]), ""]
    if mechanism is not None:
        found = mechanism_sentences(mechanism[0], contrasts, endpoint, mechanism[1])
        lines += [*found, ""] if found else []
    return lines
