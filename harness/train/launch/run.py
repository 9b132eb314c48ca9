"""Start a run: check its directory, build the data cache once, start the ranks, train.

:func:`run` is what ``batchlab-train`` calls with the resolved config; :func:`run_rank` is the
function every rank executes (the job itself on one rank, or each process torch elastic starts).
A run directory belongs to one run once it has a checkpoint or a complete summary: rerunning a complete
run there is a no-op (so a rerun sweep resumes where it stopped), and a directory that holds such a run
with other settings is refused; a run that failed before its first checkpoint claims nothing (the same
command, corrected, runs in its place).

A rank that fails (an exception, a signal, out of memory) ends the job: torch elastic's agent stops the
other ranks and raises ``ChildFailedError``; :func:`run` turns it into :class:`RankFailed`, which names the
first failed rank, how it failed, and the stage and step its status file (:mod:`harness.train.status`)
last recorded.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from harness.data.samples import load_samples
from harness.train.config import moved_into_place, run_config_from_dict
from harness.train.distributed import (
    Collectives,
    Interrupted,
    RankEnv,
    destroy_process_group,
    external_launch_env,
    init_process_group,
    launch,
)
from harness.train.launch.compose import epoch_data_config, features_config, rank_config, target_spec
from harness.train.launch.inputs import (check_shipped_data_target, preparing, with_bundled_target,
                                         with_regenerated_completions)
from harness.train.launch.run_log import RUN_LOG, copied_to
from harness.train.loop.epoch_data import select_rows
from harness.train.loop.metrics import write_json_atomic
from harness.train.placement.registry import place, placement_kind
from harness.train.rank_hook import rank_hook
from harness.train.rank_models import EMBEDDED_TARGET, pretrained_target_path
from harness.train.status import STATUS_DIR, describe, read_statuses


class RunDirectoryInUse(ValueError):
    """The run directory holds a run with other settings."""


class BadInput(ValueError):
    """A setting or the data is wrong: found before any rank starts, nothing written to the run directory."""


class RankFailed(RuntimeError):
    """A rank of the job failed (an exception, a signal, out of memory) and the job was stopped."""

    def __init__(self, message: str, rank: int, exitcode: int, stage: str | None, step: int | None) -> None:
        super().__init__(message)
        self.rank, self.exitcode, self.stage, self.step = rank, exitcode, stage, step


#: a failing rank waits this long before it closes its process group and exits, so that torch elastic's
#: agent (polling every 0.5 s) sees it fail first, not a peer whose collective failed because of it
FAILURE_GRACE_S = 2.0


#: settings that change how a run executes or reports, never what it computes: they may differ on resume
RUNTIME_KEYS = ("trainer.progress", "loader.", "trainer.resume",
                "trainer.collective_timeout_s", "trainer.threads_per_rank", "logger.", "topology.peer_timeout_s",
                # test-only settings an older run's config.json may hold (now the tests' rank hook's)
                "trainer.record_consumed", "topology.drafter_delay_s")
#: settings that lay the same samples out on other ranks / micro-steps: they may differ on resume (elastic
#: resume; the checkpoint's plan fingerprint decides, and the rest of its epoch is re-planned)
LAYOUT_KEYS = ("trainer.nproc", "trainer.grad_accum")


def config_differences(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """``key: old -> new`` for every setting (dotted key) of the old run that differs, runtime settings aside."""
    def flat(values: dict[str, Any], prefix: str = "") -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in values.items():
            if isinstance(value, dict):
                out.update(flat(value, f"{prefix}{key}."))
            else:
                out[f"{prefix}{key}"] = value
        return out

    before, after = flat(moved_into_place(old)), flat(moved_into_place(new))  # an older run's names, moved
    # a key the old run's config does not have is a setting added to batchlab since (its default is the
    # behaviour the old run had): not a difference
    keys = sorted(k for k in before if not k.startswith(RUNTIME_KEYS) and k not in LAYOUT_KEYS)
    return [f"{k}: {before.get(k)!r} -> {after.get(k)!r}" for k in keys if before.get(k) != after.get(k)]


def with_target_tokenizer(config: Any, config_dict: dict[str, Any]) -> dict[str, Any]:
    """The data is tokenized with the target's own tokenizer (and conversations with its chat template) by default:
    with ``data.tokenizer`` unset and ``target.pretrained`` a checkpoint that holds a tokenizer (a directory with
    tokenizer files, or a GGUF file), the config names it; any other config as it is."""
    from harness.data.hf_tokenizer import checkpoint_tokenizer

    pretrained = None if config.target.pretrained == EMBEDDED_TARGET else config.target.pretrained
    tokenizer = None if config.data.tokenizer is not None else checkpoint_tokenizer(pretrained)
    if tokenizer is None:
        return config_dict
    return {**config_dict, "data": {**config_dict["data"], "tokenizer": tokenizer}}


def with_tokenizer_vocabulary(config: Any, config_dict: dict[str, Any]) -> dict[str, Any]:
    """A random-weight target takes the vocabulary of the data's tokenizer (``data.tokenizer``): ``data.vocab_size``
    and the ``target.vocab_size`` that follows it are raised to the tokenizer's size when below it (a larger value
    given, e.g. a padded vocabulary, is kept); any other config as it is."""
    tokenizer_dir = config_dict["data"].get("tokenizer")
    if tokenizer_dir is None or config.target.pretrained is not None:
        return config_dict
    from harness.data.hf_tokenizer import load_hf_tokenizer

    size = len(load_hf_tokenizer(tokenizer_dir))
    configured = int(config_dict["data"]["vocab_size"])
    if size <= configured:
        return config_dict
    target = dict(config_dict["target"])
    if target.get("vocab_size") in (None, configured):  # the target follows data.vocab_size (conf/train.yaml)
        target["vocab_size"] = size
    return {**config_dict, "data": {**config_dict["data"], "vocab_size": size}, "target": target}


def run_rank(config_dict: dict[str, Any], run_dir: str) -> dict[str, Any]:
    """One rank of a run (the function torch elastic starts, or the job itself on one rank); what it prints
    is also appended to the run's log."""
    with copied_to(Path(run_dir) / RUN_LOG):
        return _run_rank(config_dict, run_dir)


