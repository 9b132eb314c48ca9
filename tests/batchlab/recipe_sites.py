"""The trainers of docs/recipes/, installed without their dependencies, and what runs each page's code against them.

Test side: :func:`page_block` (a page's python block), :func:`installed_site` (the trainer's folder, installed from the
package index on first use; the test is skipped where pip cannot install it) and :func:`run_recipe` (the block saved
as ``train_batchlab.py`` and run by this module's driver in a fresh process, whose findings come back as JSON).

Process side (``python recipe_sites.py speculators|specforge``): the driver imports the trainer (exit 3 with the
error's last line where that fails), then the page's block, and runs the trainer's own data loading on toy data.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PAGES = REPO / "docs" / "recipes"
IMPORT_FAILED = "IMPORT-FAILED: "
SPECFORGE_SITE = REPO / ".specforge-site"
SPECFORGE_PACKAGES = ("specforge==0.2.0",)
#: how each trainer is installed: speculators by the peer benchmark's own ensure_site (.speculators-site/)
INSTALLERS = {
    "speculators": "import sys; sys.path.insert(0, 'benchmarks'); import speculators_peer as m; m.ensure_site()",
    "specforge": "import sys; sys.path.insert(0, 'tests/batchlab'); import recipe_sites as m; m.ensure_specforge()",
}
SITES = {"speculators": REPO / ".speculators-site", "specforge": SPECFORGE_SITE}

# ------------------------------------------------------------------------------------------------ test side


def page_block(name: str) -> str:
    """The one python block of docs/recipes/<name>.md."""
    blocks = re.findall(r"```python\n(.*?)```", (PAGES / f"{name}.md").read_text(), flags=re.S)
    assert len(blocks) == 1, f"docs/recipes/{name}.md should hold one python block, not {len(blocks)}"
    return blocks[0]


def ensure_specforge() -> Path:
    """SpecForge in .specforge-site/, installed with --no-deps on first use (batchlab's torch, transformers serve)."""
    import subprocess

    if not (SPECFORGE_SITE / "specforge" / "training" / "trainer.py").is_file():
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(SPECFORGE_SITE),
                        *SPECFORGE_PACKAGES], check=True)
    return SPECFORGE_SITE


def installed_site(name: str) -> Path:
    """The folder holding the trainer ``name``; the test is skipped, with pip's own last error line, where it cannot
    be installed (no network, no such release)."""
    import pytest
    from support.process import run_process

    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_DEFAULT_TIMEOUT": "10", "PIP_RETRIES": "0"}
    try:
        result = run_process([sys.executable, "-c", INSTALLERS[name]], cwd=REPO, env=env, timeout=240)
    except AssertionError as error:  # run_process's timeout
        pytest.skip(f"{name} could not be installed within 240 s: {str(error).splitlines()[0]}")
    if result.returncode != 0:
        pytest.skip(f"{name} could not be installed (pip install --no-deps): {_last_error(result.stderr)}")
    return SITES[name]


def run_recipe(name: str, tmp_path: Path, timeout: float = 150) -> dict:
    """The page's block saved as ``train_batchlab.py`` and run by this module's driver for ``name`` in a fresh
    process: what the driver found (the test is skipped where the trainer itself cannot be imported)."""
    import pytest
    from support.process import failure_text, run_process

    site = installed_site(name)
    (tmp_path / "train_batchlab.py").write_text(page_block(name))
    path = os.pathsep.join([str(tmp_path), str(site), str(REPO), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path, "PYTHONWARNINGS": "ignore"}
    result = run_process([sys.executable, str(Path(__file__).resolve()), name], cwd=tmp_path, env=env,
                         timeout=timeout)
    failed_import = [line for line in result.stdout.splitlines() if line.startswith(IMPORT_FAILED)]
    if result.returncode == 3 and failed_import:
        pytest.skip(f"{name} is installed but does not import here: {failed_import[-1][len(IMPORT_FAILED):]}")
    assert result.returncode == 0, f"the {name} recipe failed:{failure_text(result)}"
    return json.loads(result.stdout.strip().splitlines()[-1])


def _last_error(stderr: str) -> str:
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("ERROR")]
    return (errors or lines or ["(pip said nothing)"])[-1]


# ------------------------------------------------------------------------------------------------ process side

#: toy samples: sample i's tokens are 1000 * i + 0, 1, 2, ... so a batch's documents can be read back from its tokens
SPECULATORS_LENGTHS = [5, 9, 7, 4, 6, 12, 3, 40, 8, 10, 5, 7, 11, 6, 4, 9, 13, 2, 15, 6, 20]  # one over 32 tokens
SPECULATORS_SEQ_LEN, HIDDEN, LAYERS, SEED, EPOCHS = 32, 8, 3, 0, 3
SPECFORGE_LENGTHS = [5, 9, 7, 4, 6, 12, 3, 14, 8, 10, 5, 7, 11, 6, 4, 9, 13, 2, 15, 6, 16]
SPECFORGE_MAX_LEN, SPECFORGE_MAX_TOKENS = 16, 24
#: (strategy, world size, accumulation, prefetch workers) of the SpecForge runs
SPECFORGE_RUNS = [("bucketed", 1, 1, 0), ("length_grouped", 2, 1, 2), ("length_grouped", 2, 2, 0)]


