"""The report's eight figures (matplotlib; PNG and SVG), one colour, marker and line style per strategy.

Colours are the Okabe–Ito palette (colour-blind safe); every strategy also has its own marker and
line style so that the figures stay readable printed in grey. The i-th strategy of the registry's
report order (``strategies.report_order()``) gets the i-th colour, marker and line style, in every
report; names the registry does not know (variants such as ``bucketed (num_buckets=16)``) take the
next ones. Stage times (figure 3) use grey shades
with hatching, so that colour always means a strategy.

1. :func:`frontier` — real tokens/s relative to ``sorted`` against the steps' length-mix excess (the diversity
   figure, exact from the plan) and against recurrence; one marker per strategy (mean), error bars = seed standard deviation, seeds
   as small points.
2. :func:`heldout` — held-out loss and τ against tokens seen and against training time, mean ± s.d.
   over seeds at each evaluation.
3. :func:`throughput` — padding % and real tokens/s per strategy, and the mean step-time split
   (data, target, drafter, optimizer + communication).
4. :func:`acf` — ACF of the step mean length against lag (plan of each epoch, mean over epochs and
   seeds), with the ±1.96/√n noise band of white noise (n = steps of an epoch).
5. :func:`streaks` — step mean length over the first steps of an epoch, one panel per strategy.
6. :func:`grad_stats` — gradient diversity and noise scale over training (measured steps).
7. :func:`train_loss` — training loss against tokens, every step as a point, with a running mean.
8. :func:`heldout_by_length` — held-out loss and τ of each length tercile of the held-out set against
   tokens seen (forgetting of one length range shows as its curve rising while the others fall).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.ticker import EngFormatter, MaxNLocator  # noqa: E402

from analysis.load import order_strategies  # noqa: E402
from strategies import report_order  # noqa: E402

# in report order: blue, orange, green, reddish purple, vermillion, sky blue, black (Okabe–Ito), then Tol's
COLOURS = ["#0072B2", "#E69F00", "#009E73", "#CC79A7", "#D55E00", "#56B4E9", "#000000", "#999933", "#882255",
           "#44AA99", "#117733"]
MARKERS = ["o", "v", "^", "D", "s", "P", "X", "*", "h", "<", ">"]
LINESTYLES = ["-", (0, (5, 1, 1, 1)), "-.", ":", "--", (0, (3, 1, 1, 1, 1, 1)), (0, (1, 1)), (0, (5, 2)), "-", "--",
              "-."]
STAGES = [("time_data", "data", "#f0f0f0", ""), ("time_target", "target forward", "#bdbdbd", "//"),
          ("time_drafter", "drafter fwd+bwd", "#737373", ".."),
          ("time_optimizer_comm", "optimizer + comm", "#252525", "")]

FIGURES = {
    "frontier": "Trade-off frontier: throughput relative to sorted against length-homogeneous steps and recurrence",
    "heldout": "Held-out loss and τ against tokens seen and training time (mean ± s.d. over seeds)",
    "throughput": "Padding, real tokens/s and the step-time split per strategy",
    "acf": "Autocorrelation of the step mean length by lag, with the 95% white-noise band",
    "streaks": "Step mean length over the first steps of an epoch",
    "grad_stats": "Gradient diversity and noise scale over training",
    "train_loss": "Training loss against tokens, every step, with a running mean",
    "heldout_by_length": "Held-out loss and τ per length tercile of the held-out set against tokens seen",
}

#: the least a τ axis spans (accepted length, between 1 and block size + 1), and where it may start
TAU_MIN_SPAN = 0.2
TAU_FLOOR = 0.98
#: an ACF whose white-noise band reaches this far (too few steps an epoch) is not drawn: nothing shows above it
ACF_MAX_BAND = 0.5

STYLE = {"font.size": 10, "axes.titlesize": 11, "axes.labelsize": 10, "legend.fontsize": 9, "axes.grid": True,
         "grid.alpha": 0.3, "grid.linewidth": 0.6, "figure.facecolor": "white", "axes.facecolor": "white",
         "savefig.facecolor": "white", "lines.linewidth": 1.8, "svg.fonttype": "path"}


class StrategyStyle:
    """Colour, marker and line style of every strategy, fixed for the whole report."""

    def __init__(self, strategies: Sequence[str]) -> None:
        self.strategies = order_strategies(strategies)
        registered = report_order()
        slots = registered + [s for s in self.strategies if s not in registered]
        self._colour = {s: COLOURS[i % len(COLOURS)] for i, s in enumerate(slots)}
        self._marker = {s: MARKERS[i % len(MARKERS)] for i, s in enumerate(slots)}
        self._line = {s: LINESTYLES[i % len(LINESTYLES)] for i, s in enumerate(slots)}

    def colour(self, strategy: str) -> str:
        return self._colour[strategy]

    def marker(self, strategy: str) -> str:
        return self._marker[strategy]

    def line(self, strategy: str):
        return self._line[strategy]

    def colours(self) -> dict[str, str]:
        return {s: self._colour[s] for s in self.strategies}


def save_figure(fig: Figure, out_dir: Path, name: str) -> list[Path]:
    """``name.png`` (150 dpi) and ``name.svg`` under ``out_dir``; closes the figure."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for ext, kwargs in (("png", {"dpi": 150}), ("svg", {})):
        path = out_dir / f"{name}.{ext}"
        fig.savefig(path, bbox_inches="tight", **kwargs)
        paths.append(path)
    plt.close(fig)
    return paths


