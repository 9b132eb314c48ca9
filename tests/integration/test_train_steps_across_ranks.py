"""The optimizer step across ranks: one rank's accumulation equals ranks' micro-batches, empty micro-batches on
every rank, equal-token steps split unevenly over two ranks."""

from __future__ import annotations

import math

import pytest
from support.process import failure_text
from support.train import (
    STEP_TOKENS,
    compose_config,
    data_overrides,
    random_samples,
    read_jsonl,
    train_cli,
    write_samples_jsonl,
)

from harness.train.launch.run import run


def test_one_rank_four_micro_batches_equals_two_ranks_two(tmp_path, batchlab_cache):
    data = write_samples_jsonl(tmp_path / "data.jsonl", random_samples(40, 10, 80, 300, seed=2))
    common = [*data_overrides(data), "logger=none", "trainer.progress=false", "trainer.num_workers=0",
              "strategy=sorted", "trainer.max_tokens=160", "trainer.stop_tokens=3000", "trainer.grad_stats_every=1"]
    run(compose_config([*common, "trainer.nproc=1", "trainer.grad_accum=4"]), tmp_path / "one")
    run(compose_config([*common, "trainer.nproc=2", "trainer.grad_accum=2"]), tmp_path / "two")
    one, two = read_jsonl(tmp_path / "one" / "metrics.jsonl"), read_jsonl(tmp_path / "two" / "metrics.jsonl")
    assert len(one) == len(two) >= 3
    for a, b in zip(one, two):
        assert (a["real_tokens"], a["micro_batches"]) == (b["real_tokens"], b["micro_batches"])
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4), a["step"]
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4), a["step"]
    # DDP's division by world size is undone: the first gradient (same weights) matches to fp32 precision
    assert two[0]["grad_norm"] == pytest.approx(one[0]["grad_norm"], rel=1e-5)
    # gradient diversity is measured from accumulation micro-batches (1 rank) and from ranks (2 ranks)
    assert all(r["grad_diversity"] is not None and r["grad_diversity"] > 0 for r in one + two)

def test_empty_micro_batches_run_the_step(tmp_path, batchlab_cache):
    """10 samples of length 8 at budget 8, world 4, accum 2: one sample a micro-batch, 8 a step, so the second
    step has 2 samples and 6 empty micro-batches, and some rank has nothing at all."""
    data = write_samples_jsonl(tmp_path / "data.jsonl", random_samples(10, 8, 8, 300, seed=3, mask_first=False))
    config = compose_config([*data_overrides(data, heldout_fraction=0.0), "logger=none", "trainer.progress=false",
                             "trainer.num_workers=0", "strategy=sorted", "trainer.max_tokens=8", "trainer.nproc=4",
                             "trainer.grad_accum=2", "trainer.stop_epochs=1", "trainer.stop_tokens=null",
                            ])
    summary = run(config, tmp_path / "run")
    records = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [r["samples_per_step"] for r in records] == [8, 2]
    assert summary["samples_seen_once"] is True and summary["tokens_seen"] == 80
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in records)
    step2 = {rank: [len(e["rows"]) for e in read_jsonl(tmp_path / "run" / "consumed" / f"rank{rank}.jsonl")
                    if e["step"] == 2] for rank in range(4)}
    assert all(len(sizes) == 2 for sizes in step2.values())  # every rank ran both micro-batches of the step
    assert sum(sizes.count(0) for sizes in step2.values()) == 6
    assert any(sizes == [0, 0] for sizes in step2.values())  # a rank with no sample joined the collectives

def test_equal_token_steps_on_two_ranks_equal_one_rank(tmp_path, batchlab_cache):
    """Ranks run different numbers of micro-batches in a step (one synchronised backward each): the same steps
    on 2 ranks and on 1 give the same losses and gradients."""
    run(compose_config([*STEP_TOKENS, "strategy=shuffle"]), tmp_path / "one")
    result = train_cli([*STEP_TOKENS[1:], "trainer.nproc=2", "strategy=shuffle", f"hydra.run.dir={tmp_path / 'two'}"],
                       cwd=tmp_path, timeout=300)
    assert result.returncode == 0, failure_text(result)
    one, two = read_jsonl(tmp_path / "one" / "metrics.jsonl"), read_jsonl(tmp_path / "two" / "metrics.jsonl")
    assert len(one) == len(two) >= 6
    assert any(r["micro_batches"] % 2 for r in two)  # some steps split unevenly over the ranks
    for a, b in zip(one, two):
        assert (a["real_tokens"], a["micro_batches"]) == (b["real_tokens"], b["micro_batches"])
        for key in ("loss", "grad_norm", "tau"):
            assert b[key] == pytest.approx(a[key], rel=1e-5), (a["step"], key)
