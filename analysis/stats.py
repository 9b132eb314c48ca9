"""Statistics over seeds, and the check that a sweep's timings can be trusted.

Tests (:func:`compare_pairs`): for every headline metric (:data:`HEADLINE_METRICS`: held-out loss, τ
teacher-forced, τ real, real tokens/s) and every pair of strategies, a two-sided paired t-test over the
seeds both strategies have (same seed = same initialisation, held-out set and anchors); the effect is the
mean paired difference A − B with its 95 % t interval (n − 1 degrees of freedom). Holm–Bonferroni
(:func:`holm`, Holm 1979) runs over the whole family — every tested pair of every metric — at
α = :data:`ALPHA`: sort the p-values ascending, reject while p_(i) ≤ α / (m − i + 1), stop at the first
failure. A pair with fewer than :data:`MIN_SEEDS` paired seeds is not tested (nor counted in m). No
bootstrap: over 3 seeds a bootstrap interval of the mean is only the range of the data.

Timings (:func:`timing_check`): real tokens/s is a wall-clock measurement and a busy machine makes it
garbage (a sweep on a loaded 2-core machine reported ``sorted`` at 11,828 ± 13,686 tok/s). A strategy's
timing is *disturbed* when

- its runs' real tokens/s vary over seeds with a coefficient of variation (sample s.d. / mean) above
  :data:`TIMING_CV_MAX` = 0.20, or
- one of its runs was unsteady (:func:`step_rate_checks`, from :data:`STEP_SPREAD_MIN_STEPS` steps up,
  on each step's computed slots per second — computed slots rather than real tokens, so that a padded
  strategy's step-to-step padding is not read as a disturbance):

  - its *step spread*, the 90th over the 10th percentile of that rate, is above
    :data:`STEP_SPREAD_MAX` = 2.0 (slowdowns over a part of the run), or
  - its *stall factor*, Σ step time over the time its median rate implies (Σ slots / median rate), is
    above :data:`STALL_MAX` = 1.25 (a few long stalls, which the percentiles do not see).

Calibration (``docs/design/statistics.md`` has the numbers): on a quiet machine the CV over seeds stayed ≤ 0.08
(the test sweep, twice: 0.010–0.068; the README's demo: 0.041–0.084), the step spread ≤ 1.64 and the
stall factor ≤ 1.05; on loaded machines the CV reached 0.10–1.16, the spread 1.5–47 and the stall factor
1.5–10.8. When any strategy is disturbed, the report quotes no throughput ratio and runs no real
tokens/s test that involves a disturbed strategy; ``benchmarks/train_throughput.py`` (strategies
interleaved over rounds, so that load drifts over all of them alike) is the source of record.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import combinations

import numpy as np
import pandas as pd

from analysis.load import order_strategies

ALPHA = 0.05
MIN_SEEDS = 3
#: column → (words, number format, which direction is better)
HEADLINE_METRICS = {
    "final_eval_loss": ("held-out loss", "{:.3f}", "lower"),
    "final_eval_tau": ("τ teacher-forced", "{:.3f}", "higher"),
    "final_eval_tau_real": ("τ real", "{:.3f}", "higher"),
    "tokens_per_second": ("real tokens/s", "{:,.0f}", "higher"),
}
THROUGHPUT = "tokens_per_second"
TIMING_CV_MAX = 0.20
STEP_SPREAD_MAX = 2.0
STALL_MAX = 1.25
STEP_SPREAD_MIN_STEPS = 8
THROUGHPUT_SOURCE = "benchmarks/train_throughput.py"


# ---------------------------------------------------------------- Student's t
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


def paired_test(diffs: np.ndarray) -> tuple[float, tuple[float, float]]:
    """Two-sided paired t-test of mean(diffs) = 0: p-value and 95 % t interval (n − 1 df) of the mean difference.

    Differences without spread give p = 0 (all equal and non-zero) or 1 (all zero) and a point interval."""
    n = diffs.size
    mean = float(diffs.mean())
    sd = float(diffs.std(ddof=1))
    if sd == 0.0:
        return (0.0 if mean != 0.0 else 1.0), (mean, mean)
    se = sd / math.sqrt(n)
    half = t_quantile(0.975, n - 1) * se
    return t_two_sided_p(mean / se, n - 1), (mean - half, mean + half)


# ---------------------------------------------------------------- Holm–Bonferroni
def holm(p_values: Sequence[float], alpha: float = ALPHA) -> tuple[list[float], list[float], list[bool]]:
    """Holm's step-down correction of ``p_values`` (one family), in their order: the threshold α/(m − i + 1) of
    each p at its rank i (1 = smallest), the adjusted p (max over ranks ≤ i of (m − j + 1)·p_(j), at most 1),
    and whether it is rejected (every p up to its rank is within its threshold; ⇔ adjusted p ≤ α)."""
    m = len(p_values)
    order = sorted(range(m), key=lambda k: (p_values[k], k))
    thresholds, adjusted, reject = [math.nan] * m, [math.nan] * m, [False] * m
    running, rejecting = 0.0, True
    for rank, k in enumerate(order, start=1):
        thresholds[k] = alpha / (m - rank + 1)
        running = max(running, min(1.0, (m - rank + 1) * p_values[k]))
        adjusted[k] = running
        rejecting = rejecting and p_values[k] <= thresholds[k]
        reject[k] = rejecting
    return thresholds, adjusted, reject


# ---------------------------------------------------------------- timings
def step_rate_checks(real_tokens: Sequence[float], computed_slots: Sequence[float],
                     step_time: Sequence[float]) -> dict[str, float]:
    """How steady a run's machine was, from its steps' computed slots per second (real tokens where no computed
    slots were logged): ``step_slot_rate_spread`` = p90 / p10 of that rate, ``step_stall_factor`` = Σ step time /
    (Σ slots / median rate). NaN under :data:`STEP_SPREAD_MIN_STEPS` steps."""
    def numbers(values: Sequence[float]) -> np.ndarray:
        return pd.to_numeric(pd.Series(list(values), dtype=object), errors="coerce").to_numpy(dtype=float)

    real, slots, time = numbers(real_tokens), numbers(computed_slots), numbers(step_time)
    slots = np.where(np.isfinite(slots), slots, real)
    ok = np.isfinite(slots) & np.isfinite(time) & (time > 0) & (slots > 0)
    if ok.sum() < STEP_SPREAD_MIN_STEPS:
        return {"step_slot_rate_spread": math.nan, "step_stall_factor": math.nan}
    rate = slots[ok] / time[ok]
    low, high = np.quantile(rate, [0.1, 0.9])
    return {"step_slot_rate_spread": float(high / low),
            "step_stall_factor": float(time[ok].sum() * np.median(rate) / slots[ok].sum())}


@dataclass
class TimingCheck:
    """Which strategies' timings were disturbed, and why (one phrase per reason)."""

    reasons: dict[str, list[str]] = field(default_factory=dict)
    cv: dict[str, float] = field(default_factory=dict)  # coefficient of variation over seeds
    spread: dict[str, float] = field(default_factory=dict)  # the largest step spread of its runs
    stall: dict[str, float] = field(default_factory=dict)  # the largest stall factor of its runs

    @property
    def disturbed(self) -> list[str]:
        return [s for s, why in self.reasons.items() if why]

    @property
    def flagged(self) -> bool:
        return bool(self.disturbed)

    def note(self) -> str:
        """One sentence: what was disturbed and what to read instead ('' when nothing was)."""
        if not self.flagged:
            return ""
        detail = "; ".join(f"{s}: {', '.join(self.reasons[s])}" for s in self.disturbed)
        return (f"The timings of this sweep were disturbed ({detail}; rule: CV over seeds > {TIMING_CV_MAX:.2f}, "
                f"or in a run a p90/p10 of per-step computed slots/s > {STEP_SPREAD_MAX:.1f} or a stall factor > "
                f"{STALL_MAX:.2f}), so no throughput ratio is quoted from it: the interleaved benchmark "
                f"`{THROUGHPUT_SOURCE}` is the source of record for throughput.")


