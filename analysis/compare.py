"""Numbers of the report, all recomputed from the step histories: per run, per strategy, across seeds.

Per run (:func:`run_metrics`, one row per run, from ``Sweep.steps``; the averages over steps are
:func:`harness.train.summary.step_averages`, the same function that writes them into ``summary.json``):

- ``tokens_per_second`` = Σ real_tokens / Σ step_time over the run's steps (real, non-pad tokens).
- ``relative_throughput`` = that / the same seed's ``sorted`` run (``sorted`` is the reference; the
  mean of ``sorted`` over seeds when that seed has no sorted run; the fastest strategy when there is
  no sorted run at all, and the table says so).
- ``padding_pct`` = 100 · (1 − Σ real_tokens / Σ computed_slots).
- ``grad_diversity`` = mean of the measured steps' gradient diversity (``grad_stats_measured``);
  ``grad_noise_scale`` = its last measured value.
- ``lag1_acf`` = mean over epochs of the plan's lag-1 ACF of step mean length (``plan_lag1_acf``).
- ``recurrence`` = mean over epochs of ``plan_step_recurrence`` (step level) where logged, else of
  ``plan_recurrence`` (micro-batch level); ``recurrence_kind`` says which.
- ``final_eval_loss`` / ``final_eval_tau`` = the last held-out evaluation.
- ``tokens_to_loss`` = tokens seen at the first evaluation whose held-out loss is ≤ the target loss
  (by default the worst final held-out loss of all runs, so that every run reaches it).
- ``target_busy_pct`` / ``drafter_idle_pct`` (``topology=disaggregated`` runs only; the table shows them
  when some run has them) = 100 · the mean over steps and target ranks of the target ranks' busy
  fraction / of the drafter ranks' time waiting for features: which stage bounds the run.

Across seeds (:func:`compare_final`): strategies are paired by seed against the best one; paired
t-test (two-sided) and its 95 % interval, plus a bootstrap interval of the mean paired difference.
With fewer than 3 paired seeds nothing is tested and no ranking is called significant.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from analysis.load import Sweep, order_strategies
from harness.train.summary import step_averages

REFERENCE = "sorted"
ALPHA = 0.05
MIN_SEEDS = 3

#: the per-strategy table: column → (heading, format)
TABLE_COLUMNS = {
    "tokens_per_second": ("real tokens/s", "{:.0f}"),
    "relative_throughput": ("× sorted", "{:.2f}"),
    "padding_pct": ("padding %", "{:.1f}"),
    "steps": ("optimizer steps", "{:.0f}"),
    "grad_diversity": ("gradient diversity", "{:.3g}"),
    "lag1_acf": ("lag-1 ACF", "{:+.2f}"),
    "recurrence": ("recurrence", "{:.2f}"),
    "final_eval_loss": ("held-out loss", "{:.3f}"),
    "final_eval_tau": ("τ", "{:.3f}"),
    "final_eval_tau_real": ("τ real", "{:.3f}"),
    "tokens_to_loss": ("tokens to target loss", "{:.0f}"),
    "target_busy_pct": ("target busy %", "{:.0f}"),
    "drafter_idle_pct": ("drafter idle %", "{:.0f}"),
}
#: columns shown only when some run has them (the stages of ``topology=disaggregated`` runs)
STAGE_COLUMNS = ("target_busy_pct", "drafter_idle_pct")


# ---------------------------------------------------------------- per run
def _finite(series: pd.Series) -> pd.Series:
    values = pd.to_numeric(series, errors="coerce")
    return values[np.isfinite(values)]


def _mean_of(history: pd.DataFrame, column: str) -> float:
    if column not in history.columns:
        return math.nan
    values = _finite(history[column])
    return float(values.mean()) if len(values) else math.nan


def recurrence_column(steps: pd.DataFrame) -> str:
    """``plan_step_recurrence`` where the strategies log it, else ``plan_recurrence``."""
    if "plan_step_recurrence" in steps.columns and _finite(steps["plan_step_recurrence"]).size:
        return "plan_step_recurrence"
    return "plan_recurrence"


def default_target_loss(steps: pd.DataFrame) -> float:
    """The worst final held-out loss over all runs: a loss every run reaches."""
    finals = [_last_eval(h, "eval_loss") for _, h in steps.groupby("run")]
    finals = [f for f in finals if math.isfinite(f)]
    return max(finals) if finals else math.nan


def _stage_means(history: pd.DataFrame) -> tuple[float, float]:
    """``(target busy %, drafter idle %)`` of a disaggregated run: the mean over steps and target ranks of
    ``topology_target_busy_fraction``, and the steps' mean ``topology_drafter_idle_fraction``; NaN for
    colocated runs. Busy targets and an idle drafter mean the targets bound the run; the reverse, the drafter."""
    busy: list[float] = []
    if "topology_target_busy_fraction" in history.columns:
        for values in history["topology_target_busy_fraction"]:
            if isinstance(values, list):
                busy.extend(float(v) for v in values if isinstance(v, (int, float)) and math.isfinite(v))
    target_busy = 100.0 * float(np.mean(busy)) if busy else math.nan
    return target_busy, 100.0 * _mean_of(history, "topology_drafter_idle_fraction")


def _last_eval(history: pd.DataFrame, column: str) -> float:
    if column not in history.columns:
        return math.nan
    values = _finite(history.sort_values("step")[column])
    return float(values.iloc[-1]) if len(values) else math.nan


def tokens_to_reach(history: pd.DataFrame, target: float) -> float:
    """Tokens seen at the first evaluation with held-out loss ≤ ``target`` (NaN when never)."""
    if not math.isfinite(target) or "eval_loss" not in history.columns:
        return math.nan
    evals = history[np.isfinite(pd.to_numeric(history["eval_loss"], errors="coerce"))].sort_values("step")
    reached = evals[evals["eval_loss"] <= target + 1e-12]
    return float(reached["tokens_seen"].iloc[0]) if len(reached) else math.nan


def run_metrics(sweep: Sweep, target_loss: float | None = None) -> pd.DataFrame:
    """One row per run with the per-run numbers of the module docstring."""
    steps = sweep.steps
    target = default_target_loss(steps) if target_loss is None else float(target_loss)
    rec_column = recurrence_column(steps)
    rows = []
    for run in sweep.runs.itertuples(index=False):
        history = steps[steps["run"] == run.run].sort_values("step")
        # the per-run averages the trainer's summary.json also holds: one definition, harness.train.summary
        averages = step_averages(history.to_dict("records"), recurrence=rec_column)
        target_busy, drafter_idle = _stage_means(history)
        rows.append({
            "run": run.run, "strategy": run.strategy, "seed": int(run.seed), "steps": int(len(history)),
            "tokens_seen": int(history["tokens_seen"].iloc[-1]),
            "epochs": float(history["epochs"].iloc[-1]) if "epochs" in history.columns else math.nan,
            "train_time_s": averages["step_time_sum_s"],
            "tokens_per_second": averages["step_tokens_per_second"],
            "padding_pct": averages["padding_pct"],
            "grad_diversity": averages["grad_diversity"],
            "grad_noise_scale": averages["grad_noise_scale"],
            "lag1_acf": averages["lag1_acf"],
            "recurrence": averages["recurrence"],
            "recurrence_kind": averages["recurrence_kind"],
            "final_eval_loss": _last_eval(history, "eval_loss"),
            "final_eval_tau": _last_eval(history, "eval_tau"),
            "final_eval_tau_real": _last_eval(history, "eval_tau_real"),
            "target_loss": target,
            "tokens_to_loss": tokens_to_reach(history, target),
            "target_busy_pct": target_busy, "drafter_idle_pct": drafter_idle,
        })
    frame = pd.DataFrame(rows)
    frame["relative_throughput"], frame.attrs["reference"] = relative_throughput(frame)
    return frame


def relative_throughput(per_run: pd.DataFrame) -> tuple[pd.Series, str]:
    """Each run's tokens/s over the reference's (same seed when there is one); and the reference's name."""
    strategies = order_strategies(per_run["strategy"])
    if REFERENCE in strategies:
        reference = REFERENCE
    else:
        reference = per_run.groupby("strategy")["tokens_per_second"].mean().idxmax()
    ref_runs = per_run[per_run["strategy"] == reference].set_index("seed")["tokens_per_second"]
    ref_mean = float(ref_runs.mean())
    ratios = [row.tokens_per_second / float(ref_runs.get(row.seed, ref_mean)) for row in per_run.itertuples()]
    return pd.Series(ratios, index=per_run.index, dtype=float), reference


