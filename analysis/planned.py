"""The pre-registered analysis of a sweep: the planned contrasts of one endpoint, declared before the runs.

A preregistration (YAML, ``conf/preregistration/*.yaml``, committed before the confirmatory runs) names the
primary endpoint (a column of ``runs.csv``, and which direction is better), α, the seeds of the pilot it was
sized on and of the confirmatory runs, and the planned contrasts A vs B:

- **superiority**: a two-sided paired t-test of A − B over the seeds both have (``scipy.stats.ttest_rel``);
- **equivalence**: TOST on the paired differences with the margin δ in the endpoint's units
  (``statsmodels``' ``ttost_paired``), the margin's rationale written beside it.

Holm runs over the planned family only (``statsmodels``' ``multipletests``); everything else a report shows is
exploratory. Each contrast gets a verdict:

- superiority: Holm-adjusted p < α → *better* or *worse* (A against B, in the endpoint's better direction);
  otherwise *inconclusive*;
- equivalence: Holm-adjusted TOST p < α → *equivalent within δ*; the (1 − 2α) interval of the mean difference
  wholly outside [−δ, δ] → *not equivalent*; otherwise *inconclusive*.

Power is the design's, from the pilot, never the confirmatory runs' (power at the observed effect only restates
their p-value). The preregistration names the pilot's runs (``pilot_runs``, read when it is loaded); each contrast's
:class:`Design` holds the pilot's paired effect and spread over its seeds, the power at the confirmatory seed count
at Holm's strictest step (α / m): the paired t-test's (``statsmodels``' ``TTestPower``) for superiority; for
equivalence, the two one-sided noncentral t tests' joint power, bounded below by ``P(low) + P(high) − 1``
(``scipy.stats.nct``); and the smallest number of paired seeds whose power reaches :data:`TARGET_POWER` at the
pilot's effect and spread, with its range over the pilot effect's 95% t interval (the pilot's s.d. held).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

KINDS = ("superiority", "equivalence")
TARGET_POWER = 0.8
MAX_SEEDS = 1000  # where the search for "needs n" stops (an effect that small is no difference to plan for)
KEYS = {"endpoint", "better", "alpha", "pilot_seeds", "pilot_runs", "confirmatory_seeds", "contrasts",
        "margin_rationale", "artefact", "seed_budget", "interval", "exploratory", "secondary", "combine"}
#: the keys of ``secondary``: a second endpoint's own family (the rest is the file's)
SECONDARY_KEYS = {"endpoint", "better", "contrasts", "margin_rationale"}
#: the intervals a preregistration may declare to decide its verdicts, each as the report names it
INTERVALS = {"seeds": "by the paired t over seeds (the held-out documents fixed)"}


@dataclass(frozen=True)
class Contrast:
    """A planned contrast A vs B: its kind and, for equivalence, the margin δ (the endpoint's units)."""

    a: str
    """Strategy A, the one the verdict speaks of (``better`` or ``worse`` than B)."""
    b: str
    """Strategy B, the comparator."""
    kind: str
    """``superiority`` (a paired t-test) or ``equivalence`` (TOST within ``margin``)."""
    margin: float | None = None
    """Equivalence only: the margin δ in the endpoint's units (> 0), its reason in ``margin_rationale``."""

    @property
    def name(self) -> str:
        return f"{self.a} vs {self.b}"


@dataclass(frozen=True)
class Preregistration:
    """What was declared before the confirmatory runs (module docstring)."""

    endpoint: str
    """The primary endpoint: a column of ``runs.csv`` (e.g. ``final_eval_loss``)."""
    better: str
    """Which way the endpoint improves: ``lower`` or ``higher``."""
    alpha: float
    """The family-wise level Holm controls over the planned contrasts, in (0, 0.5); 0.05 when the file omits it."""
    contrasts: tuple[Contrast, ...]
    """The planned contrasts A vs B, each ``{a, b, kind}`` (``margin`` too for an equivalence)."""
    pilot_seeds: tuple[int, ...] = ()
    """The seeds of the pilot the design was sized on; never reused."""
    confirmatory_seeds: tuple[int, ...] = ()
    """The seeds of the confirmatory runs (the sweeps run these: ``${batchlab_seeds:confirmatory}``)."""
    margin_rationale: str = ""
    """Why the equivalence margins are what they are (required with an equivalence contrast)."""
    artefact: str = ""
    """The data fingerprint the design was declared on (the shipped embedded default's); empty: not checked."""
    seed_budget: int | None = None
    """The most confirmatory seeds the run budget holds (the count is capped there)."""
    pilot_runs: str = ""
    """The pilot's ``runs.csv`` as the file names it (relative to the repository root); empty: no pilot declared."""
    pilot_differences: tuple[tuple[float, ...], ...] = field(default=(), metadata={"read_from": "pilot_runs"})
    """Per contrast (in ``contrasts``' order), the pilot's A − B on the endpoint at each pilot seed (sorted), read from
    ``pilot_runs`` (no key of the file); empty without it."""
    exploratory: str = ""
    """Why the contrasts are exploratory although declared (e.g. declared after a result of the same question had
    been seen); empty: a confirmatory test. The summary and report then say so where they name the file."""
    interval: str = "seeds"
    """Which interval decides the verdicts (:data:`INTERVALS`): ``seeds``, the paired t over seeds. The interval over
    seeds and documents (:mod:`analysis.per_sample`) is reported beside it."""
    secondary: Preregistration | None = None
    """A second endpoint's own family, ``{endpoint, better, contrasts, margin_rationale}``; None: one endpoint.

    It takes the file's seeds, α, data and pilot; Holm runs over its contrasts alone."""
    combine: str = ""
    """How the two endpoints' verdicts combine into the answer, declared with them (required with ``secondary``)."""


def load_preregistration(path: str | Path) -> Preregistration:
    """The preregistration in ``path``; a ValueError names the key and the fix for anything it cannot use."""
    import yaml

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"preregistration {path} does not exist")
    raw = yaml.safe_load(path.read_text())
    if not isinstance(raw, dict):  # bad input is a ValueError at every command (harness.command_errors)
        raise ValueError(f"{path}: give a mapping with the keys {sorted(KEYS)}")  # noqa: TRY004
    unknown = sorted(set(raw) - KEYS)
    if unknown:
        raise ValueError(f"{path}: unknown key(s) {unknown}; the keys are {sorted(KEYS)}")
    plan = _family(path, {k: v for k, v in raw.items() if k not in ("secondary", "combine")})
    if "secondary" not in raw:
        if raw.get("combine"):
            raise ValueError(f"{path}: combine without a secondary endpoint; declare secondary, or leave combine out")
        return plan
    secondary = raw["secondary"]
    if not isinstance(secondary, dict) or set(secondary) - SECONDARY_KEYS or {"endpoint", "better"} - set(secondary):
        raise ValueError(f"{path}: secondary={secondary!r}: give {{endpoint, better, contrasts, margin_rationale}} "
                         "(the second endpoint's own family; seeds, alpha, data and pilot are the file's)")
    combine = " ".join(str(raw.get("combine") or "").split())
    if not combine:
        raise ValueError(f"{path}: a secondary endpoint needs combine: say, before the runs, how the two endpoints' "
                         "verdicts combine into the answer")
    keep = {k: v for k, v in raw.items() if k not in ("secondary", "combine", "margin_rationale", "contrasts")}
    try:
        family = _family(path, {**keep, **secondary})
    except ValueError as error:  # the field it names is secondary's: ``secondary.better=...``, else ``secondary: ...``
        message = str(error).removeprefix(f"{path}: ")
        joint = "." if re.match(r"[a-z_]+(\[\d+\])?(=|\.| \()", message) else ": "
        raise ValueError(f"{path}: secondary{joint}{message}") from None
    if family.endpoint == plan.endpoint:
        raise ValueError(f"{path}: secondary.endpoint={family.endpoint!r} is the primary endpoint; give another")
    return replace(plan, secondary=family, combine=combine)


