"""``batchlab-train``: the Hydra entry point of a training run (one job = one run).

    batchlab-train strategy=packed
    batchlab-train -m strategy=sorted,shuffle,bucketed,packed seed=0,1,2
    batchlab-train experiment=smoke strategy=bucketed trainer.nproc=2

The config is composed from ``conf/`` (typed by :mod:`harness.train.config`), resolved once, and
handed to :func:`harness.train.launch.run.run`, which starts the job's ranks itself. Each run writes into
Hydra's run directory (``hydra.run.dir``): ``config.json``, ``metrics.jsonl``, ``summary.json``,
``checkpoints/`` and the offline W&B run under ``wandb/``.
"""

from __future__ import annotations

import os
import shutil
import sys
import traceback
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from harness.cli.process_exit import exits_fast
from harness.train.config import CONF_DIR, register_schemas, resolved_dict

register_schemas()


#: where the Hydra files of the run a directory holds are kept, inside Hydra's output subdir: Hydra rewrites
#: ``.hydra/*.yaml`` before the job starts, so a refused rerun puts these back
ACCEPTED_HYDRA_DIR = "accepted"


def _copy_yaml(source: Path, destination: Path) -> bool:
    """Copy ``source/*.yaml`` into ``destination`` (made if needed); False when ``source`` does not exist."""
    if not source.is_dir():
        return False
    destination.mkdir(exist_ok=True)
    for path in source.glob("*.yaml"):
        shutil.copy2(path, destination / path.name)
    return True


def _keep_hydra_files(hydra_dir: Path) -> None:
    """Copy this run's ``.hydra/*.yaml`` aside: the files of the run the directory holds."""
    _copy_yaml(hydra_dir, hydra_dir / ACCEPTED_HYDRA_DIR)


def _restore_hydra_files(hydra_dir: Path) -> bool:
    """Put back the ``.hydra/*.yaml`` of the run the directory holds (False when none were kept)."""
    return _copy_yaml(hydra_dir / ACCEPTED_HYDRA_DIR, hydra_dir)


def _refusal_log() -> Path:
    """A new file for the traceback of a run refused before it could claim a directory that holds another run."""
    import tempfile

    handle, name = tempfile.mkstemp(prefix="batchlab-train-refused-", suffix=".log")
    os.close(handle)
    return Path(name)


def remove_unclaimed(run_dir: Path, hydra_dir: Path, log: Path) -> None:
    """Remove the directory of a run refused before it claimed it when it holds only what Hydra wrote for this job
    (its ``.hydra`` files and job log), and the folders above it left empty (``outputs/train/DATE``), up to the
    working directory: bad input leaves nothing behind. A directory holding anything else stays as it is."""
    here, run_dir = Path.cwd().resolve(), run_dir.resolve()
    if run_dir == here or run_dir in here.parents:  # never the working directory or a folder above it
        return
    if not run_dir.is_dir() or any(path.name not in (hydra_dir.name, log.name) for path in run_dir.iterdir()):
        return
    shutil.rmtree(run_dir, ignore_errors=True)
    folder = run_dir.parent
    try:
        while here in folder.parents and not any(folder.iterdir()):
            folder.rmdir()
            folder = folder.parent
    except OSError:  # another run wrote into it meanwhile: it stays
        pass


def _launcher_rank() -> int:
    """This process's rank under an external launcher (torchrun's RANK, SLURM's SLURM_PROCID); 0 otherwise."""
    return int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="train")
def main(cfg: DictConfig) -> float | None:
    from harness.command_errors import full_errors
    from harness.train.distributed import prepare_ranks
    from harness.train.launch.run import (
        BadInput,
        RankFailed,
        RunDirectoryInUse,
        claim_run_dir,
        recorded_config,
        run,
    )
    from harness.train.launch.run_log import RUN_LOG, copied_to

    hydra_config = HydraConfig.get()
    run_dir = hydra_config.runtime.output_dir
    hydra_dir = Path(run_dir) / (hydra_config.output_subdir or ".hydra")
    config_dict = resolved_dict(cfg)
    prepare_ranks(config_dict["trainer"]["nproc"], config_dict["trainer"]["device"])  # before any work
    log = Path(run_dir) / RUN_LOG
    claimed = False  # the directory is this run's (new, or this run's to resume or to take over)
    try:
        config_dict = recorded_config(config_dict)  # what the run records (e.g. its regenerated data): compared
        claim_run_dir(config_dict, Path(run_dir), bool(config_dict["trainer"]["resume"]), announce=False)
        claimed = True
        if _launcher_rank() == 0:  # under an external torchrun / srun every rank runs this: one writes
            _keep_hydra_files(hydra_dir)
        with copied_to(log):  # the directory is this run's: its log holds what it prints from here on
            summary = run(config_dict, run_dir)
            _print_report_command(hydra_config, run_dir, summary)
    except RunDirectoryInUse as refused:  # bad input: one message, the directory as it was
        restored = _launcher_rank() != 0 or _restore_hydra_files(hydra_dir)
        print(f"batchlab-train: {refused}" + ("" if restored else f" ({hydra_dir} now shows the refused settings; "
              "config.json holds the run's)"), file=sys.stderr, flush=True)
        sys.exit(2)
    except BadInput as bad:  # one line; the traceback to the run's log (and the terminal with HYDRA_FULL_ERROR=1)
        if not claimed:
            # found before the directory was claimed: a directory holding another run keeps that run's log and Hydra
            # files, one Hydra made for this run is removed (nothing written), and the traceback goes to a file of
            # its own
            if _launcher_rank() == 0 and not _restore_hydra_files(hydra_dir):
                remove_unclaimed(Path(run_dir), hydra_dir, log)
            log = _refusal_log()
        with log.open("a") as file:
            traceback.print_exception(bad, file=file)
        if full_errors():
            traceback.print_exception(bad)
        print(f"batchlab-train: {bad} (traceback in {log})", file=sys.stderr, flush=True)
        sys.exit(2)
    except RankFailed as failed:  # the message says it all (rank, stage, step, the checkpoint); no traceback
        print(f"batchlab-train: {failed}", file=sys.stderr, flush=True)
        sys.exit(1)
    if summary and summary.get("status") == "interrupted":
        print(f"batchlab-train: interrupted after {summary['tokens_seen']} tokens; the checkpoint is in "
              f"{run_dir}/checkpoints; run the same command with hydra.run.dir={run_dir} to resume", file=sys.stderr)
        sys.exit(130)
    return summary.get("eval_loss") if summary else None


def _print_report_command(hydra_config: Any, run_dir: str, summary: dict[str, Any] | None) -> None:
    """The closing block's last line: the report over this run's sweep (a multirun) or over the run alone."""
    if not summary or _launcher_rank() != 0:
        return
    reported = hydra_config.sweep.dir if hydra_config.mode == RunMode.MULTIRUN else run_dir
    print(f"  report: batchlab-report {reported}", flush=True)


@exits_fast
def cli() -> None:
    """``batchlab-train``: a misspelt override fails here in one line (exit status 2), before Hydra starts."""
    from harness.cli.overrides import check_overrides

    # datasets' own bars ("Saving the dataset") are not the run's progress; the ranks inherit the setting
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    problem = check_overrides(sys.argv[1:])
    if problem:
        print(f"batchlab-train: {problem}", file=sys.stderr, flush=True)
        sys.exit(2)
    main()


if __name__ == "__main__":
    cli()