def _run_rank(config_dict: dict[str, Any], run_dir: str) -> dict[str, Any]:
    env = external_launch_env() or RankEnv()
    with rank_hook(env.rank, run_dir):  # the tests' seam (unset: nothing)
        return _run_hooked_rank(config_dict, run_dir, env)


def _run_hooked_rank(config_dict: dict[str, Any], run_dir: str, env: RankEnv) -> dict[str, Any]:
    started = time.time()
    config = run_config_from_dict(config_dict)
    init_process_group(env, config.trainer.device, config.trainer.collective_timeout_s)
    trainer = worker = None
    try:
        placement = place(config.topology, env)
        if placement.trains:
            from harness.train.loop.build import build_trainer

            trainer = build_trainer(rank_config(config), run_dir, placement, config_dict)
            summary = trainer.train()
        else:  # e.g. a target rank of topology=disaggregated
            worker = placement_kind(placement.kind).worker(rank_config(config), placement, run_dir)
            summary = worker.run()
        if summary["status"] == "complete":
            # every rank leaves together: a rank that closes its gloo connections while a peer still reads its
            # last collective from them can abort that peer (SIGABRT in a C++ thread, which no Python catches)
            Collectives(env).barrier()
    except BaseException as error:
        if trainer is not None:
            trainer.abort()
        stopping = (trainer is not None and trainer.signal_received) or (worker is not None and worker.signalled)
        _rank_failed(error, env, run_dir, started, stopping=stopping)
        raise
    finally:
        destroy_process_group()
    if summary["status"] == "interrupted" and "TORCHELASTIC_RUN_ID" in os.environ:
        # Stopped by a signal: everything is written (checkpoint fsynced, sinks closed). torch elastic's
        # worker wrapper would now wait for an agent that is shutting down (30 s, then SIGKILL); leave now.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(130)
    return summary