def _family(path: Path, raw: dict[str, Any]) -> Preregistration:
    """One endpoint's declared family from the file's mapping ``raw`` (no ``secondary``)."""
    if raw.get("better") not in ("lower", "higher"):
        raise ValueError(f"{path}: better={raw.get('better')!r}: give 'lower' or 'higher' (which way the endpoint "
                         "improves)")
    alpha = raw.get("alpha", 0.05)
    if not isinstance(alpha, (int, float)) or not 0 < alpha < 0.5:
        raise ValueError(f"{path}: alpha={alpha!r}: give a level in (0, 0.5), e.g. 0.05")
    contrasts = []
    for index, item in enumerate(raw.get("contrasts") or []):
        if not isinstance(item, dict) or {"a", "b", "kind"} - set(item) or set(item) - {"a", "b", "kind", "margin"}:
            raise ValueError(f"{path}: contrasts[{index}]={item!r}: give {{a: STRATEGY, b: STRATEGY, kind: "
                             "superiority}} or {a, b, kind: equivalence, margin: DELTA}")
        if item["kind"] not in KINDS:
            raise ValueError(f"{path}: contrasts[{index}].kind={item['kind']!r}: choose one of {list(KINDS)}")
        margin = item.get("margin")
        if item["kind"] == "equivalence" and not (isinstance(margin, (int, float)) and margin > 0):
            raise ValueError(f"{path}: contrasts[{index}] ({item['a']} vs {item['b']}) is an equivalence test: give "
                             "its margin (> 0, the endpoint's units) and say why in margin_rationale")
        if item["kind"] == "superiority" and margin is not None:
            raise ValueError(f"{path}: contrasts[{index}] ({item['a']} vs {item['b']}) is a superiority test: it "
                             "has no margin")
        contrasts.append(Contrast(str(item["a"]), str(item["b"]), item["kind"],
                                  None if margin is None else float(margin)))
    if not contrasts:
        raise ValueError(f"{path}: no planned contrast; give at least one under contrasts")
    if any(c.kind == "equivalence" for c in contrasts) and not str(raw.get("margin_rationale") or "").strip():
        raise ValueError(f"{path}: an equivalence margin needs its rationale (margin_rationale), committed with it")
    pilot, confirmatory = (tuple(int(s) for s in raw.get(key) or ()) for key in ("pilot_seeds", "confirmatory_seeds"))
    if set(pilot) & set(confirmatory):
        raise ValueError(f"{path}: seeds {sorted(set(pilot) & set(confirmatory))} are both pilot and confirmatory; "
                         "a pilot's seeds are never reused")
    artefact = raw.get("artefact") or ""
    if not isinstance(artefact, str):
        raise ValueError(f"{path}: artefact={artefact!r}: give the data fingerprint the design was declared on "
                         "(its manifest.json's fingerprint under harness/data/bundled/), or leave it out")
    budget = raw.get("seed_budget")
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 2):
        raise ValueError(f"{path}: seed_budget={budget!r}: give the most confirmatory seeds the budget holds (>= 2)")
    if budget is not None and len(confirmatory) > budget:
        raise ValueError(f"{path}: {len(confirmatory)} confirmatory seeds over the seed_budget of {budget}")
    interval = raw.get("interval", "seeds")
    if interval not in INTERVALS:
        raise ValueError(f"{path}: interval={interval!r}: choose one of {sorted(INTERVALS)} (which interval decides "
                         "the verdicts; deciding on the interval over seeds and documents is not built, and it is "
                         "reported beside the verdicts either way)")
    exploratory = raw.get("exploratory") or ""
    if not isinstance(exploratory, str):
        raise ValueError(f"{path}: exploratory={exploratory!r}: say in words why the contrasts are exploratory, or "
                         "leave it out (a confirmatory test)")
    pilot_runs = raw.get("pilot_runs") or ""
    differences = (_pilot_differences(path, pilot_runs, str(raw["endpoint"]), pilot, contrasts, artefact)
                   if pilot_runs else ())
    return Preregistration(str(raw["endpoint"]), raw["better"], float(alpha), tuple(contrasts), pilot, confirmatory,
                           str(raw.get("margin_rationale") or ""), artefact, budget, pilot_runs, differences,
                           " ".join(exploratory.split()), interval)


