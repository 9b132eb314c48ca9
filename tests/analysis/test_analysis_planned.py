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
from support.preregistration import plan_file, refusal
from analysis.planned import (
    Contrast,
    Design,
    PlannedResult,
    Preregistration,
    equivalence_power,
    load_preregistration,
    planned_markdown,
    planned_results,
)

ROOT = Path(__file__).resolve().parents[2]
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
    assert results[1].verdict == "inconclusive"


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
    assert plan.pilot_runs == "docs/demo/pilot_runs.csv"
    designs = [r.design for r in planned_results(pilot, plan)]
    sized = [d.needed for d in designs if d.needed is not None]
    budget = plan.seed_budget or max(sized)
    assert sized and len(plan.confirmatory_seeds) == max(5, min(budget, max(sized)))
    text = " ".join(PLAN.read_text().replace("#", " ").split())
    for contrast, design in zip(plan.contrasts, designs):  # each need is stated; one the budget misses is named
        if design.needed is not None:
            assert f"{contrast.name}{'’s equivalence within δ' if contrast.kind == 'equivalence' else ''}" \
                   in text.replace("'", "’") and f" {design.needed}" in text, contrast
        if design.needed is None or design.needed > len(plan.confirmatory_seeds):
            assert f"{design.effect:+.3f} nats" in text, contrast
    assert f"about {designs[1].power:.0%} power" in text  # bucketed vs sorted's, at the 12 seeds
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


# ------------------------------------------------------------------ the preregistration file, field by field
KEYS_TEXT = ("['alpha', 'artefact', 'better', 'combine', 'confirmatory_seeds', 'contrasts', 'endpoint', 'exploratory', "
             "'interval', 'margin_rationale', 'pilot_runs', 'pilot_seeds', 'secondary', 'seed_budget']")
def test_a_minimal_preregistration_takes_the_defaults(tmp_path):
    """Only endpoint, better and one superiority contrast: α 0.05, no seeds, no rationale (none needed without an
    equivalence), no artefact to check, no seed budget."""
    plan = load_preregistration(plan_file(tmp_path))
    assert plan == Preregistration("final_eval_loss", "lower", 0.05, (Contrast("x", "y", "superiority"),))
    assert (plan.margin_rationale, plan.artefact, plan.seed_budget, plan.interval) == ("", "", None, "seeds")


def test_both_studies_declare_that_the_seed_interval_decides(monkeypatch):
    """The verdicts were declared on the paired t over seeds; the crossed interval is reported beside them."""
    conf = Path(__file__).resolve().parents[2] / "conf" / "preregistration"
    monkeypatch.chdir(conf.parents[1])  # pilot_runs are named from the repository root
    for name in ("strategies", "study_real"):
        assert load_preregistration(conf / f"{name}.yaml").interval == "seeds"
    assert "interval: seeds" in (conf / "strategies.yaml").read_text()  # declared, not the default


def test_every_field_of_a_full_preregistration_is_read(tmp_path):
    path = plan_file(tmp_path, better="higher", alpha=0.49, pilot_seeds=[0, 1], confirmatory_seeds=[7, 5],
                     artefact="abc123", seed_budget=2, margin_rationale="  a quarter\n of the gap ", interval="seeds",
                     contrasts=[{"a": "x", "b": "y", "kind": "superiority"},
                                {"a": 1, "b": "z", "kind": "equivalence", "margin": 1}])
    assert load_preregistration(path) == Preregistration(
        "final_eval_loss", "higher", 0.49,
        (Contrast("x", "y", "superiority"), Contrast("1", "z", "equivalence", 1.0)), (0, 1), (7, 5),
        "  a quarter\n of the gap ", "abc123", 2)
    assert isinstance(load_preregistration(path).alpha, float)


def test_a_seed_budget_of_two_holding_two_confirmatory_seeds_is_accepted(tmp_path):
    plan = load_preregistration(plan_file(tmp_path, seed_budget=2, confirmatory_seeds=[10, 11]))
    assert (plan.seed_budget, plan.confirmatory_seeds) == (2, (10, 11))


def test_a_missing_preregistration_file_is_refused_naming_it(tmp_path):
    path = tmp_path / "absent.yaml"
    with pytest.raises(FileNotFoundError) as excinfo:
        load_preregistration(path)
    assert str(excinfo.value) == f"preregistration {path} does not exist"


def test_a_file_that_is_not_a_mapping_is_refused_listing_the_keys(tmp_path):
    path = tmp_path / "plan.yaml"
    path.write_text("- endpoint\n- better\n")
    assert refusal(path) == f"{path}: give a mapping with the keys {KEYS_TEXT}"


@pytest.mark.parametrize(("fields", "message"), [
    ({"endpoints": "x", "extra": 1}, "unknown key(s) ['endpoints', 'extra']; the keys are " + KEYS_TEXT),
    ({"better": "smaller"}, "better='smaller': give 'lower' or 'higher' (which way the endpoint improves)"),
    ({"better": ...}, "better=None: give 'lower' or 'higher' (which way the endpoint improves)"),
    ({"alpha": 0.5}, "alpha=0.5: give a level in (0, 0.5), e.g. 0.05"),
    ({"alpha": 0}, "alpha=0: give a level in (0, 0.5), e.g. 0.05"),
    ({"alpha": "0.05"}, "alpha='0.05': give a level in (0, 0.5), e.g. 0.05"),
    ({"contrasts": [{"a": "x", "b": "y", "kind": "noninferiority"}]},
     "contrasts[0].kind='noninferiority': choose one of ['superiority', 'equivalence']"),
    ({"contrasts": [{"a": "x", "b": "y", "kind": "superiority"}, {"a": "x", "b": "z", "kind": "equivalence"}],
      "margin_rationale": "why"},
     "contrasts[1] (x vs z) is an equivalence test: give its margin (> 0, the endpoint's units) and say why in "
     "margin_rationale"),
    ({"contrasts": [{"a": "x", "b": "y", "kind": "equivalence", "margin": 0}], "margin_rationale": "why"},
     "contrasts[0] (x vs y) is an equivalence test: give its margin (> 0, the endpoint's units) and say why in "
     "margin_rationale"),
    ({"contrasts": [{"a": "x", "b": "y", "kind": "superiority", "margin": 0.1}]},
     "contrasts[0] (x vs y) is a superiority test: it has no margin"),
    ({"contrasts": []}, "no planned contrast; give at least one under contrasts"),
    ({"contrasts": [{"a": "x", "b": "y", "kind": "equivalence", "margin": 0.1}]},
     "an equivalence margin needs its rationale (margin_rationale), committed with it"),
    ({"contrasts": [{"a": "x", "b": "y", "kind": "equivalence", "margin": 0.1}], "margin_rationale": " \n "},
     "an equivalence margin needs its rationale (margin_rationale), committed with it"),
    ({"pilot_seeds": [0, 1, 2, 3], "confirmatory_seeds": [3, 9, 1]},
     "seeds [1, 3] are both pilot and confirmatory; a pilot's seeds are never reused"),
    ({"artefact": 123}, "artefact=123: give the data fingerprint the design was declared on "
                        "(its manifest.json's fingerprint under harness/data/bundled/), or leave it out"),
    ({"seed_budget": 1}, "seed_budget=1: give the most confirmatory seeds the budget holds (>= 2)"),
    ({"seed_budget": "3"}, "seed_budget='3': give the most confirmatory seeds the budget holds (>= 2)"),
    ({"seed_budget": True}, "seed_budget=True: give the most confirmatory seeds the budget holds (>= 2)"),
    ({"seed_budget": 2, "confirmatory_seeds": [10, 11, 12]}, "3 confirmatory seeds over the seed_budget of 2"),
    ({"exploratory": True}, "exploratory=True: say in words why the contrasts are exploratory, or leave it out (a "
                            "confirmatory test)"),
    ({"interval": "seeds_and_documents"}, "interval='seeds_and_documents': choose one of ['seeds'] (which interval "
     "decides the verdicts; deciding on the interval over seeds and documents is not built, and it is reported beside "
     "the verdicts either way)"),
])
def test_each_refusal_names_the_file_the_field_and_the_fix(tmp_path, fields, message):
    path = plan_file(tmp_path, **fields)
    assert refusal(path) == f"{path}: {message}"


