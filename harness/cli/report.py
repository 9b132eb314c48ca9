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
there (:mod:`analysis.planned`): a verdict per contrast, Holm over them only, and the design's power from the
pilot the preregistration names (``pilot_runs``), never the confirmatory runs'; written to ``planned.md`` and
``planned.csv``, opening ``report.md``, and printed (with ``--from-runs-csv``: printed after the summary).

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

from harness.cli.process_exit import exits_fast
from analysis import report_inputs
from analysis.load import SweepError, load_sweeps
from harness.command_errors import OneLineParser, add_verbose, full_errors


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
        try:  # the summary opens with the verdicts; the declared plan follows it
            text = report_inputs.planned_summary(runs, plan, plan_source, answer or (), reference)
        except ValueError as error:
            return fail(f"{plan_source}: {error}")
    if out is None:
        sys.stdout.write(text)
    else:
        _write(out, text)
    return 0


def _write(path: str, text: str) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(text)
    print(f"batchlab-report: wrote {path}")


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        plan = report_inputs.read_preregistration(args.preregistration)
    except (OSError, ValueError) as error:
        return fail(f"--preregistration: {error}")
    try:
        answer, ratios = report_inputs.read_answer(plan, args.throughput_rounds, args.mechanism_runs)
        reference = report_inputs.read_reference(plan, args.agreement_with, args.agreement_preregistration,
                                                 args.agreement_name)
    except (ValueError, KeyError) as error:
        return fail(str(error))
    if args.from_runs_csv:
        if args.sweep_dirs:
            return fail("give either SWEEP_DIR(s) or --from-runs-csv, not both")
        return summary_from_runs_csv(args.from_runs_csv, args.markdown_summary, plan, args.preregistration or "",
                                     answer, reference)
    if not args.sweep_dirs:
        return fail("no SWEEP_DIR given (or --from-runs-csv RUNS_CSV to re-render a summary)")
    return report_sweeps(args, plan, answer, ratios, reference)


def report_sweeps(args: argparse.Namespace, plan, answer: list[str], ratios, reference) -> int:
    """The report of ``args.sweep_dirs`` written and said, then the W&B workspace saved when asked for."""
    workspace_path = None
    if args.wandb_workspace:  # check the flag before the (slower) report
        from analysis.workspace import WorkspaceUnavailable

        try:
            workspace_path = report_inputs.workspace_path(args.wandb_workspace)
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
    print_report(args, plan, sweep, report)
    if workspace_path is not None:
        return save_workspace(args, sweep, workspace_path)
    return 0


def print_report(args: argparse.Namespace, plan, sweep, report) -> None:
    """What the report found, in a few lines, and where it is (and ``--markdown-summary``'s copy)."""
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
        _write(args.markdown_summary, report.summary.read_text())
    print(f"batchlab-report: wrote {report.html}")


def save_workspace(args: argparse.Namespace, sweep, workspace_path: tuple[str, str]) -> int:
    try:
        url = report_inputs.save_sweep_workspace(sweep, workspace_path, args.wandb_group)
    except Exception as error:  # noqa: BLE001 - the server's errors vary; the report is written already
        return fail(f"could not save the W&B workspace in {args.wandb_workspace} ({type(error).__name__}: "
                    f"{str(error).splitlines()[0] if str(error) else ''}); log in (wandb login / WANDB_API_KEY) "
                    "and check the entity and project; the report itself is written")
    print(f"batchlab-report: saved W&B workspace {url}")
    return 0


if __name__ == "__main__":
    exits_fast(main)()
