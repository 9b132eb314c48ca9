"""analysis.compare and analysis.stats: the table's numbers equal those recomputed from metrics.jsonl; Student's t,
Holm–Bonferroni over every pair of strategies, the disturbed-timing rule; the sentences."""

import json
import math

import numpy as np
import pandas as pd
import pytest

from support import analysis as support
from analysis.compare import comparison_sentences, format_table, strategy_table, summary_sentences, tokens_to_reach
from analysis.stats import (
    STALL_MAX,
    STEP_SPREAD_MAX,
    TIMING_CV_MAX,
    compare_pairs,
    comparisons_frame,
    holm,
    paired_test,
    step_rate_checks,
    t_quantile,
    t_two_sided_p,
    timing_check,
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
        sample = [1 + s["grad_noise_scale"] for s in steps if s["grad_stats_measured"] and s["grad_noise_scale"] is not None]
        lag1 = [s["plan_lag1_acf"] for s in steps if s.get("plan_lag1_acf") is not None]
        mix = [s["plan_length_mix_excess"] for s in steps if s.get("plan_length_mix_excess") is not None]
        recurrence = [s["plan_recurrence"] for s in steps if s.get("plan_recurrence") is not None]
        if any(s.get("plan_step_recurrence") is not None for s in steps):
            recurrence = [s["plan_step_recurrence"] for s in steps if s.get("plan_step_recurrence") is not None]
        real = sum(s["real_tokens"] for s in steps)
        records[(summary["strategy"], summary["seed"])] = {
            "tokens_per_second": real / sum(s["step_time"] for s in steps),
            "padding_pct": 100 * (1 - real / sum(s["computed_slots"] for s in steps)),
            "grad_diversity": float(np.mean(measured)), "grad_sample_diversity": float(np.mean(sample)),
            "lag1_acf": float(np.mean(lag1)), "recurrence": float(np.mean(recurrence)),
            "length_mix_excess": float(np.mean(mix)),
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
        for column in ("tokens_per_second", "relative_throughput", "padding_pct", "length_mix_excess", "lag1_acf",
                       "recurrence", "final_eval_loss", "final_eval_tau", "tokens_to_loss"):
            values = [records[(strategy, seed)][column] for seed in support.SEEDS]
            assert row[column] == pytest.approx(np.mean(values), rel=1e-9, abs=1e-12), (strategy, column)
            assert row[f"{column}_sd"] == pytest.approx(np.std(values, ddof=1), rel=1e-7, abs=1e-12), (strategy, column)
    assert table.loc["sorted", "relative_throughput"] == pytest.approx(1.0)
    assert table.loc["packed", "padding_pct"] == pytest.approx(0.0, abs=1e-9)  # packing has no padding
    assert table.loc["sorted", "recurrence"] > table.loc["shuffle", "recurrence"]  # sorted repeats its batches
    assert table.loc["sorted", "length_mix_excess"] > table.loc["shuffle", "length_mix_excess"]  # one length a step
    # the run summaries agree with the histories where they report the same thing
    for directory in support.run_dirs(sweep_dir):
        summary = json.loads((directory / "summary.json").read_text())
        mine = records[(summary["strategy"], summary["seed"])]
        assert summary["padding_ratio"] * 100 == pytest.approx(mine["padding_pct"], abs=1e-9)
        assert summary["eval_loss"] == pytest.approx(mine["final_eval_loss"])
        for column in ("grad_diversity", "grad_sample_diversity", "lag1_acf", "recurrence",
                       "length_mix_excess"):  # one definition
            assert summary[column] == pytest.approx(mine[column], rel=1e-12, abs=1e-15), column


def test_tokens_to_reach_is_the_first_evaluation_at_or_below_the_target():
    history = pd.DataFrame({"step": [4, 1, 2, 3, 5], "tokens_seen": [400, 100, 200, 300, 500],
                            "eval_loss": [1.0, np.nan, 2.0, 1.5, 0.9]})  # out of order; step 1 not evaluated
    assert tokens_to_reach(history, 1.5) == 300  # reached at step 3, although steps 4 and 5 are lower
    assert tokens_to_reach(history, 2.0) == 200
    assert tokens_to_reach(history, 0.9) == 500  # equal counts as reached
    assert math.isnan(tokens_to_reach(history, 0.5))  # never
    assert math.isnan(tokens_to_reach(history, math.nan))
    assert math.isnan(tokens_to_reach(history.drop(columns="eval_loss"), 1.0))


def test_student_t_matches_the_tables():
    assert t_two_sided_p(2.776, 4) == pytest.approx(0.05, abs=2e-4)
    assert t_two_sided_p(12.706, 1) == pytest.approx(0.05, abs=2e-4)
    assert t_two_sided_p(0.0, 3) == pytest.approx(1.0)
    assert t_quantile(0.975, 2) == pytest.approx(4.303, abs=1e-3)
    assert t_quantile(0.975, 10) == pytest.approx(2.228, abs=1e-3)
    p, (low, high) = paired_test(np.array([1.0, 2.0, 3.0]))  # mean 2, sd 1, se 1/sqrt(3), t = 3.464, df 2
    assert p == pytest.approx(0.0742, abs=1e-3)
    assert (low, high) == pytest.approx((2 - 4.303 / math.sqrt(3), 2 + 4.303 / math.sqrt(3)), abs=1e-3)


def test_paired_t_matches_closed_forms():
    """Student's t has closed forms for 1, 2 and 4 degrees of freedom: the paired test's p and interval match them."""
    def p_df1(t):
        return 1 - 2 / math.pi * math.atan(abs(t))

    def p_df2(t):
        return 1 - abs(t) / math.sqrt(2 + t * t)

    def p_df4(t):
        x = t * t / (4 + t * t)
        return 1 - abs(t) / math.sqrt(4 + t * t) * (1 + (1 - x) / 2)

    for t in (0.3, 1.0, 2.5, 7.0):
        assert t_two_sided_p(t, 1) == pytest.approx(p_df1(t), abs=1e-10)
        assert t_two_sided_p(t, 2) == pytest.approx(p_df2(t), abs=1e-10)
        assert t_two_sided_p(t, 4) == pytest.approx(p_df4(t), abs=1e-10)
    # diffs 0.1 .. 0.5 (shuffled): mean 0.3, s.d. sqrt(0.025), t = 0.3 / (s.d. / sqrt 5) = 4.2426, df 4
    diffs = np.array([0.1, 0.3, 0.2, 0.4, 0.5])
    p, (low, high) = paired_test(diffs)
    t = 0.3 / (math.sqrt(0.025) / math.sqrt(5))
    assert p == pytest.approx(p_df4(t), abs=1e-10)  # 0.0132...
    half = 2.776445 * math.sqrt(0.025) / math.sqrt(5)  # t_0.975,4 = 2.776445 (tables)
    assert (low, high) == pytest.approx((0.3 - half, 0.3 + half), abs=1e-6)
    assert paired_test(np.array([0.5, 0.5, 0.5]))[0] == 0.0 and paired_test(np.zeros(3))[0] == 1.0


def test_holm_on_a_hand_computed_example():
    """p = 0.01, 0.04, 0.03, 0.005 at α 0.05: sorted 0.005 ≤ 0.05/4, 0.01 ≤ 0.05/3, then 0.03 > 0.05/2 stops it:
    0.04 is not rejected although it is below its own threshold 0.05/1."""
    thresholds, adjusted, reject = holm([0.01, 0.04, 0.03, 0.005], alpha=0.05)
    assert reject == [True, False, False, True]
    assert thresholds == pytest.approx([0.05 / 3, 0.05 / 1, 0.05 / 2, 0.05 / 4])
    assert adjusted == pytest.approx([0.03, 0.06, 0.06, 0.02])  # max over ranks of (m − j + 1) p_(j), capped at 1
    assert holm([0.5, 0.9], alpha=0.05)[1] == pytest.approx([1.0, 1.0])
    assert holm([], alpha=0.05) == ([], [], [])


def _synthetic(losses, taus=None, speeds=None, spreads=None, stalls=None):
    rows = []
    for strategy, values in losses.items():
        for seed, loss in enumerate(values):
            speed = (speeds or {}).get(strategy, 100.0)
            rows.append({"strategy": strategy, "seed": seed, "final_eval_loss": loss,
                         "final_eval_tau": (taus or {}).get(strategy, [1.0] * len(values))[seed],
                         "tokens_per_second": speed[seed] if isinstance(speed, list) else speed, "padding_pct": 10.0,
                         "steps": 20, "grad_diversity": 1.0, "lag1_acf": 0.0, "recurrence": 0.5,
                         "recurrence_kind": "step", "tokens_to_loss": 1000.0,
                         "step_slot_rate_spread": (spreads or {}).get((strategy, seed), 1.3),
                         "step_stall_factor": (stalls or {}).get((strategy, seed), 1.01)})
    frame = pd.DataFrame(rows)
    reference = frame[frame["strategy"] == "sorted"].set_index("seed")["tokens_per_second"]
    frame["relative_throughput"] = frame["tokens_per_second"] / frame["seed"].map(reference)
    frame.attrs["reference"] = "sorted"
    return frame


def test_a_clear_difference_survives_holm_and_a_tie_does_not():
    rng = np.random.default_rng(0)
    base = 2.0 + rng.normal(0, 0.05, 5)
    per_run = _synthetic({"sorted": base + 0.2 + rng.normal(0, 0.005, 5), "packed": base,
                          "shuffle": base + rng.normal(0, 0.01, 5)}, speeds={"packed": [100, 101, 99, 100, 100.5]})
    timing = timing_check(per_run)
    assert not timing.flagged
    tests = compare_pairs(per_run, timing=timing)
    # 3 pairs × 3 metrics the frame has (held-out loss, τ, tokens/s; no τ real), all tested, one family
    assert len(tests) == 9 and all(t.tested and len(t.seeds) == 5 for t in tests)
    pairs = {(t.metric, t.a, t.b): t for t in tests}
    clear = pairs[("final_eval_loss", "sorted", "packed")]  # report order: sorted before packed
    assert clear.mean_diff == pytest.approx(0.2, abs=0.01) and clear.ci[0] > 0
    assert clear.survives and clear.p_holm <= 0.05 and clear.p_holm >= clear.p_value
    tie = pairs[("final_eval_loss", "packed", "shuffle")]
    assert not tie.survives and tie.p_value > 0.05
    assert [t for t in tests if t.survives] == [clear, pairs[("final_eval_loss", "sorted", "shuffle")]]
    m = 9  # Holm's thresholds run over the whole family
    assert min(t.threshold for t in tests) == pytest.approx(0.05 / m)
    frame = comparisons_frame(tests)
    assert list(frame.columns) == ["metric", "strategy_a", "strategy_b", "seeds", "mean_difference", "sd_difference",
                                   "ci_low", "ci_high", "p_value", "holm_threshold", "p_holm", "survives", "tested",
                                   "not_tested_because"]
    assert len(frame) == 9 and frame["survives"].sum() == 2
    for (_, row), test in zip(frame.iterrows(), tests):  # every row is its own test's numbers, under its own name
        assert (row["metric"], row["strategy_a"], row["strategy_b"], row["seeds"]) == (test.metric, test.a, test.b, 5)
        assert (row["mean_difference"], row["sd_difference"], row["ci_low"], row["ci_high"]) == (
            test.mean_diff, test.sd_diff, test.ci[0], test.ci[1])
        assert (row["p_value"], row["holm_threshold"], row["p_holm"], row["survives"], row["tested"]) == (
            test.p_value, test.threshold, test.p_holm, test.survives, test.tested)
    assert (frame["p_holm"] > frame["p_value"]).any()  # the adjusted column is not the raw one
    table = strategy_table(per_run)
    lines = summary_sentences(table, tests, timing)
    assert lines[0].startswith("packed has the highest throughput") and "1.00× sorted" in lines[0]
    assert (f"held-out loss: packed lower than sorted by {abs(clear.mean_diff):.3f} (95% t interval "
            f"{clear.ci[0]:.3f}–{clear.ci[1]:.3f}, Holm-adjusted p ") in lines[1]
    assert "shuffle lower than packed" not in lines[1] and "packed lower than shuffle" not in lines[1]
    assert "p = <" not in lines[1] and ("Holm-adjusted p < 0.001" in lines[1]) == (clear.p_holm < 0.001)
    text = " ".join(comparison_sentences(tests, timing))
    assert "9 two-sided paired t-tests, Holm–Bonferroni over all 9" in text and "2 differences survive" in text


def test_an_uncorrected_p_below_005_does_not_survive_the_family():
    """One pair at p ≈ 0.03 among 20 tests: significant alone, not after Holm (0.03 > 0.05/20)."""
    diffs = np.array([0.02, 0.05, 0.035, 0.01])
    p, _ = paired_test(diffs)
    assert 0.01 < p < 0.05
    losses = {"sorted": [2.0, 2.1, 2.2, 2.3], "shuffle": list(np.array([2.0, 2.1, 2.2, 2.3]) + diffs)}
    for name in ("length_grouped", "bucketed", "packed"):
        losses[name] = [2.0, 2.1, 2.2, 2.3]
    tests = compare_pairs(_synthetic(losses), metrics=["final_eval_loss", "final_eval_tau"])
    assert len(tests) == 20
    pair = next(t for t in tests if t.metric == "final_eval_loss" and t.b == "shuffle" and t.a == "sorted")
    assert pair.p_value == pytest.approx(p) and not pair.survives and not any(t.survives for t in tests)


def test_fewer_than_three_seeds_tests_nothing():
    per_run = _synthetic({"packed": [2.0, 2.01], "sorted": [2.5, 2.6]}, speeds={"packed": 150.0})
    timing = timing_check(per_run)
    tests = compare_pairs(per_run, timing=timing)
    assert tests and not any(t.tested or t.survives for t in tests)
    assert all(t.note == "2 paired seeds (fewer than 3)" for t in tests)
    table = strategy_table(per_run)
    table.attrs["reference"] = "sorted"
    lines = summary_sentences(table, tests, timing)
    assert lines[0].startswith("packed has the highest throughput") and "1.50× sorted" in lines[0]
    assert "2 paired seeds (fewer than 3) nothing is tested" in lines[1] and "no ranking is significant" in lines[1]
    stats = comparison_sentences(tests, timing)
    assert stats[0].startswith("Nothing is tested") and "Not tested: 3 pairs" in stats[1]


def test_disturbed_timings_quote_no_ratio_and_skip_the_throughput_tests():
    losses = {s: [2.0, 2.1, 2.2] for s in ("sorted", "bucketed", "packed")}
    quiet = _synthetic(losses, speeds={"sorted": [100.0, 104.0, 97.0], "packed": [130.0, 128.0, 133.0]})
    assert not timing_check(quiet).flagged
    assert "× sorted" in summary_sentences(strategy_table(quiet), compare_pairs(quiet), timing_check(quiet))[0]
    # across seeds: sorted 11,828 ± 13,686 tok/s (the loaded fresh-clone demo), CV 1.16 > TIMING_CV_MAX
    noisy = _synthetic(losses, speeds={"sorted": [2500.0, 5400.0, 27600.0], "packed": [130.0, 128.0, 133.0]})
    timing = timing_check(noisy)
    assert timing.disturbed == ["sorted"] and timing.cv["sorted"] > TIMING_CV_MAX
    # within a run: one packed run whose steps' rate varied more than STEP_SPREAD_MAX
    unsteady = _synthetic(losses, speeds={"sorted": [100.0, 104.0, 97.0]}, spreads={("packed", 1): 3.0})
    assert timing_check(unsteady).disturbed == ["packed"] and "seed 1" in timing_check(unsteady).reasons["packed"][0]
    # within a run: a few long stalls (the percentiles stay steady, the run's total time does not)
    stalled = _synthetic(losses, speeds={"sorted": [100.0, 104.0, 97.0]}, stalls={("bucketed", 2): 1.6})
    assert timing_check(stalled).reasons["bucketed"] == ["stall factor up to 1.60 in seed 2"]
    for frame in (noisy, unsteady, stalled):
        timing = timing_check(frame)
        table = strategy_table(frame)
        table.attrs["reference"] = "sorted"
        formatted = format_table(table, timing)
        assert (formatted["× sorted"] == "—").all()
        flagged = formatted.set_index("strategy")["real tokens/s"]
        assert all(flagged[s].endswith("(disturbed)") == (s in timing.disturbed) for s in flagged.index)
        tests = compare_pairs(frame, timing=timing)
        speed = [t for t in tests if t.metric == "tokens_per_second"]
        assert all((not t.tested and t.note == "timings disturbed") == bool({t.a, t.b} & set(timing.disturbed))
                   for t in speed)
        assert any(t.tested for t in speed)  # bucketed against the steady one is still tested
        lines = summary_sentences(table, tests, timing)
        assert "×" not in lines[0] and "no throughput ratio is quoted" in lines[0]
        assert "benchmarks/train_throughput.py" in timing.note()



def test_a_one_strategy_sweep_names_no_highest_throughput_even_with_disturbed_timings():
    """A smoke run alone (one strategy, one seed, a loaded machine): its throughput, never "the highest"."""
    for speeds in ([100.0, 104.0, 97.0], [2500.0, 5400.0, 27600.0]):  # steady, then disturbed (CV > TIMING_CV_MAX)
        alone = _synthetic({"packed": [2.0, 2.1, 2.2]}, speeds={"packed": speeds})
        timing = timing_check(alone)
        assert timing.flagged == (speeds[0] == 2500.0)
        first = summary_sentences(strategy_table(alone), compare_pairs(alone, timing=timing), timing)[0]
        assert first.startswith("packed: ") and "real tokens/s" in first and "highest" not in first
        assert ("disturbed" in first) == timing.flagged

def test_step_rate_checks_measure_how_steady_the_machine_was():
    def checks(real, slots, times):
        found = step_rate_checks(real, slots, times)
        return found["step_slot_rate_spread"], found["step_stall_factor"]

    assert checks([100] * 20, [120] * 20, [0.1] * 20) == pytest.approx((1.0, 1.0))
    # 9 of 20 steps four times slower: spread 4; the run took (11 · 0.1 + 9 · 0.4) / (20 · 0.1) = 2.35× the time
    # of its median rate
    assert checks([100] * 20, [100] * 20, [0.1] * 11 + [0.4] * 9) == pytest.approx((4.0, 2.35))
    # one step stalled 10×: the percentiles do not see it, the stall factor does ((19 · 0.1 + 1) / (20 · 0.1))
    spread, stall = checks([100] * 20, [100] * 20, [0.1] * 19 + [1.0])
    assert spread == pytest.approx(1.0) and stall == pytest.approx(1.45) and stall > STALL_MAX
    # the padding of a step is not a disturbance: same slots per second, real tokens varying
    assert checks([50, 100] * 10, [100] * 20, [0.1] * 20) == pytest.approx((1.0, 1.0))
    assert all(math.isnan(v) for v in checks([100] * 5, [100] * 5, [0.1] * 5))  # too few steps to say
    assert (TIMING_CV_MAX, STEP_SPREAD_MAX, STALL_MAX) == (0.20, 2.0, 1.25)


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
