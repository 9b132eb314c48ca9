"""``batchlab-report SWEEP_DIR [SWEEP_DIR ...] [--out DIR] [--markdown-summary PATH] [--wandb-workspace E/P]``.

Reads the runs of one or more sweep directories (``batchlab-train -m ... hydra.sweep.dir=DIR``), writes
the seven figures (PNG + SVG), ``report.md``, a self-contained ``report.html``, the CSV tables and
``summary.md`` (the README's block: per-strategy table, differences that survive Holm–Bonferroni,
disturbed-timing note) into ``--out`` (default ``SWEEP_DIR/report``), and prints where ``report.html``
is; ``--markdown-summary PATH`` writes the summary there too. Crashed or interrupted runs are listed in
the report, never mixed in.

``batchlab-report --from-runs-csv RUNS_CSV [--markdown-summary PATH]`` re-renders the summary from a
report's ``runs.csv`` alone (to PATH, or standard output).

``--preregistration YAML`` (e.g. ``conf/preregistration/strategies.yaml``) adds the planned contrasts declared
there (:mod:`analysis.planned`): a verdict per contrast, Holm over them only, the power the design had; written
to ``planned.md`` and ``planned.csv``, opening ``report.md``, and printed (with ``--from-runs-csv``: printed
after the summary).

``--throughput-rounds CSV`` and ``--mechanism-runs CSV`` (make demo passes ``docs/demo/throughput_rounds.csv`` and
``docs/demo/ablation_normaliser_runs.csv``) finish the summary's answer after the verdicts (:mod:`analysis.answer`):
what each strategy's throughput buys, and each planned contrast's gap split into the per-step reweighting and the rest.

Exit status 2 with one line naming the directory or run and the fix for: no runs, incompatible sweeps
mixed, missing metrics, an unreadable runs.csv, a W&B workspace that cannot be built or saved.
"""

from __future__ import annotations

import argparse
import sys
import traceback
from pathlib import Path

from harness.command_errors import OneLineParser, add_verbose, full_errors

from analysis.load import SweepError, load_sweeps


def parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog="batchlab-report",
        description="Report a batchlab strategy sweep: throughput against gradient diversity and convergence.")
    p.add_argument("sweep_dirs", nargs="*", metavar="SWEEP_DIR", help="directory of a batchlab-train -m sweep")
    p.add_argument("--out", metavar="DIR", help="where to write the report (default: FIRST_SWEEP_DIR/report)")
    p.add_argument("--markdown-summary", metavar="PATH",
                   help="also write the markdown summary (always OUT/summary.md) to PATH, e.g. to paste in a README")
    p.add_argument("--from-runs-csv", metavar="RUNS_CSV",
                   help="no sweep: re-render the markdown summary from a report's runs.csv (to --markdown-summary "
                        "PATH, else standard output)")
    p.add_argument("--target-loss", type=float, metavar="LOSS",
                   help="held-out loss for the 'tokens to target loss' column (default: the worst final one)")
    p.add_argument("--source", choices=("jsonl", "wandb"), default="jsonl",
                   help="read the histories from metrics.jsonl (default) or from the offline W&B files")
    p.add_argument("--title", default="batchlab: batching strategies compared", help="the report's title")
    p.add_argument("--wandb-workspace", metavar="ENTITY/PROJECT",
                   help="also save a W&B workspace (wandb-workspaces) whose panels mirror the figures")
    p.add_argument("--wandb-group", metavar="GROUP", help="W&B group of the workspace (default: the runs' group)")
    p.add_argument("--preregistration", metavar="YAML",
                   help="the planned contrasts declared before the runs (e.g. conf/preregistration/strategies.yaml):"
                        " a verdict for each, Holm over them only")
    p.add_argument("--throughput-rounds", metavar="CSV",
                   help="the interleaved throughput benchmark's rounds (docs/demo/throughput_rounds.csv, written by "
                        "benchmarks/train_throughput.py --experiment strategies --write): the summary says, after the "
                        "verdicts, what each strategy's throughput buys, with its interval over rounds")
    p.add_argument("--mechanism-runs", metavar="CSV",
                   help="the normaliser ablation's runs.csv (docs/demo/ablation_normaliser_runs.csv, make "
                        "ablation-normaliser): the summary splits each planned contrast's gap into the per-step "
                        "reweighting and the rest (needs --preregistration)")
    p.add_argument("--agreement-with", metavar="RUNS_CSV",
                   help="another design's runs.csv (e.g. docs/demo/runs.csv, the embedded default's main job): the "
                        "summary says, contrast by contrast, where this sweep's planned verdicts agree with its "
                        "(needs --preregistration and --agreement-preregistration)")
    p.add_argument("--agreement-preregistration", metavar="YAML",
                   help="that design's planned analysis (e.g. conf/preregistration/strategies.yaml)")
    p.add_argument("--agreement-name", default="the embedded default's main job",
                   help="what to call that design in the summary")
    add_verbose(p)
    return p


