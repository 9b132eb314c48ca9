"""Ranks: start them, know which one this is, and the collectives the package uses (:class:`Collectives`).

Three ways a run gets its ranks (torchrun around a Hydra app races on the output directory, and
``torchrun ... -m`` sweeps hang at their second job, so Hydra stays outside the ranks):

* ``trainer.nproc == 1`` and no launcher: the Hydra job trains in its own process (no process group).
* ``trainer.nproc > 1``: the Hydra job starts the ranks itself with torch elastic's ``elastic_launch``
  (c10d rendezvous on ``localhost:0``, so two jobs never fight over a port); the resolved config
  travels as a plain dict. The ranks fork from a ``forkserver`` that imported torch and the rank's code
  once (:data:`RANK_PRELOAD`): ``spawn`` imports them afresh in every rank, seconds of CPU each, which a
  small machine pays again at every job of a sweep. Each rank then takes the launcher's environment as
  it is at this launch (:func:`in_launch_environment`), not the one the server started in.
* An external ``torchrun`` or SLURM launch (``WORLD_SIZE`` / ``SLURM_NTASKS`` in the environment): the
  process is already one rank; read the environment and join. A task of a submitit job
  (``hydra/launcher=slurm`` or ``submitit_local``) is one rank: submitit's own
  ``TorchDistributedEnvironment`` gives its rank, world and rendezvous address (the job's first host,
  a port drawn from the job id).

Collectives are no-ops on one rank, so the trainer has no ``if world_size > 1`` of its own. A rank
that dies ends the job: elastic's agent (polling every 0.1 s) stops the others (SIGTERM, SIGKILL 30 s
later) and raises ``ChildFailedError`` naming it, which :func:`harness.train.launch.run.run` turns into
``RankFailed`` with the stage and step from the rank's status file; collectives carry a timeout
(``trainer.collective_timeout_s``, gloo's and NCCL's, with NCCL's async error handling on) so that a
rank that hangs alive never hangs the others. Under an external ``torchrun`` the agent is torchrun's:
its ``ChildFailedError`` summary ("Root Cause (first observed failure)") names the rank and its exit
code or signal and, from the error file a failing rank writes, its traceback ending in the note
``batchlab: rank R failed in stage S of step N``; for a rank killed by a signal it shows only
``Signal 9 (SIGKILL) received by PID ...``, and ``python -m harness.train.status RUN_DIR`` gives the
stage and step.
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from harness.train.rank_server import SERVER_FLAG, fork_server, restore_signals


@dataclass(frozen=True)
class RankEnv:
    """This process's place in the job."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        """Rank 0: the one that writes files, logs and shows progress."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def external_launch_env() -> RankEnv | None:
    """The rank env set by torchrun / torch elastic (or SLURM's srun), None when not launched."""
    if "WORLD_SIZE" in os.environ and "RANK" in os.environ:
        return RankEnv(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]),
                       int(os.environ.get("LOCAL_RANK", os.environ["RANK"])))
    if os.environ.get("SUBMITIT_EXECUTOR"):
        return _submitit_env()
    if "SLURM_NTASKS" in os.environ and "SLURM_PROCID" in os.environ and int(os.environ["SLURM_NTASKS"]) > 1:
        # srun without torchrun: MASTER_ADDR/PORT must come from the job script (see the README)
        os.environ.setdefault("RANK", os.environ["SLURM_PROCID"])
        os.environ.setdefault("WORLD_SIZE", os.environ["SLURM_NTASKS"])
        os.environ.setdefault("LOCAL_RANK", os.environ.get("SLURM_LOCALID", "0"))
        local_tasks = slurm_tasks_on_this_node()
        if local_tasks is not None:  # the processes sharing this node's cores (modules.cpu_threads_per_rank)
            os.environ.setdefault("LOCAL_WORLD_SIZE", str(local_tasks))
        return RankEnv(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"]))
    return None


def slurm_tasks_on_this_node() -> int | None:
    """How many tasks of this SLURM step run on this node, from SLURM's compact per-node list
    (``SLURM_STEP_TASKS_PER_NODE``, else ``SLURM_TASKS_PER_NODE``: e.g. ``2(x3),1`` is 2, 2, 2, 1) and
    ``SLURM_NODEID``; None when SLURM does not say."""
    counts = os.environ.get("SLURM_STEP_TASKS_PER_NODE") or os.environ.get("SLURM_TASKS_PER_NODE")
    if not counts:
        return None
    per_node: list[int] = []
    try:
        for part in counts.split(","):
            tasks, _, repeat = part.partition("(x")
            per_node += [int(tasks)] * (int(repeat.rstrip(")")) if repeat else 1)
        return per_node[int(os.environ.get("SLURM_NODEID", "0"))]
    except (ValueError, IndexError):  # a format this does not know: the job's world size is the fallback
        return None


def _submitit_env() -> RankEnv | None:
    """This task's rank env in a submitit job of several tasks (None for one task: it starts its own ranks)."""
    from submitit import JobEnvironment
    from submitit.helpers import TorchDistributedEnvironment

    if JobEnvironment().num_tasks <= 1:
        return None
    job = TorchDistributedEnvironment()
    # the rendezvous address may come from the job's setup lines; the rank is submitit's
    os.environ.setdefault("MASTER_ADDR", job.master_addr)
    os.environ.setdefault("MASTER_PORT", str(job.master_port))
    os.environ.update(RANK=str(job.rank), WORLD_SIZE=str(job.world_size), LOCAL_RANK=str(job.local_rank),
                      LOCAL_WORLD_SIZE=str(job.local_world_size))
    return RankEnv(job.rank, job.world_size, job.local_rank)


#: The process group's backend per device type a run's tensors live on (``torch.distributed``'s backend string).
#: On CUDA the group carries two backends, NCCL for what lives on the GPU (DDP's gradient buckets, the split
#: placement's features) and gloo for what lives on the host: the step's loss weight Σw, the consumed-sample
#: counts, the step statistics, the evaluator's sums, the link's counters and every object gather are built from
#: the plan on the host and read there right after. NCCL alone would take none of them (every multi-GPU run
#: stopped at its first step's Σw all-reduce); moving each one to the GPU and back inside Collectives would add two
#: copies and a stream synchronisation to every small collective, and pickle objects through GPU memory. The cost
#: of two backends is a second (TCP) connection between the ranks: on a cluster whose hosts reach each other only
#: over another interface, name it in ``GLOO_SOCKET_IFNAME``.
BACKENDS = {"cpu": "gloo", "cuda": "cpu:gloo,cuda:nccl"}


def process_group_backend(device: str) -> str:
    """The backend string a run on ``device`` (``cpu`` or ``cuda``) gives ``init_process_group`` (:data:`BACKENDS`)."""
    try:
        return BACKENDS[torch.device(device).type]
    except KeyError:
        raise ValueError(f"no process group backend for device {device!r}; devices: {', '.join(BACKENDS)}") from None


def device_backends(backend: str) -> dict[str, str]:
    """Which backend takes a tensor on each device type: ``cpu:gloo,cuda:nccl`` -> ``{cpu: gloo, cuda: nccl}``;
    a single backend takes the devices torch lists for it (``nccl`` -> ``{cuda: nccl}``)."""
    backend = str(backend).lower()
    if ":" in backend:
        return dict(pair.split(":", 1) for pair in backend.split(","))
    return {device: backend for device in dist.Backend.backend_capability.get(backend, ["cpu"])}


def init_process_group(env: RankEnv, device: str, timeout_s: int) -> None:
    """Join the job's process group (:func:`process_group_backend`: gloo on CPU; gloo and NCCL on CUDA); nothing to
    do on one rank."""
    if not env.distributed or dist.is_initialized():
        return
    if device == "cuda":
        # every CUDA call of this rank without an explicit device (NCCL's communicators, torch.empty(device="cuda"),
        # object collectives) lands on its own GPU; threads start on device 0 again (the link's receivers set theirs)
        torch.cuda.set_device(env.local_rank)
        # NCCL's watchdog aborts a collective that outlives the timeout and ends this process (torch elastic's
        # agent sets the same; a plain srun launch does not): a lost peer never leaves a rank spinning on the GPU
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    dist.init_process_group(process_group_backend(device), timeout=datetime.timedelta(seconds=timeout_s))


def destroy_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def prepare_ranks(nproc: int, device: str) -> bool:
    """Before the launcher does any work: the server a CPU job's ranks fork from, forked from this process
    (:func:`harness.train.rank_server.fork_server`); True when it started one. Nothing for one rank, an external
    launch or CUDA (whose ranks fork from a fresh interpreter that never touched the driver). ``device`` is not
    checked here: a bad one is refused later, in one line, with the rest of the config."""
    if nproc <= 1 or device != "cpu" or external_launch_env() is not None:
        return False
    return fork_server(RANK_PRELOAD)


def launch(worker: Callable[..., Any], args: tuple, nproc: int, run_id: str) -> Any:
    """Run ``worker(*args)`` on every rank and return rank 0's result.

    Under an external launcher, or with ``nproc == 1``, this process is the (only) rank here. Otherwise
    ``nproc`` local processes are started with torch elastic; ``worker`` must be a module-level function
    and ``args`` picklable (the spawned ranks import it afresh).
    """
    if external_launch_env() is not None:
        # torchrun's agent reads a failed rank's exception (traceback and notes) from its error file
        from torch.distributed.elastic.multiprocessing.errors import record

        return record(worker)(*args)
    if nproc == 1:
        return worker(*args)
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=run_id,
        rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0, monitor_interval=0.1,
        start_method="forkserver",
    )
    from torch.distributed.elastic.multiprocessing.api import SignalException

    environment = dict(os.environ)  # what every rank runs in (in_launch_environment)
    multiprocessing.set_forkserver_preload(list(RANK_PRELOAD))  # read when the server starts (the first launch)
    os.environ[SERVER_FLAG] = "1"  # a server this launch starts ignores stop signals (harness.train.rank_server)
    try:
        results = elastic_launch(config, in_launch_environment)(environment, worker, *args)
    except SignalException as stopped:  # the ranks finished their step and checkpointed before exiting
        raise Interrupted(stopped.sigval) from None
    finally:
        os.environ.pop(SERVER_FLAG, None)
    return results[0]