@pytest.mark.parametrize("item", [{"a": "x", "b": "y"}, {"a": "x", "b": "y", "kind": "superiority", "note": 1},
                                  ["a", "b", "kind"], "x vs y"])
def test_a_contrast_of_the_wrong_shape_is_refused_showing_both_shapes(tmp_path, item):
    path = plan_file(tmp_path, contrasts=[item])
    message = refusal(path)
    # the whole text but the join of its two literals (analysis/planned.py prints "superiority}}" there)
    assert message.startswith(f"{path}: contrasts[0]={item!r}: give {{a: STRATEGY, b: STRATEGY, kind: superiority")
    assert message.endswith(" or {a, b, kind: equivalence, margin: DELTA}")


# ------------------------------------------------------------------ pairing the runs
def test_paired_values_keeps_the_seeds_both_have_as_float64():
    from analysis.planned import paired_values

    frame = pd.DataFrame({"strategy": ["a", "a", "a", "b", "b", "c"], "seed": [3, 1, 2, 1, 3, 1],
                          "final_eval_loss": [30, 10, 20, 11, 33, 99]})
    seeds, values_a, values_b = paired_values(frame, "final_eval_loss", "a", "b")
    assert seeds == (1, 3)
    assert values_a.dtype == np.float64 and values_b.dtype == np.float64
    assert values_a.tolist() == [10.0, 30.0] and values_b.tolist() == [11.0, 33.0]
    whole = pd.DataFrame({"strategy": ["a", "a", "b", "b"], "seed": [0, 1, 0, 1], "final_eval_loss": [1, 2, 3, 4]})
    _, values_a, values_b = paired_values(whole, "final_eval_loss", "a", "b")  # int64 in its table: no NaN there
    assert values_a.dtype == np.float64 and values_b.dtype == np.float64


def test_paired_values_takes_the_first_row_of_a_run_given_twice():
    from analysis.planned import paired_values

    frame = pd.DataFrame({"strategy": ["a", "a", "a", "b", "b"], "seed": [0, 0, 1, 0, 1],
                          "final_eval_loss": [1.0, 3.0, 2.0, 5.0, 6.0]})
    assert paired_values(frame, "final_eval_loss", "a", "b")[1].tolist() == [1.0, 2.0]  # never the mean 2.0


def test_a_contrast_of_a_strategy_the_sweep_lacks_is_refused_naming_it():
    with pytest.raises(ValueError) as excinfo:
        planned_results(runs({"a": [1.0, 2.0], "b": [1.5, 2.5]}), plan_of(Contrast("a", "c", "superiority")))
    assert str(excinfo.value) == "planned contrast a vs c: no run of ['c'] in this sweep"


def test_one_paired_seed_is_refused_and_two_are_enough():
    with pytest.raises(ValueError) as excinfo:
        planned_results(runs({"a": [1.0], "b": [1.5]}), plan_of(Contrast("a", "b", "superiority")))
    assert str(excinfo.value) == "planned contrast a vs b: 1 paired seed(s); a paired test needs 2 or more"
    (result,) = planned_results(runs({"a": [1.0, 2.0], "b": [1.5, 2.7]}), plan_of(Contrast("a", "b", "superiority")))
    assert result.seeds == (0, 1) and result.mean_difference == pytest.approx(-0.6, abs=1e-12)


def test_an_endpoint_the_runs_lack_is_refused_listing_twelve_columns():
    frame = pd.DataFrame({name: [0.0] for name in ["strategy", "seed", *(f"x{k:02d}" for k in range(12))]})
    with pytest.raises(ValueError) as excinfo:
        planned_results(frame, plan_of(Contrast("a", "b", "superiority")))
    assert str(excinfo.value) == ("the preregistered endpoint 'final_eval_loss' is not a column of the runs "
                                  "(['seed', 'strategy', 'x00', 'x01', 'x02', 'x03', 'x04', 'x05', 'x06', 'x07', "
                                  "'x08', 'x09'] ...)")


# ------------------------------------------------------------------ the declared data (artefact)
DECLARED = "1e33cfcfa104475e6828e2bc803a311222b433f4d0ce6ddc3c38526d6cfde3f9"


def fingerprinted(*fingerprints) -> pd.DataFrame:
    frame = runs({"a": [1.0, 1.2, 0.9, 1.1], "b": [1.5, 1.6, 1.4, 1.7]})
    frame["data_fingerprint"] = [fingerprints[k % len(fingerprints)] for k in range(len(frame))]
    return frame


def with_artefact(artefact: str) -> Preregistration:
    return Preregistration("final_eval_loss", "lower", 0.05, (Contrast("a", "b", "superiority"),), artefact=artefact)