def _pilot_file(path: Path, pilot_runs: str) -> Path:
    """``pilot_runs`` as written: absolute, or relative to the repository root: the nearest folder holding the
    preregistration ``path`` (its own included) under which it exists, else the working directory (a copy of a
    plan elsewhere, read from the repository root); a ValueError where none holds it."""
    for candidate in [folder / pilot_runs for folder in [*path.resolve().parents, Path.cwd()]]:  # absolute: itself
        if candidate.is_file():
            return candidate
    raise ValueError(f"{path}: pilot_runs={pilot_runs!r}: no such file (relative to the repository root, which "
                     "holds the preregistration, or to the working directory); give the pilot's runs.csv, e.g. "
                     "docs/demo/pilot_runs.csv, or leave pilot_runs out")


def _pilot_differences(path: Path, pilot_runs: Any, endpoint: str, pilot_seeds: tuple[int, ...],
                       contrasts: list[Contrast], artefact: str = "") -> tuple[tuple[float, ...], ...]:
    """Each contrast's A − B on ``endpoint`` at every pilot seed, from the pilot's runs (``pilot_runs``); a
    ValueError names the file, the field and the fix where they cannot size the design, or where the pilot trained
    on other data than the declared ``artefact`` (a design sized on other bytes than the ones it tests)."""
    if not isinstance(pilot_runs, str):
        raise ValueError(f"{path}: pilot_runs={pilot_runs!r}: give the pilot's runs.csv as a path relative to the "
                         "repository root, e.g. docs/demo/pilot_runs.csv")
    runs = pd.read_csv(_pilot_file(path, pilot_runs), float_precision="round_trip")  # as analysis.summary reads runs.csv
    missing = [column for column in ("strategy", "seed", endpoint) if column not in runs.columns]
    if missing:
        raise ValueError(f"{path}: pilot_runs {pilot_runs} has no column {missing}: give the pilot's runs.csv "
                         "(batchlab-report's, of the declared design)")
    if artefact:
        if "data_fingerprint" not in runs.columns:
            raise ValueError(f"{path}: pilot_runs {pilot_runs} has no data_fingerprint column, so nothing shows that "
                             f"the pilot trained on the declared data {artefact[:12]} (artefact): give the pilot's "
                             "runs.csv as batchlab-report writes it")
        other = sorted({str(f)[:12] for f in runs["data_fingerprint"] if str(f) != artefact})
        if other:
            raise ValueError(f"{path}: pilot_runs {pilot_runs} trained on the data {', '.join(other)}, the design is "
                             f"declared on {artefact[:12]} (artefact): size it from a pilot on the declared data")
    seeds = sorted(int(s) for s in runs["seed"].unique())
    if seeds != sorted(pilot_seeds):
        raise ValueError(f"{path}: pilot_runs {pilot_runs} holds seeds {seeds}, pilot_seeds declares "
                         f"{sorted(pilot_seeds)}: declare the seeds the pilot ran (pilot_seeds), or name its runs")
    if len(seeds) < 2:
        raise ValueError(f"{path}: pilot_seeds {seeds}: a pilot sizes the design from the spread over its seeds; "
                         "give 2 or more")
    differences = []
    for index, contrast in enumerate(contrasts):
        absent = [s for s in (contrast.a, contrast.b) if s not in set(runs["strategy"])]
        if absent:
            raise ValueError(f"{path}: pilot_runs {pilot_runs} has no run of {absent} (contrasts[{index}], "
                             f"{contrast.name}): pilot every planned strategy, or leave pilot_runs out")
        both, values_a, values_b = paired_values(runs, endpoint, contrast.a, contrast.b)
        if list(both) != seeds:
            raise ValueError(f"{path}: pilot_runs {pilot_runs} pairs {contrast.name} (contrasts[{index}]) on seeds "
                             f"{list(both)} of pilot_seeds {seeds}: rerun the pilot's missing runs")
        differences.append(tuple(float(d) for d in values_a - values_b))
    return tuple(differences)


