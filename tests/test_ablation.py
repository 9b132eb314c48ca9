"""The step-mode ablation (analysis/ablation.py, experiment=ablation_steps): gaps with known answers, the report's
section, the experiment's configs."""

import json
import math
import shutil

import numpy as np
import pandas as pd
import pytest
from train_support import sweep_params

import analysis_support as support
from analysis.ablation import EQUAL, FIXED, ablated_strategies, ablation_table, has_ablation, step_parts
from analysis.cli import main


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
    from train_support import compose_config

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
