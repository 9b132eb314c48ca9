"""Checkpoints: written atomically, found again on resume, refused when the plan or a state's version would differ.

:class:`CheckpointManager` saves and restores a run's *stateful components* — objects with a
``state_version``, ``state_dict()`` and ``load_state_dict()`` (:class:`Stateful`): the drafter, the
optimizer, the RNG states, the trainer's counters, the gradient statistics, the consumed-sample counts,
the epoch data's re-planned set — each under its own name with its version, so a component that changes
what it saves bumps its version and an old (or newer) checkpoint is refused naming it, never half-loaded.
Next to them it stores a *fingerprint* of everything the batching plan depends on. Resuming with a different
fingerprint (another dataset, budget, strategy or option, or seed) would silently train on other
batches, so it is refused with the differences named. The world size and the accumulation
(:data:`LAYOUT_KEYS`) only lay the same samples out on ranks and micro-steps: the trainer may allow
them to change, and then plans the rest of the checkpoint's epoch for the new shape
(:func:`strategies.plan_remainder`).

Each checkpoint's size and xxh3 checksum go into its sidecar ``step-N.pt.xxh3``, written after the file; a resume
takes the newest checkpoint that checks out, says which it passed over and why, and refuses when none does.
"""

from __future__ import annotations

import hashlib
import os
import random
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from harness.data.cache import DamagedEntry, checksum_path, checksum_problem, write_checksum

CHECKPOINT_DIR = "checkpoints"
_NAME = re.compile(r"^step-(\d{8})\.pt$")
#: fingerprint values that only lay an epoch's samples out on ranks and accumulation micro-steps (the
#: plan's step shape, world_size * grad_accum micro-batches); a resume may change them (elastic resume)
LAYOUT_KEYS = ("world_size", "grad_accum")


#: the layout of the checkpoint file itself (components by name, each with its version)
FORMAT_VERSION = 2


class FingerprintMismatch(RuntimeError):
    """The checkpoint was written for another plan."""


class CheckpointVersionError(RuntimeError):
    """The checkpoint was written by another batchlab version whose saved state this one cannot read."""


def lengths_hash(lengths: np.ndarray, indices: np.ndarray) -> str:
    """sha256 of the training samples' indices and lengths (what the plan sees)."""
    digest = hashlib.sha256()
    digest.update(np.ascontiguousarray(indices, dtype=np.int64).tobytes())
    digest.update(np.ascontiguousarray(lengths, dtype=np.int64).tobytes())
    return digest.hexdigest()