def _seeds_range(seeds: tuple[int, ...]) -> str:
    ordered = sorted(seeds)
    if len(ordered) > 2 and ordered == list(range(ordered[0], ordered[-1] + 1)):
        return f"{ordered[0]}–{ordered[-1]}"
    return ", ".join(map(str, ordered))


def _count(n: int | None) -> str:
    return f"more than {MAX_SEEDS}" if n is None else str(n)


@dataclass(frozen=True)
class Design:
    """A planned contrast as the pilot sized it, before the confirmatory runs (never the confirmatory runs' power)."""

    pilot_seeds: tuple[int, ...]
    effect: float
    """The pilot's mean paired difference A − B."""
    sd: float
    """The s.d. of the pilot's paired differences."""
    effect_interval: tuple[float, float]
    """The pilot effect's 95% t interval."""
    seeds: int
    """The confirmatory seeds declared (0: none declared, so no power at them)."""
    power: float
    """The power at ``seeds`` at the pilot's effect and spread, at Holm's strictest level (nan without ``seeds``)."""
    needed: int | None
    """The paired seeds for TARGET_POWER at the pilot's effect and spread (None: more than MAX_SEEDS)."""
    needed_interval: tuple[int | None, int | None]
    """``needed`` over ``effect_interval`` (the pilot's s.d. held): its fewest and most (None: more than MAX_SEEDS)."""

    def words(self, unit: str = "") -> str:
        power = f"power {self.power:.2f} at {self.seeds} seeds; " if self.seeds else ""
        low, high = self.needed_interval
        return (f"design (pilot seeds {_seeds_range(self.pilot_seeds)}, before the confirmatory runs): pilot effect "
                f"{self.effect:+.3f}{unit} (s.d. {self.sd:.3f}{unit}), {power}{TARGET_POWER:.0%} power needs "
                f"{_count(self.needed)} seeds (95% interval of the pilot: {_count(low)} to {_count(high)})")


