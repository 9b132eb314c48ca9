"""Cluster launch through hydra-submitit-launcher: `hydra/launcher=slurm`, and real runs through submitit_local."""

from __future__ import annotations

import json
import re

import hydra_plugins.hydra_submitit_launcher  # noqa: F401 - a declared dependency: a broken install fails here
import pytest
from support.process import failure_text, stop_group
from support.rank_hook import TEST_FAIL_ENV
from support.train import assert_same_records, assert_same_summary, train_cli


def _compose_with_hydra(overrides):
    from hydra import compose, initialize_config_dir

    from harness.train.config import CONF_DIR, register_schemas

    register_schemas()
    with initialize_config_dir(version_base="1.3", config_dir=str(CONF_DIR), job_name="train"):
        return compose("train", overrides=list(overrides), return_hydra_config=True)


def test_slurm_launcher_resolves_and_writes_the_sbatch_job(tmp_path, monkeypatch):
    from hydra_plugins.hydra_submitit_launcher.submitit_launcher import SlurmLauncher
    from omegaconf import OmegaConf
    from submitit.slurm import slurm

    monkeypatch.setenv("BATCHLAB_SLURM_PARTITION", "gpu-h100")
    monkeypatch.delenv("BATCHLAB_SLURM_ACCOUNT", raising=False)
    cfg = _compose_with_hydra(["hydra/launcher=slurm", "hydra.launcher.nodes=2", "hydra.launcher.timeout_min=90",
                               f"hydra.sweep.dir={tmp_path}", "trainer.device=cuda"])
    launcher = OmegaConf.to_container(cfg.hydra.launcher, resolve=True)
    assert launcher["_target_"] == "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher"
    assert launcher["tasks_per_node"] == 8 and launcher["gpus_per_node"] == 8 and launcher["nodes"] == 2
    assert launcher["partition"] == "gpu-h100" and launcher["account"] is None  # from the environment
    assert launcher["timeout_min"] == 90 and launcher["max_num_timeout"] == 0
    assert "export SLURM_KILL_BAD_EXIT=1" in launcher["setup"]

    # the plugin itself turns these settings into the sbatch script (submission intercepted: no cluster here)
    scripts = []

    def submit(self, delayed_submissions):
        scripts.append((len(delayed_submissions),
                        self._make_submission_file_text("python -u -m submitit.core._submit FOLDER", "uid")))
        return [_Done() for _ in delayed_submissions]

    monkeypatch.setattr(slurm.SlurmExecutor, "affinity", classmethod(lambda cls: 2))
    monkeypatch.setattr(slurm.SlurmExecutor, "_internal_process_submissions", submit)
    plugin = SlurmLauncher(**{k: v for k, v in launcher.items() if k != "_target_"})
    plugin.config = cfg
    plugin.launch([["strategy=packed"], ["strategy=sorted"]], initial_job_idx=0)
    ((jobs, script),) = scripts
    assert jobs == 2  # one SLURM job (array task) per job of the sweep
    for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=8", "#SBATCH --gpus-per-node=8",
                 "#SBATCH --partition=gpu-h100", "#SBATCH --time=90",
                 "export SLURM_KILL_BAD_EXIT=1"):
        assert line in script.splitlines(), f"{line!r} not in the sbatch script:\n{script}"
    assert "--account" not in script
    assert any(line.startswith("srun ") for line in script.splitlines())  # every task runs the job: one rank each


class _Done:
    def results(self):
        return [None]


def test_submitit_local_job_runs_one_rank_per_task(tmp_path, batchlab_cache):
    """The launch path end to end on this machine: a 2-task submitit job trains as 2 gloo ranks."""
    sweep = tmp_path / "sweep"
    result = train_cli(["-m", "hydra/launcher=submitit_local", "hydra.launcher.tasks_per_node=2",
                        "hydra.launcher.timeout_min=10", "experiment=smoke", "trainer.nproc=1",
                        "trainer.stop_tokens=6000", "trainer.eval_real_prompts=0", "logger=none",
                        "trainer.progress=false", f"hydra.sweep.dir={sweep}"], cwd=tmp_path, timeout=400)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    (summary_path,) = sweep.glob("*/summary.json")
    summary = json.loads(summary_path.read_text())
    # trainer.nproc=1, yet two ranks: each submitit task is one rank
    assert summary["world_size"] == 2 and summary["status"] == "complete" and summary["samples_seen_once"]
    assert sorted(p.name for p in (summary_path.parent / "status").glob("*.status")) == ["rank0.status",
                                                                                         "rank1.status"]
    logs = sorted(sweep.glob(".submitit/*/*_log.out"))
    assert len(logs) == 2, logs  # one log per task