def _feature_cache(config: Any, samples: Any, rows: Any) -> str:
    """Build (or find) the run's cached target features (:mod:`harness.train.feature_cache`); where they are."""
    import torch

    from harness.train.feature_cache import ensure_feature_cache
    from harness.train.rank_models import build_target, precision_dtype

    device = torch.device("cuda" if config.trainer.device == "cuda" else "cpu")
    features = features_config(config)

    def make_target() -> Any:
        return build_target(features.target, config.drafter_config, precision_dtype(features.precision), device)

    entry, meta, built = ensure_feature_cache(features, samples, rows, make_target, progress=config.trainer.progress)
    return f"{meta['rows']:,} rows, {meta['tokens']:,} tokens, {'built' if built else 'from the cache'}: {entry}"


def _rank_failed(error: BaseException, env: RankEnv, run_dir: str, started: float, stopping: bool) -> None:
    """A rank's exception: note its stage and step on it and keep its traceback; on one of several ranks,
    report it to the launcher and leave (never returns). ``stopping``: the rank was already told to stop,
    so the launcher has seen another rank fail first."""
    if isinstance(error, (KeyboardInterrupt, SystemExit)):
        return
    failed_at = time.time()
    statuses = read_statuses(run_dir, since=started)
    status = statuses.get(env.rank)
    error.add_note(f"batchlab: rank {env.rank} failed {describe(status)}")
    path = Path(run_dir) / STATUS_DIR / f"rank{env.rank}.traceback"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(traceback.format_exception(error)))
    with (Path(run_dir) / RUN_LOG).open("a") as log:  # the run's log holds every rank's traceback
        log.write(f"[rank {env.rank}] " + "".join(traceback.format_exception(error)))
    headline = _headline(f"{type(error).__name__}: {error}")
    write_json_atomic(path.with_suffix(".error.json"), {"error": headline, "time": failed_at, "status": status})
    if not env.distributed:
        return  # one process: Python's own error path (the caller re-raises)
    if "TORCHELASTIC_ERROR_FILE" in os.environ:  # what torch elastic's agent reports as this rank's failure
        from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

        ErrorHandler().record_exception(error)
    # without an agent (srun, submitit) each rank's own output is the report: name a peer that failed first
    earlier = [] if "TORCHELASTIC_RUN_ID" in os.environ else _earlier_failures(run_dir, env.rank, started, failed_at)
    print(f"[rank {env.rank}] {headline} ({describe(status)}; traceback in {path})"
          + "".join(f"; before it, rank {r} failed {describe(e['status'])}: {e['error']}" for r, e in earlier),
          file=sys.stderr, flush=True)
    if "TORCHELASTIC_RUN_ID" in os.environ and not stopping:
        # The peers are blocked in a collective with this rank and fail once it exits. Wait first (a SIGTERM
        # from the agent stopping this rank ends the wait), so that the agent sees this rank, the cause, fail
        # first, not a peer that lost it.
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        time.sleep(FAILURE_GRACE_S)
    # Leave now: an orderly shutdown with a lost peer can block for good (destroying an NCCL communicator,
    # joining DataLoader workers that ignore SIGTERM while the traceback keeps their loader alive).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)


def _headline(message: str) -> str:
    """The first line of an error message (gloo's carry the C++ frames after it)."""
    lines = str(message).strip().splitlines()
    return lines[0] if lines else ""


def _earlier_failures(run_dir: str | Path, rank: int, started: float, before: float) -> list[tuple[int, dict]]:
    """(rank, error record) of the other ranks of this run that failed before ``before``, first first."""
    found = []
    for path in (Path(run_dir) / STATUS_DIR).glob("rank*.error.json"):
        try:
            record = json.loads(path.read_text())
            other = int(path.name[len("rank"):-len(".error.json")])
        except (OSError, ValueError):
            continue
        if other != rank and started <= record["time"] <= before:
            found.append((other, record))
    return sorted(found, key=lambda item: item[1]["time"])


