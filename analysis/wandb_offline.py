"""Read an offline W&B run back without a server: its config and its history.

W&B's own reader does the decoding: ``wandb leet inspect --json RUN`` prints every record of the
run's ``.wandb`` transaction log as one JSON object a line (the file format itself is internal to
W&B, which is why ``metrics.jsonl`` stays the source of truth for analysis).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass
class OfflineRun:
    path: Path  # the .wandb file
    config: dict[str, Any]
    history: list[dict[str, Any]]  # one dict of logged values per W&B step
    summary: dict[str, Any]


def offline_run_files(run_dir: str | Path) -> list[Path]:
    """The ``.wandb`` files under a run directory (``wandb/offline-run-*/run-*.wandb``), oldest first."""
    return sorted(Path(run_dir).glob("wandb/*run-*/run-*.wandb"))


def _wandb_command() -> list[str]:
    exe = Path(sys.executable).with_name("wandb")
    if exe.exists():
        return [str(exe)]
    found = shutil.which("wandb")
    if found is None:
        raise FileNotFoundError("the `wandb` command is not installed next to this Python; pip install wandb")
    return [found]


def _config_value(update: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in update.items() if k != "_wandb"}


def read_offline_run(path: str | Path, timeout_s: float = 120) -> OfflineRun:
    """Config, history and summary of one ``.wandb`` file (or of the newest one under a run directory)."""
    path = Path(path)
    if path.is_dir():
        files = offline_run_files(path)
        if not files:
            raise FileNotFoundError(f"no offline W&B run under {path} (expected wandb/offline-run-*/run-*.wandb)")
        path = files[-1]
    result = subprocess.run([*_wandb_command(), "leet", "inspect", "--json", str(path)], capture_output=True,
                            text=True, timeout=timeout_s, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"`wandb leet inspect --json {path}` failed ({result.returncode}): {result.stderr[-2000:]}")
    config: dict[str, Any] = {}
    history: list[dict[str, Any]] = []
    summary: dict[str, Any] = {}
    for line in result.stdout.splitlines():
        if not line.strip():
            continue
        record = json.loads(line)
        kind = record.get("type")
        if kind == "run":
            config.update(_config_value(record["run"].get("config", {}).get("update", {})))
        elif kind == "config":
            config.update(_config_value(record["config"].get("update", {})))
        elif kind == "history":
            history.append(record["history"]["item"])
        elif kind == "summary":
            summary.update(record["summary"].get("update", {}))
    return OfflineRun(path=path, config=config, history=history, summary=summary)
