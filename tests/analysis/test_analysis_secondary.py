"""A declared secondary endpoint (analysis/planned.py): its own family, read with the file's seeds and pilot, tested
with its own Holm, reported after the primary's verdicts with how the two combine; the amended main-job design
follows from its pilot."""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd
import pytest
from scipy import stats
from statsmodels.stats.multitest import multipletests

from analysis.planned import load_preregistration, planned_results
from analysis.summary import read_runs_csv, summary_markdown
from support.preregistration import plan_file, refusal

ROOT = Path(__file__).resolve().parents[2]
AMENDED = ROOT / "conf" / "preregistration" / "strategies_amended.yaml"
PILOT = ROOT / "docs" / "demo" / "pilot_runs.csv"
SUPERIORITY = [{"a": "x", "b": "y", "kind": "superiority"}]


def test_the_secondary_family_takes_the_files_seeds_alpha_and_pilot_and_its_own_contrasts(tmp_path):
    path = plan_file(tmp_path, alpha=0.1, pilot_seeds=[0, 1], confirmatory_seeds=[5, 6], interval="seeds",
                     secondary={"endpoint": "final_eval_tau_real", "better": "higher",
                                "contrasts": [{"a": "x", "b": "z", "kind": "equivalence", "margin": 0.08}],
                                "margin_rationale": "a quarter of the gap"},
                     combine=" loss decides;\n tau  agrees ")
    plan = load_preregistration(path)
    family = plan.secondary
    assert (family.endpoint, family.better, family.alpha) == ("final_eval_tau_real", "higher", 0.1)
    assert (family.pilot_seeds, family.confirmatory_seeds) == ((0, 1), (5, 6))
    assert [c.name for c in family.contrasts] == ["x vs z"] and family.contrasts[0].margin == 0.08
    assert family.margin_rationale == "a quarter of the gap" and family.secondary is None
    assert plan.combine == "loss decides; tau agrees" and [c.name for c in plan.contrasts] == ["x vs y"]
    assert load_preregistration(plan_file(tmp_path)).secondary is None


@pytest.mark.parametrize(("fields", "message"), [
    ({"secondary": {"endpoint": "final_eval_tau_real", "better": "higher", "contrasts": SUPERIORITY}},
     "a secondary endpoint needs combine: say, before the runs, how the two endpoints' verdicts combine into the "
     "answer"),
    ({"combine": "loss decides"}, "combine without a secondary endpoint; declare secondary, or leave combine out"),
    ({"secondary": {"endpoint": "t", "better": "higher", "alpha": 0.1}, "combine": "c"},
     "secondary={'alpha': 0.1, 'better': 'higher', 'endpoint': 't'}: give {endpoint, better, contrasts, "
     "margin_rationale} (the second endpoint's own family; seeds, alpha, data and pilot are the file's)"),
    ({"secondary": {"endpoint": "t", "better": "up", "contrasts": SUPERIORITY}, "combine": "c"},
     "secondary.better='up': give 'lower' or 'higher' (which way the endpoint improves)"),
    ({"secondary": {"endpoint": "t", "better": "higher", "contrasts": []}, "combine": "c"},
     "secondary: no planned contrast; give at least one under contrasts"),
    ({"secondary": {"endpoint": "t", "better": "higher", "contrasts": [{"a": "x", "b": "y", "kind": "equivalence"}]},
      "combine": "c"},
     "secondary.contrasts[0] (x vs y) is an equivalence test: give its margin (> 0, the endpoint's units) and say why "
     "in margin_rationale"),
    ({"secondary": {"endpoint": "final_eval_loss", "better": "lower", "contrasts": SUPERIORITY}, "combine": "c"},
     "secondary.endpoint='final_eval_loss' is the primary endpoint; give another"),
])
def test_a_secondary_it_cannot_use_is_refused_naming_the_field(tmp_path, fields, message):
    path = plan_file(tmp_path, **fields)
    assert refusal(path) == f"{path}: {message}"


def test_the_secondary_verdicts_are_its_own_holm_family_after_the_primarys():
    """The amended plan on the main job's first confirmatory runs (docs/demo/runs.csv): τ real's verdicts recomputed
    here with scipy and statsmodels, Holm over its four alone."""
    plan = load_preregistration(AMENDED)
    runs = read_runs_csv(ROOT / "docs" / "demo" / "runs.csv")
    results = planned_results(runs, plan.secondary)
    pivot = runs.pivot_table(index="seed", columns="strategy", values="final_eval_tau_real")
    raw = []
    for contrast in plan.secondary.contrasts:
        a, b = pivot[contrast.a].dropna(), pivot[contrast.b].dropna()
        if contrast.kind == "superiority":
            raw.append(stats.ttest_rel(a, b).pvalue)
        else:
            diffs = (a - b).to_numpy()
            se = diffs.std(ddof=1) / math.sqrt(len(diffs))
            lower = stats.t.sf((diffs.mean() + contrast.margin) / se, len(diffs) - 1)
            upper = stats.t.cdf((diffs.mean() - contrast.margin) / se, len(diffs) - 1)
            raw.append(max(lower, upper))
    holm = multipletests(raw, alpha=0.05, method="holm")[1]
    assert [r.p_holm for r in results] == pytest.approx(list(holm), rel=1e-9)
    assert results[0].verdict == "better"  # packed's τ real above sorted's on every one of these seeds
    summary = summary_markdown(runs, plan, "conf/preregistration/strategies_amended.yaml")
    primary = summary.index("Planned contrasts (pre-registered in `conf/preregistration/strategies_amended.yaml`")
    secondary = summary.index("Secondary endpoint (declared in `conf/preregistration/strategies_amended.yaml`; "
                              "final_eval_tau_real, higher is better, its own Holm over the 4 at α = 0.05)")
    combine = summary.index(f"How the endpoints combine (declared with them): {plan.combine}")
    assert primary < secondary < combine
    assert f"- {results[3].sentence('final_eval_tau_real')}" in summary


