"""Pretraining the tiny target: held-out loss drops, the checkpoint is a real HF checkpoint, the cache holds.

A small slice of the embedded corpus (40 definitions, vocab 300) and a short run; one build is shared
by the module (``built``), under the session's temporary cache (``batchlab_cache``).
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from transformers import Qwen3_5ForCausalLM

from harness.data.config import DataConfig
from harness.data.samples import heldout_split, load_samples
from harness.models.compare import max_relative_difference
from harness.models.layout import TokenBatch
from harness.models.target import HybridTarget
from harness.cli import pretrain_target as cli
from harness.pretrain import target as pretrain
from harness.pretrain.target import PretrainConfig, ensure_pretrained_target, pretrained_target

TINY = Path(__file__).resolve().parents[3] / "conf" / "target" / "tiny.yaml"
DATA = DataConfig(max_documents=40, vocab_size=300)
SETTINGS = PretrainConfig(steps=150, max_tokens=512)
# what the CLI passes: tiny.yaml's keys, vocabulary from the data
TARGET = {k: v for k, v in yaml.safe_load(TINY.read_text()).items() if k != "vocab_size"}


@pytest.fixture(scope="module")
def built(batchlab_cache):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors (and a shared CPU): one thread, as every other test
    try:
        return pretrained_target(DATA, TARGET, SETTINGS, progress=False)
    finally:
        torch.set_num_threads(threads)


def test_pretraining_lowers_heldout_loss(built) -> None:
    held = built.meta["heldout"]
    assert built.built and held["labels"] > 50
    # untrained: about uniform over the vocabulary
    assert abs(held["untrained_loss"] - math.log(300)) < 0.5
    assert held["loss"] < held["untrained_loss"] - 1.5, held
    assert held["loss"] < held["unigram_loss"], held
    assert held["perplexity"] == pytest.approx(math.exp(held["loss"]))
    assert built.meta["training"]["steps"] == SETTINGS.steps


def test_checkpoint_loads_in_batchlab_and_transformers_with_equal_logits(built) -> None:
    path = built.path
    for name in ("config.json", "model.safetensors", "tokenizer.json", "meta.json"):
        assert (path / name).is_file(), name
    samples = load_samples(DATA, progress=False)
    assert (path / "tokenizer.json").read_bytes() == Path(samples.tokenizer_path).read_bytes()
    ours = HybridTarget.from_pretrained(path)
    theirs = Qwen3_5ForCausalLM.from_pretrained(path).eval()
    assert ours.config.vocab_size == samples.vocab_size == 300
    _, heldout = heldout_split(len(samples), DATA)
    docs = [torch.from_numpy(ids[:200]) for ids, _ in samples.samples(heldout)]
    with torch.no_grad():
        alone = [theirs(input_ids=doc[None]).logits[0] for doc in docs]
    for layout in ("padded", "packed"):
        logits = ours.logits(TokenBatch.from_documents(docs, layout))
        start = 0
        for row, (doc, reference) in enumerate(zip(docs, alone)):
            n = doc.numel()
            mine = logits[row, :n] if layout == "padded" else logits[0, start : start + n]
            start += n
            assert max_relative_difference(mine, reference) <= 1e-5, (layout, row)


def test_cache_is_reused_and_rebuilt_when_settings_change(built, monkeypatch) -> None:
    def no_training(*args, **kwargs):
        raise AssertionError("the cached checkpoint was retrained")

    with monkeypatch.context() as patch:
        patch.setattr(pretrain, "_train", no_training)
        assert ensure_pretrained_target(DATA, TARGET, SETTINGS, progress=False) == built.path
        again = pretrained_target(DATA, TARGET, SETTINGS, progress=False)
        assert not again.built and again.meta["key"] == built.meta["key"]
        assert again.meta["heldout"] == built.meta["heldout"]
        with pytest.raises(AssertionError, match="retrained"):
            ensure_pretrained_target(DATA, TARGET, dataclasses.replace(SETTINGS, lr=1e-3), progress=False)
    other = pretrained_target(DATA, TARGET, dataclasses.replace(SETTINGS, steps=3, lr=1e-3), progress=False)
    assert other.built and other.path != built.path and other.meta["settings"]["lr"] == 1e-3
    assert (built.path / "meta.json").is_file()  # the first entry stays valid
    with pytest.raises(ValueError, match="vocab_size=256 is smaller"):
        ensure_pretrained_target(DATA, {**TARGET, "vocab_size": 256}, SETTINGS, progress=False)


def test_heldout_rows_are_never_trained_on(batchlab_cache, monkeypatch) -> None:
    seen_rows: set[int] = set()
    windows_rows: set[int] = set()
    training_batch = pretrain._training_batch

    def spy(train, indices, layout):
        windows_rows.update(train.rows.tolist())
        seen_rows.update(train.rows[indices].tolist())
        return training_batch(train, indices, layout)

    monkeypatch.setattr(pretrain, "_training_batch", spy)
    # one whole epoch (seed 7: its own cache entry)
    samples = load_samples(DATA, progress=False)
    train_rows, heldout_rows = heldout_split(len(samples), DATA)
    settings = PretrainConfig(tokens=int(samples.lengths[train_rows].sum()), max_tokens=512, seed=7)
    result = pretrained_target(DATA, TARGET, settings, progress=False)
    assert result.built and heldout_rows.size >= 2
    trainable = {int(r) for r in train_rows if samples.lengths[r] >= 2}
    assert windows_rows == trainable
    assert seen_rows == trainable  # a full epoch saw every training row ...
    assert not seen_rows & set(heldout_rows.tolist())  # ... and no held-out row
    assert result.meta["train_rows"] == train_rows.size and result.meta["heldout_rows"] == heldout_rows.size


def test_cli_reports_the_cached_checkpoint(built, capsys, tmp_path) -> None:
    args = ["--max-documents", "40", "--vocab-size", "300", "--steps", str(SETTINGS.steps),
            "--max-tokens", str(SETTINGS.max_tokens), "--no-progress"]
    assert cli.main([*args, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["built"] is False and report["path"] == str(built.path)
    assert report["heldout"]["perplexity"] == built.meta["heldout"]["perplexity"]
    out = tmp_path / "copy"
    assert cli.main([*args, "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "(cached)" in text and str(out) in text and "held-out loss" in text and "perplexity" in text
    assert HybridTarget.from_pretrained(out).config.vocab_size == 300


def test_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="implementation"):
        PretrainConfig(implementation="jax")
    with pytest.raises(ValueError, match="steps"):
        PretrainConfig(steps=0)
    assert np.isfinite(PretrainConfig().lr)


def test_transformers_implementation_builds_a_loadable_checkpoint(batchlab_cache) -> None:
    result = pretrained_target(DATA, TARGET, PretrainConfig(steps=3, max_tokens=512, implementation="transformers"),
                               progress=False)
    assert result.built and result.meta["settings"]["implementation"] == "transformers"
    assert result.meta["heldout"]["loss"] < result.meta["heldout"]["untrained_loss"]
    assert HybridTarget.from_pretrained(result.path).config.vocab_size == 300


def test_hydra_containers_give_the_same_entry(built) -> None:
    from omegaconf import OmegaConf

    as_hydra = OmegaConf.create({**TARGET, "pretrained": "embedded"})
    assert ensure_pretrained_target(DATA, as_hydra, SETTINGS, progress=False) == built.path