@dataclass(frozen=True)
class PlannedResult:
    """A planned contrast's outcome: A − B paired over ``seeds``, its test and verdict, and the pilot's design."""

    contrast: Contrast
    seeds: tuple[int, ...]
    mean_difference: float
    sd_difference: float
    interval: tuple[float, float]  # 95 % (superiority) or 1 − 2α (equivalence) t interval of the mean difference
    interval_level: float
    p_value: float  # the t-test's, or TOST's (the larger of its two one-sided p-values)
    p_holm: float
    verdict: str
    design: Design | None = None  # the pilot's sizing (None: the preregistration names no pilot_runs)

    def sentence(self, endpoint_words: str, unit: str = "") -> str:
        low, high = self.interval
        c = self.contrast
        margin = f", δ = {c.margin:g}{unit}" if c.margin is not None else ""
        design = (self.design.words(unit) if self.design is not None
                  else "no design-time power (the preregistration names no pilot_runs)")
        return (f"{c.name} ({c.kind}{margin}): {endpoint_words} {self.mean_difference:+.3f}{unit} "
                f"({self.interval_level:.0%} interval {low:+.3f} to {high:+.3f}), Holm p = {_p(self.p_holm)}: "
                f"**{self.verdict}**; {design}.")


def _p(p: float) -> str:
    return "< 0.001" if p < 0.001 else f"{p:.3f}"


def paired_values(per_run: pd.DataFrame, endpoint: str, a: str, b: str) -> tuple[tuple[int, ...], np.ndarray,
                                                                                 np.ndarray]:
    """The seeds both strategies have, and A's and B's ``endpoint`` at each, in that order."""
    table = per_run.pivot_table(index="seed", columns="strategy", values=endpoint, aggfunc="first")
    missing = [s for s in (a, b) if s not in table.columns]
    if missing:
        raise ValueError(f"planned contrast {a} vs {b}: no run of {missing} in this sweep")
    both = table[[a, b]].dropna()
    return (tuple(int(s) for s in both.index), both[a].to_numpy(dtype=np.float64),
            both[b].to_numpy(dtype=np.float64))