def _note(ax, text: str) -> None:
    ax.text(0.5, 0.5, text, transform=ax.transAxes, ha="center", va="center", fontsize=9, color="#444444",
            bbox={"facecolor": "white", "edgecolor": "#bbbbbb"})


def _disturbed_banner(fig: Figure, disturbed: Sequence[str]) -> None:
    if disturbed:
        fig.suptitle(f"timings disturbed ({', '.join(disturbed)}): these throughputs are no measurement of record; "
                     "see benchmarks/train_throughput.py", color="#b00000", fontsize=9)


def _finite(values) -> np.ndarray:
    array = pd.to_numeric(pd.Series(values), errors="coerce").to_numpy(dtype=float)
    return array[np.isfinite(array)]


def _legend(fig: Figure, style: StrategyStyle, axes, ncol: int | None = None) -> None:
    handles = [plt.Line2D([], [], color=style.colour(s), marker=style.marker(s), linestyle=style.line(s), label=s)
               for s in style.strategies]
    fig.legend(handles=handles, loc="lower center", ncol=ncol or len(handles), frameon=False,
               bbox_to_anchor=(0.5, -0.02))
    fig.tight_layout(rect=(0, 0.07, 1, 1))


# ---------------------------------------------------------------- 1
def frontier(per_run: pd.DataFrame, style: StrategyStyle, disturbed: Sequence[str] = (),
             throughput: dict[str, tuple[float, float, float]] | None = None) -> Figure:
    """``disturbed``: strategies whose timings were disturbed (:func:`analysis.stats.timing_check`); the figure
    then says that its ratios are no measurement of record. ``throughput``: strategy → (mean, low, high) of the
    interleaved benchmark's tokens/s ratio to the reference (:func:`analysis.answer.ratio_table`); when given, the
    y-axis is that measurement (error bar: its 95 % interval over rounds) instead of the sweep's own timings."""
    reference = per_run.attrs.get("reference", "sorted")
    kind = per_run["recurrence_kind"].iloc[0] if "recurrence_kind" in per_run.columns and len(per_run) else "step"
    panels = [("length_mix_excess", "step length-mix excess over random steps (0: as mixed as random)"),
              ("recurrence", f"{kind}-level composition recurrence (epoch e → e+1)")]
    with plt.rc_context(STYLE):
        fig, axes = plt.subplots(1, 2, figsize=(11, 4.6))
        for ax, (column, label) in zip(axes, panels):
            drawn = False
            for strategy in style.strategies:
                runs = per_run[per_run["strategy"] == strategy]
                if column not in runs.columns:
                    continue
                if throughput is not None:
                    if strategy not in throughput and strategy != reference:
                        continue
                    mean, low, high = throughput.get(strategy, (1.0, 1.0, 1.0))
                    ok = runs[np.isfinite(runs[column])]
                    seeds_y = np.full(len(ok), mean)
                    y, yerr = mean, [[mean - low], [high - mean]]
                else:
                    ok = runs[np.isfinite(runs[column]) & np.isfinite(runs["relative_throughput"])]
                    seeds_y = ok["relative_throughput"].to_numpy()
                    y = ok["relative_throughput"].mean()
                    yerr = ok["relative_throughput"].std(ddof=1) if len(ok) > 1 else 0.0
                if ok.empty:
                    continue
                drawn = True
                colour, marker = style.colour(strategy), style.marker(strategy)
                ax.scatter(ok[column], seeds_y, s=18, color=colour, marker=marker, alpha=0.45, linewidths=0)
                x = ok[column].mean()
                xerr = ok[column].std(ddof=1) if len(ok) > 1 else 0.0
                ax.errorbar(x, y, xerr=xerr, yerr=yerr, color=colour, marker=marker, markersize=9, capsize=4,
                            markeredgecolor="black", markeredgewidth=0.6, linewidth=1.2)
                ax.annotate(strategy, (x, y), textcoords="offset points", xytext=(7, 6), fontsize=9)
            ax.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
            ylabel = (f"real tokens/s relative to {reference}\n(target online, interleaved rounds; 95% interval)"
                      if throughput is not None else f"real tokens/s relative to {reference}")
            ax.set(xlabel=label, ylabel=ylabel)
            if not drawn:
                _note(ax, f"no {column} was logged")
        axes[0].set_title("Throughput vs length-homogeneous steps")
        axes[1].set_title("Throughput vs repeated batch composition")
        if throughput is None:
            _disturbed_banner(fig, disturbed)
        _legend(fig, style, axes)
    return fig


