"""A W&B workspace whose panels mirror the report's figures, runs grouped by strategy.

Built with the ``wandb-workspaces`` library (``pip install wandb-workspaces``). :func:`build_workspace`
only builds the object (no network); :func:`save_workspace` saves it to the server (needs a login).
The runs of a sweep share a W&B group and carry the strategy in their config (``strategy.name``), so
the workspace filters on the group and groups by that key, with the report's colours.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from analysis.figures import FIGURES, StrategyStyle

STRATEGY_KEY = "strategy.name"


class WorkspaceUnavailable(RuntimeError):
    """``wandb-workspaces`` is not installed."""


def _library():
    try:
        import wandb_workspaces.reports.v2 as wr
        import wandb_workspaces.workspaces as ws
    except ImportError as error:  # pragma: no cover - depends on the environment
        raise WorkspaceUnavailable(
            f"--wandb-workspace needs the wandb-workspaces package ({error}); pip install wandb-workspaces") from None
    return ws, wr


def parse_workspace_path(path: str) -> tuple[str, str]:
    parts = [p for p in path.split("/") if p]
    if len(parts) != 2:
        raise ValueError(f"--wandb-workspace {path!r}: expected ENTITY/PROJECT (e.g. my-team/batchlab)")
    return parts[0], parts[1]


def panel_spec() -> dict[str, list[dict[str, Any]]]:
    """Section name → panels (kind and fields), one section per figure of the report."""
    x = "tokens_seen"
    return {
        "frontier": [
            {"kind": "scatter", "title": "real tokens/s vs length-mix excess", "x": "plan_length_mix_excess",
             "y": "tokens_per_second"},
            {"kind": "scatter", "title": "real tokens/s vs recurrence (micro-batch)", "x": "plan_recurrence",
             "y": "tokens_per_second"},
        ],
        "heldout": [
            {"kind": "line", "title": "held-out loss vs tokens", "x": x, "y": ["eval_loss"]},
            {"kind": "line", "title": "held-out τ vs tokens", "x": x, "y": ["eval_tau"]},
            {"kind": "line", "title": "held-out loss vs wall time", "x": "RelativeTime(Wall)", "y": ["eval_loss"]},
            {"kind": "line", "title": "held-out τ vs wall time", "x": "RelativeTime(Wall)", "y": ["eval_tau"]},
        ],
        "throughput": [
            {"kind": "bar", "title": "padding ratio", "metrics": ["padding_ratio"]},
            {"kind": "bar", "title": "real tokens/s", "metrics": ["tokens_per_second"]},
            {"kind": "line", "title": "step-time split (s)", "x": x,
             "y": ["time_data", "time_target", "time_drafter", "time_optimizer_comm"]},
        ],
        "acf": [
            {"kind": "bar", "title": "lag-1 ACF of step mean length", "metrics": ["lag1_acf"]},
            {"kind": "line", "title": "plan ACF by lag (per epoch)", "x": x, "y": [f"plan_acf/{k}" for k in range(8)]},
        ],
        "streaks": [
            {"kind": "line", "title": "step mean length", "x": "step", "y": ["step_mean_length"]},
        ],
        "grad_stats": [
            {"kind": "line", "title": "sample diversity 1+B", "x": x, "y": ["grad_sample_diversity"]},
            {"kind": "line", "title": "gradient noise scale", "x": x, "y": ["grad_noise_scale"]},
        ],
        "train_loss": [
            {"kind": "line", "title": "training loss (per step and smoothed)", "x": x, "y": ["loss"], "smooth": True},
        ],
        "heldout_by_length": [
            {"kind": "line", "title": "held-out loss per length tercile (0 short, 1 mid, 2 long)", "x": x,
             "y": [f"eval_loss_by_length/{k}" for k in range(3)]},
            {"kind": "line", "title": "held-out τ per length tercile (0 short, 1 mid, 2 long)", "x": x,
             "y": [f"eval_tau_by_length/{k}" for k in range(3)]},
        ],
    }


def build_workspace(entity: str, project: str, group: str | None, strategies: Sequence[str],
                    name: str | None = None):
    """The workspace object (nothing is sent): one section per report figure, runs grouped by strategy."""
    ws, wr = _library()
    style = StrategyStyle(strategies)
    sections = []
    for key, panels in panel_spec().items():
        built = []
        for panel in panels:
            if panel["kind"] == "line":
                extra = {"smoothing_factor": 0.6, "smoothing_type": "exponential", "smoothing_show_original": True} \
                    if panel.get("smooth") else {}
                built.append(wr.LinePlot(title=panel["title"], x=panel["x"], y=list(panel["y"]), groupby_aggfunc="mean",
                                         groupby_rangefunc="stddev", **extra))
            elif panel["kind"] == "bar":
                built.append(wr.BarPlot(title=panel["title"], metrics=[wr.SummaryMetric(m) for m in panel["metrics"]],
                                        orientation="v", groupby_aggfunc="mean",
                                        groupby_rangefunc="stddev"))
            else:  # one point per run: the run's summary values
                built.append(wr.ScatterPlot(title=panel["title"], x=wr.SummaryMetric(panel["x"]),
                                            y=wr.SummaryMetric(panel["y"])))
        sections.append(ws.Section(name=FIGURES[key], panels=built, is_open=True))
    filters = [ws.Metric("Group") == group] if group else ""
    runset = ws.RunsetSettings(filters=filters, groupby=[ws.Config(STRATEGY_KEY)], group_colors=style.colours(),
                               pinned_columns=[f"config:{STRATEGY_KEY}", "config:seed", "summary:eval_loss",
                                               "summary:tokens_per_second"])
    title = name or f"batchlab strategies{f' ({group})' if group else ''}"
    return ws.Workspace(entity=entity, project=project, name=title, sections=sections, runset_settings=runset)


def save_workspace(workspace) -> str:
    """Save to the W&B server; returns its URL."""
    workspace.save()
    return str(getattr(workspace, "url", ""))
