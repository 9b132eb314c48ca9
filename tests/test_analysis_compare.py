"""analysis.compare: the table's numbers equal those recomputed from metrics.jsonl; the statistics and sentences."""

import json
import math

import numpy as np
import pandas as pd
import pytest

import analysis_support as support
from analysis.compare import (
    compare_final,
    comparison_sentences,
    paired_test,
    summary_sentences,
    strategy_table,
    t_quantile,
    t_two_sided_p,
)


@pytest.fixture(scope="session")
def report(tmp_path_factory, batchlab_cache):
    return support.report_dir(tmp_path_factory.mktemp("analysis"))


def _recomputed(sweep_dir):
    """Every table number of every run, straight from the JSON files (independent of analysis/)."""
    records = {}
    for directory in support.run_dirs(sweep_dir):
        steps = support.read_jsonl(directory / "metrics.jsonl")
        summary = json.loads((directory / "summary.json").read_text())
        evals = [s for s in steps if s.get("eval_loss") is not None]
        measured = [s["grad_diversity"] for s in steps if s["grad_stats_measured"] and s["grad_diversity"] is not None]
        lag1 = [s["plan_lag1_acf"] for s in steps if s.get("plan_lag1_acf") is not None]
        recurrence = [s["plan_recurrence"] for s in steps if s.get("plan_recurrence") is not None]
        if any(s.get("plan_step_recurrence") is not None for s in steps):
            recurrence = [s["plan_step_recurrence"] for s in steps if s.get("plan_step_recurrence") is not None]
        real = sum(s["real_tokens"] for s in steps)
        records[(summary["strategy"], summary["seed"])] = {
            "tokens_per_second": real / sum(s["step_time"] for s in steps),
            "padding_pct": 100 * (1 - real / sum(s["computed_slots"] for s in steps)),
            "grad_diversity": float(np.mean(measured)),
            "lag1_acf": float(np.mean(lag1)), "recurrence": float(np.mean(recurrence)),
            "final_eval_loss": evals[-1]["eval_loss"], "final_eval_tau": evals[-1]["eval_tau"], "evals": evals,
        }
    target = max(r["final_eval_loss"] for r in records.values())
    for (strategy, seed), r in records.items():
        r["relative_throughput"] = r["tokens_per_second"] / records[("sorted", seed)]["tokens_per_second"]
        r["tokens_to_loss"] = next(e["tokens_seen"] for e in r.pop("evals") if e["eval_loss"] <= target)
    return records, target


def test_table_equals_numbers_recomputed_from_the_histories(report, tmp_path_factory):
    sweep_dir = support.tiny_sweep(tmp_path_factory.mktemp("unused"))
    records, target = _recomputed(sweep_dir)
    table = pd.read_csv(report / "strategies.csv").set_index("strategy")
    per_run = pd.read_csv(report / "runs.csv")
    assert per_run["target_loss"].iloc[0] == pytest.approx(target)
    assert sorted(table.index) == sorted(support.STRATEGIES)
    for strategy in support.STRATEGIES:
        row = table.loc[strategy]
        assert row["seeds"] == len(support.SEEDS)
        for column in ("tokens_per_second", "relative_throughput", "padding_pct", "grad_diversity", "lag1_acf",
                       "recurrence", "final_eval_loss", "final_eval_tau", "tokens_to_loss"):
            values = [records[(strategy, seed)][column] for seed in support.SEEDS]
            assert row[column] == pytest.approx(np.mean(values), rel=1e-9, abs=1e-12), (strategy, column)
            assert row[f"{column}_sd"] == pytest.approx(np.std(values, ddof=1), rel=1e-7, abs=1e-12), (strategy, column)
    assert table.loc["sorted", "relative_throughput"] == pytest.approx(1.0)
    assert table.loc["packed", "padding_pct"] == pytest.approx(0.0, abs=1e-9)  # packing has no padding
    assert table.loc["sorted", "recurrence"] > table.loc["shuffle", "recurrence"]  # sorted repeats its batches
    # the run summaries agree with the histories where they report the same thing
    for directory in support.run_dirs(sweep_dir):
        summary = json.loads((directory / "summary.json").read_text())
        mine = records[(summary["strategy"], summary["seed"])]
        assert summary["padding_ratio"] * 100 == pytest.approx(mine["padding_pct"], abs=1e-9)
        assert summary["eval_loss"] == pytest.approx(mine["final_eval_loss"])
        for column in ("grad_diversity", "lag1_acf", "recurrence"):  # one definition of the run's averages
            assert summary[column] == pytest.approx(mine[column], rel=1e-12, abs=1e-15), column


def test_student_t_matches_the_tables():
    assert t_two_sided_p(2.776, 4) == pytest.approx(0.05, abs=2e-4)
    assert t_two_sided_p(12.706, 1) == pytest.approx(0.05, abs=2e-4)
    assert t_two_sided_p(0.0, 3) == pytest.approx(1.0)
    assert t_quantile(0.975, 2) == pytest.approx(4.303, abs=1e-3)
    assert t_quantile(0.975, 10) == pytest.approx(2.228, abs=1e-3)
    p, (low, high) = paired_test(np.array([1.0, 2.0, 3.0]))  # mean 2, sd 1, se 1/sqrt(3), t = 3.464, df 2
    assert p == pytest.approx(0.0742, abs=1e-3)
    assert (low, high) == pytest.approx((2 - 4.303 / math.sqrt(3), 2 + 4.303 / math.sqrt(3)), abs=1e-3)


