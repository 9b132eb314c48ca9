"""The lr sweep's choice (benchmarks/lr_sweep.py): the mean over seeds then strategies, the edge rule, and its runs'
file read back to the same choice."""

from __future__ import annotations

import csv
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from lr_sweep import RUN_COLUMNS, chosen_lr, mean_losses, write_runs_csv  # noqa: E402


def test_the_mean_is_over_seeds_within_a_strategy_then_over_strategies():
    rows = [{"lr": 1e-3, "strategy": "sorted", "eval_loss": 2.0}, {"lr": 1e-3, "strategy": "sorted", "eval_loss": 4.0},
            {"lr": 1e-3, "strategy": "packed", "eval_loss": 1.0},  # one seed only: weighs as much as sorted's two
            {"lr": 2e-3, "strategy": "sorted", "eval_loss": 2.5}, {"lr": 2e-3, "strategy": "packed", "eval_loss": 2.5}]
    assert mean_losses(rows) == {1e-3: 2.0, 2e-3: 2.5}  # pooled over runs, 1e-3 would read 7/3


def test_the_chosen_lr_is_the_lowest_mean_and_says_when_it_sits_at_an_edge():
    assert chosen_lr({1e-3: 2.0, 2e-3: 1.5, 4e-3: 1.8}) == (2e-3, True)
    assert chosen_lr({1e-3: 2.0, 2e-3: 1.9, 4e-3: 1.8}) == (4e-3, False)
    assert chosen_lr({1e-3: 1.0, 2e-3: 1.9}) == (1e-3, False)


def test_the_runs_file_holds_every_run_and_recomputes_the_choice(tmp_path):
    results = {(lr, strategy, seed): {"eval_loss": loss + 0.1 * seed, "eval_tau_real": 1.25, "clip_fraction": 0.5,
                                      "data_fingerprint": "ab" * 32}
               for lr, loss in ((5e-4, 2.0), (1e-3, 1.7), (2e-3, 1.9)) for strategy in ("sorted", "packed")
               for seed in (200, 201)}
    path = tmp_path / "runs.csv"
    write_runs_csv(path, "study_real", results)
    with path.open() as rows:
        read = list(csv.DictReader(rows))
    assert tuple(read[0]) == RUN_COLUMNS and len(read) == 12
    assert {(float(r["lr"]), r["strategy"], int(r["seed"])) for r in read} == set(results)
    assert all(float(r["eval_loss"]) == results[float(r["lr"]), r["strategy"], int(r["seed"])]["eval_loss"]
               for r in read)  # written with repr: read back bit for bit
    assert chosen_lr(mean_losses(read)) == (1e-3, True)


@pytest.mark.parametrize(("runs", "experiment", "artefact"), [
    ("docs/demo/lr_sweep_runs.csv", "strategies", "harness/data/bundled/manifest.json"),
    ("docs/study-real/lr_sweep_runs.csv", "study_real", "harness/data/bundled/sharegpt_smollm2/manifest.json"),
])
def test_each_configured_lr_is_recomputed_from_its_committed_sweep_on_the_shipped_data(runs, experiment, artefact):
    """The committed sweeps (benchmarks/lr_sweep.py --runs-csv): every run on the shipped data's validation rows, a
    full grid on the tuning seeds, and the lr the experiment trains with is the one they choose, inside the grid."""
    import json

    import yaml

    repo = Path(__file__).resolve().parents[2]
    with (repo / runs).open() as rows:
        read = list(csv.DictReader(rows))
    assert {r["experiment"] for r in read} == {experiment}
    assert {r["data_fingerprint"] for r in read} == {json.loads((repo / artefact).read_text())["fingerprint"]}
    cells = {(float(r["lr"]), r["strategy"], int(r["seed"])) for r in read}
    lrs, strategies, seeds = ({cell[k] for cell in cells} for k in range(3))
    assert len(cells) == len(read) == len(lrs) * len(strategies) * len(seeds)  # a full grid, each run once
    assert strategies == {"sorted", "packed"} and seeds == {200, 201}  # the tuning seeds: no pilot or confirmatory one
    chosen, inside = chosen_lr(mean_losses(read))
    assert inside  # a worse lr on each side
    configured = yaml.safe_load((repo / "conf" / "experiment" / f"{experiment}.yaml").read_text())["optim"]["lr"]
    assert chosen == configured
