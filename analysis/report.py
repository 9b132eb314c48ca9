"""The sweep report: figures, tables, sentences → ``report.md`` and a self-contained ``report.html``.

:func:`build_report` takes a loaded :class:`~analysis.load.Sweep` and writes into ``out_dir``:
``figures/<name>.png`` and ``.svg`` (the eight figures of :mod:`analysis.figures`), ``runs.csv``
(per-run numbers), ``strategies.csv`` (the per-strategy table, means and standard deviations, and the
timing check: ``tokens_per_second_cv``, ``step_slot_rate_spread_max``, ``step_stall_factor_max``,
``timing_disturbed``),
``comparisons.csv`` (every pair of strategies on every headline metric: paired t-test, Holm–Bonferroni;
:mod:`analysis.stats`), ``excluded.csv`` (runs left out), ``summary.md`` (the README's block,
:mod:`analysis.summary`, rendered from ``runs.csv``), ``report.md`` and ``report.html`` (figures embedded
as base64 PNG, no external file needed). A sweep that ran strategies in both step modes
(``experiment=ablation_steps``) adds an ablation section, ``ablation.csv`` and ``figures/ablation_steps``
(:mod:`analysis.ablation`); one in both loss normalisers (``experiment=ablation_normaliser``) the mechanism section,
``ablation_normaliser.csv`` and ``figures/ablation_normaliser``.
"""

from __future__ import annotations

import base64
import html
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from analysis import ablation as abl
from analysis import figures as figs
from analysis.compare import comparison_sentences, format_table, run_metrics, strategy_table, summary_sentences
from analysis.load import Sweep
from analysis.stats import (
    HEADLINE_METRICS,
    PairTest,
    TimingCheck,
    compare_pairs,
    comparisons_frame,
    format_p,
    tested_metrics,
    timing_check,
)
from analysis.summary import md_table, read_runs_csv, write_summary


@dataclass
class Report:
    out_dir: Path
    per_run: pd.DataFrame
    table: pd.DataFrame
    comparisons: list[PairTest]
    timing: TimingCheck
    sentences: list[str]
    figures: dict[str, list[Path]] = field(default_factory=dict)
    markdown: Path | None = None
    html: Path | None = None
    summary: Path | None = None
    planned: list = field(default_factory=list)  # analysis.planned.PlannedResult, one per planned contrast


def sweep_facts(sweep: Sweep, per_run: pd.DataFrame) -> list[tuple[str, str]]:
    """What was compared: the lines of the report's "Sweep" section."""
    runs = sweep.runs
    first = runs.iloc[0]

    def column(name: str, default: Any = "—") -> Any:
        return first[name] if name in runs.columns and not _missing(first[name]) else default

    seeds = sweep.seeds
    epochs = per_run["epochs"]
    facts = [
        ("sweep", ", ".join(sweep.sources)),
        ("strategies", ", ".join(sweep.strategies)),
        ("seeds", f"{len(seeds)} ({', '.join(map(str, seeds))})"),
        ("complete runs", f"{len(runs)}"
         + (f"; {len(sweep.excluded)} left out (below)" if len(sweep.excluded) else "")),
        ("tokens per run", f"{int(column('stop_tokens', 0)):,} training tokens (stop), "
                           f"{per_run['tokens_seen'].mean():,.0f} seen on average"),
        ("epochs", f"{epochs.min():.2f}–{epochs.max():.2f} (epoch = {int(column('epoch_tokens', 0)):,} tokens)"),
        ("budget", f"max_tokens {int(column('max_tokens', 0))} per micro-batch, {column('world_size', 1)} rank(s) × "
                   f"{column('grad_accum', 1)} accumulation micro-batch(es) per step"),
        ("data", f"{column('data.source')} (max_documents {column('data.max_documents')}, "
                 f"{column('train_samples')} training / {column('heldout_samples')} held-out samples), "
                 f"fingerprint {str(column('data_fingerprint'))[:12]}"),
        ("model", f"target {column('target.num_hidden_layers')} layers × {column('target.hidden_size')}, "
                  f"drafter {column('drafter.num_hidden_layers')} layers, block {column('drafter.block_size')}"),
        ("target loss", f"{per_run['target_loss'].iloc[0]:.3f} (the column \"tokens to target loss\")"),
    ]
    return facts


