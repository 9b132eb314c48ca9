"""batchlab-advise: the cost fit, the calibration cache (keyed, resumable, atomic), deterministic predictions that
match an independent sum over the plan, the recommendation, and one-line errors."""

from __future__ import annotations

import json
import os
from dataclasses import replace as dataclasses_replace
from pathlib import Path

import numpy as np
import pytest

from harness.advise import advice
from harness.advise import calibrate as cal
from harness.advise import link as link_module
from harness.advise.schedule import LinkCost
from harness.advise.predict import plan_seconds, predict, recommendation
from harness.cli import advise as advise_cli
from harness.train.launch.compose import models_config

#: a (s/slot), b (s/len²), c (s/block), m (s/micro-batch): each term a visible share of a 2,048-token micro-batch
TRUE = np.array([1e-4, 1e-8, 5e-5, 2e-2])
#: the same split in two stages: the target's forward (slots, Σlen², its share of m), the drafter's (blocks, the rest)
TARGET, DRAFTER = np.array([1e-4, 1e-8, 0.0, 1.5e-2]), np.array([0.0, 0.0, 5e-5, 0.5e-2])


#: the split's link as a CPU run of batchlab-advise measures it (stored, as calibrations are in these tests): a
#: full micro-batch's send, receive and unpack
STORED_LINK = LinkCost(send=(2e-3, 0.0, 3e-7), receive=(1.5e-3, 0.0, 5e-7), unpack=(3e-4, 0.0, 1e-7))


@pytest.fixture(autouse=True)
def stored_link(monkeypatch):
    """The command measures the split's link on CPU with two real ranks: these tests give it a stored one, and
    record what it was asked for."""
    asked = []

    def fake(config, cache_dir, progress=True):
        asked.append(config)
        return STORED_LINK, {"rows": []}

    monkeypatch.setattr(link_module, "calibrate_link", fake)
    return asked


def terms_of(shapes, max_tokens=2048, block_size=8, num_anchors=64):
    return np.array([[*s.terms(block_size, num_anchors, max_tokens), 1.0] for s in shapes])


def test_the_fit_recovers_known_coefficients_from_noisy_timings():
    shapes = cal.design(2048, 8)
    terms = terms_of(shapes)
    rng = np.random.default_rng(0)
    seconds = terms @ TRUE * (1 + rng.normal(0, 0.01, len(shapes)))
    fitted = cal.fit(terms, seconds)
    assert (fitted >= 0).all()
    assert np.allclose(fitted, TRUE, rtol=0.25), fitted
    assert np.abs(terms @ fitted / (terms @ TRUE) - 1).max() < 0.05  # every shape's time within 5%
    exact = cal.fit(terms, terms @ TRUE)
    assert np.allclose(exact, TRUE, rtol=1e-6)  # without noise, exactly


def test_the_fit_never_returns_a_negative_coefficient():
    shapes = cal.design(1024, 8)
    terms = terms_of(shapes, max_tokens=1024)
    seconds = terms[:, 0] * 1e-6 - terms[:, 1] * 1e-10 + 1e-3  # an unconstrained fit would make b negative
    assert (cal.fit(terms, seconds) >= 0).all()


def test_the_cache_key_changes_with_machine_device_dtype_budget_and_configs():
    machine = cal.machine_identity("cpu")
    base = dict(machine=machine, dtype="fp32", max_tokens=2048, target={"hidden_size": 64}, drafter={"layers": 2})
    keys = {cal.calibration_key(**base)}
    for change in ({"machine": {**machine, "cpu": "another"}}, {"machine": {**machine, "device": "cuda"}},
                   {"dtype": "bf16"}, {"max_tokens": 4096}, {"target": {"hidden_size": 128}}, {"drafter": {"layers": 1}}):
        keys.add(cal.calibration_key(**{**base, **change}))
    assert len(keys) == 7
    assert cal.calibration_key(**base) == cal.calibration_key(**base)
    # soft labels cost a teacher head: keyed when set; unset (0), the key of a drafter from before the setting
    assert cal.calibration_key(**{**base, "drafter": {"layers": 2, "distill_weight": 0.0}}) == cal.calibration_key(**base)
    assert cal.calibration_key(**{**base, "drafter": {"layers": 2, "distill_weight": 0.5}}) not in keys
    # a bf16 drafter over an fp32 target is calibrated apart from both precisions
    assert cal.stage_precisions({"precision": "fp32", "drafter_precision": None}) == "fp32"
    assert cal.stage_precisions({"precision": "fp32", "drafter_precision": "fp32"}) == "fp32"
    assert cal.stage_precisions({"precision": "fp32", "drafter_precision": "bf16"}) not in ("fp32", "bf16")


def config(max_tokens=1024):
    from harness.train.config import compose_run_config

    return compose_run_config([f"trainer.max_tokens={max_tokens}", "trainer.nproc=1", "logger=none"])


def synthetic_measure(calls):
    def measure(shape):
        calls.append(shape)
        terms = np.array([*shape.terms(8, 64, 1024), 1.0])
        return [float(terms @ TRUE)] * 3, [float(terms @ TARGET)] * 3, 0.01
    return measure


