"""The trainer's components on their own, in-process: step statistics by name, versioned checkpoints, the
consumed-sample counts, gradient statistics, the epoch data's re-plan, test-only faults, and a failed run
closing its logger."""

from __future__ import annotations

import dataclasses
import json
import math
import re

import numpy as np
import pytest
from support import rank_hook
import torch
from support.train import Counter, compose_config

from harness.models.drafter_loss import DrafterLoss
from harness.train.launch.compose import epoch_data_config, models_config, rank_config
from harness.train.loop.checkpoint import (
    CheckpointManager,
    CheckpointVersionError,
    FingerprintMismatch,
    checkpoint_paths,
    load_checkpoint,
    save_checkpoint,
)
from harness.train.config import run_config_from_dict
from harness.train.loop.consumed import ConsumedSamples
from harness.train.distributed import Collectives, RankEnv
from harness.train.loop.grad_stats import (
    BucketNorms,
    GradientNoise,
    GradientStatistics,
    squared_norms,
    small_batch_estimates,
)
from harness.train.loop.step_stats import StepStats, reduce_sum, stat, step_record


class ManyRanks(Collectives):
    """Collectives of rank 0 among ranks whose other tensors are given (all_gather stacks, all_reduce sums)."""

    def __init__(self, others: list[torch.Tensor]) -> None:
        super().__init__(RankEnv(0, 1 + len(others)))
        self.others = others

    def all_gather(self, tensor):
        return torch.stack([tensor, *self.others])

    def all_reduce_sum(self, tensor):
        return tensor + sum(self.others)


def _stats(**values):
    slots = values.pop("slots", [0.0, 0.0])
    return StepStats(**values, correct_per_position=torch.tensor(slots[0]), count_per_position=torch.tensor(slots[1]))


# ---------------------------------------------------------------- step statistics
def test_step_stats_are_gathered_and_reported_by_name():
    other = _stats(real_tokens=30, computed_slots=40, samples=3, length_sum=30, length_sq_sum=350, weighted_ce_sum=6.0,
                   weight_sum=2.0, block_count=4, blocks_computed=8, step_time=2.0, data_wait=0.5, target_time=0.5,
                   drafter_time=1.0, peak_memory_mb=700, slots=[[1.0, 0.0], [2.0, 1.0]])
    mine = _stats(real_tokens=10, computed_slots=10, samples=1, length_sum=10, length_sq_sum=100, weighted_ce_sum=2.0,
                  weight_sum=2.0, block_count=2, blocks_computed=2, step_time=1.0, target_time=0.2, drafter_time=0.3,
                  peak_memory_mb=500, stop_requested=1.0, slots=[[2.0, 1.0], [2.0, 1.0]])
    ranks = mine.gather(ManyRanks([other.vector()]))
    assert ranks["real_tokens"].tolist() == [10.0, 30.0] and ranks.total("weight_sum") == 4.0
    assert ranks["correct_per_position"].tolist() == [[2.0, 1.0], [1.0, 0.0]]
    record = step_record(ranks, grad_norm=0.5, lr=1e-3, optimizer_time=0.25)
    # reported fields: by their reduction and record name, integers where declared
    assert record["real_tokens"] == 40 and isinstance(record["real_tokens"], int) and record["blocks"] == 6
    assert record["peak_memory_mb"] == 700 and record["time_data"] == 0.25 and record["time_drafter"] == 0.65
    # derived: the global normaliser, never a mean of per-rank means
    assert record["loss"] == pytest.approx(8.0 / 4.0) and record["loss_max_rank"] == pytest.approx(3.0)
    assert record["accuracy_per_position"] == [pytest.approx(3 / 4), pytest.approx(1 / 2)]
    assert record["padding_ratio"] == pytest.approx(1 - 40 / 50)
    assert record["step_time"] == pytest.approx(2.25) and record["tokens_per_second"] == pytest.approx(40 / 2.25)
    assert record["step_mean_length"] == pytest.approx(10.0) and record["samples_per_step"] == 4
    assert record["rank_imbalance"] == pytest.approx(1.5 / 1.0)
    assert bool(ranks["stop_requested"].max() > 0)  # one rank asked to stop: every rank sees it


def test_a_metric_is_one_field():
    @dataclasses.dataclass
    class WithQueue(StepStats):
        queue_depth: float = stat("max")

    mine, other = WithQueue(queue_depth=3.0), WithQueue(queue_depth=7.0)
    record = step_record(mine.gather(ManyRanks([other.vector()])), grad_norm=1.0, lr=0.0, optimizer_time=0.0)
    assert record["queue_depth"] == 7.0
    with pytest.raises(ValueError, match="report='median' is not one of"):
        stat("median")


