"""``batchlab-train``: the Hydra entry point of a training run (one job = one run).

    batchlab-train strategy=packed
    batchlab-train -m strategy=sorted,shuffle,bucketed,packed seed=0,1,2
    batchlab-train experiment=smoke strategy=bucketed trainer.nproc=2

The config is composed from ``conf/`` (typed by :mod:`harness.train.config`), resolved once, and
handed to :func:`harness.train.run.run`, which starts the job's ranks itself. Each run writes into
Hydra's run directory (``hydra.run.dir``): ``config.json``, ``metrics.jsonl``, ``summary.json``,
``checkpoints/`` and the offline W&B run under ``wandb/``.
"""

from __future__ import annotations

import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from harness.train.config import CONF_DIR, register_schemas, resolved_dict

register_schemas()


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="train")
def main(cfg: DictConfig) -> float | None:
    from harness.train.run import RankFailed, run

    run_dir = HydraConfig.get().runtime.output_dir
    try:
        summary = run(resolved_dict(cfg), run_dir)
    except RankFailed as failed:  # the message says it all (rank, stage, step, the checkpoint); no traceback
        print(f"batchlab-train: {failed}", file=sys.stderr, flush=True)
        sys.exit(1)
    if summary and summary.get("status") == "interrupted":
        print(f"batchlab-train: interrupted after {summary['tokens_seen']} tokens; the checkpoint is in "
              f"{run_dir}/checkpoints; run the same command with hydra.run.dir={run_dir} to resume", file=sys.stderr)
        sys.exit(130)
    return summary.get("eval_loss") if summary else None


if __name__ == "__main__":
    main()
