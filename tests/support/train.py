"""Helpers of the training tests: compose the real configs, run batchlab-train, read its files."""

import json
import os
import sys
from pathlib import Path

from support.process import run_process, stop_group

REPO = Path(__file__).resolve().parents[2]


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
    return run_process([sys.executable, "-m", "harness.cli.train", *args], cwd=cwd, env=env, timeout=timeout)


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
        return process.wait(timeout=wait_s)
    finally:
        if process.poll() is None:  # the test failed or the run did not stop: it must not outlive the test
            stop_group(process)


#: a training run in the test's own process, without W&B or a progress bar
IN_PROCESS = ["trainer.nproc=1", "trainer.num_workers=0", "logger=none", "trainer.progress=false"]
#: the smoke experiment with equal-token steps (1536 real tokens a step, micro-batches of at most 512)
STEP_TOKENS = [*IN_PROCESS, "experiment=smoke", "trainer.max_tokens=512", "trainer.step_tokens=1536",
               "trainer.stop_tokens=12000", "trainer.eval_every_tokens=100000", "trainer.eval_real_prompts=0",
               "trainer.grad_stats_every=1"]


def write_samples_jsonl(path, samples):
    """``samples`` (``(input_ids, loss_mask)`` pairs) as a token-id jsonl file at ``path``; the path."""
    with path.open("w") as handle:
        for ids, mask in samples:
            handle.write(json.dumps({"input_ids": ids, "loss_mask": mask}) + "\n")
    return path


def random_samples(count, low, high, vocab, seed, mask_first=True):
    """``count`` random samples of ``low``..``high`` tokens below ``vocab`` (their first 3 unmasked or not)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    samples = []
    for _ in range(count):
        length = int(rng.integers(low, high + 1))
        ids = rng.integers(2, vocab, size=length).tolist()
        mask = [0] * 3 + [1] * (length - 3) if mask_first else [1] * length
        samples.append((ids, mask))
    return samples


def data_overrides(path, heldout_fraction=0.1):
    """The overrides that train on the token-id file ``path`` (vocabulary 300, at most 4 held out)."""
    return [f"data.source={path}", "data.max_documents=null", "data.vocab_size=300",
            f"data.heldout_fraction={heldout_fraction}", "data.max_heldout=4"]


def read_jsonl(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


#: what differs between two runs of the same settings: wall-clock timings, memory, and what is computed from them
VOLATILE_KEYS = frozenset({
    "tokens_per_second", "rank_tokens_per_second", "step_time", "time_data", "time_target", "time_drafter",
    "time_optimizer_comm", "data_wait_fraction", "rank_imbalance", "peak_memory_mb",
    # the summary's
    "train_time_s", "wall_time_s", "step_tokens_per_second", "step_time_sum_s",
})
#: a disaggregated run's stage metrics are timings and counts of in-flight messages
VOLATILE_PREFIXES = ("topology_",)


def _compared(record):
    return {k: v for k, v in record.items() if k not in VOLATILE_KEYS and not k.startswith(VOLATILE_PREFIXES)}


def assert_same_records(reference_dir, run_dir):
    """Every step record of ``run_dir``'s metrics.jsonl equals the reference run's, key by key (all but the
    volatile keys): a resumed run repeats the uninterrupted one bit for bit on CPU."""
    expected, got = read_jsonl(Path(reference_dir) / "metrics.jsonl"), read_jsonl(Path(run_dir) / "metrics.jsonl")
    assert [r["step"] for r in got] == [r["step"] for r in expected]
    for want, have in zip(expected, got):
        want, have = _compared(want), _compared(have)
        assert set(have) == set(want), f"step {want['step']}: keys differ: {sorted(set(have) ^ set(want))}"
        for key in want:
            assert have[key] == want[key], f"step {want['step']}: {key} {have[key]} != {want[key]}"


def assert_same_summary(reference_dir, run_dir, ignore=()):
    """``summary.json`` equals the reference run's but for the volatile keys (and ``ignore``)."""
    expected = _compared(json.loads((Path(reference_dir) / "summary.json").read_text()))
    got = _compared(json.loads((Path(run_dir) / "summary.json").read_text()))
    for key in sorted(set(expected) | set(got)):
        if key not in ignore:
            assert got.get(key) == expected.get(key), f"summary {key}: {got.get(key)} != {expected.get(key)}"


class Counter:
    """A checkpointed component of the simplest kind (one value, state version 1), for checkpoint tests."""

    state_version = 1

    def __init__(self, value=0):
        self.value = value

    def state_dict(self):
        return {"value": self.value}

    def load_state_dict(self, state):
        self.value = state["value"]