def test_an_empty_rank_has_no_loss_of_its_own():
    empty = _stats(step_time=1.0)
    busy = _stats(weighted_ce_sum=3.0, weight_sum=1.0, step_time=1.0)
    record = step_record(empty.gather(ManyRanks([busy.vector()])), 1.0, 0.0, 0.0)
    assert record["loss"] == 3.0 and record["loss_max_rank"] == 3.0
    assert math.isnan(step_record(empty.gather(Collectives(RankEnv())), 1.0, 0.0, 0.0)["loss"])


def test_drafter_loss_sums_reduce_field_by_field():
    sums = DrafterLoss.zeros(3)
    sums = dataclasses.replace(sums, weight_sum=torch.tensor(2.0), count_per_position=torch.tensor([1.0, 2.0, 3.0]))
    # the other rank's 7 sums, 2 x 3 per-position sums and its draft-vocabulary misses, in field order
    other = torch.arange(1, 15, dtype=torch.float64)
    reduced = reduce_sum(sums, ManyRanks([other]))
    assert float(reduced.weighted_ce_sum) == 1.0 and float(reduced.weight_sum) == 4.0
    assert reduced.correct_per_position.tolist() == [8, 9, 10]
    assert reduced.count_per_position.tolist() == [1 + 11, 2 + 12, 3 + 13]
    assert float(reduced.draft_vocab_misses) == 14.0


# ---------------------------------------------------------------- checkpoints
def _manager(run_dir, components, fingerprint=None):
    return CheckpointManager(run_dir, components, fingerprint=fingerprint or {"seed": 0, "world_size": 1},
                             config={"seed": 0}, keep=2, is_main=True, barrier=lambda: None,
                             status=type("Status", (), {"stage": staticmethod(lambda name, step: None)})())


def test_checkpoint_components_round_trip_and_the_newest_are_kept(tmp_path):
    saved = _manager(tmp_path, {"a": Counter(3), "b": Counter(5)})
    for step in (1, 2, 3):
        saved.components["a"].value = step
        saved.save(step)
    assert [p.name for p in checkpoint_paths(tmp_path)] == ["step-00000002.pt", "step-00000003.pt"]
    loaded = _manager(tmp_path, {"a": Counter(), "b": Counter()})
    restored = loaded.restore()
    assert restored.path.name == "step-00000003.pt" and restored.layout_changed == []
    assert loaded.components["a"].value == 3 and loaded.components["b"].value == 5
    assert _manager(tmp_path / "empty", {"a": Counter()}).restore() is None


def test_other_state_versions_are_refused_before_anything_loads(tmp_path):
    _manager(tmp_path, {"a": Counter(3), "b": Counter(5)}).save(1)
    newer, untouched = Counter(), Counter()
    newer.state_version = 2
    with pytest.raises(CheckpointVersionError, match=r"'a' state is version 1 \(older\), this batchlab reads 2") as err:
        _manager(tmp_path, {"b": untouched, "a": newer}).restore()
    assert "trainer.resume=false" in str(err.value)
    assert untouched.value == 0  # refused whole, not half-loaded
    older = Counter()
    older.state_version = 0
    with pytest.raises(CheckpointVersionError, match=r"'a' state is version 1 \(newer\)"):
        _manager(tmp_path, {"a": older, "b": Counter()}).restore()
    with pytest.raises(CheckpointVersionError, match="'c' is missing"):
        _manager(tmp_path, {"a": Counter(), "b": Counter(), "c": Counter()}).restore()


@pytest.mark.parametrize(("fmt", "age"), [(None, "an older"), (99, "a newer")])
def test_other_checkpoint_formats_are_refused(tmp_path, fmt, age):
    state = {"fingerprint": {}, "state": {"global_step": 1}} if fmt is None else {"format": fmt, "components": {}}
    save_checkpoint(tmp_path, 1, state, keep=1)
    with pytest.raises(CheckpointVersionError, match=f"{age} batchlab wrote it"):
        _manager(tmp_path, {"a": Counter()}).restore()


def test_another_plan_is_refused_but_world_size_may_change(tmp_path):
    _manager(tmp_path, {"a": Counter(1)}, fingerprint={"seed": 0, "world_size": 2}).save(1)
    restored = _manager(tmp_path, {"a": Counter()}, fingerprint={"seed": 0, "world_size": 1}).restore()
    assert restored.layout_changed == ["world_size"] and restored.fingerprint["world_size"] == 2
    with pytest.raises(FingerprintMismatch, match="seed: checkpoint 0, now 1"):
        _manager(tmp_path, {"a": Counter()}, fingerprint={"seed": 1, "world_size": 2}).restore()
    assert load_checkpoint(checkpoint_paths(tmp_path)[-1])["components"]["a"] == {"version": 1, "state": {"value": 1}}