def test_an_interrupted_calibration_resumes_and_never_leaves_a_corrupt_cache(tmp_path):
    calls = []
    measure = synthetic_measure(calls)

    def interrupted(shape):
        if len(calls) == 4:
            raise KeyboardInterrupt
        return measure(shape)

    cfg = config()
    cfg["drafter"] = {**cfg["drafter"], "block_size": 8, "num_anchors": 64}
    with pytest.raises(KeyboardInterrupt):
        cal.calibrate(cfg, tmp_path, progress=False, measure=interrupted)
    assert not cal.is_cached(cfg, tmp_path)  # a partial entry is not a calibration
    files = sorted(p.name for p in (tmp_path / cal.CACHE_SUBDIR).iterdir() if not p.name.endswith(".xxh3"))
    assert len(files) == 1 and files[0].endswith(".partial.json")  # no final entry, the 4 shapes kept
    assert len(json.loads((tmp_path / cal.CACHE_SUBDIR / files[0]).read_text())["shapes"]) == 4
    calls.clear()
    calibration, measured = cal.calibrate(cfg, tmp_path, progress=False, measure=measure)
    shapes = cal.design(1024, 8)
    assert measured and len(calls) == len(shapes) - 4  # only what was left
    assert sorted(p.name for p in (tmp_path / cal.CACHE_SUBDIR).iterdir()) == [f"{calibration.key}.json",
                                                                             f"{calibration.key}.json.xxh3"]
    assert np.allclose([calibration.a, calibration.b, calibration.c, calibration.micro_batch_s], TRUE, rtol=1e-6)
    # the stages timed apart are fitted apart: the target's forward and the drafter's step
    assert np.allclose(calibration.target_stage, TARGET, rtol=1e-6, atol=1e-12), calibration.target_stage
    assert np.allclose(calibration.drafter_stage, DRAFTER, rtol=1e-6, atol=1e-12), calibration.drafter_stage
    again, measured_again = cal.calibrate(cfg, tmp_path, progress=False, measure=measure)
    assert not measured_again and again == calibration
    assert cal.is_cached(cfg, tmp_path) and not cal.is_cached(cfg, tmp_path, local_ranks=2)



@pytest.mark.parametrize("timings", ["flat", "wild"])
def test_a_degenerate_calibration_is_refused_and_never_cached(tmp_path, timings):
    """Every shape timed alike (a fit with no per-token term: CostModel(a=0, b=0, c=0) crashed batchlab-advise
    later, and every call after it from the cache), or timings no fit follows: refused naming why, nothing cached,
    and the next call measures afresh."""
    cfg = config()
    cfg["drafter"] = {**cfg["drafter"], "block_size": 8, "num_anchors": 64}
    draws = iter(np.random.default_rng(0).uniform(0.001, 0.2, size=1000))

    def disturbed(shape):
        seconds = 0.05 if timings == "flat" else float(next(draws))
        return [seconds] * 3, [seconds / 2] * 3, 0.01

    with pytest.raises(cal.DegenerateFit, match="nothing was cached") as refused:
        cal.calibrate(cfg, tmp_path, progress=False, measure=disturbed)
    assert ("no term grows with the micro-batch" if timings == "flat" else "off by more than a factor") in str(refused.value)
    assert not cal.is_cached(cfg, tmp_path) and not list((tmp_path / cal.CACHE_SUBDIR).iterdir())
    calls = []
    _, measured = cal.calibrate(cfg, tmp_path, progress=False, measure=synthetic_measure(calls))
    assert measured and len(calls) == len(cal.design(1024, 8)) and cal.is_cached(cfg, tmp_path)

def stored_calibration(max_tokens=1024, block_size=8, num_anchors=64, drafter=DRAFTER):
    return cal.Calibration(*TRUE, 0.01, block_size, num_anchors, max_tokens, "k" * 64, {"cpu": "test"}, [],
                           list(TARGET), list(drafter))


def test_predictions_are_deterministic_and_sum_the_plans_micro_batches():
    from strategies import Budget, build_strategy

    calibration = stored_calibration()
    lengths = np.random.default_rng(1).lognormal(5, 0.8, 600).astype(np.int64).clip(10, 1000)
    first = predict(lengths, ["sorted", "shuffle", "packed"], calibration, world_size=2, tokens=10**6)
    assert first == predict(lengths, ["sorted", "shuffle", "packed"], calibration, world_size=2, tokens=10**6)
    plan = build_strategy("shuffle").plan(lengths, Budget(1024), seed=0, epoch=0, world_size=2, grad_accum=1,
                                          oversize="drop")
    total = 0.0
    for step in range(plan.num_steps):  # independently: each rank's micro-batch, the slower one, plus the step
        ranks = []
        for rank in range(2):
            docs = plan.lengths[plan.micro_batch(step, rank, 0)].astype(float)
            if docs.size == 0:
                ranks.append(0.0)
                continue
            slots, quad = docs.size * docs.max(), docs.size * docs.max() ** 2
            blocks = np.clip(docs - 7, 0, 64).sum()
            ranks.append(TRUE[0] * slots + TRUE[1] * quad + TRUE[2] * blocks + TRUE[3])
        total += max(ranks) + 0.01
    assert plan_seconds(plan, calibration).sum() == pytest.approx(total, rel=1e-9)
    shuffle = first[1]
    assert shuffle.epoch_seconds == pytest.approx(total, rel=1e-9)
    assert shuffle.tokens_per_second == pytest.approx(lengths.sum() / total, rel=1e-9)
    assert shuffle.seconds_to_budget == pytest.approx(10**6 / shuffle.tokens_per_second)
    assert first[2].padding_pct < first[1].padding_pct  # packed fills rows, shuffle pads them


