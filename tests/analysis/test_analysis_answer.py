"""The summary's answer after the verdicts (analysis/answer.py): the throughput sentence's ratios and intervals, the
mechanism's parts oriented as each planned contrast, both checked against hand computations, and the CLI flags."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from support.analysis import REPO

from analysis.answer import answer_lines, mechanism_sentences, read_throughput_rounds, throughput_sentence
from harness.cli.report import main
from analysis.load import EPOCH_NORMALISER, STEP_NORMALISER
from analysis.planned import Contrast

# t(0.975, 2) = 4.302653 (tables); three rounds with ratios 1.1, 1.2, 1.3: s.d. 0.1, half width 4.302653 * 0.1 / √3
HALF = 4.302653 * 0.1 / 3 ** 0.5


def _rounds() -> pd.DataFrame:
    rows = []
    for index, (sorted_speed, packed, shuffle) in enumerate([(100.0, 110.0, 50.0), (200.0, 240.0, 104.0),
                                                             (100.0, 130.0, 54.0)]):
        rows += [{"round": index, "strategy": "sorted", "tokens_per_second": sorted_speed, "padding_ratio": 0.02},
                 {"round": index, "strategy": "packed", "tokens_per_second": packed, "padding_ratio": 0.0},
                 {"round": index, "strategy": "shuffle", "tokens_per_second": shuffle, "padding_ratio": 0.4}]
    return pd.DataFrame(rows)


def test_the_throughput_sentence_gives_each_rounds_ratio_with_its_t_interval():
    sentence = throughput_sentence(_rounds(), ["sorted", "packed", "shuffle"], "rounds.csv")
    # packed: 1.1, 1.2, 1.3 → 1.20 [1.20 − HALF, 1.20 + HALF]; shuffle: 0.50, 0.52, 0.54 → 0.52 ± HALF / 5
    assert f"packed 1.20× [{1.2 - HALF:.2f}, {1.2 + HALF:.2f}] (0.0% padding)" in sentence
    assert f"shuffle 0.52× [{0.52 - HALF / 5:.2f}, {0.52 + HALF / 5:.2f}] (40.0% padding)" in sentence
    assert "Intervals that exclude 1: slower: shuffle." in sentence  # packed's interval [0.95, 1.45] holds 1
    assert "3 interleaved rounds" in sentence and "sorted pads 2.0%" in sentence
    fast = _rounds()
    fast.loc[fast["strategy"] == "packed", "tokens_per_second"] *= 2
    assert "faster than sorted: packed; slower: shuffle" in throughput_sentence(fast, ["packed", "shuffle"], "r")


def test_a_rounds_table_without_its_columns_is_refused_naming_the_command(tmp_path):
    path = tmp_path / "rounds.csv"
    _rounds().drop(columns="padding_ratio").to_csv(path, index=False)
    with pytest.raises(ValueError, match=r"padding_ratio.*train_throughput.py --experiment strategies --write"):
        read_throughput_rounds(path)


def _ablation() -> pd.DataFrame:
    """sorted and packed in both normaliser arms over seeds 0-2, held-out loss chosen so that the parts are known."""
    losses = {("sorted", STEP_NORMALISER): [1.40, 1.50, 1.45], ("sorted", EPOCH_NORMALISER): [1.38, 1.46, 1.44],
              ("packed", STEP_NORMALISER): [1.20, 1.25, 1.24], ("packed", EPOCH_NORMALISER): [1.22, 1.27, 1.24]}
    return pd.DataFrame([{"strategy_name": s, "strategy": s, "loss_normaliser": arm, "seed": seed,
                          "final_eval_loss": loss, "final_eval_tau_real": 3.0 - loss}
                         for (s, arm), values in losses.items() for seed, loss in enumerate(values)])


def test_the_mechanism_is_oriented_as_each_planned_contrast():
    # packed − sorted per seed: step Σw -0.20, -0.25, -0.21 (mean -0.22); constant -0.16, -0.19, -0.20 (mean
    # -0.183333); the reweighting's part = step − constant: -0.04, -0.06, -0.01 (mean -0.036667)
    lines = mechanism_sentences(_ablation(), [Contrast("packed", "sorted", "superiority")], "final_eval_loss", "abl")
    assert lines[0].startswith("The mechanism (`abl`, final_eval_loss on seeds 0, 1, 2;")
    assert lines[2].startswith("- packed − sorted: -0.220 [")
    assert "reweighting accounts for -0.037 [" in lines[2] and "and -0.183 [" in lines[2]
    flipped = mechanism_sentences(_ablation(), [Contrast("sorted", "packed", "superiority")], "final_eval_loss", "abl")
    assert flipped[2].startswith("- sorted − packed: +0.220 [") and "accounts for +0.037 [" in flipped[2]
    # the interval flips with the sign: packed − sorted's [low, high] is sorted − packed's [−high, −low]
    low, high = (float(x) for x in lines[2].split("-0.220 [")[1].split("]")[0].split(", "))
    assert flipped[2].startswith(f"- sorted − packed: +0.220 [{-high:+.3f}, {-low:+.3f}]")
    # a contrast the ablation did not run says nothing
    assert mechanism_sentences(_ablation(), [Contrast("bucketed", "shuffle", "superiority")], "final_eval_loss",
                               "abl") == []
    assert answer_lines([Contrast("packed", "sorted", "superiority")], "final_eval_loss", ["packed"],
                        (_rounds(), "r"), (_ablation(), "abl"))[2].startswith("The mechanism")


def test_the_cli_reads_both_tables_into_the_summary(tmp_path, capsys):
    rounds, ablation = tmp_path / "rounds.csv", tmp_path / "ablation.csv"
    _rounds().to_csv(rounds, index=False)
    _ablation().to_csv(ablation, index=False)
    runs = str(REPO / "docs" / "demo" / "runs.csv")
    plan = str(REPO / "conf" / "preregistration" / "strategies.yaml")
    assert main(["--from-runs-csv", runs, "--mechanism-runs", str(ablation)]) == 2
    assert "give --preregistration too" in capsys.readouterr().err
    assert main(["--from-runs-csv", runs, "--preregistration", plan, "--throughput-rounds", str(rounds)]) == 0
    text = capsys.readouterr().out
    assert text.index("- packed vs shuffle (equivalence") < text.index("Throughput each strategy buys") < \
        text.index("| strategy |")
    assert main(["--from-runs-csv", runs, "--preregistration", plan, "--mechanism-runs", str(tmp_path / "none.csv")]) \
        == 2 and "cannot read" in capsys.readouterr().err


def test_the_frontier_plots_the_benchmarks_ratios_against_the_length_mix_excess():
    """With the interleaved rounds, the frontier's y is each strategy's mean ratio over rounds (its error bar the
    95 % interval) and its x the mean length-mix excess over seeds; without them, the sweep's own ratios."""
    from analysis.answer import ratio_table
    from analysis.figures import StrategyStyle, frontier

    per_run = pd.DataFrame([{"strategy": s, "seed": seed, "length_mix_excess": x + 0.01 * seed, "recurrence": 0.5,
                             "relative_throughput": 1.0, "recurrence_kind": "step"}
                            for s, x in (("sorted", 1.4), ("packed", 0.0), ("shuffle", 0.01)) for seed in range(3)])
    per_run.attrs["reference"] = "sorted"
    ratios = ratio_table(_rounds())
    assert ratios["packed"] == pytest.approx((1.2, 1.2 - HALF, 1.2 + HALF))
    style = StrategyStyle(["sorted", "packed", "shuffle"])
    axis = frontier(per_run, style, throughput=ratios).axes[0]
    centres = [line.get_xydata()[0] for line in axis.lines if line.get_markersize() == 9]
    np.testing.assert_allclose(centres, [(1.41, 1.0), (0.01, 1.2), (0.02, 0.52)], rtol=1e-9)
    assert "interleaved rounds" in axis.get_ylabel()