def rank_failed_error(failed: Any, run_dir: str | Path, since: float | None = None,
                      collective_timeout_s: int | None = None) -> RankFailed:
    """:class:`RankFailed` from torch elastic's ``ChildFailedError``: the first failed rank, how it failed
    (signal, exit code, exception), the stage and step of its status file, where the other ranks were."""
    rank, failure = failed.get_first_failure()
    statuses = read_statuses(run_dir, since=since)
    status = statuses.get(rank)
    if failure.exitcode < 0:
        name = failure.signal_name()
        how = f"was killed by signal {-failure.exitcode} ({name})"
        if name == "SIGKILL":
            how += (" (sent from outside the job, often by the kernel's out-of-memory killer: check `dmesg` or the "
                    "job's memory limit; lower trainer.max_tokens or loader.num_workers)")
    else:
        message = failure.message
        if isinstance(message, dict):
            message = message.get("message", "")
        message = _headline(message)
        how = f"exited with code {failure.exitcode}"
        if message and not str(message).startswith("To enable traceback"):
            how += f": {message}"
        if "OutOfMemoryError" in str(message):
            how += (" (out of memory: lower trainer.max_tokens, the micro-batch budget, and raise trainer.grad_accum "
                    "to keep the global batch)")
        elif collective_timeout_s is not None and "timed out" in str(message).lower():
            how += (f" (a collective waited trainer.collective_timeout_s={collective_timeout_s} s for a rank that "
                    "stopped answering: see where the other ranks were)")
        traceback_file = Path(run_dir) / STATUS_DIR / f"rank{rank}.traceback"
        if traceback_file.exists() and (since is None or traceback_file.stat().st_mtime >= since):
            how += f" (traceback: {traceback_file})"  # this run's, not an earlier failure's
    others = "; ".join(f"rank {r} {describe(s)}" for r, s in sorted(statuses.items()) if r != rank)
    from harness.train.loop.checkpoint import latest_checkpoint

    checkpoint = latest_checkpoint(Path(run_dir))
    resume = (f"the last checkpoint is {checkpoint}; run the same command with hydra.run.dir={run_dir} to resume "
              "from it" if checkpoint is not None else "no checkpoint had been written yet")
    message = (f"rank {rank} failed {describe(status)}: it {how}. The other ranks were stopped"
               f"{f' ({others})' if others else ''}; {resume}")
    return RankFailed(message, rank, failure.exitcode, status and status["stage"], status and status["step"])


def complete_summary(run_dir: Path) -> dict[str, Any] | None:
    """The summary of the complete run ``run_dir`` holds, or None."""
    done = run_dir / "summary.json"
    summary = json.loads(done.read_text()) if done.exists() else None
    return summary if summary is not None and summary.get("status") == "complete" else None


def claimed(run_dir: Path) -> bool:
    """Whether ``run_dir`` holds a run worth keeping: a checkpoint to resume from, or a complete summary. A run
    that failed before its first checkpoint (a typo in ``data.source``, an empty file) claims nothing."""
    from harness.train.loop.checkpoint import latest_checkpoint

    return latest_checkpoint(run_dir) is not None or complete_summary(run_dir) is not None


def claim_run_dir(config_dict: dict[str, Any], run_dir: Path, resume: bool = True, announce: bool = True) -> None:
    """Refuse ``run_dir`` (:class:`RunDirectoryInUse`, before anything is written) when it holds a claimed run
    (:func:`claimed`) with other settings; a run that never got that far is replaced, and said so (``announce``)."""
    previous = run_dir / "config.json"
    if not (previous.exists() and resume):
        return
    differences = config_differences(json.loads(previous.read_text()), config_dict)
    if not differences:
        return
    if claimed(run_dir):
        raise RunDirectoryInUse(
            f"{run_dir} holds a run with other settings ({'; '.join(differences)}); resuming it would mix "
            "two runs. Choose another hydra.run.dir, or set trainer.resume=false to start over in it"
        )
    if announce:
        print(f"batchlab-train: {run_dir} held a run that stopped before its first checkpoint "
              f"({'; '.join(differences)}); this run takes its place", flush=True)


