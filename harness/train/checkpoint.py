"""Checkpoints: written atomically, found again on resume, refused when the plan would differ.

A checkpoint holds the drafter, optimizer, schedule and RNG states, the trainer's counters (tokens
seen, plan position, eval cadence, gradient-statistics EMAs, the current epoch's consumed-sample
counts) and a *fingerprint* of everything the batching plan depends on. Resuming with a different
fingerprint (another dataset, budget, strategy or option, or seed) would silently train on other
batches, so it is refused with the differences named. The world size and the accumulation
(:data:`LAYOUT_KEYS`) only lay the same samples out on ranks and micro-steps: the trainer may allow
them to change, and then plans the rest of the checkpoint's epoch for the new shape
(:func:`strategies.plan_remainder`).
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch

CHECKPOINT_DIR = "checkpoints"
_NAME = re.compile(r"^step-(\d{8})\.pt$")
#: fingerprint values that only lay an epoch's samples out on ranks and accumulation micro-steps (the
#: plan's step shape, world_size * grad_accum micro-batches); a resume may change them (elastic resume)
LAYOUT_KEYS = ("world_size", "grad_accum")


class FingerprintMismatch(RuntimeError):
    """The checkpoint was written for another plan."""


def lengths_hash(lengths: np.ndarray, indices: np.ndarray) -> str:
    """sha256 of the training samples' indices and lengths (what the plan sees)."""
    digest = hashlib.sha256()
    digest.update(np.ascontiguousarray(indices, dtype=np.int64).tobytes())
    digest.update(np.ascontiguousarray(lengths, dtype=np.int64).tobytes())
    return digest.hexdigest()


def plan_fingerprint(*, lengths_sha256: str, data_fingerprint: str, max_tokens: int, max_samples: int | None,
                     strategy: str, strategy_options: dict[str, Any], balance: Any, oversize: str,
                     world_size: int, grad_accum: int, seed: int, block_size: int, num_anchors: int,
                     max_blocks: int | None) -> dict[str, Any]:
    """The values a resumed run must share with the checkpoint (anchor settings included: they pick the blocks)."""
    return {
        "lengths_sha256": lengths_sha256, "data_fingerprint": data_fingerprint, "max_tokens": max_tokens,
        "max_samples": max_samples, "strategy": strategy, "strategy_options": dict(sorted(strategy_options.items())),
        "balance": balance, "oversize": oversize, "world_size": world_size, "grad_accum": grad_accum, "seed": seed,
        "block_size": block_size, "num_anchors": num_anchors, "max_blocks": max_blocks,
    }


def check_fingerprint(saved: dict[str, Any], current: dict[str, Any], path: Path,
                      allowed: Iterable[str] = ()) -> list[str]:
    """Raise :class:`FingerprintMismatch` naming every value that differs, those in ``allowed`` aside.

    Returns the keys of ``allowed`` whose values differ (for an elastic resume, ``allowed`` is
    :data:`LAYOUT_KEYS`); empty when the plans are the same.
    """
    allowed = tuple(allowed)
    keys = sorted(set(saved) | set(current))
    changed = [k for k in keys if saved.get(k) != current.get(k)]
    differences = [f"{k}: checkpoint {saved.get(k)!r}, now {current.get(k)!r}" for k in changed if k not in allowed]
    if differences:
        may_change = f" (only {', '.join(allowed)} may change on resume)" if allowed else ""
        raise FingerprintMismatch(
            f"checkpoint {path} was written for another batching plan, so resuming would not repeat the "
            f"uninterrupted run: {'; '.join(differences)}{may_change}. Resume with the checkpoint's settings, or "
            "start a fresh run in a new directory (or set trainer.resume=false)"
        )
    return [k for k in changed if k in allowed]


def checkpoint_paths(run_dir: Path) -> list[Path]:
    """This run's checkpoints, oldest first."""
    directory = Path(run_dir) / CHECKPOINT_DIR
    if not directory.is_dir():
        return []
    return sorted((p for p in directory.iterdir() if _NAME.match(p.name)), key=lambda p: p.name)


def latest_checkpoint(run_dir: Path) -> Path | None:
    paths = checkpoint_paths(run_dir)
    return paths[-1] if paths else None


def save_checkpoint(run_dir: Path, global_step: int, state: dict[str, Any], keep: int) -> Path:
    """Write ``state`` as ``checkpoints/step-NNNNNNNN.pt`` (temp file, fsync, rename); keep the newest ``keep``."""
    directory = Path(run_dir) / CHECKPOINT_DIR
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"step-{global_step:08d}.pt"
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("wb") as handle:
        torch.save(state, handle)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    for old in checkpoint_paths(run_dir)[:-keep]:
        old.unlink()
    return path


def load_checkpoint(path: Path) -> dict[str, Any]:
    # weights_only=False: the state holds numpy RNG states and plain Python containers we wrote ourselves
    return torch.load(path, map_location="cpu", weights_only=False)