# ---------------------------------------------------------------- 2
def eval_points(steps: pd.DataFrame) -> pd.DataFrame:
    """The evaluation rows of every run, numbered in order (``eval_index``)."""
    evals = steps[np.isfinite(pd.to_numeric(steps.get("eval_loss", pd.Series(dtype=float)), errors="coerce"))]
    evals = evals.sort_values(["run", "step"]).copy()
    evals["eval_index"] = evals.groupby("run").cumcount()
    return evals


def heldout(steps: pd.DataFrame, style: StrategyStyle) -> Figure:
    evals = eval_points(steps)
    with plt.rc_context(STYLE):
        fig, axes = plt.subplots(2, 2, figsize=(11, 7.5), sharey="row")
        metrics = (("eval_loss", "held-out loss"), ("eval_tau", "held-out τ (accepted length)"))
        for row, (metric, label) in enumerate(metrics):
            for col, (x, xlabel) in enumerate((("tokens_seen", "tokens seen"),
                                               ("train_time_s", "training time (s, summed step time)"))):
                ax = axes[row, col]
                for strategy in style.strategies:
                    group = evals[evals["strategy"] == strategy]
                    if group.empty or x not in group.columns:
                        continue
                    agg = group.groupby("eval_index").agg(x=(x, "mean"), y=(metric, "mean"), sd=(metric, "std"),
                                                         n=(metric, "count"))
                    agg = agg[agg["n"] == agg["n"].max()]  # evaluations every seed reached
                    sd = agg["sd"].fillna(0.0)
                    ax.plot(agg["x"], agg["y"], color=style.colour(strategy), marker=style.marker(strategy),
                            linestyle=style.line(strategy), markersize=5)
                    ax.fill_between(agg["x"], agg["y"] - sd, agg["y"] + sd, color=style.colour(strategy), alpha=0.15,
                                    linewidth=0)
                ax.set(xlabel=xlabel, ylabel=label)
        axes[0, 0].set_title("against tokens seen (equal-token comparison)")
        axes[0, 1].set_title("against training time")
        _legend(fig, style, axes)
    return fig


