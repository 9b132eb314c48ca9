"""The step-mode ablation (analysis/ablation.py, experiment=ablation_steps): gaps with known answers, the report's
section, the experiment's configs."""

import json
import math
import shutil

import numpy as np
import pandas as pd
import pytest
from support.train import sweep_params

from support import analysis as support
from analysis.ablation import (
    EQUAL,
    FIXED,
    NORMALISER,
    ablated_strategies,
    ablation_table,
    factor_sentences,
    has_ablation,
    step_parts,
)
from harness.cli.report import main
from analysis.load import EPOCH_NORMALISER, STEP_NORMALISER


def _frame(gaps_fixed, gaps_equal, steps=None):
    """packed and shuffle in both modes, 3 seeds: shuffle's held-out loss = packed's + the given gap per seed."""
    rows = []
    for seed in range(3):
        for mode, gaps in ((FIXED, gaps_fixed), (EQUAL, gaps_equal)):
            base = 2.0 + 0.1 * seed + (0.05 if mode == FIXED else 0.0)
            for strategy, loss in (("packed", base), ("shuffle", base + gaps[seed])):
                rows.append({"strategy_name": strategy, "step_mode": mode, "seed": seed, "final_eval_loss": loss,
                             "final_eval_tau_real": 3.0 - loss, "clipped_pct": 2.0,
                             "steps": (steps or {}).get((strategy, mode), 196)})
    return pd.DataFrame(rows)


def test_the_step_mode_part_is_the_difference_of_the_two_gaps_paired_by_seed():
    per_run = _frame(gaps_fixed=[-0.30, -0.20, -0.25], gaps_equal=[0.01, -0.01, 0.03])
    assert has_ablation(per_run) and ablated_strategies(per_run) == ["packed", "shuffle"]
    part = next(p for p in step_parts(per_run) if p.metric == "final_eval_loss")
    assert (part.a, part.b, part.seeds) == ("packed", "shuffle", [0, 1, 2])
    # a − b: packed − shuffle = −gap
    assert part.fixed.mean == pytest.approx(0.25) and part.equal.mean == pytest.approx(-0.01)
    assert part.mean == pytest.approx(0.26)
    diffs = np.array([0.30 + 0.01, 0.20 - 0.01, 0.25 + 0.03])  # per seed: gap_fixed − gap_equal
    half = 4.302652729911275 * diffs.std(ddof=1) / math.sqrt(3)  # t(0.975, 2 df)
    assert part.ci == pytest.approx((diffs.mean() - half, diffs.mean() + half), rel=1e-6)
    tau = next(p for p in step_parts(per_run) if p.metric == "final_eval_tau_real")
    assert tau.mean == pytest.approx(-0.26)  # τ real = 3 − loss here


def test_no_step_mode_part_when_only_the_composition_differs():
    per_run = _frame(gaps_fixed=[0.1, 0.12, 0.08], gaps_equal=[0.1, 0.12, 0.08])
    part = next(p for p in step_parts(per_run) if p.metric == "final_eval_loss")
    assert part.mean == pytest.approx(0.0, abs=1e-12) and part.ci == pytest.approx((0.0, 0.0), abs=1e-12)
    assert part.fixed.mean == pytest.approx(-0.1)


def test_no_ablation_without_both_modes_for_two_strategies():
    per_run = _frame([0.1] * 3, [0.1] * 3)
    assert not has_ablation(per_run[per_run["step_mode"] == EQUAL])
    assert not has_ablation(per_run[(per_run["strategy_name"] == "packed") | (per_run["step_mode"] == EQUAL)])
    table = ablation_table(per_run)
    assert table[["strategy", "step mode"]].values.tolist() == [
        ["packed", FIXED], ["packed", EQUAL], ["shuffle", FIXED], ["shuffle", EQUAL]]
    assert table["clipped"].tolist() == ["2.0% ± 0.0%"] * 4


def test_the_ablation_experiment_sweeps_both_modes_and_keeps_the_main_jobs_settings():
    params = sweep_params(["experiment=ablation_steps"])
    assert params["step_mode"] == "equal_tokens,fixed_accumulation" and params["strategy"] == "packed,shuffle"
    assert list(params)[0] == "seed"  # the arms interleaved within each seed
    from support.train import compose_config

    main_job = compose_config(["experiment=strategies", "strategy=packed"])
    for mode, (step_tokens, grad_accum) in {"equal_tokens": (4096, 1), "fixed_accumulation": (None, 2)}.items():
        config = compose_config(["experiment=ablation_steps", "strategy=packed", f"step_mode={mode}"])
        assert (config["trainer"]["step_tokens"], config["trainer"]["grad_accum"]) == (step_tokens, grad_accum)
        for key in ("data", "target", "drafter", "optim", "eval", "checkpoint", "grad_stats", "loader"):
            assert config[key] == main_job[key], key
        assert {k: v for k, v in config["trainer"].items() if k not in ("step_tokens", "grad_accum")} == {
            k: v for k, v in main_job["trainer"].items() if k not in ("step_tokens", "grad_accum")}


