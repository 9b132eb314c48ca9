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


def test_verdicts_are_set_side_by_side_and_said_to_agree_or_differ():
    here = [result("packed", "sorted", "better", -0.2), result("bucketed", "sorted", "no difference found", 0.01),
            result("packed", "shuffle", "inconclusive", 0.03, "equivalence"),
            result("packed", "bucketed", "better", -0.1)]
    there = [result("packed", "sorted", "better", -0.4, seeds=12), result("bucketed", "sorted", "better", -0.1),
             result("packed", "shuffle", "inconclusive", 0.02, "equivalence")]
    lines = agreement_lines(here, there, "here", "the main job")
    assert lines[0] == ("packed vs sorted (superiority): **agrees** — here better, -0.200 [-0.300, -0.100] over 3 "
                        "seeds; the main job better, -0.400 [-0.500, -0.300] over 12 seeds.")
    assert lines[1].startswith("bucketed vs sorted (superiority): **differs** — here no difference found")
    assert "**agrees**" in lines[2]
    assert lines[3].endswith("not a contrast of the main job.")
    section = agreement_section(here, there, "here", "the main job", "docs/demo/runs.csv")
    assert section[0].startswith("Against the main job (its runs: `docs/demo/runs.csv`), the verdicts agree on 2 of 4")


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
    assert "Against the main job (its runs: `docs/demo/runs.csv`), the verdicts agree on 2 of 4" in done.stdout
    assert "- packed vs sorted (superiority): **differs** — here worse, +0." in done.stdout
    assert "; the main job better, -0." in done.stdout
    assert "- bucketed vs sorted (superiority): **agrees** — here better" in done.stdout
    # the per-strategy table is its own paragraph after the agreement's list (Markdown would run it into the list)
    assert "over 12 seeds.\n\n| strategy |" in done.stdout
    refused = subprocess.run([*command, "--agreement-with", demo], capture_output=True, text=True)
    assert refused.returncode == 2 and "give --preregistration and --agreement-preregistration too" in refused.stderr
