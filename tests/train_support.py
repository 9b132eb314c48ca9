"""Helpers of the training tests: compose the real configs, run batchlab-train, read its files."""

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def compose_config(overrides):
    """The resolved config dict that `batchlab-train OVERRIDES` would run."""
    from harness.train.config import compose_run_config

    return compose_run_config(overrides)


def sweep_params(overrides):
    """``hydra.sweeper.params`` (resolved) of what `batchlab-train -m OVERRIDES` would sweep."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from harness.train.config import CONF_DIR, register_schemas

    register_schemas()
    with initialize_config_dir(version_base="1.3", config_dir=str(CONF_DIR)):
        config = compose("train", overrides=list(overrides), return_hydra_config=True)
    return OmegaConf.to_container(config.hydra.sweeper.params, resolve=True)


def train_cli(args, cwd, timeout=300, env_extra=None):
    """Run `batchlab-train ARGS` in a subprocess; returns the CompletedProcess."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", WANDB_SILENT="true", **(env_extra or {}))
    env.pop("WANDB_MODE", None)
    return subprocess.run([sys.executable, "-m", "harness.cli.train", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout, check=False)


def signal_after_steps(process, run_dir, after_steps, sig, deadline_s=240, wait_s=60):
    """Wait until ``RUN_DIR/metrics.jsonl`` holds ``after_steps`` steps, send ``sig`` to the started run's whole
    process group (launcher and ranks; start it with ``start_new_session=True``); its exit code."""
    import time

    deadline = time.time() + deadline_s
    try:
        while time.time() < deadline:
            metrics = Path(run_dir) / "metrics.jsonl"
            if metrics.exists() and len(metrics.read_text().splitlines()) >= after_steps:
                break
            assert process.poll() is None, "the run ended before it could be stopped"
            time.sleep(0.05)
        os.killpg(process.pid, sig)
    finally:
        returncode = process.wait(timeout=wait_s)
    return returncode


def read_jsonl(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
