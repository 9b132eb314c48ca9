"""The step-mode ablation: how much of a gap between two strategies is the number of optimizer steps they take.

At a fixed accumulation (a fixed number of micro-batches of one slot budget per step) a strategy that pads more
takes more, smaller optimizer steps for the same tokens; at equal-token steps (``trainer.step_tokens``) every
strategy takes the same steps. A sweep that runs the same strategies in both modes with the same seeds
(``batchlab-train -m experiment=ablation_steps``) separates the two causes. For strategies A and B and a metric m
(held-out loss, τ real), paired by seed:

- the gap in a mode = mean over seeds of m(A) − m(B), with its 95 % t interval;
- the step-count part = gap(fixed accumulation) − gap(equal-token steps), per seed, then its mean and interval:
  what changes when only the step mode changes. What remains at equal steps is the part batch composition can
  explain.

The same arithmetic splits a gap by the loss normaliser (``batchlab-train -m experiment=ablation_normaliser``,
:data:`NORMALISER`): the gap with the step's Σw as the divisor (every trainer's practice) minus the gap with one
constant per epoch (every block weighs alike) is the part the per-step reweighting explains; the gap left under the
constant is what the steps' homogeneity and the order lengths arrive in do with equal weights.

The intervals are per comparison, without a family correction: the ablation describes; the significance of a
ranking is the main sweep's Holm-corrected tests (:mod:`analysis.stats`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import combinations

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from analysis.compare import format_table, strategy_table
from analysis.figures import STYLE, StrategyStyle
from analysis.load import EPOCH_NORMALISER, STEP_NORMALISER, order_strategies
from analysis.stats import MIN_SEEDS, paired_test
from analysis.summary import md_table

FIXED, EQUAL = "fixed accumulation", "equal-token steps"
MODES = (FIXED, EQUAL)
#: metric → (words, format of a value)
METRICS = {"final_eval_loss": ("held-out loss", "{:.3f}"), "final_eval_tau_real": ("τ real", "{:.2f}")}
#: the ablation table: column → (heading, format)
TABLE_COLUMNS = {"steps": ("optimizer steps", "{:.0f}"), "clipped_pct": ("clipped", "{:.1f}%"),
                 "final_eval_loss": ("held-out loss", "{:.3f}"), "final_eval_tau_real": ("τ real", "{:.2f}")}
HEADING = "Ablation: optimizer steps or batch composition?"


@dataclass(frozen=True)
class Factor:
    """What an ablation sweep varies besides the strategy: the per-run column naming the arm, its two arms (the
    part is gap(first) − gap(second)), the arm in words, the report's heading, figure title and figure name, and
    its csv: the file and the column of each arm's gap (the prefix of its interval's columns) and of the part."""
    column: str
    arms: tuple[str, str]
    words: str
    heading: str
    title: str
    figure: str
    csv: str
    gap_columns: tuple[tuple[str, str], tuple[str, str]]
    part_column: str


STEP_MODE = Factor("step_mode", (FIXED, EQUAL), "step mode", HEADING,
                   "Same tokens in both modes: what changes between them is the optimizer step count; the gap left "
                   "at equal steps is composition's", "ablation_steps", "ablation.csv",
                   (("gap_fixed_accumulation", "gap_fixed"), ("gap_equal_steps", "gap_equal")), "step_mode_part")
NORMALISER = Factor("loss_normaliser", (STEP_NORMALISER, EPOCH_NORMALISER), "loss normaliser",
                    "Mechanism: per-step reweighting or step composition?",
                    "Same steps and tokens: the gap left under one constant divisor is the steps' composition; the "
                    "rest is the per-step reweighting", "ablation_normaliser", "ablation_normaliser.csv",
                    (("gap_step", "gap_step"), ("gap_epoch", "gap_epoch")), "reweighting_part")
FACTORS = (STEP_MODE, NORMALISER)


@dataclass
class Gap:
    """m(a) − m(b) in one mode, paired by seed."""
    metric: str
    a: str
    b: str
    mode: str
    seeds: list[int]
    mean: float
    ci: tuple[float, float]


@dataclass
class StepPart:
    """gap(fixed accumulation) − gap(equal-token steps), paired by seed; ``fixed`` and ``equal`` are the gaps."""
    metric: str
    a: str
    b: str
    seeds: list[int]
    mean: float
    ci: tuple[float, float]
    fixed: Gap
    equal: Gap


def _values(per_run: pd.DataFrame, strategy: str, mode: str, metric: str, factor: Factor = STEP_MODE) -> pd.Series:
    rows = per_run[(per_run["strategy_name"] == strategy) & (per_run[factor.column] == mode)]
    return rows.set_index("seed")[metric].astype(float).dropna()


def ablated_strategies(per_run: pd.DataFrame, factor: Factor = STEP_MODE) -> list[str]:
    """The strategies run in both arms of ``factor`` (in report order); the ablation needs two of them."""
    if not {"strategy_name", factor.column} <= set(per_run.columns):
        return []
    both = [s for s in per_run["strategy_name"].unique()
            if set(per_run.loc[per_run["strategy_name"] == s, factor.column]) >= set(factor.arms)]
    return order_strategies(both)


def has_ablation(per_run: pd.DataFrame, factor: Factor = STEP_MODE) -> bool:
    return len(ablated_strategies(per_run, factor)) >= 2


def _interval(diffs: np.ndarray) -> tuple[float, tuple[float, float]]:
    if diffs.size < MIN_SEEDS:
        return float(diffs.mean()) if diffs.size else math.nan, (math.nan, math.nan)
    return float(diffs.mean()), paired_test(diffs)[1]


def _diffs(per_run: pd.DataFrame, metric: str, a: str, b: str, mode: str, seeds: list[int],
           factor: Factor = STEP_MODE) -> np.ndarray:
    """m(a) − m(b) in arm ``mode``, one value per seed of ``seeds``."""
    return (_values(per_run, a, mode, metric, factor)[seeds] - _values(per_run, b, mode, metric, factor)[seeds]
            ).to_numpy()


def step_parts(per_run: pd.DataFrame, factor: Factor = STEP_MODE) -> list[StepPart]:
    """Every pair of ablated strategies on every metric of :data:`METRICS`, on the seeds all four runs have
    (``fixed`` and ``equal`` hold the gaps in ``factor``'s first and second arm)."""
    parts = []
    first, second = factor.arms
    for a, b in combinations(ablated_strategies(per_run, factor), 2):
        for metric in METRICS:
            seeds = sorted(set.intersection(*(set(_values(per_run, s, m, metric, factor).index) for s in (a, b)
                                              for m in factor.arms)))
            gaps = {mode: _diffs(per_run, metric, a, b, mode, seeds, factor) for mode in factor.arms}
            fixed, equal = (Gap(metric, a, b, mode, seeds, *_interval(gaps[mode])) for mode in factor.arms)
            mean, ci = _interval(gaps[first] - gaps[second])
            parts.append(StepPart(metric, a, b, seeds, mean, ci, fixed, equal))
    return parts


def ablation_table(per_run: pd.DataFrame, factor: Factor = STEP_MODE) -> pd.DataFrame:
    """One row per ablated strategy and arm: strategy, arm, seeds, then ``mean ± sd`` of
    :data:`TABLE_COLUMNS` as strings (the main table's formatting, :func:`analysis.compare.format_table`)."""
    rows = []
    for strategy in ablated_strategies(per_run, factor):
        for mode in factor.arms:
            group = per_run[(per_run["strategy_name"] == strategy) & (per_run[factor.column] == mode)]
            formatted = format_table(strategy_table(group.assign(strategy=strategy)), columns=TABLE_COLUMNS)
            rows.append({"strategy": strategy, factor.words: mode, **formatted.drop(columns="strategy").iloc[0]})
    return pd.DataFrame(rows)


def _steps(per_run: pd.DataFrame, strategy: str, mode: str) -> str:
    steps = _values(per_run, strategy, mode, "steps")
    return f"{steps.mean():.0f}" if len(steps) else "?"


def _signed(fmt: str, value: float) -> str:
    return fmt.replace("{:", "{:+").format(value)


def _with_interval(fmt: str, mean: float, ci: tuple[float, float]) -> str:
    if not math.isfinite(ci[0]):
        return f"{_signed(fmt, mean)} (no interval: fewer than {MIN_SEEDS} seeds)"
    return f"{_signed(fmt, mean)} [{_signed(fmt, ci[0])}, {_signed(fmt, ci[1])}]"


#: the closing sentence of every ablation section
DESCRIPTIVE = ("95 % t intervals over seeds, one per comparison (no family correction): the ablation describes; the "
               "main sweep's Holm-corrected tests say which rankings are significant.")


def _part_sentence(part: StepPart, first: str, second: str, share: str, tail: str) -> str:
    """``metric, a − b over seeds …: gap first, gap second: share part tail``, each number with its interval."""
    words, fmt = METRICS[part.metric]
    return (f"{words}, {part.a} − {part.b} over seeds {', '.join(map(str, part.seeds))}: "
            f"{_with_interval(fmt, part.fixed.mean, part.fixed.ci)} {first}, "
            f"{_with_interval(fmt, part.equal.mean, part.equal.ci)} {second}: {share} "
            f"{_with_interval(fmt, part.mean, part.ci)}{tail}")


def ablation_sentences(per_run: pd.DataFrame, parts: list[StepPart]) -> list[str]:
    """One sentence per pair and metric, every number with its 95 % t interval over seeds."""
    sentences = []
    for part in parts:
        a, b = part.a, part.b
        sentences.append(_part_sentence(
            part, f"under fixed accumulation ({a} {_steps(per_run, a, FIXED)} steps, {b} {_steps(per_run, b, FIXED)})",
            f"at equal-token steps ({a} {_steps(per_run, a, EQUAL)}, {b} {_steps(per_run, b, EQUAL)})",
            "the step count accounts for",
            " of the fixed-accumulation gap; the equal-step gap is what batch composition can explain."))
    return [*sentences, DESCRIPTIVE]


def _clipped(per_run: pd.DataFrame, strategy: str, arm: str) -> str:
    clipped = _values(per_run, strategy, arm, "clipped_pct", NORMALISER)
    return f"{clipped.mean():.1f}%" if len(clipped) else "?"


def mechanism_sentences(per_run: pd.DataFrame, parts: list[StepPart]) -> list[str]:
    """The normaliser ablation's sentences: per pair and metric, the gap under each normaliser and the part the
    per-step reweighting explains, each in the metric's units with its 95 % t interval, and the clipped steps."""
    sentences = [_part_sentence(part, "with each step's loss divided by its Σw",
                                "with one constant per epoch (every block weighs alike)",
                                "the per-step reweighting accounts for",
                                "; what remains under the constant is the steps' homogeneity and the order lengths "
                                "arrive in.") for part in parts]
    if parts:
        strategies = ablated_strategies(per_run, NORMALISER)
        clipped = "; ".join(f"{s} {_clipped(per_run, s, STEP_NORMALISER)} with the step's Σw, "
                            f"{_clipped(per_run, s, EPOCH_NORMALISER)} with the constant" for s in strategies)
        sentences.append(f"Clipped steps: {clipped} (a constant divisor scales a step's gradient with its "
                         "document count).")
    return [*sentences, DESCRIPTIVE]


def factor_sentences(per_run: pd.DataFrame, factor: Factor) -> list[str]:
    """The section's sentences for ``factor``."""
    parts = step_parts(per_run, factor)
    return ablation_sentences(per_run, parts) if factor is STEP_MODE else mechanism_sentences(per_run, parts)


def ablation_markdown(per_run: pd.DataFrame) -> str:
    """The section's text in markdown (what ``report.md`` holds, and what ``benchmarks/RESULTS.md`` pastes;
    re-rendered by a test from a stored ``runs.csv``)."""
    return section_markdown(ablation_table(per_run), ablation_sentences(per_run, step_parts(per_run)))


def section_markdown(table: pd.DataFrame, sentences: list[str]) -> str:
    """The table, then one bullet per sentence."""
    lines = [md_table(list(table.columns), table.astype(str).values.tolist()), ""]
    return "\n".join(lines + [f"- {s}" for s in sentences]) + "\n"


def normaliser_markdown(per_run: pd.DataFrame) -> str:
    """The normaliser ablation's section in markdown (re-rendered by a test from a stored ``runs.csv``)."""
    return section_markdown(ablation_table(per_run, NORMALISER), factor_sentences(per_run, NORMALISER))


def ablation_figure(per_run: pd.DataFrame, factor: Factor = STEP_MODE) -> Figure:
    """Held-out loss and τ real of each ablated strategy in both arms: a dot per seed, the mean joined
    across arms, the mean optimizer steps written beside each mean (colours: the main report's)."""
    strategies = ablated_strategies(per_run, factor)
    style = StrategyStyle(strategies)
    with plt.rc_context(STYLE):
        fig, axes = plt.subplots(1, len(METRICS), figsize=(11, 4.4))
        for ax, (metric, (words, fmt)) in zip(axes, METRICS.items()):
            for offset, strategy in zip(np.linspace(-0.08, 0.08, len(strategies)), strategies):
                colour = style.colour(strategy)
                means = []
                for x, mode in enumerate(factor.arms):
                    values = _values(per_run, strategy, mode, metric, factor)
                    ax.scatter(np.full(len(values), x + offset), values, color=colour, alpha=0.45, s=18)
                    means.append(values.mean() if len(values) else math.nan)
                    if len(values) and factor is STEP_MODE:
                        ax.annotate(f"{_steps(per_run, strategy, mode)} steps", (x + offset, means[-1]),
                                    textcoords="offset points", xytext=(7, -3), fontsize=8, color=colour)
                ax.plot(np.arange(len(factor.arms)) + offset, means, color=colour, marker=style.marker(strategy),
                        label=strategy)
            ax.set_xticks(range(len(factor.arms)), factor.arms)
            ax.set_xlim(-0.4, len(factor.arms) - 0.4)
            ax.set_ylabel(f"final {words}")
            ax.set_title(f"{words} by {factor.words} (same tokens)")
        axes[0].legend(loc="best")
        fig.suptitle(factor.title)
        fig.tight_layout()
    return fig
