"""Where a run's metrics go: ``metrics.jsonl`` and ``summary.json`` always, W&B when configured.

Only rank 0 builds a :class:`MetricLogger` with sinks (the others get one without any). The local
files are the source of truth for analysis; W&B is a view of the same records. A W&B failure warns
once and switches W&B off for the rest of the run: it never stops training.

Records are flat dicts of JSON values. Every record carries ``tokens_seen``, which W&B uses as the
x-axis of every metric (``define_metric``), so strategies with different step counts line up.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import warnings
from pathlib import Path
from typing import Any, Protocol

METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
WANDB_ID_FILE = "wandb_run_id"


def json_value(value: Any) -> Any:
    """``value`` with numpy/torch scalars as Python numbers and non-finite floats as None (strict JSON)."""
    if hasattr(value, "tolist"):
        value = value.tolist()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): json_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_value(v) for v in value]
    return value


def write_json_atomic(path: Path, payload: Any) -> None:
    """Write ``payload`` as JSON to a temporary file, then rename it onto ``path``: readers never see half a file.
    The temporary file is this process's own (under an external launcher every rank writes ``config.json``)."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(json_value(payload), indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


class MetricSink(Protocol):
    def log(self, record: dict[str, Any]) -> None: ...
    def log_table(self, name: str, columns: list[str], rows: list[list[Any]], tokens_seen: int) -> None: ...
    def summary(self, values: dict[str, Any]) -> None: ...
    def location(self) -> str: ...
    def close(self, failed: bool = False) -> None: ...