def superiority_power(effect: float, sd: float, n: int, alpha: float) -> float:
    """The two-sided paired t-test's power at mean difference ``effect`` and spread ``sd`` over ``n`` pairs."""
    from scipy import stats

    if n < 2 or not sd > 0:
        return math.nan
    # the noncentral t's two tails, as statsmodels' TTestPower sums them. Called on scipy directly: for a large
    # noncentrality (an effect of 5 s.d. at 5 pairs) scipy's far tail, P(T < -critical), underflows to nan, and so
    # does TTestPower, where the power is ~1. That tail is then below 1e-15 (its finite neighbours), so it counts 0.
    df, noncentrality = n - 1, abs(effect) / sd * math.sqrt(n)
    critical = stats.t.ppf(1 - alpha / 2, df)
    far = float(stats.nct.cdf(-critical, df, noncentrality))
    return float(stats.nct.sf(critical, df, noncentrality)) + (far if math.isfinite(far) else 0.0)


def equivalence_power(effect: float, sd: float, n: int, alpha: float, margin: float) -> float:
    """TOST's power (its two one-sided tests at ``alpha`` each) at true mean difference ``effect`` and spread
    ``sd`` over ``n`` pairs: ``P(low rejects) + P(high rejects) − 1``, a lower bound (the two share one s.d.)."""
    from scipy import stats

    if n < 2 or not sd > 0:
        return math.nan
    df, scale = n - 1, sd / math.sqrt(n)
    critical = stats.t.ppf(1 - alpha, df)
    low = stats.nct.sf(critical, df, (effect + margin) / scale)  # (d̄ + δ)/se > t_crit
    high = stats.nct.cdf(-critical, df, (effect - margin) / scale)  # (d̄ − δ)/se < −t_crit
    return float(max(0.0, low + high - 1.0))


def seeds_needed(power_at: Any, start: int) -> int | None:
    """The smallest n ≥ 2 (searched from ``start``) with ``power_at(n) ≥ TARGET_POWER``; None past MAX_SEEDS.
    Power grows with n (both tests' do where they can reach the target), so the search bisects between ``start``
    and MAX_SEEDS."""
    low = max(start, 2)
    if low > MAX_SEEDS:
        return None
    if power_at(low) >= TARGET_POWER:
        return low
    high = MAX_SEEDS
    if not power_at(high) >= TARGET_POWER:
        return None
    while high - low > 1:  # power_at(low) short of the target, power_at(high) reaching it
        middle = (low + high) // 2
        if power_at(middle) >= TARGET_POWER:
            high = middle
        else:
            low = middle
    return high


def design_of(contrast: Contrast, differences: tuple[float, ...], plan: Preregistration) -> Design:
    """What the pilot's paired ``differences`` (one per pilot seed) give ``contrast``: its effect, spread, power at
    the confirmatory seed count and the seeds TARGET_POWER needs, all at Holm's strictest level (α / m)."""
    from scipy import stats

    strictest = plan.alpha / len(plan.contrasts)
    values = np.asarray(differences)
    pilot_n, effect, sd = len(values), float(values.mean()), float(values.std(ddof=1))
    half = float(stats.t.ppf(0.975, pilot_n - 1)) * sd / math.sqrt(pilot_n)

    def power(mean: float, k: int) -> float:
        if contrast.kind == "superiority":
            return superiority_power(mean, sd, k, strictest)
        return equivalence_power(mean, sd, k, strictest, contrast.margin)

    def needed(mean: float) -> int | None:
        return seeds_needed(lambda k: power(mean, k), 2)

    ends = (effect - half, effect + half)
    # the fewest and most seeds over the interval: both powers fall as |effect| falls (superiority) or grows
    # (equivalence), so the extremes lie at its ends or at its point nearest zero (zero itself where it holds zero)
    over = [needed(mean) for mean in (*ends, min(max(0.0, ends[0]), ends[1]))]
    ordered = sorted(over, key=lambda n: math.inf if n is None else n)
    seeds = len(plan.confirmatory_seeds)  # none: both powers are nan under 2 pairs
    return Design(tuple(sorted(plan.pilot_seeds)), effect, sd, ends, seeds, power(effect, seeds), needed(effect),
                  (ordered[0], ordered[-1]))