# ---------------------------------------------------------------- consumed samples
class _Batch:
    def __init__(self, rows):
        self.sample_indices = torch.tensor(rows)


def test_consumed_counts_check_exactly_once(tmp_path):
    consumed = ConsumedSamples(6, Collectives(RankEnv()))
    consumed.add([_Batch([0, 2]), _Batch([4])], step=1, epoch=0, step_in_epoch=0)
    assert consumed.at_most_once()
    assert consumed.end_epoch(np.array([0, 2, 4])) is True and not consumed.counts.any()  # the next epoch restarts
    consumed.add([_Batch([1, 1])], step=2, epoch=1, step_in_epoch=0)
    assert not consumed.at_most_once()
    assert consumed.end_epoch(np.array([1])) is False


def test_the_tests_hook_logs_every_micro_batch_and_a_resume_cuts_the_log(tmp_path):
    """tests/support/rank_hook.py's log of consumed samples (the run tests compare it): one line per micro-batch; a
    resumed run rewrites what came after its checkpoint; the hook is undone when the rank's work ends."""
    add = ConsumedSamples.add
    with rank_hook.installed(0, tmp_path):
        first = ConsumedSamples(4, Collectives(RankEnv()))
        first.add([_Batch([0]), _Batch([1])], step=1, epoch=0, step_in_epoch=0)
        for step in (2, 3):
            first.add([_Batch([step])], step=step, epoch=0, step_in_epoch=step - 1)
        saved = first.state_dict()
    assert ConsumedSamples.add is add
    lines = [json.loads(line) for line in (tmp_path / "consumed" / "rank0.jsonl").read_text().splitlines()]
    assert [line["rows"] for line in lines] == [[0], [1], [2], [3]] and [line["step"] for line in lines] == [1, 1, 2, 3]
    on_rank_1 = ConsumedSamples(4, Collectives(RankEnv(1, 2)))
    on_rank_1.load_state_dict(saved)
    assert not on_rank_1.counts.any() and on_rank_1.resumed_total.tolist() == [1, 1, 1, 1]
    with rank_hook.installed(0, tmp_path):
        resumed = ConsumedSamples(4, Collectives(RankEnv()))
        resumed.load_state_dict(saved)
        assert resumed.counts.tolist() == [1, 1, 1, 1]
        resumed.add([_Batch([3])], step=3, epoch=0, step_in_epoch=2)  # the checkpoint was of step 2: step 3 redone
    steps = [json.loads(line)["step"] for line in (tmp_path / "consumed" / "rank0.jsonl").read_text().splitlines()]
    assert steps == [1, 1, 2, 3]
    with rank_hook.installed(0, tmp_path):  # a fresh run in the same directory starts a new log
        ConsumedSamples(4, Collectives(RankEnv())).add([_Batch([1])], step=1, epoch=0, step_in_epoch=0)
    assert len((tmp_path / "consumed" / "rank0.jsonl").read_text().splitlines()) == 1


# ---------------------------------------------------------------- gradient statistics
class _Bucket:
    def __init__(self, params):
        self._params = params

    def parameters(self):
        return self._params

    def gradients(self):
        return [p.grad for p in self._params]


def test_gradient_norms_do_not_depend_on_the_bucket_layout():
    generator = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (1000, 7, 4096, 33, 129)]
    for p in params:
        p.grad = torch.randn(p.shape, generator=generator) * 1e3
    totals = []
    for layout in ([params], [params[3:], params[:3]], [[p] for p in reversed(params)]):
        norms = BucketNorms()
        norms.start()
        for bucket in layout:
            norms.local_sq.update(squared_norms(_Bucket(bucket)))
            norms.global_sq.update(squared_norms(_Bucket(bucket)))
        totals.append(norms.stop())
    assert totals[0] == totals[1] == totals[2]  # bit for bit
    assert totals[0][0] == pytest.approx(sum(float(p.grad.double().square().sum()) for p in params), rel=1e-12)


