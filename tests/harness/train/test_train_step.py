"""The optimizer step: global loss normalisation, empty micro-batches, non-finite stops, W&B failures, bad input."""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from support.train import (
    IN_PROCESS,
    STEP_TOKENS,
    compose_config,
    data_overrides,
    random_samples,
    read_jsonl,
    write_samples_jsonl,
)

from harness.data.config import DataConfig
from harness.data.samples import load_samples
from harness.models.drafter import DFlashDrafter
from harness.train.batch import BatchCollator
from harness.train.config import run_config_from_dict
from harness.train.launch.compose import features_config, models_config
from harness.train.launch.run import run
from harness.train.loop.checkpoint import checkpoint_paths
from harness.train.loop.trainer import NonFiniteLoss
from strategies import Budget, available_strategies, build_strategy

def test_same_samples_in_one_step_give_the_same_gradient_under_every_strategy(tmp_path, batchlab_cache):
    """Each strategy groups (and lays out) the same 12 samples into the micro-batches of one step in its own way."""
    data = write_samples_jsonl(tmp_path / "data.jsonl", random_samples(14, 12, 60, 300, seed=1))
    first_steps = {}
    for strategy in available_strategies():
        config = compose_config([*IN_PROCESS, *data_overrides(data), f"strategy={strategy}",
                                 "trainer.max_tokens=128", "trainer.grad_accum=16", "trainer.stop_tokens=1"])
        run(config, tmp_path / strategy)
        first_steps[strategy] = read_jsonl(tmp_path / strategy / "metrics.jsonl")[0]
    reference = first_steps["shuffle"]
    assert reference["samples_per_step"] == 12  # the whole training split in one step
    for strategy, record in first_steps.items():
        assert record["samples_per_step"] == 12
        assert record["loss"] == pytest.approx(reference["loss"], rel=1e-5), strategy
        assert record["grad_norm"] == pytest.approx(reference["grad_norm"], rel=1e-5), strategy
    # the groupings really differ (otherwise the test proves nothing)
    assert len({r["computed_slots"] for r in first_steps.values()}) > 1


def test_non_finite_loss_stops_naming_step_and_samples(tmp_path, batchlab_cache, monkeypatch):
    data = write_samples_jsonl(tmp_path / "data.jsonl", random_samples(30, 10, 60, 300, seed=4))
    original = DFlashDrafter.prepared_loss
    calls = {"n": 0}

    def poisoned(self, inputs, hidden, features=None):
        result = original(self, inputs, hidden, features)
        if torch.is_grad_enabled():
            calls["n"] += 1
            if calls["n"] == 3:
                result.weighted_ce_sum = result.weighted_ce_sum * float("nan")
        return result

    monkeypatch.setattr(DFlashDrafter, "prepared_loss", poisoned)
    config = compose_config([*IN_PROCESS, *data_overrides(data), "strategy=packed", "trainer.max_tokens=128",
                             "trainer.checkpoint_every_steps=1", "trainer.stop_tokens=100000"])
    with pytest.raises(NonFiniteLoss) as stopped:
        run(config, tmp_path / "run")
    message = str(stopped.value)
    assert "step 3" in message and "rank 0 samples [[" in message
    assert [p.name for p in checkpoint_paths(tmp_path / "run")] == ["step-00000001.pt", "step-00000002.pt"]


