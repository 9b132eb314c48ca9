"""The ``batchlab-plan`` command: every input format, its JSON and table output, and bad input."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from harness.cli.plan import main
from harness.data.profiles import lognormal_lengths
from strategies import available_strategies

ALL_STRATEGIES = set(available_strategies())
REQUIRED_FIELDS = {
    "strategy",
    "padding_efficiency",
    "micro_batches",
    "steps",
    "lag1_acf",
    "recurrence",
    "step_recurrence",
    "length_mix_excess",
    "rank_imbalance",
    "drafter_imbalance",
    "plan_seconds",
    "samples_seen_once",
}
MAX_TOKENS = 2048
# 3,000 small lognormal lengths (median 120, cap 1,024): enough for every strategy to differ.
LENGTHS = lognormal_lengths(3000, median=120.0, sigma=1.0, min_length=4, max_length=1024, seed=7)
BASE_ARGS = ["--max-tokens", str(MAX_TOKENS), "--world-size", "2", "--epochs", "2", "--json"]


def write_all_formats(root: Path) -> dict[str, str]:
    """The same lengths in every supported file format."""
    import datasets

    token_lists = [[1] * int(n) for n in LENGTHS]
    datasets.Dataset.from_dict({"input_ids": token_lists}).save_to_disk(str(root / "hf"))
    pq.write_table(pa.table({"input_ids": token_lists, "id": np.arange(LENGTHS.size)}), root / "data.parquet")
    with open(root / "data.jsonl", "w") as handle:
        for index, n in enumerate(LENGTHS):
            handle.write(json.dumps({"id": index, "length": int(n)}) + "\n")
    np.save(root / "data.npy", LENGTHS)
    (root / "data.txt").write_text("\n".join(str(int(n)) for n in LENGTHS) + "\n")
    return {
        "hf": str(root / "hf"),
        "parquet": str(root / "data.parquet"),
        "jsonl": str(root / "data.jsonl"),
        "npy": str(root / "data.npy"),
        "txt": str(root / "data.txt"),
    }


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, str]:
    return write_all_formats(tmp_path_factory.mktemp("formats"))


def run_json(capsys, argv: list[str]) -> list[dict]:
    status = main(argv)
    captured = capsys.readouterr()
    assert status == 0, captured.err
    return json.loads(captured.out)


def by_strategy(rows: list[dict]) -> dict[str, dict]:
    return {row["strategy"]: row for row in rows}


@pytest.fixture(scope="module")
def npy_rows(sources) -> dict[str, dict]:
    """JSON rows of all strategies on the .npy copy (computed once for several checks)."""
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["--lengths", sources["npy"], *BASE_ARGS]) == 0
    return by_strategy(json.loads(out.getvalue()))


def test_json_has_every_strategy_and_the_required_fields(npy_rows):
    assert set(npy_rows) == ALL_STRATEGIES
    for row in npy_rows.values():
        assert REQUIRED_FIELDS <= set(row), REQUIRED_FIELDS - set(row)
        assert row["samples_seen_once"] is True
        assert row["budget_violations"] == 0
        assert row["samples"] == LENGTHS.size
        assert row["real_tokens"] == int(LENGTHS.sum())
        assert 0.0 < row["padding_efficiency"] <= 1.0
        assert row["plan_seconds"] > 0.0
        assert row["steps"] * 2 >= row["micro_batches"] > 0
        assert len(row["padding_efficiency_per_epoch"]) == 2


def test_json_values_order_the_strategies_as_the_design_expects(npy_rows):
    sorted_row, shuffle_row = npy_rows["sorted"], npy_rows["shuffle"]
    assert sorted_row["padding_efficiency"] >= shuffle_row["padding_efficiency"]
    assert npy_rows["packed"]["padding_efficiency"] >= 0.95
    # sorted keeps its micro-batches between epochs; a full shuffle almost never does
    assert sorted_row["recurrence"] >= 0.95
    assert shuffle_row["recurrence"] <= 0.2
    assert sorted_row["length_mix_kl"] > shuffle_row["length_mix_kl"]


def test_step_recurrence_and_mix_excess_reach_the_json(npy_rows):
    sorted_row, shuffle_row = npy_rows["sorted"], npy_rows["shuffle"]
    # sorted's micro-batches recur whole, but their order is shuffled: steps recur much less
    assert sorted_row["recurrence"] >= 0.95 and sorted_row["step_recurrence"] < 0.8 * sorted_row["recurrence"]
    assert len(sorted_row["step_recurrence_per_epoch"]) == 1
    assert abs(shuffle_row["length_mix_excess"]) < 0.05 < sorted_row["length_mix_excess"]
    assert npy_rows["bucketed"]["recurrence_bound"] == 0.1 and npy_rows["sorted"]["recurrence_bound"] is None


def test_a_recurrence_above_the_bound_gets_one_warning_line(capsys, tmp_path):
    # 6,000 short samples: quantile edges (which ignore the bound) in 32 buckets repeat partners
    lengths_path = tmp_path / "small.npy"
    rng = np.random.default_rng(21)
    np.save(lengths_path, np.clip(np.round(rng.lognormal(np.log(100), 1.3, 6000)), 1, 8192).astype(np.int64))
    common = ["--lengths", str(lengths_path), "--world-size", "8", "--strategies", "bucketed", "--json"]
    rows = run_json(capsys, [*common, "--edges", "quantile", "--num-buckets", "32"])
    assert rows[0]["recurrence"] > 0.1
    status = main([*common, "--edges", "quantile", "--num-buckets", "32"])
    warnings = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert status == 0 and len(warnings) == 1
    assert "exceeds its bound max_recurrence=0.1" in warnings[0] and "fewer buckets" in warnings[0]
    assert "packed" in warnings[0]
    # the default dp edges honour the bound: no warning
    assert main(common) == 0
    assert "warning" not in capsys.readouterr().err
    assert main([*common, "--max-recurrence", "2"]) == 2
    assert "--max-recurrence '2' must be in (0, 1]" in capsys.readouterr().err


def test_hf_order_shows_the_step_length_oscillation(capsys, sources):
    common = ["--lengths", sources["npy"], "--max-tokens", str(MAX_TOKENS), "--strategies", "length_grouped",
              "--epochs", "1", "--json", "--mega-batch-mult", "20"]
    (hf,) = run_json(capsys, [*common, "--hf-order"])
    (shuffled,) = run_json(capsys, common)
    assert hf["options"]["shuffle_order"] is False and shuffled["options"]["shuffle_order"] is True
    assert hf["options"]["mega_batch_mult"] == 20
    assert hf["lag1_acf"] > 0.5 > abs(shuffled["lag1_acf"]) + 0.3
    assert hf["padding_efficiency"] == shuffled["padding_efficiency"]


def test_advice_notes_when_length_grouped_pads_less_at_no_higher_recurrence():
    from harness.plan_comparison import advice

    bucketed = {"strategy": "bucketed", "padding_efficiency": 0.95, "recurrence": 0.004, "recurrence_bound": 0.1,
                "rank_imbalance": 1.02}
    grouped = {"strategy": "length_grouped", "padding_efficiency": 0.97, "recurrence": 0.001, "recurrence_bound": None,
               "rank_imbalance": 1.5}
    (note,) = advice([bucketed, grouped])
    assert note.startswith("note: length_grouped pads less than bucketed") and "rank balance" in note
    assert advice([bucketed, {**grouped, "recurrence": 0.2}]) == []  # a trade-off, not a win: no note
    assert advice([{**bucketed, "recurrence": float("nan")}]) == []


@pytest.mark.parametrize("fmt", ["hf", "parquet", "jsonl", "txt"])
def test_every_file_format_gives_the_same_plans_as_npy(capsys, sources, npy_rows, fmt):
    rows = by_strategy(run_json(capsys, ["--lengths", sources[fmt], *BASE_ARGS, "--strategies", "sorted,bucketed"]))
    assert set(rows) == {"sorted", "bucketed"}
    for name, row in rows.items():
        assert row["real_tokens"] == int(LENGTHS.sum())
        assert row["padding_efficiency"] == pytest.approx(npy_rows[name]["padding_efficiency"], abs=1e-12)
        assert row["micro_batches"] == npy_rows[name]["micro_batches"]


def test_profile_input(capsys):
    rows = run_json(
        capsys, ["--profile", "chat-902k", "--max-tokens", "16384", "--strategies", "packed", "--epochs", "1", "--json"]
    )
    assert len(rows) == 1 and rows[0]["samples"] == 902_000
    assert rows[0]["samples_seen_once"] is True
    assert rows[0]["recurrence"] is None  # one epoch: nothing to compare with
    assert rows[0]["padding_efficiency"] > 0.99


def test_table_output_lists_each_strategy(capsys, sources):
    assert main(["--lengths", sources["npy"], "--max-tokens", str(MAX_TOKENS), "--strategies", "sorted,shuffle"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert "3,000 samples" in lines[0]
    assert "efficiency" in lines[1] and "recurrence" in lines[1]
    assert [line.split()[0] for line in lines[3:]] == ["sorted", "shuffle"]


def test_bucket_options_and_oversize_drop(capsys, sources):
    quantile = by_strategy(
        run_json(capsys, ["--lengths", sources["npy"], *BASE_ARGS, "--strategies", "bucketed", "--edges", "quantile", "--num-buckets", "4"])
    )["bucketed"]
    explicit = by_strategy(
        run_json(capsys, ["--lengths", sources["npy"], *BASE_ARGS, "--strategies", "bucketed", "--edges", "64,128,256"])
    )["bucketed"]
    assert quantile["samples_seen_once"] and explicit["samples_seen_once"]
    dropped = by_strategy(
        run_json(capsys, ["--lengths", sources["npy"], "--max-tokens", "512", "--oversize", "drop", "--json", "--strategies", "sorted"])
    )["sorted"]
    assert dropped["dropped"] == int((LENGTHS > 512).sum()) > 0
    assert dropped["samples_seen_once"] is True


def test_oversize_drop_plans_when_the_first_samples_are_all_too_long(capsys, tmp_path, monkeypatch):
    # the warm-up on the first WARMUP_SAMPLES samples used to fail with "oversize='drop' left no
    # sample" when every one of them was oversize, although the whole dataset plans fine
    import harness.plan_comparison as comparison

    monkeypatch.setattr(comparison, "WARMUP_SAMPLES", 50)
    lengths = np.full(400, 100, dtype=np.int64)
    lengths[:50] = 5000
    np.save(tmp_path / "long_first.npy", lengths)
    rows = by_strategy(
        run_json(capsys, ["--lengths", str(tmp_path / "long_first.npy"), "--max-tokens", "1000", "--oversize", "drop",
                          "--world-size", "2", "--grad-accum", "2", "--json"])
    )
    assert set(rows) == ALL_STRATEGIES
    for row in rows.values():
        assert row["dropped"] == 50 and row["samples_planned"] == 350
        assert row["samples_seen_once"] is True


def test_samples_over_the_budget_are_named_in_the_commands_own_options(capsys, tmp_path, caplog):
    """Refused: the fix in batchlab-plan's flags (--max-tokens, --oversize), not the library's keywords. Dropped:
    said once on stderr, not once per strategy and epoch."""
    from harness.cli.plan import main

    lengths = np.full(300, 100, dtype=np.int64)
    lengths[[3, 7]] = 5000
    np.save(tmp_path / "lengths.npy", lengths)
    args = ["--lengths", str(tmp_path / "lengths.npy"), "--max-tokens", "1000", "--epochs", "2"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "raise --max-tokens to at least 5000, or pass --oversize truncate or --oversize drop" in err, err
    assert main([*args, "--oversize", "drop"]) == 0
    err = capsys.readouterr().err
    assert err.count("longer than") == 1 and "2 of 300 samples longer than --max-tokens 1000 left out" in err, err
    assert "left out of the epoch" not in caplog.text


def test_balance_lowers_rank_imbalance(capsys, sources):
    argv = ["--lengths", sources["npy"], "--max-tokens", str(MAX_TOKENS), "--world-size", "4", "--grad-accum", "2"]
    argv += ["--strategies", "shuffle", "--epochs", "1", "--json"]
    plain = run_json(capsys, argv)[0]
    balanced = run_json(capsys, [*argv, "--balance"])[0]
    assert balanced["samples_seen_once"] is True
    # a shuffle's ranks differ here (measured 1.19): balancing must remove a good part of it (measured 1.08), so
    # a --balance that did nothing fails
    assert plain["rank_imbalance"] > 1.1
    assert balanced["rank_imbalance"] - 1 < 0.7 * (plain["rank_imbalance"] - 1)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--lengths", "MISSING.parquet"], "does not exist"),
        (["--lengths", "NPY", "--strategies", "sorted,fastest"], "unknown strategy fastest; choose from"),
        (["--lengths", "PARQUET", "--column", "labels"], r"columns present: \['input_ids', 'id'\]"),
        (["--lengths", "NPY", "--max-tokens", "100"], "100"),
        (["--lengths", "NPY", "--epochs", "0"], "--epochs 0 must be at least 1"),
        (["--lengths", "NPY", "--edges", "dp,fast"], "--edges 'dp,fast'"),
        (["--lengths", "NPY", "--world-size", "0"], "world_size"),
        (["--lengths", "NPY", "--profile", "chat-902k"], "not allowed with argument"),
        (["--max-tokens", "10"], "one of the arguments --lengths --profile is required"),
        (["--lengths", "NPY", "--balance-window", "2"], "--balance-window 2 needs --balance"),
        # each of these used to end in a Python traceback (exit 1) or in silent NaN metrics
        (["--lengths", "EMPTY.npy"], r"not a readable numeric \.npy array \(EOFError"),
        (["--lengths", "HUGE.txt"], r"line 2: '99999999999999999999' does not fit in a 64-bit integer"),
        (["--lengths", "NPY", "--max-tokens", str(2**70)], r"max_tokens=1180591620717411303424 is larger than"),
        (["--lengths", "NPY", "--cost-a", "nan"], r"CostModel\.a=nan must be finite"),
        (["--lengths", "NPY", "--report-dir", "FILE"], r"--report-dir .* is an existing file"),
        (["--lengths", "NPY", "--report-dir", "FILE/sub"], r"--report-dir .*: cannot write the report"),
        (["--lengths", "NPY", "--split", "train"], r"split='train' applies only to a dataset directory"),
        # the number of turns used to be planned as if it were a length (exit 0, a table of nonsense)
        (["--lengths", "CHATS.jsonl", "--column", "conversations"],
         r"column 'conversations' holds conversations \(lists of turns\); lengths are token counts"),
        (["--lengths", "CHATS.jsonl", "--column", "tags"], r"column 'tags' holds lists of string, not token ids"),
    ],
)
def test_bad_input_exits_2_with_a_message_not_a_traceback(capsys, sources, tmp_path, extra, message):
    (tmp_path / "empty.npy").write_bytes(b"")
    (tmp_path / "huge.txt").write_text("5\n99999999999999999999\n")
    (tmp_path / "a_file").write_text("not a directory")
    turns = [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]
    (tmp_path / "chats.jsonl").write_text("".join(json.dumps({"conversations": turns, "tags": ["a", "b"]}) + "\n"
                                                  for _ in range(3)))
    substitute = {
        "CHATS.jsonl": str(tmp_path / "chats.jsonl"),
        "NPY": sources["npy"],
        "PARQUET": sources["parquet"],
        "MISSING.parquet": str(tmp_path / "missing.parquet"),
        "EMPTY.npy": str(tmp_path / "empty.npy"),
        "HUGE.txt": str(tmp_path / "huge.txt"),
        "FILE": str(tmp_path / "a_file"),
        "FILE/sub": str(tmp_path / "a_file" / "sub"),
    }
    argv = [substitute.get(arg, arg) for arg in extra]
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "Traceback" not in captured.err
    assert re.search(message, captured.err), captured.err


def test_progress_goes_to_stderr_and_leaves_the_rows_unchanged(capsys, sources):
    from harness.cli.plan import build_parser
    from harness.plan_comparison import compare_strategies

    args = build_parser().parse_args(["--lengths", sources["npy"], "--max-tokens", str(MAX_TOKENS), "--epochs", "2"])
    lengths = np.load(sources["npy"])
    quiet = compare_strategies(lengths, args, ["sorted"], show_progress=False)
    loud = compare_strategies(lengths, args, ["sorted"], show_progress=True)
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "planning" in captured.err
    assert loud[0]["padding_efficiency"] == quiet[0]["padding_efficiency"]
    assert loud[0]["micro_batches"] == quiet[0]["micro_batches"]


def test_installed_entry_point_prints_pure_json_without_importing_torch(sources):
    entry_point = Path(sys.executable).with_name("batchlab-plan")
    if not entry_point.exists():
        pytest.fail(f"{entry_point} is missing: run `pip install -e .` in the environment first")
    completed = subprocess.run(
        [str(entry_point), "--lengths", sources["txt"], *BASE_ARGS, "--strategies", "packed"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr
    rows = json.loads(completed.stdout)
    assert rows[0]["strategy"] == "packed" and rows[0]["samples_seen_once"] is True
    probe = (
        "import sys; from harness.cli.plan import main; "
        f"status = main(['--lengths', {sources['npy']!r}, '--strategies', 'sorted', '--epochs', '1']); "
        "sys.exit(status or (3 if 'torch' in sys.modules else 0))"
    )
    assert subprocess.run([sys.executable, "-c", probe], capture_output=True, timeout=120, check=False).returncode == 0


def test_report_dir_writes_the_figure_and_the_report(capsys, sources, tmp_path):
    report_dir = tmp_path / "report"
    assert main(["--lengths", sources["npy"], "--max-tokens", str(MAX_TOKENS), "--report-dir", str(report_dir)]) == 0
    saved = json.loads((report_dir / "plan_metrics.json").read_text())
    assert {row["strategy"] for row in saved} == ALL_STRATEGIES
    report = (report_dir / "plan_report.md").read_text()
    for name in ALL_STRATEGIES:
        assert f"| {name} |" in report
    assert (report_dir / "plan_tradeoff.png").read_bytes()[:4] == b"\x89PNG"
    assert "plan_report.md" in capsys.readouterr().err


def test_every_column_of_the_plan_table_is_explained_in_the_docs():
    """docs/commands/batchlab-plan.md has a row for each column batchlab-plan prints, naming the metric behind it."""
    from harness.cli.plan import TABLE_COLUMNS

    docs = (Path(__file__).resolve().parents[3] / "docs" / "commands" / "batchlab-plan.md").read_text()
    rows = {line.split("|")[1].strip(): line.split("|")[2].strip() for line in docs.splitlines()
            if line.startswith("| ") and line.count("|") == 4}
    for title, key, _ in TABLE_COLUMNS:
        assert title in rows, f"column {title!r} of batchlab-plan's table is not explained in its docs page"
        assert rows[title] in (f"`{key}`", "—"), (title, rows[title])
