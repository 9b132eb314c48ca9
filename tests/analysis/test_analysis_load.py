"""analysis.load: a sweep into tidy frames; incomplete runs listed apart; incompatible or incomplete sweeps refused."""

import json
import math
from types import SimpleNamespace

import numpy as np
import pytest

from analysis.load import SweepError, flatten, history_from_wandb, load_sweeps, load_wandb_group
from support import analysis as support


@pytest.fixture(scope="session")
def sweep_dir(tmp_path_factory, batchlab_cache):
    return support.tiny_sweep(tmp_path_factory.mktemp("analysis"))


def test_one_row_per_run_and_per_step(sweep_dir):
    sweep = load_sweeps([sweep_dir])
    assert len(sweep.runs) == len(support.STRATEGIES) * len(support.SEEDS)
    assert sweep.excluded.empty
    assert sweep.strategies == list(support.STRATEGIES)  # every registered strategy, in report order
    assert sweep.seeds == list(support.SEEDS)
    # the resolved config, flattened to dotted keys, next to the summary
    assert (sweep.runs["strategy.name"] == sweep.runs["strategy"]).all()
    assert (sweep.runs["trainer.max_tokens"] == 384).all() and (sweep.runs["max_tokens"] == 384).all()
    assert {"optim.lr", "drafter.block_size", "data.max_documents", "tokens_seen", "status"} <= set(sweep.runs.columns)
    for run in sweep.runs.itertuples():
        records = support.read_jsonl(f"{run.path}/metrics.jsonl")
        steps = sweep.steps[sweep.steps["run"] == run.run].sort_values("step")
        assert len(steps) == len(records)
        assert steps["loss"].tolist() == pytest.approx([r["loss"] for r in records])
        assert (steps["strategy"] == run.strategy).all() and (steps["seed"] == run.seed).all()
        assert steps["train_time_s"].iloc[-1] == pytest.approx(sum(r["step_time"] for r in records))
    # list-valued metrics stay lists, JSON nulls become NaN
    acf = sweep.steps["plan_acf"].dropna()
    assert len(acf) and all(isinstance(v, list) for v in acf)
    assert not any(v is None for values in acf for v in values)


def test_incomplete_runs_are_listed_never_mixed_in(sweep_dir, tmp_path):
    copy = support.copy_sweep(sweep_dir, tmp_path / "sweep")
    crashed = support.run_dir(copy, "packed", 1)
    (crashed / "summary.json").unlink()
    interrupted = support.run_dir(copy, "shuffle", 2)
    support.edit_json(interrupted / "summary.json", status="interrupted")
    sweep = load_sweeps([copy])
    assert len(sweep.runs) == len(support.STRATEGIES) * len(support.SEEDS) - 2
    reasons = dict(zip(sweep.excluded["run"], sweep.excluded["reason"]))
    assert set(reasons) == {crashed.name, interrupted.name}
    assert "no summary.json" in reasons[crashed.name]
    assert "interrupted" in reasons[interrupted.name]
    assert not sweep.steps["run"].isin(list(reasons)).any()
    assert not ((sweep.runs["strategy"] == "packed") & (sweep.runs["seed"] == 1)).any()


@pytest.mark.parametrize("key, value, words", [
    ("data_fingerprint", "0" * 64, "the data"),
    ("max_tokens", 768, "token budget"),
    ("stop_tokens", 123, "number of training tokens"),
])
def test_mixed_sweeps_are_refused(sweep_dir, tmp_path, key, value, words):
    first = support.copy_sweep(sweep_dir, tmp_path / "a", runs={support.run_dir(sweep_dir, "sorted", 0).name})
    other = support.copy_sweep(sweep_dir, tmp_path / "b", runs={support.run_dir(sweep_dir, "packed", 0).name})
    support.edit_json(support.run_dir(other, "packed", 0) / "summary.json", **{key: value})
    with pytest.raises(SweepError) as error:
        load_sweeps([first, other])
    message = str(error.value)
    assert "incompatible sweeps" in message and words in message and key in message
    assert str(tmp_path / "b") in message and "\n" not in message


