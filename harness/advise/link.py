"""The split placement's link, measured on its own: what a micro-batch's trip from a target rank to a drafter rank costs.

Two ranks (gloo on CPU, NCCL on GPUs) play the two ends of :mod:`harness.train.placement.link` with its own code, on
the calibration's design of shapes (:func:`harness.advise.calibrate.design`), the target's forward left out:

* **send** (the target rank): the store's dispatch counter and in-flight look-ups, the real tokens' features
  gathered from the tapped layers (:func:`~harness.train.placement.link.encode`), the batch pickled, the header,
  the batch and the features sent;
* **receive** (the drafter rank's receiving thread): from the header received to the batch unpickled
  (:func:`~harness.train.placement.link.decode`);
* **unpack** (the drafter rank's take): the credit returned through the store, the batch moved to the device, the
  features scattered back to the batch's token shape (:func:`~harness.train.placement.link.unpack`).

The sender waits for each micro-batch's credit before the next, so the three are timed apart. Each is fitted
``fixed + per_token · real tokens + per_slot · computed slots`` (non-negative least squares), and
:mod:`harness.advise.schedule` replays the link's protocol with them. Cached beside the calibration.
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from harness.advise.calibrate import (
    CACHE_SUBDIR,
    REPEATS,
    _write_atomic,
    design,
    drafter_identity,
    fit,
    machine_identity,
    shape_batch,
)
from harness.advise.schedule import LinkCost
from harness.data import cache

FORMAT_VERSION = 1
TAG_READY = 199


def link_key(config_dict: dict[str, Any]) -> str:
    trainer = config_dict["trainer"]
    return cache.digest({"format": FORMAT_VERSION, "machine": machine_identity(trainer["device"]),
                         "precision": trainer["precision"], "max_tokens": int(trainer["max_tokens"]),
                         "target": config_dict["target"], "drafter": drafter_identity(config_dict["drafter"]),
                         "repeats": REPEATS})


def calibrate_link(config_dict: dict[str, Any], cache_dir: Path, progress: bool = True) -> tuple[LinkCost, dict]:
    """``(link cost, the measured rows)`` for ``config_dict``'s target and drafter on this machine, from the cache
    when there (module docstring)."""
    from harness.train.distributed import launch

    path = Path(cache_dir) / CACHE_SUBDIR / f"link-{link_key(config_dict)}.json"
    values = cache.read_json_checked(path, "link calibration")
    if values is not None:
        return _cost(values), values
    if progress:
        print("batchlab-advise: measuring the split placement's link (2 ranks)", flush=True)
    started = time.time()
    rows = launch(_link_rank, (config_dict,), 2, run_id=f"batchlab-link-{os.getpid()}-{time.time_ns()}")
    terms = np.array([[1.0, r["tokens"], r["slots"]] for r in rows])
    cost = {part: tuple(float(x) for x in fit(terms, np.maximum(np.array([r[part] for r in rows]), 1e-9)))
            for part in ("send", "receive", "unpack")}
    values = {"cost": cost, "rows": rows, "seconds": time.time() - started}
    path.parent.mkdir(parents=True, exist_ok=True)
    _write_atomic(path, values)
    return _cost(values), values


def _cost(values: dict) -> LinkCost:
    return LinkCost(**{part: tuple(coefficients) for part, coefficients in values["cost"].items()})


def _link_rank(config_dict: dict[str, Any]) -> list[dict]:
    """Rank 0 plays a drafter rank, rank 1 a target rank; rank 0 returns a row per shape."""
    from harness.train.config import run_config_from_dict
    from harness.train.distributed import RankEnv, destroy_process_group, external_launch_env, init_process_group
    from harness.train.launch.compose import models_config
    from harness.train.rank_models import DrafterModel, rank_device

    env = external_launch_env() or RankEnv()
    config = run_config_from_dict(config_dict)
    init_process_group(env, config.trainer.device, 600)
    try:
        device = rank_device(config.trainer, env)
        model = DrafterModel(models_config(config), device)
        drafter = model.drafter
        end = _End(device, list(drafter.target_layer_ids), drafter.hidden_size, model.dtype)
        vocab = int(model.target.embed_tokens.num_embeddings)
        rows = []
        for shape in design(config.trainer.max_tokens, drafter.block_size):
            batch = shape_batch(shape, config, drafter, vocab)
            if env.rank == 1:
                end.send(batch)
            else:
                times = end.receive()
                rows.append({"layout": shape.layout, "lengths": list(shape.lengths),
                             "tokens": float(sum(shape.lengths)), "slots": float(batch.computed_slots),
                             **{part: statistics.median(values) for part, values in times.items()}})
        return rows
    finally:
        destroy_process_group()


class _End:
    """One end of the measured link, with the link's own code and store keys of its own."""

    def __init__(self, device: Any, taps: list[int], hidden: int, dtype: Any) -> None:
        import torch
        import torch.distributed as dist

        from harness.train.placement import link as feature_link

        self.torch, self.dist, self.link = torch, dist, feature_link
        self.device, self.wire = device, feature_link.link_device(device)
        self.taps, self.hidden, self.dtype = taps, hidden, dtype
        self.store = feature_link.job_store()

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            self.torch.cuda.synchronize(self.device)

    def send(self, batch: Any) -> None:
        """The target end: every repeat once the drafter end waits on its receive; sends its seconds back."""
        torch, dist, link = self.torch, self.dist, self.link
        tapped = torch.randn(*batch.drafter.token_shape, len(self.taps) * self.hidden, device=self.device).to(self.dtype)
        for _ in range(REPEATS + 1):
            dist.recv(torch.zeros(1, dtype=torch.int64, device=self.wire), src=0, tag=TAG_READY)
            self._synchronize()
            started = time.perf_counter()
            self.store.add(link.store_key("link", "dispatch"), 1)  # the dynamic dispatch counter
            self.store.add(link.store_key("link", "credit"), 0)  # the in-flight look-up before the forward
            meta, features = link.encode(batch, tapped, self.wire)
            self._synchronize()
            self.store.add(link.store_key("link", "credit"), 0)  # the in-flight count the header carries
            dist.send(link.header({"kind": link.KIND_BATCH, **link.payload_fields(meta, features)}, self.wire), dst=0,
                      tag=link.TAG_HEADER)
            dist.send(meta, dst=0, tag=link.TAG_META)
            dist.send(features, dst=0, tag=link.TAG_FEATURES)
            elapsed = time.perf_counter() - started
            dist.send(torch.tensor([elapsed], dtype=torch.float64, device=self.wire), dst=0, tag=TAG_READY)

    def receive(self) -> dict[str, list[float]]:
        """The drafter end: a receiving thread as the link's, then the take; the seconds of every part."""
        torch, dist, link = self.torch, self.dist, self.link
        times: dict[str, list[float]] = {"send": [], "receive": [], "unpack": []}
        for repeat in range(REPEATS + 1):
            got: dict[str, Any] = {}

            def receive() -> None:
                if self.wire.type == "cuda":
                    torch.cuda.set_device(self.wire)
                header = torch.empty(len(link.HEADER_FIELDS), dtype=torch.int64, device=self.wire)
                dist.recv(header, src=1, tag=link.TAG_HEADER)
                started = time.perf_counter()
                meta, features = link.receive_payload(header.tolist(), 1, self.wire)
                got.update(batch=link.decode(meta), features=features, seconds=time.perf_counter() - started)

            thread = threading.Thread(target=receive, name="batchlab-link-measure")
            thread.start()
            time.sleep(0.005)  # the thread is blocked in its receive, as the link's always is
            dist.send(torch.ones(1, dtype=torch.int64, device=self.wire), dst=1, tag=TAG_READY)
            thread.join()
            started = time.perf_counter()
            self.store.add(link.store_key("link", "credit"), 1)
            taken = got["batch"].to(self.device)
            link.unpack(taken, got["features"].to(self.device, non_blocking=True), self.taps, self.hidden)
            self._synchronize()
            unpacked = time.perf_counter() - started
            elapsed = torch.zeros(1, dtype=torch.float64, device=self.wire)
            dist.recv(elapsed, src=1, tag=TAG_READY)
            if repeat:  # the first trip warms up
                times["send"].append(float(elapsed[0]))
                times["receive"].append(got["seconds"])
                times["unpack"].append(unpacked)
        return times