def _as_equal_steps(source, destination, loss_shift):
    """A copy of a run relabelled as an equal-token-steps run, its held-out losses shifted by ``loss_shift``."""
    shutil.copytree(source, destination, ignore=shutil.ignore_patterns("checkpoints", "wandb", "consumed"))
    config = json.loads((destination / "config.json").read_text())
    config["trainer"].update(step_tokens=768, grad_accum=1)
    (destination / "config.json").write_text(json.dumps(config))
    summary = json.loads((destination / "summary.json").read_text())
    summary.update(step_tokens=768, grad_accum=1)
    (destination / "summary.json").write_text(json.dumps(summary))
    records = support.read_jsonl(destination / "metrics.jsonl")
    for record in records:
        if record.get("eval_loss") is not None:
            record["eval_loss"] += loss_shift
    (destination / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_a_sweep_in_both_modes_gets_the_ablation_section(tmp_path_factory, batchlab_cache, tmp_path):
    sweep = support.tiny_sweep(tmp_path_factory.mktemp("analysis"))
    both = tmp_path / "both"
    names = {support.run_dir(sweep, s, seed).name for s in ("packed", "shuffle") for seed in support.SEEDS}
    support.copy_sweep(sweep, both / "fixed", runs=names)
    for name in names:  # the equal-step copies: shuffle's held-out loss 0.2 lower, packed's unchanged
        _as_equal_steps(both / "fixed" / name, both / "equal" / name, -0.2 if "shuffle" in name else 0.0)
    out = tmp_path / "report"
    assert main([str(both), "--out", str(out)]) == 0
    runs = pd.read_csv(out / "runs.csv")
    assert set(runs["strategy"]) == {f"{s} ({m})" for s in ("packed", "shuffle") for m in (FIXED, EQUAL)}
    ablation = pd.read_csv(out / "ablation.csv").set_index("metric")
    loss = ablation.loc["final_eval_loss"]
    # packed − shuffle grows by 0.2 at equal steps: the step mode's part is −0.2 on every seed
    assert loss["gap_equal_steps"] - loss["gap_fixed_accumulation"] == pytest.approx(0.2)
    assert loss["step_mode_part"] == pytest.approx(-0.2) and loss["step_mode_part_low"] == pytest.approx(-0.2)
    assert ablation.loc["final_eval_tau_real", "step_mode_part"] == pytest.approx(0.0, abs=1e-12)
    markdown = (out / "report.md").read_text()
    assert "## Ablation: optimizer steps or batch composition?" in markdown
    assert "the step count accounts for -0.200 [-0.200, -0.200]" in markdown  # a − b = packed − shuffle
    assert (out / "figures" / "ablation_steps.png").stat().st_size > 10_000
    assert 'id="fig-ablation_steps"' in (out / "report.html").read_text()
    # a sweep in one mode has no such section
    assert main([str(both / "fixed"), "--out", str(tmp_path / "one")]) == 0
    assert "Ablation" not in (tmp_path / "one" / "report.md").read_text()
    assert not (tmp_path / "one" / "ablation.csv").exists()


def test_the_results_ablation_block_is_the_reports_own_output():
    """benchmarks/RESULTS.md's ablation numbers are analysis.ablation's, re-rendered from the stored runs.csv."""
    from analysis.ablation import ablation_markdown
    from analysis.summary import read_runs_csv

    results = (support.REPO / "benchmarks" / "RESULTS.md").read_text()
    start, end = "<!-- ablation of make ablation (docs/demo/ablation_runs.csv) -->\n", "<!-- end of ablation -->"
    assert start in results and end in results, "the RESULTS.md ablation block markers are missing"
    block = results.split(start, 1)[1].split(end, 1)[0]
    per_run = read_runs_csv(support.REPO / "docs" / "demo" / "ablation_runs.csv")
    assert has_ablation(per_run)
    assert block.strip() == ablation_markdown(per_run).strip()


def _normaliser_frame(gaps_step, gaps_epoch, clipped=(3.0, 40.0)):
    """sorted and packed under both normalisers, 3 seeds: sorted's held-out loss = packed's + the gap per seed."""
    rows = []
    for seed in range(3):
        for arm, gaps, clip in ((STEP_NORMALISER, gaps_step, clipped[0]), (EPOCH_NORMALISER, gaps_epoch, clipped[1])):
            base = 1.3 + 0.05 * seed
            for strategy, loss in (("sorted", base + gaps[seed]), ("packed", base)):
                rows.append({"strategy_name": strategy, "loss_normaliser": arm, "step_mode": EQUAL, "seed": seed,
                             "final_eval_loss": loss, "final_eval_tau_real": 3.0 - loss, "clipped_pct": clip,
                             "steps": 216})
    return pd.DataFrame(rows)


def test_the_reweighting_part_is_the_gap_with_each_steps_weight_minus_the_gap_with_one_constant():
    """Sorted trails packed by 0.9 nats with the step's Σw and by 0.3 with one constant: the reweighting is 0.6."""
    per_run = _normaliser_frame(gaps_step=[0.8, 1.0, 0.9], gaps_epoch=[0.25, 0.35, 0.3])
    assert has_ablation(per_run, NORMALISER) and not has_ablation(per_run)  # one step mode: no step-mode section
    part = next(p for p in step_parts(per_run, NORMALISER) if p.metric == "final_eval_loss")
    assert (part.a, part.b) == ("sorted", "packed")  # report order
    assert part.fixed.mean == pytest.approx(0.9) and part.equal.mean == pytest.approx(0.3)
    diffs = np.array([0.8 - 0.25, 1.0 - 0.35, 0.9 - 0.3])
    half = 4.302652729911275 * diffs.std(ddof=1) / math.sqrt(3)  # t(0.975, 2 df), by hand
    assert part.mean == pytest.approx(0.6) and part.ci == pytest.approx((0.6 - half, 0.6 + half), rel=1e-6)
    sentences = factor_sentences(per_run, NORMALISER)
    assert sentences[0].startswith("held-out loss, sorted − packed over seeds 0, 1, 2: +0.900 [")
    assert f"the per-step reweighting accounts for +0.600 [{0.6 - half:+.3f}, {0.6 + half:+.3f}]" in sentences[0]
    assert "sorted 3.0% with the step's Σw, 40.0% with the constant" in sentences[2]
    table = ablation_table(per_run, NORMALISER)
    assert table[["strategy", "loss normaliser"]].values.tolist() == [
        ["sorted", STEP_NORMALISER], ["sorted", EPOCH_NORMALISER], ["packed", STEP_NORMALISER],
        ["packed", EPOCH_NORMALISER]]


def test_the_mechanism_experiment_sweeps_both_normalisers_and_keeps_the_main_jobs_settings():
    params = sweep_params(["experiment=ablation_normaliser"])
    assert params["optim.loss_normaliser"] == "step,epoch" and params["strategy"] == "sorted,bucketed,packed"
    assert list(params)[0] == "seed"
    from support.train import compose_config

    main_job = compose_config(["experiment=strategies", "strategy=sorted"])
    config = compose_config(["experiment=ablation_normaliser", "strategy=sorted", "optim.loss_normaliser=epoch"])
    assert config["optim"] == {**main_job["optim"], "loss_normaliser": "epoch"}
    for key in ("data", "target", "drafter", "trainer", "eval", "checkpoint", "grad_stats", "loader"):
        assert config[key] == main_job[key], key


def test_the_results_mechanism_block_is_the_reports_own_output():
    """benchmarks/RESULTS.md's mechanism numbers are analysis.ablation's, re-rendered from the stored runs.csv."""
    from analysis.ablation import normaliser_markdown
    from analysis.summary import read_runs_csv

    results = (support.REPO / "benchmarks" / "RESULTS.md").read_text()
    start = "<!-- mechanism of make ablation-normaliser (docs/demo/ablation_normaliser_runs.csv) -->\n"
    end = "<!-- end of mechanism -->"
    assert start in results and end in results, "the RESULTS.md mechanism block markers are missing"
    block = results.split(start, 1)[1].split(end, 1)[0]
    per_run = read_runs_csv(support.REPO / "docs" / "demo" / "ablation_normaliser_runs.csv")
    assert has_ablation(per_run, NORMALISER)
    assert block.strip() == normaliser_markdown(per_run).strip()
