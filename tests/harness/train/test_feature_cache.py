"""Cached target features (harness/train/feature_cache.py): built once, read back in every layout, a run from the
cache trains as one with the target online; the cache resumes an interrupted build and is keyed by what it holds."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from support.train import compose_config, read_jsonl

from harness.train import feature_cache
from harness.train.feature_cache import FeatureStore, ensure_feature_cache
from harness.train.launch.compose import epoch_data_config, features_config, target_spec

#: fp32 on CPU: the features of a row alone against the same row beside others (rounding only)
FEATURE_ATOL = 1e-5


def _inputs(*overrides):
    from harness.data.samples import load_samples
    from harness.train.config import run_config_from_dict
    from harness.train.loop.epoch_data import select_rows
    from harness.train.rank_models import build_target

    config = run_config_from_dict(compose_config(["experiment=smoke", "trainer.nproc=1", "logger=none",
                                                  "trainer.progress=false", *overrides]))
    samples = load_samples(config.data, progress=False)
    rows = select_rows(epoch_data_config(config), samples).train_rows
    target = build_target(target_spec(config), config.drafter_config, torch.float32, torch.device("cpu"))
    return config, samples, rows, target


def test_the_cache_holds_each_rows_features_and_gives_them_back_in_every_layout(batchlab_cache):
    from harness.train.batch import BatchCollator

    config, samples, rows, target = _inputs()
    features = features_config(config)
    entry, meta, built = ensure_feature_cache(features, samples, rows, lambda: target)
    assert built and meta["rows"] == rows.size and meta["taps"] == list(target.tap_layer_ids)
    # the second time: read, and no target built for it
    assert ensure_feature_cache(features, samples, rows, lambda: pytest.fail("built a target"))[2] is False
    store = FeatureStore(entry, list(target.tap_layer_ids))
    for layout in ("padded", "packed"):
        collate = BatchCollator(samples, layout, anchor_seed=0, block_size=8, num_anchors=16, mask_token_id=512,
                                loss_decay_gamma=4.0, max_blocks=None)
        chosen = rows[[3, 0, 7, 1, 5]]
        batch = collate(chosen, np.minimum(samples.lengths[chosen], config.trainer.max_tokens), epoch=0)
        online = target(batch.tokens, tap_layer_ids=list(target.tap_layer_ids)).hidden_states
        cached = store.batch_features(batch, torch.device("cpu")).hidden_states
        real = batch.tokens.attention_mask.bool() if batch.tokens.cu_seqlens is None else None
        for want, got in zip(online, cached):
            if real is None:
                torch.testing.assert_close(got, want, atol=FEATURE_ATOL, rtol=0)
            else:
                torch.testing.assert_close(got[real], want[real], atol=FEATURE_ATOL, rtol=0)
                assert not got[~real].any()  # zeros at the pads (the drafter reads real positions only)
    heldout = int(np.setdiff1d(np.arange(len(samples)), rows)[0])
    with pytest.raises(KeyError, match=f"dataset row {heldout} .* is not in the feature cache"):
        store.row(heldout, 4)


def test_an_interrupted_build_goes_on_from_the_rows_it_had_written(batchlab_cache, monkeypatch):
    config, samples, rows, target = _inputs("data.max_documents=40")
    calls = []
    real_forward = type(target).forward

    def failing(self, batch, *args, **kwargs):
        calls.append(int(batch.input_ids.shape[0]))
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real_forward(self, batch, *args, **kwargs)

    monkeypatch.setattr(feature_cache, "ROWS_PER_SAVE", feature_cache.ROWS_PER_FORWARD)  # saved after each forward
    monkeypatch.setattr(type(target), "forward", failing)
    with pytest.raises(KeyboardInterrupt):
        ensure_feature_cache(features_config(config), samples, rows, lambda: target)
    key = feature_cache.cache_key(features_config(config), samples.fingerprint, rows)
    partial = config.data.resolved_cache_dir() / f".features-{key}.partial"
    assert json.loads((partial / "done.json").read_text())["rows"] == 2 * feature_cache.ROWS_PER_FORWARD
    monkeypatch.setattr(type(target), "forward", real_forward)
    forwards = []
    monkeypatch.setattr(type(target), "forward",
                        lambda self, batch, *a, **k: forwards.append(1) or real_forward(self, batch, *a, **k))
    entry, meta, built = ensure_feature_cache(features_config(config), samples, rows, lambda: target)
    expected = -(-rows.size // feature_cache.ROWS_PER_FORWARD) - 2  # the rest only
    assert built and len(forwards) == expected and not partial.exists()
    fresh, _, _ = _fresh_build(config, samples, rows, target, tmp=entry.parent / "fresh")
    np.testing.assert_array_equal(np.load(entry / "features.npy"), np.load(fresh / "features.npy"))


def _fresh_build(config, samples, rows, target, tmp, *overrides):
    import dataclasses

    from harness.train.config import run_config_from_dict

    other = run_config_from_dict({**compose_config(["experiment=smoke", "logger=none", "data.max_documents=40",
                                                    *overrides]),
                                  "data": {**dataclasses.asdict(config.data), "cache_dir": str(tmp)}})
    return ensure_feature_cache(features_config(other), samples, rows, lambda: target)


def test_a_run_from_the_cache_trains_as_one_with_the_target_online(tmp_path, batchlab_cache):
    from harness.train.launch.run import BadInput, prepared_config, run

    base = ["experiment=smoke", "trainer.nproc=1", "trainer.stop_tokens=8000", "logger=none", "trainer.progress=false",
            "strategy=packed", "eval.every_tokens=3000"]
    run(compose_config(base), tmp_path / "online")
    # the evaluated rows' features from a cache of their own too (eval.target_features=cached)
    run(compose_config([*base, "trainer.target_features=cached", "eval.target_features=cached"]), tmp_path / "cached")
    online, cached = (read_jsonl(tmp_path / name / "metrics.jsonl") for name in ("online", "cached"))
    assert len(online) == len(cached) >= 5
    for a, b in zip(online, cached):  # the same steps and samples; losses within the features' rounding
        assert (a["step"], a["tokens_seen"], a["samples_per_step"]) == (b["step"], b["tokens_seen"],
                                                                       b["samples_per_step"])
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4)
    evals = [(a, b) for a, b in zip(online, cached) if "eval_loss" in a]
    assert len(evals) >= 2 and all("eval_loss" in b for _, b in evals)
    for a, b in evals:  # the held-out loss and accuracy from the cached features: the same within rounding
        assert b["eval_loss"] == pytest.approx(a["eval_loss"], rel=1e-4)
        assert b["eval_accuracy"] == pytest.approx(a["eval_accuracy"], abs=1e-3)
    summary = json.loads((tmp_path / "cached" / "summary.json").read_text())
    assert summary["target_features"] == "cached"
    from harness.data.samples import load_samples
    from harness.train.config import run_config_from_dict
    from harness.train.feature_cache import PREFIX, cache_key
    from harness.train.loop.epoch_data import select_rows

    config = run_config_from_dict(compose_config([*base, "eval.target_features=cached"]))
    samples = load_samples(config.data, progress=False)
    heldout = select_rows(epoch_data_config(config), samples).heldout_rows
    assert heldout.size == summary["heldout_samples"]
    assert (batchlab_cache / f"{PREFIX}-{cache_key(features_config(config), samples.fingerprint, heldout)}").is_dir()
    with pytest.raises(BadInput, match="topology=disaggregated runs the target on ranks of its own"):
        prepared_config(compose_config([*base, "trainer.target_features=cached", "topology=disaggregated",
                                        "trainer.nproc=3"]))


def test_an_interrupted_build_resumes_from_its_last_chunk_that_checks_out(batchlab_cache, monkeypatch, capsys):
    """One byte flipped in the second saved chunk of an interrupted build: the rows from there are computed again,
    said in a line, and the entry equals a fresh build's."""
    other_key = "trainer.max_tokens=768"  # an entry of its own (the test above builds the 1,024-token one)
    config, samples, rows, target = _inputs("data.max_documents=40", other_key)
    real_forward = type(target).forward
    calls = []

    def failing(self, batch, *args, **kwargs):
        calls.append(1)
        if len(calls) == 4:
            raise KeyboardInterrupt
        return real_forward(self, batch, *args, **kwargs)

    monkeypatch.setattr(feature_cache, "ROWS_PER_SAVE", feature_cache.ROWS_PER_FORWARD)  # a chunk each forward
    monkeypatch.setattr(type(target), "forward", failing)
    key = feature_cache.cache_key(features_config(config), samples.fingerprint, rows)
    partial = config.data.resolved_cache_dir() / f".features-{key}.partial"
    with pytest.raises(KeyboardInterrupt):
        ensure_feature_cache(features_config(config), samples, rows, lambda: target)
    record = json.loads((partial / "done.json").read_text())
    assert record["rows"] == 3 * feature_cache.ROWS_PER_FORWARD and len(record["chunks"]) == 3
    features = np.load(partial / "features.npy", mmap_mode="r+")
    lengths = np.sort(np.minimum(samples.lengths[rows], config.trainer.max_tokens))
    second_chunk_token = int(lengths[:feature_cache.ROWS_PER_FORWARD].sum())  # the first token of chunk 2
    features[second_chunk_token, 0] += 1.0
    features.flush()
    del features
    forwards = []
    monkeypatch.setattr(type(target), "forward",
                        lambda self, batch, *a, **k: forwards.append(1) or real_forward(self, batch, *a, **k))
    entry, _, built = ensure_feature_cache(features_config(config), samples, rows, lambda: target)
    assert built and len(forwards) == -(-rows.size // feature_cache.ROWS_PER_FORWARD) - 1  # all but chunk 1
    assert f"damaged after row {feature_cache.ROWS_PER_FORWARD} of {rows.size}" in capsys.readouterr().out
    fresh, _, _ = _fresh_build(config, samples, rows, target, entry.parent / "fresh-chunks", other_key)
    np.testing.assert_array_equal(np.load(entry / "features.npy"), np.load(fresh / "features.npy"))