# ---------------------------------------------------------------- 3
def throughput(per_run: pd.DataFrame, steps: pd.DataFrame, style: StrategyStyle,
               disturbed: Sequence[str] = ()) -> Figure:
    names = style.strategies
    with plt.rc_context(STYLE):
        fig, axes = plt.subplots(1, 3, figsize=(14, 4.6), gridspec_kw={"width_ratios": [1, 1, 1.3]})
        for ax, (column, label) in zip(axes[:2], (("padding_pct", "padding (% of computed slots)"),
                                                 ("tokens_per_second", "real tokens/s"))):
            for i, strategy in enumerate(names):
                values = _finite(per_run.loc[per_run["strategy"] == strategy, column])
                if not values.size:
                    continue
                sd = values.std(ddof=1) if values.size > 1 else 0.0
                ax.bar(i, values.mean(), yerr=sd, color=style.colour(strategy), edgecolor="black", linewidth=0.6,
                       capsize=4, width=0.7)
                ax.scatter(np.full(values.size, i) + np.linspace(-0.15, 0.15, values.size), values, s=14,
                           color="black", zorder=3, marker=style.marker(strategy))
            ax.set_xticks(range(len(names)), names, rotation=30, ha="right", rotation_mode="anchor")
            ax.set_ylabel(label)
            ax.grid(axis="x", visible=False)
        axes[0].set_title("Padding")
        axes[1].set_title("Throughput (mean ± s.d. over seeds)")
        ax = axes[2]
        present = [s for s in STAGES if s[0] in steps.columns]
        if not present:
            _note(ax, "no step-time split was logged")
        left = np.zeros(len(names))
        for column, label, shade, hatch in present:
            means = np.array([float(np.nanmean(_finite(steps.loc[steps["strategy"] == s, column]))
                                    if _finite(steps.loc[steps["strategy"] == s, column]).size else 0.0) * 1000
                              for s in names])
            ax.barh(range(len(names)), means, left=left, color=shade, hatch=hatch, edgecolor="black", linewidth=0.6,
                    label=label)
            left += means
        ax.set_yticks(range(len(names)), names)
        for tick, strategy in zip(ax.get_yticklabels(), names):
            tick.set_color(style.colour(strategy))
            tick.set_fontweight("bold")
        ax.invert_yaxis()
        ax.set(xlabel="mean time per optimizer step (ms)", title="Where a step's time goes")
        ax.grid(axis="y", visible=False)
        if present:
            ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2, fontsize=8, frameon=False)
        _disturbed_banner(fig, disturbed)
        fig.tight_layout()
    return fig


# ---------------------------------------------------------------- 4
def autocorrelation(series: np.ndarray, lags: int) -> np.ndarray:
    """``r_k = Σ (x_t − x̄)(x_{t+k} − x̄) / Σ (x_t − x̄)²`` for k = 1..lags (NaN where undefined)."""
    x = np.asarray(series, dtype=float)
    out = np.full(lags, np.nan)
    if x.size < 2:
        return out
    d = x - x.mean()
    denom = float((d * d).sum())
    if denom == 0.0:
        return out
    for k in range(1, min(lags, x.size - 1) + 1):
        out[k - 1] = float((d[:-k] * d[k:]).sum()) / denom
    return out