def test_accumulation_statistics_are_measured_on_chosen_steps_and_carried_between():
    weight = torch.nn.Parameter(torch.zeros(4))
    grads = GradientStatistics([weight], Collectives(RankEnv()), every=2, ema=0.5)
    contributions = [torch.tensor([1.0, 0.0, 0.0, 0.0]), torch.tensor([0.0, 1.0, 0.0, 0.0])]

    def step(number):
        weight.grad = None
        grads.start_step(number, len(contributions))
        for g in contributions:
            weight.grad = g.clone() if weight.grad is None else weight.grad + g
            grads.micro_batch_done(weight_sum=1.0)
        return grads.end_step(global_weight=2.0, local_weight=2.0)

    skipped = step(1)
    assert skipped["grad_stats_measured"] is False and math.isnan(skipped["grad_diversity"])
    measured = step(2)
    # orthogonal halves of weight 1: |G_k|² = 4, |G_W|² = 2, so tr Σ = (4 - 2) / (1 - 1/2) = 4 and |G|² = 0: all
    # noise; |G|² is held at its floor, so the noise scale is large and finite
    assert measured["grad_stats_measured"] is True and measured["grad_trace_estimate"] == pytest.approx(4.0)
    assert measured["grad_norm_sq_estimate"] == pytest.approx(0.0, abs=1e-12) and measured["grad_noise_floored"]
    assert measured["grad_noise_scale"] == pytest.approx(4.0 / (GradientNoise.G2_FLOOR * 2.0))
    assert 0.99 < measured["grad_diversity"] < 1.0
    carried = step(3)
    assert carried["grad_stats_measured"] is False and carried["grad_diversity"] == measured["grad_diversity"]
    again = GradientStatistics([weight], Collectives(RankEnv()), every=2, ema=0.5)
    again.load_state_dict(grads.state_dict())
    assert again.state_dict() == grads.state_dict()


def _split_statistics(unit_grads, sizes):
    """The estimator's sums for one step whose unit-weight gradients ``unit_grads`` [W, d] are split into small
    batches of ``sizes`` units: (|contribution|², weight) pairs and the step gradient's squared norm."""
    total = unit_grads.shape[0]
    bounds = np.cumsum([0, *sizes])
    contributions = [unit_grads[a:b].sum(0) / total for a, b in zip(bounds[:-1], bounds[1:])]
    small = [(float(np.square(c).sum()), float(size)) for c, size in zip(contributions, sizes)]
    return small, float(np.square(sum(contributions)).sum())


def test_noise_estimates_are_unbiased_for_unequal_small_batches():
    rng = np.random.default_rng(0)
    dims, sigma, sizes = 40, 0.5, [1, 3, 12]  # W = 16 units in very unequal small batches
    mean = rng.normal(size=dims) * 0.2
    true_g2, true_trace = float(np.square(mean).sum()), sigma**2 * dims
    g2, trace = [], []
    for _ in range(4000):
        small, big_sq = _split_statistics(mean + sigma * rng.normal(size=(sum(sizes), dims)), sizes)
        g2_sum, trace_sum, count = GradientStatistics._estimate(small, big_sq, float(sum(sizes)))
        g2.append(g2_sum / count)
        trace.append(trace_sum / count)
    # tolerances: about 4 standard errors of the mean over 4000 steps
    assert np.mean(g2) == pytest.approx(true_g2, rel=0.08)
    assert np.mean(trace) == pytest.approx(true_trace, rel=0.05)
    # the equal-size formula (B_small = W / K) on the same steps is biased by the unequal sizes
    equal = []
    for _ in range(4000):
        small, big_sq = _split_statistics(mean + sigma * rng.normal(size=(sum(sizes), dims)), sizes)
        b_small = 16 / 3
        small_sq = np.mean([sq * (16 / w) ** 2 for sq, w in small])
        equal.append((small_sq - big_sq) / (1 / b_small - 1 / 16))
    assert abs(np.mean(equal) / true_trace - 1) > 0.5


def test_diversity_does_not_move_when_the_same_gradients_are_split_differently():
    """Identical per-sample gradients, split by every strategy's real micro-batch weights of one step: the noise
    scale and Δ are the same for all; Δ between the micro-batches (the old formula) follows the split."""
    from strategies import Budget, available_strategies, plan

    rng = np.random.default_rng(1)
    lengths = np.clip(rng.lognormal(np.log(200), 0.8, 400), 20, 1500).astype(np.int64)
    direction = rng.normal(size=8)
    results, old_delta = {}, {}
    for name in available_strategies():
        p = plan(lengths, Budget(2048), name, seed=0, epoch=0, world_size=1, grad_accum=3)
        weights = p.micro_batch_tokens()[:3].astype(float)
        weights = weights / weights.sum() * 64.0  # the same step weight W = 64 for every split
        noise = GradientNoise(ema=0.9)
        contributions = [(w / 64.0) * direction for w in weights]  # g_k = (W_k / W) G with G_k = G for all k
        small = [(float(np.square(c).sum()), w) for c, w in zip(contributions, weights)]
        big_sq = float(np.square(direction).sum())
        record = noise.update(*GradientStatistics._estimate(small, big_sq, 64.0), big_sq, 64.0)
        results[name] = (record["grad_noise_scale"], record["grad_diversity"])
        old_delta[name] = sum(sq for sq, _ in small) / big_sq
    assert all(scale == pytest.approx(0.0, abs=1e-9) for scale, _ in results.values())
    assert all(delta == pytest.approx(1 / 64) for _, delta in results.values())
    assert max(old_delta.values()) - min(old_delta.values()) > 0.01, old_delta  # the old Δ moved with the split