# ---------------------------------------------------------------- per strategy
def strategy_table(per_run: pd.DataFrame) -> pd.DataFrame:
    """Mean, sample standard deviation (ddof 1; 0 for one seed) and seed count of every table column."""
    rows = []
    for strategy in order_strategies(per_run["strategy"]):
        group = per_run[per_run["strategy"] == strategy]
        row: dict[str, Any] = {"strategy": strategy, "seeds": int(len(group))}
        for column in TABLE_COLUMNS:
            values = _finite(group[column]) if column in group.columns else pd.Series([], dtype=float)
            row[column] = float(values.mean()) if len(values) else math.nan
            row[f"{column}_sd"] = float(values.std(ddof=1)) if len(values) > 1 else (0.0 if len(values) else math.nan)
            row[f"{column}_n"] = int(len(values))
        rows.append(row)
    table = pd.DataFrame(rows)
    table.attrs.update(per_run.attrs)
    return table


def format_table(table: pd.DataFrame) -> pd.DataFrame:
    """The table as strings, ``mean ± sd`` (``—`` where undefined, ``not reached (k/n)`` for the token target)."""
    out = pd.DataFrame({"strategy": table["strategy"], "seeds": table["seeds"].astype(str)})
    for column, (heading, fmt) in TABLE_COLUMNS.items():
        if column in STAGE_COLUMNS and not np.isfinite(table[column].astype(float)).any():
            continue  # colocated runs: no stages to show
        cells = []
        for row in table.itertuples(index=False):
            mean, sd, n = getattr(row, column), getattr(row, f"{column}_sd"), getattr(row, f"{column}_n")
            if not math.isfinite(mean):
                cells.append("not reached" if column == "tokens_to_loss" else "—")
                continue
            cell = fmt.format(mean)
            if n > 1:
                cell += " ± " + _same_decimals(cell, abs(sd))
            if column == "tokens_to_loss" and n < row.seeds:
                cell += f" ({n}/{row.seeds} seeds)"
            cells.append(cell)
        out[heading] = cells
    return out