def prepared_config(config_dict: dict[str, Any]) -> dict[str, Any]:
    """The config checked (every group, the placement's name, a checkpoint's architecture) and completed (the target
    checkpoint's tokenizer for conversations, the vocabulary of the data's tokenizer); builds nothing. Idempotent;
    bad input raises :class:`BadInput`."""
    try:
        check_shipped_data_target(config_dict)  # the target as configured (bundled, not its directory)
        config_dict = with_bundled_target(config_dict)
        config = run_config_from_dict(config_dict)  # fail here, before any process starts
        placement_kind(config.topology.name)  # a registered placement
        if config.trainer.target_features == "cached" and config.topology.name != "colocated":
            raise ValueError(f"trainer.target_features=cached reads the target's features from a cache on the ranks "
                             f"that train; topology={config.topology.name} runs the target on ranks of its own: "
                             "use topology=colocated, or trainer.target_features=online")
        if config.target.pretrained not in (None, EMBEDDED_TARGET):
            from harness.models.causal_lm_target import check_target_checkpoint

            check_target_checkpoint(config.target.pretrained)  # its config only: a checkpoint the target can be
        return with_tokenizer_vocabulary(config, with_target_tokenizer(config, config_dict))
    except (ValueError, FileNotFoundError) as error:
        raise BadInput(str(error)) from error


def recorded_config(config_dict: dict[str, Any]) -> dict[str, Any]:
    """The config a run records and trains with: :func:`prepared_config`, then what its ranks read built (the
    pretrained target and its regenerated completions, once, cached: :mod:`harness.train.launch.inputs`) and
    named. Idempotent; bad input raises :class:`BadInput`."""
    config_dict = prepared_config(config_dict)
    try:
        return with_regenerated_completions(config_dict)
    except (ValueError, FileNotFoundError) as error:
        raise BadInput(str(error)) from error


def run(config_dict: dict[str, Any], run_dir: str | Path) -> dict[str, Any]:
    """A whole run from a resolved config: validate, build the data cache once, start the ranks, train.

    Bad input found before the ranks start (a setting, the data source) raises :class:`BadInput` and writes
    no ``config.json``; a directory holding another run raises :class:`RunDirectoryInUse` and is left as it
    was. Once the directory is the run's, what the run prints is also appended to its ``train.log``."""
    run_dir = Path(run_dir)
    config_dict = recorded_config(config_dict)
    config = run_config_from_dict(config_dict)
    claim_run_dir(config_dict, run_dir, config.trainer.resume)
    with copied_to(run_dir / RUN_LOG):
        return _run_claimed(config_dict, config, run_dir)


def _run_claimed(config_dict: dict[str, Any], config: Any, run_dir: Path) -> dict[str, Any]:
    try:
        complete = complete_summary(run_dir) if config.trainer.resume else None
        if complete is not None:
            print(f"batchlab-train: {run_dir} already holds this run, complete; skipped", flush=True)
            return complete
        with preparing("data") as done:
            samples = load_samples(config.data, progress=config.trainer.progress)  # the ranks find the caches built
            done(f"{len(samples):,} samples: {samples.source}")
        if samples.tokenizer_path:
            print(f"batchlab-train: tokenizer ✓ {samples.tokenizer_path}", flush=True)
        # bad data (oversize=error, nothing left) is bad input, found here
        selection = select_rows(epoch_data_config(config), samples)
    except (ValueError, FileNotFoundError) as error:
        raise BadInput(str(error)) from error
    run_dir.mkdir(parents=True, exist_ok=True)
    write_json_atomic(run_dir / "config.json", config_dict)
    if config.target.pretrained == EMBEDDED_TARGET:
        with preparing("target") as done:
            done(pretrained_target_path(target_spec(config), progress=config.trainer.progress))
    if config.trainer.target_features == "cached":  # once, before the ranks: they read it
        with preparing("target features") as done:
            done(_feature_cache(config, samples, selection.train_rows))
    if config.eval.target_features == "cached":
        with preparing(f"target features of the evaluated ({config.eval.split}) rows") as done:
            done(_feature_cache(config, samples, selection.eval_rows(config.eval.split)))
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    started = time.time()
    try:
        return launch(run_rank, (config_dict, str(run_dir)), config.trainer.nproc,
                      run_id=f"batchlab-{os.getpid()}-{time.time_ns()}")
    except ChildFailedError as failed:
        raise rank_failed_error(failed, run_dir, since=started,
                                collective_timeout_s=config.trainer.collective_timeout_s) from None
    except Interrupted:
        summary_path = run_dir / "summary.json"
        if summary_path.exists():
            return json.loads(summary_path.read_text())
        raise