def test_the_noise_scale_is_never_nan_once_measured():
    noise = GradientNoise(ema=0.9)
    # a first step whose |G|² estimate is negative (the small batch's own gradient is larger than the step allows)
    g2, trace = small_batch_estimates(own_sq=50.0, weight=4.0, big_sq=1.0, total_weight=8.0)
    assert g2 < 0
    record = noise.update(g2, trace, 1, 1.0, 8.0)
    assert math.isfinite(record["grad_noise_scale"]) and math.isfinite(record["grad_diversity"])
    assert record["grad_noise_floored"] is True
    # a negative tr Σ estimate counts as no noise: B_simple 0, Δ = 1 / W
    noise = GradientNoise(ema=0.9)
    record = noise.update(*small_batch_estimates(own_sq=0.5, weight=4.0, big_sq=1.0, total_weight=8.0), 1, 1.0, 8.0)
    assert record["grad_noise_scale"] == 0.0 and record["grad_diversity"] == pytest.approx(1 / 8)
    assert noise.update(0.0, 0.0, 0, 1.0, 8.0) == {}  # nothing informative: no measurement


# ---------------------------------------------------------------- epoch data
def test_an_elastic_resume_plans_exactly_the_rest_of_the_epoch(batchlab_cache):
    from harness.train.loop.epoch_data import EpochData

    config = run_config_from_dict(compose_config(["experiment=smoke", "trainer.nproc=1", "logger=none"]))
    data = EpochData(epoch_data_config(config), Collectives(RankEnv()))
    whole = data.plan_epoch(0)
    first_half = np.concatenate([whole.micro_batch(step, 0, a) for step in range(whole.num_steps // 2)
                                 for a in range(whole.grad_accum)])
    consumed = np.zeros(len(data.samples), dtype=np.int64)
    consumed[data.train_rows[first_half]] = 1
    rest, left = data.replan_rest(0, consumed, "ckpt")
    assert data.replanned(0) and not data.replanned(1) and data.plan_epoch(0) is rest
    rest_rows = np.concatenate([rest.micro_batch(s, 0, a) for s in range(rest.num_steps) for a in range(rest.grad_accum)])
    assert left == len(rest_rows) == data.train_rows.size - first_half.size
    assert sorted(np.concatenate([first_half, rest_rows]).tolist()) == list(range(data.train_rows.size))
    saved = data.state_dict()
    other = EpochData(epoch_data_config(config), Collectives(RankEnv()))
    other.load_state_dict(saved)
    assert other.replanned(0) and np.array_equal(other.plan_epoch(0).sample_indices, rest.sample_indices)
    consumed[data.train_rows[first_half[0]]] = 2
    with pytest.raises(ValueError, match="a sample consumed 2 times"):
        data.replan_rest(0, consumed, "ckpt")


# ---------------------------------------------------------------- the tests' rank hook
def test_the_fault_hook_is_off_unless_a_test_names_the_rank(monkeypatch):
    for name in (rank_hook.TEST_FAIL_ENV, rank_hook.TEST_KILL_ENV, rank_hook.DRAFTER_DELAY_ENV):
        monkeypatch.delenv(name, raising=False)
    assert rank_hook.stage_hook(0) is None
    monkeypatch.setenv(rank_hook.TEST_FAIL_ENV, "1:3:drafter_forward:raise")
    assert rank_hook.stage_hook(0) is None
    hook = rank_hook.stage_hook(1)
    hook("drafter_forward", 2)
    hook("optimizer", 3)
    with pytest.raises(RuntimeError, match="simulated failure of rank 1 in stage 'drafter_forward' of step 3"):
        hook("drafter_forward", 3)


def test_kill_counts_a_targets_sends(monkeypatch):
    killed = []
    monkeypatch.delenv(rank_hook.TEST_FAIL_ENV, raising=False)
    monkeypatch.setenv(rank_hook.TEST_KILL_ENV, "2:3")
    monkeypatch.setattr(rank_hook.os, "kill", lambda pid, sig: killed.append(sig))
    hook = rank_hook.stage_hook(2)
    for stage in ("target_forward", "send", "target_forward", "send", "wait_credit"):
        hook(stage, 1)
    assert killed == []
    hook("send", 2)
    assert len(killed) == 1
    monkeypatch.setenv(rank_hook.TEST_KILL_ENV, "2:x")
    with pytest.raises(ValueError, match="expected RANK:N"):
        rank_hook.stage_hook(2)


def test_a_failure_lands_after_the_status_file_records_the_stage(tmp_path, monkeypatch):
    """Through the package's seam (BATCHLAB_RANK_HOOK, set by conftest.py): the status file holds the stage the
    rank failed in, and the hook is gone once the rank's work ends."""
    from harness.train.rank_hook import rank_hook as hooked
    from harness.train.status import RankStatus, read_statuses

    monkeypatch.setenv(rank_hook.TEST_FAIL_ENV, "0:2:optimizer:raise")
    stage = RankStatus.stage
    with pytest.raises(RuntimeError, match="simulated failure of rank 0 in stage 'optimizer' of step 2"), \
            hooked(0, tmp_path):
        status = RankStatus(tmp_path, 0)
        status.stage("optimizer", 1)
        status.stage("optimizer", 2)
    assert read_statuses(tmp_path)[0]["stage"] == "optimizer" and read_statuses(tmp_path)[0]["step"] == 2
    assert RankStatus.stage is stage
    monkeypatch.setenv("BATCHLAB_RANK_HOOK", str(tmp_path / "missing.py"))
    with pytest.raises(FileNotFoundError, match="BATCHLAB_RANK_HOOK"), hooked(0, tmp_path):
        pass


# ---------------------------------------------------------------- a failed run
class RecordingSink:
    def __init__(self):
        self.records, self.closed = [], []

    def log(self, record):
        self.records.append(record)

    def log_table(self, *args):
        pass

    def summary(self, values):
        pass

    def close(self, failed=False):
        self.closed.append(failed)


def test_a_failing_run_closes_its_logger_as_failed_once(tmp_path, batchlab_cache):
    from harness.train.loop.build import build_trainer
    from harness.train.loop.metrics import MetricLogger
    from harness.train.placement.registry import place

    config = run_config_from_dict(compose_config([
        "experiment=smoke", "trainer.nproc=1", "logger=none", "trainer.progress=false", "trainer.stop_tokens=3000",
        "trainer.eval_every_tokens=1000", "trainer.eval_real_prompts=0"]))
    trainer = build_trainer(rank_config(config), tmp_path, place(config.topology, RankEnv()))
    sink = RecordingSink()
    trainer.logger = MetricLogger([sink])

    def broken_eval(step):
        raise RuntimeError("eval broke")

    trainer.evaluator = broken_eval
    with pytest.raises(RuntimeError, match="eval broke"):
        trainer.train()
    trainer.abort()  # the launcher's own abort after the exception: nothing closes twice
    assert sink.closed == [True]  # the W&B run would be finished as failed (exit code 1), once



def test_a_stop_signal_during_the_optimizer_step_is_never_lost(tmp_path, batchlab_cache):
    """The ranks decide to stop together, from each rank's flag gathered with its step numbers; a signal landing
    after that gather (here: in the optimizer step) stops the run at the next step. It was lost when the handler
    set the decision itself and the gathered result overwrote it (a SIGTERM'd job then ran to its end, exit 0)."""
    import os
    import signal

    from harness.train.loop.build import build_trainer
    from harness.train.placement.registry import place

    config = run_config_from_dict(compose_config([
        "experiment=smoke", "trainer.nproc=1", "logger=none", "trainer.progress=false", "trainer.stop_tokens=8000",
        "eval.every_tokens=100000", "eval.real_prompts=0"]))
    trainer = build_trainer(rank_config(config), tmp_path, place(config.topology, RankEnv()))
    step = trainer.optimizer.step
    calls = []

    def step_then_signalled(*args, **kwargs):
        calls.append(1)
        result = step(*args, **kwargs)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGTERM)  # the trainer's handler runs here, after the gather
        return result

    trainer.optimizer.step = step_then_signalled
    summary = trainer.train()
    assert summary["status"] == "interrupted"
    assert summary["steps"] == 3 == len(calls)  # the step after the signal's, every rank with it