def test_runs_on_other_data_than_the_declared_are_refused_naming_both_fingerprints():
    frame = fingerprinted(DECLARED, "ffffffffffff9999", "0123456789abcdef", None)
    with pytest.raises(ValueError) as excinfo:
        planned_results(frame, with_artefact(DECLARED))
    assert str(excinfo.value) == ("the preregistration was declared on the data 1e33cfcfa104 (artefact), but runs of "
                                  "this sweep trained on 0123456789ab, ffffffffffff: they are another experiment; "
                                  "test them without this preregistration, or rerun them on the declared data")


def test_the_artefact_is_checked_only_when_declared_and_recorded():
    (declared,) = planned_results(fingerprinted(DECLARED, None), with_artefact(DECLARED))  # a run without one passes
    (undeclared,) = planned_results(fingerprinted("ffffffffffff9999"), with_artefact(""))
    (unrecorded,) = planned_results(fingerprinted(DECLARED).drop(columns="data_fingerprint"), with_artefact(DECLARED))
    assert declared.seeds == undeclared.seeds == unrecorded.seeds == (0, 1, 2, 3)


# ------------------------------------------------------------------ power and the seeds it needs
def test_superiority_power_is_nan_without_two_pairs_or_a_spread_and_statsmodels_at_two_pairs():
    from statsmodels.stats.power import TTestPower

    from analysis.planned import superiority_power

    assert math.isnan(superiority_power(0.5, 0.3, 1, 0.05))
    assert math.isnan(superiority_power(0.5, 0.0, 5, 0.05)) and math.isnan(superiority_power(0.5, -0.1, 5, 0.05))
    expected = TTestPower().power(effect_size=4.0, nobs=2, alpha=0.05, alternative="two-sided")
    assert superiority_power(-2.0, 0.5, 2, 0.05) == pytest.approx(expected, rel=1e-9)
    assert 0.05 < expected < 0.5  # two pairs: far from 0 and 1, so a wrong df or critical value moves it


def test_superiority_power_counts_a_far_tail_that_underflows_to_nan_as_zero():
    """5 s.d. at 5 pairs, α = 0.0125: scipy's P(T < −t_crit) is nan there, the near tail ~1; the power is the near
    tail alone, never above 1."""
    from scipy import stats

    from analysis.planned import superiority_power

    critical = stats.t.ppf(1 - 0.0125 / 2, 4)
    assert math.isnan(stats.nct.cdf(-critical, 4, 5 * math.sqrt(5)))  # the case this guards (scipy's underflow)
    power = superiority_power(5.0, 1.0, 5, 0.0125)
    assert power == pytest.approx(float(stats.nct.sf(critical, 4, 5 * math.sqrt(5))), abs=1e-12)
    assert 0.99 < power <= 1.0


def tost_bound_by_simulation(effect: float, sd: float, n: int, alpha: float, margin: float) -> float:
    """P(low rejects) + P(high rejects) − 1 of TOST's two one-sided t-tests, from 200 000 simulated designs."""
    from scipy import stats

    draws = np.random.default_rng(49).normal(effect, sd, size=(200_000, n))
    mean, se = draws.mean(axis=1), draws.std(axis=1, ddof=1) / math.sqrt(n)
    critical = stats.t.ppf(1 - alpha, n - 1)
    return float(((mean + margin) / se > critical).mean() + ((mean - margin) / se < -critical).mean() - 1)


@pytest.mark.parametrize(("effect", "sd", "n", "alpha", "margin"), [
    (0.02, 0.1, 4, 0.05, 0.2),  # ~0.80 (df n − 2 gives ~0.59, n + 1 ~0.90)
    (0.0, 0.1, 3, 0.05, 0.25),  # ~0.70 (df n − 2: ~0.004, n + 1: ~0.94)
    (0.0, 0.1, 2, 0.05, 0.5),   # ~0.46 at the fewest pairs it sizes
])
def test_equivalence_power_matches_a_simulation_of_the_two_one_sided_tests(effect, sd, n, alpha, margin):
    """Monte-Carlo with a fixed seed: 200 000 designs put the estimate within ±0.003 (1 s.e.) of the bound;
    0.01 is over 3 s.e."""
    assert equivalence_power(effect, sd, n, alpha, margin) == pytest.approx(
        tost_bound_by_simulation(effect, sd, n, alpha, margin), abs=0.01)


def test_equivalence_power_is_nan_without_two_pairs_or_a_spread_and_zero_where_the_bound_is_negative():
    assert math.isnan(equivalence_power(0.0, 0.1, 1, 0.05, 0.2))
    assert math.isnan(equivalence_power(0.0, 0.0, 5, 0.05, 0.2))
    assert equivalence_power(0.0, 1.0, 3, 0.05, 0.1) == 0.0  # δ a tenth of the s.d. at 3 pairs: no power


def test_seeds_needed_searches_from_start_but_never_below_two_and_stops_at_max_seeds():
    from analysis.planned import MAX_SEEDS, TARGET_POWER, seeds_needed

    asked = []

    def always(n: int) -> float:
        asked.append(n)
        return 1.0

    assert seeds_needed(always, 0) == 2 and asked == [2]
    assert seeds_needed(always, 2) == 2 and seeds_needed(always, 7) == 7
    assert seeds_needed(lambda n: TARGET_POWER if n >= 9 else TARGET_POWER - 1e-9, 3) == 9  # reaching it is enough
    assert MAX_SEEDS == 1000
    assert seeds_needed(lambda n: float(n >= 1000), 2) == 1000  # the last n it tries
    assert seeds_needed(lambda n: float(n >= 1001), 2) is None
    assert seeds_needed(lambda n: 0.0, 999) is None


# ------------------------------------------------------------------ verdicts
SHIFTS = [0.08, 0.1, 0.12, 0.09, 0.11, 0.1]  # mean 0.1, s.d. ~0.014: a difference no test misses


def shifted(by: float) -> pd.DataFrame:
    return runs({"a": [1.0 + by * s / 0.1 for s in SHIFTS], "b": [1.0] * len(SHIFTS)})


@pytest.mark.parametrize(("by", "better", "verdict"), [
    (-0.1, "lower", "better"), (0.1, "lower", "worse"), (-0.1, "higher", "worse"), (0.1, "higher", "better"),
    (-2.0, "lower", "better"), (2.0, "lower", "worse"),
])
def test_a_significant_superiority_reads_better_or_worse_in_the_endpoints_direction(by, better, verdict):
    plan = Preregistration("final_eval_loss", better, 0.05, (Contrast("a", "b", "superiority"),))
    (result,) = planned_results(shifted(by), plan)
    assert result.p_holm < 1e-4 and result.verdict == verdict


