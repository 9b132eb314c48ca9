"""Follow a run's config from the entry point: the files it reaches, in order, and how often the walk climbs.

The walk is traced, not read: ``batchlab-train`` runs in this process (one rank, the main job's settings
shrunk to a few steps) under ``sys.setprofile``, and every call of a project function that is handed the
config — the composed Hydra config, the resolved dict, the typed :class:`~harness.train.config.RunConfig` or
one of its sections — is a step of the walk, from the calling project file to the called one. A *climb* is
a step to a file on a higher layer than the caller's (the import-linter contract in ``pyproject.toml``: 0 the
entry points, higher numbers below): the config handed back up (a callback, a registry, a lazy import), where
it should only flow down. Files are listed in the order of their first visit, each with its layer.

    python benchmarks/config_walk.py                 # the main job's config (tiny-pretrained target, regenerated data)
    python benchmarks/config_walk.py --write         # and the result into benchmarks/RESULTS.md

The pretrained target and the regenerated completions come from the cache (``$BATCHLAB_CACHE``) when they
are there; a cold cache builds them first (minutes) and the walk then also visits the builders.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import logging
import sys
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import datetime  # noqa: E402
import platform  # noqa: E402

from results_file import cpu_model, write_section  # noqa: E402

TITLE = "## Config walk: a run's config from the entry point"

#: the main job (conf/experiment/strategies.yaml) shrunk to a few steps, one rank, no W&B
OVERRIDES = ["experiment=strategies", "strategy=packed", "seed=0", "logger=none", "trainer.progress=false",
             "trainer.stop_epochs=null", "trainer.stop_tokens=8192", "eval.every_tokens=8192",
             "eval.real_prompts=2", "eval.real_new_tokens=4"]


def layers() -> list[tuple[str, ...]]:
    """The layering contract's layers, top first, each a tuple of module prefixes."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    contract = next(c for c in config["contracts"] if c["type"] == "layers")
    return [tuple(part.strip() for part in layer.replace("|", ":").split(":")) for layer in contract["layers"]]


def layer_of(module: str, stack: list[tuple[str, ...]]) -> int | None:
    """The index of the layer holding ``module`` (the longest matching prefix), or None outside the contract."""
    best, index = -1, None
    for i, prefixes in enumerate(stack):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, index = len(prefix), i
    return index


