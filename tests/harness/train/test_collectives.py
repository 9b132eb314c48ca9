"""Every collective on a backend that takes its tensor: the package's only way to one is ``Collectives``.

A CUDA run's process group carries NCCL for the GPU and gloo for the host (``harness.train.distributed.BACKENDS``).
Checked on CPU three ways: a scan of the package for any other call of a ``torch.distributed`` collective; a
recording stand-in for ``torch.distributed`` that plays a CUDA rank's process group (what it is built with, which
device each tensor is on, what comes back); and a real two-rank gloo run whose every collective is recorded and
judged against the backends of a CUDA run.
"""

from __future__ import annotations

import ast
import json
import os
import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from support.process import failure_text
from support.train import train_cli

from harness.train.distributed import (
    BACKENDS,
    Collectives,
    RankEnv,
    device_backends,
    init_process_group,
    process_group_backend,
)

REPO = Path(__file__).resolve().parents[3]
PACKAGE = ("harness", "strategies", "analysis")  # the installed package (pyproject's packages)
#: torch.distributed's collectives (every rank of a group calls them together)
COLLECTIVES = frozenset({
    "all_reduce", "all_reduce_coalesced", "all_gather", "all_gather_into_tensor", "all_gather_coalesced",
    "all_gather_object", "reduce_scatter", "reduce_scatter_tensor", "broadcast", "broadcast_object_list", "reduce",
    "gather", "gather_object", "scatter", "scatter_object_list", "all_to_all", "all_to_all_single", "barrier",
    "monitored_barrier",
})
#: point to point: only the split placement's feature link sends, on the device its backend takes
#: (``feature_link.link_device``: the GPU under NCCL, the host under gloo)
POINT_TO_POINT = frozenset({"send", "recv", "isend", "irecv", "batch_isend_irecv", "send_object_list",
                            "recv_object_list"})
ALLOWED = {"harness/train/distributed.py": COLLECTIVES, "harness/train/placement/link.py": POINT_TO_POINT,
           "harness/train/placement/target_producer.py": POINT_TO_POINT,
           "harness/train/placement/drafter_link.py": POINT_TO_POINT,
           "harness/advise/link.py": POINT_TO_POINT}  # the link's microbenchmark plays its two ends


