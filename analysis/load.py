"""Load sweep directories into tidy pandas frames: one row per run, one row per logged step.

A sweep directory is what ``batchlab-train -m ... hydra.sweep.dir=DIR`` writes: one sub-directory per
job (``strategy=packed,seed=1``), each holding ``config.json`` (the resolved config), ``metrics.jsonl``
(one record per optimizer step) and, once the run has finished, ``summary.json``. A single run
directory is accepted as well.

- :func:`load_sweeps` → :class:`Sweep` with ``runs`` (one row per *complete* run: the summary's keys
  plus the resolved config flattened to dotted names such as ``optim.lr`` or ``strategy.name``),
  ``steps`` (one row per optimizer step of those runs; list-valued metrics stay lists) and
  ``excluded`` (crashed, interrupted or unreadable runs with the reason: listed, never mixed in).
- ``source="wandb"`` reads config, summary and history from each run's offline W&B file instead
  (through :func:`analysis.wandb_offline.read_offline_run`); :func:`load_wandb_group` reads the same
  from a W&B server with ``wandb.Api()`` (entity/project/group).
- :func:`check_compatible` refuses runs of different sweeps mixed together (data fingerprint, budget
  ``max_tokens``, ``stop_tokens``) and :func:`check_metrics` runs that lack what the report needs.
  Both raise :class:`SweepError`, whose message names the directory or run and the fix.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from strategies import report_order

CONFIG_FILE = "config.json"
METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"

#: summary keys that must agree between the runs of one comparison
COMPATIBILITY_KEYS = {
    "data_fingerprint": "the data (corpus slice, tokenizer or held-out split)",
    "max_tokens": "the token budget of a micro-batch (trainer.max_tokens)",
    "stop_tokens": "the number of training tokens (trainer.stop_tokens)",
}

#: per-step metrics without which the report cannot be made, and what to do about it
REQUIRED_STEP_METRICS = {
    "step": "rerun with the current batchlab-train",
    "tokens_seen": "rerun with the current batchlab-train",
    "loss": "rerun with the current batchlab-train",
    "real_tokens": "rerun with the current batchlab-train",
    "computed_slots": "rerun with the current batchlab-train",
    "step_time": "rerun with the current batchlab-train",
    "step_mean_length": "rerun with the current batchlab-train",
    "eval_loss": "no held-out evaluation was logged: keep data.max_heldout > 0 and "
                 "eval.every_tokens below trainer.stop_tokens",
    "eval_tau": "no held-out evaluation was logged: keep data.max_heldout > 0 and "
                "eval.every_tokens below trainer.stop_tokens",
}
REQUIRED_SUMMARY_KEYS = ("strategy", "seed", "status", *COMPATIBILITY_KEYS)


class SweepError(ValueError):
    """The sweep cannot be reported as given; the message names the directory or run and the fix."""


@dataclass
class Sweep:
    """Tidy frames of one comparison (one or more sweep directories)."""

    runs: pd.DataFrame  # one row per complete run
    steps: pd.DataFrame  # one row per optimizer step of the complete runs
    excluded: pd.DataFrame  # run, path, status, reason: runs left out
    sources: list[str] = field(default_factory=list)  # the directories (or W&B paths) read

    @property
    def strategies(self) -> list[str]:
        return order_strategies(self.runs["strategy"].unique()) if len(self.runs) else []

    @property
    def seeds(self) -> list[int]:
        return sorted(int(s) for s in self.runs["seed"].unique()) if len(self.runs) else []

    def steps_of(self, strategy: str) -> pd.DataFrame:
        return self.steps[self.steps["strategy"] == strategy]

    def select(self, **where: Any) -> Sweep:
        """The runs whose columns equal the given values (``select(**{"optim.lr": 3e-4})``) and their steps."""
        keep = pd.Series(True, index=self.runs.index)
        for key, value in where.items():
            if key not in self.runs.columns:
                raise KeyError(f"no column {key!r} in the runs frame; columns: {sorted(self.runs.columns)}")
            keep &= self.runs[key] == value
        runs = self.runs[keep]
        return Sweep(runs=runs, steps=self.steps[self.steps["run"].isin(runs["run"])], excluded=self.excluded,
                     sources=self.sources)


def order_strategies(names: Iterable[str]) -> list[str]:
    """Report order: the registry's (``strategies.report_order()``), then unregistered names alphabetically.

    Variants (``bucketed (num_buckets=16)``) follow their base strategy.
    """
    names = list(dict.fromkeys(str(n) for n in names))
    order = report_order()

    def key(name: str) -> tuple[int, str, str]:
        base = name.split(" (")[0]
        rank = order.index(base) if base in order else len(order)
        return (rank, base if rank == len(order) else "", name)

    return sorted(names, key=key)


def _short(value: Any) -> Any:
    return int(value) if isinstance(value, float) and value.is_integer() else value


#: config keys that never make two runs different variants of a strategy
_NOT_VARIANT = ("plan_fingerprint.", "logger.", "hydra.")


#: the config keys a step mode sets (conf/step_mode/): runs differing only in them are labelled by the mode
STEP_MODE_KEYS = frozenset({"trainer.step_tokens", "trainer.grad_accum"})


def step_mode(run: pd.Series) -> str:
    """``"equal-token steps"`` (``trainer.step_tokens`` set: every step carries the same real tokens) or
    ``"fixed accumulation"`` (a fixed number of micro-batches per step), from a row of ``Sweep.runs``."""
    step_tokens = run.get("step_tokens", run.get("trainer.step_tokens"))
    equal = step_tokens is not None and not (isinstance(step_tokens, float) and math.isnan(step_tokens))
    return "equal-token steps" if equal else "fixed accumulation"


#: the loss normaliser's arms as the report names them (``optim.loss_normaliser``: step, epoch)
STEP_NORMALISER, EPOCH_NORMALISER = "step Σw", "epoch constant"


def loss_normaliser(run: pd.Series) -> str:
    """``"step Σw"`` (a step's loss divided by its Σw; runs from before the setting existed) or ``"epoch constant"``
    (``optim.loss_normaliser=epoch``), from a row of ``Sweep.runs``."""
    value = run.get("loss_normaliser", run.get("optim.loss_normaliser"))
    return EPOCH_NORMALISER if value == "epoch" else STEP_NORMALISER


def label_variants(runs: pd.DataFrame) -> pd.Series:
    """The strategy label of every run: the strategy's name, plus the config keys that tell its variants apart.

    A sweep over, say, ``strategy.num_buckets=16,32`` gives two runs of ``bucketed`` per seed; they are
    reported as ``bucketed (num_buckets=16)`` and ``bucketed (num_buckets=32)``.
    """
    labels = runs["strategy"].astype(str).copy()
    config = [c for c in runs.columns if "." in c and not c.startswith(_NOT_VARIANT)]
    for strategy, group in runs.groupby("strategy", sort=False):
        if not group.duplicated("seed").any():
            continue
        differing = [c for c in config if group[c].astype(str).nunique() > 1]
        if not differing:
            continue
        for index, row in group.iterrows():
            if set(differing) <= STEP_MODE_KEYS:  # experiment=ablation_steps: "packed (fixed accumulation)"
                labels[index] = f"{strategy} ({step_mode(row)})"
                continue
            parts = ", ".join(f"{c.rsplit('.', 1)[-1]}={_short(row[c])}" for c in differing)
            labels[index] = f"{strategy} ({parts})"
    return labels


# ---------------------------------------------------------------- values
def _number(value: Any) -> Any:
    """JSON null (what the trainer writes for NaN) back to NaN, also inside lists."""
    if value is None:
        return math.nan
    if isinstance(value, list):
        return [math.nan if v is None else v for v in value]
    return value


def flatten(mapping: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"optim": {"lr": 1}}`` → ``{"optim.lr": 1}``; lists stay values."""
    flat: dict[str, Any] = {}
    for key, value in mapping.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(flatten(value, name + "."))
        else:
            flat[name] = value
    return flat


def _read_json(path: Path) -> Any:
    return json.loads(path.read_text())


def read_metrics_file(path: Path) -> list[dict[str, Any]]:
    """The records of a ``metrics.jsonl``; a last line cut by a kill is skipped, a bad line elsewhere raises."""
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    records = []
    for i, line in enumerate(lines):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as error:
            if i == len(lines) - 1:
                break
            raise SweepError(f"{path}: line {i + 1} is not JSON ({error}); the file is damaged, rerun this run"
                             ) from None
    return records


# ---------------------------------------------------------------- discovery
def find_run_dirs(sweep_dir: str | Path) -> list[Path]:
    """Run directories under ``sweep_dir`` (any directory holding config.json, metrics.jsonl or summary.json)."""
    root = Path(sweep_dir)
    if not root.exists():
        raise SweepError(f"{root}: no such directory; pass the sweep directory (hydra.sweep.dir) of batchlab-train -m")
    if not root.is_dir():
        raise SweepError(f"{root}: not a directory; pass the sweep directory (hydra.sweep.dir) of batchlab-train -m")
    found: set[Path] = set()
    for name in (CONFIG_FILE, METRICS_FILE, SUMMARY_FILE):
        for path in root.rglob(name):
            parts = path.relative_to(root).parts
            if any(p.startswith(".") or p in ("wandb", "checkpoints") for p in parts[:-1]):
                continue
            found.add(path.parent)
    return sorted(found)


@dataclass
class RunData:
    """One run as read from its files (or from W&B)."""

    run: str  # a name unique within the comparison (the sub-directory, or the W&B run path)
    path: str
    config: dict[str, Any]
    summary: dict[str, Any] | None
    history: list[dict[str, Any]]
    problem: str | None = None  # why it is left out, when it is


def _run_name(root: Path, run_dir: Path, multiple_roots: bool) -> str:
    relative = run_dir.relative_to(root).as_posix()
    if relative == ".":
        relative = run_dir.name
    return f"{root.name}/{relative}" if multiple_roots else relative


def read_run_dir(run_dir: Path, name: str, source: str = "jsonl") -> RunData:
    """A run directory's config, summary and history; ``problem`` says why it cannot be used, if so."""
    if source == "wandb":
        return read_offline_wandb(run_dir, name)
    path = str(run_dir)
    config: dict[str, Any] = {}
    if (run_dir / CONFIG_FILE).exists():
        try:
            config = _read_json(run_dir / CONFIG_FILE)
        except json.JSONDecodeError as error:
            return RunData(name, path, {}, None, [], f"config.json is not JSON ({error})")
    summary_path = run_dir / SUMMARY_FILE
    if not summary_path.exists():
        return RunData(name, path, config, None, [], "no summary.json: the run crashed or is still running")
    try:
        summary = _read_json(summary_path)
    except json.JSONDecodeError as error:
        return RunData(name, path, config, None, [], f"summary.json is not JSON ({error})")
    metrics_path = run_dir / METRICS_FILE
    history = read_metrics_file(metrics_path) if metrics_path.exists() else []
    return _checked(RunData(name, path, config, summary, history), "summary.json", "metrics.jsonl")


def _checked(run: RunData, summary_name: str, history_name: str) -> RunData:
    status = (run.summary or {}).get("status")
    if status != "complete":
        run.problem = f"status {status!r} in {summary_name} (not complete)"
    elif not run.history:
        run.problem = f"{history_name} is missing or empty"
    return run


def read_offline_wandb(run_dir: Path, name: str) -> RunData:
    """Config, summary and history of a run from its offline W&B file alone (not metrics.jsonl)."""
    from analysis.wandb_offline import offline_run_files, read_offline_run

    if not offline_run_files(run_dir):
        if not (run_dir / SUMMARY_FILE).exists():
            return RunData(name, str(run_dir), {}, None, [], "no summary.json and no W&B run: it crashed early")
        raise SweepError(f"{run_dir}: no offline W&B run (wandb/offline-run-*/run-*.wandb): it was trained with "
                         "logger=none; read metrics.jsonl instead (leave out --source wandb)")
    offline = read_offline_run(run_dir)
    summary = {k: v for k, v in offline.summary.items() if not k.startswith("_") and "/" not in k and "." not in k}
    if "status" not in summary:
        return RunData(name, str(offline.path), offline.config, summary, [],
                       "the W&B run has no final summary: the run crashed or is still running")
    return _checked(RunData(name, str(run_dir), offline.config, summary, history_from_wandb(offline.history)),
                    "the W&B summary", "the W&B history")


def history_from_wandb(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """W&B history rows back into metrics.jsonl records.

    The W&B sink logs list metrics as ``key/0``, ``key/1``, ...; they are put back together as lists.
    Rows without ``step`` (tables logged on their own) and W&B's own ``_``-keys are dropped.
    """
    records = []
    for row in rows:
        # W&B's own keys (_step, _runtime, ...) and the fields of logged tables (plan_acf._type, ...) out
        row = {k: _unwrap(v) for k, v in row.items() if not k.startswith("_") and "." not in k}
        if "step" not in row or row["step"] is None:
            continue
        lists: dict[str, dict[int, Any]] = {}
        record: dict[str, Any] = {}
        for key, value in row.items():
            head, _, tail = key.rpartition("/")
            if head and tail.isdigit():
                lists.setdefault(head, {})[int(tail)] = value
            else:
                record[key] = value
        for key, items in lists.items():
            record[key] = [items.get(i, math.nan) for i in range(max(items) + 1)]
        for key in ("step", "epoch", "step_in_epoch", "tokens_seen", "samples_seen", "real_tokens", "computed_slots"):
            if isinstance(record.get(key), float) and record[key].is_integer():
                record[key] = int(record[key])
        records.append(record)
    return records


def _unwrap(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except (json.JSONDecodeError, ValueError):
            return value
    return value


# ---------------------------------------------------------------- frames
def _summary_value(summary: dict[str, Any], config: dict[str, Any], key: str) -> Any:
    if key in summary:
        return summary[key]
    flat = flatten(config)
    fallback = {"strategy": "strategy.name", "max_tokens": "trainer.max_tokens", "stop_tokens": "trainer.stop_tokens"}
    return flat.get(fallback.get(key, key))


def frames_from_runs(runs: Sequence[RunData], sources: Sequence[str]) -> Sweep:
    """Build the tidy frames from runs already read (files or W&B)."""
    rows, step_frames, excluded = [], [], []
    for run in runs:
        if run.problem is not None:
            summary = run.summary or {}
            flat = flatten(run.config)
            excluded.append({"run": run.run, "path": run.path, "status": summary.get("status", "missing"),
                             "strategy": summary.get("strategy", flat.get("strategy.name")),
                             "seed": summary.get("seed", flat.get("seed")), "reason": run.problem})
            continue
        summary = {k: _number(v) for k, v in flatten(run.summary or {}).items()}
        for key in ("strategy", "seed", "max_tokens", "stop_tokens"):
            if key not in summary:
                summary[key] = _summary_value(summary, run.config, key)
        config = {k: v for k, v in flatten(run.config).items() if k not in summary}
        rows.append({"run": run.run, "path": run.path, **summary, **config})
        history = pd.DataFrame.from_records([{k: _number(v) for k, v in r.items()} for r in run.history])
        history.insert(0, "run", run.run)
        history.insert(1, "strategy", summary["strategy"])
        history.insert(2, "seed", summary["seed"])
        step_frames.append(history)
    runs_frame = pd.DataFrame(rows)
    steps = (pd.concat(step_frames, ignore_index=True) if step_frames
             else pd.DataFrame(columns=["run", "strategy", "seed"]))
    if len(runs_frame):
        runs_frame["seed"] = runs_frame["seed"].astype(int)
        runs_frame["strategy_name"] = runs_frame["strategy"].astype(str)
        runs_frame["strategy"] = label_variants(runs_frame)
        steps["strategy"] = steps["run"].map(dict(zip(runs_frame["run"], runs_frame["strategy"])))
        order = {s: i for i, s in enumerate(order_strategies(runs_frame["strategy"]))}
        runs_frame = runs_frame.sort_values(["strategy", "seed"],
                                            key=lambda c: c.map(order) if c.name == "strategy" else c)
        runs_frame = runs_frame.reset_index(drop=True)
        steps["seed"] = steps["seed"].astype(int)
        steps = _derived_step_columns(steps)
    excluded_frame = pd.DataFrame(excluded, columns=["run", "path", "status", "strategy", "seed", "reason"])
    return Sweep(runs=runs_frame, steps=steps, excluded=excluded_frame, sources=list(sources))


def _derived_step_columns(steps: pd.DataFrame) -> pd.DataFrame:
    """``train_time_s``: cumulative step time per run (the x-axis "wall time" of the figures)."""
    steps = steps.sort_values(["run", "step"]).reset_index(drop=True)
    if "step_time" in steps.columns:
        steps["train_time_s"] = steps.groupby("run")["step_time"].cumsum()
    return steps


def load_sweeps(sweep_dirs: Sequence[str | Path], source: str = "jsonl", check: bool = True) -> Sweep:
    """Every run under the given sweep directories, as tidy frames (see the module docstring).

    Raises :class:`SweepError` for a directory with no runs, for no complete run at all and, with
    ``check``, for incompatible or incomplete runs (:func:`check_compatible`, :func:`check_metrics`).
    """
    if source not in ("jsonl", "wandb"):
        raise ValueError(f"source={source!r}: use 'jsonl' (metrics.jsonl) or 'wandb' (offline W&B files)")
    if not sweep_dirs:
        raise SweepError("no sweep directory given; pass the directory of a batchlab-train -m sweep")
    roots = [Path(d) for d in sweep_dirs]
    runs: list[RunData] = []
    for root in roots:
        found = find_run_dirs(root)
        if not found:
            raise SweepError(f"{root}: no runs in this directory (no config.json, metrics.jsonl or summary.json "
                             "below it); pass the hydra.sweep.dir of a batchlab-train -m sweep")
        for run_dir in found:
            runs.append(read_run_dir(run_dir, _run_name(root, run_dir, len(roots) > 1), source))
    sweep = frames_from_runs(runs, [str(r) for r in roots])
    if check:
        check_sweep(sweep)
    return sweep


def check_sweep(sweep: Sweep) -> None:
    if not len(sweep.runs):
        reasons = "; ".join(f"{r.run}: {r.reason}" for r in sweep.excluded.itertuples()) or "none found"
        raise SweepError(f"{', '.join(sweep.sources)}: no complete run to report ({reasons}); rerun the sweep "
                         "(batchlab-train -m ... resumes the runs that did not finish)")
    check_compatible(sweep.runs)
    check_metrics(sweep)
    check_unique(sweep.runs)


def check_compatible(runs: pd.DataFrame) -> None:
    """Refuse runs of different sweeps mixed together (different data, budget or token count)."""
    for key, what in COMPATIBILITY_KEYS.items():
        if key not in runs.columns:
            raise SweepError(f"run {runs['run'].iloc[0]} ({runs['path'].iloc[0]}): summary.json has no {key!r}; "
                             "rerun it with the current batchlab-train")
        values = runs[key].astype(str)
        if values.nunique() > 1:
            groups = []
            for value, group in runs.groupby(values, sort=False):
                shown = value if len(value) <= 16 else value[:12] + "…"
                groups.append(f"{key}={shown} in {group['path'].iloc[0]}"
                              + (f" and {len(group) - 1} more" if len(group) > 1 else ""))
            raise SweepError(f"runs of incompatible sweeps mixed: they differ in {what} ({'; '.join(groups)}); "
                             "compare runs of one sweep only (one batchlab-report call per sweep)")


def check_metrics(sweep: Sweep) -> None:
    """Every run has the summary keys and per-step metrics the report is built from."""
    for key in REQUIRED_SUMMARY_KEYS:
        missing = sweep.runs[sweep.runs[key].isna()] if key in sweep.runs.columns else sweep.runs
        if len(missing):
            row = missing.iloc[0]
            raise SweepError(f"run {row['run']} ({row['path']}): summary.json has no {key!r}; rerun it with the "
                             "current batchlab-train")
    for run, history in sweep.steps.groupby("run", sort=False):
        path = sweep.runs.loc[sweep.runs["run"] == run, "path"].iloc[0]
        for key, fix in REQUIRED_STEP_METRICS.items():
            if key not in history.columns or history[key].isna().all():
                raise SweepError(f"run {run} ({path}): metrics.jsonl has no {key!r} values; {fix}")


def check_unique(runs: pd.DataFrame) -> None:
    """One run per (strategy, seed): the comparison pairs strategies by seed (variants are told apart first)."""
    duplicated = runs[runs.duplicated(["strategy", "seed"], keep=False)]
    if len(duplicated):
        first = duplicated.iloc[0]
        same = duplicated[(duplicated["strategy"] == first["strategy"]) & (duplicated["seed"] == first["seed"])]
        raise SweepError(f"strategy={first['strategy']} seed={first['seed']} appears in {len(same)} runs "
                         f"({', '.join(same['path'])}); pass each (strategy, seed) once (one sweep, or sweeps of "
                         "different seeds)")


# ---------------------------------------------------------------- W&B online
def load_wandb_group(path: str, group: str | None = None, api: Any = None, check: bool = True) -> Sweep:
    """The runs of a W&B project (``ENTITY/PROJECT``), optionally one group, through ``wandb.Api()``.

    ``api`` is anything with ``runs(path, filters=...)`` returning objects with ``name``, ``id``,
    ``state``, ``config``, ``summary`` and ``scan_history()`` (a ``wandb.Api`` by default; tests pass
    a fake). A run is complete when its summary's ``status`` is ``"complete"``.
    """
    if api is None:
        import wandb

        api = wandb.Api()
    filters = {"group": group} if group else {}
    runs = []
    for run in api.runs(path, filters=filters):
        config = {k: v for k, v in dict(run.config).items() if not str(k).startswith("_")}
        summary = _plain_summary(run.summary)
        name = f"{path}/{getattr(run, 'id', run.name)}"
        label = getattr(run, "name", name)
        if summary.get("status") != "complete":
            state = getattr(run, "state", "unknown")
            problem = (f"W&B state {state!r}, summary status {summary.get('status')!r} (not complete)")
            runs.append(RunData(label, name, config, summary, [], problem))
            continue
        history = history_from_wandb(list(run.scan_history()))
        runs.append(RunData(label, name, config, summary, history, None if history else "no history on W&B"))
    sweep = frames_from_runs(runs, [f"{path}" + (f" group {group}" if group else "")])
    if check:
        if not runs:
            raise SweepError(f"W&B {path}" + (f" group {group!r}" if group else "") + ": no runs; check the entity, "
                             "project and group (logger.project / group of batchlab-train)")
        check_sweep(sweep)
    return sweep


def _plain_summary(summary: Any) -> dict[str, Any]:
    if hasattr(summary, "_json_dict"):
        summary = summary._json_dict
    return {k: v for k, v in dict(summary).items() if not str(k).startswith("_")}


def as_float_array(values: Iterable[Any]) -> np.ndarray:
    return np.array([_number(v) for v in values], dtype=float)
