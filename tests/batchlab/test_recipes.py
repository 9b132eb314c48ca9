"""docs/recipes/: each page's python block, run as written against the trainer it is for (installed from the package
index without its dependencies; skipped where that cannot be done), through the trainer's own data loading, on toy
data on CPU: the trainer's loader yields batchlab's micro-batches, every sample once an epoch across ranks, in the
layout the trainer's model reads (tests/batchlab/recipe_sites.py runs each block in a fresh process)."""

from __future__ import annotations

from collections import Counter

from recipe_sites import (
    EPOCHS, HIDDEN, LAYERS, SPECFORGE_LENGTHS, SPECFORGE_MAX_LEN, SPECFORGE_MAX_TOKENS, SPECFORGE_RUNS,
    SPECULATORS_LENGTHS, SPECULATORS_SEQ_LEN, run_recipe,
)


def test_speculators_dataloader_yields_batchlabs_packed_rows_every_sample_once_and_resumes(tmp_path):
    found = run_recipe("speculators", tmp_path)
    samples = len(SPECULATORS_LENGTHS)
    empty_seen = 0
    for strategy, runs in found["strategies"].items():
        assert [(run["world"], run["rank"]) for run in runs] == [(1, 0), (2, 0), (2, 1)]
        for run in runs:
            where = f"{strategy}, rank {run['rank']} of {run['world']}"
            assert run["sampler"] == "SpeculatorsBatchSampler", where  # what _setup_dataloader built
            for epoch in range(EPOCHS):
                rows, expected = run["epochs"][epoch], run["expected"][epoch]
                # the trainer's DataLoader yields StrategyBatchSampler's micro-batches, in its order
                assert [row["docs"] for row in rows] == expected, f"{where}, epoch {epoch}"
                assert run["lengths"][epoch] == len(expected)
                for row in rows:
                    assert row["shapes"] == {  # one packed row, the keys speculators' models take
                        "hidden_states": [1, SPECULATORS_SEQ_LEN, LAYERS * HIDDEN],
                        "input_ids": [1, SPECULATORS_SEQ_LEN], "loss_mask": [1, SPECULATORS_SEQ_LEN],
                        "verifier_last_hidden_states": [1, SPECULATORS_SEQ_LEN, HIDDEN],
                        "position_ids": [1, SPECULATORS_SEQ_LEN], "document_ids": [1, SPECULATORS_SEQ_LEN]}, where
                    assert row["sizes"] == [min(SPECULATORS_LENGTHS[d], SPECULATORS_SEQ_LEN) for d in row["docs"]]
                    assert sum(row["sizes"]) <= SPECULATORS_SEQ_LEN
                    assert row["positions_restart"] and row["padding_after_documents"], where
                    assert row["locally_empty"] == (not row["docs"])  # an empty micro-batch: speculators' own path
                    empty_seen += not row["docs"]
        for epoch in range(EPOCHS):
            one_rank = Counter(d for row in runs[0]["epochs"][epoch] for d in row["docs"])
            two_ranks = Counter(d for run in runs[1:] for row in run["epochs"][epoch] for d in row["docs"])
            assert one_rank == two_ranks == Counter(range(samples)), f"{strategy}, epoch {epoch}: every sample once"
            assert runs[1]["lengths"][epoch] == runs[2]["lengths"][epoch]  # the ranks step together
        assert [row["docs"] for row in runs[0]["epochs"][0]] != [row["docs"] for row in runs[0]["epochs"][1]]
        for run in runs[1:]:  # the Trainer's mid-epoch resume skips the batches done and trains the rest
            resume, expected = run["resume"], run["expected"][1]
            assert resume["skipped"] == 2
            assert resume["docs"] == expected[2:] and resume["length"] == len(expected) - 2
            assert resume["next_epoch_length"] == len(run["expected"][2])
    assert empty_seen, "the toy data should give some rank an empty micro-batch (a short last step)"


def test_specforge_trainer_loader_yields_batchlabs_padded_batches_and_its_horizon(tmp_path):
    found = run_recipe("specforge", tmp_path)
    lengths = [min(n, SPECFORGE_MAX_LEN) for n in SPECFORGE_LENGTHS]
    runs = found["runs"]
    assert [(r["strategy"], r["world"], r["accumulation"], r["workers"]) for r in runs] == [
        (strategy, world, accumulation, workers)
        for strategy, world, accumulation, workers in SPECFORGE_RUNS for _ in range(world)]
    dropped_seen = False
    for start in range(len(runs)):
        if runs[start]["rank"] != 0:
            continue
        group = runs[start:start + runs[start]["world"]]  # the ranks of one run
        accumulation = group[0]["accumulation"]
        total_steps = 0
        for epoch in range(EPOCHS):
            expected = [run["expected"][epoch] for run in group]
            # a short last step (some rank's micro-batch empty) is left out on every rank
            short = any(not batch for batch_list in expected for batch in batch_list[-accumulation:])
            dropped_seen |= short
            keep = len(expected[0]) - accumulation * short
            total_steps += group[0]["steps"][epoch] - short
            covered = Counter()
            for run, planned in zip(group, expected):
                where = f"{run['strategy']}, rank {run['rank']} of {run['world']} (accumulation {accumulation})"
                batches = run["epochs"][epoch]
                assert [batch["docs"] for batch in batches] == planned[:keep], f"{where}, epoch {epoch}"
                assert len(batches) % accumulation == 0  # whole optimizer steps only
                for batch in batches:
                    rows, longest = len(batch["docs"]), max(batch["sizes"])
                    assert batch["shapes"] == {"input_ids": [rows, longest], "loss_mask": [rows, longest],
                                               "hidden_states": [rows, longest, LAYERS * HIDDEN]}, where
                    assert batch["sizes"] == [lengths[d] for d in batch["docs"]]
                    assert rows * longest <= SPECFORGE_MAX_TOKENS
                    assert batch["sample_ids"] == batch["ids"]  # the unsharded refs, in their order
                    covered.update(batch["docs"])
            assert len({len(run["epochs"][epoch]) for run in group}) == 1  # FSDP: every rank the same count
            assert max(covered.values()) == 1, "a sample twice in an epoch"
            dropped = [d for batch_list in expected for batch in batch_list[keep:] for d in batch]
            assert sorted(covered) == sorted(set(range(len(lengths))) - set(dropped))
            if group[0]["world"] == 1 and accumulation == 1:
                assert not short and sorted(covered) == list(range(len(lengths)))  # every sample once
        for run in group:
            assert run["loader"] == "BatchlabFeatureDataLoader"  # what SpecForge's Trainer built
            assert run["refs"] == len(lengths)  # every ref on every rank: the sampler shards them
            assert run["trainer_set_epoch"].startswith("Trainer.__init__")  # the Trainer's reload, still called
            assert run["total_steps"] == total_steps  # the schedule's horizon is batchlab's plans' steps
            assert run["after_seek"] == [batch["docs"] for batch in run["epochs"][1]][1:]
    assert dropped_seen, "the toy data should give a short last step somewhere"
    refusals = found["refusals"]
    assert refusals["packed"] and "padded strategy" in refusals["packed"]
    assert refusals["accumulation"] and "accumulation_steps=2" in refusals["accumulation"]