def planned_results(per_run: pd.DataFrame, plan: Preregistration) -> list[PlannedResult]:
    """Every planned contrast of ``plan`` on ``per_run`` (one row per run: strategy, seed, the endpoint), Holm over
    the planned family only."""
    from scipy import stats
    from statsmodels.stats.multitest import multipletests
    from statsmodels.stats.weightstats import ttost_paired

    if plan.endpoint not in per_run.columns:
        raise ValueError(f"the preregistered endpoint {plan.endpoint!r} is not a column of the runs "
                         f"({sorted(per_run.columns)[:12]} ...)")
    if plan.artefact and "data_fingerprint" in per_run.columns:
        other = sorted({str(f)[:12] for f in per_run["data_fingerprint"].dropna() if str(f) != plan.artefact})
        if other:
            raise ValueError(f"the preregistration was declared on the data {plan.artefact[:12]} (artefact), but runs "
                             f"of this sweep trained on {', '.join(other)}: they are another experiment; test them "
                             "without this preregistration, or rerun them on the declared data")
    confirmatory = per_run["seed"].isin(plan.confirmatory_seeds)
    if confirmatory.any():  # a sweep holding confirmatory runs is tested on them alone (never on the pilot's too)
        per_run = per_run[confirmatory]
    rows = []
    for contrast in plan.contrasts:
        seeds, values_a, values_b = paired_values(per_run, plan.endpoint, contrast.a, contrast.b)
        diffs = values_a - values_b
        if len(diffs) < 2:
            raise ValueError(f"planned contrast {contrast.name}: {len(diffs)} paired seed(s); a paired test needs 2 "
                             "or more")
        n, mean, sd = len(diffs), float(diffs.mean()), float(diffs.std(ddof=1))
        if contrast.kind == "superiority":
            p = float(stats.ttest_rel(values_a, values_b).pvalue)
            level = 0.95
        else:
            p = float(ttost_paired(values_a, values_b, -contrast.margin, contrast.margin)[0])
            level = 1 - 2 * plan.alpha
        half = stats.t.ppf(0.5 + level / 2, n - 1) * sd / math.sqrt(n)
        rows.append((contrast, seeds, mean, sd, (mean - half, mean + half), level, p))
    adjusted = multipletests([row[-1] for row in rows], alpha=plan.alpha, method="holm")[1]
    designs = [design_of(c, d, plan) for c, d in zip(plan.contrasts, plan.pilot_differences)] or [None] * len(rows)
    results = []
    for (contrast, seeds, mean, sd, interval, level, p), p_holm, design in zip(rows, adjusted, designs):
        if p_holm < plan.alpha:
            if contrast.kind == "superiority":
                a_better = (mean < 0) == (plan.better == "lower")
                verdict = "better" if a_better else "worse"
            else:
                verdict = "equivalent within δ"
        elif contrast.kind == "equivalence" and (interval[0] > contrast.margin or interval[1] < -contrast.margin):
            verdict = "not equivalent"
        else:
            verdict = "inconclusive"
        results.append(PlannedResult(contrast, seeds, mean, sd, interval, level, p, float(p_holm), verdict, design))
    return results


def planned_frame(results: list[PlannedResult]) -> pd.DataFrame:
    """One row per planned contrast (``planned.csv``)."""
    return pd.DataFrame([{
        "contrast": r.contrast.name, "kind": r.contrast.kind, "margin": r.contrast.margin, "seeds": len(r.seeds),
        "mean_difference": r.mean_difference, "sd_difference": r.sd_difference, "interval_low": r.interval[0],
        "interval_high": r.interval[1], "interval_level": r.interval_level, "p_value": r.p_value,
        "p_holm": r.p_holm, "verdict": r.verdict, **_design_columns(r.design),
    } for r in results])