def test_a_holm_p_exactly_at_alpha_is_not_significant():
    """α set to the contrast's own p (Holm over one contrast leaves it as is): p < α fails, so no verdict."""
    contrast = Contrast("a", "b", "superiority")
    frame = runs({"a": [1.2, 1.3, 1.25, 1.22], "b": [1.0, 1.0, 1.0, 1.0]})
    (first,) = planned_results(frame, plan_of(contrast))
    assert first.verdict == "worse"
    (at_alpha,) = planned_results(frame, plan_of(contrast, alpha=first.p_value))
    assert at_alpha.p_holm == first.p_value and at_alpha.verdict == "inconclusive"

    equivalence = Contrast("a", "b", "equivalence", 0.1)
    frame = runs({"a": [1.0, 1.01, 0.99, 1.02, 0.98], "b": [1.0] * 5})
    (first,) = planned_results(frame, plan_of(equivalence))
    assert first.verdict == "equivalent within δ"
    (at_alpha,) = planned_results(frame, plan_of(equivalence, alpha=first.p_value))
    assert at_alpha.p_holm == first.p_value and at_alpha.verdict == "inconclusive"


@pytest.mark.parametrize("sign", [1, -1])
def test_an_interval_ending_exactly_at_the_margin_is_not_wholly_outside_it(sign):
    """The (1 − 2α) interval does not depend on δ: δ set to its end nearest 0 leaves it touching ±δ, which is
    inconclusive (not equivalent needs the interval wholly outside)."""
    frame = runs({"a": [1.0 + sign * d for d in (0.5, 0.6, 0.4, 0.55, 0.45)], "b": [1.0] * 5})
    (first,) = planned_results(frame, plan_of(Contrast("a", "b", "equivalence", 0.1)))
    assert first.verdict == "not equivalent"
    touching = min(abs(first.interval[0]), abs(first.interval[1]))
    (at_margin,) = planned_results(frame, plan_of(Contrast("a", "b", "equivalence", touching)))
    assert at_margin.interval == first.interval
    assert at_margin.verdict == "inconclusive"


def test_an_interval_straddling_minus_the_margin_is_inconclusive():
    frame = runs({"a": [1.0 - d for d in (0.05, 0.15, 0.0, 0.2, 0.1)], "b": [1.0] * 5})
    (result,) = planned_results(frame, plan_of(Contrast("a", "b", "equivalence", 0.1)))
    low, high = result.interval
    assert low < -0.1 < high < 0.1
    assert result.verdict == "inconclusive"


def test_an_inconclusive_verdict_reads_inconclusive_and_nothing_of_the_observed_effects_power():
    frame = runs({"a": [1.1, 0.95, 1.2, 1.0], "b": [1.0] * 4})
    (result,) = planned_results(frame, plan_of(Contrast("a", "b", "superiority")))
    assert result.verdict == "inconclusive" and result.design is None
    assert not {"power", "needs_seeds"} & set(vars(result))
    assert result.sentence("x").endswith("**inconclusive**; no design-time power (the preregistration names no "
                                         "pilot_runs).")


def test_a_superiority_result_holds_the_95_percent_interval_and_the_spread_of_the_differences():
    from scipy import stats

    a, b = [1.1, 0.95, 1.2, 1.0, 1.3], [1.0, 1.05, 0.9, 1.0, 1.1]
    (result,) = planned_results(runs({"a": a, "b": b}), plan_of(Contrast("a", "b", "superiority"), alpha=0.1))
    diffs = np.subtract(a, b)
    assert result.sd_difference == pytest.approx(float(np.std(diffs, ddof=1)), rel=1e-12)
    assert result.interval_level == 0.95  # whatever α: the superiority interval is 95%
    assert result.interval == pytest.approx(tuple(stats.ttest_rel(a, b).confidence_interval(0.95)), rel=1e-9)
    assert result.p_value == pytest.approx(float(stats.ttest_rel(a, b).pvalue), rel=1e-12)


# ------------------------------------------------------------------ the results in words and in a table
SUPERIORITY = PlannedResult(Contrast("p", "q", "superiority"), (0, 1, 2, 3), -0.25, 0.1, (-0.409, -0.091), 0.95,
                            0.0004, 0.0008, "better",
                            Design((0, 1, 2), -0.2, 0.05, (-0.32, -0.08), 4, 0.876, 4, (3, 7)))
EQUIVALENCE = PlannedResult(Contrast("a", "b", "equivalence", 0.05), (100, 101, 102), 0.0123, 0.02,
                            (-0.0041, 0.0287), 0.9, 0.2, 0.4, "inconclusive",
                            Design((0, 2, 5), 0.01, 0.03, (-0.06, 0.08), 3, 0.314, 12, (5, None)))


def test_a_result_sentence_gives_effect_interval_holm_p_verdict_and_the_design_line():
    assert SUPERIORITY.sentence("final_eval_loss") == (
        "p vs q (superiority): final_eval_loss -0.250 (95% interval -0.409 to -0.091), Holm p = < 0.001: **better**; "
        "design (pilot seeds 0–2, before the confirmatory runs): pilot effect -0.200 (s.d. 0.050), power 0.88 at 4 "
        "seeds; 80% power needs 4 seeds (95% interval of the pilot: 3 to 7).")
    assert EQUIVALENCE.sentence("final_eval_loss") == (
        "a vs b (equivalence, δ = 0.05): final_eval_loss +0.012 (90% interval -0.004 to +0.029), Holm p = 0.400: "
        "**inconclusive**; design (pilot seeds 0, 2, 5, before the confirmatory runs): pilot effect +0.010 (s.d. "
        "0.030), power 0.31 at 3 seeds; 80% power needs 12 seeds (95% interval of the pilot: 5 to more than 1000).")
    assert EQUIVALENCE.sentence("the loss", " nats") == (
        "a vs b (equivalence, δ = 0.05 nats): the loss +0.012 nats (90% interval -0.004 to +0.029), Holm p = 0.400: "
        "**inconclusive**; design (pilot seeds 0, 2, 5, before the confirmatory runs): pilot effect +0.010 nats "
        "(s.d. 0.030 nats), power 0.31 at 3 seeds; 80% power needs 12 seeds (95% interval of the pilot: 5 to more "
        "than 1000).")


@pytest.mark.parametrize(("p_holm", "written"), [(0.0004, "< 0.001"), (0.000999, "< 0.001"), (0.001, "0.001"),
                                                  (0.5, "0.500"), (1.0, "1.000")])