def timing_check(per_run: pd.DataFrame) -> TimingCheck:
    """The rule of the module docstring applied to the per-run frame (``tokens_per_second`` and, when present,
    ``step_slot_rate_spread`` and ``step_stall_factor``)."""
    check = TimingCheck()
    for strategy in order_strategies(per_run["strategy"]):
        runs = per_run[per_run["strategy"] == strategy]
        speeds = pd.to_numeric(runs[THROUGHPUT], errors="coerce").dropna()
        reasons = []
        cv = float(speeds.std(ddof=1) / speeds.mean()) if len(speeds) > 1 and speeds.mean() > 0 else math.nan
        if math.isfinite(cv) and cv > TIMING_CV_MAX:
            reasons.append(f"CV over seeds {cv:.2f}")
        worst = {}
        for column, bound, words in (("step_slot_rate_spread", STEP_SPREAD_MAX, "step spread"),
                                     ("step_stall_factor", STALL_MAX, "stall factor")):
            values = pd.to_numeric(runs.get(column, pd.Series(math.nan, index=runs.index)), errors="coerce")
            worst[column] = float(values.max()) if values.notna().any() else math.nan
            over = runs[values > bound]
            if len(over):
                seeds = ", ".join(str(int(s)) for s in sorted(over["seed"]))
                reasons.append(f"{words} up to {worst[column]:.2f} in seed{'s' if len(over) > 1 else ''} {seeds}")
        check.reasons[strategy], check.cv[strategy] = reasons, cv
        check.spread[strategy], check.stall[strategy] = worst["step_slot_rate_spread"], worst["step_stall_factor"]
    return check