def test_the_amended_design_follows_from_its_pilot_and_runs_on_fresh_seeds():
    """τ real's δ ≤ a quarter of the pilot's shuffle − sorted gap (the loss family's rule), each contrast's need at
    80% power stated, and confirmatory seeds no earlier run used."""
    plan = load_preregistration(AMENDED)
    pilot = pd.read_csv(PILOT)
    means = pilot.groupby("strategy")["final_eval_tau_real"].mean()
    gap = means["shuffle"] - means["sorted"]
    family = plan.secondary
    assert f"{gap:.3f} τ" in family.margin_rationale and f"{gap / 4:.3f}" in family.margin_rationale
    (equivalence,) = [c for c in family.contrasts if c.kind == "equivalence"]
    assert equivalence.margin <= gap / 4
    text = " ".join(AMENDED.read_text().replace("#", " ").split())
    designs = [r.design for r in planned_results(pilot, family)]
    for contrast, design in zip(family.contrasts, designs):
        assert f" {design.needed}" in text, contrast
        if design.needed > len(plan.confirmatory_seeds):
            assert f"{design.effect:+.3f} τ" in text, contrast
    assert f"about {designs[1].power:.0%} power at 12 seeds" in text
    first = load_preregistration(ROOT / "conf" / "preregistration" / "strategies.yaml")
    used = {*first.pilot_seeds, *first.confirmatory_seeds, 200, 201}  # 200-201: the lr sweep's tuning seeds
    assert not set(plan.confirmatory_seeds) & used and len(plan.confirmatory_seeds) == plan.seed_budget == 12
    assert (plan.contrasts, plan.alpha, plan.artefact) == (first.contrasts, first.alpha, first.artefact)
    makefile = (ROOT / "Makefile").read_text()
    assert "${batchlab_seeds:strategies_amended/confirmatory}" in makefile.replace("$$", "$")


def test_the_real_studys_amended_design_names_its_shipped_data_follows_from_its_pilot_and_takes_fresh_seeds():
    """The real-model study amended: declared on the shipped data's fingerprint, sized from a pilot on those very
    bytes (a pilot on other data is refused when the file is read), each δ under a quarter of the pilot's gap on its
    endpoint, each contrast's need at 80% power stated, and confirmatory seeds no earlier run of the study used."""
    import json
    import re

    path = ROOT / "conf" / "preregistration" / "study_real_amended.yaml"
    plan = load_preregistration(path)
    shipped = json.loads((ROOT / "harness/data/bundled/sharegpt_smollm2/manifest.json").read_text())["fingerprint"]
    pilot = pd.read_csv(ROOT / plan.pilot_runs)
    assert plan.artefact == shipped and set(pilot["data_fingerprint"]) == {shipped}
    text = " ".join(path.read_text().replace("#", " ").split())
    for family, gap in ((plan, "sorted - shuffle"), (plan.secondary, "shuffle - sorted")):
        means = pilot.groupby("strategy")[family.endpoint].mean()
        first, second = gap.split(" - ")
        difference = means[first] - means[second]
        (equivalence,) = [c for c in family.contrasts if c.kind == "equivalence"]
        assert 0 < equivalence.margin <= difference / 4, family.endpoint
        assert f"({difference:.{3 if family is plan else 4}f} " in family.margin_rationale
        for result in planned_results(pilot, family):
            need = "more than 1000" if result.design.needed is None else str(result.design.needed)
            assert re.search(rf"{result.contrast.a} vs {result.contrast.b}(’s|'s equivalence)? {need} \(", text), \
                (family.endpoint, result.contrast.name, need)
            assert f"{result.design.power:.2f}" in text
    first = load_preregistration(ROOT / "conf" / "preregistration" / "study_real.yaml")
    used = {*first.pilot_seeds, *first.confirmatory_seeds, *plan.pilot_seeds, 200, 201}  # 200-201: the lr sweep's
    assert not set(plan.confirmatory_seeds) & used and len(plan.confirmatory_seeds) == plan.seed_budget
    assert (plan.contrasts[:3], plan.alpha) == (first.contrasts[:3], first.alpha)
    assert plan.combine.startswith(load_preregistration(AMENDED).combine)  # the main job's rule, unchanged
    makefile = (ROOT / "Makefile").read_text().replace("$$", "$")
    assert "${batchlab_seeds:study_real_amended/confirmatory}" in makefile
    assert "--preregistration conf/preregistration/study_real_amended.yaml" in makefile
    pilot_line = re.search(r"experiment=study_real seed=([\d,]+)", makefile).group(1)  # make study-pilot's seeds
    assert sorted(int(s) for s in pilot_line.split(",")) == sorted(plan.pilot_seeds)