def acf_by_run(steps: pd.DataFrame, lags: int = 8) -> tuple[pd.DataFrame, int]:
    """ACF per run and lag (mean over its epochs) and the shortest epoch (steps) behind it.

    From the plan ACF logged on each epoch's first step (``plan_acf``); from the logged step mean
    lengths of each epoch when no plan ACF was logged.
    """
    rows, lengths = [], []
    for run, history in steps.groupby("run", sort=False):
        strategy = history["strategy"].iloc[0]
        series: list[np.ndarray] = []
        if "plan_acf" in history.columns:
            for value, n in zip(history["plan_acf"], history.get("plan_steps", pd.Series(np.nan, index=history.index))):
                if isinstance(value, (list, tuple)) and value:
                    series.append(np.array([np.nan if v is None else v for v in value], dtype=float))
                    if np.isfinite(n):
                        lengths.append(int(n))
        if not series:
            for _, epoch in history.groupby("epoch"):
                series.append(autocorrelation(epoch["step_mean_length"].to_numpy(), lags))
                lengths.append(len(epoch))
        k = max(len(s) for s in series)
        stacked = np.full((len(series), k), np.nan)
        for i, s in enumerate(series):
            stacked[i, :len(s)] = s
        with np.errstate(all="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # lags undefined in every epoch stay NaN
            mean = np.nanmean(stacked, axis=0)
        for lag, value in enumerate(mean, start=1):
            rows.append({"run": run, "strategy": strategy, "lag": lag, "acf": float(value)})
    return pd.DataFrame(rows, columns=["run", "strategy", "lag", "acf"]), (min(lengths) if lengths else 0)


def acf(steps: pd.DataFrame, style: StrategyStyle) -> Figure:
    frame, n_steps = acf_by_run(steps)
    with plt.rc_context(STYLE):
        fig, ax = plt.subplots(figsize=(8, 4.6))
        band = 1.96 / math.sqrt(n_steps) if n_steps > 0 else math.inf
        if band < ACF_MAX_BAND:
            ax.axhspan(-band, band, color="grey", alpha=0.18, label=f"white-noise band ±1.96/√{n_steps}")
        elif n_steps > 0:  # white noise alone would fill the panel
            frame = frame.iloc[0:0]
            _note(ax, f"{n_steps} steps an epoch: white noise alone reaches ±{band:.2f},\n"
                      "too few steps to tell an autocorrelation from chance")
        ax.axhline(0.0, color="black", linewidth=0.8)
        offsets = np.linspace(-0.15, 0.15, max(len(style.strategies), 1))
        for offset, strategy in zip(offsets, style.strategies):
            group = frame[frame["strategy"] == strategy].groupby("lag")["acf"].agg(["mean", "std", "count"])
            group = group[np.isfinite(group["mean"])]
            if group.empty:
                continue
            ax.errorbar(group.index + offset, group["mean"], yerr=group["std"].fillna(0.0),
                        color=style.colour(strategy), marker=style.marker(strategy), linestyle=style.line(strategy),
                        capsize=3, label=strategy)
        if (frame.empty or not np.isfinite(frame["acf"]).any()) and band < ACF_MAX_BAND:
            _note(ax, "the ACF is undefined: too few steps per epoch")
        several = len(frame) and frame.groupby("strategy")["run"].nunique().min() > 1
        ax.set(xlabel="lag (optimizer steps)", ylabel="ACF of step mean length",
               title="Batch-length autocorrelation (mean over epochs"
                     + ("; bars: s.d. over seeds)" if several else "; one seed a strategy)"))
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="upper right", fontsize=8)
        fig.tight_layout()
    return fig