def _missing(value: Any) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def build_report(sweep: Sweep, out_dir: str | Path, target_loss: float | None = None,
                 title: str = "batchlab: batching strategies compared", plan: Any = None,
                 plan_source: str = "", answer: list[str] | None = None,
                 throughput: dict[str, tuple[float, float, float]] | None = None,
                 reference: tuple[list[Any], str, str] | None = None) -> Report:
    """The report of ``sweep`` in ``out_dir``; with ``plan`` (an :class:`analysis.planned.Preregistration`), its
    planned contrasts first (a ValueError when the sweep lacks what they need, before anything is written), and
    ``answer`` (:func:`analysis.answer.answer_lines`) after them in the summary and the report; ``throughput`` (the
    interleaved benchmark's ratios, :func:`analysis.answer.ratio_table`) is the frontier figure's y-axis;
    ``reference`` (another design's planned results, its name and its runs' file) adds where the verdicts agree with
    it (:mod:`analysis.agreement`) after the answer."""
    out_dir = Path(out_dir)
    per_run = run_metrics(sweep, target_loss)
    planned, planned_section, samples = [], "", None
    if plan is not None:
        from analysis.agreement import with_agreement
        from analysis.planned import planned_frame, planned_markdown, planned_results

        planned = planned_results(per_run, plan)
        answer = with_agreement(answer or (), planned, reference)
        planned_section = planned_markdown(planned, plan, plan_source)
        from analysis.per_sample import SAMPLES_CSV, crossed_lines, run_samples, samples_table

        samples = run_samples(per_run.merge(sweep.runs[["run", "path"]], on="run", how="left"))
        crossed = crossed_lines(per_run, plan, samples)
        if crossed:  # the runs wrote eval_samples.jsonl: the same effects, documents treated as sampled too
            planned_section += "\n" + "\n".join(crossed) + "\n"
        if plan.secondary is not None:
            from analysis.planned import secondary_lines

            secondary_results = planned_results(per_run, plan.secondary)
            planned_section += "\n" + "\n".join(secondary_lines(secondary_results, plan, plan_source)) + "\n"
    out_dir.mkdir(parents=True, exist_ok=True)
    if planned:
        frames = [planned_frame(planned).assign(endpoint=plan.endpoint)]
        if plan.secondary is not None:
            frames.append(planned_frame(secondary_results).assign(endpoint=plan.secondary.endpoint))
        pd.concat(frames, ignore_index=True).to_csv(out_dir / "planned.csv", index=False)
        (out_dir / "planned.md").write_text(planned_section)
        held_out = samples_table(samples)
        if held_out is not None:  # what a study commits beside runs.csv: its crossed intervals recomputed from it
            held_out.to_csv(out_dir / SAMPLES_CSV, index=False)
    table = strategy_table(per_run)
    timing = timing_check(per_run)
    table["tokens_per_second_cv"] = table["strategy"].map(timing.cv)
    table["step_slot_rate_spread_max"] = table["strategy"].map(timing.spread)
    table["step_stall_factor_max"] = table["strategy"].map(timing.stall)
    table["timing_disturbed"] = table["strategy"].isin(timing.disturbed)
    comparisons = compare_pairs(per_run, tested_metrics(per_run), timing=timing)
    sentences = summary_sentences(table, comparisons, timing)
    stats_sentences = comparison_sentences(comparisons, timing)
    style = figs.StrategyStyle(sweep.strategies)
    figure_dir = out_dir / "figures"
    paths = {name: figs.save_figure(fig, figure_dir, name)
             for name, fig in figs.all_figures(per_run, sweep.steps, style, timing.disturbed, throughput).items()}
    per_run.to_csv(out_dir / "runs.csv", index=False)
    table.to_csv(out_dir / "strategies.csv", index=False)
    comparisons_frame(comparisons).to_csv(out_dir / "comparisons.csv", index=False)
    sweep.excluded.to_csv(out_dir / "excluded.csv", index=False)
    report = Report(out_dir, per_run, table, comparisons, timing, sentences + stats_sentences, paths)
    report.planned = planned
    report.summary = write_summary(read_runs_csv(out_dir / "runs.csv"), out_dir / "summary.md", plan, plan_source,
                                   answer or (), samples=samples)
    facts = sweep_facts(sweep, per_run)
    formatted = format_table(table, timing)
    notes = table_notes(per_run, table, timing)
    ablation = ablation_sections(per_run, out_dir, figure_dir)
    report.markdown = out_dir / "report.md"
    captions = figs.figure_captions(int(per_run.groupby("strategy").size().min()) if len(per_run) else 0)
    markdown = render_markdown(title, facts, sentences, stats_sentences, formatted, notes, comparisons,
                               sweep.excluded, paths, captions, ablation)
    told = "\n".join(answer or ())
    lead = planned_section + (f"\n{told}\n" if told else "")
    if lead:  # the planned contrasts (and the answer's other parts) open the report, under its title
        heading, _, rest = markdown.partition("\n")
        markdown = f"{heading}\n\n{lead}{rest}"
    report.markdown.write_text(markdown)
    report.html = out_dir / "report.html"
    report.html.write_text(render_html(title, facts, sentences, stats_sentences, formatted, notes, comparisons,
                                       sweep.excluded, paths, captions, style, ablation, lead))
    return report


