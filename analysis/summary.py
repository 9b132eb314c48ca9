"""The short markdown block the README pastes: the per-strategy table and the differences that survive.

:func:`summary_markdown` renders it from the per-run table alone (the report's ``runs.csv``, read back by
:func:`read_runs_csv`), so that it can be re-rendered from a stored file and compared
(``batchlab-report --from-runs-csv runs.csv --markdown-summary out.md``). It holds:

- the table of :data:`SUMMARY_COLUMNS` (mean ± sample s.d. over seeds; ``—`` in the ratio column when the
  sweep's timings were disturbed, see :func:`analysis.stats.timing_check`);
- the differences that survive Holm–Bonferroni over every pair of strategies and headline metric
  (:func:`analysis.stats.compare_pairs`), one line each, or a line saying that none does and why;
- the disturbed-timing note, when it applies;
- first of all, with a pre-registration, one sentence per planned contrast (its effect, interval, verdict and design-time power:
  the answer in words), saying whether the seeds are the confirmatory ones; then, when given, what each strategy's
  throughput buys and the mechanism's parts (:mod:`analysis.answer`, from their stored tables).

Deterministic: the same ``runs.csv`` gives the same bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from analysis.compare import format_table, relative_throughput, strategy_table
from analysis.stats import (ALPHA, MIN_SEEDS, compare_pairs, surviving_sentence, target_features_cached,
                            tested_metrics, timing_check, untested_sentences)

#: column → (heading, format): the README's result table
SUMMARY_COLUMNS = {
    "tokens_per_second": ("real tokens/s", "{:,.0f}"),
    "relative_throughput": ("× sorted", "{:.2f}"),
    "padding_pct": ("padding", "{:.1f}%"),
    "steps": ("optimizer steps", "{:.0f}"),
    "clipped_pct": ("clipped", "{:.1f}%"),
    "recurrence": ("step recurrence", "{:.2f}"),
    "length_mix_excess": ("length-mix excess", "{:.2f}"),
    "final_eval_loss": ("held-out loss", "{:.3f}"),
    "final_eval_tau": ("τ teacher-forced", "{:.3f}"),
    "final_eval_tau_real": ("τ real", "{:.3f}"),
}


def md_table(header: list[str], rows: list[list[str]]) -> str:
    def cell(value: str) -> str:
        return str(value).replace("|", "\\|")

    lines = ["| " + " | ".join(cell(h) for h in header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def read_runs_csv(path: str | Path) -> pd.DataFrame:
    """A report's ``runs.csv``, floats read back exactly as written."""
    return pd.read_csv(path, float_precision="round_trip")


def summary_markdown(runs: pd.DataFrame, plan: Any = None, plan_source: str = "", answer: Sequence[str] = (),
                     samples: dict[Any, Any] | None = None) -> str:
    """The block of the module docstring, from the per-run frame (the columns of ``runs.csv``); with ``plan`` (an
    :class:`analysis.planned.Preregistration`) it opens with one sentence per planned contrast: effect, interval,
    verdict and design-time power, followed by ``answer`` (:func:`analysis.answer.answer_lines`: the throughput each strategy
    buys and the mechanism's parts, from their stored tables); with ``samples`` (the runs' final held-out samples,
    :mod:`analysis.per_sample`) each planned contrast's interval over seeds and documents follows its verdict."""
    opening: list[str] = []
    if plan is not None:
        from analysis.planned import planned_results, secondary_lines, verdict_lines

        opening = [*verdict_lines(planned_results(runs, plan), plan, plan_source), ""]
        if samples:
            from analysis.per_sample import crossed_lines

            crossed = crossed_lines(runs, plan, samples)
            opening += [*crossed, ""] if crossed else []
        if plan.secondary is not None:
            opening += [*secondary_lines(planned_results(runs, plan.secondary), plan, plan_source), ""]
    opening += list(answer)
    per_run = runs.copy()
    per_run["relative_throughput"], reference = relative_throughput(per_run)
    per_run.attrs["reference"] = reference
    table = strategy_table(per_run)
    timing = timing_check(per_run)
    tests = compare_pairs(per_run, tested_metrics(per_run), timing=timing)
    # a column the stored runs.csv predates (length_mix_excess before it was a column) is left out, not shown empty
    columns = {k: v for k, v in SUMMARY_COLUMNS.items() if k in per_run.columns}
    columns["relative_throughput"] = (f"× {reference}", SUMMARY_COLUMNS["relative_throughput"][1])
    if "recurrence_kind" in per_run.columns and (per_run["recurrence_kind"] != "step").any():
        columns["recurrence"] = ("recurrence (micro-batch)", SUMMARY_COLUMNS["recurrence"][1])
    cached = target_features_cached(per_run)
    if cached:  # the target did not run in training: the speed is the drafter's step's, not a strategy's throughput
        columns["tokens_per_second"] = ("drafter tokens/s (target cached)", SUMMARY_COLUMNS["tokens_per_second"][1])
    formatted = format_table(table, timing, columns).drop(columns="seeds")
    seeds = sorted(int(s) for s in per_run["seed"].unique())
    counts = sorted(set(table["seeds"]))
    over = f"{counts[0]} seeds" if len(counts) == 1 else f"{counts[0]}–{counts[-1]} seeds"
    if opening and opening[-1]:  # a table must not run on from the list before it (Markdown joins them)
        opening.append("")
    lines = [*opening, md_table(list(formatted.columns), formatted.astype(str).values.tolist()), "",
             f"(mean ± s.d. over {over}, seeds {', '.join(map(str, seeds))}; × {reference} = ratio to the same "
             f"seed's {reference} run; τ real = tokens per target forward in greedy speculative decoding of held-out "
             "prompts.)", ""]
    if cached:
        lines[-1:-1] = ["", "The target's features were read from the cache (`trainer.target_features=cached`, computed "
                        "once for the sweep): the runs' tokens/s time the drafter's step alone, not a strategy's "
                        "throughput, which the interleaved benchmark measures with the target online "
                        "(`benchmarks/train_throughput.py`, benchmarks/RESULTS.md)."]
    tested = [t for t in tests if t.tested]
    metric_words = "every headline metric" + (" but tokens/s (the drafter's alone here)" if cached else "")
    survivors = [t for t in tested if t.survives]
    if survivors:
        lines.append(f"Differences that survive Holm–Bonferroni ({len(tested)} paired t-tests: every pair of "
                     f"strategies on {metric_words}, paired by seed, α = {ALPHA}):")
        lines += [""] + [f"- {surviving_sentence(t)}" for t in survivors]
    elif tested:
        lines.append(f"No difference survives Holm–Bonferroni ({len(tested)} paired t-tests: every pair of "
                     f"strategies on {metric_words}, paired by seed, α = {ALPHA}): no ranking is significant.")
    else:
        lines.append(f"Nothing is tested (fewer than {MIN_SEEDS} paired seeds): no ranking is significant.")
    untested = untested_sentences(tests)
    if untested:
        lines += [""] + untested
    if timing.flagged:
        lines += ["", timing.note()]
    return "\n".join(lines) + "\n"


def write_summary(runs: pd.DataFrame, path: str | Path, plan: Any = None, plan_source: str = "",
                  answer: Sequence[str] = (), samples: dict[Any, Any] | None = None) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(summary_markdown(runs, plan, plan_source, answer, samples))
    return path