def _design_columns(design: Design | None) -> dict[str, Any]:
    """``planned.csv``'s design columns: the pilot's effect and spread, the power at the confirmatory seeds and the
    seeds TARGET_POWER needs with their range (empty without a pilot; a count past MAX_SEEDS is empty too)."""
    if design is None:
        return dict.fromkeys(DESIGN_COLUMNS)
    return dict(zip(DESIGN_COLUMNS, (design.effect, design.sd, design.power, design.seeds, design.needed,
                                     *design.needed_interval)))


DESIGN_COLUMNS = ("pilot_effect", "pilot_sd", "design_power", "design_seeds", "design_needs_seeds",
                  "design_needs_seeds_low", "design_needs_seeds_high")


def seeds_words(results: list[PlannedResult], plan: Preregistration) -> str:
    """Which seeds the contrasts ran on, and whether they are the plan's confirmatory seeds or its pilot's."""
    seeds = sorted({seed for r in results for seed in r.seeds})
    listed = ", ".join(map(str, seeds))
    declared = sorted(plan.confirmatory_seeds)
    if declared and set(seeds) <= set(declared):
        if len(seeds) == len(declared):
            return f"the confirmatory seeds ({listed})"
        return f"{len(seeds)} of the {len(declared)} confirmatory seeds ({listed}; the others are not in these runs)"
    if plan.pilot_seeds and set(seeds) <= set(plan.pilot_seeds):
        missing = f"; the confirmatory seeds ({', '.join(map(str, declared))}) are not in these runs" if declared else ""
        return f"the pilot's seeds ({listed}), not a confirmatory test{missing}"
    return f"seeds {listed}, neither the plan's pilot nor its confirmatory seeds"


def verdict_lines(results: list[PlannedResult], plan: Preregistration, source: str) -> list[str]:
    """The answer in words, one sentence per planned contrast (the summary's opening, pasted in the README)."""
    declared = (f"Exploratory contrasts (declared in `{source}`, {plan.exploratory}" if plan.exploratory
                else f"Planned contrasts (pre-registered in `{source}`")
    heading = (f"{declared}; {plan.endpoint}, {plan.better} is better, Holm over the {len(results)} at "
               f"α = {plan.alpha:g}), on {seeds_words(results, plan)}:")
    return [heading, "", *(f"- {r.sentence(plan.endpoint)}" for r in results)]


def secondary_lines(results: list[PlannedResult], plan: Preregistration, source: str) -> list[str]:
    """The secondary endpoint's verdicts (``results``: :func:`planned_results` of ``plan.secondary``), then how the
    two endpoints combine, as declared."""
    family = plan.secondary
    heading = (f"Secondary endpoint (declared in `{source}`; {family.endpoint}, {family.better} is better, its own "
               f"Holm over the {len(results)} at α = {family.alpha:g}), on {seeds_words(results, family)}:")
    return [heading, "", *(f"- {r.sentence(family.endpoint)}" for r in results), "",
            f"How the endpoints combine (declared with them): {plan.combine}"]


def planned_markdown(results: list[PlannedResult], plan: Preregistration, source: str) -> str:
    """The planned contrasts' section: one sentence per contrast, then what was declared."""
    lines = [f"## Planned contrasts (pre-registered: `{source}`)", "",
             (f"Primary endpoint `{plan.endpoint}` ({plan.better} is better), α = {plan.alpha:g}, Holm over the "
              f"{len(results)} planned contrasts only; everything else in this report is exploratory."), ""]
    if plan.exploratory:
        lines[0] = f"## Declared contrasts, exploratory (`{source}`)"
        lines[2] = (f"Exploratory: {plan.exploratory}. Endpoint `{plan.endpoint}` ({plan.better} is better), "
                    f"α = {plan.alpha:g}, Holm over the {len(results)} declared contrasts.")
    lines += [f"- {r.sentence(plan.endpoint)}" for r in results]
    if plan.margin_rationale:
        lines += ["", f"Margin: {' '.join(plan.margin_rationale.split())}"]
    return "\n".join(lines) + "\n"
