"""The Hydra configuration: every group composes, typos and wrong types fail naming the key, defaults hold."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from hydra.errors import ConfigCompositionException
from support.train import REPO, compose_config, sweep_params

from harness.train.config import run_config_from_dict, strategy_schemas
from harness.train.launch.compose import epoch_data_config, rank_config
from harness.train.loop.build import build_trainer
from harness.train.distributed import Collectives, RankEnv
from harness.train.loop.epoch_data import EpochData
from harness.train.placement.registry import place
from strategies import available_strategies, report_order, strategy_class


def _options(group: str) -> list[str]:
    return sorted(p.stem for p in (REPO / "conf" / group).glob("*.yaml"))


def test_every_strategy_has_a_config_and_every_option_is_a_key():
    assert _options("strategy") == available_strategies()
    for name, schema in strategy_schemas().items():
        keys = {f.name for f in dataclasses.fields(schema)}
        assert {f.name for f in dataclasses.fields(strategy_class(name))} <= keys
        config = compose_config([f"strategy={name}"])
        assert config["strategy"]["name"] == name
        run_config_from_dict(config)  # the strategy accepts the composed options


@pytest.mark.parametrize("group", ["target", "drafter", "data", "optim", "trainer", "logger", "experiment"])
def test_every_group_option_composes(group):
    for option in _options(group):
        config = compose_config([f"{group}={option}"])
        assert config["name"] == f"{config['strategy']['name']}-s0"


@pytest.mark.parametrize("override, key", [
    ("strategy.num_bukets=3", "num_bukets"),
    ("trainer.npoc=2", "npoc"),
    ("drafter.block_sise=8", "block_sise"),
    ("target.hiden_size=8", "hiden_size"),
    ("data.vocab=3", "vocab"),
    ("optim.learning_rate=1", "learning_rate"),
    ("trainer.nproc=two", "nproc"),
    ("strategy.same_bucket_steps=maybe", "same_bucket_steps"),
])
def test_typos_and_wrong_types_fail_at_compose_time_naming_the_key(override, key):
    with pytest.raises(ConfigCompositionException) as failed:
        compose_config([override])
    chain = [failed.value]
    while chain[-1].__cause__ is not None:
        chain.append(chain[-1].__cause__)
    assert any(key in str(error) for error in chain), [str(e) for e in chain]


@pytest.mark.parametrize("override, message", [
    ("trainer.precision=fp16", "trainer.precision"),
    ("trainer.drafter_precision=fp16", "trainer.drafter_precision"),
    ("trainer.device=tpu", "trainer.device"),
    ("trainer.stop_epochs=3", "exactly one stop condition"),
    ("optim.warmup_fraction=1.5", "optim.warmup_fraction"),
    ("optim.lr=-1e-3", r"optim.lr=-0.001 must be >= 0"),
    ("optim.beta2=1.0", r"optim.beta2=1.0 must be in \[0, 1\)"),
    ("optim.eps=0", r"optim.eps=0.* must be > 0"),
    ("optim.weight_decay=-0.1", "optim.weight_decay"),
    ("data.no_anchor=ignore", "no_anchor"),
    ("drafter.block_size=1", "block_size"),
    ("strategy=packed", None),
])
def test_bad_values_are_refused_before_any_work(override, message):
    config = compose_config([override])
    if message is None:
        run_config_from_dict(config)
        return
    with pytest.raises(ValueError, match=message):
        run_config_from_dict(config)


def test_an_unknown_placement_is_refused_where_the_run_is_prepared_naming_the_nearest(tmp_path):
    """The config leaves placement names to the registry above it; the run refuses one before any process or
    file, naming the registered placements and the nearest."""
    from harness.train.launch.run import BadInput, run

    config = compose_config(["topology.name=colocatd"])
    run_config_from_dict(config)  # the config itself takes any name
    with pytest.raises(BadInput, match=r"topology.name='colocatd' is not one of \['colocated', 'disaggregated'\]; "
                                       r"did you mean 'colocated'\?"):
        run(config, tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_the_smoke_sweep_covers_every_registered_strategy_in_report_order():
    params = sweep_params(["experiment=strategies_smoke"])
    assert params == {"strategy": ",".join(report_order()), "seed": "0,1,2"}
    # seeds outermost: Hydra's basic sweeper runs the product with the last key fastest, so each seed runs every
    # strategy in turn (a slow spell of the machine falls on all strategies alike)
    assert list(params) == ["seed", "strategy"]


def test_the_main_job_sweeps_the_contrasted_strategies_over_the_declared_seeds():
    """make demo: the strategies of the planned contrasts x the confirmatory seeds, then length_grouped x 3 of them;
    make pilot: the same on the pilot's seeds. The seeds come from the pre-registration itself."""
    import yaml

    from harness.train.config import CONF_DIR, PREREGISTRATION

    plan = yaml.safe_load((CONF_DIR / PREREGISTRATION).read_text())
    contrasted = {s for c in plan["contrasts"] for s in (c["a"], c["b"])}
    confirmatory = ",".join(map(str, plan["confirmatory_seeds"]))
    params = sweep_params(["experiment=strategies"])
    assert params == {"seed": confirmatory, "strategy": ",".join(s for s in report_order() if s in contrasted)}
    assert list(params) == ["seed", "strategy"]  # seeds outermost
    makefile = (CONF_DIR.parent / "Makefile").read_text()
    demo = makefile[makefile.index("\ndemo:"):makefile.index("\npilot:")]
    pilot = makefile[makefile.index("\npilot:"):]
    extra = ["hydra.sweeper.params.strategy=length_grouped", "hydra.sweeper.params.seed=${batchlab_seeds:confirmatory,3}"]
    assert all(o.replace("${", "$${") in demo for o in extra)
    assert sweep_params(["experiment=strategies", *extra]) == {
        "seed": ",".join(map(str, plan["confirmatory_seeds"][:3])), "strategy": "length_grouped"}
    assert "hydra.sweeper.params.seed=$${batchlab_seeds:pilot}" in pilot
    assert sweep_params(["experiment=strategies", "hydra.sweeper.params.seed=${batchlab_seeds:pilot}"])["seed"] == (
        ",".join(map(str, plan["pilot_seeds"])))