def test_no_runs_and_missing_metrics_are_named(sweep_dir, tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(SweepError, match="no runs in this directory"):
        load_sweeps([tmp_path / "empty"])
    with pytest.raises(SweepError, match="no such directory"):
        load_sweeps([tmp_path / "absent"])
    copy = support.copy_sweep(sweep_dir, tmp_path / "sweep")
    run = support.run_dir(copy, "bucketed", 0)
    records = support.read_jsonl(run / "metrics.jsonl")
    (run / "metrics.jsonl").write_text("".join(json.dumps({k: v for k, v in r.items() if not k.startswith("eval_")})
                                               + "\n" for r in records))
    with pytest.raises(SweepError) as error:
        load_sweeps([copy])
    assert run.name in str(error.value) and "'eval_loss'" in str(error.value)
    assert "data.max_heldout" in str(error.value)  # the fix


def test_the_same_run_twice_is_refused(sweep_dir):
    with pytest.raises(SweepError, match="appears in 2 runs"):
        load_sweeps([sweep_dir, sweep_dir])


def test_a_run_directory_alone_is_a_sweep(sweep_dir):
    sweep = load_sweeps([support.run_dir(sweep_dir, "sorted", 1)])
    assert sweep.runs["strategy"].tolist() == ["sorted"] and sweep.runs["seed"].tolist() == [1]


def test_select_slices_by_any_config_key(sweep_dir):
    sweep = load_sweeps([sweep_dir])
    packed = sweep.select(**{"strategy.name": "packed"})
    assert packed.strategies == ["packed"] and set(packed.steps["strategy"]) == {"packed"}
    with pytest.raises(KeyError, match="no column"):
        sweep.select(**{"optim.nothing": 1})


def test_offline_wandb_history_matches_metrics_jsonl(tmp_path_factory, batchlab_cache):
    sweep_dir = support.wandb_run(tmp_path_factory.mktemp("analysis-wandb"))
    from_files = load_sweeps([sweep_dir])
    from_wandb = load_sweeps([sweep_dir], source="wandb")
    assert from_wandb.runs[["strategy", "seed", "status"]].values.tolist() == [["packed", 0, "complete"]]
    assert from_wandb.runs["data_fingerprint"].iloc[0] == from_files.runs["data_fingerprint"].iloc[0]
    assert from_wandb.runs["optim.lr"].iloc[0] == from_files.runs["optim.lr"].iloc[0]  # the config, from W&B
    a, b = from_files.steps, from_wandb.steps
    assert len(a) == len(b)
    for column in ("step", "tokens_seen", "loss", "eval_loss", "eval_tau", "step_time", "grad_diversity",
                   "step_mean_length", "plan_lag1_acf"):
        assert np.allclose(a[column].astype(float), b[column].astype(float), equal_nan=True), column
    first_acf = [v for v in a["plan_acf"].dropna().iloc[0] if not math.isnan(v)]
    assert b["plan_acf"].dropna().iloc[0][:len(first_acf)] == pytest.approx(first_acf)
    # a run trained without W&B cannot be read from W&B: said so, with the fix
    with pytest.raises(SweepError, match="logger=none"):
        load_sweeps([support.tiny_sweep(tmp_path_factory.mktemp("unused"))], source="wandb")


def test_history_from_wandb_rebuilds_lists_and_drops_tables():
    rows = [{"_step": 0, "tokens_seen": 0, "plan_acf._type": "table-file"},
            {"_step": 1, "step": 1, "tokens_seen": 10.0, "loss": 2.0, "plan_acf/0": 0.5, "plan_acf/2": 0.1}]
    assert history_from_wandb(rows) == [{"step": 1, "tokens_seen": 10, "loss": 2.0,
                                         "plan_acf": [0.5, pytest.approx(math.nan, nan_ok=True), 0.1]}]


class FakeRun:
    def __init__(self, run_id, config, summary, history, state="finished"):
        self.id, self.name, self.state = run_id, config["name"], state
        self.config, self.summary, self._history = config, SimpleNamespace(_json_dict=summary), history

    def scan_history(self):
        return iter(self._history)


class FakeApi:
    def __init__(self, runs):
        self._runs, self.calls = runs, []

    def runs(self, path, filters=None):
        self.calls.append((path, filters))
        return list(self._runs)


def _as_wandb(records):
    """metrics.jsonl records as the W&B sink logs them (lists split into key/i, None left out)."""
    rows = []
    for i, record in enumerate(records):
        row = {"_step": i, "_runtime": 0.1 * i}
        for key, value in record.items():
            if isinstance(value, list):
                row.update({f"{key}/{j}": v for j, v in enumerate(value) if v is not None})
            elif value is not None:
                row[key] = value
        rows.append(row)
    return rows


def test_online_wandb_group_through_a_fake_api(sweep_dir):
    runs = []
    for strategy in ("sorted", "packed"):
        directory = support.run_dir(sweep_dir, strategy, 0)
        config = json.loads((directory / "config.json").read_text())
        summary = {k: v for k, v in json.loads((directory / "summary.json").read_text()).items()
                   if isinstance(v, (int, float, str, bool))}
        runs.append(FakeRun(f"id-{strategy}", config, {**summary, "_runtime": 3.0},
                            _as_wandb(support.read_jsonl(directory / "metrics.jsonl"))))
    crashed_config = json.loads((support.run_dir(sweep_dir, "shuffle", 0) / "config.json").read_text())
    runs.append(FakeRun("id-crashed", crashed_config, {"loss": 6.0}, [], state="crashed"))
    api = FakeApi(runs)
    sweep = load_wandb_group("team/batchlab", group="analysis_tiny", api=api)
    assert api.calls == [("team/batchlab", {"group": "analysis_tiny"})]
    assert sweep.runs["strategy"].tolist() == ["sorted", "packed"]
    assert sweep.excluded["strategy"].tolist() == ["shuffle"] and "crashed" in sweep.excluded["reason"].iloc[0]
    local = load_sweeps([support.run_dir(sweep_dir, "packed", 0)])
    remote = sweep.steps[sweep.steps["strategy"] == "packed"].reset_index(drop=True)
    assert remote["loss"].tolist() == pytest.approx(local.steps["loss"].tolist())
    assert remote["eval_loss"].astype(float).tolist() == pytest.approx(local.steps["eval_loss"].astype(float).tolist(),
                                                                       nan_ok=True)
    with pytest.raises(SweepError, match="no runs"):
        load_wandb_group("team/batchlab", group="nothing", api=FakeApi([]))


def test_flatten():
    assert flatten({"a": {"b": 1, "c": {"d": [1, 2]}}, "e": {}}) == {"a.b": 1, "a.c.d": [1, 2], "e": {}}


def test_variants_of_a_strategy_are_told_apart(sweep_dir, tmp_path):
    names = {support.run_dir(sweep_dir, s, seed).name for s in ("sorted", "bucketed") for seed in (0, 1)}
    first = support.copy_sweep(sweep_dir, tmp_path / "a", runs=names)
    second = support.copy_sweep(sweep_dir, tmp_path / "b", runs={n for n in names if "bucketed" in n})
    for directory in second.iterdir():  # the same bucketed runs, as if swept with another option
        config = json.loads((directory / "config.json").read_text())
        config["strategy"]["num_buckets"] = 8
        (directory / "config.json").write_text(json.dumps(config))
    for directory in first.iterdir():
        if "bucketed" in directory.name:
            config = json.loads((directory / "config.json").read_text())
            config["strategy"]["num_buckets"] = 32
            (directory / "config.json").write_text(json.dumps(config))
    sweep = load_sweeps([first, second])
    assert sweep.strategies == ["sorted", "bucketed (num_buckets=32)", "bucketed (num_buckets=8)"]
    assert set(sweep.steps["strategy"]) == set(sweep.strategies)
    assert set(sweep.runs["strategy_name"]) == {"sorted", "bucketed"}