def read_reference(args, plan) -> tuple[list, str, str] | None:
    """``--agreement-with``'s planned results, name and file (None without it); a ValueError names the fix."""
    if not args.agreement_with:
        return None
    if plan is None or not args.agreement_preregistration:
        raise ValueError("--agreement-with compares planned verdicts: give --preregistration and "
                         "--agreement-preregistration too")
    from analysis.planned import load_preregistration, planned_results
    from analysis.summary import read_runs_csv

    try:
        runs, reference_plan = read_runs_csv(args.agreement_with), load_preregistration(args.agreement_preregistration)
    except OSError as error:
        raise ValueError(f"cannot read {error.filename} ({error.strerror})") from error
    return planned_results(runs, reference_plan), args.agreement_name, args.agreement_with


def read_answer(args, plan) -> tuple[list[str], dict | None]:
    """The summary's lines after the verdicts (:mod:`analysis.answer`) from ``--throughput-rounds`` and
    ``--mechanism-runs``, and the rounds' ratios (the frontier's y-axis; None without rounds); a ValueError names the
    file and the fix."""
    from analysis.answer import answer_lines, ratio_table, read_throughput_rounds
    from analysis.load import order_strategies
    from analysis.summary import read_runs_csv

    if args.mechanism_runs and plan is None:
        raise ValueError("--mechanism-runs splits the planned contrasts' gaps: give --preregistration too")
    throughput = mechanism = None
    try:
        if args.throughput_rounds:
            throughput = (read_throughput_rounds(args.throughput_rounds), args.throughput_rounds)
        if args.mechanism_runs:
            mechanism = (read_runs_csv(args.mechanism_runs), args.mechanism_runs)
    except OSError as error:
        raise ValueError(f"cannot read {error.filename} ({error.strerror})") from error
    strategies = order_strategies(list(throughput[0]["strategy"].unique())) if throughput is not None else []
    lines = answer_lines(list(plan.contrasts) if plan is not None else [], plan.endpoint if plan is not None else "",
                         strategies, throughput, mechanism)
    return lines, (ratio_table(throughput[0]) if throughput is not None else None)


def fail(message: str) -> int:
    print(f"batchlab-report: error: {message}", file=sys.stderr)
    return 2