def plan_fingerprint(*, lengths_sha256: str, data_fingerprint: str, max_tokens: int, max_samples: int | None,
                     strategy: str, strategy_options: dict[str, Any], balance: Any, oversize: str,
                     world_size: int, grad_accum: int, seed: int, block_size: int, num_anchors: int,
                     max_blocks: int | None, step_tokens: int | None = None) -> dict[str, Any]:
    """The values a resumed run must share with the checkpoint (anchor settings included: they pick the blocks)."""
    return {
        "lengths_sha256": lengths_sha256, "data_fingerprint": data_fingerprint, "max_tokens": max_tokens,
        "max_samples": max_samples, "strategy": strategy, "strategy_options": dict(sorted(strategy_options.items())),
        "balance": balance, "oversize": oversize, "world_size": world_size, "grad_accum": grad_accum, "seed": seed,
        "block_size": block_size, "num_anchors": num_anchors, "max_blocks": max_blocks, "step_tokens": step_tokens,
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


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written (a full disk, a file size limit); the previous ones are intact."""


def save_checkpoint(run_dir: Path, global_step: int, state: dict[str, Any], keep: int) -> Path:
    """Write ``state`` as ``checkpoints/step-NNNNNNNN.pt`` (temp file, fsync, rename), then its checksum sidecar;
    keep the newest ``keep``. A write that fails part-way removes its temporary file and raises
    :class:`CheckpointWriteError`: the checkpoints written before stay as they were."""
    directory = Path(run_dir) / CHECKPOINT_DIR
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"step-{global_step:08d}.pt"
    tmp = path.with_name(path.name + ".tmp")
    try:
        with tmp.open("wb") as handle:
            torch.save(state, handle)
            handle.flush()
            os.fsync(handle.fileno())
        checksum_path(path).unlink(missing_ok=True)  # the old sidecar of a rewritten step would vouch for nothing
        os.replace(tmp, path)
        write_checksum(path)
    except (OSError, RuntimeError) as error:  # torch.save reports a failed write as RuntimeError
        tmp.unlink(missing_ok=True)
        if not _write_failure(error):
            raise
        earlier = [p.name for p in checkpoint_paths(run_dir) if p != path]
        raise CheckpointWriteError(
            f"could not write checkpoint {path} ({error}); "
            + (f"the earlier checkpoints ({', '.join(earlier)}) are untouched: free space or raise the file size "
               "limit, then run the same command to resume" if earlier else "no earlier checkpoint exists")) from error
    for old in checkpoint_paths(run_dir)[:-keep]:
        old.unlink()
        checksum_path(old).unlink(missing_ok=True)
    return path


def _write_failure(error: BaseException) -> bool:
    """Whether ``error`` (or what it was raised from or during: torch.save turns a failed write into a
    RuntimeError) is the file system refusing a write."""
    seen = error
    while seen is not None:
        if isinstance(seen, OSError) or "write" in str(seen).lower():
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _set_aside(paths: list[Path]) -> None:
    for damaged in paths:
        for file in (damaged, checksum_path(damaged)):
            if file.exists():
                os.replace(file, file.with_name(file.name + DAMAGED_SUFFIX))


def load_checkpoint(path: Path) -> dict[str, Any]:
    """The checkpoint at ``path`` once its checksum checks out (:class:`~harness.data.cache.DamagedEntry` if not)."""
    problem = checksum_problem(Path(path))
    if problem:
        raise DamagedEntry(f"checkpoint {problem}")
    # weights_only=False: the state holds numpy RNG states and plain Python containers we wrote ourselves
    return torch.load(path, map_location="cpu", weights_only=False)


#: what a damaged checkpoint passed over on resume is renamed to (never listed again, never pruned in place of a
#: good one; kept for a look)
DAMAGED_SUFFIX = ".damaged"


def newest_good_checkpoint(run_dir: Path, say: Any = print, set_aside: bool = False) -> Path | None:
    """The newest checkpoint whose checksum checks out (None when there is no checkpoint at all); each newer one
    passed over is said (``say``) and, with ``set_aside`` (one rank), renamed ``…pt.damaged``;
    :class:`~harness.data.cache.DamagedEntry` names every file when none is good. In a run directory where no
    checkpoint has its checksum (an older batchlab wrote them all), the newest is used unverified, said."""
    paths = checkpoint_paths(run_dir)
    if paths and not any(checksum_path(p).exists() for p in paths):
        say(f"batchlab-train: the checkpoints in {Path(run_dir) / CHECKPOINT_DIR} predate checksums (an older "
            f"batchlab wrote them): resuming from {paths[-1].name} unverified")
        return paths[-1]
    problems = []
    for path in reversed(paths):
        problem = checksum_problem(path)
        if problem is None:
            if problems:
                say(f"batchlab-train: passed over {len(problems)} damaged checkpoint(s) ({'; '.join(problems)}); "
                    f"resuming from {path.name}, the newest good one"
                    + (f" (the damaged ones renamed *{DAMAGED_SUFFIX})" if set_aside else ""))
                if set_aside:
                    _set_aside(paths[paths.index(path) + 1:])
            return path
        problems.append(problem)
    if problems:
        raise DamagedEntry(f"no checkpoint in {Path(run_dir) / CHECKPOINT_DIR} can be resumed: {'; '.join(problems)}. "
                           "Restore one from a good copy, or start a fresh run in a new directory (or set "
                           "trainer.resume=false)")
    return None


class Stateful(Protocol):
    """What :class:`CheckpointManager` saves: its own state, with the version of that state's layout."""

    state_version: int

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class TorchState:
    """A torch module or optimizer as a :class:`Stateful` (the layout of its state is torch's)."""

    state_version = 1

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def state_dict(self) -> dict[str, Any]:
        return self.obj.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.obj.load_state_dict(state)


class RngState:
    """This process's torch, numpy and Python random states (a resumed run draws what the uninterrupted one would)."""

    state_version = 1

    def state_dict(self) -> dict[str, Any]:
        return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        torch.set_rng_state(state["torch"])
        np.random.set_state(state["numpy"])
        random.setstate(state["python"])


class CheckpointManager:
    """Saves the named components when the trainer says so, keeps the newest ``keep`` files, restores the latest.

    Every rank calls :meth:`save` (a component's ``state_dict`` may be a collective); rank 0 writes. The plan
    ``fingerprint`` and the resolved ``config`` are stored beside the components, checked or read, not restored."""

    def __init__(self, run_dir: Path, components: dict[str, Stateful], *, fingerprint: dict[str, Any],
                 config: dict[str, Any], keep: int, is_main: bool, barrier: Any, status: Any) -> None:
        self.run_dir = Path(run_dir)
        self.components = components
        self.fingerprint = fingerprint
        self.config = config
        self.keep = keep
        self.is_main = is_main
        self.barrier = barrier
        self.status = status

    def save(self, global_step: int) -> None:
        self.status.stage("checkpoint", global_step)
        state = {"format": FORMAT_VERSION, "fingerprint": self.fingerprint, "config": self.config,
                 "components": {name: {"version": c.state_version, "state": c.state_dict()}
                                for name, c in self.components.items()}}
        if self.is_main:
            save_checkpoint(self.run_dir, global_step, state, self.keep)
        self.barrier()

    def _say(self, line: str) -> None:
        if self.is_main:
            print(line, flush=True)

    def restore(self) -> Restored | None:
        """Load the latest checkpoint into the components (None when there is none). Refused before any component loads: another plan (:class:`FingerprintMismatch`,
        world size and accumulation aside) or another state version (:class:`CheckpointVersionError`)."""
        path = newest_good_checkpoint(self.run_dir, say=self._say, set_aside=self.is_main)
        if path is None:
            return None
        saved = torch.load(path, map_location="cpu", weights_only=False)  # its checksum checked just now
        check_versions(saved, {name: c.state_version for name, c in self.components.items()}, path)
        # world size and accumulation may change (elastic resume): the rest of the epoch is re-planned
        layout_changed = check_fingerprint(saved["fingerprint"], self.fingerprint, path, allowed=LAYOUT_KEYS)
        for name, component in self.components.items():
            component.load_state_dict(saved["components"][name]["state"])
        return Restored(path, layout_changed, saved["fingerprint"])


@dataclass(frozen=True)
class Restored:
    """What :meth:`CheckpointManager.restore` loaded: the file, the layout keys that changed, its fingerprint."""

    path: Path
    layout_changed: list[str]
    fingerprint: dict[str, Any]


def component_state(saved: dict[str, Any], name: str) -> Any:
    """The state component ``name`` saved in a loaded checkpoint (e.g. ``progress``, ``drafter``, ``consumed``)."""
    return saved["components"][name]["state"]


def check_versions(saved: dict[str, Any], expected: dict[str, int], path: Path) -> None:
    """Raise :class:`CheckpointVersionError` unless ``saved`` holds every component at the version this code reads."""
    fix = ("resume it with the batchlab version that wrote it, or start a fresh run in a new directory (or set "
           "trainer.resume=false)")
    found = saved.get("format") if isinstance(saved, dict) else None
    if found != FORMAT_VERSION:
        age = "an older" if not isinstance(found, int) or found < FORMAT_VERSION else "a newer"
        raise CheckpointVersionError(
            f"checkpoint {path} has checkpoint format {found if found is not None else 1}, this batchlab reads "
            f"format {FORMAT_VERSION}: {age} batchlab wrote it; {fix}")
    components = saved.get("components", {})
    problems = []
    for name, version in expected.items():
        entry = components.get(name)
        if entry is None:
            problems.append(f"{name!r} is missing")
        elif entry.get("version") != version:
            age = "older" if entry.get("version", 0) < version else "newer"
            problems.append(f"{name!r} state is version {entry.get('version')} ({age}), this batchlab reads {version}")
    if problems:
        raise CheckpointVersionError(f"checkpoint {path} cannot be resumed by this batchlab: {'; '.join(problems)}; "
                                     f"{fix}")