# ---------------------------------------------------------------- 5
def streaks(steps: pd.DataFrame, style: StrategyStyle, first_steps: int = 40) -> Figure:
    names = style.strategies
    cols = min(len(names), 3) or 1
    rows = math.ceil(len(names) / cols) or 1
    with plt.rc_context(STYLE):
        fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.2 * rows), sharey=True, squeeze=False)
        for ax in axes.flat[len(names):]:
            ax.set_visible(False)
        for ax, strategy in zip(axes.flat, names):
            group = steps[steps["strategy"] == strategy]
            epoch = int(group["epoch"].min()) if len(group) else 0
            for i, (seed, history) in enumerate(group.groupby("seed")):
                part = history[history["epoch"] == epoch].sort_values("step_in_epoch").head(first_steps)
                ax.plot(part["step_in_epoch"], part["step_mean_length"], color=style.colour(strategy),
                        linestyle=style.line(strategy), marker=style.marker(strategy), markersize=3,
                        alpha=1.0 if i == 0 else 0.45, linewidth=1.5 if i == 0 else 1.0, label=f"seed {seed}")
            if len(group) and "samples_per_step" in group.columns:
                mean_length = group["real_tokens"].sum() / max(group["samples_per_step"].sum(), 1)
                ax.axhline(mean_length, color="black", linewidth=0.8, linestyle="--")
            ax.set_title(f"{strategy} (epoch {epoch})", color=style.colour(strategy), fontweight="bold")
            ax.set_xlabel("step of the epoch")
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        for ax in axes[:, 0]:
            ax.set_ylabel("mean sample length of the step")
        fig.suptitle("How streaky each strategy is (dashed: mean sample length; bold: first seed)", fontsize=11)
        fig.tight_layout()
    return fig


# ---------------------------------------------------------------- 6
def _grid_mean(curves: list[tuple[np.ndarray, np.ndarray]], points: int = 60, band: str = "sd"):
    """Mean and band of curves interpolated onto a common grid; each curve counts only inside its own range.

    ``band="sd"``: mean ± sample standard deviation; ``band="range"``: min to max over the curves.
    Returns ``(grid, mean, low, high)`` (empty arrays when there is no curve).
    """
    curves = [(x, y) for x, y in curves if x.size]
    if not curves:
        return (np.array([]),) * 4
    lo = min(float(x.min()) for x, _ in curves)
    hi = max(float(x.max()) for x, _ in curves)
    grid = np.linspace(lo, hi, points) if hi > lo else np.array([lo])
    values = np.full((len(curves), grid.size), np.nan)
    for i, (x, y) in enumerate(curves):
        order = np.argsort(x)
        inside = (grid >= x.min()) & (grid <= x.max())
        values[i, inside] = np.interp(grid[inside], x[order], y[order])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        mean = np.nanmean(values, axis=0)
        if band == "range":
            low, high = np.nanmin(values, axis=0), np.nanmax(values, axis=0)
        else:
            sd = np.nan_to_num(np.nanstd(values, axis=0, ddof=1)) if len(curves) > 1 else np.zeros(grid.size)
            low, high = mean - sd, mean + sd
    return grid, mean, low, high


def grad_stats(steps: pd.DataFrame, style: StrategyStyle) -> Figure:
    with plt.rc_context(STYLE):
        fig, axes = plt.subplots(1, 2, figsize=(11, 4.4))
        measured = steps
        if "grad_stats_measured" in steps.columns:
            measured = steps[steps["grad_stats_measured"].fillna(False).astype(bool)]
        for ax, (column, label) in zip(axes, (("grad_sample_diversity", "sample diversity 1 + B of the step's samples"),
                                             ("grad_noise_scale", "gradient noise scale B_simple (loss weight)"))):
            drawn = False
            for strategy in style.strategies:
                curves = []
                for _, history in measured[measured["strategy"] == strategy].groupby("run"):
                    if column not in history.columns:
                        continue
                    values = pd.to_numeric(history[column], errors="coerce")
                    keep = np.isfinite(values) & ((values > 0) if column == "grad_noise_scale" else True)
                    ok = history[keep]
                    if ok.empty:
                        continue
                    x, y = ok["tokens_seen"].to_numpy(float), ok[column].to_numpy(float)
                    ax.plot(x, y, color=style.colour(strategy), linewidth=0.7, alpha=0.35,
                            marker=style.marker(strategy), markersize=2.5)
                    curves.append((x, y))
                grid, mean, low, high = _grid_mean(curves, band="range")
                if grid.size:
                    drawn = True
                    ax.plot(grid, mean, color=style.colour(strategy), linestyle=style.line(strategy), linewidth=2)
                    ax.fill_between(grid, low, high, color=style.colour(strategy), alpha=0.12, linewidth=0)
            ax.set(xlabel="tokens seen", ylabel=label)
            if column == "grad_noise_scale" and drawn:
                ax.set_yscale("log")  # the estimate spans decades; non-positive estimates (pure noise) are left out
            if not drawn:
                _note(ax, "not measured: gradient statistics\nneed grad_accum > 1 or more than one rank")
        several = "run" in measured and len(measured) and measured.groupby("strategy")["run"].nunique().min() > 1
        axes[0].set_title("Sample diversity 1 + B_simple from a step's micro-batches (assumes random splits:\n"
                          "length-homogeneous micro-batches inflate it, docs/design/metrics.md) "
                          + ("(thin: seeds; thick: mean; band: seed range)" if several else "(one seed a strategy)"),
                          fontsize=9)
        axes[1].set_title("Gradient noise scale (ratio of EMAs of unbiased estimates)")
        _legend(fig, style, axes)
    return fig


