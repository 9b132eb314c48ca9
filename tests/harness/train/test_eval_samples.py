"""eval_samples.jsonl: every held-out sample's and every real-acceptance prompt's numbers at every evaluation, the
same numbers as the pooled metrics (harness/train/loop/evaluator.py)."""

from __future__ import annotations

import json
import math

import pytest
from support.train import IN_PROCESS, data_overrides, random_samples, write_samples_jsonl
from support.train import compose_config, read_jsonl

from harness.train.launch.run import run
from harness.train.loop.evaluator import EVAL_SAMPLES_FILE


def _evaluated_run(tmp_path, name, *overrides):
    data = write_samples_jsonl(tmp_path / "data.jsonl", random_samples(48, 10, 90, 300, seed=5))
    config = compose_config([*IN_PROCESS, *data_overrides(data, heldout_fraction=0.25), "data.max_heldout=12",
                             "trainer.max_tokens=256", "trainer.stop_tokens=2500", "eval.every_tokens=1200",
                             "eval.real_prompts=5", "eval.real_new_tokens=12", "eval.real_prompt_tokens=24",
                             *overrides])
    run(config, tmp_path / name)
    return read_jsonl(tmp_path / name / "metrics.jsonl"), tmp_path / name / EVAL_SAMPLES_FILE


def test_each_held_out_sample_and_prompt_sums_to_the_pooled_metrics(tmp_path, batchlab_cache):
    records, path = _evaluated_run(tmp_path, "run")
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    evals = [r for r in records if r.get("eval_loss") is not None]
    assert len(evals) >= 2 and {line["step"] for line in lines} == {r["step"] for r in evals}
    for record in evals:
        samples = [line for line in lines if line["step"] == record["step"] and line["kind"] == "sample"]
        prompts = [line for line in lines if line["step"] == record["step"] and line["kind"] == "prompt"]
        assert len(samples) == len({s["sample"] for s in samples}) == 12  # every held-out sample once
        # the endpoint is its records' own sums (accumulated in fp64 from the same per-block values), to 1e-12
        weight = math.fsum(s["weight_sum"] for s in samples)
        assert abs(math.fsum(s["weighted_ce_sum"] for s in samples) / weight - record["eval_loss"]) <= 1e-12
        assert abs(math.fsum(s["tau_sum"] for s in samples) / sum(s["blocks"] for s in samples)
                   - record["eval_tau"]) <= 1e-12
        assert sum(s["blocks"] for s in samples) == record["eval_blocks"]
        assert [p["prompt"] for p in prompts] == list(range(record["eval_real_prompts"])) == list(range(5))
        gains = [g for p in prompts for g in p["accepted"]]
        assert sum(gains) / len(gains) == pytest.approx(record["eval_tau_real"], rel=1e-12)
        assert all(p["accepted"] and all(1 <= g <= 8 for g in p["accepted"]) for p in prompts)  # block size 8
    per_sample_loss = {s["sample"]: s["weighted_ce_sum"] / s["weight_sum"]
                       for s in lines if s["kind"] == "sample" and s["step"] == evals[-1]["step"] and s["weight_sum"]}
    assert len(set(round(v, 6) for v in per_sample_loss.values())) > 1  # per sample, not a pooled copy
    # the run names its machine, and the sweep's runs.csv carries it (timings are comparable on one machine only)
    from analysis.compare import run_metrics
    from analysis.load import load_sweeps
    from harness.machine import cpu_model, machine_name

    summary = json.loads((path.parent / "summary.json").read_text())
    assert summary["machine"] == machine_name() and summary["machine"].startswith(cpu_model())
    assert list(run_metrics(load_sweeps([tmp_path]))["machine"]) == [summary["machine"]]


def test_per_sample_evaluation_can_be_switched_off(tmp_path, batchlab_cache):
    records, path = _evaluated_run(tmp_path, "off", "eval.per_sample=false", "eval.real_prompts=0")
    assert any(r.get("eval_loss") is not None for r in records) and not path.exists()


def test_the_validation_split_is_set_aside_from_training_apart_from_the_test_rows():
    from harness.data.config import DataConfig
    from harness.data.samples import heldout_split, validation_split

    cfg = DataConfig(heldout_fraction=0.1, validation_fraction=0.2, max_validation=50)
    train, heldout = heldout_split(400, cfg)
    kept, validation = validation_split(train, cfg)
    assert validation.size == 50 and kept.size == train.size - 50  # ceil(0.2 * 360) = 72, capped at 50
    assert not set(validation) & set(heldout) and not set(validation) & set(kept)
    assert sorted([*kept, *validation]) == train.tolist()
    again = validation_split(train, DataConfig(heldout_fraction=0.1, validation_fraction=0.2, max_validation=50))
    assert again[1].tolist() == validation.tolist()  # the same rows for every run
    other = validation_split(train, DataConfig(heldout_fraction=0.1, validation_fraction=0.2, max_validation=50,
                                               heldout_seed=7))
    assert other[1].tolist() != validation.tolist()  # its own seed: the split's, never the run's
    assert validation_split(train, DataConfig())[1].size == 0  # none by default


def test_tuning_evaluates_the_validation_rows_and_never_trains_on_them(tmp_path, batchlab_cache, capsys):
    from harness.train.config import run_config_from_dict

    with pytest.raises(ValueError, match="data.validation_fraction"):
        run_config_from_dict(compose_config([*IN_PROCESS, "eval.split=validation"]))
    from harness.data.config import DataConfig
    from harness.data.samples import heldout_split, validation_split

    records, path = _evaluated_run(tmp_path, "tune", "data.validation_fraction=0.2", "eval.split=validation")
    closing = capsys.readouterr().out
    assert "validation loss" in closing and "held-out loss" not in closing  # the closing line names the rows
    evaluated = {json.loads(line)["sample"] for line in path.read_text().splitlines()
                 if json.loads(line)["kind"] == "sample"}
    summary = json.loads((tmp_path / "tune" / "summary.json").read_text())
    assert summary["eval_split"] == "validation" and summary["validation_samples"] == len(evaluated) == 8
    split = DataConfig(heldout_fraction=0.25, max_heldout=12, validation_fraction=0.2)  # _evaluated_run's data
    trained, validation = validation_split(heldout_split(48, split)[0], split)
    assert evaluated <= set(validation.tolist()) and not evaluated & set(trained.tolist())
    assert summary["train_samples"] <= trained.size == 48 - 12 - 8
    _, test_run = _evaluated_run(tmp_path, "test", "data.validation_fraction=0.2")
    assert "held-out loss" in capsys.readouterr().out
    tested = {json.loads(line)["sample"] for line in test_run.read_text().splitlines()
              if json.loads(line)["kind"] == "sample"}
    assert len(tested) == 12 and not tested & evaluated  # the test rows are another set