def test_the_recommendation_prefers_the_fastest_diverse_strategy():
    from harness.advise.predict import Prediction

    def p(name, rate, recurrence):
        return Prediction(name, rate, 1.0, 1, 1, 0.0, recurrence, recurrence, 0.0, 1.0, None)

    text = recommendation([p("sorted", 300.0, 0.6), p("bucketed", 250.0, 0.07), p("shuffle", 100.0, 0.03)])
    assert text.startswith("bucketed is the fastest strategy whose batch composition recurs at most 0.10")
    assert "The most diverse, shuffle (recurrence 0.03), would run at 0.40× its tokens/s." in text


@pytest.mark.parametrize(("argv", "message"), [
    (["--target", "nope"], "--target nope: no conf/target/nope.yaml"),
    (["--device", "cuda"], "--device cuda: no CUDA device is visible here"),
    (["--max-tokens", "8"], "argument --max-tokens: 8 is too small"),
    (["--strategies", "sortd"], "unknown strategy sortd"),
    (["--target", "qwen3.6-27b"], "GiB for its weights alone at fp32, more than the 16.0 GiB free on cpu"),
    (["--experiment", "reference_8gpu"], "--target (experiment reference_8gpu) needs"),  # its 27B-class target
    (["--experiment", "nope"], "--experiment nope: no conf/experiment/nope.yaml"),
    (["--set", "optim.lr=1"], "--set optim.lr=1: give KEY=VALUE with a target., drafter. or trainer. key"),
    (["--set", "drafter.num_hidden_layer=5"], "drafter.num_hidden_layer"),
    (["--set", "drafter.num_hidden_layers=five"], "--set drafter.num_hidden_layers=five: "),  # Hydra's own error
    (["--set", "trainer.max_tokens=4096"], "trainer.max_tokens is this command's --max-tokens; use that option"),
    (["--experiment", "reference_8gpu", "--target", "tiny"], "sets its own target and drafter; change them with --set"),
    (["--allreduce-gbps", "400"], "--allreduce-gbps 400.0: only with --device cuda (CPU ranks are calibrated together"),
    # one copy would fit in 16 GiB, but the 8 CPU ranks that calibrate together (on 8 cores) each hold one
    (["--experiment", "reference_8gpu", "--set", "target.num_hidden_layers=4", "--set", "target.vocab_size=1024",
      "--dtype", "bf16", "--world-size", "8"],
     "GiB for its weights alone at bf16 on each of the 8 CPU ranks that calibrate together"),
])
def test_bad_input_is_one_line(argv, message, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(cal, "available_bytes", lambda device: 16 * 2**30)  # the 27B target never fits, anywhere
    monkeypatch.setattr(os, "cpu_count", lambda: 8)  # as many cores as ranks: all 8 calibrate together
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("\n".join(["100", "200", "5000"]))
    args = ["--lengths", str(lengths), "--max-tokens", "1024", "--cache-dir", str(tmp_path / "cache"), *argv]
    if argv[0] == "--device":
        import torch

        if torch.cuda.is_available():
            pytest.skip("a CUDA device is visible")
    try:
        status = advise_cli.main(args)
    except SystemExit as exit_request:
        status = exit_request.code
    err = capsys.readouterr().err
    assert status == 2 and len(err.strip().splitlines()) == 1 and message in err, err
    assert not (tmp_path / "cache" / cal.CACHE_SUBDIR).exists()  # nothing measured


def test_the_command_predicts_from_a_stored_calibration_and_names_samples_over_the_budget(tmp_path, capsys,
                                                                                          monkeypatch):
    """A calibration in the cache is used as it is (no timing); the table, the paragraph, the oversize note,
    --json and --report-dir."""
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("\n".join(str(n) for n in [*np.random.default_rng(2).integers(40, 900, 300), 1500, 3000]))
    stored = stored_calibration(block_size=16, num_anchors=512)
    monkeypatch.setattr(cal, "calibrate", lambda *a, **k: (stored, False))
    args = ["--lengths", str(lengths), "--max-tokens", "1024", "--world-size", "2", "--tokens", "1e6",
            "--cache-dir", str(tmp_path)]
    assert advise_cli.main(args) == 0
    out = capsys.readouterr().out
    assert "calibration (cached" in out and "is the fastest strategy" in out
    assert "2 of 302 samples (0.7%) are longer than --max-tokens 1024 (the longest 3,000)" in out
    assert advise_cli.main([*args, "--json", "--report-dir", str(tmp_path / "advice")]) == 0
    result = json.loads(capsys.readouterr().out)
    assert {p["strategy"] for p in result["predictions"]} >= {"sorted", "shuffle", "bucketed", "packed"}
    assert (tmp_path / "advice" / "advice.png").stat().st_size > 10_000
    assert json.loads((tmp_path / "advice" / "advice.json").read_text())["recommendation"] == result["recommendation"]


def test_a_sweep_adds_only_what_its_corrected_tests_keep(tmp_path, capsys, monkeypatch, batchlab_cache,
                                                         tmp_path_factory):
    """--sweep: the recommendation quotes the report's surviving differences, or says that none survives."""
    from support import analysis as support
    from analysis.compare import run_metrics
    from analysis.load import load_sweeps
    from analysis.stats import compare_pairs, timing_check

    sweep = support.tiny_sweep(tmp_path_factory.mktemp("analysis"))
    per_run = run_metrics(load_sweeps([sweep]))
    survivors = [t for t in compare_pairs(per_run, timing=timing_check(per_run)) if t.survives]
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("\n".join(str(n) for n in np.random.default_rng(3).integers(40, 900, 200)))
    monkeypatch.setattr(cal, "calibrate", lambda *a, **k: (stored_calibration(block_size=16, num_anchors=512), False))
    assert advise_cli.main(["--lengths", str(lengths), "--max-tokens", "1024", "--cache-dir", str(tmp_path),
                            "--sweep", str(sweep), "--json"]) == 0
    text = json.loads(capsys.readouterr().out)["recommendation"]
    assert f"Measured in {sweep}" in text
    if survivors:
        from analysis.stats import surviving_sentence

        assert "differences that survive Holm–Bonferroni" in text
        assert all(surviving_sentence(t) in text for t in survivors)
    else:
        assert "no difference between strategies survives Holm–Bonferroni" in text
    assert advise_cli.main(["--lengths", str(lengths), "--max-tokens", "1024", "--sweep", str(tmp_path / "none")]) == 2
    assert "--sweep: " in capsys.readouterr().err


def test_a_target_checkpoint_is_calibrated_as_itself(tmp_path, monkeypatch, capsys):
    """--target DIR: the run's config loads that checkpoint, and its weights are what the memory check counts."""
    import torch
    import yaml
    from transformers import Qwen3_5ForCausalLM

    from harness.models.config import load_target_config
    from support.train import REPO

    kwargs = yaml.safe_load((REPO / "conf" / "target" / "tiny.yaml").read_text())
    kwargs.update(vocab_size=300, hidden_size=96, intermediate_size=160)
    checkpoint = tmp_path / "ckpt"
    model = Qwen3_5ForCausalLM(load_target_config({k: v for k, v in kwargs.items() if k != "pretrained"}))
    model.save_pretrained(checkpoint)
    seen = {}

    def fake_calibrate(config, *args, **kwargs):
        seen["config"] = config
        seen["bytes"] = cal.target_bytes(config)
        return stored_calibration(block_size=16, num_anchors=512), False

    monkeypatch.setattr(cal, "calibrate", fake_calibrate)
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("\n".join(["100", "300", "700"] * 20))
    assert advise_cli.main(["--lengths", str(lengths), "--max-tokens", "1024", "--target", str(checkpoint),
                            "--cache-dir", str(tmp_path), "--json"]) == 0
    assert seen["config"]["target"]["pretrained"] == str(checkpoint.resolve())
    assert seen["bytes"] == 4 * sum(p.numel() for p in model.parameters())
    assert torch.get_default_device().type == "cpu"  # the meta device stayed inside the count


def test_the_stage_model_sums_every_split_by_hand():
    """Colocated: each step's slowest rank (both stages) plus the step. A split T+D: the target ranks share all
    the target work, the drafter ranks (planned at the same global batch) take each step's slowest drafter rank
    plus the step; the slower stage is the epoch. Only splits whose drafter ranks divide the global batch."""
    from harness.advise.stages import StageCost, colocated_seconds, splits
    from strategies import Budget, build_strategy

    lengths = np.random.default_rng(4).lognormal(5, 0.7, 400).astype(np.int64).clip(20, 1000)
    strategy = build_strategy("shuffle")

    def make_plan(world_size, grad_accum):
        return strategy.plan(lengths, Budget(1024), seed=0, epoch=0, world_size=world_size, grad_accum=grad_accum,
                             oversize="drop")

    target = StageCost(a=1e-4, b=1e-8, m=0.01, block_size=8, num_anchors=64)
    drafter = StageCost(c=5e-5, m=0.005, block_size=8, num_anchors=64, max_blocks=150)

    def by_hand(docs, stage):
        if docs.size == 0:
            return 0.0
        blocks = min(np.clip(docs - 7, 0, 64).sum(), 150)  # the drafter's cap per micro-batch
        return (stage.a * docs.size * docs.max() + stage.b * docs.size * docs.max() ** 2 + stage.c * blocks
                + stage.m)

    def rank_times(plan, stages):
        return [[sum(by_hand(plan.lengths[plan.micro_batch(step, rank, k)].astype(float), stage)
                     for k in range(plan.grad_accum) for stage in stages) for rank in range(plan.world_size)]
                for step in range(plan.num_steps)]

    colocated = make_plan(4, 1)
    expected = sum(max(ranks) + 0.002 for ranks in rank_times(colocated, [target, drafter]))
    assert colocated_seconds(colocated, target, drafter, 0.002) == pytest.approx(expected, rel=1e-9)
    found = splits(make_plan, 4, 1, target, drafter, 0.002)
    assert [(s.label, s.drafter_grad_accum) for s in found] == [("2+2", 2), ("3+1", 4)]  # 3 drafter ranks: no
    for split in found:
        plan = make_plan(split.drafter_ranks, split.drafter_grad_accum)
        target_time = sum(map(sum, rank_times(plan, [target]))) / split.target_ranks
        drafter_time = sum(max(ranks) + 0.002 for ranks in rank_times(plan, [drafter]))
        assert split.epoch_seconds == pytest.approx(max(target_time, drafter_time), rel=1e-9)
        assert max(split.target_busy, split.drafter_busy) == pytest.approx(1.0)
        assert split.target_busy == pytest.approx(target_time / split.epoch_seconds, rel=1e-9)
        assert split.tokens == lengths[lengths <= 1024].sum()
    # the target stage is the heavy one here: a third target rank shortens the epoch, the drafter rank idles more
    assert found[1].epoch_seconds < found[0].epoch_seconds and found[1].drafter_busy > found[0].drafter_busy


def test_predictions_place_the_stages_where_they_balance():
    """On one rank there is nothing to split; on two, 1+1 against colocated, and the recommendation says which."""
    lengths = np.random.default_rng(5).lognormal(5, 0.8, 500).astype(np.int64).clip(10, 1000)
    one = predict(lengths, ["packed"], stored_calibration(), world_size=1)
    assert one[0].placement is None and "Placement" not in recommendation(one)
    # the target stage outweighs a light drafter: a split (1+1) idles the drafter rank, colocated wins
    light = predict(lengths, ["packed", "shuffle"], stored_calibration(), world_size=2)
    rows = light[0].placement["splits"]
    assert [r["split"] for r in rows] == ["1+1"] and rows[0]["vs_colocated"] < 1.0
    assert light[0].placement["best"] == "colocated"
    assert "Placement: keep target and drafter colocated; the best split, 1 target + 1 drafter ranks" in \
        recommendation(light)
    # 4 ranks and a drafter as heavy as the target: 2+2 balances, and beats colocated only if stages overlap
    balanced = predict(lengths, ["packed"], stored_calibration(drafter=TARGET[[2, 2, 0, 3]] + [0, 0, 1e-4, 0]),
                       world_size=4)[0].placement
    assert {r["split"] for r in balanced["splits"]} == {"2+2", "3+1"}
    best = max(balanced["splits"], key=lambda r: r["tokens_per_second"])
    from harness.advise.predict import SPLIT_MARGIN

    assert balanced["best"] == (best["split"] if best["vs_colocated"] >= SPLIT_MARGIN else "colocated")
    assert min(best["target_busy"], best["drafter_busy"]) > 0.5  # the best split keeps both stages busy


def test_a_runs_own_drafter_is_calibrated(tmp_path, monkeypatch, capsys):
    """--drafter RUN_DIR: the drafter section of the run's config.json; a directory that is not a run is one line."""
    from harness.train.config import compose_run_config

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    drafter = {**compose_run_config(["drafter=tiny"])["drafter"], "num_hidden_layers": 1, "block_size": 10}
    (run_dir / "config.json").write_text(json.dumps({"drafter": drafter, "seed": 0}))
    seen = {}

    def fake_calibrate(config, *args, **kwargs):
        seen["drafter"], seen["target"] = config["drafter"], config["target"]
        return stored_calibration(block_size=10, num_anchors=16), False

    monkeypatch.setattr(cal, "calibrate", fake_calibrate)
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("\n".join(["100", "300", "700"] * 20))
    base = ["--lengths", str(lengths), "--max-tokens", "1024", "--cache-dir", str(tmp_path), "--world-size", "2"]
    assert advise_cli.main([*base, "--drafter", str(run_dir), "--target", "tiny"]) == 0
    assert seen["drafter"] == drafter
    out = capsys.readouterr().out
    assert "placement on 2 ranks, target + drafter ranks" in out and "1+1" in out
    # without --target: the target the run trained against (its checkpoint), or a one-line refusal
    assert advise_cli.main([*base, "--drafter", str(run_dir)]) == 2
    assert "the run's config names no target checkpoint (target.pretrained)" in capsys.readouterr().err
    checkpoint = tmp_path / "target-checkpoint"
    checkpoint.mkdir()
    (run_dir / "config.json").write_text(json.dumps({"drafter": {**drafter, "a_key_of_another_version": 1},
                                                     "target": {"pretrained": str(checkpoint)}}))
    monkeypatch.setattr(cal, "target_bytes", lambda config: 1)
    assert advise_cli.main([*base, "--drafter", str(run_dir)]) == 0
    assert seen["target"]["pretrained"] == str(checkpoint) and seen["drafter"] == drafter
    capsys.readouterr()
    (run_dir / "config.json").write_text(json.dumps({"drafter": {**drafter, "block_size": 4}}))
    assert advise_cli.main([*base, "--drafter", str(run_dir), "--target", "tiny"]) == 2
    assert "its drafter config does not build with --target tiny: loss_decay_gamma" in capsys.readouterr().err
    (run_dir / "config.json").write_text(json.dumps({"seed": 0}))
    assert advise_cli.main([*base, "--drafter", str(run_dir), "--target", "tiny"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "is not a batchlab-train run's config (no drafter section)" in err
    assert advise_cli.main([*base, "--drafter", str(tmp_path / "lengths.txt")]) == 2
    assert "no batchlab-train run directory (one holding config.json)" in capsys.readouterr().err


def test_an_experiments_shape_is_calibrated_colocated_and_its_splits_modelled(tmp_path, monkeypatch, capsys):
    """--experiment reference_8gpu --set ...: its target, drafter and trainer settings (one period of layers here),
    each rank running both stages; the 8-rank splits are modelled from the stage fits."""
    seen = {}

    def fake_calibrate(config, *args, **kwargs):
        seen["config"], seen["local_ranks"] = config, kwargs.get("local_ranks")
        return stored_calibration(max_tokens=4096, block_size=16, num_anchors=512), False

    monkeypatch.setattr(cal, "calibrate", fake_calibrate)
    monkeypatch.setattr(cal, "available_bytes", lambda device: 64 * 2**30)
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("\n".join(str(n) for n in np.random.default_rng(6).integers(100, 4000, 400)))
    assert advise_cli.main(["--lengths", str(lengths), "--max-tokens", "4096", "--world-size", "8", "--dtype", "bf16",
                            "--experiment", "reference_8gpu", "--set", "target.num_hidden_layers=4",
                            "--cache-dir", str(tmp_path), "--json"]) == 0
    config = seen["config"]
    assert config["target"]["num_hidden_layers"] == 4 and config["target"]["vocab_size"] == 248320
    assert (config["drafter"]["num_hidden_layers"], config["drafter"]["block_size"]) == (5, 16)
    assert config["topology"]["name"] == "colocated" and config["trainer"]["nproc"] == 1
    assert (config["trainer"]["precision"], config["trainer"]["max_tokens"]) == ("bf16", 4096)
    # on CPU the ranks share the machine: measured together, one a core (more are simulated sharing the cores)
    assert seen["local_ranks"] == min(8, os.cpu_count())
    result = json.loads(capsys.readouterr().out)
    assert [r["split"] for r in result["predictions"][0]["placement"]["splits"]] == ["4+4", "6+2", "7+1"]
    assert "Placement:" in result["recommendation"]


def test_more_cpu_ranks_than_cores_are_calibrated_a_core_each_and_predicted_sharing_them():
    """A job of more CPU ranks than cores calibrates one rank a core; its predicted steps last as long as every
    rank's share of the cores makes them (world / cores times a rank's own time), and on GPUs one rank calibrates."""
    from harness.advise.predict import calibration_ranks, plan_seconds
    from strategies import Budget, build_strategy

    assert (calibration_ranks(3, "cpu", cores=2), calibration_ranks(2, "cpu", cores=2)) == (2, 2)
    assert (calibration_ranks(1, "cpu", cores=2), calibration_ranks(8, "cuda", cores=2)) == (1, 1)
    calibration = stored_calibration(max_tokens=1024, block_size=16, num_anchors=512)
    lengths = np.random.default_rng(3).integers(50, 1000, 300)
    plan = build_strategy("packed").plan(lengths, Budget(1024), seed=0, epoch=0, world_size=4, grad_accum=1)
    alone = plan_seconds(plan, calibration)
    np.testing.assert_allclose(plan_seconds(plan, calibration, cores=2), 2 * alone, rtol=1e-12)
    np.testing.assert_allclose(plan_seconds(plan, calibration, cores=4), alone, rtol=1e-12)
    np.testing.assert_allclose(plan_seconds(plan, calibration, cores=8), alone, rtol=1e-12)


def test_the_target_stage_times_the_micro_batchs_collate(monkeypatch):
    """A rank collates its own micro-batches before the target's forward (a target rank always; a colocated rank
    whose loader has no workers, as on CPU): the calibration times the collate in the target stage, every repeat,
    and not in the drafter's."""
    import statistics
    import time

    from harness.train.batch import BatchCollator

    measure = cal._measurer(config(256))
    original = BatchCollator.__call__
    collated = []

    def slow(self, *args, **kwargs):
        collated.append(1)
        time.sleep(0.05)  # far above the tiny target's forward of 96 tokens
        return original(self, *args, **kwargs)

    monkeypatch.setattr(BatchCollator, "__call__", slow)
    total, target, _ = measure(cal.Shape("padded", (64, 32)))
    assert len(collated) == cal.REPEATS + 1  # once a run, the warm-up's included
    assert min(target) >= 0.05, target
    assert statistics.median(t - u for t, u in zip(total, target)) < 0.05


def test_blocks_are_counted_as_the_drafter_runs_them_capped_a_micro_batch():
    """With the drafter's max_blocks, a micro-batch's c term counts at most that many blocks (the collate keeps
    no more), in the calibration's design and in every prediction."""
    import dataclasses

    from strategies import Budget, build_strategy

    shape = cal.Shape("packed", (512,) * 4)
    assert shape.terms(8, 64, 2048)[2] == 4 * 64 and shape.terms(8, 64, 2048, max_blocks=100)[2] == 100
    capped = dataclasses.replace(stored_calibration(), max_blocks=100)
    lengths = np.random.default_rng(7).integers(200, 1000, 300)
    plan = build_strategy("packed").plan(lengths, Budget(1024), seed=0, epoch=0, world_size=1, grad_accum=1,
                                         oversize="drop")
    total = 0.0
    for step in range(plan.num_steps):
        docs = plan.lengths[plan.micro_batch(step, 0, 0)].astype(float)
        if docs.size:
            blocks = min(np.clip(docs - 7, 0, 64).sum(), 100)
            total += TRUE[0] * 1024 + TRUE[1] * (docs ** 2).sum() + TRUE[2] * blocks + TRUE[3]
        total += 0.01
    assert plan_seconds(plan, capped).sum() == pytest.approx(total, rel=1e-9)
    assert plan_seconds(plan, capped).sum() < plan_seconds(plan, stored_calibration()).sum()
    target, drafter = capped.stage_costs()
    assert drafter.max_blocks == 100 and target.max_blocks == 100


def test_the_gradient_allreduce_is_added_to_every_step_of_the_ranks_that_train_the_drafter():
    """--allreduce-gbps on GPUs: a ring all-reduce of the drafter's gradients a step, over every rank colocated and
    over the drafter ranks of a split."""
    from harness.advise.predict import ring_allreduce_seconds
    from harness.advise.stages import split_seconds
    from strategies import Budget, build_strategy

    allreduce = ring_allreduce_seconds(2e9, 100.0)
    assert allreduce(1) == 0.0 and allreduce(4) == pytest.approx(2 * 3 / 4 * 2e9 / 100e9)
    calibration = stored_calibration()
    lengths = np.random.default_rng(3).lognormal(5, 0.8, 500).astype(np.int64).clip(10, 1000)
    plain, = predict(lengths, ["bucketed"], calibration, world_size=4)
    with_allreduce, = predict(lengths, ["bucketed"], calibration, world_size=4, allreduce=allreduce)
    assert with_allreduce.epoch_seconds - plain.epoch_seconds == pytest.approx(plain.steps * allreduce(4), rel=1e-9)
    target, drafter = calibration.stage_costs()
    for row in with_allreduce.placement["splits"]:  # each split all-reduces over its own drafter ranks
        ranks = row["drafter_ranks"]
        plan = build_strategy("bucketed").plan(lengths, Budget(1024), seed=0, epoch=0, world_size=ranks,
                                               grad_accum=4 // ranks, oversize="drop")
        expected = split_seconds(plan, target, drafter, row["target_ranks"], calibration.step_s + allreduce(ranks))
        assert row["tokens_per_second"] == pytest.approx(expected.tokens_per_second, rel=1e-9)


def test_the_allreduce_counts_the_drafters_trainable_parameters_and_the_note_says_what_was_assumed():
    import argparse

    import torch

    from harness.train.config import compose_run_config, run_config_from_dict
    from harness.train.rank_models import DrafterModel

    config = compose_run_config(["logger=none"])
    model = DrafterModel(models_config(run_config_from_dict(config)), torch.device("cpu"))  # the real one, built as a run builds it
    assert cal.drafter_gradient_bytes(config) == 4 * sum(p.numel() for p in model.parameters)
    reference = compose_run_config(["experiment=reference_8gpu", "target.num_hidden_layers=4", "logger=none"])
    size = cal.drafter_gradient_bytes(reference)
    readme = (Path(__file__).resolve().parents[3] / "docs" / "commands" / "batchlab-advise.md").read_text()
    assert f"({size / 1e9:.2f} GB for `reference_8gpu`'s drafter)" in " ".join(readme.split())  # the docs' number
    args = argparse.Namespace(device="cuda", world_size=8, allreduce_gbps=None)
    left_out, note = advice.gradient_allreduce(reference, args)
    assert left_out(8) == 0.0 and f"({size / 1e9:,.2f} GB of fp32 gradients a step) is not in these numbers" in note
    args.allreduce_gbps = 400.0
    added, note = advice.gradient_allreduce(reference, args)
    assert added(8) == pytest.approx(2 * 7 / 8 * size / 400e9)
    assert f"{1e3 * added(8):,.1f} ms on 8 GPUs (assumed, not measured; at most" in note
    args.device = "cpu"  # measured inside the CPU ranks' step: nothing added, nothing to say
    assert advice.gradient_allreduce(reference, args)[1] == ""


def test_a_cached_calibration_is_read_where_measuring_it_would_not_fit(tmp_path, capsys, monkeypatch):
    """The memory check guards what a calibration would allocate: a cached one allocates nothing."""
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("\n".join(["100", "200", "500"]))
    monkeypatch.setattr(cal, "available_bytes", lambda device: 1)
    monkeypatch.setattr(cal, "calibrate", lambda *a, **k: (stored_calibration(), False))
    args = ["--lengths", str(lengths), "--max-tokens", "1024", "--world-size", "2", "--cache-dir", str(tmp_path)]
    monkeypatch.setattr(cal, "is_cached", lambda *a, **k: True)
    assert advise_cli.main(args) == 0 and "is the fastest strategy" in capsys.readouterr().out
    assert advise_cli.main([*args, "--recalibrate"]) == 2  # measuring again would allocate: refused
    assert "more than the 0.0 GiB free on cpu" in capsys.readouterr().err
    monkeypatch.setattr(cal, "is_cached", lambda *a, **k: False)
    assert advise_cli.main(args) == 2


def test_on_cpu_the_command_measures_the_link_and_simulates_the_splits(tmp_path, capsys, monkeypatch, stored_link):
    """Two CPU ranks: the link is measured (here: stored) once, both placements are simulated with it, and the
    table says so; one rank needs no link."""
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("\n".join(str(n) for n in np.random.default_rng(3).integers(40, 900, 300)))
    monkeypatch.setattr(cal, "calibrate", lambda *a, **k: (stored_calibration(), False))
    args = ["--lengths", str(lengths), "--max-tokens", "1024", "--cache-dir", str(tmp_path)]
    assert advise_cli.main([*args, "--world-size", "1"]) == 0 and stored_link == []
    capsys.readouterr()
    assert advise_cli.main([*args, "--world-size", "2", "--json"]) == 0
    assert len(stored_link) == 1
    result = json.loads(capsys.readouterr().out)
    placement = result["predictions"][0]["placement"]
    assert placement["simulated"] is True and [r["split"] for r in placement["splits"]] == ["1+1"]
    # the link's costs and its protocol's waits only slow a split down against the stage bound
    bounded = predict(np.loadtxt(lengths).astype(np.int64), [result["predictions"][0]["strategy"]],
                      stored_calibration(), world_size=2)[0].placement
    assert placement["splits"][0]["tokens_per_second"] < bounded["splits"][0]["tokens_per_second"]
    assert advise_cli.main([*args, "--world-size", "2"]) == 0
    assert "simulated: the link's protocol and measured costs" in capsys.readouterr().out


def test_conversations_are_counted_by_the_tokenizer_and_calibrated_at_its_vocabulary(tmp_path, capsys, monkeypatch,
                                                                                     batchlab_cache):
    """--lengths FILE --tokenizer DIR: the conversations counted as a training run tokenizes them (the same cache),
    bad rows reported in one line or dropped (--bad-rows drop), and the random-weight target calibrated at the
    tokenizer's vocabulary, which the calibration records and the command prints."""
    from transformers import AutoTokenizer

    from harness.advise import predict as predict_module
    from harness.data.chat.encode import conversation_lengths
    from harness.data.config import DataConfig
    from harness.data.samples import load_samples

    embedded = load_samples(DataConfig(source="stdlib-chat", max_documents=40, vocab_size=514), progress=False)
    tokenizer = AutoTokenizer.from_pretrained(str(embedded.tokenizer_path), local_files_only=True)
    tokenizer.add_tokens([f"<extra_{i}>" for i in range(1500)])  # above the default data.vocab_size (1,024)
    tokenizer.save_pretrained(tmp_path / "tokenizer")
    rows = [{"conversations": [{"from": "human", "value": f"question {i}"}, {"from": "gpt", "value": "yes " * i}]}
            for i in range(1, 41)] + [{"conversations": []}]
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    seen = {}

    def calibrate(config, cache_dir, progress=True, local_ranks=1):
        seen["config"] = config
        return real_calibrate(config, cache_dir, progress=False, measure=synthetic_measure([]), local_ranks=local_ranks)

    def predict(lengths, *args, **kwargs):
        seen["lengths"] = lengths
        return real_predict(lengths, *args, **kwargs)

    real_calibrate, real_predict = cal.calibrate, predict_module.predict
    monkeypatch.setattr(cal, "calibrate", calibrate)
    monkeypatch.setattr(predict_module, "predict", predict)
    args = ["--lengths", str(path), "--tokenizer", str(tmp_path / "tokenizer"), "--max-tokens", "1024",
            "--cache-dir", str(tmp_path / "cache"), "--strategies", "sorted,packed"]
    assert advise_cli.main(args) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "1 of 41 conversations are bad (1 empty conversation)" in err
    assert advise_cli.main([*args, "--bad-rows", "drop"]) == 0
    captured = capsys.readouterr()
    assert "40 conversations (ShareGPT conversations), 1 bad dropped" in captured.err
    assert seen["config"]["target"]["vocab_size"] == len(tokenizer) > 1024
    assert f"vocabulary {len(tokenizer):,})" in captured.out
    expected, _ = conversation_lengths(path, None, tmp_path / "tokenizer", tmp_path / "cache", bad_rows="drop")
    assert seen["lengths"].tolist() == expected.tolist() and len(expected) == 40


def test_every_column_of_the_advice_table_is_explained_in_the_docs():
    """docs/commands/batchlab-advise.md has a row for each column batchlab-advise prints, naming the prediction's
    field."""
    import dataclasses

    from harness.advise.predict import Prediction

    docs = (Path(__file__).resolve().parents[3] / "docs" / "commands" / "batchlab-advise.md").read_text()
    section = docs[docs.index("**`batchlab-advise`'s tables**"):]
    rows = {line.split("|")[1].strip(): line.split("|")[2].strip() for line in section.splitlines()
            if line.startswith("| ") and line.count("|") == 4}
    fields = {field.name for field in dataclasses.fields(Prediction)}
    for title, field, _ in advise_cli.TABLE_COLUMNS:
        assert field in fields and rows.get(title) == f"`{field}`", (title, rows.get(title))


def test_a_calibration_names_the_vocabulary_it_ran_at_only_for_a_random_weight_target():
    stored = stored_calibration()
    assert stored.vocab_size is None  # an older calibration records nothing
    random_weights = dataclasses_replace(stored, measured_on={"target": {"vocab_size": 49_152}})
    assert random_weights.vocab_size == 49_152
    pretrained = dataclasses_replace(stored, measured_on={"target": {"vocab_size": 1024, "pretrained": "/ckpt"}})
    assert pretrained.vocab_size is None  # the checkpoint's own vocabulary, not the composed config's value
    assert cal.Calibration.from_json({k: v for k, v in stored.to_json().items() if k != "measured_on"}) == stored
