"""Every fingerprint, each of its fields changed in turn: a refusal or a new key. The fields are read from the
fingerprint's own definition (a function's parameters, a built fingerprint's keys, a module's declared settings), so
a field the fingerprint drops, or that its caller never passes, fails here; a new field needs its change below.

Fingerprints: the plan's (also the checkpoint's), ``StrategyBatchSampler``'s state, the tokenized data, the cached
features, τ real's replay and the calibration."""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import numpy as np
import pytest
from support.train import compose_config

from harness.train.loop import checkpoint as ckpt
from harness.train.launch.compose import epoch_data_config, features_config

BASE = ["experiment=smoke", "logger=none", "trainer.nproc=1", "strategy=packed", "data.max_documents=40"]

#: a change of the run's config that changes each field of the plan fingerprint (the fields themselves are read from
#: plan_fingerprint's parameters)
PLAN_CHANGES = {
    "lengths_sha256": ["data.heldout_seed=5"],
    "data_fingerprint": ["data.max_documents=41"],
    "max_tokens": ["trainer.max_tokens=768"],
    "max_samples": ["trainer.max_samples=3"],
    "strategy": ["strategy=shuffle"],
    "strategy_options": ["strategy.fit=best"],
    "balance": ["strategy.balance=true"],
    "oversize": ["trainer.oversize=truncate"],
    "world_size": ["trainer.nproc=2"],
    "grad_accum": ["trainer.grad_accum=2"],
    "seed": ["seed=1"],
    "block_size": ["drafter.block_size=10"],
    "num_anchors": ["drafter.num_anchors=8"],
    "max_blocks": ["drafter.max_blocks=16"],
    "step_tokens": ["trainer.step_tokens=2048"],
}


def _fingerprint(overrides: list[str]) -> dict:
    """The plan fingerprint a run of ``BASE + overrides`` computes (EpochData, as the trainer builds it)."""
    from harness.train.config import run_config_from_dict
    from harness.train.loop.epoch_data import EpochData

    config = run_config_from_dict(compose_config([*BASE, *overrides]))
    env = SimpleNamespace(world_size=int(config.trainer.nproc), rank=0, is_main=True)
    return EpochData(epoch_data_config(config), SimpleNamespace(env=env, barrier=lambda: None)).fingerprint


@pytest.fixture(scope="module")
def base_fingerprint(batchlab_cache):
    return _fingerprint([])


def test_every_plan_fingerprint_field_has_a_change():
    fields = set(inspect.signature(ckpt.plan_fingerprint).parameters)
    assert set(PLAN_CHANGES) == fields, f"plan_fingerprint's fields without a change here: {fields - set(PLAN_CHANGES)}"


@pytest.mark.parametrize("field", sorted(inspect.signature(ckpt.plan_fingerprint).parameters))
def test_a_checkpoint_refuses_each_changed_plan_field(field, base_fingerprint, tmp_path):
    changed = _fingerprint(PLAN_CHANGES[field])
    assert field in base_fingerprint, f"plan_fingerprint drops {field}"
    assert changed[field] != base_fingerprint[field], f"{PLAN_CHANGES[field]} does not reach the fingerprint's {field}"
    if field in ckpt.LAYOUT_KEYS:  # may change on resume: the rest of the epoch is re-planned
        assert ckpt.check_fingerprint(base_fingerprint, changed, tmp_path, allowed=ckpt.LAYOUT_KEYS) == [field]
    else:
        with pytest.raises(ckpt.FingerprintMismatch, match=rf"\b{field}: checkpoint"):
            ckpt.check_fingerprint(base_fingerprint, changed, tmp_path, allowed=ckpt.LAYOUT_KEYS)


# ---------------------------------------------------------------------------------------------- the sampler's state
LENGTHS = np.random.default_rng(0).integers(16, 400, 300)
SAMPLER_CHANGES = {
    "samples": {"lengths": LENGTHS[:-1]},
    "lengths_sha256": {"lengths": LENGTHS[::-1].copy()},
    "max_tokens": {"max_tokens": 1000},
    "max_samples": {"max_samples": 4},
    "strategy": {"strategy": "shuffle"},
    "strategy_options": {"strategy_options": {"fit": "best"}},
    "seed": {"seed": 1},
    "oversize": {"oversize": "drop"},
    "balance": {"balance": {}},
    "step_tokens": {"step_tokens": 2048},
}


