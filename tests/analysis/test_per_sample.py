"""The planned contrasts over seeds and documents (analysis/per_sample.py): the pooled effect and the seed interval are
the primary's exactly; the crossed interval covers a known effect at its level on synthetic data where the seed-only
one does not, and agrees with statsmodels' MixedLM; mismatched held-out plans are refused."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from analysis.per_sample import EVAL_SAMPLES_FILE, crossed_interval, sample_contrast, sample_sentences


def _run(root, strategy, seed, ce, weights, step=10):
    run = root / f"{strategy}-{seed}"
    run.mkdir(parents=True)
    lines = [{"step": 5, "kind": "sample", "sample": i, "weighted_ce_sum": 99.0, "weight_sum": w}
             for i, w in enumerate(weights)]  # an earlier evaluation: never read
    lines += [{"step": step, "kind": "sample", "sample": i, "weighted_ce_sum": c, "weight_sum": w}
              for i, (c, w) in enumerate(zip(ce, weights))]
    lines.append({"step": step, "kind": "prompt", "prompt": 0, "accepted": [2, 1], "tau_real": 1.5})
    (run / EVAL_SAMPLES_FILE).write_text("".join(json.dumps(line) + "\n" for line in lines))
    return {"strategy": strategy, "seed": seed, "path": str(run),
            "final_eval_loss": float(np.sum(ce) / np.sum(weights))}


def test_the_pooled_effect_and_the_seed_interval_are_the_primary_paired_t(tmp_path):
    from scipy import stats

    rng = np.random.default_rng(0)
    weights = rng.uniform(1, 5, 40)
    document_gap = rng.normal(0, 0.5, 40)  # packed's advantage varies by document, the same on every seed
    rows = []
    for seed in range(3):
        rows.append(_run(tmp_path, "packed", seed, weights * (rng.uniform(1.0, 2.0, 40) + document_gap), weights))
        rows.append(_run(tmp_path, "sorted", seed, weights * rng.uniform(1.5, 3.0, 40), weights))
    per_run = pd.DataFrame(rows)
    result = sample_contrast(per_run, "packed", "sorted")
    pivot = per_run.pivot(index="seed", columns="strategy", values="final_eval_loss")
    per_seed = (pivot["packed"] - pivot["sorted"]).to_numpy()
    assert result.effect == pytest.approx(per_seed.mean(), rel=1e-12)
    primary = stats.ttest_rel(pivot["packed"], pivot["sorted"]).confidence_interval(0.95)
    assert result.crossed.seed_interval == pytest.approx((primary.low, primary.high), rel=1e-9)
    low, high = result.crossed.interval
    assert low < primary.low and primary.high < high < 0 and result.crossed.document_share > 0.1  # documents vary
    assert result.seeds == (0, 1, 2) and result.samples == 40 and result.share_a_lower > 0.7
    sentence, = sample_sentences(per_run, [("packed", "sorted")])
    assert sentence.startswith(f"packed vs sorted: held-out loss {result.effect:+.3f}; 95% interval over the 3 seeds "
                               f"{primary.low:+.3f} to {primary.high:+.3f} (documents fixed), over seeds and the 40 "
                               f"documents {low:+.3f} to {high:+.3f} (df {result.crossed.df:.1f}")


def _synthetic(rng, seeds, documents, sd_seed, sd_document, sd_error, effect):
    """Σw·CE differences whose per-document loss difference is ``effect`` + seed + document + noise, and Σw."""
    weights = rng.uniform(1, 5, documents)
    loss = (effect + rng.normal(0, sd_seed, (seeds, 1)) + rng.normal(0, sd_document, (1, documents))
            + rng.normal(0, sd_error, (seeds, documents)))
    return loss * weights, weights


@pytest.mark.parametrize(("seeds", "documents", "spreads", "seed_only_covers"), [
    ((12, 90, (0.05, 0.5, 0.3), False)),  # the real study's shape: the documents' spread dominates
    ((5, 60, (1.0, 0.0, 1.0), True)),  # documents alike: both intervals hold their level
])
def test_the_crossed_interval_covers_a_known_effect_at_its_level(seeds, documents, spreads, seed_only_covers):
    rng = np.random.default_rng(11)
    rounds, effect, covered = 1000, 0.3, np.zeros(2)
    for _ in range(rounds):
        result = crossed_interval(*_synthetic(rng, seeds, documents, *spreads, effect))
        covered += [result.seed_interval[0] <= effect <= result.seed_interval[1],
                    result.interval[0] <= effect <= result.interval[1]]
    seed_only, crossed = covered / rounds
    assert 0.925 <= crossed <= 0.975  # 95% within 3.6 binomial standard errors of 1000 rounds
    assert (0.925 <= seed_only) == seed_only_covers
    if not seed_only_covers:
        assert seed_only < 0.7  # treating documents as fixed misses the effect often


def test_the_crossed_standard_error_is_mixedlms_reml():
    import statsmodels.formula.api as smf

    rng = np.random.default_rng(3)
    diffs = 0.2 + rng.normal(0, 1, (6, 1)) + rng.normal(0, 2, (1, 40)) + rng.normal(0, 1, (6, 40))
    result = crossed_interval(diffs, np.ones(40))
    frame = pd.DataFrame({"x": diffs.ravel(), "seed": np.repeat(np.arange(6), 40), "doc": np.tile(np.arange(40), 6),
                          "all": 1})
    fit = smf.mixedlm("x ~ 1", frame, groups="all", vc_formula={"seed": "0 + C(seed)", "doc": "0 + C(doc)"}).fit(
        reml=True)
    assert result.effect == pytest.approx(fit.params["Intercept"], rel=1e-9)
    assert result.standard_error == pytest.approx(fit.bse["Intercept"], rel=1e-3)
    document_var, seed_var = fit.vcomp  # in the order of the names, sorted
    total = seed_var / 6 + document_var / 40 + fit.scale / 240
    assert result.document_share == pytest.approx(document_var / 40 / total, rel=2e-3)


def test_without_a_document_component_the_crossed_interval_is_the_seed_interval():
    rng = np.random.default_rng(5)
    weights = rng.uniform(1, 3, 30)
    diffs = (0.1 + rng.normal(0, 1, (4, 1)) + np.zeros((1, 30))) * weights  # no document or error spread at all
    result = crossed_interval(diffs, weights)
    assert result.document_share == 0 and result.df == 3 and result.interval == result.seed_interval
    with pytest.raises(ValueError, match=r"seeds >= 2, documents >= 2"):
        crossed_interval(diffs[:1], weights)


def test_no_per_sample_lines_no_sentence_and_another_held_out_plan_is_refused(tmp_path):
    weights = np.ones(5)
    rows = [_run(tmp_path, "packed", 0, weights, weights), _run(tmp_path, "sorted", 0, weights * 2, weights)]
    assert sample_contrast(pd.DataFrame(rows), "packed", "sorted") is None  # one seed: nothing to resample
    rows += [_run(tmp_path, "packed", 1, weights, weights), _run(tmp_path, "sorted", 1, weights, weights * 2)]
    with pytest.raises(ValueError, match="one held-out plan"):
        sample_contrast(pd.DataFrame(rows), "packed", "sorted")
    no_file = pd.DataFrame([{**row, "path": str(tmp_path / "nowhere")} for row in rows])
    assert sample_sentences(no_file, [("packed", "sorted")]) == []


def test_the_samples_table_round_trips_through_its_csv_and_gives_the_same_intervals(tmp_path):
    from analysis.per_sample import SAMPLES_CSV, crossed_lines, read_samples_table, run_samples, samples_table
    from analysis.planned import Contrast, Preregistration

    rng = np.random.default_rng(4)
    weights = rng.uniform(1, 5, 30)
    rows = [_run(tmp_path, strategy, seed, weights * rng.uniform(1, 3, 30), weights)
            for seed in (0, 1, 2, 7, 8, 9) for strategy in ("packed", "sorted")]
    per_run = pd.DataFrame(rows)
    samples = run_samples(per_run)
    samples_table(samples).to_csv(tmp_path / SAMPLES_CSV, index=False)
    back = read_samples_table(tmp_path / SAMPLES_CSV)
    assert back.keys() == samples.keys() and all(back[key].equals(samples[key]) for key in samples)  # bit for bit
    plan = Preregistration("final_eval_loss", "lower", 0.05, (Contrast("packed", "sorted", "superiority"),),
                           pilot_seeds=(0, 1, 2), confirmatory_seeds=(7, 8, 9))
    lines = crossed_lines(per_run, plan, back)
    assert lines == crossed_lines(per_run, plan)  # from the run directories: the same
    assert lines[0].startswith("The same contrasts with the held-out documents treated as a sample too (secondary: "
                               "the verdicts above are decided by the paired t over seeds")
    confirmatory = per_run[per_run["seed"] >= 7]
    expected = sample_contrast(confirmatory, "packed", "sorted")
    assert lines[2].startswith(f"- packed vs sorted: held-out loss {expected.effect:+.3f}; 95% interval over the 3 "
                               "seeds")
    assert crossed_lines(per_run, plan, {}) == []  # no per-sample lines: nothing said