def _synthetic(losses, taus=None, speeds=None):
    rows = []
    for strategy, values in losses.items():
        for seed, loss in enumerate(values):
            rows.append({"strategy": strategy, "seed": seed, "final_eval_loss": loss,
                         "final_eval_tau": (taus or {}).get(strategy, [1.0] * len(values))[seed],
                         "tokens_per_second": (speeds or {}).get(strategy, 100.0), "padding_pct": 10.0,
                         "grad_diversity": 1.0, "lag1_acf": 0.0, "recurrence": 0.5, "tokens_to_loss": 1000.0})
    frame = pd.DataFrame(rows)
    reference = frame[frame["strategy"] == "sorted"].set_index("seed")["tokens_per_second"]
    frame["relative_throughput"] = frame["tokens_per_second"] / frame["seed"].map(reference)
    frame.attrs["reference"] = "sorted"
    return frame


def test_a_clear_difference_is_significant_and_a_tie_is_not():
    rng = np.random.default_rng(0)
    base = 2.0 + rng.normal(0, 0.05, 5)
    per_run = _synthetic({"packed": base, "shuffle": base + rng.normal(0, 0.01, 5), "sorted": base + 0.2})
    comparison = compare_final(per_run, "final_eval_loss")
    assert comparison.enough_seeds
    pairs = {p.strategy: p for p in comparison.pairs}
    best = comparison.best
    assert best in ("packed", "shuffle")
    assert pairs["sorted"].significant and pairs["sorted"].worse
    assert pairs["sorted"].mean_diff == pytest.approx(0.2, abs=0.02)
    assert pairs["sorted"].ci[0] > 0 and pairs["sorted"].bootstrap_ci[0] > 0
    other = "shuffle" if best == "packed" else "packed"
    assert not pairs[other].significant
    text = " ".join(comparison_sentences(comparison))
    assert "indistinguishable" in text and f"sorted is worse than {best}" in text and "p = " in text


def test_fewer_than_three_seeds_ranks_nothing():
    per_run = _synthetic({"packed": [2.0, 2.01], "sorted": [2.5, 2.6]}, speeds={"packed": 150.0})
    loss = compare_final(per_run, "final_eval_loss")
    tau = compare_final(per_run, "final_eval_tau")
    assert not loss.enough_seeds and not any(p.tested for p in loss.pairs)
    sentence = comparison_sentences(loss)[0]
    assert "no ranking" in sentence and "significant" in sentence and "2 paired seeds" in sentence
    table = strategy_table(per_run)
    table.attrs["reference"] = "sorted"
    lines = summary_sentences(table, loss, tau)
    assert lines[0].startswith("packed has the highest throughput") and "1.50× sorted" in lines[0]
    assert "too few seeds" in lines[1]


def test_disaggregated_runs_show_which_stage_bounds_them(report, tmp_path):
    """The stage columns come from the topology metrics of disaggregated runs, and stay out of colocated tables."""
    from analysis.compare import format_table, run_metrics
    from analysis.load import load_sweeps

    sweep_dir = support.tiny_sweep(tmp_path / "unused")
    colocated = format_table(strategy_table(run_metrics(load_sweeps([sweep_dir]))))
    assert "target busy %" not in colocated.columns and "drafter idle %" not in colocated.columns
    copy = support.copy_sweep(sweep_dir, tmp_path / "copy", runs={"strategy=packed,seed=0", "strategy=packed,seed=1"})
    expected = {}
    for seed, directory in enumerate(support.run_dirs(copy)):
        steps = support.read_jsonl(directory / "metrics.jsonl")
        busy, idle = [], []
        for i, step in enumerate(steps):
            step["topology_target_busy_fraction"] = [0.5 + 0.01 * i, None if i % 3 == 0 else 0.9 - 0.1 * seed]
            step["topology_drafter_idle_fraction"] = 0.02 * seed + 0.001 * i
            busy += [v for v in step["topology_target_busy_fraction"] if v is not None]
            idle.append(step["topology_drafter_idle_fraction"])
        (directory / "metrics.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
        expected[json.loads((directory / "summary.json").read_text())["seed"]] = (100 * np.mean(busy), 100 * np.mean(idle))
    per_run = run_metrics(load_sweeps([copy])).set_index("seed")
    for seed, (busy, idle) in expected.items():
        assert per_run.loc[seed, "target_busy_pct"] == pytest.approx(busy, rel=1e-12)
        assert per_run.loc[seed, "drafter_idle_pct"] == pytest.approx(idle, rel=1e-12)
    table = format_table(strategy_table(per_run.reset_index()))
    assert table.loc[0, "target busy %"].startswith(f"{np.mean([b for b, _ in expected.values()]):.0f}")
