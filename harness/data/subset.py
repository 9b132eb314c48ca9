"""The rows a study can afford: every row of a source cut to ``data.max_length`` tokens, then a seeded subset of
``data.max_rows`` of them (``data.subset_seed``), built once and cached by the source's fingerprint and these options.

A row longer than ``max_length`` is cut at the end of its last supervised span (a conversation's last assistant turn,
a completion) that ends within it; a row whose first span does not end within it is cut at ``max_length`` inside that
span when some of it fits, and dropped when its prompt alone fills ``max_length`` (nothing left to learn). The subset
is drawn from the rows that remain, so a study gets exactly ``max_rows`` rows (all of them when fewer remain). Rows
keep their source order. Every cut and drop is counted in the samples' description, which every run prints.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np

from harness.data import cache
from harness.data.config import DataConfig

PREFIX = "rows"
FORMAT_VERSION = 1
DATASET_DIR = "dataset"
#: how a row fared, in the order the description names them
OUTCOMES = ("kept whole", "cut after a supervised span", "cut inside its first supervised span",
            "dropped: prompt fills max_length")


def supervised_spans(mask: np.ndarray) -> list[tuple[int, int]]:
    """``[start, end)`` of every run of supervised tokens: a completion, or each assistant turn of a conversation."""
    edges = np.diff(np.concatenate([[0], (np.asarray(mask) != 0).astype(np.int8), [0]]))
    return list(zip(np.flatnonzero(edges == 1).tolist(), np.flatnonzero(edges == -1).tolist()))


def cut_point(mask: np.ndarray, max_length: int) -> tuple[int, str]:
    """Where a row of loss mask ``mask`` ends once cut to ``max_length`` tokens (0: dropped), and which outcome."""
    if len(mask) <= max_length:
        return len(mask), OUTCOMES[0]
    # one token past the cut: a span that runs on past it ends at max_length + 1, so it does not end within it
    spans = supervised_spans(mask[: max_length + 1])
    ends = [end for _, end in spans if end <= max_length]
    if ends:
        return ends[-1], OUTCOMES[1]
    if spans and spans[0][0] < max_length:
        return max_length, OUTCOMES[2]
    return 0, OUTCOMES[3]


def rows_selected(lengths: np.ndarray, masks, max_rows: int | None, max_length: int | None,
                  seed: int) -> tuple[np.ndarray, np.ndarray, Counter]:
    """``(rows, cut lengths, outcomes)``: the source rows kept (sorted), each one's length after the cut, and how
    many rows fared each way (before the subset). ``masks(row)`` gives a row's loss mask."""
    ends = np.asarray(lengths, dtype=np.int64).copy()
    outcomes: Counter = Counter()
    if max_length is not None:
        for row in np.flatnonzero(ends > max_length):
            ends[row], outcome = cut_point(masks(int(row)), max_length)
            outcomes[outcome] += 1
        outcomes[OUTCOMES[0]] = int((np.asarray(lengths) <= max_length).sum())
    usable = np.flatnonzero(ends > 0)
    if max_rows is not None and len(usable) > max_rows:
        usable = np.sort(np.random.default_rng(seed).choice(usable, size=max_rows, replace=False))
    return usable, ends[usable], outcomes


def cut_subset(samples: Any, cfg: DataConfig) -> tuple[Any, str, str]:
    """``samples`` (a :class:`~harness.data.samples.TokenizedSamples` of a user source) cut and subset as ``cfg``
    says: ``(dataset, what was done in words, fingerprint)``, built once and cached."""
    import datasets

    options = {"max_rows": cfg.max_rows, "max_length": cfg.max_length, "subset_seed": cfg.subset_seed}
    key = cache.digest({"format": FORMAT_VERSION, "data": samples.fingerprint, **options})

    def build(tmp) -> dict:
        rows, ends, outcomes = rows_selected(samples.lengths, lambda r: samples.sample(r)[1], cfg.max_rows,
                                             cfg.max_length, cfg.subset_seed)
        picked = samples.samples(rows.tolist())
        columns = {"input_ids": [ids[:end].tolist() for (ids, _), end in zip(picked, ends)],
                   "loss_mask": [mask[:end].tolist() for (_, mask), end in zip(picked, ends)]}
        features = datasets.Features({"input_ids": datasets.Sequence(datasets.Value("int32")),
                                      "loss_mask": datasets.Sequence(datasets.Value("int8"))})
        with cache.quiet_datasets():
            datasets.Dataset.from_dict(columns, features=features).save_to_disk(str(tmp / DATASET_DIR))
        return {"rows": len(rows), "source_rows": len(samples), "outcomes": dict(outcomes), **options}

    entry, meta, _ = cache.ensure_entry(cfg.resolved_cache_dir(), PREFIX, key, build)
    return datasets.load_from_disk(str(entry / DATASET_DIR)), describe(meta), key


def describe(meta: dict) -> str:
    """The subset in words: how many rows of how many, and every cut and drop."""
    words = []
    if meta["max_length"] is not None:
        fared = [f"{meta['outcomes'][name]:,} {name}" for name in OUTCOMES if meta["outcomes"].get(name)]
        words.append(f"cut to data.max_length={meta['max_length']:,} tokens ({', '.join(fared)})")
    if meta["max_rows"] is not None:
        words.append(f"data.max_rows={meta['max_rows']:,} drawn with seed {meta['subset_seed']}")
    return f"{meta['rows']:,} of {meta['source_rows']:,} rows kept: " + "; ".join(words)
