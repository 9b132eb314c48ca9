"""The epoch reaches every per-epoch and per-sample draw on the training path, end to end: a two-epoch run's
micro-batches and each sample's anchors differ between its epochs, and a rerun repeats both exactly."""

from __future__ import annotations

import pytest
from support.train import compose_config

RUN = ["experiment=smoke", "trainer.nproc=1", "trainer.num_workers=0", "logger=none", "trainer.progress=false",
       "data.max_documents=40", "trainer.max_tokens=512", "trainer.stop_tokens=null", "trainer.stop_epochs=2",
       "eval.every_tokens=1000000", "eval.real_prompts=0", "checkpoint.every_steps=1000"]


def _recorded_run(run_dir, strategy: str, monkeypatch) -> dict[int, list[dict[int, tuple[int, ...]]]]:
    """Each epoch's micro-batches as the loop collated them, in order: ``{dataset row: its anchors}`` each."""
    from harness.train import batch as batch_module
    from harness.train.launch.run import run

    epochs: dict[int, list[dict[int, tuple[int, ...]]]] = {}
    current = []
    original_init, original_collate = batch_module.RankMicroBatches.__init__, batch_module.BatchCollator.__call__

    def init(self, plan, *args, **kwargs):
        original_init(self, plan, *args, **kwargs)
        current.append(plan.epoch)
        epochs.setdefault(plan.epoch, [])

    def collate(self, rows, lengths, epoch):
        made = original_collate(self, rows, lengths, epoch)
        if made.drafter is not None:
            layout = made.drafter.layout
            anchors = {int(r): tuple(layout.anchor[(layout.doc_index == d) & layout.keep].tolist())
                       for d, r in enumerate(rows)}
            epochs[current[-1]].append(anchors)
        return made

    with monkeypatch.context() as patch:
        patch.setattr(batch_module.RankMicroBatches, "__init__", init)
        patch.setattr(batch_module.BatchCollator, "__call__", collate)
        run(compose_config([*RUN, f"strategy={strategy}"]), run_dir)
    return epochs


@pytest.mark.parametrize("strategy", ["packed", "sorted"])
def test_a_two_epoch_runs_batches_and_anchors_change_with_the_epoch_and_repeat_on_a_rerun(
        tmp_path, batchlab_cache, monkeypatch, strategy):
    first = _recorded_run(tmp_path / "first", strategy, monkeypatch)
    assert sorted(first) == [0, 1] and all(first.values())
    zero, one = first[0], first[1]
    # the plan's draw: another order (and, for packed, other micro-batches) in epoch 1
    assert [sorted(b) for b in zero] != [sorted(b) for b in one]
    if strategy == "packed":
        assert {frozenset(b) for b in zero} != {frozenset(b) for b in one}
    # the per-sample draw: a sample's anchors are drawn again in epoch 1
    anchors = [{row: a for batch in batches for row, a in batch.items()} for batches in (zero, one)]
    shared = [row for row in anchors[0] if row in anchors[1] and anchors[0][row]]
    changed = sum(anchors[0][row] != anchors[1][row] for row in shared)
    assert len(shared) >= 10 and changed >= 0.8 * len(shared), (changed, len(shared))
    # and all of it from the seed, the epoch and the sample: a rerun repeats it exactly
    assert _recorded_run(tmp_path / "again", strategy, monkeypatch) == first