def _same_decimals(shown: str, value: float) -> str:
    """``value`` with as many decimals as the already formatted ``shown`` (``0.953`` → ``0.041``)."""
    digits = shown.split("e")[0]
    decimals = len(digits.split(".")[1]) if "." in digits else 0
    return f"{value:.{decimals}f}"


# ---------------------------------------------------------------- statistics
def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the incomplete beta function (modified Lentz)."""
    tiny, eps = 1e-300, 3e-16
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 500):
        m2 = 2 * m
        aa = m * (b - m) * x / ((qam + m2) * (a + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        h *= d * c
        aa = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < eps:
            break
    return h


def betainc(a: float, b: float, x: float) -> float:
    """Regularised incomplete beta function I_x(a, b)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(log_front) * _betacf(a, b, x) / a
    return 1.0 - math.exp(log_front) * _betacf(b, a, 1.0 - x) / b


def t_two_sided_p(t: float, df: int) -> float:
    """P(|T| ≥ |t|) for Student's t with ``df`` degrees of freedom."""
    if math.isinf(t):
        return 0.0
    return betainc(df / 2.0, 0.5, df / (df + t * t))


def t_quantile(q: float, df: int) -> float:
    """The ``q`` quantile (q > 0.5) of Student's t, by bisection on :func:`t_two_sided_p`."""
    target = 2.0 * (1.0 - q)
    lo, hi = 0.0, 1e3
    for _ in range(200):
        mid = (lo + hi) / 2
        if t_two_sided_p(mid, df) > target:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


@dataclass
class PairedComparison:
    metric: str  # final_eval_loss or final_eval_tau
    strategy: str
    best: str
    seeds: list[int]
    mean_diff: float  # strategy − best
    sd_diff: float
    p_value: float  # NaN when not tested (fewer than MIN_SEEDS paired seeds)
    ci: tuple[float, float]  # t interval, 95 %
    bootstrap_ci: tuple[float, float]
    tested: bool
    significant: bool
    worse: bool  # strategy worse than best (higher loss, lower τ)


@dataclass
class Comparison:
    metric: str
    best: str
    means: dict[str, float]
    pairs: list[PairedComparison] = field(default_factory=list)
    enough_seeds: bool = False


METRIC_WORDS = {"final_eval_loss": ("final held-out loss", "lower"), "final_eval_tau": ("final τ", "higher")}