#: what the forkserver imports once, before it forks ranks: torch and the code a rank runs, its trainer's builder
#: and ``datasets`` included (imported in every rank instead, they cost each rank of a 2-rank smoke job about 3 s of CPU)
RANK_PRELOAD = ("harness.train.rank_server", "torch", "torch.distributed", "harness.train.launch.run",
                "harness.train.loop.build", "datasets")
#: the variables torch elastic sets for a rank that the launcher may hold too (with another value for the rank)
ELASTIC_RANK_VARIABLES = ("CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS")


def in_launch_environment(environment: dict[str, str], worker: Callable[..., Any], *args: Any) -> Any:
    """``worker(*args)`` in ``environment`` (the launcher's at this launch) plus what torch elastic set for this rank.

    A rank forks from a server that kept the environment it started in, perhaps a sweep's jobs ago; torch elastic
    then sets only the rank's own variables (``RANK``, ``LOCAL_RANK``, ``MASTER_ADDR``, ...). A variable the
    launcher removed since the server started stays (it cannot be told from one of the rank's). The stop signals
    get their default actions back first (the server ignores them: :mod:`harness.train.rank_server`)."""
    restore_signals()
    own = {key: value for key, value in os.environ.items()
           if key not in environment or key in ELASTIC_RANK_VARIABLES}
    os.environ.clear()
    os.environ.update(environment)
    os.environ.update(own)
    return worker(*args)