def test_a_holm_p_under_0_001_is_written_as_a_bound(p_holm, written):
    from dataclasses import replace

    assert f"Holm p = {written}: **better**" in replace(SUPERIORITY, p_holm=p_holm).sentence("x")


def test_planned_markdown_is_the_heading_the_declared_design_a_sentence_each_and_the_margin_rationale():
    plan = Preregistration("final_eval_loss", "lower", 0.05, (SUPERIORITY.contrast, EQUIVALENCE.contrast),
                           margin_rationale=" δ = 0.05 nats,\n  a quarter   of the gap.\n")
    assert planned_markdown([SUPERIORITY, EQUIVALENCE], plan, "plan.yaml") == (
        "## Planned contrasts (pre-registered: `plan.yaml`)\n"
        "\n"
        "Primary endpoint `final_eval_loss` (lower is better), α = 0.05, Holm over the 2 planned contrasts only; "
        "everything else in this report is exploratory.\n"
        "\n"
        f"- {SUPERIORITY.sentence('final_eval_loss')}\n"
        f"- {EQUIVALENCE.sentence('final_eval_loss')}\n"
        "\n"
        "Margin: δ = 0.05 nats, a quarter of the gap.\n")
    without = Preregistration("final_eval_loss", "higher", 0.1, (SUPERIORITY.contrast,))
    assert planned_markdown([SUPERIORITY], without, "p.yaml") == (
        "## Planned contrasts (pre-registered: `p.yaml`)\n\nPrimary endpoint `final_eval_loss` (higher is better), "
        "α = 0.1, Holm over the 1 planned contrasts only; everything else in this report is exploratory.\n\n"
        f"- {SUPERIORITY.sentence('final_eval_loss')}\n")


def test_verdict_lines_open_with_the_plan_and_the_seeds_then_a_sentence_each():
    from analysis.planned import verdict_lines

    plan = Preregistration("final_eval_loss", "lower", 0.05, (SUPERIORITY.contrast,), pilot_seeds=(0, 1, 2, 3))
    assert verdict_lines([SUPERIORITY], plan, "conf/p.yaml") == [
        "Planned contrasts (pre-registered in `conf/p.yaml`; final_eval_loss, lower is better, Holm over the 1 at "
        "α = 0.05), on the pilot's seeds (0, 1, 2, 3), not a confirmatory test:",
        "",
        f"- {SUPERIORITY.sentence('final_eval_loss')}",
    ]


def test_a_declared_exploratory_design_is_never_called_pre_registered(tmp_path):
    from analysis.planned import planned_markdown, verdict_lines

    plan = load_preregistration(plan_file(tmp_path, exploratory=" declared after\n a result "))
    assert plan.exploratory == "declared after a result"
    heading = verdict_lines([SUPERIORITY], plan, "conf/p.yaml")[0]
    assert heading.startswith("Exploratory contrasts (declared in `conf/p.yaml`, declared after a result; ")
    section = planned_markdown([SUPERIORITY], plan, "conf/p.yaml")
    assert section.startswith("## Declared contrasts, exploratory (`conf/p.yaml`)\n\n"
                              "Exploratory: declared after a result.")
    assert "pre-registered" not in heading + section and "planned contrasts only" not in section
    own_lr = Path(__file__).resolve().parents[2] / "conf" / "preregistration" / "own_lr.yaml"
    assert load_preregistration(own_lr).exploratory  # committed after an earlier own-lr result had been seen


def test_planned_frame_has_one_row_per_contrast_with_every_column():
    from analysis.planned import planned_frame

    frame = planned_frame([SUPERIORITY, EQUIVALENCE])
    assert frame.columns.tolist() == ["contrast", "kind", "margin", "seeds", "mean_difference", "sd_difference",
                                      "interval_low", "interval_high", "interval_level", "p_value", "p_holm",
                                      "verdict", "pilot_effect", "pilot_sd", "design_power", "design_seeds",
                                      "design_needs_seeds", "design_needs_seeds_low", "design_needs_seeds_high"]
    second = frame.iloc[1].to_dict()
    assert math.isnan(second.pop("design_needs_seeds_high"))  # more than MAX_SEEDS: empty in planned.csv
    assert second == {
        "contrast": "a vs b", "kind": "equivalence", "margin": 0.05, "seeds": 3, "mean_difference": 0.0123,
        "sd_difference": 0.02, "interval_low": -0.0041, "interval_high": 0.0287, "interval_level": 0.9,
        "p_value": 0.2, "p_holm": 0.4, "verdict": "inconclusive", "pilot_effect": 0.01, "pilot_sd": 0.03,
        "design_power": 0.314, "design_seeds": 3, "design_needs_seeds": 12, "design_needs_seeds_low": 5}
    first = frame.iloc[0].to_dict()
    assert math.isnan(first.pop("margin"))  # a superiority has none
    assert first == {
        "contrast": "p vs q", "kind": "superiority", "seeds": 4, "mean_difference": -0.25, "sd_difference": 0.1,
        "interval_low": -0.409, "interval_high": -0.091, "interval_level": 0.95, "p_value": 0.0004, "p_holm": 0.0008,
        "verdict": "better", "pilot_effect": -0.2, "pilot_sd": 0.05, "design_power": 0.876, "design_seeds": 4,
        "design_needs_seeds": 4, "design_needs_seeds_low": 3, "design_needs_seeds_high": 7}
    from dataclasses import replace

    (bare,) = planned_frame([replace(SUPERIORITY, design=None)]).to_dict("records")
    assert [bare[k] for k in ("pilot_effect", "design_power", "design_needs_seeds_high")] == [None, None, None]


def on_seeds(*seeds: int) -> PlannedResult:
    from dataclasses import replace

    return replace(SUPERIORITY, seeds=seeds)