def bootstrap_interval(diffs: np.ndarray, rounds: int = 10000, seed: int = 0) -> tuple[float, float]:
    """95 % percentile bootstrap interval of the mean of ``diffs`` (resampling seeds, fixed RNG)."""
    if diffs.size == 0:
        return (math.nan, math.nan)
    rng = np.random.default_rng(seed)
    means = diffs[rng.integers(0, diffs.size, size=(rounds, diffs.size))].mean(axis=1)
    low, high = np.quantile(means, [0.025, 0.975])
    return (float(low), float(high))


def paired_test(diffs: np.ndarray) -> tuple[float, tuple[float, float]]:
    """Two-sided paired t-test of mean(diffs) = 0: p-value and 95 % interval of the mean difference."""
    n = diffs.size
    mean = float(diffs.mean())
    sd = float(diffs.std(ddof=1))
    if sd == 0.0:
        return (0.0 if mean != 0.0 else 1.0), (mean, mean)
    se = sd / math.sqrt(n)
    t = mean / se
    half = t_quantile(0.975, n - 1) * se
    return t_two_sided_p(t, n - 1), (mean - half, mean + half)


def compare_final(per_run: pd.DataFrame, metric: str) -> Comparison:
    """Every strategy against the best one on ``metric``, paired by seed."""
    lower_is_better = METRIC_WORDS[metric][1] == "lower"
    means = per_run.groupby("strategy")[metric].mean().dropna()
    if means.empty:
        return Comparison(metric, "", {})
    best = str(means.idxmin() if lower_is_better else means.idxmax())
    best_runs = per_run[per_run["strategy"] == best].set_index("seed")[metric]
    comparison = Comparison(metric, best, {s: float(means[s]) for s in order_strategies(means.index)})
    enough = True
    for strategy in order_strategies(means.index):
        if strategy == best:
            continue
        other = per_run[per_run["strategy"] == strategy].set_index("seed")[metric]
        seeds = sorted(int(s) for s in set(other.dropna().index) & set(best_runs.dropna().index))
        diffs = np.array([other[s] - best_runs[s] for s in seeds], dtype=float)
        tested = len(seeds) >= MIN_SEEDS
        enough &= tested
        if tested:
            p, ci = paired_test(diffs)
        else:
            p, ci = math.nan, (math.nan, math.nan)
        mean = float(diffs.mean()) if diffs.size else math.nan
        comparison.pairs.append(PairedComparison(
            metric=metric, strategy=strategy, best=best, seeds=seeds, mean_diff=mean,
            sd_diff=float(diffs.std(ddof=1)) if diffs.size > 1 else math.nan, p_value=p, ci=ci,
            bootstrap_ci=bootstrap_interval(diffs) if tested else (math.nan, math.nan), tested=tested,
            significant=bool(tested and p < ALPHA),
            worse=bool(mean > 0) if lower_is_better else bool(mean < 0)))
    comparison.enough_seeds = enough and bool(comparison.pairs)
    return comparison


def comparisons_frame(comparisons: list[Comparison]) -> pd.DataFrame:
    rows = []
    for comparison in comparisons:
        for pair in comparison.pairs:
            rows.append({"metric": pair.metric, "strategy": pair.strategy, "against": pair.best,
                         "seeds": len(pair.seeds), "mean_difference": pair.mean_diff, "sd_difference": pair.sd_diff,
                         "ci_low": pair.ci[0], "ci_high": pair.ci[1], "bootstrap_low": pair.bootstrap_ci[0],
                         "bootstrap_high": pair.bootstrap_ci[1], "p_value": pair.p_value, "tested": pair.tested,
                         "significant": pair.significant})
    return pd.DataFrame(rows)


# ---------------------------------------------------------------- sentences
def _p(p: float) -> str:
    return "p < 0.001" if p < 0.001 else f"p = {p:.3f}" if p < 0.01 else f"p = {p:.2f}"