@dataclass
class AblationSection:
    """One of the report's ablations (:mod:`analysis.ablation`: the step mode, the loss normaliser), when the sweep
    ran strategies in both arms."""
    table: pd.DataFrame
    sentences: list[str]
    figure: list[Path]
    heading: str = abl.HEADING
    name: str = "ablation_steps"


def ablation_sections(per_run: pd.DataFrame, out_dir: Path, figure_dir: Path) -> list[AblationSection]:
    """Every factor the sweep ran in both arms; each writes its csv (``Factor.csv``): every gap and part with its
    interval."""
    sections = []
    for factor in abl.FACTORS:
        if not abl.has_ablation(per_run, factor):
            continue
        parts = abl.step_parts(per_run, factor)
        (first, first_low), (second, second_low) = factor.gap_columns
        part = factor.part_column
        pd.DataFrame([{"metric": p.metric, "a": p.a, "b": p.b, "seeds": len(p.seeds),
                       first: p.fixed.mean, f"{first_low}_low": p.fixed.ci[0], f"{first_low}_high": p.fixed.ci[1],
                       second: p.equal.mean, f"{second_low}_low": p.equal.ci[0], f"{second_low}_high": p.equal.ci[1],
                       part: p.mean, f"{part}_low": p.ci[0], f"{part}_high": p.ci[1]} for p in parts]
                     ).to_csv(out_dir / factor.csv, index=False)
        sections.append(AblationSection(abl.ablation_table(per_run, factor), abl.factor_sentences(per_run, factor),
                                        figs.save_figure(abl.ablation_figure(per_run, factor), figure_dir,
                                                         factor.figure), factor.heading, factor.figure))
    return sections


def table_notes(per_run: pd.DataFrame, table: pd.DataFrame, timing: TimingCheck) -> list[str]:
    reference = per_run.attrs.get("reference", "sorted")
    kind = per_run["recurrence_kind"].iloc[0]
    notes = [
        "Mean ± sample standard deviation over seeds. All numbers are recomputed from metrics.jsonl.",
        f"real tokens/s = Σ real tokens / Σ step time; × {reference} = ratio to the same seed's {reference} run"
        + ("" if reference == "sorted" else " (no sorted run in this sweep: the fastest strategy is the reference)")
        + (": not quoted (—), the timings were disturbed (below)" if timing.flagged else "") + ".",
        "padding % = 1 − Σ real tokens / Σ computed slots; " + step_mode_note(per_run) + " length-mix excess = "
        "mean over epochs of how much less a step mixes lengths than random steps of the same sizes (KL of its length "
        "histogram to the data's, minus the same for random steps: 0 when steps mix as random ones do; exact from the "
        "plan, docs/design/metrics.md); clipped % = share of steps whose gradient norm was clipped (optim.grad_clip).",
        "lag-1 ACF = the plan's autocorrelation of step mean length at lag 1 (mean over epochs); "
        f"recurrence = {kind}-level composition recurrence between consecutive epochs (1: same batches every epoch).",
        "held-out loss and τ = last evaluation (τ teacher-forced against the data; τ real = tokens per target "
        "forward in greedy speculative decoding of held-out prompts); tokens to target loss = tokens seen at the "
        "first evaluation with "
        f"held-out loss ≤ {per_run['target_loss'].iloc[0]:.3f}.",
    ]
    if timing.flagged:
        notes.append(timing.note())
    return notes