@pytest.mark.parametrize(("results", "pilot", "confirmatory", "words"), [
    ([on_seeds(101, 100), on_seeds(100)], (0, 1), (100, 101), "the confirmatory seeds (100, 101)"),
    ([on_seeds(100)], (0, 1), (100, 101), "1 of the 2 confirmatory seeds (100; the others are not in these runs)"),
    ([on_seeds(1, 0)], (0, 1, 2), (101, 100),
     "the pilot's seeds (0, 1), not a confirmatory test; the confirmatory seeds (100, 101) are not in these runs"),
    ([on_seeds(1, 0)], (0, 1, 2), (), "the pilot's seeds (0, 1), not a confirmatory test"),
    ([on_seeds(5, 6)], (0, 1), (100,), "seeds 5, 6, neither the plan's pilot nor its confirmatory seeds"),
    ([on_seeds(5, 6)], (), (), "seeds 5, 6, neither the plan's pilot nor its confirmatory seeds"),
    ([on_seeds(0, 100)], (0, 1), (100, 101), "seeds 0, 100, neither the plan's pilot nor its confirmatory seeds"),
])
def test_seeds_words_say_whether_the_seeds_are_confirmatory_or_the_pilots(results, pilot, confirmatory, words):
    from analysis.planned import seeds_words

    plan = Preregistration("final_eval_loss", "lower", 0.05, (SUPERIORITY.contrast,), pilot, confirmatory)
    assert seeds_words(results, plan) == words


# ------------------------------------------------------------------ design-time power, from the pilot
PILOT_DIFFS = [-0.10, -0.20, -0.02, -0.10]  # a − b at pilot seeds 0-3: mean -0.105, s.d. ~0.0737
NEAR_DIFFS = [0.01, -0.02, 0.0, 0.015]  # c − b: mean 0.00125, s.d. ~0.0155, for an equivalence within 0.02


def pilot_csv(path: Path, seeds=(0, 1, 2, 3), strategies=("a", "b", "c"), drop=(), data=None) -> Path:
    """The pilot's runs.csv; ``data``: a data_fingerprint column, the value of every run or one per run."""
    rows = [{"strategy": s, "seed": seed, "final_eval_loss": 1.0 + {"a": a, "b": 0.0, "c": c}[s]}
            for seed, a, c in zip(seeds, PILOT_DIFFS, NEAR_DIFFS) for s in strategies if (s, seed) not in drop]
    frame = pd.DataFrame(rows)
    if data is not None:
        frame["data_fingerprint"] = data if isinstance(data, str) else [data[k % len(data)] for k in range(len(frame))]
    frame.to_csv(path, index=False)
    return path


def designed(tmp_path: Path, **fields) -> Path:
    """A preregistration of a vs b (superiority) and c vs b (equivalence within 0.02), α 0.05 (Holm's strictest
    step 0.025), 8 confirmatory seeds, sized on pilot.csv beside it (seeds 0-3)."""
    pilot_csv(tmp_path / "pilot.csv")
    return plan_file(tmp_path, **{
        "pilot_seeds": [0, 1, 2, 3], "pilot_runs": "pilot.csv", "confirmatory_seeds": list(range(100, 108)),
        "contrasts": [{"a": "a", "b": "b", "kind": "superiority"},
                      {"a": "c", "b": "b", "kind": "equivalence", "margin": 0.02}],
        "margin_rationale": "why", **fields})


def solved(effect: float, sd: float, alpha: float) -> int:
    """statsmodels' seeds for 80% power (the paired t-test's): the first count from 2 its power reaches 0.8 at
    (solve_power's continuous answer, rounded up, can fall under 2, where no count holds)."""
    from scipy import stats
    from statsmodels.stats.power import TTestPower

    def power(n: int) -> float:  # where statsmodels' far tail underflows to nan (a huge effect), the near tail's
        value = TTestPower().power(effect_size=abs(effect) / sd, nobs=n, alpha=alpha)
        critical = stats.t.ppf(1 - alpha / 2, n - 1)
        return value if math.isfinite(value) else stats.nct.sf(critical, n - 1, abs(effect) / sd * math.sqrt(n))

    start = max(2, math.floor(TTestPower().solve_power(effect_size=abs(effect) / sd, alpha=alpha, power=0.8)) - 1)
    return next(n for n in range(start, 10_000) if power(n) >= 0.8)


def test_the_design_is_the_pilots_effect_and_spread_and_statsmodels_power_at_the_confirmatory_seeds(tmp_path):
    from scipy import stats
    from statsmodels.stats.power import TTestPower

    plan = load_preregistration(designed(tmp_path))
    assert plan.pilot_runs == "pilot.csv"
    assert [list(d) for d in plan.pilot_differences] == [pytest.approx(PILOT_DIFFS, abs=1e-12),
                                                         pytest.approx(NEAR_DIFFS, abs=1e-12)]
    confirmatory = runs({"a": [1.0, 0.9, 1.1, 1.0, 0.95, 1.05, 1.0, 1.02], "b": [1.0] * 8,
                         "c": [1.005, 0.996, 1.0, 1.003, 0.998, 1.001, 0.997, 1.0]})
    confirmatory["seed"] += 100
    superiority, equivalence = (r.design for r in planned_results(confirmatory, plan))
    mean, sd = float(np.mean(PILOT_DIFFS)), float(np.std(PILOT_DIFFS, ddof=1))
    assert (superiority.effect, superiority.sd) == (pytest.approx(mean, abs=1e-12), pytest.approx(sd, rel=1e-9))
    assert (superiority.pilot_seeds, superiority.seeds) == ((0, 1, 2, 3), 8)
    assert superiority.power == pytest.approx(TTestPower().power(effect_size=-mean / sd, nobs=8, alpha=0.025),
                                              rel=1e-9)
    assert superiority.needed == solved(mean, sd, 0.025) == 8  # the known answer: 1.42 s.d. at α 0.025
    half = stats.t.ppf(0.975, 3) * sd / 2
    assert superiority.effect_interval == pytest.approx((mean - half, mean + half), rel=1e-9)
    assert superiority.needed_interval == (solved(mean - half, sd, 0.025), None)  # the interval reaches past 0
    # the equivalence: TOST's two one-sided powers at the pilot's effect, from scipy's noncentral t by hand
    near, near_sd = float(np.mean(NEAR_DIFFS)), float(np.std(NEAR_DIFFS, ddof=1))
    se, critical = near_sd / math.sqrt(8), stats.t.ppf(1 - 0.025, 7)
    by_hand = stats.nct.sf(critical, 7, (near + 0.02) / se) + stats.nct.cdf(-critical, 7, (near - 0.02) / se) - 1
    assert equivalence.power == pytest.approx(by_hand, rel=1e-9) and 0.7 < by_hand < 0.8
    assert equivalence.power == pytest.approx(tost_bound_by_simulation(near, near_sd, 8, 0.025, 0.02), abs=0.01)
    assert equivalence.needed == min(n for n in range(2, 60)
                                     if equivalence_power(near, near_sd, n, 0.025, 0.02) >= 0.8) == 9


