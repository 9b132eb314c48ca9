"""Where the real-model study's planned verdicts agree with the embedded default's (analysis/agreement.py)."""

from __future__ import annotations

import subprocess
import sys

import pandas as pd

from analysis.agreement import agreement_lines, agreement_section
from analysis.planned import Contrast, PlannedResult


def result(a, b, verdict, mean, kind="superiority", seeds=3):
    return PlannedResult(Contrast(a, b, kind, 0.05 if kind == "equivalence" else None), tuple(range(seeds)), mean, 0.1,
                         (mean - 0.1, mean + 0.1), 0.95, 0.01, 0.02, verdict)


def test_verdicts_are_set_side_by_side_and_said_to_agree_conflict_or_be_undecided():
    here = [result("packed", "sorted", "better", -0.2), result("bucketed", "sorted", "no difference found", 0.01),
            result("packed", "shuffle", "inconclusive", 0.03, "equivalence"),
            result("packed", "bucketed", "better", -0.1)]
    there = [result("packed", "sorted", "better", -0.4, seeds=12), result("bucketed", "sorted", "better", -0.1),
             result("packed", "shuffle", "inconclusive", 0.02, "equivalence")]
    lines = agreement_lines(here, there, "here", "the main job")
    assert lines[0] == ("packed vs sorted (superiority): **agrees** — here better, -0.200 [-0.300, -0.100] over 3 "
                        "seeds; the main job better, -0.400 [-0.500, -0.300] over 12 seeds.")
    # undecided here, its effect against the other's direction: neither an agreement nor a conflict
    assert lines[1].startswith("bucketed vs sorted (superiority): **one inconclusive** — here no difference found")
    assert "**agrees**" in lines[2]
    assert lines[3].endswith("not a contrast of the main job.")
    section = agreement_section(here, there, "here", "the main job", "docs/demo/runs.csv")
    assert section[0] == ("Against the main job (its runs: `docs/demo/runs.csv`), the verdicts agree on 2 of 4 planned "
                          "contrasts and conflict on 0; on 1 one design is inconclusive, 0 of them with its effect in "
                          "the other's direction (effects in each design's own nats; verdicts and directions are "
                          "compared, not sizes):")


def test_an_undecided_effect_in_the_decided_direction_is_said_so_and_two_decisions_that_differ_conflict():
    from analysis.agreement import relation

    decided = result("bucketed", "sorted", "better", -0.1)
    assert relation(result("bucketed", "sorted", "inconclusive", -0.05), decided) == "one inconclusive, same direction"
    assert relation(decided, result("bucketed", "sorted", "inconclusive", -0.05)) == "one inconclusive, same direction"
    assert relation(result("bucketed", "sorted", "inconclusive", 0.05), decided) == "one inconclusive"
    assert relation(result("bucketed", "sorted", "worse", 0.05), decided) == "conflicts"
    assert relation(result("a", "b", "inconclusive", 0.1), result("a", "b", "no difference found", -0.1)) == "agrees"
    equivalent = result("p", "s", "equivalent within δ", 0.01, "equivalence")
    assert relation(result("p", "s", "inconclusive", 0.01, "equivalence"), equivalent) == "one inconclusive"
    assert relation(result("p", "s", "not equivalent", 0.3, "equivalence"), equivalent) == "conflicts"
    lines = agreement_section([result("bucketed", "sorted", "inconclusive", -0.05)], [decided], "here", "there", "x")
    assert "agree on 0 of 1 planned contrasts and conflict on 0; on 1 one design is inconclusive, 1 of them" in lines[0]


def test_the_cli_adds_the_agreement_after_the_answer_and_refuses_it_without_both_plans(tmp_path):
    """The main job's own runs against a copy whose packed runs lose 1 nat: the packed contrasts differ, the
    bucketed ones agree."""
    demo, plan = "docs/demo/runs.csv", "conf/preregistration/strategies.yaml"
    here = pd.read_csv(demo)
    here.loc[here["strategy"] == "packed", "final_eval_loss"] += 1.0
    here.to_csv(tmp_path / "here.csv", index=False)
    command = [sys.executable, "-m", "harness.cli.report", "--from-runs-csv", str(tmp_path / "here.csv"),
               "--preregistration", plan]
    done = subprocess.run([*command, "--agreement-with", demo, "--agreement-preregistration", plan,
                           "--agreement-name", "the main job"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert ("Against the main job (its runs: `docs/demo/runs.csv`), the verdicts agree on 2 of 4 planned contrasts and "
            "conflict on 2 (effects") in done.stdout
    assert "- packed vs sorted (superiority): **conflicts** — here worse, +0." in done.stdout
    assert "; the main job better, -0." in done.stdout
    assert "- bucketed vs sorted (superiority): **agrees** — here better" in done.stdout
    # the per-strategy table is its own paragraph after the agreement's list (Markdown would run it into the list)
    assert "over 12 seeds.\n\n| strategy |" in done.stdout
    refused = subprocess.run([*command, "--agreement-with", demo], capture_output=True, text=True)
    assert refused.returncode == 2 and "give --preregistration and --agreement-preregistration too" in refused.stderr
