"""The pre-registered analysis (analysis/planned.py): the declared family read from its file, Holm and TOST
against hand computations, the verdicts, and the committed margin and seed count recomputed from the pilot."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

from harness.cli.report import main
from analysis.planned import (
    Contrast,
    Preregistration,
    equivalence_power,
    load_preregistration,
    planned_results,
)

ROOT = Path(__file__).resolve().parents[1]
PLAN = ROOT / "conf" / "preregistration" / "strategies.yaml"
PILOT = ROOT / "docs" / "demo" / "pilot_runs.csv"  # make pilot's runs.csv: what sized the confirmatory design


def runs(values: dict[str, list[float]]) -> pd.DataFrame:
    return pd.DataFrame([{"strategy": s, "seed": seed, "final_eval_loss": v}
                         for s, series in values.items() for seed, v in enumerate(series)])


def plan_of(*contrasts: Contrast, alpha: float = 0.05) -> Preregistration:
    return Preregistration("final_eval_loss", "lower", alpha, tuple(contrasts))


def test_holm_over_the_planned_family_matches_a_hand_computation():
    """Four superiority contrasts built to have p = 0.01, 0.04, 0.03, 0.005 (t-test p-values set through the
    t statistic): Holm's step-down by hand gives 0.03, 0.06, 0.06, 0.02."""
    from scipy import stats

    n, targets = 6, [0.01, 0.04, 0.03, 0.005]
    base = np.array([-2.0, -1.0, 0.0, 0.5, 1.0, 1.5])  # any spread; scaled so that t hits its target
    base = (base - base.mean()) / base.std(ddof=1)
    values = {"ref": [0.0] * n}
    for k, p in enumerate(targets):
        t = stats.t.isf(p / 2, n - 1)
        values[f"s{k}"] = list(base + t / math.sqrt(n))  # mean t/√n, s.d. 1: t-statistic t
    results = planned_results(runs(values), plan_of(*(Contrast(f"s{k}", "ref", "superiority") for k in range(4))))
    assert [r.p_value for r in results] == pytest.approx(targets, rel=1e-6)
    # by hand: sorted 0.005 (×4 = 0.02), 0.01 (×3 = 0.03), 0.03 (×2 = 0.06), 0.04 (×1 = 0.04 → 0.06, monotone)
    assert [r.p_holm for r in results] == pytest.approx([0.03, 0.06, 0.06, 0.02], rel=1e-6)
    assert [r.verdict for r in results][3] == "worse" and results[0].verdict == "worse"  # higher loss than ref
    assert results[1].verdict.startswith("inconclusive — needs ")


def test_tost_matches_the_t_table():
    """Differences −2k … 2k (mean 0, s.d. k·√2.5) with δ set so that each one-sided statistic is 2.131, a hair
    under the t table's one-sided 5% value at 4 degrees of freedom (2.132): TOST's p is 0.050 (just above), so
    equivalence at α = 0.05 is just out of reach; a wider margin reaches it, a shifted difference is refused."""
    k = 0.1
    diffs = np.array([-2, -1, 0, 1, 2]) * k
    margin = 2.131 * (k * math.sqrt(2.5)) / math.sqrt(5)
    values = {"a": list(1.0 + diffs), "b": [1.0] * 5}
    (result,) = planned_results(runs(values), plan_of(Contrast("a", "b", "equivalence", margin)))
    assert result.p_value == pytest.approx(0.050, abs=2e-4)
    assert result.interval == pytest.approx((-margin, margin), rel=1e-3)  # the 90% interval touches ±δ
    assert result.verdict.startswith("inconclusive")
    (wider,) = planned_results(runs(values), plan_of(Contrast("a", "b", "equivalence", margin * 1.2)))
    assert wider.verdict == "equivalent within δ"
    far = {"a": list(2.0 + diffs), "b": [1.0] * 5}
    (apart,) = planned_results(runs(far), plan_of(Contrast("a", "b", "equivalence", margin)))
    assert apart.verdict == "not equivalent"


def test_equivalence_power_grows_with_seeds_and_with_the_margin():
    assert equivalence_power(0.0, 0.2, 3, 0.05, 0.1) < equivalence_power(0.0, 0.2, 30, 0.05, 0.1)
    assert equivalence_power(0.0, 0.2, 10, 0.05, 0.1) < equivalence_power(0.0, 0.2, 10, 0.05, 0.3)
    assert equivalence_power(0.0, 0.2, 200, 0.05, 0.1) > 0.99


def test_the_planned_family_is_read_from_the_file_and_a_contrast_added_there_is_reported(tmp_path, capsys):
    declared = yaml.safe_load(PLAN.read_text())
    assert [(c["a"], c["b"], c["kind"]) for c in declared["contrasts"]] == [
        (c.a, c.b, c.kind) for c in load_preregistration(PLAN).contrasts]
    declared["contrasts"].append({"a": "shuffle", "b": "sorted", "kind": "superiority"})
    extended = tmp_path / "extended.yaml"
    extended.write_text(yaml.safe_dump(declared, allow_unicode=True))
    assert main(["--from-runs-csv", str(PILOT), "--preregistration", str(extended)]) == 0
    out = capsys.readouterr().out
    assert "Holm over the 5 planned contrasts only" in out
    for contrast in load_preregistration(extended).contrasts:
        assert f"- {contrast.name} ({contrast.kind}" in out, contrast
    # the summary opens with the answer in words, and says these seeds are the pilot's, not a confirmatory test
    assert out.startswith(f"Planned contrasts (pre-registered in `{extended}`; final_eval_loss, lower is better, "
                          "Holm over the 5 at α = 0.05), on the pilot's seeds (0, 1, 2), not a confirmatory test")
    assert out.index("- shuffle vs sorted (superiority)") < out.index("| strategy |")