def test_the_needed_seeds_interval_brackets_the_point_and_moves_with_the_pilots_effect():
    """Shifting the pilot's differences (the s.d. held): a superiority needs fewer seeds at every end as the effect
    grows, an equivalence more as it nears δ; each interval brackets its point, and one holding zero reaches past
    MAX_SEEDS for a superiority and holds the fewest seeds for an equivalence."""
    from analysis.planned import MAX_SEEDS, design_of

    def count(n):
        return MAX_SEEDS + 1 if n is None else n

    spread = np.array([-0.06, 0.04, 0.0, 0.02])
    superiority, equivalence = Contrast("a", "b", "superiority"), Contrast("a", "b", "equivalence", 0.1)
    plan = Preregistration("final_eval_loss", "lower", 0.05, (superiority, equivalence), (0, 1, 2, 3), (7, 8))
    seen = []
    for effect in (0.05, 0.08, 0.12, 0.2):  # needs 10 (4 to more than 1000), 6 (4 to 143), 4 (4 to 10), 3 (3 to 4)
        design = design_of(superiority, tuple(spread + effect), plan)
        low, high = (count(n) for n in design.needed_interval)
        assert low <= count(design.needed) <= high
        ends = design.effect_interval
        assert low == solved(max(ends, key=abs), design.sd, 0.025)  # the end farther from zero
        assert high == (MAX_SEEDS + 1 if ends[0] < 0 < ends[1] else solved(min(ends, key=abs), design.sd, 0.025))
        seen.append((low, count(design.needed), high))
    assert all(a >= b for earlier, later in zip(seen, seen[1:]) for a, b in zip(earlier, later))
    assert [row[1] for row in seen] == [10, 6, 4, 3] and seen[0][2] == MAX_SEEDS + 1 > seen[1][2] > seen[2][2]
    seen = []
    for effect in (0.0, 0.02, 0.04, 0.06):  # needs 5 (5 to 18), 5 (5 to 118), 7 (5 to more), 12 (5 to more)
        design = design_of(equivalence, tuple(spread + effect), plan)
        low, high = (count(n) for n in design.needed_interval)
        assert low <= count(design.needed) <= high
        assert design.effect_interval[0] < 0 < design.effect_interval[1]  # the fewest seeds: at zero difference
        assert low == design_of(equivalence, tuple(spread - spread.mean()), plan).needed
        seen.append((low, count(design.needed), high))
    assert all(a <= b for earlier, later in zip(seen, seen[1:]) for a, b in zip(earlier, later))
    assert [row[1] for row in seen] == [5, 5, 7, 12] and seen[0][2] < seen[1][2] < seen[2][2] == MAX_SEEDS + 1


def test_the_planned_section_gives_the_pilots_power_and_never_the_confirmatory_runs(tmp_path):
    """Confirmatory runs whose own effect is far weaker than the pilot's: their observed power and the seeds it
    would ask for appear nowhere (section, summary opening, planned.csv); the design line gives the pilot's."""
    from statsmodels.stats.power import TTestPower

    from analysis.planned import planned_frame, verdict_lines

    plan = load_preregistration(designed(tmp_path))
    a = [1.0, 0.94, 1.05, 0.97, 1.01, 0.96, 1.03, 0.98]  # a − b: mean -0.0075, s.d. ~0.035
    confirmatory = runs({"a": a, "b": [1.0] * 8, "c": [1.005, 0.996, 1.0, 1.003, 0.998, 1.001, 0.997, 1.0]})
    confirmatory["seed"] += 100
    results = planned_results(confirmatory, plan)
    first = results[0]
    observed = TTestPower().power(effect_size=abs(first.mean_difference) / first.sd_difference, nobs=8, alpha=0.025)
    asked = solved(first.mean_difference, first.sd_difference, 0.025)
    design = first.design
    assert observed < 0.2 < 0.8 < design.power and asked > 100  # the two are far apart
    text = planned_markdown(results, plan, "plan.yaml") + "\n".join(verdict_lines(results, plan, "plan.yaml"))
    import re

    assert re.findall(r"power (\d\.\d\d) at", text) == [f"{r.design.power:.2f}" for r in results] * 2
    assert f"{observed:.2f} at" not in text and f"{asked} seeds" not in text and "needs_seeds" not in text
    assert (f"**inconclusive**; design (pilot seeds 0–3, before the confirmatory runs): pilot effect -0.105 (s.d. "
            f"0.074), power 0.85 at 8 seeds; 80% power needs 8 seeds (95% interval of the pilot: "
            f"{design.needed_interval[0]} to more than 1000).") in text
    frame = planned_frame(results)
    assert not {"power", "needs_seeds"} & set(frame.columns)
    assert frame["design_power"].tolist() == [r.design.power for r in results]


def test_a_design_without_confirmatory_seeds_gives_the_seeds_it_needs_and_no_power():
    from analysis.planned import design_of

    contrast = Contrast("a", "b", "superiority")
    design = design_of(contrast, tuple(PILOT_DIFFS), Preregistration("x", "lower", 0.05, (contrast,), (4, 5, 6, 7)))
    assert design.seeds == 0 and math.isnan(design.power) and design.needed == solved(-0.105, design.sd, 0.05)
    assert design.words().startswith("design (pilot seeds 4–7, before the confirmatory runs): pilot effect -0.105 "
                                     "(s.d. 0.074), 80% power needs ")
    huge = design_of(contrast, (1.0, 1.01, 0.99), Preregistration("x", "lower", 0.05, (contrast,), (0, 1, 2)))
    assert huge.needed == 2 and huge.needed_interval == (2, 2)  # 100 s.d.: two pairs are enough
    for seeds, words in (((3, 5), "3, 5"), ((1, 0), "0, 1"), ((2, 0, 1), "0–2"), ((0, 1, 3), "0, 1, 3")):
        plan = Preregistration("x", "lower", 0.05, (contrast,), seeds, (9, 10))
        assert design_of(contrast, (0.1, 0.2, 0.15)[:len(seeds)], plan).words().startswith(
            f"design (pilot seeds {words}, before"), seeds


def test_the_fields_read_from_the_file_are_its_keys_and_the_pilots_differences_are_read_from_pilot_runs(tmp_path):
    import dataclasses

    from analysis.planned import KEYS

    fields = {f.name: f.metadata for f in dataclasses.fields(Preregistration)}
    assert fields.pop("pilot_differences") == {"read_from": "pilot_runs"}  # no key of the file: the config reference
    assert set(fields) == KEYS                                             # leaves it out
    two = designed(tmp_path, pilot_seeds=[0, 1])  # the fewest seeds that give a spread
    pilot_csv(tmp_path / "pilot.csv", seeds=(0, 1))
    assert load_preregistration(two).pilot_differences == (((1.0 - 0.10) - 1.0, (1.0 - 0.20) - 1.0),
                                                           ((1.0 + 0.01) - 1.0, (1.0 - 0.02) - 1.0))