class JsonlSink:
    """``metrics.jsonl`` (one record a line, flushed) and ``summary.json`` (rewritten atomically)."""

    def __init__(self, run_dir: Path, resume_after_step: int | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / METRICS_FILE
        restart_step_file(self.path, resume_after_step)
        self._file = self.path.open("a")

    def location(self) -> str:
        return str(self.run_dir / SUMMARY_FILE)

    def log(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(json_value(record), sort_keys=True) + "\n")
        self._file.flush()

    def log_table(self, name: str, columns: list[str], rows: list[list[Any]], tokens_seen: int) -> None:
        """Tables go to W&B only: every line of metrics.jsonl is one step (tables' values are in the steps)."""

    def summary(self, values: dict[str, Any]) -> None:
        write_json_atomic(self.run_dir / SUMMARY_FILE, values)

    def close(self, failed: bool = False) -> None:  # noqa: ARG002 - every line is already flushed
        self._file.close()


def restart_step_file(path: Path, resume_after_step: int | None) -> None:
    """A run's file of step records (one JSON object a line, each with its ``step``) as its run starts: a resumed
    run keeps the records up to its checkpoint's step; a fresh run in a reused directory starts a fresh file."""
    if resume_after_step is not None:
        truncate_metrics(path, resume_after_step)
    elif path.exists():
        path.unlink()


def truncate_metrics(path: Path, last_step: int) -> None:
    """Keep the records of steps ``<= last_step`` (a resumed run rewrites what came after its checkpoint)."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # a line cut by a kill
            continue
        if record.get("step", -1) <= last_step:
            kept.append(line)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    os.replace(tmp, path)


class WandbSink:
    """One W&B run per job (rank 0): offline by default, ``WANDB_MODE`` wins over ``logger.mode``."""

    def __init__(self, run_dir: Path, *, project: str, entity: str | None, group: str, name: str,
                 job_type: str, tags: list[str], config: dict[str, Any], mode: str, run_id: str,
                 resume: bool) -> None:
        import wandb

        self._wandb = wandb
        self._failed = False
        mode = os.environ.get("WANDB_MODE", mode)  # wandb.init's mode argument would beat the env var
        self.run = wandb.init(
            dir=str(run_dir), project=project, entity=entity, group=group, name=name, job_type=job_type,
            tags=list(tags), config=config, mode=mode, id=run_id, resume="allow" if resume else None,
            settings=wandb.Settings(silent=True, console="off"),
        )
        self.run.define_metric("tokens_seen")
        self.run.define_metric("*", step_metric="tokens_seen")

    def _guard(self, what: str, call: Any) -> None:
        if self._failed:
            return
        try:
            call()
        except Exception as error:  # noqa: BLE001 - W&B must never stop a run
            self._failed = True
            warnings.warn(f"W&B {what} failed ({type(error).__name__}: {error}); W&B logging is off for the rest "
                          "of this run; metrics.jsonl and summary.json are unaffected", stacklevel=2)

    def log(self, record: dict[str, Any]) -> None:
        values = {k: v for k, v in json_value(record).items() if isinstance(v, (int, float)) and v is not None}
        for key, value in record.items():  # per-position and per-rank lists as separate series
            if isinstance(value, (list, tuple)) and value and all(isinstance(v, (int, float)) for v in value):
                values.update({f"{key}/{i}": v for i, v in enumerate(json_value(value)) if v is not None})
        self._guard("log", lambda: self.run.log(values))

    def log_table(self, name: str, columns: list[str], rows: list[list[Any]], tokens_seen: int) -> None:
        self._guard("table", lambda: self.run.log({name: self._wandb.Table(columns=columns, data=rows),
                                                   "tokens_seen": tokens_seen}))

    def summary(self, values: dict[str, Any]) -> None:
        def write() -> None:
            for key, value in json_value(values).items():
                if isinstance(value, (int, float, str, bool)):
                    self.run.summary[key] = value
        self._guard("summary", write)

    def location(self) -> str:
        """Where the run went: its URL, its offline directory (only where one was written), or that W&B is off."""
        if getattr(self.run, "disabled", False):
            return "W&B disabled (WANDB_MODE=disabled or logger.mode=disabled): nothing logged to W&B"
        url = None if getattr(self.run, "offline", False) else getattr(self.run, "url", None)  # .url warns offline
        if url:
            return f"W&B {url}"
        directory = Path(self.run.dir).parent
        return (f"W&B offline run in {directory} (wandb sync to upload)" if directory.is_dir()
                else "W&B offline, but no run directory was written")

    def close(self, failed: bool = False) -> None:
        """Finish the W&B run (marked failed, exit code 1, when the rank failed), also after a logging failure
        turned W&B off: an unfinished run would take the next ``wandb.init`` of this process (a sweep's next job)."""
        self._failed = False
        self._guard("finish", lambda: self.run.finish(exit_code=1 if failed else 0))


class MetricLogger:
    """Fans records out to every sink (none on ranks other than 0); :meth:`close` closes them once."""

    def __init__(self, sinks: list[MetricSink] | None = None) -> None:
        self.sinks = list(sinks or [])

    def log(self, record: dict[str, Any]) -> None:
        for sink in self.sinks:
            sink.log(record)

    def log_table(self, name: str, columns: list[str], rows: list[list[Any]], tokens_seen: int) -> None:
        for sink in self.sinks:
            sink.log_table(name, columns, rows, tokens_seen)

    def summary(self, values: dict[str, Any]) -> None:
        for sink in self.sinks:
            sink.summary(values)

    def locations(self) -> list[str]:
        """Where each sink keeps the run (a file, a W&B URL or offline directory)."""
        return [sink.location() for sink in self.sinks]

    def close(self, failed: bool = False) -> None:
        sinks, self.sinks = self.sinks, []
        for sink in sinks:
            sink.close(failed)


def build_logger(logger: Any, run_dir: Path, is_main: bool, resumed_step: int | None, config_dict: dict[str, Any],
                 *, group: str, name: str, job_type: str) -> MetricLogger:
    """Rank 0's logger (``logger``: the run's ``logger`` section): ``metrics.jsonl`` (truncated to ``resumed_step``
    on resume) and, when configured, W&B under ``group``, ``name`` and ``job_type`` (the same W&B run id for the
    same run directory, so a resumed run continues its W&B run); other ranks get a logger without sinks. W&B failing
    to start warns and leaves metrics.jsonl alone."""
    if not is_main:
        return MetricLogger()
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    sinks: list[MetricSink] = [JsonlSink(run_dir, resume_after_step=resumed_step)]
    if logger.wandb and logger.mode != "disabled":
        id_file = run_dir / WANDB_ID_FILE
        if not id_file.exists():
            id_file.write_text(secrets.token_hex(4))
        try:
            sinks.append(WandbSink(
                run_dir, project=logger.project, entity=logger.entity, group=group, name=name, job_type=job_type,
                tags=logger.tags, config=config_dict, mode=logger.mode, run_id=id_file.read_text().strip(),
                resume=resumed_step is not None))
        except Exception as error:  # noqa: BLE001 - W&B must never stop a run
            warnings.warn(f"W&B could not start ({type(error).__name__}: {error}); logging to metrics.jsonl only",
                          stacklevel=2)
    return MetricLogger(sinks)


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The records of ``metrics.jsonl`` (for tests, analysis and notebooks)."""
    path = Path(run_dir) / METRICS_FILE
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