def step_mode_note(per_run: pd.DataFrame) -> str:
    """Which question the sweep's step mode answers (docs/design/training-runs.md)."""
    modes = set(per_run["step_mode"].dropna()) if "step_mode" in per_run.columns else set()
    if modes == {"equal-token steps"}:
        return ("every optimizer step carries the same real tokens (trainer.step_tokens), so every strategy takes "
                "the same optimizer steps and padding shows as a step's cost: the comparison isolates batch "
                "composition.")
    if modes == {"fixed accumulation"}:
        return ("every optimizer step has a fixed number of micro-batches of one slot budget, so a strategy that "
                "pads more takes more, smaller optimizer steps for the same tokens: differences mix step count "
                "with composition.")
    return "the runs mix step modes (equal-token steps and fixed accumulation): see the ablation section."


def _signed(fmt: str, value: float) -> str:
    return fmt.replace("{:", "{:+").format(value)


def _pairs_rows(tests: list[PairTest]) -> list[list[str]]:
    rows = []
    for t in tests:
        words, fmt, _ = HEADLINE_METRICS[t.metric]
        head = [words, t.a, t.b, str(len(t.seeds)), _signed(fmt, t.mean_diff) if t.seeds else "—"]
        if t.tested:
            rows.append([*head, f"[{_signed(fmt, t.ci[0])}, {_signed(fmt, t.ci[1])}]", format_p(t.p_value),
                         f"{t.threshold:.4g}", format_p(t.p_holm), "yes" if t.survives else "no"])
        else:
            rows.append([*head, "—", f"not tested: {t.note}", "—", "—", "no"])
    return rows


PAIR_HEADER = ["metric", "A", "B", "seeds", "mean A − B", "95% t interval", "p (paired t)", "Holm threshold",
               "Holm-adjusted p", "survives (α = 0.05)"]
STATS_HEADING = "Statistical comparison (every pair of strategies, paired by seed, Holm–Bonferroni)"


def render_markdown(title, facts, sentences, stats_sentences, formatted, notes, comparisons, excluded, paths,
                    figure_captions,
                    ablation: list[AblationSection] = ()) -> str:
    parts = [f"# {title}", "", "## Sweep", ""]
    parts += [f"- **{k}**: {v}" for k, v in facts]
    parts += ["", "## Findings", ""] + [f"- {s}" for s in sentences]
    parts += ["", "## Per strategy", "", md_table(list(formatted.columns), formatted.astype(str).values.tolist()), ""]
    parts += [f"- {n}" for n in notes]
    parts += ["", f"## {STATS_HEADING}", ""]
    parts += [f"- {s}" for s in stats_sentences]
    rows = _pairs_rows(comparisons)
    if rows:
        parts += ["", md_table(PAIR_HEADER, rows)]
    for section in ablation:
        png, svg = section.figure
        parts += ["", f"## {section.heading}", "",
                  abl.section_markdown(section.table, section.sentences).rstrip("\n")]
        parts += ["", f"![{section.heading}](figures/{png.name})", "", f"SVG: [figures/{svg.name}](figures/{svg.name})"]
    parts += ["", "## Figures", ""]
    for i, (name, caption) in enumerate(figure_captions.items(), start=1):
        png = paths[name][0]
        parts += [f"### {i}. {caption}", "", f"![{caption}](figures/{png.name})", "",
                  f"SVG: [figures/{paths[name][1].name}](figures/{paths[name][1].name})", ""]
    parts += ["## Runs left out", ""]
    if len(excluded):
        parts += [f"- `{r.run}` ({r.strategy}, seed {r.seed}): {r.reason}" for r in excluded.itertuples()]
    else:
        parts.append("None: every run found is complete.")
    return "\n".join(parts) + "\n"