def test_smoke_experiment_is_two_ranks_with_eval_and_checkpoints():
    config = run_config_from_dict(compose_config(["experiment=smoke"]))
    trainer = config.trainer
    assert trainer.nproc == 2 and config.group == "smoke"
    assert config.eval.every_tokens < trainer.stop_tokens
    assert config.checkpoint.every_steps < 20


# ---------------------------------------------------------------- the components' own sections
def test_every_moved_key_still_works_at_its_old_place_and_lands_at_the_new_one():
    """trainer.eval_every_tokens and the other moved settings: on the command line (over an experiment's new
    key), and in an older run's config.json, which resumes (no difference) or is refused naming the setting."""
    from harness.train.config import MOVED_KEYS
    from harness.train.launch.run import config_differences

    values = {"trainer.eval_every_tokens": 777, "trainer.eval_real_prompts": 3, "trainer.eval_real_new_tokens": 5,
              "trainer.eval_real_prompt_tokens": 64, "trainer.checkpoint_every_steps": 7, "trainer.keep_checkpoints": 4,
              "trainer.grad_stats_every": 9, "trainer.grad_stats_ema": 0.5, "trainer.num_workers": 2,
              "trainer.prefetch_factor": 3}
    assert set(values) == set(MOVED_KEYS)
    config = compose_config(["experiment=smoke", *(f"{k}={v}" for k, v in values.items())])
    assert not set(config["trainer"]) & {old.split(".")[1] for old in MOVED_KEYS}  # the resolved dict: new places only
    typed = run_config_from_dict(config)
    for old, new in MOVED_KEYS.items():
        section, name = new.split(".")
        assert getattr(getattr(typed, section), name) == values[old], new
    # an older run's config.json: the same settings under their old names
    new = compose_config(["experiment=smoke"])
    old = {**new, "trainer": {**new["trainer"], "eval_every_tokens": new["eval"]["every_tokens"],
                              "checkpoint_every_steps": new["checkpoint"]["every_steps"]}}
    del old["eval"], old["checkpoint"]
    assert config_differences(old, new) == []
    old["trainer"]["eval_every_tokens"] = 5
    assert config_differences(old, new) == [f"eval.every_tokens: 5 -> {new['eval']['every_tokens']}"]


@pytest.mark.parametrize("override, message", [
    ("eval.every_tokens=0", "eval.every_tokens=0 must be >= 1"),
    ("trainer.eval_every_tokens=0", "eval.every_tokens=0 must be >= 1"),  # named where it now lives
    ("eval.real_prompts=-1", "eval.real_prompts"),
    ("checkpoint.keep=0", "checkpoint.keep"),
    ("grad_stats.ema=1.0", r"grad_stats.ema=1.0 must be in \[0, 1\)"),
    ("loader.num_workers=-1", "loader.num_workers"),
])
def test_each_section_checks_its_own_values(override, message):
    with pytest.raises(ValueError, match=message):
        run_config_from_dict(compose_config([override]))


