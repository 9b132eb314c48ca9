"""BatchlabTrainer, accelerate, a plain DDP loop and torchdata's loader on batchlab's batches, in real processes: every
sample once an epoch across 2 ranks for every strategy, a run killed mid-epoch resumes with the same batches and losses,
and a 2-process checkpoint resumes on 1 process exactly once (each process logs what it trained: trainer_worker.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from support.process import run_process

pytest.importorskip("transformers")
pytest.importorskip("torchdata")

WORKER = Path(__file__).with_name("trainer_worker.py")
sys.path.insert(0, str(WORKER.parent))
import trainer_worker  # noqa: E402

SAMPLE_OF = {tuple(sample["input_ids"]): index for index, sample in enumerate(trainer_worker.dataset())}
STRATEGIES = ("sorted", "shuffle", "bucketed", "packed", "length_grouped")


def launch(out: Path, *arguments: str, processes: int = 1, check: bool = True) -> subprocess.CompletedProcess:
    prefix = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}"]
              if processes > 1 else [sys.executable])
    result = run_process([*prefix, str(WORKER), str(out), *arguments], cwd=out, timeout=240)
    if check:
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return result


def records(out: Path) -> list[dict]:
    return [json.loads(line) for path in sorted(out.glob("rank-*.jsonl")) for line in path.read_text().splitlines()]


def visits(rows: list[dict]) -> np.ndarray:
    counts = np.zeros(len(SAMPLE_OF), dtype=np.int64)
    for row in rows:
        for doc in row["docs"]:
            counts[SAMPLE_OF[tuple(doc)]] += 1
    return counts


def test_two_processes_train_every_sample_once_an_epoch_for_every_strategy(tmp_path):
    launch(tmp_path, "trainer", "--strategies", ",".join(STRATEGIES), processes=2)
    rows = records(tmp_path)
    for strategy in STRATEGIES:
        mine = [row for row in rows if row["run"] == strategy]
        assert {row["world_size"] for row in mine} == {2}
        for epoch in range(trainer_worker.EPOCHS):
            counts = visits([row for row in mine if row["epoch"] == epoch])
            assert (counts == 1).all(), (strategy, epoch, counts)
        per_rank = Counter(path.name for path in tmp_path.glob("rank-*.jsonl") for line in path.read_text().splitlines()
                           if f'"run": "{strategy}"' in line)
        assert len(set(per_rank.values())) == 1  # no rank waits on another's shorter epoch


def test_a_run_killed_mid_epoch_resumes_with_the_same_batches_and_losses_step_by_step(tmp_path):
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    whole.mkdir(), killed.mkdir()
    launch(whole, "trainer", "--strategies", "bucketed")
    died = launch(killed, "trainer", "--strategies", "bucketed", "--kill-at", "4", check=False)
    assert died.returncode == -9, died.stderr[-3000:]  # SIGKILL right after the checkpoint of step 4
    assert max(row["step"] for row in records(killed)) == 4
    launch(killed, "trainer", "--strategies", "bucketed", "--resume")
    expected, resumed = records(whole), records(killed)
    assert [(r["step"], r["docs"]) for r in resumed] == [(r["step"], r["docs"]) for r in expected]
    np.testing.assert_allclose([r["loss"] for r in resumed], [r["loss"] for r in expected], rtol=0, atol=1e-6)
    first_epoch_steps = max(row["step"] for row in expected if row["epoch"] == 0)
    assert 4 < first_epoch_steps  # the kill fell inside the first epoch


def test_a_two_process_checkpoint_resumes_on_one_process_exactly_once(tmp_path):
    died = launch(tmp_path, "trainer", "--strategies", "packed", "--kill-at", "2", processes=2, check=False)
    assert died.returncode != 0 and (tmp_path / "packed" / "checkpoint-2" / "batchlab_sampler.json").is_file()
    launch(tmp_path, "trainer", "--strategies", "packed", "--resume")
    rows = records(tmp_path)
    assert {row["world_size"] for row in rows if row["step"] <= 2} == {2}
    assert {row["world_size"] for row in rows if row["step"] > 2} == {1}
    assert any(row["world_size"] == 1 and row["epoch"] == 0 for row in rows)  # resumed inside the first epoch
    for epoch in range(trainer_worker.EPOCHS):
        assert (visits([row for row in rows if row["epoch"] == epoch]) == 1).all()


def test_a_ddp_loop_accelerate_and_a_stateful_loader_resumed_mid_epoch_visit_every_sample_once(tmp_path):
    launch(tmp_path, "loops", processes=2)
    rows = records(tmp_path)
    for run in ("ddp", "accelerate"):
        for epoch in range(trainer_worker.EPOCHS):
            assert (visits([r for r in rows if r["run"] == run and r["epoch"] == epoch]) == 1).all(), (run, epoch)
    stateful = [r for r in rows if r["run"] == "stateful"]
    assert sum(r["step"] == 0 for r in stateful) == 2 * 3  # 3 micro-batches a rank before the checkpoint
    assert (visits(stateful) == 1).all()


def test_accelerate_would_shard_the_rank_batches_again_without_prepare_dataloader():
    from accelerate.data_loader import BatchSamplerShard

    from batchlab import StrategyBatchSampler
    from batchlab.accelerate_loader import keep_rank_batches

    sampler = StrategyBatchSampler(np.arange(5, 105), max_tokens=256, rank=0, world_size=2)
    shard = BatchSamplerShard(sampler, num_processes=2, process_index=0)
    assert len(list(shard)) < len(sampler)  # accelerate's default: every other batch of this rank's own
    loader = type("Prepared", (), {"batch_sampler": shard})()
    keep_rank_batches(loader, sampler)
    assert list(shard) == list(sampler)


def test_resuming_from_a_checkpoint_without_the_batch_state_is_refused_naming_the_file(tmp_path):
    from batchlab.hf_trainer import read_checkpoint_state

    with pytest.raises(FileNotFoundError, match="batchlab_sampler.json is missing.*not written by BatchlabTrainer"):
        read_checkpoint_state(str(tmp_path))


def test_the_trainers_own_length_grouping_is_refused_in_favour_of_a_strategy(tmp_path):
    from transformers import TrainingArguments

    from batchlab import BatchlabTrainer

    args = TrainingArguments(str(tmp_path), train_sampling_strategy="group_by_length", report_to=[], use_cpu=True)
    with pytest.raises(ValueError, match="'group_by_length' sampling.*pick strategy="):
        BatchlabTrainer(model=trainer_worker.tiny_llama(), args=args, train_dataset=trainer_worker.dataset(),
                        max_tokens=256)
