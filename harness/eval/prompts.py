"""Held-out prompts for real acceptance: the prompt part of held-out documents."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from harness.data.samples import TokenizedSamples


def heldout_prompts(
    samples: TokenizedSamples, rows: Sequence[int] | np.ndarray, max_prompt_tokens: int, limit: int
) -> list[list[int]]:
    """The prompts of held-out documents, for speculative decoding.

    A document's prompt is its leading run of ``loss_mask == 0`` tokens (a document whose mask is all
    zero is all prompt). Documents with an empty prompt (``loss_mask[0] == 1``) are skipped; a longer
    prompt keeps its last ``max_prompt_tokens`` tokens (those next to the completion). The first
    ``limit`` prompts in the order of ``rows`` are returned: deterministic, and the same for every
    strategy and seed when ``rows`` is the held-out split (:func:`harness.data.samples.heldout_split`).
    """
    if isinstance(max_prompt_tokens, bool) or int(max_prompt_tokens) < 1:
        raise ValueError(f"max_prompt_tokens={max_prompt_tokens!r}: give at least 1 token")
    if isinstance(limit, bool) or int(limit) < 0:
        raise ValueError(f"limit={limit!r}: give a non-negative number of prompts")
    max_prompt_tokens, limit = int(max_prompt_tokens), int(limit)
    prompts: list[list[int]] = []
    rows = np.asarray(rows, dtype=np.int64).reshape(-1)
    chunk = 256  # read rows a chunk at a time: usually only the first few are needed
    for start in range(0, rows.size, chunk):
        if len(prompts) >= limit:
            break
        for ids, mask in samples.samples(rows[start : start + chunk]):
            supervised = np.flatnonzero(mask)
            cut = int(supervised[0]) if supervised.size else int(ids.size)
            if cut == 0:
                continue
            prompts.append([int(x) for x in ids[max(0, cut - max_prompt_tokens) : cut]])
            if len(prompts) >= limit:
                break
    return prompts
