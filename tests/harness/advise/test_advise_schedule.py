"""The placements' schedules simulated (harness/advise/schedule.py): by hand on small cases, and against the bound.

The split's protocol (credits seen at the poll's ticks, a step's micro-batches taken together), the cores shared
by the job's processes, and the colocated ranks meeting at every step; the link measured by two real ranks."""

from __future__ import annotations

import numpy as np
import pytest

from harness.advise.schedule import LinkCost, Event, Machine, simulate_colocated, simulate_split
from harness.advise.stages import StageCost, Terms, colocated_seconds, split_seconds
from harness.train.placement.link import POLL_FIRST_S, POLL_MAX_S
from strategies import Budget, build_strategy

LENGTHS = np.random.default_rng(7).lognormal(5, 0.7, 300).astype(np.int64).clip(20, 1000)
TARGET = StageCost(a=1e-5, b=1e-8, m=0.002, block_size=8, num_anchors=64)
DRAFTER = StageCost(c=2e-4, m=0.003, block_size=8, num_anchors=64)
FREE = LinkCost()


def make_plan(strategy="shuffle", world_size=1, grad_accum=2, step_tokens=None):
    return build_strategy(strategy).plan(LENGTHS, Budget(1024), seed=0, epoch=0, world_size=world_size,
                                         grad_accum=grad_accum, oversize="drop", step_tokens=step_tokens)


def stage_seconds(plan):
    terms = Terms.of(plan, DRAFTER.block_size, DRAFTER.num_anchors)
    return TARGET.seconds(terms), DRAFTER.seconds(terms)


def test_a_credit_is_seen_at_the_poll_loops_next_tick():
    machine, event, resumed = Machine(None), Event(), []

    def waiter():
        yield ("poll", event)
        resumed.append(machine.now)

    machine.start(waiter())
    machine._at(0.005, lambda: event.fire(machine.now))  # the credit comes 5 ms into the wait
    machine.run()
    ticks, pause = [0.0], POLL_FIRST_S
    while ticks[-1] < 0.005:
        ticks.append(ticks[-1] + pause)
        pause = min(2 * pause, POLL_MAX_S)
    assert resumed == [pytest.approx(ticks[-1])] and ticks[-1] == pytest.approx(0.0062)  # 0.2, 0.6, 1.4, 3.0, 6.2 ms


def test_colocated_on_a_core_each_is_the_stage_bound_and_shares_cores_when_fewer():
    plan = make_plan(world_size=3, grad_accum=1)
    target_s, drafter_s = stage_seconds(plan)
    bound = colocated_seconds(plan, TARGET, DRAFTER, 0.004)
    assert simulate_colocated(plan, target_s, drafter_s, 0.004, cores=None).epoch_seconds == pytest.approx(bound, rel=1e-9)
    assert simulate_colocated(plan, target_s, drafter_s, 0.004, cores=3).epoch_seconds == pytest.approx(bound, rel=1e-9)
    # 3 ranks of equal work on 2 cores: every step takes 3/2 as long
    equal = np.full(plan.micro_batch_slots().shape, 0.01)  # every rank's slot, the last step's empty ones too
    alone = simulate_colocated(plan, equal, 0 * equal, 0.0, cores=None).epoch_seconds
    shared = simulate_colocated(plan, equal, 0 * equal, 0.0, cores=2).epoch_seconds
    assert shared == pytest.approx(1.5 * alone, rel=1e-9)


def test_a_split_never_beats_its_stage_bound_and_reaches_it_with_a_free_link_and_deep_credits():
    for strategy in ("sorted", "shuffle", "packed"):
        plan = make_plan(strategy, world_size=1, grad_accum=2)
        target_s, drafter_s = stage_seconds(plan)
        bound = split_seconds(plan, TARGET, DRAFTER, 1, 0.001).epoch_seconds
        shallow = simulate_split(plan, target_s, drafter_s, FREE, 1, 0.001, cores=None, max_in_flight=2)
        deep = simulate_split(plan, target_s, drafter_s, FREE, 1, 0.001, cores=None, max_in_flight=10_000)
        assert bound <= deep.epoch_seconds + 1e-9 and deep.epoch_seconds <= shallow.epoch_seconds + 1e-9
        # with every micro-batch allowed in flight nothing waits for a credit: only the pipeline's fill and drain
        assert deep.epoch_seconds == pytest.approx(bound, rel=0.05), strategy
        assert deep.tokens == pytest.approx(float(plan.micro_batch_tokens().sum()))


def test_a_target_bound_split_with_a_free_link_lasts_its_target_work():
    plan = make_plan(world_size=1, grad_accum=2)
    nonempty = plan.micro_batch_sizes() > 0
    target_s = np.where(nonempty, 0.01, 0.0)
    run = simulate_split(plan, target_s, 0 * target_s, FREE, 1, 0.0, cores=None, max_in_flight=10_000)
    assert run.epoch_seconds == pytest.approx(target_s.sum(), rel=1e-9)
    assert run.target_busy == pytest.approx(1.0) and run.drafter_waiting == pytest.approx(1.0)