def _sampler(**changes):
    from batchlab import StrategyBatchSampler

    return StrategyBatchSampler(**{"lengths": LENGTHS, "max_tokens": 1024, "rank": 0, "world_size": 1, **changes})


def test_every_sampler_fingerprint_field_has_a_change():
    assert set(SAMPLER_CHANGES) == set(_sampler().fingerprint)


@pytest.mark.parametrize("field", sorted(SAMPLER_CHANGES))
def test_a_sampler_state_refuses_each_changed_field(field):
    from batchlab.sampler import SamplerStateError

    state = _sampler().state_dict()
    changed = _sampler(**SAMPLER_CHANGES[field])
    assert changed.fingerprint[field] != state["fingerprint"][field]
    with pytest.raises(SamplerStateError, match=rf"\b{field}: state"):
        changed.load_state_dict(state)


# ---------------------------------------------------------------------------------------------- cache keys
def changed_value(value):
    """Another value of ``value``'s kind."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    if isinstance(value, float):
        return value / 2 + 0.25
    if isinstance(value, str):
        return value + "-other"
    if isinstance(value, (list, tuple)):
        return [*value, value[-1]] if value else [1]
    if isinstance(value, dict):
        return {**value, "other": 1}
    if value is None:
        return 1
    raise TypeError(f"no other value for {value!r}")


def test_the_data_key_changes_with_each_of_its_settings(tmp_path):
    import dataclasses

    from harness.data.config import DataConfig
    from harness.data.corpus_cache import SAMPLES_KEY_SETTINGS, samples_key

    tokenizer = tmp_path / "tokenizer.json"
    tokenizer.write_text("{}")
    corpus = {"root": "/lib", "files": [["a.py", 1, 2]]}
    base = DataConfig(max_documents=40)
    keys = {samples_key(base, corpus), samples_key(base, {**corpus, "files": []})}
    for name in SAMPLES_KEY_SETTINGS:
        value = str(tokenizer) if name == "tokenizer" else changed_value(getattr(base, name))
        keys.add(samples_key(dataclasses.replace(base, **{name: value}), corpus))
    assert len(keys) == 2 + len(SAMPLES_KEY_SETTINGS)


def test_the_feature_key_changes_with_the_target_the_data_the_rows_and_each_setting():
    from harness.train.config import run_config_from_dict
    from harness.train.feature_cache import KEY_SETTINGS, cache_key

    config = compose_config([*BASE, "drafter.target_layer_ids=[1,2]"])
    rows = np.arange(10)
    def key(run: dict, data: str, rows: np.ndarray) -> str:
        return cache_key(features_config(run_config_from_dict(run)), data, rows)

    keys = {key(config, "data", rows), key(config, "other data", rows), key(config, "data", rows[:-1]),
            key({**config, "target": {**config["target"], "num_hidden_layers": 3}}, "data", rows)}
    for dotted in KEY_SETTINGS:
        section, name = dotted.split(".")
        value = {"trainer.precision": "bf16"}.get(dotted, changed_value(config[section][name]))
        keys.add(key({**config, section: {**config[section], name: value}}, "data", rows))
    assert len(keys) == 4 + len(KEY_SETTINGS)


def _keys_over_parameters(key_function, base: dict) -> set[str]:
    """``key_function(**base)`` and, for each of its parameters in turn, the key with that one changed."""
    keys = {key_function(**base)}
    for name in inspect.signature(key_function).parameters:
        if name in base:
            keys.add(key_function(**{**base, name: changed_value(base[name])}))
    return keys


def test_the_replay_key_changes_with_each_of_its_arguments():
    from harness.eval.replay import replay_key

    base = {"identity": {"target": "t"}, "prompts": [[1, 2, 3]], "max_new_tokens": 8, "tap_layer_ids": [1, 3]}
    keys = _keys_over_parameters(replay_key, base)
    keys.add(replay_key(**base, gdn_backend="fla"))  # the keyword options too
    assert len(keys) == 2 + len(base)


def test_the_calibration_key_changes_with_each_of_its_arguments():
    from harness.advise.calibrate import calibration_key

    base = {"machine": {"cpu": "x"}, "dtype": "fp32", "max_tokens": 1024, "target": {"layers": 2},
            "drafter": {"block_size": 8}}
    assert set(base) == set(inspect.signature(calibration_key).parameters)
    assert len(_keys_over_parameters(calibration_key, base)) == 1 + len(base)