CSS = """
body { font-family: -apple-system, "Segoe UI", Helvetica, Arial, sans-serif; max-width: 1180px; margin: 2em auto;
       padding: 0 1em; color: #111; line-height: 1.45; background: #fff; }
h1 { font-size: 1.6em; border-bottom: 2px solid #333; padding-bottom: .2em; }
h2 { font-size: 1.25em; margin-top: 1.6em; border-bottom: 1px solid #bbb; }
table { border-collapse: collapse; margin: .8em 0; font-size: .9em; }
th, td { border: 1px solid #999; padding: .3em .6em; text-align: right; }
th { background: #eee; } td:first-child, th:first-child { text-align: left; }
figure { margin: 1.2em 0; } figure img { max-width: 100%; border: 1px solid #ddd; }
figcaption { font-weight: bold; margin-bottom: .3em; }
.swatch { display: inline-block; width: .9em; height: .9em; margin-right: .35em; vertical-align: -0.1em;
          border: 1px solid #333; }
ul.facts li { margin: .1em 0; } .notes { font-size: .85em; color: #333; }
@media print { body { max-width: none; } figure { page-break-inside: avoid; } }
"""


def _html_table(header: list[str], rows: list[list[str]], colours: dict[str, str] | None = None) -> str:
    out = ["<table>", "<tr>" + "".join(f"<th>{html.escape(str(h))}</th>" for h in header) + "</tr>"]
    for row in rows:
        cells = []
        for i, value in enumerate(row):
            text = html.escape(str(value))
            if i == 0 and colours and value in colours:
                text = f'<span class="swatch" style="background:{colours[value]}"></span>{text}'
            cells.append(f"<td>{text}</td>")
        out.append("<tr>" + "".join(cells) + "</tr>")
    out.append("</table>")
    return "\n".join(out)


def render_html(title, facts, sentences, stats_sentences, formatted, notes, comparisons, excluded, paths,
                figure_captions,
                style: figs.StrategyStyle, ablation: list[AblationSection] = (), lead: str = "") -> str:
    """``lead``: markdown that opens the report under its title (the planned contrasts and the answer after them),
    rendered by markdown-it (CommonMark)."""
    esc = html.escape
    body = [f"<h1>{esc(title)}</h1>"]
    if lead:
        from markdown_it import MarkdownIt

        body.append(MarkdownIt("commonmark", {"html": False}).render(lead))
    body += ["<h2>Sweep</h2>", '<ul class="facts">']
    body += [f"<li><b>{esc(k)}</b>: {esc(str(v))}</li>" for k, v in facts]
    body += ["</ul>", "<h2>Findings</h2>", "<ul>"] + [f"<li>{esc(s)}</li>" for s in sentences] + ["</ul>"]
    body += ["<h2>Per strategy</h2>",
             _html_table(list(formatted.columns), formatted.astype(str).values.tolist(), style.colours()),
             '<ul class="notes">'] + [f"<li>{esc(n)}</li>" for n in notes] + ["</ul>"]
    body += [f"<h2>{esc(STATS_HEADING)}</h2>", "<ul>"]
    body += [f"<li>{esc(s)}</li>" for s in stats_sentences] + ["</ul>"]
    rows = _pairs_rows(comparisons)
    if rows:
        body.append(_html_table(PAIR_HEADER, rows))
    for section in ablation:
        data = base64.b64encode(section.figure[0].read_bytes()).decode("ascii")
        body += [f"<h2>{esc(section.heading)}</h2>",
                 _html_table(list(section.table.columns), section.table.astype(str).values.tolist()), "<ul>"]
        body += [f"<li>{esc(s)}</li>" for s in section.sentences] + ["</ul>"]
        body.append(f'<figure id="fig-{section.name}"><img alt="{esc(section.heading)}" '
                    f'src="data:image/png;base64,{data}"></figure>')
    body.append("<h2>Figures</h2>")
    for i, (name, caption) in enumerate(figure_captions.items(), start=1):
        data = base64.b64encode(paths[name][0].read_bytes()).decode("ascii")
        body.append(f'<figure id="fig-{name}"><figcaption>{i}. {esc(caption)}</figcaption>'
                    f'<img alt="{esc(caption)}" src="data:image/png;base64,{data}"></figure>')
    body.append("<h2>Runs left out</h2>")
    if len(excluded):
        body += ["<ul>"] + [f"<li><code>{esc(str(r.run))}</code> ({esc(str(r.strategy))}, seed {esc(str(r.seed))}): "
                            f"{esc(str(r.reason))}</li>" for r in excluded.itertuples()] + ["</ul>"]
    else:
        body.append("<p>None: every run found is complete.</p>")
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{esc(title)}</title><style>{CSS}</style></head><body>\n" + "\n".join(body) + "\n</body></html>\n")


def finite_or_none(value: float) -> float | None:
    return float(value) if value is not None and np.isfinite(value) else None