# ---------------------------------------------------------------- 7
def train_loss(steps: pd.DataFrame, style: StrategyStyle, window: int = 7) -> Figure:
    names = style.strategies
    cols = min(len(names) + 1, 3)
    rows = math.ceil((len(names) + 1) / cols)
    with plt.rc_context(STYLE):
        fig, axes = plt.subplots(rows, cols, figsize=(4.3 * cols, 3.3 * rows), sharex=True, sharey=True, squeeze=False)
        for ax in axes.flat[len(names) + 1:]:
            ax.set_visible(False)
        overlay = axes.flat[len(names)]
        for ax, strategy in zip(axes.flat, names):
            group = steps[steps["strategy"] == strategy]
            ax.scatter(group["tokens_seen"], group["loss"], s=7, color=style.colour(strategy),
                       marker=style.marker(strategy), alpha=0.5, linewidths=0)
            curves = []
            for _, history in group.groupby("run"):
                history = history.sort_values("step")
                smooth = history["loss"].rolling(window, min_periods=1, center=True).mean()
                curves.append((history["tokens_seen"].to_numpy(float), smooth.to_numpy(float)))
            grid, mean, _, _ = _grid_mean(curves)
            for target in (ax, overlay):
                if grid.size:
                    target.plot(grid, mean, color=style.colour(strategy), linestyle=style.line(strategy), linewidth=2,
                                label=strategy)
            ax.set_title(strategy, color=style.colour(strategy), fontweight="bold")
        overlay.set_title(f"running means ({window} steps), all strategies")
        overlay.legend(fontsize=8)
        for index, ax in enumerate(axes.flat[:len(names) + 1]):
            below = index + cols
            if below >= len(names) + 1:  # nothing visible below: this panel carries the x axis
                ax.set_xlabel("tokens seen")
                ax.tick_params(labelbottom=True)
        for ax in axes[:, 0]:
            ax.set_ylabel("training loss")
        fig.suptitle("Training loss per step (points: every step of every seed)", fontsize=11)
        fig.tight_layout()
    return fig


def _by_length(evals: pd.DataFrame, column: str, index: int) -> pd.Series:
    """Tercile ``index`` of a per-length-tercile list column (``metrics.jsonl``: a list; W&B: ``column/index``)."""
    if f"{column}/{index}" in evals.columns:
        return pd.to_numeric(evals[f"{column}/{index}"], errors="coerce")
    if column not in evals.columns:
        return pd.Series(np.nan, index=evals.index)
    return evals[column].map(lambda v: float(v[index]) if isinstance(v, (list, tuple)) and len(v) > index
                             and v[index] is not None else np.nan)


