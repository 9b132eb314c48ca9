"""Start a run: check its directory, build the data cache once, start the ranks, train.

:func:`run` is what ``batchlab-train`` calls with the resolved config; :func:`run_rank` is the
function every rank executes (the job itself on one rank, or each process torch elastic starts).
A run directory belongs to one run: rerunning a complete run there is a no-op (so a rerun sweep
resumes where it stopped), and a directory that holds a run with other settings is refused.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from harness.data.samples import load_samples
from harness.train.config import run_config_from_dict
from harness.train.distributed import (
    Interrupted,
    RankEnv,
    destroy_process_group,
    external_launch_env,
    init_process_group,
    launch,
)
from harness.train.metrics import write_json_atomic
from harness.train.trainer import EMBEDDED_TARGET, Trainer, pretrained_target_path


class RunDirectoryInUse(ValueError):
    """The run directory holds a run with other settings."""


#: settings that change how a run executes or reports, never what it computes: they may differ on resume
RUNTIME_KEYS = ("trainer.progress", "trainer.num_workers", "trainer.prefetch_factor", "trainer.resume",
                "trainer.collective_timeout_s", "trainer.record_consumed", "trainer.threads_per_rank", "logger.")
#: settings that lay the same samples out on other ranks / micro-steps: they may differ on resume (elastic
#: resume; the checkpoint's plan fingerprint decides, and the rest of its epoch is re-planned)
LAYOUT_KEYS = ("trainer.nproc", "trainer.grad_accum")


def config_differences(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """``key: old -> new`` for every setting (dotted key) of the old run that differs, runtime settings aside."""
    def flat(values: dict[str, Any], prefix: str = "") -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in values.items():
            if isinstance(value, dict):
                out.update(flat(value, f"{prefix}{key}."))
            else:
                out[f"{prefix}{key}"] = value
        return out

    before, after = flat(old), flat(new)
    # a key the old run's config does not have is a setting added to batchlab since (its default is the
    # behaviour the old run had): not a difference
    keys = sorted(k for k in before if not k.startswith(RUNTIME_KEYS) and k not in LAYOUT_KEYS)
    return [f"{k}: {before.get(k)!r} -> {after.get(k)!r}" for k in keys if before.get(k) != after.get(k)]


def _with_regenerated_completions(config: Any, config_dict: dict[str, Any]) -> dict[str, Any]:
    """``data.completions=regenerated``: the config with ``data.source`` pointing at the target's regenerated
    completions of the same prompts (built once, cached); any other config as it is."""
    if config.data.completions != "regenerated":
        return config_dict
    if not config.target.pretrained:
        raise ValueError(
            "data.completions=regenerated needs a pretrained target (target=tiny-pretrained, or "
            "target.pretrained=CHECKPOINT_DIR): a random-weight target's continuations carry nothing to learn"
        )
    from harness.eval.regenerate import RegenerateSettings, regenerate

    target = pretrained_target_path(config, progress=config.trainer.progress)
    dataset, _, _ = regenerate(config.data, target, RegenerateSettings(), progress=config.trainer.progress)
    # the regenerated rows are the selected rows, in order: the held-out split picks the same prompts
    data = {**config_dict["data"], "source": str(dataset), "max_documents": None, "split": None,
            "completions": "corpus"}
    return {**config_dict, "data": data}


def run_rank(config_dict: dict[str, Any], run_dir: str) -> dict[str, Any]:
    """One rank of a run (the function torch elastic starts, or the job itself on one rank)."""
    config = run_config_from_dict(config_dict)
    env = external_launch_env() or RankEnv()
    init_process_group(env, config.trainer.device, config.trainer.collective_timeout_s)
    try:
        summary = Trainer(config, run_dir, env, config_dict=config_dict).train()
    finally:
        destroy_process_group()
    if summary["status"] == "interrupted" and "TORCHELASTIC_RUN_ID" in os.environ:
        # Stopped by a signal: everything is written (checkpoint fsynced, sinks closed). torch elastic's
        # worker wrapper would now wait for an agent that is shutting down (30 s, then SIGKILL); leave now.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(130)
    return summary


def run(config_dict: dict[str, Any], run_dir: str | Path) -> dict[str, Any]:
    """A whole run from a resolved config: validate, build the data cache once, start the ranks, train."""
    config = run_config_from_dict(config_dict)  # fail here, before any process starts
    config_dict = _with_regenerated_completions(config, config_dict)
    config = run_config_from_dict(config_dict)
    run_dir = Path(run_dir)
    previous = run_dir / "config.json"
    if previous.exists() and config.trainer.resume:
        differences = config_differences(json.loads(previous.read_text()), config_dict)
        if differences:
            raise RunDirectoryInUse(
                f"{run_dir} holds a run with other settings ({'; '.join(differences)}); resuming it would mix "
                "two runs. Choose another hydra.run.dir, or set trainer.resume=false to start over in it"
            )
        done = run_dir / "summary.json"
        if done.exists() and json.loads(done.read_text()).get("status") == "complete":
            print(f"batchlab-train: {run_dir} already holds this run, complete; skipped", flush=True)
            return json.loads(done.read_text())
    run_dir.mkdir(parents=True, exist_ok=True)
    write_json_atomic(run_dir / "config.json", config_dict)
    load_samples(config.data, progress=config.trainer.progress)  # the ranks find the caches built
    if config.target.pretrained == EMBEDDED_TARGET:
        pretrained_target_path(config, progress=config.trainer.progress)
    try:
        return launch(run_rank, (config_dict, str(run_dir)), config.trainer.nproc,
                      run_id=f"batchlab-{os.getpid()}-{time.time_ns()}")
    except Interrupted:
        summary_path = run_dir / "summary.json"
        if summary_path.exists():
            return json.loads(summary_path.read_text())
        raise
