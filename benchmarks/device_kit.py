"""What a lent GPU machine lacks for ``benchmarks/gpu_check.sh``, gathered here into ``.device/`` (git-ignored).

The GPU image has torch, triton, transformers, numpy, pandas, pyarrow, numba and tokenizers, but no network
and none of hydra-core, datasets or flash-linear-attention; building the default run's data there (the
embedded corpus of that machine's own standard library, its tokenizer trained) would spend a short lease's
time on something else than the GPU. So, on this machine:

* ``.device/wheels/``: those packages (and what they need that the image lacks) for the image's Python
  (3.12, x86-64), at the versions installed here (flash-linear-attention at the Makefile's version);
  ``pip download`` for the image's platform, ``pip wheel`` for a package published as a source archive only;
* ``.device/data/``: the default run's samples (the embedded corpus, as ``save_to_disk``; its random-weight
  tiny target needs nothing more).

Then one call of the device tool runs everything, carrying ``.device``:

    python benchmarks/device_kit.py                  # here, once (seconds)
    bash benchmarks/device_run.sh                    # there: carry [".device"], timeout 600 (BUDGET, STEPS)
"""

from __future__ import annotations

import argparse
import importlib.metadata
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

KIT = REPO / ".device"
#: installed here, missing from the GPU image (its package list: the device tool's KINDS.md)
FROM_THIS_VENV = ("hydra-core", "omegaconf", "antlr4-python3-runtime", "datasets", "dill", "multiprocess")
#: the gpu extra (pyproject.toml), at the version `make fla-interpret` checks
FLA = ("flash-linear-attention==0.6.0", "fla-core==0.6.0")
PYTHON_VERSION = "3.12"
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64")
#: what one call of the device tool may carry in all (the working tree included); the kit keeps well under it
LIMIT_MB = 48


def pinned() -> list[str]:
    return [f"{name}=={importlib.metadata.version(name)}" for name in FROM_THIS_VENV] + list(FLA)


def download_wheels(destination: Path) -> list[Path]:
    """One wheel per requirement, for the image's Python; a source-only one is built into a wheel here."""
    destination.mkdir(parents=True, exist_ok=True)
    for requirement in pinned():
        platform = [arg for name in PLATFORMS for arg in ("--platform", name)]
        download = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "--python-version", PYTHON_VERSION, "--implementation", "cp", *platform, "-d", str(destination),
                    requirement]
        if subprocess.run(download, capture_output=True, text=True).returncode == 0:
            continue
        # no wheel published (antlr4-python3-runtime 4.9.3 is a source archive): build one; it must be pure Python
        built = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(destination),
                                requirement], capture_output=True, text=True)
        if built.returncode:
            raise SystemExit(f"device_kit: no wheel of {requirement} for Python {PYTHON_VERSION}:\n{built.stderr[-2000:]}")
    wheels = sorted(destination.glob("*.whl"))
    impure = [w.name for w in wheels if w.name.endswith("-linux_x86_64.whl")]
    if impure:
        raise SystemExit(f"device_kit: {', '.join(impure)} was built for this machine's Python, not the image's")
    return wheels


def default_data(destination: Path) -> Path:
    """The default run's samples, saved into ``destination/data``."""
    from harness.data.samples import load_samples
    from harness.train.config import compose_run_config, run_config_from_dict

    config = run_config_from_dict(compose_run_config(["logger=none"]))
    samples = load_samples(config.data, progress=True)
    data = destination / "data"
    shutil.rmtree(data, ignore_errors=True)
    samples.dataset.select_columns(["input_ids", "loss_mask"]).save_to_disk(str(data))
    return data


def size_mb(path: Path) -> float:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--no-data", action="store_true", help="wheels only (the training steps then build the "
                                                                 "data on the GPU machine)")
    args = parser.parse_args()
    wheels_dir = KIT / "wheels"
    shutil.rmtree(wheels_dir, ignore_errors=True)
    wheels = download_wheels(wheels_dir)
    print(f"{len(wheels)} wheels in {wheels_dir} ({size_mb(wheels_dir):.1f} MB): " + ", ".join(w.name for w in wheels))
    if not args.no_data:
        data = default_data(KIT)
        print(f"data: {data} ({size_mb(data):.1f} MB)")
    total = size_mb(KIT)
    if total > LIMIT_MB:
        raise SystemExit(f"device_kit: {KIT} holds {total:.0f} MB, over the {LIMIT_MB} MB the device call can carry")
    print(f"{KIT}: {total:.1f} MB. On the GPU machine: bash benchmarks/device_run.sh (carry .device)")


if __name__ == "__main__":
    main()
