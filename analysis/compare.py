"""Numbers of the report, all recomputed from the step histories: per run, per strategy, across seeds.

Per run (:func:`run_metrics`, one row per run, from ``Sweep.steps``; the averages over steps are
:func:`harness.step_averages.step_averages`, the same function that writes them into ``summary.json``):

- ``tokens_per_second`` = Σ real_tokens / Σ step_time over the run's steps (real, non-pad tokens).
- ``relative_throughput`` = that / the same seed's ``sorted`` run (``sorted`` is the reference; the
  mean of ``sorted`` over seeds when that seed has no sorted run; the fastest strategy when there is
  no sorted run at all, and the table says so).
- ``padding_pct`` = 100 · (1 − Σ real_tokens / Σ computed_slots); ``clipped_pct`` = 100 · the share of steps
  whose gradient norm was clipped; ``step_mode`` = ``equal-token steps`` or ``fixed accumulation``
  (:func:`analysis.load.step_mode`); ``strategy_name`` = the strategy without its variant label.
- ``grad_diversity`` = mean of the measured steps' Yin Δ at the step's weight (``grad_stats_measured``);
  ``grad_sample_diversity`` = mean of their ``1 + B_simple`` (the table's and the frontier's: no step size in it);
  ``grad_noise_scale`` = its last measured value.
- ``lag1_acf`` = mean over epochs of the plan's lag-1 ACF of step mean length (``plan_lag1_acf``).
- ``recurrence`` = mean over epochs of ``plan_step_recurrence`` (step level) where logged, else of
  ``plan_recurrence`` (micro-batch level); ``recurrence_kind`` says which.
- ``length_mix_excess`` = mean over epochs of ``plan_length_mix_excess``: how much less a step mixes lengths than
  random steps of the same sizes (0: as mixed as random; the table's and the frontier's diversity figure, exact from
  the plan; ``grad_sample_diversity`` is kept beside it but cannot rank strategies whose micro-batches are
  length-homogeneous, ``docs/design/metrics.md``).
- ``final_eval_loss`` / ``final_eval_tau`` = the last held-out evaluation.
- ``tokens_to_loss`` = tokens seen at the first evaluation whose held-out loss is ≤ the target loss
  (by default the worst final held-out loss of all runs, so that every run reaches it).
- ``target_busy_pct`` / ``drafter_idle_pct`` (``topology=disaggregated`` runs only; the table shows them
  when some run has them) = 100 · the mean over steps and target ranks of the target ranks' busy
  fraction / of the drafter ranks' time waiting for features: which stage bounds the run.

- ``step_slot_rate_spread`` = p90 / p10 of the run's per-step computed slots per second and
  ``step_stall_factor`` = Σ step time / (Σ computed slots / median per-step rate)
  (:func:`analysis.stats.step_rate_checks`): how steady the machine was during the run.

Across seeds (:mod:`analysis.stats`): every pair of strategies on every headline metric, paired by seed,
Holm–Bonferroni over the whole family; :func:`analysis.stats.timing_check` says whose timings were disturbed,
and then no throughput ratio is quoted (:func:`format_table`, :func:`summary_sentences`).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pandas as pd

from analysis.load import Sweep, loss_normaliser, order_strategies, step_mode
from analysis.stats import (
    MIN_SEEDS,
    THROUGHPUT_SOURCE,
    PairTest,
    TimingCheck,
    family_sentences,
    step_rate_checks,
    surviving_sentence,
)
from harness.step_averages import step_averages

REFERENCE = "sorted"

#: the per-strategy table: column → (heading, format)
TABLE_COLUMNS = {
    "tokens_per_second": ("real tokens/s", "{:.0f}"),
    "relative_throughput": ("× sorted", "{:.2f}"),
    "padding_pct": ("padding %", "{:.1f}"),
    "steps": ("optimizer steps", "{:.0f}"),
    "clipped_pct": ("clipped %", "{:.1f}"),
    "length_mix_excess": ("length-mix excess", "{:.2f}"),
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
    for _, run in sweep.runs.iterrows():
        history = steps[steps["run"] == run["run"]].sort_values("step")
        # the per-run averages the trainer's summary.json also holds: one definition, harness.train.loop.summary
        averages = step_averages(history.to_dict("records"), recurrence=rec_column)
        target_busy, drafter_idle = _stage_means(history)
        rows.append({
            "run": run["run"], "strategy": run["strategy"], "seed": int(run["seed"]), "steps": int(len(history)),
            "strategy_name": run.get("strategy_name", run["strategy"]), "step_mode": step_mode(run),
            "loss_normaliser": loss_normaliser(run), "lr": run.get("optim.lr", math.nan),
            "data_fingerprint": run.get("data_fingerprint", ""),  # which data (the preregistration names one)
            "target": run.get("target", ""),  # which target model (the trainer's summary names it)
            "machine": run.get("machine", ""),  # what it ran on (CPU model and cores, the accelerator): timings differ
            # "cached": the target's features were read from the cache, so tokens/s times the drafter's step alone
            "target_features": run.get("trainer.target_features", "online") or "online",
            "clipped_pct": 100.0 * averages["clip_fraction"],
            "tokens_seen": int(history["tokens_seen"].iloc[-1]),
            "epochs": float(history["epochs"].iloc[-1]) if "epochs" in history.columns else math.nan,
            "train_time_s": averages["step_time_sum_s"],
            "tokens_per_second": averages["step_tokens_per_second"],
            "padding_pct": averages["padding_pct"],
            "grad_diversity": averages["grad_diversity"],
            "grad_sample_diversity": averages["grad_sample_diversity"],
            "grad_noise_scale": averages["grad_noise_scale"],
            "lag1_acf": averages["lag1_acf"],
            "recurrence": averages["recurrence"],
            "recurrence_kind": averages["recurrence_kind"],
            "length_mix_excess": averages["length_mix_excess"],
            "final_eval_loss": _last_eval(history, "eval_loss"),
            "final_eval_tau": _last_eval(history, "eval_tau"),
            "final_eval_tau_real": _last_eval(history, "eval_tau_real"),
            "target_loss": target,
            "tokens_to_loss": tokens_to_reach(history, target),
            "target_busy_pct": target_busy, "drafter_idle_pct": drafter_idle,
            **step_rate_checks(history["real_tokens"], history.get("computed_slots", history["real_tokens"]),
                               history["step_time"]),
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


def format_table(table: pd.DataFrame, timing: TimingCheck | None = None,
                 columns: dict[str, tuple[str, str]] | None = None) -> pd.DataFrame:
    """The table as strings, ``mean ± sd`` (``—`` where undefined, ``not reached (k/n)`` for the token target).

    With disturbed ``timing`` the ratio column shows ``—`` (no ratio is quoted) and the real tokens/s of each
    disturbed strategy is marked ``(disturbed)``. ``columns`` (default :data:`TABLE_COLUMNS`) picks and names them;
    a format ending in ``%`` shows the unit on both numbers, one with ``,`` separates thousands."""
    columns = TABLE_COLUMNS if columns is None else columns
    disturbed = set(timing.disturbed) if timing is not None else set()
    out = pd.DataFrame({"strategy": table["strategy"], "seeds": table["seeds"].astype(str)})
    for column, (heading, fmt) in columns.items():
        if column in STAGE_COLUMNS and not np.isfinite(table[column].astype(float)).any():
            continue  # colocated runs: no stages to show
        cells = []
        for row in table.itertuples(index=False):
            mean, sd, n = getattr(row, column), getattr(row, f"{column}_sd"), getattr(row, f"{column}_n")
            if column == "relative_throughput" and disturbed:
                cells.append("—")
                continue
            if not math.isfinite(mean):
                cells.append("not reached" if column == "tokens_to_loss" else "—")
                continue
            cell = fmt.format(mean)
            if n > 1 and not (column == "relative_throughput" and row.strategy == table.attrs.get("reference")):
                cell += " ± " + _same_decimals(cell, abs(sd), thousands="," in fmt)
            if column == "tokens_to_loss" and n < row.seeds:
                cell += f" ({n}/{row.seeds} seeds)"
            if column == "tokens_per_second" and row.strategy in disturbed:
                cell += " (disturbed)"
            cells.append(cell)
        out[heading] = cells
    return out


def _same_decimals(shown: str, value: float, thousands: bool = False) -> str:
    """``value`` with as many decimals (and the unit) as the already formatted ``shown`` (``0.953`` → ``0.041``)."""
    unit = "%" if shown.endswith("%") else ""
    digits = shown.removesuffix(unit).split("e")[0]
    decimals = len(digits.split(".")[1]) if "." in digits else 0
    return f"{value:{',' if thousands else ''}.{decimals}f}{unit}"


# ---------------------------------------------------------------- sentences
def summary_sentences(table: pd.DataFrame, tests: list[PairTest], timing: TimingCheck) -> list[str]:
    """The findings: throughput (no ratio when the timings were disturbed), the differences that survive
    Holm–Bonferroni, what the recurrence and diversity numbers say."""
    reference = table.attrs.get("reference", REFERENCE)
    finite = table[np.isfinite(table["tokens_per_second"])]
    if finite.empty:
        return []
    fastest = finite.loc[finite["tokens_per_second"].idxmax()]
    if len(finite) == 1:  # nothing to compare with: no "highest"
        sentences = [f"{fastest['strategy']}: {fastest['tokens_per_second']:,.0f} real tokens/s "
                     f"(padding {fastest['padding_pct']:.1f}%)"
                     + (f"; its timings were disturbed ({THROUGHPUT_SOURCE} is the source of record)."
                        if timing.flagged else ".")]
    elif timing.flagged:
        sentences = [f"{fastest['strategy']} has the highest throughput measured in this sweep "
                     f"({fastest['tokens_per_second']:,.0f} real tokens/s, padding {fastest['padding_pct']:.1f}%), "
                     f"but the timings of {', '.join(timing.disturbed)} were disturbed: no throughput ratio is quoted "
                     f"from this sweep (`{THROUGHPUT_SOURCE}` is the source of record)."]
    else:
        sentences = [f"{fastest['strategy']} has the highest throughput: {fastest['tokens_per_second']:,.0f} real "
                     f"tokens/s, {fastest['relative_throughput']:.2f}× {reference} "
                     f"(padding {fastest['padding_pct']:.1f}%)."]
    survivors = [t for t in tests if t.survives]
    if survivors:
        sentences.append("Differences that survive Holm–Bonferroni (every pair, every headline metric, α = 0.05): "
                         + "; ".join(surviving_sentence(t) for t in survivors) + ".")
    elif any(t.tested for t in tests):
        sentences.append("No difference between strategies survives Holm–Bonferroni over every pair and headline "
                         "metric: no ranking is significant, the means are descriptive only.")
    elif not tests:
        sentences.append("One strategy in this sweep: nothing is compared.")
    else:
        fewest = min((len(t.seeds) for t in tests), default=0)
        sentences.append(f"With {fewest} paired seed{'s' if fewest != 1 else ''} (fewer than {MIN_SEEDS}) nothing is "
                         "tested: no ranking is significant, the means are descriptive only.")
    rec = table[np.isfinite(table["recurrence"])]
    if len(rec) > 1:
        most = rec.loc[rec["recurrence"].idxmax()]
        least = rec.loc[rec["recurrence"].idxmin()]
        sentences.append(f"Batch composition recurs most under {most['strategy']} (recurrence "
                         f"{most['recurrence']:.2f}) and least under {least['strategy']} ({least['recurrence']:.2f}).")
    mix = table[np.isfinite(table["length_mix_excess"])]
    if len(mix) > 1:
        most = mix.loc[mix["length_mix_excess"].idxmax()]
        least = mix.loc[mix["length_mix_excess"].idxmin()]
        sentences.append(f"Steps are the most length-homogeneous under {most['strategy']} (length-mix excess over "
                         f"random steps {most['length_mix_excess']:.2f}) and mix lengths the most like random steps "
                         f"under {least['strategy']} ({least['length_mix_excess']:.2f}; 0 is random).")
    return sentences


def comparison_sentences(tests: list[PairTest], timing: TimingCheck) -> list[str]:
    """The statistics section's sentences: the family, what was not tested, the timing note."""
    return family_sentences(tests) + ([timing.note()] if timing.flagged else [])


def measured_evidence(sweep_dirs: list[str]) -> str:
    """What a finished sweep says: the differences that survive Holm–Bonferroni over every pair and headline
    metric (the report's own tests), or that none does (``batchlab-advise --sweep``)."""
    from analysis.load import SweepError, load_sweeps
    from analysis.stats import compare_pairs, surviving_sentence, timing_check

    try:
        sweep = load_sweeps(sweep_dirs)
    except SweepError as error:
        raise ValueError(f"--sweep: {error}") from None
    per_run = run_metrics(sweep)
    tests = compare_pairs(per_run, timing=timing_check(per_run))
    where = f"Measured in {', '.join(sweep_dirs)} ({len(sweep.runs)} runs, {len(sweep.seeds)} seeds)"
    survivors = [t for t in tests if t.survives]
    if survivors:
        return f"{where}, differences that survive Holm–Bonferroni: " + "; ".join(map(surviving_sentence, survivors)) + "."
    if any(t.tested for t in tests):
        return f"{where}: no difference between strategies survives Holm–Bonferroni; convergence does not separate them."
    return f"{where}: too few paired seeds to test a difference (3 or more are needed)."