@pytest.mark.parametrize("arguments, expected", [
    (["eval.every_token=5"], "eval has no setting 'every_token'; did you mean eval.every_tokens?"),
    (["evl.every_tokens=5"], "evl is not a setting; did you mean eval?"),
    (["checkpoint.keep_last=3"], "checkpoint has no setting 'keep_last'; did you mean checkpoint.keep?"),
    (["trainer.eval_every_token=5"], "did you mean trainer.eval_every_tokens?"),
    (["trainer.eval_every_tokens=5", "eval.every_tokens=6"],
     "trainer.eval_every_tokens is the old name of eval.every_tokens; give eval.every_tokens only"),
])
def test_an_unknown_or_doubled_section_key_is_refused_with_what_was_meant(arguments, expected):
    from harness.cli.overrides import check_overrides

    problem = check_overrides(arguments)
    assert problem is not None and expected in problem, problem


def test_default_run_covers_at_least_three_epochs_of_the_default_data(tmp_path, batchlab_cache):
    config = run_config_from_dict(compose_config(["logger=none"]))
    data = EpochData(epoch_data_config(config), Collectives(RankEnv()))
    assert data.total_tokens >= 3 * data.epoch_tokens
    assert data.heldout_rows.size > 0 and not set(data.heldout_rows) & set(data.train_rows)
    # the held-out split is the same for every strategy and every seed of a sweep
    other_config = run_config_from_dict(compose_config(["logger=none", "strategy=sorted", "seed=3"]))
    other = EpochData(epoch_data_config(other_config), Collectives(RankEnv()))
    assert list(other.heldout_rows) == list(data.heldout_rows)
    assert list(other.train_rows) == list(data.train_rows)


def test_bf16_target_keeps_fp32_drafter_master_weights(tmp_path, batchlab_cache):
    import torch

    config = run_config_from_dict(compose_config(["logger=none", "experiment=smoke", "trainer.nproc=1",
                                                  "trainer.precision=bf16"]))
    trainer = build_trainer(rank_config(config), Path(tmp_path), place(config.topology, RankEnv()))
    assert trainer.model.target.dtype == torch.bfloat16
    assert {p.dtype for p in trainer.model.drafter.parameters() if p.requires_grad} == {torch.float32}
    assert all(p.dtype == torch.float32 for group in trainer.optimizer.param_groups for p in group["params"])


@pytest.mark.parametrize("argument, expected", [
    ("strategy=packd", "strategy=packd: there is no such strategy (conf/strategy/); did you mean packed? Choose one of: "
                       "bucketed, length_grouped, packed, shuffle, sorted"),
    ("strategy=sorted,shufle", "did you mean shuffle?"),
    ("trainer.max_tokn=512", "trainer has no setting 'max_tokn'; did you mean trainer.max_tokens?"),
    ("optim.lrr=0.1", "optim has no setting 'lrr'; did you mean optim.lr?"),
    ("sede=1", "sede is not a setting; did you mean seed?"),
    ("+trainer.stop_tokenz=5", "+trainer.stop_tokenz=5: trainer has no setting 'stop_tokenz' (settings are typed: '+' "
                               "cannot add one); did you mean trainer.stop_tokens?"),
    ("+experiment=smoke", "experiment is in conf/train.yaml's defaults already; write experiment=smoke to choose it"),
])
def test_a_misspelt_override_says_what_was_meant(argument, expected):
    from harness.cli.overrides import check_overrides

    problem = check_overrides(["-m", argument])
    assert problem is not None and expected in problem and "_schema" not in problem, problem


def test_every_override_the_docs_use_passes_the_check():
    """The pre-check never refuses what Hydra accepts: the README's, the docs pages', the Makefile's and the tests'
    overrides."""
    import re

    from harness.cli.overrides import check_overrides

    pages = [REPO / "README.md", REPO / "Makefile", *sorted((REPO / "docs").rglob("*.md"))]
    text = "\n".join(path.read_text() for path in pages)
    # (a Makefile's quoted argument and its $$ escape as the shell passes them)
    arguments = [a.strip("`,;'").replace("$$", "$") for line in re.findall(r"batchlab-train (.*)", text)
                 for a in line.split("#")[0].split() if "=" in a and not a.startswith("$")]
    arguments += ["hydra/launcher=submitit_local", "+extra=1", "strategy=${batchlab_strategies:}",
                  "target=tiny-pretrained", "step_mode=fixed_accumulation", "topology.target_ranks=2", "logger.mode=offline"]
    assert len(arguments) > 20
    assert check_overrides(arguments) is None, check_overrides(arguments)
    # another config search path may hold other options: left to Hydra
    assert check_overrides(["hydra.searchpath=[file:///tmp/conf]", "strategy=strided"]) is None


def test_the_cli_refuses_a_misspelt_strategy_in_one_line(tmp_path):
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-m", "harness.cli.train", "strategy=packd"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "batchlab-train: strategy=packd: there is no such strategy (conf/strategy/); did you mean packed? Choose one "
        "of: bucketed, length_grouped, packed, shuffle, sorted"]
    assert not any(tmp_path.iterdir())  # nothing written