def test_the_committed_margin_and_seed_count_follow_from_the_pilot():
    """δ ≤ a quarter of the pilot's sorted − shuffle gap; confirmatory seeds (never the pilot's) as many as the
    pilot's effects need for 80% power on every planned contrast it can size, at least 5; one it cannot size is
    named in the plan."""
    plan = load_preregistration(PLAN)
    pilot = pd.read_csv(PILOT)
    assert sorted(pilot["seed"].unique()) == sorted(plan.pilot_seeds)
    means = pilot.groupby("strategy")["final_eval_loss"].mean()
    gap = means["sorted"] - means["shuffle"]
    assert f"{gap:.3f} nats" in plan.margin_rationale and f"{gap / 4:.3f}" in plan.margin_rationale
    (equivalence,) = [c for c in plan.contrasts if c.kind == "equivalence"]
    assert equivalence.margin <= gap / 4
    results = planned_results(pilot, plan)
    sized = [r.needs_seeds for r in results if r.needs_seeds is not None]
    budget = plan.seed_budget or max(sized)
    assert sized and len(plan.confirmatory_seeds) == max(5, min(budget, max(sized)))
    text = " ".join(PLAN.read_text().replace("#", " ").split())
    for result in results:  # each contrast's need is stated; one the budget cannot meet is named with its pilot effect
        if result.needs_seeds is not None:
            assert f"{result.contrast.name}{'’s equivalence within δ' if result.contrast.kind == 'equivalence' else ''}" \
                   in text.replace("'", "’") and f" {result.needs_seeds}" in text, result.contrast
        if result.needs_seeds is None or result.needs_seeds > len(plan.confirmatory_seeds):
            assert f"{result.mean_difference:+.3f} nats" in text, result.contrast
    assert not set(plan.confirmatory_seeds) & set(plan.pilot_seeds)


@pytest.mark.parametrize(("change", "message"), [
    ({"better": "smaller"}, "better='smaller'"),
    ({"contrasts": [{"a": "packed", "b": "shuffle", "kind": "equivalence"}]}, "give its margin"),
    ({"contrasts": [{"a": "packed", "b": "sorted", "kind": "superiority", "margin": 0.1}]}, "has no margin"),
    ({"contrasts": [{"a": "packed", "b": "sorted", "kind": "noninferiority"}]}, "choose one of"),
    ({"confirmatory_seeds": [0, 200]}, "both pilot and confirmatory"),
    ({"margin_rationale": ""}, "needs its rationale"),
    ({"endpoints": "x"}, "unknown key"),
])
def test_a_preregistration_it_cannot_use_is_refused_naming_the_key(tmp_path, change, message):
    declared = {**yaml.safe_load(PLAN.read_text()), **change}
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(declared, allow_unicode=True))
    with pytest.raises(ValueError, match=message):
        load_preregistration(path)
    assert main(["--from-runs-csv", str(PILOT), "--preregistration", str(path)]) == 2


def test_a_sweep_with_confirmatory_runs_is_tested_on_them_alone_and_says_how_many():
    """Pilot seeds beside confirmatory ones: the contrasts use the confirmatory seeds only, and the summary says how
    many of the declared ones ran (never a pooled test of pilot and confirmatory runs)."""
    from analysis.planned import seeds_words

    frame = runs({"a": [1.0, 1.1, 0.9, 5.0, 5.2, 4.9], "b": [2.0, 2.2, 1.9, 5.1, 5.0, 5.3]})
    frame["seed"] = frame["seed"].map({0: 0, 1: 1, 2: 2, 3: 100, 4: 101, 5: 102})
    plan = Preregistration("final_eval_loss", "lower", 0.05, (Contrast("a", "b", "superiority"),), (0, 1, 2),
                           tuple(range(100, 110)))
    (result,) = planned_results(frame, plan)
    assert result.seeds == (100, 101, 102)
    assert result.mean_difference == pytest.approx(np.mean([5.0 - 5.1, 5.2 - 5.0, 4.9 - 5.3]))
    assert seeds_words([result], plan) == "3 of the 10 confirmatory seeds (100, 101, 102; the others are not in these runs)"
    pilot_only = frame[frame["seed"] < 100]
    (pilot,) = planned_results(pilot_only, plan)
    assert pilot.seeds == (0, 1, 2) and seeds_words([pilot], plan).startswith("the pilot's seeds (0, 1, 2), not a")


def test_superiority_power_is_statsmodels_where_it_is_finite_and_near_one_where_it_is_not():
    """The paired t-test's power: TTestPower's value wherever statsmodels computes one, and ~1 (not nan) for an
    effect of 5 s.d. at 5 pairs, where statsmodels returns nan."""
    from statsmodels.stats.power import TTestPower

    from analysis.planned import superiority_power

    for effect, sd, n in ((0.0385, 0.0354, 12), (0.1, 0.2, 8), (0.5, 0.3, 3), (-0.178, 0.0358, 3)):
        expected = TTestPower().power(effect_size=abs(effect) / sd, nobs=n, alpha=0.0125, alternative="two-sided")
        assert superiority_power(effect, sd, n, 0.0125) == pytest.approx(expected, rel=1e-9), (effect, sd, n)
    assert superiority_power(-0.178, 0.0358, 5, 0.0125) == pytest.approx(1.0, abs=1e-3)