def raw_calls(source: str) -> list[tuple[int, str]]:
    """``(line, name)`` of every call of a ``torch.distributed`` collective or point-to-point function in
    ``source``, however the module or the function was imported."""
    tree = ast.parse(source)
    modules, functions = {"torch.distributed"}, {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "torch.distributed":
                    modules.add(alias.asname or "torch.distributed")
        elif isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if node.module == "torch" and alias.name == "distributed":
                    modules.add(alias.asname or "distributed")
                elif node.module in ("torch.distributed", "torch.distributed.distributed_c10d"):
                    functions[alias.asname or alias.name] = alias.name
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = None
        if isinstance(node.func, ast.Attribute) and ast.unparse(node.func.value) in modules:
            name = node.func.attr
        elif isinstance(node.func, ast.Name) and node.func.id in functions:
            name = functions[node.func.id]
        if name in COLLECTIVES | POINT_TO_POINT:
            found.append((node.lineno, name))
    return found


def test_the_scan_finds_a_raw_collective_however_it_was_imported():
    source = textwrap.dedent("""
        import torch.distributed as dist
        import torch.distributed
        from torch import distributed as d
        from torch.distributed import all_gather as gather_all, barrier
        dist.all_reduce(x)
        torch.distributed.broadcast(x, 0)
        d.send(x, 1)
        gather_all([], x)
        barrier()
        dist.get_rank()
        comm.all_reduce_sum(x)
    """)
    assert raw_calls(source) == [(6, "all_reduce"), (7, "broadcast"), (8, "send"), (9, "all_gather"), (10, "barrier")]


def test_no_code_of_the_package_calls_a_collective_but_collectives():
    offenders = []
    for package in PACKAGE:
        for path in sorted((REPO / package).rglob("*.py")):
            relative = path.relative_to(REPO).as_posix()
            allowed = ALLOWED.get(relative, frozenset())
            offenders += [f"{relative}:{line}: torch.distributed.{name}"
                          for line, name in raw_calls(path.read_text()) if name not in allowed]
    assert not offenders, ("call these through harness.train.distributed.Collectives (it gives each tensor to the "
                           "backend of its device):\n" + "\n".join(offenders))


# ---------------------------------------------------------------- a recording stand-in for torch.distributed


class RecordingGroup:
    """Plays ``torch.distributed`` for one rank of a two-rank job: records how the group is built and every tensor a
    collective is handed; the other rank contributes the same tensor (a sum doubles it, a gather repeats it)."""

    def __init__(self) -> None:
        self.backend: str | None = None
        self.timeout = None
        self.devices_set: list[int] = []
        self.calls: list[tuple[str, torch.device, torch.dtype]] = []

    def takes(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type in device_backends(self.backend)

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(dist, "is_initialized", lambda: self.backend is not None)
        monkeypatch.setattr(dist, "init_process_group", self.init_process_group)
        monkeypatch.setattr(dist, "get_backend_config", lambda group=None: self.backend)
        monkeypatch.setattr(dist, "all_reduce", self.all_reduce)
        monkeypatch.setattr(dist, "all_gather", self.all_gather)
        monkeypatch.setattr(dist, "all_gather_object", self.all_gather_object)
        monkeypatch.setattr(dist, "barrier", lambda group=None: self.calls.append(("barrier", None, None)))
        monkeypatch.setattr(torch.cuda, "set_device", self.devices_set.append)

    def init_process_group(self, backend, timeout=None, **kwargs):
        self.backend, self.timeout = str(backend), timeout

    def _record(self, op: str, tensor: torch.Tensor) -> None:
        self.calls.append((op, tensor.device, tensor.dtype))

    def all_reduce(self, tensor, op=None, group=None, async_op=False):
        self._record("all_reduce", tensor)
        if op == dist.ReduceOp.SUM:
            tensor.mul_(2)
        if async_op:
            future = torch.futures.Future()
            future.set_result([tensor])
            return type("Work", (), {"get_future": lambda self: future})()
        return None

    def all_gather(self, tensors, tensor, group=None):
        self._record("all_gather", tensor)
        for out in tensors:
            out.copy_(tensor)

    def all_gather_object(self, objects, value, group=None):
        self.calls.append(("all_gather_object", None, None))
        objects[:] = [value] * len(objects)


@pytest.fixture
def recording(monkeypatch):
    group = RecordingGroup()
    group.install(monkeypatch)
    monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", raising=False)
    return group


def test_a_cuda_rank_joins_a_group_with_a_backend_for_each_device(recording):
    env = RankEnv(rank=1, world_size=2, local_rank=1)
    init_process_group(env, "cuda", timeout_s=42)
    assert device_backends(recording.backend) == {"cpu": "gloo", "cuda": "nccl"}
    assert recording.devices_set == [1]  # its own GPU, before NCCL builds a communicator
    assert recording.timeout.total_seconds() == 42
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"  # a collective past the timeout ends the rank


def test_every_tensor_reaches_a_backend_that_takes_it_and_comes_back_as_it_was(recording):
    env = RankEnv(rank=1, world_size=2, local_rank=1)
    init_process_group(env, "cuda", timeout_s=30)
    comm = Collectives(env)
    # what the package hands over: the step's weight, eval sums, link counters (float64), consumed counts (int64),
    # step statistics (float32), a gradient bucket (the DDP hook's future)
    weight = torch.tensor([3.0], dtype=torch.float64)
    counts = torch.tensor([1, 0, 2], dtype=torch.int64)
    stats = torch.tensor([0.5, 1.5], dtype=torch.float32)
    assert comm.all_reduce_sum(weight) is weight and weight.tolist() == [6.0]
    assert comm.all_reduce_max(counts) is counts and counts.dtype == torch.int64
    gathered = comm.all_gather(stats)
    assert gathered.shape == (2, 2) and gathered.dtype == torch.float32 and gathered.device == stats.device
    refused = [(op, str(device)) for op, device, _ in recording.calls if device.type not in device_backends(recording.backend)]
    assert not refused, f"the process group ({recording.backend}) takes none of {refused}"
    bucket = torch.ones(4, dtype=torch.float32)
    assert comm.all_reduce_sum_future(bucket).wait()[0] is bucket and bucket.tolist() == [2.0] * 4
    assert comm.all_gather_object({"rank": 1}) == [{"rank": 1}] * 2
    comm.barrier()
    handed = [(op, device) for op, device, _ in recording.calls if device is not None]
    assert len(handed) == 4 and all(recording.takes(torch.empty(0, device=device)) for _, device in handed)


def test_a_tensor_on_a_device_without_a_backend_is_refused_naming_the_collective(recording):
    env = RankEnv(rank=0, world_size=2)
    init_process_group(env, "cpu", timeout_s=30)
    assert recording.backend == BACKENDS["cpu"] == "gloo"
    with pytest.raises(RuntimeError, match=r"all_reduce_sum of a torch.float64 tensor on meta: .*gloo"):
        Collectives(env).all_reduce_sum(torch.zeros(1, dtype=torch.float64, device="meta"))
    assert recording.calls == []  # refused before the call


def test_one_rank_calls_nothing(recording):
    comm = Collectives(RankEnv())
    weight = torch.tensor([2.0], dtype=torch.float64)
    assert comm.all_reduce_sum(weight).tolist() == [2.0] and comm.all_gather(weight).shape == (1, 1)
    assert comm.all_reduce_sum_future(weight).wait()[0] is weight
    assert recording.calls == [] and recording.backend is None


def test_backend_strings():
    assert process_group_backend("cuda") == "cpu:gloo,cuda:nccl" and process_group_backend("cpu") == "gloo"
    assert device_backends("nccl") == {"cuda": "nccl"}  # NCCL alone takes no host tensor
    with pytest.raises(ValueError, match="no process group backend for device 'meta'"):
        process_group_backend("meta")


# ---------------------------------------------------------------- a real two-rank run, every collective recorded

RECORDER = '''
"""Loaded by every process of the test's run (PYTHONPATH): records each torch.distributed collective it is handed."""
import json, os, sys
import torch.distributed as dist

_OUT = os.environ["BATCHLAB_RECORD_COLLECTIVES"]


def _wrap(name, tensor_at):
    real = getattr(dist, name)

    def recorded(*args, **kwargs):
        tensor = args[tensor_at] if tensor_at is not None and len(args) > tensor_at else None
        caller = sys._getframe(1)
        frames, frame = [], caller
        while frame is not None:
            frames.append(frame.f_code.co_filename)
            frame = frame.f_back
        result = real(*args, **kwargs)
        line = {"op": name, "caller": caller.f_code.co_filename, "stack": frames,
                "device": None if tensor is None else str(tensor.device),
                "dtype": None if tensor is None else str(tensor.dtype)}
        if tensor is not None:
            line["after"] = [str(tensor.device), str(tensor.dtype)]
        with open(os.path.join(_OUT, f"{os.getpid()}.jsonl"), "a") as out:
            out.write(json.dumps(line) + "\\n")
        return result

    setattr(dist, name, recorded)


for _name, _at in (("all_reduce", 0), ("all_gather", 1), ("all_gather_object", None), ("barrier", None),
                   ("broadcast", 0), ("reduce_scatter", 0), ("all_gather_into_tensor", 1)):
    _wrap(_name, _at)
'''

# small enough for a few seconds of training on 2 cores; gradient statistics on every step (the DDP hook's
# all-reduce), the held-out eval at the end, consumed samples recorded
TWO_RANKS = ["experiment=smoke", "strategy=bucketed", "logger=none", "trainer.progress=false", "trainer.num_workers=0",
             "trainer.threads_per_rank=1", "trainer.max_tokens=512", "trainer.grad_accum=2",
             "trainer.stop_tokens=3000", "trainer.eval_every_tokens=3000", "trainer.eval_real_prompts=0",
             "trainer.grad_stats_every=1", "trainer.checkpoint_every_steps=1000",
             "trainer.nproc=2"]


def test_a_two_rank_run_hands_every_collective_a_tensor_a_cuda_run_could_send(tmp_path, batchlab_cache):
    """Every tensor the trainer, evaluator, consumed counts, step statistics and gradient statistics hand to a
    collective in a real two-rank run goes through Collectives, on a device a CUDA run's group takes (a tensor
    on the CPU here is on the CPU there, or on the GPU if it follows the model: both have a backend)."""
    (tmp_path / "recorder").mkdir()
    (tmp_path / "recorder" / "sitecustomize.py").write_text(RECORDER)
    records = tmp_path / "records"
    records.mkdir()
    run_dir = tmp_path / "run"
    pythonpath = os.pathsep.join([str(tmp_path / "recorder"), str(REPO), os.environ.get("PYTHONPATH", "")])
    result = train_cli([*TWO_RANKS, f"hydra.run.dir={run_dir}"], cwd=tmp_path, timeout=180,
                       env_extra={"PYTHONPATH": pythonpath, "BATCHLAB_RECORD_COLLECTIVES": str(records)})
    assert result.returncode == 0, failure_text(result)
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "complete"
    calls = [json.loads(line) for path in records.glob("*.jsonl") for line in path.read_text().splitlines()]
    ranks = {path.stem for path in records.glob("*.jsonl")}
    assert len(ranks) >= 2, ranks  # both ranks recorded (the launcher itself calls none)
    assert all(c["caller"].endswith("harness/train/distributed.py") for c in calls), \
        {c["caller"] for c in calls if not c["caller"].endswith("harness/train/distributed.py")}
    cuda_run = device_backends(process_group_backend("cuda"))
    tensors = [c for c in calls if c["device"] is not None]
    refused = [c for c in tensors if torch.device(c["device"]).type not in cuda_run]
    assert not refused, refused
    assert all(c["after"] == [c["device"], c["dtype"]] for c in tensors)
    # the collectives of every component that calls one were seen
    origins = {Path(f).name for c in calls for f in c["stack"]}
    assert {"trainer.py", "evaluator.py", "consumed.py", "step_stats.py", "grad_stats.py", "epoch_data.py"} <= origins, \
        origins
    assert {"torch.float64", "torch.int64", "torch.float32"} <= {c["dtype"] for c in tensors}