# ---------------------------------------------------------------- evaluation
class Recorded(Collectives):
    """One rank of a simulated job run alone: its all-reduce inputs are recorded (and returned unreduced)."""

    def __init__(self, env):
        super().__init__(env)
        self.sent = []

    def all_reduce_sum(self, tensor):
        self.sent.append(tensor.clone())
        return tensor

    def barrier(self):
        pass

    def all_gather_object(self, value):
        return [value]  # this rank's own (the per-sample lines; the metrics compared here go through all-reduces)


class Replayed(Recorded):
    """The last rank of the simulated job: each all-reduce adds what the other ranks sent at the same call."""

    def __init__(self, env, others):
        super().__init__(env)
        self.others = others

    def all_reduce_sum(self, tensor):
        out = tensor + sum(other.sent[len(self.sent)] for other in self.others)
        self.sent.append(tensor.clone())
        return out


def test_heldout_metrics_do_not_depend_on_the_world_size(tmp_path, batchlab_cache, capsys):
    """Held-out loss, accuracy per position, τ, each tercile's, and real acceptance: 1 rank against 2 ranks (each
    evaluating its own share, the sums all-reduced); also catches ranks evaluating the same share."""
    from harness.train.batch import BatchCollator
    from harness.train.loop.epoch_data import EpochData
    from harness.train.loop.evaluator import Evaluator
    from harness.train.rank_models import DrafterModel

    config = run_config_from_dict(compose_config([
        "experiment=smoke", "trainer.nproc=1", "logger=none", "trainer.eval_real_prompts=4",
        "trainer.eval_real_new_tokens=6"]))
    model = DrafterModel(models_config(config), torch.device("cpu"))
    status = type("Status", (), {"stage": staticmethod(lambda name, step: None)})()

    def evaluate(comm):
        data = EpochData(epoch_data_config(config), comm)
        drafter = model.drafter
        collate = BatchCollator(data.samples, "padded", block_size=drafter.block_size, num_anchors=64,
                                mask_token_id=drafter.mask_token_id, loss_decay_gamma=drafter.loss_decay_gamma,
                                max_blocks=None, anchor_seed=config.data.heldout_seed)
        return Evaluator(data=data, collate=collate, model=model, comm=comm, status=status,
                         eval_config=config.eval, gdn_backend=config.trainer.gdn_backend,
                         device=torch.device("cpu"), progress=progress)(0)

    progress = False
    alone = evaluate(Recorded(RankEnv()))
    # with progress: a bar of its own over this rank's held-out micro-batches (the training bar stood still for
    # 11-14 s at every eval), the same numbers
    progress = True
    capsys.readouterr()
    shown = evaluate(Recorded(RankEnv()))
    bar = capsys.readouterr().err
    assert "eval: held-out loss" in bar and "eval: speculative decoding" in bar, bar[-500:]
    micro_batches = max(int(done) for done, _ in re.findall(r"(\d+)/(\d+) \[", bar))
    assert micro_batches == int(re.findall(r"\d+/(\d+) \[", bar)[-1]) > 0  # it reached its total
    assert shown == alone
    progress = False
    rank1 = Recorded(RankEnv(1, 2))
    evaluate(rank1)
    together = evaluate(Replayed(RankEnv(0, 2), [rank1]))
    assert alone["eval_blocks"] == together["eval_blocks"] > 0 and alone["eval_length_groups"] == ["short", "mid", "long"]
    for key in ("eval_loss", "eval_accuracy", "eval_tau", "eval_tau_real", "eval_speedup_bound"):
        assert together[key] == pytest.approx(alone[key], rel=1e-6), key
    for key in ("eval_accuracy_per_position", "eval_loss_by_length", "eval_tau_by_length"):
        assert together[key] == pytest.approx(alone[key], rel=1e-6), key
    assert together["eval_tau_real_hist"] == alone["eval_tau_real_hist"]
    # the overall loss is the terciles' combined: their losses bracket it
    by_length = alone["eval_loss_by_length"]
    assert min(by_length) <= alone["eval_loss"] <= max(by_length)