def heldout_by_length(steps: pd.DataFrame, style: StrategyStyle) -> Figure:
    evals = eval_points(steps)
    groups = ("short", "mid", "long")
    with plt.rc_context(STYLE):
        fig, axes = plt.subplots(2, 3, figsize=(13, 7.2), sharex=True, sharey="row")
        drawn = False
        for row, (column, label) in enumerate((("eval_loss_by_length", "held-out loss"),
                                                ("eval_tau_by_length", "held-out τ"))):
            for col, group_name in enumerate(groups):
                ax = axes[row, col]
                values = evals.assign(y=_by_length(evals, column, col))
                for strategy in style.strategies:
                    group = values[(values["strategy"] == strategy) & np.isfinite(values["y"])]
                    if group.empty:
                        continue
                    agg = group.groupby("eval_index").agg(x=("tokens_seen", "mean"), y=("y", "mean"), sd=("y", "std"),
                                                         n=("y", "count"))
                    agg = agg[agg["n"] == agg["n"].max()]
                    sd = agg["sd"].fillna(0.0)
                    ax.plot(agg["x"], agg["y"], color=style.colour(strategy), marker=style.marker(strategy),
                            linestyle=style.line(strategy), markersize=4)
                    ax.fill_between(agg["x"], agg["y"] - sd, agg["y"] + sd, color=style.colour(strategy), alpha=0.12,
                                    linewidth=0)
                    drawn = True
                if row == 0:
                    ax.set_title(f"{group_name} third of the held-out set (by length)")
                ax.set(xlabel="tokens seen" if row == 1 else "", ylabel=label if col == 0 else "")
        if not drawn:
            _note(axes[0, 0], "no per-length evaluation was logged\n(runs older than eval_loss_by_length)")
        _legend(fig, style, axes)
    return fig


def all_figures(per_run: pd.DataFrame, steps: pd.DataFrame, style: StrategyStyle,
                disturbed: Sequence[str] = (), throughput_ratios: dict[str, tuple[float, float, float]] | None = None
                ) -> dict[str, Figure]:
    """The eight figures; ``disturbed`` (strategies whose timings were disturbed) marks the two throughput ones;
    ``throughput_ratios`` (the interleaved benchmark's) is the frontier's y-axis when given."""
    figures = {
        "frontier": frontier(per_run, style, disturbed, throughput_ratios),
        "heldout": heldout(steps, style),
        "throughput": throughput(per_run, steps, style, disturbed),
        "acf": acf(steps, style),
        "streaks": streaks(steps, style),
        "grad_stats": grad_stats(steps, style),
        "train_loss": train_loss(steps, style),
        "heldout_by_length": heldout_by_length(steps, style),
    }
    for fig in figures.values():
        readable_axes(fig)
    return figures


def readable_axes(fig: Figure) -> None:
    """Token axes in engineering notation (``20k``, not ``20000``, which runs into its neighbours) and τ axes
    at least :data:`TAU_MIN_SPAN` tall, so that a 0.01 difference in τ does not fill the panel."""
    for ax in fig.axes:
        if "tokens" in ax.get_xlabel() and "tokens/s" not in ax.get_xlabel():
            ax.xaxis.set_major_formatter(EngFormatter(sep=""))
        if "τ" in ax.get_ylabel():
            low, high = ax.get_ylim()
            if high - low < TAU_MIN_SPAN:
                middle = (low + high) / 2
                low = max(middle - TAU_MIN_SPAN / 2, TAU_FLOOR)  # τ counts the target's own token: never below 1
                ax.set_ylim(low, low + TAU_MIN_SPAN)


def figure_captions(seeds: int) -> dict[str, str]:
    """:data:`FIGURES`, saying what is drawn with ``seeds`` seeds a strategy (no seed band with one)."""
    if seeds > 1:
        return dict(FIGURES)
    return {**FIGURES, "heldout": "Held-out loss and τ against tokens seen and training time (one seed: no band)"}
