"""What ``batchlab-report``'s options name, read and checked (:mod:`harness.cli.report` is the command).

Each reader raises a ValueError naming the option, the file and the fix; the command prints it on one line.
"""

from __future__ import annotations

from typing import Any


def read_preregistration(path: str | None) -> Any:
    """``--preregistration``'s planned analysis (:func:`analysis.planned.load_preregistration`), None without it."""
    if not path:
        return None
    from analysis.planned import load_preregistration

    return load_preregistration(path)


def read_reference(plan: Any, agreement_with: str | None, agreement_preregistration: str | None,
                   agreement_name: str) -> tuple[list, str, str] | None:
    """``--agreement-with``'s planned results, name and file (None without it); a ValueError names the fix."""
    if not agreement_with:
        return None
    if plan is None or not agreement_preregistration:
        raise ValueError("--agreement-with compares planned verdicts: give --preregistration and "
                         "--agreement-preregistration too")
    from analysis.planned import load_preregistration, planned_results
    from analysis.summary import read_runs_csv

    try:
        runs, reference_plan = read_runs_csv(agreement_with), load_preregistration(agreement_preregistration)
    except OSError as error:
        raise ValueError(f"cannot read {error.filename} ({error.strerror})") from error
    return planned_results(runs, reference_plan), agreement_name, agreement_with


def read_answer(plan: Any, throughput_rounds: str | None = None,
                mechanism_runs: str | None = None) -> tuple[list[str], dict | None]:
    """The summary's lines after the verdicts (:mod:`analysis.answer`) from ``--throughput-rounds`` and
    ``--mechanism-runs``, and the rounds' ratios (the frontier's y-axis; None without rounds); a ValueError names the
    file and the fix."""
    from analysis.answer import answer_lines, ratio_table, read_throughput_rounds
    from analysis.load import order_strategies
    from analysis.summary import read_runs_csv

    if mechanism_runs and plan is None:
        raise ValueError("--mechanism-runs splits the planned contrasts' gaps: give --preregistration too")
    throughput = mechanism = None
    try:
        if throughput_rounds:
            throughput = (read_throughput_rounds(throughput_rounds), throughput_rounds)
        if mechanism_runs:
            mechanism = (read_runs_csv(mechanism_runs), mechanism_runs)
    except OSError as error:
        raise ValueError(f"cannot read {error.filename} ({error.strerror})") from error
    strategies = order_strategies(list(throughput[0]["strategy"].unique())) if throughput is not None else []
    lines = answer_lines(list(plan.contrasts) if plan is not None else [], plan.endpoint if plan is not None else "",
                         strategies, throughput, mechanism)
    return lines, (ratio_table(throughput[0]) if throughput is not None else None)


def planned_summary(runs: Any, plan: Any, plan_source: str, answer: list[str], reference: Any = None) -> str:
    """The summary of ``runs`` opening with ``plan``'s verdicts, the declared plan after it (a ValueError names what
    the runs cannot answer)."""
    from analysis.agreement import with_agreement
    from analysis.planned import planned_markdown, planned_results
    from analysis.summary import summary_markdown

    planned = planned_results(runs, plan)
    return summary_markdown(runs, plan, plan_source, with_agreement(answer, planned, reference)) + (
        "\n" + planned_markdown(planned, plan, plan_source))


def workspace_path(text: str) -> tuple[str, str]:
    """``--wandb-workspace ENTITY/PROJECT`` checked before the (slower) report: the path, and the library there to
    save it (a ValueError or :class:`~analysis.workspace.WorkspaceUnavailable` says what is missing)."""
    from analysis.workspace import _library, parse_workspace_path

    path = parse_workspace_path(text)
    _library()
    return path


def save_sweep_workspace(sweep: Any, path: tuple[str, str], group: str | None) -> str:
    """Save the W&B workspace of ``sweep``'s strategies in ``path`` (entity, project); its URL. The group is
    ``group``, else the runs' one group (none when they have several)."""
    from analysis.workspace import build_workspace, save_workspace

    groups = sorted(str(g) for g in sweep.runs["group"].dropna().unique()) if "group" in sweep.runs else []
    group = group or (groups[0] if len(groups) == 1 else None)
    workspace = build_workspace(*path, group=group, strategies=sweep.strategies)
    return save_workspace(workspace)