def summary_from_runs_csv(runs_csv: str, out: str | None, plan=None, plan_source: str = "",
                         answer: list[str] | None = None, reference=None) -> int:
    from analysis.summary import read_runs_csv, summary_markdown

    try:
        runs = read_runs_csv(runs_csv)
        text = summary_markdown(runs, answer=answer or ())
    except (OSError, ValueError, KeyError) as error:
        return fail(f"cannot render a summary from {runs_csv} ({type(error).__name__}: {error}); give the runs.csv "
                    "that batchlab-report wrote")
    if plan is not None:
        from analysis.agreement import with_agreement
        from analysis.planned import planned_markdown, planned_results

        try:  # the summary opens with the verdicts; the declared plan follows it
            planned = planned_results(runs, plan)
            text = summary_markdown(runs, plan, plan_source, with_agreement(answer or (), planned, reference)) + (
                "\n" + planned_markdown(planned, plan, plan_source))
        except ValueError as error:
            return fail(f"{plan_source}: {error}")
    if out is None:
        sys.stdout.write(text)
    else:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(text)
        print(f"batchlab-report: wrote {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    plan = None
    if args.preregistration:
        from analysis.planned import load_preregistration

        try:
            plan = load_preregistration(args.preregistration)
        except (OSError, ValueError) as error:
            return fail(f"--preregistration: {error}")
    try:
        answer, ratios = read_answer(args, plan)
        reference = read_reference(args, plan)
    except (ValueError, KeyError) as error:
        return fail(str(error))
    if args.from_runs_csv:
        if args.sweep_dirs:
            return fail("give either SWEEP_DIR(s) or --from-runs-csv, not both")
        return summary_from_runs_csv(args.from_runs_csv, args.markdown_summary, plan, args.preregistration or "",
                                     answer, reference)
    if not args.sweep_dirs:
        return fail("no SWEEP_DIR given (or --from-runs-csv RUNS_CSV to re-render a summary)")
    workspace_path = None
    if args.wandb_workspace:  # check the flag before the (slower) report
        from analysis.workspace import WorkspaceUnavailable, _library, parse_workspace_path

        try:
            workspace_path = parse_workspace_path(args.wandb_workspace)
            _library()
        except (ValueError, WorkspaceUnavailable) as error:
            return fail(str(error))
    try:
        sweep = load_sweeps(args.sweep_dirs, source=args.source)
    except SweepError as error:
        if full_errors(args.verbose):
            traceback.print_exc()
        return fail(str(error))
    from analysis.report import build_report

    out = Path(args.out) if args.out else Path(args.sweep_dirs[0]) / "report"
    try:
        report = build_report(sweep, out, target_loss=args.target_loss, title=args.title, plan=plan,
                              plan_source=args.preregistration or "", answer=answer, throughput=ratios,
                              reference=reference)
    except ValueError as error:
        if plan is None:
            raise
        return fail(f"{args.preregistration}: {error}")
    if len(sweep.excluded):
        print(f"batchlab-report: {len(sweep.excluded)} run(s) left out (listed in the report): "
              + "; ".join(f"{r.run}: {r.reason}" for r in sweep.excluded.itertuples()))
    print(f"batchlab-report: {len(sweep.runs)} runs, {len(sweep.strategies)} strategies, {len(sweep.seeds)} seeds")
    for sentence in report.sentences[:3]:
        print(f"  {sentence}")
    if report.planned:
        print(f"batchlab-report: planned contrasts ({args.preregistration}):")
        for result in report.planned:
            print(f"  {result.sentence(plan.endpoint).replace('**', '')}")
    if args.markdown_summary:
        Path(args.markdown_summary).parent.mkdir(parents=True, exist_ok=True)
        Path(args.markdown_summary).write_text(report.summary.read_text())
        print(f"batchlab-report: wrote {args.markdown_summary}")
    print(f"batchlab-report: wrote {report.html}")
    if workspace_path is not None:
        from analysis.workspace import build_workspace, save_workspace

        groups = sorted(str(g) for g in sweep.runs["group"].dropna().unique()) if "group" in sweep.runs else []
        group = args.wandb_group or (groups[0] if len(groups) == 1 else None)
        try:
            workspace = build_workspace(*workspace_path, group=group, strategies=sweep.strategies)
            url = save_workspace(workspace)
        except Exception as error:  # noqa: BLE001 - the server's errors vary; the report is written already
            return fail(f"could not save the W&B workspace in {args.wandb_workspace} ({type(error).__name__}: "
                        f"{str(error).splitlines()[0] if str(error) else ''}); log in (wandb login / WANDB_API_KEY) "
                        "and check the entity and project; the report itself is written")
        print(f"batchlab-report: saved W&B workspace {url}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
