"""The planned contrasts per held-out sample (analysis/per_sample.py): the pooled effect is the primary's exactly,
the hierarchical bootstrap is deterministic and carries both spreads, mismatched held-out plans are refused."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from analysis.per_sample import EVAL_SAMPLES_FILE, sample_contrast, sample_sentences


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


def test_the_pooled_effect_is_the_primary_mean_difference_and_the_bootstrap_repeats(tmp_path):
    rng = np.random.default_rng(0)
    weights = rng.uniform(1, 5, 40)
    rows = []
    for seed in range(3):
        rows.append(_run(tmp_path, "packed", seed, weights * rng.uniform(1.0, 2.0, 40), weights))
        rows.append(_run(tmp_path, "sorted", seed, weights * rng.uniform(1.5, 3.0, 40), weights))
    per_run = pd.DataFrame(rows)
    result = sample_contrast(per_run, "packed", "sorted")
    pivot = per_run.pivot(index="seed", columns="strategy", values="final_eval_loss")
    assert result.effect == pytest.approx((pivot["packed"] - pivot["sorted"]).mean(), rel=1e-12)
    assert result.interval[0] < result.effect < result.interval[1] < 0  # packed lower here, on every seed
    assert result.seeds == (0, 1, 2) and result.samples == 40 and result.share_a_lower > 0.8
    assert sample_contrast(per_run, "packed", "sorted") == result  # the bootstrap's generator is fixed
    sentence, = sample_sentences(per_run, [("packed", "sorted")])
    assert sentence.startswith(f"packed vs sorted, per held-out sample (secondary): held-out loss {result.effect:+.3f}")


def test_no_per_sample_lines_no_sentence_and_another_held_out_plan_is_refused(tmp_path):
    weights = np.ones(5)
    rows = [_run(tmp_path, "packed", 0, weights, weights), _run(tmp_path, "sorted", 0, weights * 2, weights)]
    assert sample_contrast(pd.DataFrame(rows), "packed", "sorted") is None  # one seed: nothing to resample
    rows += [_run(tmp_path, "packed", 1, weights, weights), _run(tmp_path, "sorted", 1, weights, weights * 2)]
    with pytest.raises(ValueError, match="one held-out plan"):
        sample_contrast(pd.DataFrame(rows), "packed", "sorted")
    no_file = pd.DataFrame([{**row, "path": str(tmp_path / "nowhere")} for row in rows])
    assert sample_sentences(no_file, [("packed", "sorted")]) == []
