"""Random generators of the planners, each derived from ``(seed, epoch, purpose)``.

Every random draw of a plan comes from its own generator,
``np.random.default_rng(np.random.SeedSequence([seed, epoch, purpose]))``, so that a plan is a pure
function of ``(seed, epoch)`` and changing one random step (say, the order of micro-batches) never
shifts the stream of another (the order of samples). Draws that must not change between epochs
(sorted's tie-breaking, which fixes its micro-batch composition) use ``epoch=STATIC_EPOCH`` with
their own purpose code, so they cannot collide with any per-epoch stream.
"""

from __future__ import annotations

from enum import IntEnum

import numpy as np

#: epoch slot used by draws that must be the same in every epoch
STATIC_EPOCH = 0


class Purpose(IntEnum):
    """Purpose codes: one independent stream per kind of random draw."""

    SAMPLE_ORDER = 1  # shuffle / packed: permutation of the samples
    SORTED_TIES = 2  # sorted: tie-breaking permutation (epoch-independent)
    MICRO_BATCH_ORDER = 3  # order of micro-batches in the epoch
    BUCKET_ORDER = 4  # bucketed: shuffle inside each bucket
    STEP_ORDER = 5  # bucketed same_bucket_steps with step_tokens: pool and order of equal-token steps
    BALANCE = 6  # rank balance: order of regrouped steps inside a window


def generator(seed: int, epoch: int, purpose: Purpose) -> np.random.Generator:
    """The generator for one purpose of one epoch (see the module docstring)."""
    return np.random.default_rng(np.random.SeedSequence([int(seed), int(epoch), int(purpose)]))