def _import_or_exit(modules: list[str]) -> None:
    import importlib

    try:
        for module in modules:
            importlib.import_module(module)
    except Exception as error:  # noqa: BLE001 - reported to the test, which skips
        print(f"{IMPORT_FAILED}{module}: {type(error).__name__}: {error}".splitlines()[0], flush=True)
        sys.exit(3)


def speculators_driver() -> dict:
    """speculators' own ``_setup_dataloader`` (after the page's code replaced its sampler) on toy samples: what its
    DataLoader yields every epoch on 1 rank and on each of 2, the batches ``StrategyBatchSampler`` plans for the
    same, and a mid-epoch resume through the Trainer's own ``_prepare_resume_skip``."""
    _import_or_exit(["speculators.train.dataloader", "speculators.train.data", "speculators.train.trainer"])
    import types

    import numpy as np
    import torch
    import speculators.train.dataloader as dataloader
    from speculators.train.data import BaseDataset
    from speculators.train.trainer import Trainer

    import train_batchlab as recipe  # the page's block
    from batchlab import StrategyBatchSampler

    class Toy(BaseDataset):
        def __init__(self, lengths):
            self.lengths = lengths
            super().__init__(max_len=SPECULATORS_SEQ_LEN, hidden_states_dtype=torch.float32)

        def _compute_approx_lengths(self):
            return list(self.lengths)

        def __len__(self):
            return len(self.lengths)

        def _get_raw_data(self, index):
            n = self.lengths[index]
            return {"hidden_states": torch.randn(n, LAYERS * HIDDEN), "input_ids": 1000 * index + torch.arange(n),
                    "verifier_last_hidden_states": torch.randn(n, HIDDEN), "loss_mask": torch.ones(n, dtype=torch.bool)}

    def read_row(batch):
        """The documents of one packed row, read back from its tokens, and its layout facts."""
        documents = batch["document_ids"][0]
        ids, positions = batch["input_ids"][0], batch["position_ids"][0]
        docs, sizes, restart = [], [], True
        for doc in range(int(documents.max()) + 1):
            where = (documents == doc).nonzero().flatten()
            docs.append(int(ids[where[0]]) // 1000)
            sizes.append(int(where.numel()))
            restart &= bool(torch.equal(positions[where], torch.arange(where.numel())))
            restart &= bool(torch.equal(ids[where], 1000 * docs[-1] + torch.arange(where.numel())))
        real = int((documents >= 0).sum())
        return {"docs": docs, "sizes": sizes, "positions_restart": restart,
                "padding_after_documents": bool((documents[real:] == -1).all()),
                "shapes": {key: list(value.shape) for key, value in batch.items() if hasattr(value, "shape")},
                "locally_empty": bool(getattr(batch.get("__recovery__"), "locally_empty", False))}

    dataset = Toy(SPECULATORS_LENGTHS)
    found = {"strategies": {}}
    for strategy in ("packed", "bucketed"):
        recipe.STRATEGY = strategy
        runs = found["strategies"][strategy] = []
        for world in (1, 2):
            for rank in range(world):
                dataloader.get_dp_rank, dataloader.get_dp_size = (lambda r=rank: r), (lambda w=world: w)
                loader = dataloader._setup_dataloader(dataset, SPECULATORS_SEQ_LEN, HIDDEN, num_workers=0,
                                                      num_target_layers=LAYERS, seed=SEED)
                planned = StrategyBatchSampler(np.asarray(SPECULATORS_LENGTHS), max_tokens=SPECULATORS_SEQ_LEN,
                                               strategy=strategy, seed=SEED, rank=rank, world_size=world,
                                               oversize="truncate")
                run = {"world": world, "rank": rank, "sampler": type(loader.batch_sampler).__name__,
                       "epochs": [], "expected": [], "lengths": []}
                for epoch in range(EPOCHS):
                    loader.batch_sampler.set_epoch(epoch)  # as the Trainer's train_epoch does
                    planned.set_epoch(epoch)
                    run["lengths"].append(len(loader))
                    run["epochs"].append([read_row(batch) for batch in loader])
                    run["expected"].append(list(planned))
                if world == 2:  # a mid-epoch resume of epoch 1 after 2 batches, by the Trainer's own code
                    trainer = types.SimpleNamespace(train_loader=loader, current_epoch=1, _resume_local_step=2,
                                                    global_step=0)
                    loader.batch_sampler.set_epoch(1)
                    skipped = Trainer._prepare_resume_skip(trainer, 1)
                    resumed_length = len(loader)
                    resumed = [read_row(batch)["docs"] for batch in loader]
                    loader.batch_sampler.set_epoch(2)
                    run["resume"] = {"skipped": skipped, "length": resumed_length, "docs": resumed,
                                     "next_epoch_length": len(loader)}
                runs.append(run)
    return found


def specforge_driver(features: Path) -> dict:
    """SpecForge's own ``build_offline_runtime`` (after the page's code replaced its loader and sharding) on toy
    feature files, stopped when the Trainer hands the optimizer its step horizon: the Trainer's loader, what it yields
    every epoch, the horizon, and the batches ``StrategyBatchSampler`` plans for the same."""
    _import_or_exit(["specforge.launch", "specforge.training.trainer", "specforge.algorithms.builtin"])
    import tempfile

    import torch
    from specforge.algorithms.builtin import builtin_algorithm_registry
    from specforge.launch import build_offline_runtime

    import train_batchlab as recipe  # the page's block
    from batchlab import StrategyBatchSampler

    features.mkdir(exist_ok=True)
    for index, n in enumerate(SPECFORGE_LENGTHS):
        torch.save({"input_ids": 1000 * index + torch.arange(n), "loss_mask": torch.ones(n, dtype=torch.long),
                    "hidden_states": torch.randn(n, LAYERS * HIDDEN)}, features / f"data_{index:03d}.ckpt")

    class HorizonReached(Exception):
        pass

    class Optimizer:  # the Trainer hands it the schedule's horizon, then would build the model: stop there
        def configure_total_steps(self, steps):
            self.total_steps = steps
            raise HorizonReached

    def build(accumulation, workers, optimizer):
        recipe.TRAIN_LOADER = None
        try:
            build_offline_runtime(algorithm=builtin_algorithm_registry().resolve("dflash"),
                                  hidden_states_path=str(features), draft_model=torch.nn.Linear(1, 1),
                                  target_head=None, optimizer_factory=optimizer, run_id="toy",
                                  output_dir=tempfile.mkdtemp(), max_len=SPECFORGE_MAX_LEN, batch_size=2,
                                  accumulation_steps=accumulation, num_epochs=EPOCHS, seed=SEED,
                                  dataloader_num_workers=workers)
        except HorizonReached:
            return recipe.TRAIN_LOADER
        raise AssertionError("the Trainer never configured the optimizer's horizon")

    def read_batch(batch):
        ids, mask = batch.tensors["input_ids"], batch.tensors["loss_mask"]
        return {"docs": [int(row[0]) // 1000 for row in ids], "sizes": [int(row.sum()) for row in mask],
                "ids": [f"toy:{int(row[0]) // 1000:08d}" for row in ids], "sample_ids": list(batch.sample_ids),
                "shapes": {key: list(value.shape) for key, value in batch.tensors.items()}}

    recipe.MAX_TOKENS, recipe.SEED = SPECFORGE_MAX_TOKENS, SEED
    lengths = [min(n, SPECFORGE_MAX_LEN) for n in SPECFORGE_LENGTHS]
    found = {"runs": [], "refusals": {}}
    for strategy, world, accumulation, workers in SPECFORGE_RUNS:
        recipe.STRATEGY, recipe.ACCUMULATION_STEPS = strategy, accumulation
        for rank in range(world):
            recipe.data_parallel_position = lambda r=rank, w=world: (r, w)
            optimizer = Optimizer()
            loader = build(accumulation, workers, optimizer)
            planned = StrategyBatchSampler(lengths, max_tokens=SPECFORGE_MAX_TOKENS, strategy=strategy, seed=SEED,
                                           rank=rank, world_size=world, grad_accum=accumulation)
            run = {"strategy": strategy, "world": world, "rank": rank, "accumulation": accumulation,
                   "workers": workers, "loader": type(loader).__name__, "refs": len(loader._refs),
                   "trainer_set_epoch": loader._reload_refs.__qualname__, "total_steps": optimizer.total_steps,
                   "epochs": [], "expected": [], "steps": []}
            for epoch in range(EPOCHS):
                loader.set_epoch(epoch)  # the Trainer's own set_epoch, wrapped by the page's loader
                planned.set_epoch(epoch)
                run["epochs"].append([read_batch(batch) for batch in loader])
                run["expected"].append(list(planned))
                run["steps"].append(planned.num_steps)
            loader.set_epoch(1)
            loader.seek(1)  # the controller's mid-epoch resume: skip that many micro-batches
            run["after_seek"] = [read_batch(batch)["docs"] for batch in loader]
            found["runs"].append(run)
    recipe.data_parallel_position = lambda: (0, 1)
    for name, (strategy, accumulation) in {"packed": ("packed", 1), "accumulation": ("bucketed", 2)}.items():
        recipe.STRATEGY, recipe.ACCUMULATION_STEPS = strategy, 1
        try:
            build(accumulation, 0, Optimizer())
            found["refusals"][name] = None
        except ValueError as error:
            found["refusals"][name] = str(error)
    return found


if __name__ == "__main__":
    drivers = {"speculators": lambda: speculators_driver(),
               "specforge": lambda: specforge_driver(Path.cwd() / "features")}
    result = drivers[sys.argv[1]]()
    print(json.dumps(result), flush=True)