# ---------------------------------------------------------------- schedule and data policies
def test_the_learning_rate_follows_tokens_warmup_cosine_and_floor():
    from harness.train.loop.lr_schedule import TokenCosineSchedule

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    schedule = TokenCosineSchedule(optimizer, lr=2.0, total_tokens=1000, warmup_fraction=0.1, min_lr_ratio=0.1)
    assert schedule.lr_at(0) == pytest.approx(2.0 / 100) and schedule.lr_at(49) == pytest.approx(2.0 * 50 / 100)
    assert schedule.lr_at(100) == pytest.approx(2.0)  # the end of warmup: the peak
    assert schedule.lr_at(550) == pytest.approx(2.0 * (0.1 + 0.9 * 0.5))  # half way down the cosine
    assert schedule.lr_at(1000) == pytest.approx(0.2) and schedule.lr_at(5000) == pytest.approx(0.2)  # the floor
    after = [schedule.lr_at(t) for t in range(100, 1001, 50)]
    assert all(a >= b for a, b in zip(after, after[1:]))
    assert schedule.set(550) == optimizer.param_groups[0]["lr"] == pytest.approx(1.1)


@pytest.mark.parametrize("policy", ["drop", "truncate", "error"])
def test_oversize_samples_follow_the_policy(policy, batchlab_cache):
    from harness.train.loop.epoch_data import EpochData

    overrides = ["experiment=smoke", "trainer.nproc=1", "logger=none", "trainer.max_tokens=96",
                 f"trainer.oversize={policy}"]
    config = run_config_from_dict(compose_config(overrides))
    if policy == "error":
        with pytest.raises(ValueError, match=r"sample \d+ has \d+ tokens, more than trainer.max_tokens=96"):
            EpochData(epoch_data_config(config), Collectives(RankEnv()))
        return
    data = EpochData(epoch_data_config(config), Collectives(RankEnv()))
    kept = data.train_report.kept
    over = int((data.samples.lengths[kept] > 96).sum())
    assert over > 0  # the budget is small enough to matter
    if policy == "drop":
        assert data.oversize_dropped == over and data.train_rows.size == kept.size - over
        assert (data.samples.lengths[data.train_rows] <= 96).all()
    else:
        assert data.oversize_truncated == over and data.train_rows.size == kept.size
        assert data.train_lengths.max() == 96
    plan = data.plan_epoch(0)
    assert plan.exactly_once() and plan.budget_violations().size == 0
    # what the run says it uses, in words and the counts above
    checked = kept.size + data.train_report.dropped_no_anchor.size
    words = data.selection_words()
    assert words.startswith(f"{data.train_rows.size} of {checked} training samples used (")
    verb = "dropped (trainer.oversize)" if policy == "drop" else "truncated to it"
    assert f"{over} over trainer.max_tokens=96 {verb}" in words, words
    no_anchor = data.train_report.dropped_no_anchor.size
    assert (f"{no_anchor} without a position to anchor a block" in words) == (no_anchor > 0), words