@functools.lru_cache(maxsize=None)  # called on every Python call of the traced run: resolve each file once
def module_of(filename: str) -> str | None:
    path = Path(filename).resolve()
    try:
        relative = path.relative_to(ROOT)
    except ValueError:
        return None
    if relative.parts[0] not in ("harness", "strategies", "analysis") or path.suffix != ".py":
        return None
    parts = list(relative.with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def config_types() -> tuple[type, ...]:
    """The run config's types: RunConfig, its sections, and the components' own configs cut from it."""
    from harness.data.config import DataConfig
    from harness.models.drafter_config import DrafterConfig
    from harness.train import config
    from harness.train.feature_cache import FeaturesConfig
    from harness.train.loop.build import RankConfig
    from harness.train.loop.epoch_data import EpochDataConfig
    from harness.train.loop.trainer import LoopConfig
    from harness.train.rank_models import ModelsConfig, TargetSpec

    sections = [config.RunConfig, DataConfig, DrafterConfig, config.TargetConfig, config.DrafterSchema,
                TargetSpec, ModelsConfig, FeaturesConfig, EpochDataConfig, LoopConfig, RankConfig]
    sections += [value for value in vars(config).values()
                 if isinstance(value, type) and dataclasses.is_dataclass(value) and value.__module__ == config.__name__]
    return tuple(sections)


def is_config(value: object, types: tuple[type, ...]) -> bool:
    if isinstance(value, types):
        return True
    from omegaconf import DictConfig

    # the Hydra config, the resolved dict (never `in` on anything else: it would drain an iterator)
    return isinstance(value, (dict, DictConfig)) and all(key in value for key in ("trainer", "strategy", "data"))


@contextlib.contextmanager
def logging_restored():
    """Hydra's in-process run configures logging (a file handler on the run's ``train.log``, levels); put the
    loggers back as they were, so that nothing logs into the walk's deleted run directory afterwards."""
    loggers = [logging.getLogger(), *(logger for logger in logging.Logger.manager.loggerDict.values()
                                      if isinstance(logger, logging.Logger))]
    saved = {logger: (list(logger.handlers), logger.level, logger.propagate, logger.disabled) for logger in loggers}
    try:
        yield
    finally:
        for logger, (handlers, level, propagate, disabled) in saved.items():
            for handler in [h for h in logger.handlers if h not in handlers]:
                handler.close()
            logger.handlers[:] = handlers  # Hydra's dictConfig also took the earlier ones off
            logger.setLevel(level)
            logger.propagate, logger.disabled = propagate, disabled


def traced_walk(overrides: list[str]) -> tuple[list[str], dict[tuple[str, str], None]]:
    """The project modules handed the config, in the order of their first visit, and every step (caller module,
    called module) of the walk, as ``batchlab-train`` runs."""
    import harness.cli.train as entry

    types = config_types()
    seen: dict[str, None] = {}
    steps: dict[tuple[str, str], None] = {}

    def profile(frame, event, arg):  # noqa: ARG001
        if event != "call":
            return
        code = frame.f_code
        module = module_of(code.co_filename)
        if module is None:
            return
        count = code.co_argcount + code.co_kwonlyargcount
        if not any(is_config(frame.f_locals.get(name), types) for name in code.co_varnames[:count]):
            return
        seen.setdefault(module, None)
        caller = frame.f_back
        while caller is not None and module_of(caller.f_code.co_filename) is None:
            caller = caller.f_back
        if caller is not None and module_of(caller.f_code.co_filename) != module:
            steps.setdefault((module_of(caller.f_code.co_filename), module), None)

    with tempfile.TemporaryDirectory() as run_dir, logging_restored():
        argv = sys.argv
        sys.argv = ["batchlab-train", *overrides, f"hydra.run.dir={run_dir}"]
        sys.setprofile(profile)
        try:
            entry.main()
        except SystemExit as exit_:
            if exit_.code not in (0, None):
                raise
        finally:
            sys.setprofile(None)
            sys.argv = argv
    return list(seen), steps


def path_of(module: str) -> str:
    path = module.replace(".", "/") + ".py"
    return path if (ROOT / path).exists() else module.replace(".", "/") + "/__init__.py"


def walk_table(modules: list[str], steps: dict[tuple[str, str], None]) -> tuple[list[str], list[str]]:
    """Markdown lines of the walk (order of first visit, file, layer, the climbs into it) and the climbs."""
    stack = layers()
    climbs = [f"`{path_of(caller)}` ({layer_of(caller, stack)}) → `{path_of(called)}` ({layer_of(called, stack)})"
              for caller, called in steps
              if None not in (layer_of(caller, stack), layer_of(called, stack))
              and layer_of(called, stack) < layer_of(caller, stack)]
    lines = ["| # | file | layer | reached from |", "|---|---|---|---|"]
    for number, module in enumerate(modules, 1):
        layer = layer_of(module, stack)
        callers = sorted({f"`{path_of(a)}`" for a, b in steps if b == module})
        lines.append(f"| {number} | `{path_of(module)}` | {'-' if layer is None else layer} | {', '.join(callers)} |")
    return lines, climbs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help="write the result into benchmarks/RESULTS.md")
    parser.add_argument("overrides", nargs="*", default=OVERRIDES, help="batchlab-train overrides (default: %(default)s)")
    args = parser.parse_args()
    modules, steps = traced_walk(args.overrides)
    lines, climbs = walk_table(modules, steps)
    headline = f"{len(modules)} files, {len(climbs)} climb(s) back up the layering"
    lines += ["", "Climbs (caller (layer) → called (layer)): " + ("; ".join(climbs) if climbs else "none")]
    print("\n".join(lines))
    print(headline)
    if args.write:
        section = [TITLE, "",
                   f"Command: `python benchmarks/config_walk.py --write` (traced: `batchlab-train "
                   f"{' '.join(args.overrides)}`)  ",
                   f"Machine: {cpu_model()}, Python {platform.python_version()}; {datetime.date.today()}  ",
                   "Layers: `pyproject.toml`'s import-linter contract, top (0, the entry points) down. A climb is a "
                   "file handing the config to a file on a higher layer than its own.", "",
                   f"**{headline}.**", "", *lines]
        write_section("\n".join(section) + "\n", TITLE)


if __name__ == "__main__":
    main()