class Interrupted(RuntimeError):
    """The job was stopped by a signal (SIGTERM/SIGINT) after its ranks checkpointed."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped by signal {int(signum)}")
        self.signum = int(signum)


class Collectives:
    """The only way the package calls a collective (``tests/harness/train/test_collectives.py`` scans for any other): over
    ``group`` (None: the whole job), identity on one rank.

    ``env`` is the rank's place in that group (a disaggregated run's drafter ranks form their own group, see
    :mod:`harness.train.placement.registry`). Each tensor goes to the group's backend for the device it lives on
    (:data:`BACKENDS`); one on a device the group has no backend for is refused before the call, naming the
    collective and the device, and a result keeps its input's dtype and device.
    """

    def __init__(self, env: RankEnv, group: Any = None) -> None:
        self.env = env
        self.group = group
        self._backends: dict[str, str] | None = None  # read from the group at the first collective

    def _check(self, collective: str, tensor: torch.Tensor) -> torch.Tensor:
        if self._backends is None:
            self._backends = device_backends(dist.get_backend_config(self.group))
        if tensor.device.type not in self._backends:
            raise RuntimeError(
                f"{collective} of a {tensor.dtype} tensor on {tensor.device}: this process group's backends "
                f"({', '.join(f'{d}: {b}' for d, b in self._backends.items())}) take no tensor on a "
                f"{tensor.device.type} device; build it on one of those (harness.train.distributed.BACKENDS)")
        return tensor

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.env.distributed:
            dist.all_reduce(self._check("all_reduce_sum", tensor), op=dist.ReduceOp.SUM, group=self.group)
        return tensor

    def all_reduce_sum_future(self, tensor: torch.Tensor) -> torch.futures.Future:
        """An asynchronous in-place SUM whose future holds ``[tensor]`` (a DDP communication hook's all-reduce)."""
        if not self.env.distributed:
            future: torch.futures.Future = torch.futures.Future()
            future.set_result([tensor])
            return future
        return dist.all_reduce(self._check("all_reduce_sum_future", tensor), op=dist.ReduceOp.SUM,
                               group=self.group, async_op=True).get_future()

    def all_reduce_max(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.env.distributed:
            dist.all_reduce(self._check("all_reduce_max", tensor), op=dist.ReduceOp.MAX, group=self.group)
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """``[world_size, *tensor.shape]``: every rank's tensor, in rank order."""
        if not self.env.distributed:
            return tensor[None].clone()
        gathered = [torch.empty_like(tensor) for _ in range(self.env.world_size)]
        dist.all_gather(gathered, self._check("all_gather", tensor), group=self.group)
        return torch.stack(gathered)

    def all_gather_object(self, value: Any) -> list[Any]:
        if not self.env.distributed:
            return [value]
        gathered: list[Any] = [None] * self.env.world_size
        dist.all_gather_object(gathered, value, group=self.group)  # torch picks the group's host backend for objects
        return gathered

    def barrier(self) -> None:
        if self.env.distributed:
            dist.barrier(group=self.group)