def test_max_samples_caps_every_micro_batch(batchlab_cache):
    from harness.train.loop.epoch_data import EpochData

    config = run_config_from_dict(compose_config(["experiment=smoke", "trainer.nproc=1", "logger=none",
                                                  "strategy=packed", "trainer.max_samples=3"]))
    plan = EpochData(epoch_data_config(config), Collectives(RankEnv())).plan_epoch(0)
    assert plan.micro_batch_sizes().max() == 3 and plan.budget_violations().size == 0


def test_the_run_log_copies_what_the_process_prints(tmp_path, capsys):
    """copied_to: stdout and stderr reach the terminal as they are and the log as whole lines, a progress bar as
    its last state, a cleared bar not at all; nested blocks copy once; the streams are put back afterwards."""
    import sys

    from harness.train.launch.run_log import copied_to

    log = tmp_path / "run" / "train.log"
    before = sys.stdout, sys.stderr
    with copied_to(log):
        print("data ✓ 40 samples")
        sys.stderr.write("bar: 10%\rbar: 50%\rbar: 100%\n")
        sys.stderr.write("\rconverting: 0 rows\r                  \r")
        with copied_to(log):
            print("closing line", flush=True)
        sys.stderr.write("unfinished")
    assert (sys.stdout, sys.stderr) == before
    assert log.read_text() == "data ✓ 40 samples\nbar: 100%\nclosing line\nunfinished\n"
    out, err = capsys.readouterr()
    assert out == "data ✓ 40 samples\nclosing line\n" and err.startswith("bar: 10%\rbar: 50%")


def test_an_in_process_run_leaves_the_signal_handlers_as_it_found_them(tmp_path, batchlab_cache):
    """A run inside a notebook or a test must hand Ctrl-C and SIGTERM back (they would otherwise only set the
    finished trainer's stop flag)."""
    import signal

    from support.train import Counter, compose_config

    from harness.train.launch.run import run

    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    summary = run(compose_config(["experiment=smoke", "trainer.nproc=1", "trainer.num_workers=0", "logger=none",
                                  "trainer.progress=false", "trainer.stop_tokens=1500", "trainer.eval_real_prompts=0"]),
                  tmp_path / "run")
    assert summary["status"] == "complete"
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before


def test_two_ranks_writing_one_json_file_never_take_each_others_temporary_file(tmp_path, monkeypatch):
    """Under torchrun every rank writes the run's config.json: another rank may write it between this rank's write
    and its rename (seen as a FileNotFoundError on the rename when both used one temporary name)."""
    import os

    from harness.train.loop.metrics import write_json_atomic

    path, real_replace, real_getpid = tmp_path / "config.json", os.replace, os.getpid
    interleaved = []

    def the_other_rank_writes_first(source, destination):
        if not interleaved:
            interleaved.append(source)
            with monkeypatch.context() as other:
                other.setattr(os, "getpid", lambda: real_getpid() + 1)
                write_json_atomic(path, {"rank": 1})
        real_replace(source, destination)

    monkeypatch.setattr(os, "replace", the_other_rank_writes_first)
    write_json_atomic(path, {"rank": 0})
    assert interleaved and json.loads(path.read_text()) == {"rank": 0}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json"]  # no temporary file left behind
