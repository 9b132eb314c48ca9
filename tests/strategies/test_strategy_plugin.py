"""A strategy added end to end needs its class and its ``conf/strategy/<name>.yaml``, nothing else.

A throwaway strategy, ``strided``, is defined here, registered, given its Hydra file in a config
directory of its own (on Hydra's search path), and then goes through every tool: ``batchlab-plan``
with the option it declares, the strategy sweeps, a training run next to a ``sorted`` one, and
``batchlab-report`` over both. Nothing in batchlab names it.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import pytest
from support.train import compose_config, read_jsonl, sweep_params

from harness.data.profiles import lognormal_lengths
from strategies import (
    CliOption,
    MicroBatches,
    Purpose,
    Strategy,
    available_strategies,
    generator,
    padded_fill,
    register_strategy,
    report_order,
    strategy_options,
    unregister_strategy,
)

NAME = "strided"


@dataclass(frozen=True)
class StridedStrategy(Strategy):
    """Sort by length, deal the sorted samples into ``stride`` interleaved runs (every ``stride``-th
    sample), fill each greedily, shuffle the micro-batch order each epoch: sorted's composition with
    ``stride`` times its length spread."""

    name: ClassVar[str] = NAME
    cli_options: ClassVar[tuple[CliOption, ...]] = (
        CliOption("--stride", "stride", "strided: interleaved runs of the sorted lengths", type=int),
    )
    stride: int = 2

    def micro_batches(self, prepared, budget, seed, epoch, per_step):
        by_length = prepared.kept[np.argsort(prepared.lengths[prepared.kept], kind="stable")]
        order = np.concatenate([by_length[start :: self.stride] for start in range(self.stride)])
        offsets = padded_fill(order, prepared.lengths, budget)
        sequence = generator(seed, epoch, Purpose.MICRO_BATCH_ORDER).permutation(offsets.size - 1)
        return MicroBatches(order, offsets, sequence)


STRATEGY_FILE = f"""\
# A test's throwaway strategy: sorted lengths dealt into `stride` interleaved runs.
defaults:
  - {NAME}_schema
  - _self_
stride: 3
balance: false
"""


@pytest.fixture(scope="module")
def plugin(tmp_path_factory):
    """The strategy registered and its Hydra file on the search path (as an override); unregistered after."""
    conf = tmp_path_factory.mktemp("plugin-conf")
    (conf / "strategy").mkdir()
    (conf / "strategy" / f"{NAME}.yaml").write_text(STRATEGY_FILE)
    register_strategy(StridedStrategy)
    try:
        yield f"hydra.searchpath=[file://{conf}]"
    finally:
        unregister_strategy(NAME)
    assert NAME not in available_strategies()


def test_the_registry_knows_it(plugin):
    assert NAME in available_strategies() and strategy_options(NAME) == ["stride"]
    assert report_order()[-1] == NAME  # unranked: after the built-ins


def test_batchlab_plan_compares_it_with_the_option_it_declares(plugin, tmp_path, capsys):
    from harness.cli.plan import build_parser, main

    assert "--stride" in build_parser().format_help()
    lengths = lognormal_lengths(3000, median=120.0, sigma=1.0, min_length=4, max_length=1024, seed=7)
    np.save(tmp_path / "lengths.npy", lengths)
    common = ["--lengths", str(tmp_path / "lengths.npy"), "--max-tokens", "2048", "--world-size", "2", "--json"]

    def rows(*extra):
        assert main([*common, *extra]) == 0
        return {row["strategy"]: row for row in json.loads(capsys.readouterr().out)}

    default = rows()
    assert set(default) == set(available_strategies()) and default[NAME]["options"] == {"stride": 2}
    both = rows("--strategies", f"{NAME},sorted", "--stride", "4")
    assert list(both) == [NAME, "sorted"]
    strided, sorted_row = both[NAME], both["sorted"]
    assert strided["options"] == {"stride": 4} and sorted_row["options"] == {}
    assert strided["samples_seen_once"] is True and strided["samples"] == lengths.size
    # every 4th sorted length in a micro-batch: more spread inside it, so more padding than sorted, and the
    # same micro-batches every epoch
    assert strided["padding_efficiency"] < sorted_row["padding_efficiency"]
    assert strided["micro_batches"] > sorted_row["micro_batches"]
    assert strided["recurrence"] > 0.95
    assert main([*common, "--strategies", NAME, "--stride", "two"]) == 2
    assert "argument --stride: invalid int value: 'two'" in capsys.readouterr().err


def test_the_strategy_sweeps_include_it(plugin):
    swept = sweep_params(["experiment=strategies_smoke", plugin])["strategy"].split(",")
    assert swept == report_order() and swept[-1] == NAME


def test_it_trains_and_is_reported_next_to_sorted(plugin, tmp_path, batchlab_cache):
    from harness.cli.report import main as report_main
    from analysis.figures import COLOURS, StrategyStyle
    from harness.train.launch.run import run

    sweep = tmp_path / "sweep"
    common = ["experiment=strategies_smoke", "logger=none", "trainer.stop_tokens=1500", "trainer.eval_every_tokens=700",
              "trainer.eval_real_prompts=2", plugin]
    summaries = {}
    for strategy, extra in ((NAME, ["strategy.stride=4"]), ("sorted", [])):
        config = compose_config([*common, f"strategy={strategy}", *extra])
        assert config["strategy"]["name"] == strategy
        summaries[strategy] = run(config, sweep / f"strategy={strategy},seed=0")
    strided = summaries[NAME]
    assert strided["strategy"] == NAME and strided["status"] == "complete"
    assert strided["samples_seen_once"] is True and strided["tokens_seen"] >= 1500
    records = read_jsonl(sweep / f"strategy={NAME},seed=0" / "metrics.jsonl")
    assert records and any("eval_loss" in r for r in records)
    # the run planned with the yaml's options, overridden from the command line
    config = json.loads((sweep / f"strategy={NAME},seed=0" / "config.json").read_text())
    assert config["strategy"] == {"name": NAME, "stride": 4, "balance": False, "balance_window_steps": 1}

    out = tmp_path / "report"
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        assert report_main([str(sweep), "--out", str(out)]) == 0
    assert "2 runs, 2 strategies" in printed.getvalue()
    table = (out / "strategies.csv").read_text().splitlines()
    assert [line.split(",")[0] for line in table[1:]] == ["sorted", NAME]  # report order: sorted first
    assert re.search(rf"^\| {NAME} \|", (out / "report.md").read_text(), re.MULTILINE)
    # its colour is the one of its place in the registry's report order, in every report
    colour = StrategyStyle(["sorted", NAME]).colour(NAME)
    assert colour == COLOURS[report_order().index(NAME)] != StrategyStyle(["sorted", NAME]).colour("sorted")
    assert f'<span class="swatch" style="background:{colour}"></span>{NAME}' in (out / "report.html").read_text()