# ---------------------------------------------------------------- all pairs
@dataclass
class PairTest:
    metric: str
    a: str
    b: str
    seeds: list[int]
    mean_diff: float  # a − b over the paired seeds
    sd_diff: float
    ci: tuple[float, float]  # 95 % t interval of mean_diff
    p_value: float  # NaN when not tested
    tested: bool
    note: str = ""  # why not tested
    threshold: float = math.nan  # Holm's α/(m − i + 1) at its rank
    p_holm: float = math.nan  # Holm-adjusted p
    survives: bool = False


def _pair(per_run: pd.DataFrame, metric: str, a: str, b: str, skip: str) -> PairTest:
    values = {s: per_run[per_run["strategy"] == s].set_index("seed")[metric].astype(float).dropna() for s in (a, b)}
    seeds = sorted(int(s) for s in set(values[a].index) & set(values[b].index))
    diffs = np.array([values[a][s] - values[b][s] for s in seeds], dtype=float)
    mean = float(diffs.mean()) if diffs.size else math.nan
    sd = float(diffs.std(ddof=1)) if diffs.size > 1 else math.nan
    note = skip or ("" if len(seeds) >= MIN_SEEDS else f"{len(seeds)} paired seed{'s' if len(seeds) != 1 else ''} "
                                                      f"(fewer than {MIN_SEEDS})")
    if note:
        return PairTest(metric, a, b, seeds, mean, sd, (math.nan, math.nan), math.nan, False, note)
    p, ci = paired_test(diffs)
    return PairTest(metric, a, b, seeds, mean, sd, ci, p, True)


def target_features_cached(per_run: pd.DataFrame) -> bool:
    """Whether some run read the target's features from the cache (its tokens/s then time the drafter alone)."""
    return "target_features" in per_run.columns and bool((per_run["target_features"] == "cached").any())


def tested_metrics(per_run: pd.DataFrame) -> tuple[str, ...]:
    """The headline metrics a sweep's pairs are tested on: all of them, but throughput when the target's features
    came from the cache (the drafter's speed alone is not a strategy's throughput)."""
    return tuple(m for m in HEADLINE_METRICS if not (m == THROUGHPUT and target_features_cached(per_run)))


def compare_pairs(per_run: pd.DataFrame, metrics: Sequence[str] = tuple(HEADLINE_METRICS),
                  timing: TimingCheck | None = None, alpha: float = ALPHA) -> list[PairTest]:
    """Every pair of strategies (report order, A before B) on every metric the frame has, paired by seed;
    Holm–Bonferroni over every tested pair of every metric. Real tokens/s pairs with a strategy whose timing is
    disturbed are not tested."""
    strategies = order_strategies(per_run["strategy"])
    disturbed = set(timing.disturbed) if timing is not None else set()
    tests = []
    for metric in metrics:
        if metric not in per_run.columns or not np.isfinite(pd.to_numeric(per_run[metric], errors="coerce")).any():
            continue
        for a, b in combinations(strategies, 2):
            skip = "timings disturbed" if metric == THROUGHPUT and {a, b} & disturbed else ""
            tests.append(_pair(per_run, metric, a, b, skip))
    tested = [t for t in tests if t.tested]
    for test, threshold, adjusted, reject in zip(tested, *holm([t.p_value for t in tested], alpha)):
        test.threshold, test.p_holm, test.survives = threshold, adjusted, reject
    return tests