def comparison_sentences(comparison: Comparison) -> list[str]:
    words, _ = METRIC_WORDS[comparison.metric]
    if not comparison.pairs:
        return []
    if not comparison.enough_seeds:
        fewest = min(len(p.seeds) for p in comparison.pairs)
        ranking = ", ".join(f"{s} {m:.3f}" for s, m in comparison.means.items())
        return [f"With {fewest} paired seed{'s' if fewest != 1 else ''} (fewer than {MIN_SEEDS}), no ranking of "
                f"{words} is significant; the means ({ranking}) are descriptive only."]
    sentences = []
    identical = [p for p in comparison.pairs if p.mean_diff == 0.0 and (p.sd_diff == 0.0 or math.isnan(p.sd_diff))]
    if identical:
        names = ", ".join([comparison.best] + [p.strategy for p in identical])
        sentences.append(f"{names} have the same {words} in every seed ({comparison.means[comparison.best]:.3f}): "
                         "nothing to rank.")
    same = [p for p in comparison.pairs if not p.significant and all(p is not q for q in identical)]
    if same:
        names = " and ".join([comparison.best] + [p.strategy for p in same]) if len(same) == 1 else \
            ", ".join([comparison.best] + [p.strategy for p in same[:-1]]) + f" and {same[-1].strategy}"
        details = "; ".join(f"{p.strategy} − {p.best} = {p.mean_diff:+.3f} ± {p.sd_diff:.3f}, {_p(p.p_value)}"
                            for p in same)
        sentences.append(f"{names} are indistinguishable in {words} ({details}; paired t-test over "
                         f"{len(same[0].seeds)} seeds).")
    for p in comparison.pairs:
        if not p.significant:
            continue
        direction = "worse" if p.worse else "better"
        sentences.append(f"{p.strategy} is {direction} than {p.best} in {words} by {abs(p.mean_diff):.3f} ± "
                         f"{p.sd_diff:.3f} (95% CI {p.ci[0]:+.3f} to {p.ci[1]:+.3f}, {_p(p.p_value)}, "
                         f"{len(p.seeds)} seeds).")
    return sentences


def summary_sentences(table: pd.DataFrame, loss: Comparison, tau: Comparison) -> list[str]:
    """Which strategy dominates, what trade-off remains, what the diversity numbers say."""
    reference = table.attrs.get("reference", REFERENCE)
    finite = table[np.isfinite(table["relative_throughput"])]
    if finite.empty:
        return []
    fastest = finite.loc[finite["relative_throughput"].idxmax()]
    sentences = [f"{fastest['strategy']} has the highest throughput: {fastest['tokens_per_second']:.0f} real "
                 f"tokens/s, {fastest['relative_throughput']:.2f}× {reference} "
                 f"(padding {fastest['padding_pct']:.1f}%)."]
    not_worse = {loss.best} | {p.strategy for p in loss.pairs if not (p.significant and p.worse)}
    not_worse_tau = {tau.best} | {p.strategy for p in tau.pairs if not (p.significant and p.worse)}
    name = fastest["strategy"]
    significant = loss.enough_seeds and tau.enough_seeds
    if name == loss.best and name == tau.best:
        qualifier = "" if significant else " (descriptively: too few seeds for a test)"
        sentences.append(f"{name} dominates{qualifier}: the fastest strategy also has the best held-out loss and τ.")
    elif significant and name in not_worse and name in not_worse_tau:
        best = loss.best if loss.best == tau.best else f"loss: {loss.best}, τ: {tau.best}"
        sentences.append(f"{name} dominates: the fastest strategy, and its held-out loss and τ are not "
                         f"significantly worse than the best ({best}).")
    else:
        best = table.set_index("strategy").loc[loss.best]
        gap = fastest["final_eval_loss"] - best["final_eval_loss"]
        tail = "" if significant else " — not a significant difference with so few seeds"
        sentences.append(f"A trade-off remains: {name} is fastest but {loss.best} reaches a lower held-out loss "
                         f"({best['final_eval_loss']:.3f} against {fastest['final_eval_loss']:.3f}, "
                         f"{gap:+.3f}) at {best['relative_throughput']:.2f}× {reference}{tail}.")
    rec = table[np.isfinite(table["recurrence"])]
    if len(rec):
        most = rec.loc[rec["recurrence"].idxmax()]
        least = rec.loc[rec["recurrence"].idxmin()]
        sentences.append(f"Batch composition recurs most under {most['strategy']} (recurrence "
                         f"{most['recurrence']:.2f}) and least under {least['strategy']} ({least['recurrence']:.2f}).")
    div = table[np.isfinite(table["grad_diversity"])]
    if len(div) > 1:
        high = div.loc[div["grad_diversity"].idxmax()]
        low = div.loc[div["grad_diversity"].idxmin()]
        sentences.append(f"Measured gradient diversity is highest under {high['strategy']} "
                         f"({high['grad_diversity']:.3g}) and lowest under {low['strategy']} "
                         f"({low['grad_diversity']:.3g}); Δ grows when a step's small batches (ranks or "
                         "accumulation micro-batches) pull in different directions, so length-homogeneous "
                         "micro-batches raise it: read it with the recurrence and length-mix columns.")
    return sentences