def test_the_committed_plans_read_their_pilots_and_a_relative_pilot_is_found_above_the_plan(tmp_path, monkeypatch):
    for name, pilot in (("strategies", "docs/demo/pilot_runs.csv"), ("study_real", "docs/study-real/pilot_runs.csv"),
                        ("study_real_amended", "docs/study-real/amended_pilot_runs.csv")):
        plan = load_preregistration(ROOT / "conf" / "preregistration" / f"{name}.yaml")
        frame = pd.read_csv(ROOT / pilot)
        assert plan.pilot_runs == pilot and len(plan.pilot_differences) == len(plan.contrasts)
        for contrast, differences in zip(plan.contrasts, plan.pilot_differences):
            values = frame.pivot_table(index="seed", columns="strategy", values="final_eval_loss")
            assert differences == tuple(values[contrast.a] - values[contrast.b])
    assert load_preregistration(ROOT / "conf" / "preregistration" / "own_lr.yaml").pilot_differences == ()
    nested = tmp_path / "conf" / "plans"
    nested.mkdir(parents=True)
    (tmp_path / "data").mkdir()
    pilot_csv(tmp_path / "data" / "pilot.csv")
    fields = {"pilot_seeds": [0, 1, 2, 3], "pilot_runs": "data/pilot.csv",
              "contrasts": [{"a": "a", "b": "b", "kind": "superiority"}]}
    assert len(load_preregistration(plan_file(nested, **fields)).pilot_differences) == 1  # found two folders up
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(tmp_path)  # a plan outside the repository, read from its root
    assert len(load_preregistration(plan_file(elsewhere, **fields)).pilot_differences) == 1
    absolute = {**fields, "pilot_runs": str(tmp_path / "data" / "pilot.csv")}
    monkeypatch.chdir(elsewhere)
    assert len(load_preregistration(plan_file(elsewhere, **absolute)).pilot_differences) == 1


@pytest.mark.parametrize(("fields", "pilot", "message"), [
    ({"pilot_runs": "absent.csv"}, {},
     "pilot_runs='absent.csv': no such file (relative to the repository root, which holds the preregistration, or to "
     "the working directory); give the pilot's runs.csv, e.g. docs/demo/pilot_runs.csv, or leave pilot_runs out"),
    ({"pilot_runs": 3}, {}, "pilot_runs=3: give the pilot's runs.csv as a path relative to the repository root, "
                            "e.g. docs/demo/pilot_runs.csv"),
    ({"pilot_seeds": [0, 1, 2, 4]}, {},
     "pilot_runs pilot.csv holds seeds [0, 1, 2, 3], pilot_seeds declares [0, 1, 2, 4]: declare the seeds the pilot "
     "ran (pilot_seeds), or name its runs"),
    ({"pilot_seeds": ...}, {},
     "pilot_runs pilot.csv holds seeds [0, 1, 2, 3], pilot_seeds declares []: declare the seeds the pilot ran "
     "(pilot_seeds), or name its runs"),
    ({"pilot_seeds": [0]}, {"seeds": (0,)},
     "pilot_seeds [0]: a pilot sizes the design from the spread over its seeds; give 2 or more"),
    ({}, {"strategies": ("a", "b")},
     "pilot_runs pilot.csv has no run of ['c'] (contrasts[1], c vs b): pilot every planned strategy, or leave "
     "pilot_runs out"),
    ({}, {"drop": {("b", 2)}},
     "pilot_runs pilot.csv pairs a vs b (contrasts[0]) on seeds [0, 1, 3] of pilot_seeds [0, 1, 2, 3]: rerun the "
     "pilot's missing runs"),
    ({"endpoint": "tau"}, {},
     "pilot_runs pilot.csv has no column ['tau']: give the pilot's runs.csv (batchlab-report's, of the declared "
     "design)"),
])
def test_a_pilot_that_cannot_size_the_design_is_refused_naming_the_file_the_field_and_the_fix(tmp_path, fields,
                                                                                              pilot, message):
    path = designed(tmp_path, **fields)
    pilot_csv(tmp_path / "pilot.csv", **pilot)
    assert refusal(path) == f"{path}: {message}"


def test_a_pilot_on_other_data_than_the_declared_artefact_is_refused_and_one_on_it_sizes_the_design(tmp_path):
    """A declared artefact binds the pilot too: a design sized on other bytes than the ones it tests is refused."""
    path = designed(tmp_path, artefact=DECLARED)
    pilot_csv(tmp_path / "pilot.csv", data=DECLARED)
    assert len(load_preregistration(path).pilot_differences) == 2
    pilot_csv(tmp_path / "pilot.csv", data=(DECLARED, "399f81088cda77"))
    assert refusal(path) == (f"{path}: pilot_runs pilot.csv trained on the data 399f81088cda, the design is declared "
                             "on 1e33cfcfa104 (artefact): size it from a pilot on the declared data")
    pilot_csv(tmp_path / "pilot.csv")
    assert refusal(path) == (f"{path}: pilot_runs pilot.csv has no data_fingerprint column, so nothing shows that the "
                             "pilot trained on the declared data 1e33cfcfa104 (artefact): give the pilot's runs.csv as "
                             "batchlab-report writes it")
    assert len(load_preregistration(designed(tmp_path)).pilot_differences) == 2  # no artefact declared: not checked


def test_seeds_needed_bisects_asking_few_powers():
    from analysis.planned import seeds_needed

    asked = []

    def power(n: int) -> float:
        asked.append(n)
        return float(n >= 377)

    assert seeds_needed(power, 2) == 377 and len(asked) <= 12 and asked[:2] == [2, 1000]
    asked.clear()
    assert seeds_needed(power, 1001) is None and asked == []
    assert seeds_needed(lambda n: float(n >= 1000), 1000) == 1000  # MAX_SEEDS itself is tried
    assert seeds_needed(lambda n: 0.8, 5) == 5  # reaching the target at the start is enough
    assert seeds_needed(lambda n: float(n >= 3), 2) == 3 and seeds_needed(lambda n: float(n >= 999), 2) == 999
    assert seeds_needed(lambda n: math.nan, 2) is None  # no spread: no power, no count