def comparisons_frame(tests: Sequence[PairTest]) -> pd.DataFrame:
    """``comparisons.csv``: one row per pair and metric."""
    return pd.DataFrame([{
        "metric": t.metric, "strategy_a": t.a, "strategy_b": t.b, "seeds": len(t.seeds),
        "mean_difference": t.mean_diff, "sd_difference": t.sd_diff, "ci_low": t.ci[0], "ci_high": t.ci[1],
        "p_value": t.p_value, "holm_threshold": t.threshold, "p_holm": t.p_holm, "survives": t.survives,
        "tested": t.tested, "not_tested_because": t.note,
    } for t in tests], columns=["metric", "strategy_a", "strategy_b", "seeds", "mean_difference", "sd_difference",
                                "ci_low", "ci_high", "p_value", "holm_threshold", "p_holm", "survives", "tested",
                                "not_tested_because"])


# ---------------------------------------------------------------- sentences
def format_p(p: float) -> str:
    return "< 0.001" if p < 0.001 else f"{p:.3f}" if p < 0.01 else f"{p:.2f}"


def surviving_sentence(test: PairTest) -> str:
    """``held-out loss: packed lower than sorted by 0.053 (95% t interval 0.041–0.065, Holm-adjusted p = 0.01)``:
    the strategy with the better mean first."""
    words, fmt, better = HEADLINE_METRICS[test.metric]
    a_better = (test.mean_diff < 0) == (better == "lower")
    first, second = (test.a, test.b) if a_better else (test.b, test.a)
    low, high = sorted(abs(v) for v in test.ci)
    p = format_p(test.p_holm)
    return (f"{words}: {first} {better} than {second} by {fmt.format(abs(test.mean_diff))} (95% t interval "
            f"{fmt.format(low)}–{fmt.format(high)}, Holm-adjusted p {p if p.startswith('<') else '= ' + p}, "
            f"{len(test.seeds)} seeds)")


def family_sentences(tests: Sequence[PairTest], alpha: float = ALPHA) -> list[str]:
    """What was tested, what was not and why, and how many differences survive the correction."""
    if not tests:
        return []
    tested = [t for t in tests if t.tested]
    metrics = list(dict.fromkeys(t.metric for t in tests))
    pairs = len({(t.a, t.b) for t in tests})
    survivors = sum(t.survives for t in tested)
    if tested:
        verdict = (f"{survivors} difference{'s' if survivors != 1 else ''} survive{'s' if survivors == 1 else ''} "
                   "the correction and nothing else is significant" if survivors else
                   "no difference survives the correction, so no ranking is significant")
        lines = [f"Every pair of strategies ({pairs} pair{'s' if pairs != 1 else ''}) on {len(metrics)} metric"
                 f"{'s' if len(metrics) != 1 else ''} ({', '.join(HEADLINE_METRICS[m][0] for m in metrics)}), paired "
                 f"by seed: {len(tested)} two-sided paired t-tests, Holm–Bonferroni over all {len(tested)} at "
                 f"α = {alpha}; {verdict} (an uncorrected p below 0.05 ranks nothing)."]
    else:
        lines = ["Nothing is tested, so no ranking is significant: every pair of strategies lacks enough paired "
                 "seeds or reliable timings (below)."]
    lines += untested_sentences(tests)
    lines.append("Intervals are 95% t intervals of the mean paired difference (n − 1 degrees of freedom); no "
                 "bootstrap is shown: over 3 seeds a bootstrap interval is only the range of the data.")
    return lines


def untested_sentences(tests: Sequence[PairTest]) -> list[str]:
    """One line per reason a pair was not tested."""
    lines = []
    for note in dict.fromkeys(t.note for t in tests if not t.tested):
        skipped = [t for t in tests if t.note == note]
        if note == "timings disturbed":
            lines.append(f"Not tested: {len(skipped)} real tokens/s pair{'s' if len(skipped) != 1 else ''} with a "
                         f"strategy whose timings were disturbed ({THROUGHPUT_SOURCE} is the source of record for "
                         "throughput).")
        else:
            what = ", ".join(dict.fromkeys(HEADLINE_METRICS[t.metric][0] for t in skipped))
            lines.append(f"Not tested: {len(skipped)} pair{'s' if len(skipped) != 1 else ''} ({what}) with {note}: "
                         "no ranking of them is significant, their means are descriptive only.")
    return lines
