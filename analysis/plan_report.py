"""Turn the per-strategy plan metrics of one comparison into a table, a trade-off figure and a report.

Input is what ``batchlab-plan --json`` prints: a list with one metrics dict per strategy (at least
``strategy``, ``padding_efficiency``, ``lag1_acf``, ``recurrence``; ``acf`` is the list of step-level
autocorrelations at lags 1..K when present). Output, in one directory: ``plan_metrics.csv``,
``plan_tradeoff.png`` and ``plan_report.md``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; no display on servers or in CI
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

TABLE_COLUMNS = [
    "strategy",
    "padding_efficiency",
    "lag1_acf",
    "recurrence",
    "step_recurrence",
    "length_mix_excess",
    "rank_imbalance",
    "drafter_imbalance",
    "micro_batches",
    "steps",
    "plan_seconds",
]


def metrics_frame(metrics: Sequence[dict]) -> pd.DataFrame:
    """One row per strategy, the report's columns first (missing ones left out)."""
    if not metrics:
        raise ValueError("no plan metrics to report: the comparison produced no strategies")
    frame = pd.DataFrame(list(metrics))
    if "strategy" not in frame.columns:
        raise ValueError(f"plan metrics lack the 'strategy' field; fields present: {sorted(frame.columns)}")
    for column in ("padding_efficiency", "lag1_acf", "recurrence"):
        if column not in frame.columns:
            raise ValueError(f"plan metrics lack the {column!r} field; fields present: {sorted(frame.columns)}")
        frame[column] = pd.to_numeric(frame[column], errors="coerce")  # None (undefined) -> NaN
    first = [c for c in TABLE_COLUMNS if c in frame.columns]
    return frame[first + [c for c in frame.columns if c not in first]]


def plot_tradeoff(frame: pd.DataFrame, path: Path) -> Path:
    """Padding efficiency against the two diversity costs, and the step-level ACF by lag."""
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, row in enumerate(frame.itertuples(index=False)):
        color = colors[i % len(colors)]
        efficiency = 100 * row.padding_efficiency
        axes[0].scatter(efficiency, row.recurrence, s=80, color=color, label=row.strategy)
        label_offset = (6, 4) if i % 2 == 0 else (6, -12)  # alternate so neighbouring labels do not overlap
        axes[0].annotate(row.strategy, (efficiency, row.recurrence), textcoords="offset points", xytext=label_offset)
        axes[1].scatter(efficiency, abs(row.lag1_acf), s=80, color=color)
        axes[1].annotate(row.strategy, (efficiency, abs(row.lag1_acf)), textcoords="offset points", xytext=label_offset)
        acf = getattr(row, "acf", None)
        if isinstance(acf, (list, tuple)) and acf:
            axes[2].plot(range(1, len(acf) + 1), acf, marker="o", color=color, label=row.strategy)
    axes[0].set(xlabel="padding efficiency (%)", ylabel="composition recurrence (epoch e → e+1)",
                title="Throughput vs repeated batches")
    axes[1].set(xlabel="padding efficiency (%)", ylabel="|lag-1 ACF| of step mean length",
                title="Throughput vs length autocorrelation")
    axes[2].axhline(0.0, color="grey", linewidth=0.8)
    if "steps" in frame.columns and frame["steps"].min() > 0:
        # 95% band of the ACF of white noise over the shortest series: values inside it are noise.
        noise = 1.96 / math.sqrt(float(frame["steps"].min()))
        axes[1].axhspan(0.0, noise, color="grey", alpha=0.15, label="noise band (95%)")
        axes[1].legend(loc="upper right")
        axes[2].axhspan(-noise, noise, color="grey", alpha=0.15, label="noise band (95%)")
    axes[2].set(xlabel="lag (optimizer steps)", ylabel="ACF of step mean length", title="Autocorrelation by lag")
    axes[2].xaxis.set_major_locator(MaxNLocator(integer=True))
    if axes[2].get_legend_handles_labels()[0]:  # the zero line alone has no label
        axes[2].legend()
    axes[0].set_ylim(bottom=0)
    for ax in axes[:2]:
        ax.set_xlim(right=108)  # room for the labels of points near 100%
    axes[1].set_ylim(bottom=0)
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _markdown_table(frame: pd.DataFrame) -> str:
    columns = [c for c in TABLE_COLUMNS if c in frame.columns]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in frame[columns].itertuples(index=False):
        cells = []
        for name, value in zip(columns, row):
            if value is None or (isinstance(value, float) and math.isnan(value)):
                cells.append("-")  # undefined (e.g. recurrence of a single epoch), as in the CLI table
            elif name == "padding_efficiency":
                cells.append(f"{100 * value:.1f}%")
            elif isinstance(value, float):
                cells.append(f"{value:.3f}")
            else:
                cells.append(str(value))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_plan_report(metrics: Sequence[dict], out_dir: str | Path, title: str = "Plan comparison") -> dict[str, Path]:
    """Write ``plan_metrics.csv``, ``plan_tradeoff.png`` and ``plan_report.md`` into ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    frame = metrics_frame(metrics)
    paths = {
        "csv": out / "plan_metrics.csv",
        "figure": plot_tradeoff(frame, out / "plan_tradeoff.png"),
        "report": out / "plan_report.md",
    }
    frame.drop(columns=[c for c in frame.columns if frame[c].map(lambda v: isinstance(v, (list, dict))).any()]).to_csv(
        paths["csv"], index=False
    )
    paths["report"].write_text(
        f"# {title}\n\n{_markdown_table(frame)}\n\n![trade-off]({paths['figure'].name})\n\n"
        "Padding efficiency = real tokens / computed slots (a packed row counts at its full capacity). "
        "Recurrence = fraction of sample pairs that share a micro-batch in epoch e and again in e+1 "
        "(1 = batches never change); step recurrence = the same for optimizer steps, which is what reaches "
        "the optimizer when the loss is normalised over the global step. Length-mix excess = mean KL of a "
        "step's length histogram from the dataset's, minus the same for randomly filled steps of the same "
        "sizes (0 = steps as mixed as random ones). Rank imbalance = max / mean rank cost per step under the "
        "cost model (target and drafter); drafter imbalance = the same for drafter blocks alone.\n\n"
        "Lag-1 ACF is measured on the mean sample length of each optimizer step. It detects an order that "
        "walks through sorted lengths (Hugging Face's length-grouped order, `length_grouped` with "
        "`shuffle_order=False`); every other strategy shuffles its micro-batch order, so its ACF is ~0 by "
        "construction and says nothing about how length-homogeneous each step is (see length-mix excess) "
        "or whether batches repeat (see recurrence). Values inside the grey band are noise.\n"
    )
    return paths