def test_wandb_failing_mid_run_warns_once_and_training_goes_on(tmp_path, batchlab_cache, monkeypatch):
    import wandb
    import wandb.sdk.wandb_run

    data = write_samples_jsonl(tmp_path / "data.jsonl", random_samples(30, 10, 60, 300, seed=5))
    original = wandb.sdk.wandb_run.Run.log
    calls = {"n": 0}

    def flaky(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] >= 3:
            raise ConnectionError("W&B went away")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(wandb.sdk.wandb_run.Run, "log", flaky)
    config = compose_config([*IN_PROCESS[:2], "trainer.progress=false", "logger=wandb", *data_overrides(data),
                             "strategy=packed", "trainer.max_tokens=128", "trainer.stop_tokens=2500"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        summary = run(config, tmp_path / "run")
    w_and_b = [w for w in caught if "W&B log failed" in str(w.message)]
    assert len(w_and_b) == 1
    assert summary["status"] == "complete"
    records = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert records[-1]["tokens_seen"] == summary["tokens_seen"] >= 2500
    assert calls["n"] == 3  # switched off after the failure
    assert wandb.run is None  # and still finished: a next run in this process (a sweep's next job) starts its own


@pytest.mark.parametrize("mode", ["disabled", "offline"])
def test_the_closing_line_says_where_the_wandb_run_went_and_only_what_exists(tmp_path, monkeypatch, mode):
    from harness.train.loop.metrics import WandbSink

    monkeypatch.setenv("WANDB_MODE", mode)
    monkeypatch.setenv("WANDB_SILENT", "true")
    sink = WandbSink(tmp_path, project="p", entity=None, group="g", name="n", job_type="train", tags=[], config={},
                     mode="offline", run_id=f"closing-{mode}", resume=False)
    where = sink.location()
    sink.close()
    if mode == "disabled":
        assert where.startswith("W&B disabled") and "offline run in" not in where
        assert not (tmp_path / "wandb").exists()
    else:
        directory = where.split("offline run in ")[1].split(" (wandb sync")[0]
        assert Path(directory).is_dir() and Path(directory).is_relative_to(tmp_path)


@pytest.mark.parametrize("bad, message", [
    ({"input_ids": [5, 9999, 7, 8, 9, 10, 11, 12, 13, 14]}, "9999"),
    ({"input_ids": [5, 6, 7, 8, 9, 10, 11, 12, 13], "loss_mask": [1, 1]}, "loss_mask"),
    ({"tokens": [5, 6, 7]}, "input_ids"),
])
def test_bad_input_is_named_before_training(tmp_path, batchlab_cache, bad, message):
    rows = [{"input_ids": list(range(2, 40))} for _ in range(6)]
    if "tokens" in bad:
        rows = [bad] * 6
    else:
        rows[3] = bad
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = compose_config([*IN_PROCESS, *data_overrides(path, heldout_fraction=0.0), "strategy=packed"])
    with pytest.raises(ValueError, match=message):
        run(config, tmp_path / "run")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_samples_anchors_do_not_depend_on_its_neighbours(batchlab_cache):
    """The collate draws anchors from (seed, epoch, sample index): same blocks under every strategy and world size."""
    samples = load_samples(DataConfig(max_documents=60, vocab_size=300), progress=False)
    collate = BatchCollator(samples, "padded", block_size=8, num_anchors=4, mask_token_id=300,
                            loss_decay_gamma=4.0, max_blocks=None, anchor_seed=7)
    rows = np.arange(len(samples))
    lengths = np.minimum(samples.lengths, 512)
    seen: dict[int, list] = {}
    for strategy in available_strategies():
        for world in (1, 3):
            plan = build_strategy(strategy).plan(lengths, Budget(512), seed=0, epoch=2, world_size=world)
            layout = "packed" if plan.layout == "packed" else "padded"
            collate.layout = layout
            for m in range(plan.num_micro_batches):
                indices = plan.sample_indices[plan.micro_batch_offsets[m]:plan.micro_batch_offsets[m + 1]]
                if indices.size == 0:
                    continue
                batch = collate(rows[indices], lengths[indices], epoch=2)
                lay = batch.drafter.layout
                for d, row in enumerate(batch.sample_indices.tolist()):
                    anchors = lay.anchor[(lay.doc_index == d) & lay.keep].tolist()
                    seen.setdefault(row, []).append(anchors)
    assert len(seen) == len(samples)
    assert all(all(a == draws[0] for a in draws) for draws in seen.values())
    assert sum(len(draws[0]) > 0 for draws in seen.values()) > len(samples) // 2


def test_regenerated_completions_train_on_the_targets_own_continuations(tmp_path, batchlab_cache):
    """data.completions=regenerated: the same prompts with the (pretrained) target's greedy completions."""
    import yaml
    from support.train import REPO
    from transformers import Qwen3_5ForCausalLM

    from harness.data.samples import heldout_split
    from harness.models.config import load_target_config

    kwargs = yaml.safe_load((REPO / "conf" / "target" / "tiny.yaml").read_text())
    kwargs["vocab_size"] = 512
    torch.manual_seed(0)
    checkpoint = tmp_path / "target"
    Qwen3_5ForCausalLM(load_target_config(kwargs)).save_pretrained(checkpoint)
    base = [*IN_PROCESS, "experiment=smoke", "trainer.nproc=1", "trainer.num_workers=0", "logger=none",
            "trainer.stop_tokens=2000", f"target.pretrained={checkpoint}"]
    with pytest.raises(ValueError, match="needs a pretrained target"):
        run(compose_config([*IN_PROCESS, "experiment=smoke", "trainer.nproc=1", "data.completions=regenerated"]),
            tmp_path / "random")
    summary = run(compose_config([*base, "data.completions=regenerated"]), tmp_path / "run")
    assert summary["status"] == "complete"
    used = json.loads((tmp_path / "run" / "config.json").read_text())["data"]
    assert used["completions"] == "corpus" and "regen-" in used["source"]
    original = load_samples(DataConfig(**{**compose_config(base)["data"]}), progress=False)
    regenerated = load_samples(DataConfig(**used), progress=False)
    assert len(regenerated) == len(original)
    assert list(heldout_split(len(original), DataConfig(**used))[1]) == list(
        heldout_split(len(regenerated), DataConfig(**used))[1])
    changed = 0
    for row in range(len(original)):
        (ids_a, mask_a), (ids_b, mask_b) = original.sample(row), regenerated.sample(row)
        prompt = int((~mask_a.astype(bool)).cumprod().sum())
        assert list(ids_b[:prompt]) == list(ids_a[:prompt])  # the same prompt
        assert not mask_b[:prompt].any() and mask_b[prompt:].all()  # the loss covers the new completion
        changed += list(ids_b[prompt:]) != list(ids_a[prompt:])
    assert changed > len(original) // 2  # the completions are the target's, not the corpus's


def test_regenerated_completions_pin_the_target_that_wrote_them(tmp_path, monkeypatch):
    """target.pretrained=embedded resolves the target from the run's data: after regeneration that data is the
    target's own completions, so resolving it again would pretrain (and train the drafter on) another target.
    The run's config must name the checkpoint that regenerated the data."""
    from harness.eval import regenerate as regenerate_module
    from harness.train.launch import inputs as inputs_module
    from harness.train.launch.inputs import with_regenerated_completions

    checkpoint = tmp_path / "target-ckpt"
    calls = []

    def fake_target_path(config, progress=False):
        calls.append(config.data.source)
        return str(checkpoint)

    def fake_regenerate(data, target_spec, settings, progress=True):
        assert target_spec == str(checkpoint)
        return tmp_path / "regen", {"rows": 3}, True

    monkeypatch.setattr(inputs_module, "pretrained_target_path", fake_target_path)
    monkeypatch.setattr(regenerate_module, "regenerate", fake_regenerate)
    config_dict = compose_config([*IN_PROCESS, "experiment=smoke", "target=tiny-pretrained",
                                  "data=stdlib-regenerated"])
    assert config_dict["target"]["pretrained"] == "embedded"
    used = with_regenerated_completions(config_dict)
    assert used["data"]["source"] == str(tmp_path / "regen") and used["data"]["completions"] == "corpus"
    assert used["target"]["pretrained"] == str(checkpoint) and calls == ["stdlib"]
    assert run_config_from_dict(used).target.pretrained == str(checkpoint)


# ---------------------------------------------------------------- equal-token steps
def test_equal_token_steps_give_every_strategy_the_same_step_count(tmp_path, batchlab_cache):
    steps = {}
    for strategy in ("sorted", "shuffle", "packed"):
        run(compose_config([*STEP_TOKENS, f"strategy={strategy}"]), tmp_path / strategy)
        records = read_jsonl(tmp_path / strategy / "metrics.jsonl")
        summary = json.loads((tmp_path / strategy / "summary.json").read_text())
        assert summary["status"] == "complete" and summary["steps"] == summary["stop_steps"] == len(records)
        steps[strategy] = records
        # a step carries step_tokens real tokens within the largest micro-batch (max_tokens), but an epoch's
        # last step (what is left) and the run's last
        last_of_epoch = {r["epoch"]: r["step"] for r in records}
        inner = [r for r in records if r["step"] != last_of_epoch[r["epoch"]]]
        assert inner and all(abs(r["real_tokens"] - 1536) <= 512 for r in inner), [r["real_tokens"] for r in inner]
        assert records[0]["plan_step_tokens_target"] == 1536
    assert len({len(records) for records in steps.values()}) == 1  # the same number of optimizer steps
    tokens = {s: records[-1]["tokens_seen"] for s, records in steps.items()}
    assert max(tokens.values()) - min(tokens.values()) <= 2 * 512, tokens  # the same tokens, to a micro-batch
    # padding shows as a step's cost (more micro-batches, more slots), not as more steps
    for key in ("computed_slots", "micro_batches"):
        assert np.mean([r[key] for r in steps["shuffle"]]) > np.mean([r[key] for r in steps["packed"]]), key


def test_equal_token_steps_stop_at_the_end_of_a_whole_number_of_epochs(tmp_path, batchlab_cache):
    """trainer.stop_epochs=N: every strategy sees every sample N times (the same tokens exactly, no tail subset that
    differs by strategy), in the same number of steps to one step an epoch; the last step is evaluated."""
    runs = {}
    for strategy in ("sorted", "shuffle", "packed"):
        config = compose_config([*STEP_TOKENS, f"strategy={strategy}", "trainer.stop_tokens=null",
                                 "trainer.stop_epochs=2", "data.max_documents=60"])
        run(config, tmp_path / strategy)
        runs[strategy] = (read_jsonl(tmp_path / strategy / "metrics.jsonl"),
                          json.loads((tmp_path / strategy / "summary.json").read_text()))
    for strategy, (records, summary) in runs.items():
        assert summary["status"] == "complete" and summary["stop_steps"] is None
        assert records[-1]["tokens_seen"] == 2 * summary["epoch_tokens"], strategy  # exactly two epochs
        assert records[-1]["epochs"] == 2.0 and {r["epoch"] for r in records} == {0, 1}
        assert math.isfinite(records[-1]["eval_loss"])  # the stop is evaluated
    steps = [len(records) for records, _ in runs.values()]
    assert max(steps) - min(steps) <= 2, steps


def test_a_bf16_drafter_over_an_fp32_target_keeps_the_targets_features(tmp_path, batchlab_cache, monkeypatch):
    """trainer.drafter_precision=bf16: the drafter's forward in bf16 autocast (its losses move by bf16 rounding
    only), the target never (training, held-out loss and live τ real: its proposals in bf16, the target's
    verification not), the target's features and their cache key those of the fp32 run."""
    from harness.eval import speculative
    from harness.models.target import HybridTarget
    from harness.train.feature_cache import cache_key
    from harness.train.rank_models import DrafterModel

    seen = {"target": [], "proposals": []}
    target_forward, propose = HybridTarget.forward, speculative._propose

    def target_recording(*args, **kwargs):
        seen["target"].append(torch.is_autocast_enabled("cpu"))
        return target_forward(*args, **kwargs)

    def propose_recording(*args, **kwargs):
        seen["proposals"].append(torch.is_autocast_enabled("cpu"))
        return propose(*args, **kwargs)

    monkeypatch.setattr(HybridTarget, "forward", target_recording)
    monkeypatch.setattr(speculative, "_propose", propose_recording)
    data = write_samples_jsonl(tmp_path / "data.jsonl", random_samples(24, 12, 60, 300, seed=5))
    common = [*IN_PROCESS, *data_overrides(data), "strategy=sorted", "trainer.max_tokens=256",
              "trainer.stop_tokens=600", "eval.every_tokens=1000000", "eval.real_replay=false",
              "eval.real_prompts=2", "eval.real_new_tokens=6"]
    records = {}
    for precision in ("fp32", "bf16"):
        config = compose_config([*common, f"trainer.drafter_precision={precision}"])
        seen["target"].clear(), seen["proposals"].clear()
        run(config, tmp_path / precision)
        assert seen["target"] and not any(seen["target"])  # every target forward outside autocast
        assert seen["proposals"] and all(enabled == (precision == "bf16") for enabled in seen["proposals"])
        records[precision] = read_jsonl(tmp_path / precision / "metrics.jsonl")
        models = DrafterModel(models_config(run_config_from_dict(config)), torch.device("cpu"))
        assert models.target.embed_tokens.weight.dtype == torch.float32  # the target stays at trainer.precision
        with models.autocast():
            assert torch.is_autocast_enabled("cpu") == (precision == "bf16")
        with models.target_autocast():  # an fp32 target never computes in bf16
            assert not torch.is_autocast_enabled("cpu")
    fp32, bf16 = records["fp32"], records["bf16"]
    assert len(fp32) == len(bf16) >= 2
    # the same weights at step 1: the losses differ by the bf16 rounding of the drafter alone
    assert bf16[0]["loss"] == pytest.approx(fp32[0]["loss"], rel=2e-2)
    assert bf16[0]["loss"] != fp32[0]["loss"]
    rows = np.arange(4)

    def key(*overrides):
        return cache_key(features_config(run_config_from_dict(compose_config([*common, *overrides]))), "data", rows)

    assert key("trainer.drafter_precision=fp32") == key("trainer.drafter_precision=bf16") == key()
    assert key("trainer.precision=bf16") != key()
