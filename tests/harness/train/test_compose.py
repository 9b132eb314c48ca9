"""The run config is read whole only at the top: below the launch, each component gets its own section."""

from __future__ import annotations

import ast
import dataclasses
import sys
import threading
from pathlib import Path

from support.train import compose_config

from harness.train.config import RunConfig, run_config_from_dict
from harness.train.launch.compose import epoch_data_config, features_config, loop_config, models_config, rank_config

REPO = Path(__file__).resolve().parents[3]
#: where the whole RunConfig may be taken: the config itself, the launch (which composes each component's section),
#: and the commands above it (advice and the command line compose a run config of their own)
TOP = ("harness/train/config.py", "harness/train/launch/", "harness/cli/", "harness/advise/")


def _below_the_launch(path: str) -> bool:
    return path.startswith("harness/") and not path.startswith(TOP)


def _holds_a_run_config(value: object) -> bool:
    """``value`` is a RunConfig, or an object one of whose attributes is (a section that carries it)."""
    if isinstance(value, RunConfig):
        return True
    members = vars(value).values() if hasattr(value, "__dict__") and not isinstance(value, type) else ()
    return any(isinstance(member, RunConfig) for member in members)


def functions_given_a_run_config(work) -> set[tuple[str, str, str]]:
    """``(file, function, argument)`` of every call into batchlab's code below the launch, while ``work()`` runs,
    whose argument is a RunConfig or holds one in a field."""
    found: set[tuple[str, str, str]] = set()
    root = str(REPO) + "/"

    def profile(frame, event, arg):  # noqa: ARG001
        if event != "call" or not frame.f_code.co_filename.startswith(root):
            return
        path = frame.f_code.co_filename[len(root):]
        if not _below_the_launch(path):
            return
        code = frame.f_code
        names = code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]
        local = frame.f_locals
        for name in names:
            if _holds_a_run_config(local.get(name)):
                found.add((path, code.co_name, name))

    sys.setprofile(profile)
    threading.setprofile(profile)
    try:
        work()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    return found


def test_a_whole_run_below_the_launch_never_gets_the_run_config(tmp_path, batchlab_cache):
    """A one-rank run from the launch, with cached target features, a draft vocabulary and τ real: every function
    below the launch gets its own section, never the RunConfig (nor an object that carries it). Its caches are its
    own (the shared one's feature entries are other tests' to build)."""
    from harness.train.launch.run import run

    config = compose_config(["experiment=smoke", "trainer.nproc=1", "logger=none", "trainer.progress=false",
                             "trainer.stop_tokens=2000", "eval.every_tokens=1000", "eval.real_prompts=2",
                             "eval.real_new_tokens=4", "trainer.target_features=cached",
                             "eval.target_features=cached", "drafter.draft_vocab_size=256",
                             "checkpoint.every_steps=2", f"data.cache_dir={tmp_path / 'cache'}"])
    summaries = []
    found = functions_given_a_run_config(lambda: summaries.append(run(config, tmp_path / "run")))
    assert summaries[0]["status"] == "complete"
    assert found == set(), "these take the whole run config below the launch: " + ", ".join(
        f"{path}:{function}({argument})" for path, function, argument in sorted(found))


def test_the_check_finds_a_component_handed_the_run_config(tmp_path):
    """The check itself: a function below the launch given the RunConfig, or a section that carries it, is found."""
    from harness.train.loop.epoch_data import select_rows
    from harness.train.rank_models import rank_device

    run = run_config_from_dict(compose_config(["experiment=smoke", "logger=none"]))

    def handed_whole() -> None:
        try:
            select_rows(run, None)
        except AttributeError:
            pass

    carrying = dataclasses.replace(run.trainer)
    carrying.__dict__["run"] = run  # a section that smuggles the whole config in

    def handed_inside() -> None:
        rank_device(carrying, type("Env", (), {"world_size": 1, "local_rank": 0})())

    assert ("harness/train/loop/epoch_data.py", "select_rows", "config") in functions_given_a_run_config(handed_whole)
    assert ("harness/train/rank_models.py", "rank_device", "trainer") in functions_given_a_run_config(handed_inside)


def test_no_function_below_the_launch_is_typed_to_take_the_run_config():
    """The annotations say the same, on paths a one-rank run does not take (a disaggregated target rank's)."""
    typed = []
    for path in sorted((REPO / "harness").rglob("*.py")):
        relative = str(path.relative_to(REPO))
        if not _below_the_launch(relative):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                arguments = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
                typed += [f"{relative}:{node.name}({a.arg})" for a in arguments
                          if a.annotation is not None and "RunConfig" in ast.unparse(a.annotation)]
    assert typed == []


def test_each_section_is_the_run_configs_own():
    """The composed sections are the run config's values, not copies that could drift from it."""
    run = run_config_from_dict(compose_config(["experiment=smoke", "logger=none", "seed=5", "strategy=packed"]))
    data, models, loop = epoch_data_config(run), models_config(run), loop_config(run)
    assert data.trainer is run.trainer and data.data is run.data and data.seed == models.seed == loop.seed == 5
    assert data.strategy == loop.strategy == "packed" and data.strategy_options == run.strategy_options
    assert models.drafter == run.drafter_config and models.target.kwargs == run.target_kwargs
    assert features_config(run).cache_dir == run.data.resolved_cache_dir()
    rank = rank_config(run)
    assert rank.optim is run.optim and rank.topology is run.topology and rank.loop == loop