def test_the_links_costs_and_shared_cores_slow_a_split_down():
    plan = make_plan(world_size=1, grad_accum=4)
    target_s, drafter_s = stage_seconds(plan)
    free = simulate_split(plan, target_s, drafter_s, FREE, 3, 0.001, cores=None)
    costly = simulate_split(plan, target_s, drafter_s, LinkCost(send=(0.002, 1e-6, 0), receive=(0.001, 0, 1e-6),
                                                               unpack=(0.0005, 0, 0)), 3, 0.001, cores=None)
    shared = simulate_split(plan, target_s, drafter_s, FREE, 3, 0.001, cores=2)
    assert costly.epoch_seconds > free.epoch_seconds and shared.epoch_seconds > free.epoch_seconds
    # 3 target ranks + a drafter rank on 2 cores can go no faster than all their work on 2 cores
    work = target_s.sum() + drafter_s.sum() + 0.001 * plan.num_steps
    assert shared.epoch_seconds >= work / 2 - 1e-9


def test_round_robin_keeps_each_target_ranks_turns_and_dynamic_dispatch_balances_them():
    """Deep credits, a free drafter: alternate micro-batches cost 30 ms and 10 ms. Round robin gives one target rank
    every 30 ms one, so the epoch is their sum; dynamic dispatch hands the next one to whichever rank is free."""
    plan = make_plan("shuffle", world_size=1, grad_accum=4)
    numbers = np.arange(plan.micro_batch_slots().size)  # one drafter rank, fixed accumulation: slot = work order
    target_s = np.where(numbers % 2 == 0, 0.03, 0.01)
    zero = np.zeros_like(target_s)
    robin = simulate_split(plan, target_s, zero, FREE, 2, 0.0, cores=None, max_in_flight=10_000, dispatch="round_robin")
    dynamic = simulate_split(plan, target_s, zero, FREE, 2, 0.0, cores=None, max_in_flight=10_000, dispatch="dynamic")
    assert robin.epoch_seconds == pytest.approx(target_s[::2].sum(), rel=1e-9)
    assert target_s.sum() / 2 <= dynamic.epoch_seconds + 1e-9 <= target_s.sum() / 2 + 0.03
    assert dynamic.epoch_seconds < 0.8 * robin.epoch_seconds


def test_two_drafter_ranks_meet_at_every_step_and_a_runs_first_steps_can_be_simulated():
    plan = make_plan("shuffle", world_size=2, grad_accum=1, step_tokens=2048)
    target_s, drafter_s = stage_seconds(plan)
    whole = simulate_split(plan, target_s, drafter_s, FREE, 2, 0.001, cores=None)
    assert whole.tokens == pytest.approx(float(plan.micro_batch_tokens().sum()))
    first = simulate_split(plan, target_s, drafter_s, FREE, 2, 0.001, cores=None, tokens=10_000)
    steps = int(np.argmax(np.cumsum(plan.tokens_per_step()) >= 10_000)) + 1
    assert first.tokens == pytest.approx(float(plan.tokens_per_step()[:steps].sum()))
    assert first.epoch_seconds < whole.epoch_seconds
    # the drafter ranks' slowest rank bounds every step
    slots = plan.rank_step_slots()
    per_slot = drafter_s.reshape(plan.num_steps, 2, plan.grad_accum)
    per_rank = np.array([[per_slot[s, r, :slots[s, r]].sum() for r in range(2)] for s in range(plan.num_steps)]).max(1)
    assert whole.epoch_seconds >= per_rank.sum() + 0.001 * plan.num_steps - 1e-9


def test_the_link_is_measured_by_two_ranks_fitted_and_cached(tmp_path, batchlab_cache):
    from harness.advise.link import calibrate_link
    from harness.train.config import compose_run_config

    config = compose_run_config(["experiment=smoke", "trainer.max_tokens=512", "logger=none",
                                 "trainer.threads_per_rank=1"])
    cost, values = calibrate_link(config, tmp_path, progress=False)
    assert len(values["rows"]) >= 5 and {r["layout"] for r in values["rows"]} == {"padded", "packed"}
    for row in values["rows"]:
        assert row["slots"] >= row["tokens"] > 0 and min(row["send"], row["receive"], row["unpack"]) > 0
    send, receive, unpack = cost.seconds(np.array([512.0]), np.array([512.0]))
    assert 0 < send[0] < 0.5 and 0 < receive[0] < 0.5 and 0 <= unpack[0] < 0.5
    again, _ = calibrate_link(config, tmp_path, progress=False)
    assert again == cost  # read from the cache, nothing measured


def test_ranks_calibrating_together_count_every_ranks_runs(batchlab_cache):
    """With more ranks than cores the scheduler decides which rank gets a core first: the calibration keeps every
    rank's runs of a shape (the median is a typical rank's), not rank 0's alone."""
    from harness.advise.calibrate import REPEATS, Shape, concurrent_rank
    from harness.train.config import compose_run_config
    from harness.train.distributed import launch

    config = compose_run_config(["experiment=smoke", "trainer.max_tokens=256", "logger=none",
                                 "trainer.threads_per_rank=1"])
    shapes = [Shape("packed", (128, 128)), Shape("padded", (64, 64))]
    results = launch(concurrent_rank, (config, shapes), 2, run_id="test-concurrent-calibration")
    assert len(results) == len(shapes)
    for times, target_times, step_s in results:
        assert len(times) == len(target_times) == 2 * REPEATS  # both ranks' runs
        assert all(0 < u < t for t, u in zip(times, target_times)) and step_s > 0
