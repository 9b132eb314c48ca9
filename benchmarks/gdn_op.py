"""Benchmark of the gated delta rule op on CPU: a packed row versus the same documents padded.

Draws document lengths from a lognormal, runs the ``torch-chunk`` backend on one packed row (with
``cu_seqlens``) and on a right-padded ``[B, L]`` batch of the same documents, alternating the two so
both see the same machine load, and prints real tokens per second for each (forward, and forward +
backward with ``--backward``).

    .venv/bin/python benchmarks/gdn_op.py --docs 16 --tokens 4096 --heads 4 --dim 16
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from harness.models.gdn.gated_delta import gated_delta_rule


def lognormal_lengths(num_docs: int, total_tokens: int, sigma: float, seed: int) -> list[int]:
    """``num_docs`` lognormal lengths (>= 1) rescaled so they sum to about ``total_tokens``."""
    raw = np.random.default_rng(seed).lognormal(mean=0.0, sigma=sigma, size=num_docs)
    return [max(1, int(round(x))) for x in raw / raw.sum() * total_tokens]


def make_inputs(lengths: list[int], heads: int, dim: int, seed: int) -> dict[str, torch.Tensor]:
    """Random packed inputs ``[1, T, ...]`` and their ``cu_seqlens``."""
    gen = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    cu_seqlens = torch.tensor([0, *np.cumsum(lengths).tolist()], dtype=torch.int32)
    return {
        "q": torch.randn(1, total, heads, dim, generator=gen),
        "k": torch.randn(1, total, heads, dim, generator=gen),
        "v": torch.randn(1, total, heads, dim, generator=gen),
        "g": -torch.rand(1, total, heads, generator=gen),
        "beta": torch.rand(1, total, heads, generator=gen),
        "cu_seqlens": cu_seqlens,
    }


def to_padded(packed: dict[str, torch.Tensor], lengths: list[int]) -> dict[str, torch.Tensor]:
    """The same documents right-padded to ``[B, max_len, ...]`` (padding tokens are zeros)."""
    bounds = packed["cu_seqlens"].tolist()
    out = {}
    for name in ("q", "k", "v", "g", "beta"):
        docs = [packed[name][0, s:e] for s, e in zip(bounds[:-1], bounds[1:])]
        out[name] = torch.nn.utils.rnn.pad_sequence(docs, batch_first=True)
    return out


def time_call(inputs: dict[str, torch.Tensor], backward: bool, chunk_size: int) -> float:
    """Seconds for one call (forward, or forward + backward)."""
    tensors = {n: t.clone().requires_grad_(backward) if n != "cu_seqlens" else t for n, t in inputs.items()}
    start = time.perf_counter()
    with torch.set_grad_enabled(backward):
        out, _ = gated_delta_rule(
            tensors["q"], tensors["k"], tensors["v"], tensors["g"], tensors["beta"],
            cu_seqlens=tensors.get("cu_seqlens"), use_qk_l2norm_in_kernel=True,
            backend="torch-chunk", chunk_size=chunk_size,
        )
        if backward:
            out.square().sum().backward()
    return time.perf_counter() - start


def main() -> None:
    """Parse arguments, run the side-by-side timing and print a JSON summary."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--sigma", type=float, default=1.0)
    parser.add_argument("--chunk-size", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--backward", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    lengths = lognormal_lengths(args.docs, args.tokens, args.sigma, args.seed)
    packed = make_inputs(lengths, args.heads, args.dim, args.seed)
    padded = to_padded(packed, lengths)
    real = sum(lengths)
    for inputs in (packed, padded):  # warm-up
        time_call(inputs, args.backward, args.chunk_size)
    packed_s, padded_s = [], []
    for _ in range(args.repeats):  # alternate so both layouts see the same load
        packed_s.append(time_call(packed, args.backward, args.chunk_size))
        padded_s.append(time_call(padded, args.backward, args.chunk_size))
    packed_t, padded_t = float(np.median(packed_s)), float(np.median(padded_s))
    print(json.dumps({
        "docs": args.docs, "real_tokens": real, "max_len": max(lengths),
        "padded_tokens": len(lengths) * max(lengths), "heads": args.heads, "dim": args.dim,
        "backward": args.backward, "chunk_size": args.chunk_size,
        "packed_s": round(packed_t, 5), "padded_s": round(padded_t, 5),
        "packed_real_tok_per_s": round(real / packed_t), "padded_real_tok_per_s": round(real / padded_t),
        "packed_speedup": round(padded_t / packed_t, 3),
    }))


if __name__ == "__main__":
    main()
