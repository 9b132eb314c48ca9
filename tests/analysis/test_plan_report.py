"""The plan report: table, figure and markdown from per-strategy metrics."""

import pandas as pd
import pytest

from analysis.plan_report import metrics_frame, write_plan_report

METRICS = [
    {"strategy": "sorted", "padding_efficiency": 0.995, "lag1_acf": 0.31, "recurrence": 1.0, "acf": [0.31, 0.2]},
    {"strategy": "shuffle", "padding_efficiency": 0.45, "lag1_acf": -0.01, "recurrence": 0.0, "acf": [-0.01, 0.0]},
]


def test_report_files_hold_every_strategy(tmp_path):
    paths = write_plan_report(METRICS, tmp_path)
    table = pd.read_csv(paths["csv"])
    assert list(table["strategy"]) == ["sorted", "shuffle"]
    assert table.loc[0, "padding_efficiency"] == pytest.approx(0.995)
    assert "acf" not in table.columns  # list-valued metrics stay out of the CSV
    report = paths["report"].read_text()
    assert "| sorted | 99.5% |" in report and "| shuffle | 45.0% |" in report
    assert paths["figure"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert paths["figure"].stat().st_size > 10_000


def test_bad_metrics_are_named():
    with pytest.raises(ValueError, match="no plan metrics"):
        metrics_frame([])
    with pytest.raises(ValueError, match="'strategy'"):
        metrics_frame([{"padding_efficiency": 1.0}])


def test_undefined_values_show_as_a_dash_in_the_markdown(tmp_path):
    # one epoch: recurrence is undefined (None in the CLI's JSON, NaN in the frame)
    metrics = [
        {"strategy": "packed", "padding_efficiency": 0.999, "lag1_acf": 0.01, "recurrence": None, "rank_imbalance": None},
        {"strategy": "sorted", "padding_efficiency": 0.99, "lag1_acf": float("nan"), "recurrence": None, "rank_imbalance": 1.25},
    ]
    report = write_plan_report(metrics, tmp_path)["report"].read_text()
    assert "| packed | 99.9% | 0.010 | - | - |" in report
    assert "| sorted | 99.0% | - | - | 1.250 |" in report
    assert "nan" not in report and "None" not in report