def test_submitit_local_failure_names_the_rank_that_failed_first(tmp_path, batchlab_cache):
    """No torch elastic agent here (as under srun): the surviving rank's report names the first failure."""
    sweep = tmp_path / "sweep"
    result = train_cli(["-m", "hydra/launcher=submitit_local", "hydra.launcher.tasks_per_node=2",
                        "hydra.launcher.timeout_min=10", "experiment=smoke", "trainer.nproc=1",
                        "trainer.stop_tokens=6000", "trainer.eval_real_prompts=0", "logger=none",
                        "trainer.progress=false", f"hydra.sweep.dir={sweep}"], cwd=tmp_path, timeout=400,
                       env_extra={TEST_FAIL_ENV: "1:3:target_forward:raise"})
    assert result.returncode != 0
    (rank0_log,) = sweep.glob(".submitit/*/*_0_log.err")
    reports = [line for line in rank0_log.read_text().splitlines() if line.startswith("[rank 0]")]
    assert reports, f"rank 0's log holds no report line; it holds:\n{rank0_log.read_text()[-3000:]}"
    report = reports[0]
    assert re.search(r"\(in stage '\w+' of step 3; traceback in ", report), report
    assert ("before it, rank 1 failed in stage 'target_forward' of step 3: RuntimeError: "
            f"{TEST_FAIL_ENV}: simulated failure") in report, report
    assert "[rank 0]" in result.stderr  # what the launcher shows: task 0's error stream


def test_submitit_time_limit_warning_checkpoints_and_the_rerun_resumes(tmp_path, batchlab_cache):
    """SLURM warns a submitit job with SIGUSR2 before its time limit: the ranks finish the step and checkpoint."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from harness.train.loop.checkpoint import latest_checkpoint
    from harness.train.status import read_statuses

    sweep = tmp_path / "sweep"
    args = ["-m", "hydra/launcher=submitit_local", "hydra.launcher.tasks_per_node=2", "hydra.launcher.timeout_min=10",
            "experiment=smoke", "trainer.nproc=1", "trainer.stop_tokens=30000", "trainer.checkpoint_every_steps=100",
            "trainer.eval_real_prompts=0", "logger=none", "trainer.progress=false", f"hydra.sweep.dir={sweep}"]
    env = dict(os.environ, PYTHONUNBUFFERED="1", WANDB_SILENT="true")
    process = subprocess.Popen([sys.executable, "-m", "harness.cli.train", *args], cwd=tmp_path, env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.time() + 240
        while time.time() < deadline:
            metrics = list(sweep.glob("*/metrics.jsonl"))
            if metrics and len(metrics[0].read_text().splitlines()) >= 3:
                break
            assert process.poll() is None, "the job ended before the signal"
            time.sleep(0.1)
        assert metrics, f"the job wrote no step in 240 s: {sorted(p.name for p in sweep.glob('**/*'))[:20]}"
        run_dir = metrics[0].parent
        statuses = read_statuses(run_dir)
        assert sorted(statuses) == [0, 1]
        for status in statuses.values():  # as SLURM does: every task of the job
            os.kill(status["pid"], signal.SIGUSR2)
        process.wait(timeout=120)
    finally:
        if process.poll() is None:  # the job and its submitit tasks must not outlive the test
            stop_group(process)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "interrupted" and 3 <= summary["steps"]
    assert latest_checkpoint(run_dir).name == f"step-{summary['steps']:08d}.pt"

    rerun = train_cli(args, cwd=tmp_path, timeout=400)  # the same command resumes the job to its end
    assert rerun.returncode == 0, failure_text(rerun)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "complete" and summary["samples_seen_once"] is True and summary["world_size"] == 2
    # the same run uninterrupted (2 ranks started by the job itself: the same plan) is repeated bit for bit
    reference = tmp_path / "uninterrupted"
    plain = [a for a in args[1:] if not a.startswith(("hydra", "trainer.nproc"))]
    result = train_cli([*plain, "trainer.nproc=2", f"hydra.run.dir={reference}"], cwd=tmp_path, timeout=400)
    assert result.returncode == 0, failure_text(result)
    assert_same_records(reference, run_dir)
    assert_same_summary(reference, run_dir)


@pytest.mark.parametrize("tasks_per_node, node, local", [("4,2", 1, 2), ("2(x3)", 2, 2), ("3(x2),1", 0, 3)])
def test_plain_srun_ranks_share_their_nodes_cores_not_the_jobs(monkeypatch, tasks_per_node, node, local):
    """srun without torchrun: each rank's threads are this node's cores over the tasks on this node."""
    import os

    from harness.train.distributed import external_launch_env
    from harness.train.rank_models import cpu_threads_per_rank

    environ = {"SLURM_NTASKS": "6", "SLURM_PROCID": "4", "SLURM_LOCALID": "0", "SLURM_NODEID": str(node),
               "SLURM_STEP_TASKS_PER_NODE": tasks_per_node}
    monkeypatch.setattr(os, "environ", environ)
    monkeypatch.setattr(os, "cpu_count", lambda: 12)
    env = external_launch_env()
    assert (env.rank, env.world_size, env.local_rank) == (4, 6, 0)
    assert environ["LOCAL_WORLD_SIZE"] == str(local)
    assert cpu_threads_per_rank(env) == 12 // local  # not 12 // 6: the other nodes' tasks have their own cores
