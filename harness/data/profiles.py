"""Bundled length profiles: synthetic length distributions regenerated from a fixed seed.

A profile stands in for a real dataset's lengths when none is at hand (demos, benchmarks, tests).
Profiles are generated on demand, never stored: the same name always gives the same lengths.

``chat-902k``: 902,000 lengths from a lognormal with median 600 and sigma 1.0, clipped to
[16, 8192] and rounded to integers — a stand-in for the reference run's SFT chat dataset.

``stdlib-defs``: one length per top-level function or class definition (decorators included) of
the running interpreter's standard library (``sysconfig``'s ``stdlib`` directory, without
``site-packages`` and the ``test`` packages), approximated as ``ceil(characters / 4)`` tokens and
clipped to [1, 8192]: a small real corpus (about 6K samples, median about 100 tokens on CPython
3.11) on which fixed-size bucketing degenerates. It depends on the interpreter's version, and
reading it takes a few seconds (cached per process).

Add a profile by registering a :class:`LengthProfile` in ``PROFILES``.
"""

from __future__ import annotations

import ast
import functools
import math
import os
import sysconfig
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class LengthProfile:
    """A named, reproducible length distribution.

    Attributes:
        name: registry name (what ``--profile`` and ``profile:<name>`` take).
        description: one line shown in listings and error messages.
        generate: returns the profile's int64 lengths; must be deterministic.
    """

    name: str
    description: str
    generate: Callable[[], np.ndarray]


def lognormal_lengths(
    num_samples: int, median: float, sigma: float, min_length: int, max_length: int, seed: int
) -> np.ndarray:
    """Integer lengths drawn from ``lognormal(log(median), sigma)``, clipped and rounded.

    Args:
        num_samples: number of lengths.
        median: median of the lognormal before clipping.
        sigma: standard deviation of the underlying normal.
        min_length: lower clip (inclusive).
        max_length: upper clip (inclusive).
        seed: seed of ``numpy.random.default_rng``.

    Returns:
        int64 array of ``num_samples`` lengths in ``[min_length, max_length]``.
    """
    rng = np.random.default_rng(seed)
    draws = rng.lognormal(mean=math.log(median), sigma=sigma, size=num_samples)
    return np.rint(np.clip(draws, min_length, max_length)).astype(np.int64)


#: directories of the standard library that ``stdlib_definition_lengths`` skips
STDLIB_SKIPPED_DIRECTORIES = frozenset({"site-packages", "dist-packages", "__pycache__", "test", "tests"})
#: characters per token of the ``stdlib-defs`` approximation (no tokenizer needed)
CHARACTERS_PER_TOKEN = 4
STDLIB_MAX_LENGTH = 8192


@functools.lru_cache(maxsize=1)
def _stdlib_definition_lengths() -> tuple[int, ...]:
    root = Path(sysconfig.get_paths()["stdlib"])
    lengths: list[int] = []
    for directory, subdirectories, files in os.walk(root):
        subdirectories[:] = sorted(d for d in subdirectories if d not in STDLIB_SKIPPED_DIRECTORIES)
        for name in sorted(files):
            if not name.endswith(".py"):
                continue
            try:
                source = (Path(directory) / name).read_text(encoding="utf-8")
                tree = ast.parse(source)
            except (OSError, UnicodeDecodeError, SyntaxError, ValueError):
                continue  # unreadable or not Python 3 (a few files ship as test data)
            line_starts = [0]
            for line in source.splitlines(keepends=True):
                line_starts.append(line_starts[-1] + len(line))
            for node in tree.body:
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    first = node.decorator_list[0].lineno if node.decorator_list else node.lineno
                    characters = line_starts[node.end_lineno] - line_starts[first - 1]
                    lengths.append(-(-characters // CHARACTERS_PER_TOKEN))
    return tuple(lengths)


def stdlib_definition_lengths() -> np.ndarray:
    """Token-length estimates of the top-level definitions of this interpreter's standard library.

    Returns:
        int64 array, one entry per definition in path order, ``ceil(characters / 4)`` clipped to
        ``[1, 8192]`` (see the module docstring).
    """
    lengths = np.asarray(_stdlib_definition_lengths(), dtype=np.int64)
    return np.clip(lengths, 1, STDLIB_MAX_LENGTH)


CHAT_902K_SEED = 902_000

PROFILES: dict[str, LengthProfile] = {
    "chat-902k": LengthProfile(
        name="chat-902k",
        description="902,000 lengths, lognormal(median 600, sigma 1.0) clipped to [16, 8192]",
        generate=lambda: lognormal_lengths(
            902_000, median=600.0, sigma=1.0, min_length=16, max_length=8192, seed=CHAT_902K_SEED
        ),
    ),
    "stdlib-defs": LengthProfile(
        name="stdlib-defs",
        description="top-level definitions of this Python's standard library, characters / 4, cap 8192",
        generate=stdlib_definition_lengths,
    ),
}


def available_profiles() -> list[str]:
    """Names of the bundled profiles, sorted."""
    return sorted(PROFILES)


def profile_lengths(name: str) -> np.ndarray:
    """Lengths of the bundled profile ``name`` (a fresh int64 array on every call).

    Raises:
        ValueError: ``name`` is not a bundled profile; the message lists the ones that are.
    """
    if name not in PROFILES:
        listing = ", ".join(f"{p.name} ({p.description})" for p in PROFILES.values())
        raise ValueError(f"unknown length profile {name!r}; bundled profiles: {listing}")
    return PROFILES[name].generate()
