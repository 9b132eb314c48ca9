"""Bundled length profiles: synthetic length distributions regenerated from a fixed seed.

A profile stands in for a real dataset's lengths when none is at hand (demos, benchmarks, tests).
Profiles are generated on demand, never stored: the same name always gives the same lengths.

``chat-902k``: 902,000 lengths from a lognormal with median 600 and sigma 1.0, clipped to
[16, 8192] and rounded to integers — a stand-in for the reference run's SFT chat dataset.

Add a profile by registering a :class:`LengthProfile` in ``PROFILES``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

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


CHAT_902K_SEED = 902_000

PROFILES: dict[str, LengthProfile] = {
    "chat-902k": LengthProfile(
        name="chat-902k",
        description="902,000 lengths, lognormal(median 600, sigma 1.0) clipped to [16, 8192]",
        generate=lambda: lognormal_lengths(
            902_000, median=600.0, sigma=1.0, min_length=16, max_length=8192, seed=CHAT_902K_SEED
        ),
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
