"""Check how batchlab calls flash-linear-attention without a GPU: fla's Triton kernels on CPU, interpreted.

Runs the project's own public calls with ``backend="fla"`` — the gated delta rule on a packed row
(outputs, final states and all gradients), the varlen short conv (outputs and gradients), and a
packed target forward with ``gdn_backend="fla"`` — under ``TRITON_INTERPRET=1`` and compares them
with the float64 torch references. What this proves: argument names, layouts, dtypes, head mapping,
``cu_seqlens`` handling and return values match fla's API, and fla computes the same function
(fp32, max relative difference <= 1e-4). What it does not: the GPU compile, autotuned configs other
than the first, speed, bf16 (the interpreter computes bf16 on raw bits; that needs the GPU run,
``benchmarks/gpu_check.sh``).

Needs its own environment with Triton and fla (never install Triton into the project's venv on a
CPU-only machine: transformers would then route Gated DeltaNet to kernels that cannot run there):

    make fla-interpret                  # makes .venv-fla (torch, Triton, fla), then runs this
    make fla-interpret ARGS=--write     # and replaces this check's section of RESULTS.md

Exit status 0 when every difference is within tolerance, 1 otherwise.
"""

from __future__ import annotations

import argparse
import ast
import os
import platform
import sys
import time
from datetime import date
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"  # before Triton is imported

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from harness.models.compare import max_relative_difference  # noqa: E402
from harness.models.gdn.gated_delta import gated_delta_rule  # noqa: E402
from harness.models.layout import TokenBatch  # noqa: E402
from harness.models.gdn.short_conv import causal_conv1d  # noqa: E402
from results_file import cpu_model, write_section  # noqa: E402

SECTION = "## fla kernels through Triton's interpreter (CPU)"
TOLERANCE = 1e-4  # fp32 vs a float64 reference
LENGTHS = [1, 5, 17, 64, 65, 100]  # length 1, the chunk size 64, chunk + 1, several chunks


def patch_triton_interpreter() -> None:
    """Two gaps of Triton's interpreter that fla's kernels hit; written here because no library closes them.

    * The autotuner benchmarks configs on a GPU driver ("0 active drivers"): run the first config.
    * In compiled Triton the variable of ``for i in range(n)`` is a tensor (fla calls ``i.to(...)``
      on it); the interpreter gives a Python int. Start each such loop body with ``i = i``, which the
      interpreter's own assignment rewrite turns into a tensor.
    """
    import triton.runtime.autotuner as autotuner
    import triton.runtime.interpreter as interpreter

    prune = autotuner.Autotuner.prune_configs
    autotuner.Autotuner.prune_configs = lambda self, kwargs: list(prune(self, kwargs))[:1]

    def visit_for(self, node):
        node = self.generic_visit(node)
        loop = node.iter
        if (isinstance(loop, ast.Call) and isinstance(loop.func, ast.Name) and loop.func.id == "range"
                and isinstance(node.target, ast.Name)):
            name = node.target.id
            assign = self.visit_Assign(ast.Assign(targets=[ast.Name(id=name, ctx=ast.Store())],
                                                  value=ast.Name(id=name, ctx=ast.Load())))
            node.body.insert(0, ast.copy_location(assign, node.body[0]))
        return node

    interpreter.ASTTransformer.visit_For = visit_for


def cu_seqlens_of(lengths: list[int], dtype: torch.dtype = torch.int32) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=dtype)


def with_grads(function, leaves: dict[str, torch.Tensor | None], dtype: torch.dtype, seed: int):
    """Run ``function(**leaves)`` in ``dtype``, backpropagate random cotangents; outputs and gradients."""
    inputs = {name: None if x is None else x.detach().to(dtype).requires_grad_() for name, x in leaves.items()}
    outputs = function(**inputs)
    outputs = [o for o in (outputs if isinstance(outputs, tuple) else (outputs,)) if o is not None]
    generator = torch.Generator().manual_seed(seed)
    loss = sum((o * torch.randn(o.shape, generator=generator).to(o.dtype)).sum() for o in outputs)
    loss.backward()
    grads = {name: x.grad for name, x in inputs.items() if x is not None}
    return outputs, grads


def compare(case: str, function, reference, leaves: dict, output_names: list[str], seed: int = 0) -> list[dict]:
    """fp32 ``function`` vs float64 ``reference`` on the same leaves: one row per output and gradient."""
    started = time.perf_counter()
    outputs, grads = with_grads(function, leaves, torch.float32, seed)
    seconds = time.perf_counter() - started
    ref_outputs, ref_grads = with_grads(reference, leaves, torch.float64, seed)
    rows = [{"case": case, "what": name, "diff": max_relative_difference(o, r), "seconds": seconds}
            for name, o, r in zip(output_names, outputs, ref_outputs)]
    rows += [{"case": case, "what": f"d{name}", "diff": max_relative_difference(grads[name], ref_grads[name]),
              "seconds": None} for name in ref_grads]
    return rows


def gated_delta_case(key_heads: int, value_heads: int, key_dim: int, value_dim: int, initial_state: bool,
                     cu_dtype: torch.dtype, seed: int) -> list[dict]:
    generator = torch.Generator().manual_seed(seed)
    total = sum(LENGTHS)
    randn = lambda *shape: torch.randn(*shape, generator=generator)  # noqa: E731
    leaves = {
        "q": randn(1, total, key_heads, key_dim), "k": randn(1, total, key_heads, key_dim),
        "v": randn(1, total, value_heads, value_dim),
        "g": -F.softplus(randn(1, total, value_heads)),  # log decay <= 0, as the model computes it
        "beta": torch.sigmoid(randn(1, total, value_heads)),
        "initial_state": randn(len(LENGTHS), value_heads, key_dim, value_dim) if initial_state else None,
    }
    cu = cu_seqlens_of(LENGTHS, cu_dtype)

    def run(backend):
        return lambda **x: gated_delta_rule(**x, use_qk_l2norm_in_kernel=True, output_final_state=True,
                                            cu_seqlens=cu, backend=backend)

    case = (f"gated delta rule H={key_heads} HV={value_heads} K={key_dim} V={value_dim} "
            f"initial_state={'yes' if initial_state else 'no'} cu_seqlens={str(cu_dtype).split('.')[-1]}")
    return compare(case, run("fla"), run("torch-recurrent"), leaves, ["output", "final state"], seed)


def negative_control(seed: int) -> list[dict]:
    """fla called on the packed row WITHOUT cu_seqlens must differ from the per-document reference:
    shows that this check sees a state leak across documents."""
    generator = torch.Generator().manual_seed(seed)
    total = sum(LENGTHS)
    q, k, v = (torch.randn(1, total, 2, 16, generator=generator) for _ in range(3))
    g = -F.softplus(torch.randn(1, total, 2, generator=generator))
    beta = torch.sigmoid(torch.randn(1, total, 2, generator=generator))
    leaked, _ = gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True, backend="fla")
    reference, _ = gated_delta_rule(q.double(), k.double(), v.double(), g.double(), beta.double(),
                                    use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens_of(LENGTHS),
                                    backend="torch-recurrent")
    return [{"case": "negative control: fla without cu_seqlens (must differ)", "what": "output",
             "diff": max_relative_difference(leaked, reference), "seconds": None}]


def short_conv_case(bias: bool, seed: int) -> list[dict]:
    generator = torch.Generator().manual_seed(seed)
    total, channels, width = sum(LENGTHS), 24, 4
    leaves = {"x": torch.randn(1, total, channels, generator=generator),
              "weight": torch.randn(channels, width, generator=generator) * 0.5,
              "bias": torch.randn(channels, generator=generator) if bias else None}
    cu = cu_seqlens_of(LENGTHS)

    def run(backend):
        return lambda **x: causal_conv1d(**x, activation="silu", cu_seqlens=cu, backend=backend)

    case = f"short conv D={channels} W={width} silu bias={'yes' if bias else 'no'}"
    return compare(case, run("fla"), run("torch"), leaves, ["output"], seed)


def target_case(seed: int) -> list[dict]:
    """Packed forward of the tiny target: every GDN layer through fla vs through torch-chunk (fp32 both)."""
    from harness.models.target import HybridTarget

    torch.manual_seed(seed)
    target = HybridTarget(REPO / "conf" / "target" / "tiny.yaml", tap_layer_ids=[0, 1, 2, 3])
    generator = torch.Generator().manual_seed(seed)
    docs = [torch.randint(0, target.config.vocab_size, (n,), generator=generator) for n in LENGTHS]
    batch = TokenBatch.from_documents(docs, "packed")
    started = time.perf_counter()
    fla = target(batch, gdn_backend="fla").hidden_states
    seconds = time.perf_counter() - started
    reference = target(batch, gdn_backend="torch-chunk").hidden_states
    return [{"case": "tiny target, packed row, forward", "what": f"layer {layer} ({target.config.layer_types[layer]})",
             "diff": max_relative_difference(a, b), "seconds": seconds if layer == 0 else None}
            for layer, (a, b) in enumerate(zip(fla, reference))]


def passed(rows: list[dict], control: list[dict]) -> bool:
    """Every comparison within tolerance, and the negative control well outside it."""
    return all(row["diff"] <= TOLERANCE for row in rows) and all(row["diff"] > 100 * TOLERANCE for row in control)


def format_section(rows: list[dict], control: list[dict], versions: dict[str, str], command: str) -> str:
    worst = max(row["diff"] for row in rows)
    ok = passed(rows, control)
    lines = [
        SECTION, "",
        f"Command: `{command}`  ",
        f"Date: {date.today().isoformat()}  ",
        f"Machine: {cpu_model()}, {os.cpu_count()} CPU cores, {platform.system()} {platform.release()}, "
        + ", ".join(f"{name} {version}" for name, version in versions.items()), "",
        "The project's own calls with `backend=\"fla\"` (fp32) against the float64 torch references "
        f"(torch-recurrent for the gated delta rule, the torch conv), on one packed row of documents {LENGTHS}; "
        "the target rows compare fla with torch-chunk inside the tiny target's packed forward. fla's kernels "
        "run in Triton's interpreter on the CPU, each autotuned kernel with its first config. This checks the "
        "calls (names, layouts, dtypes, head mapping, `cu_seqlens`, returns), not GPU speed or bf16.", "",
        "| case | output or gradient | max rel diff | seconds (forward) |", "| --- | --- | ---: | ---: |",
    ]
    for row in rows + control:
        seconds = "" if row["seconds"] is None else f"{row['seconds']:.2f}"
        lines.append(f"| {row['case']} | {row['what']} | {row['diff']:.1e} | {seconds} |")
    lines += ["", f"- worst {worst:.1e} against tolerance {TOLERANCE:.0e}; negative control "
              f"{min(row['diff'] for row in control):.1e} (must exceed {100 * TOLERANCE:.0e}): "
              f"**{'ok' if ok else 'NOT OK'}**", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--write", action="store_true", help=f"replace the section {SECTION!r} of RESULTS.md")
    args = parser.parse_args(argv)
    patch_triton_interpreter()
    import fla
    import triton

    torch.set_num_threads(min(2, os.cpu_count() or 1))
    versions = {"torch": torch.__version__, "triton": triton.__version__, "flash-linear-attention": fla.__version__}
    rows = []
    for key_heads, value_heads, key_dim, value_dim, initial_state, cu_dtype in (
        (2, 2, 32, 16, True, torch.int32),
        (2, 2, 32, 16, False, torch.int64),
        (2, 4, 16, 32, True, torch.int32),  # more value heads than key heads (Qwen3.5's layout)
    ):
        rows += gated_delta_case(key_heads, value_heads, key_dim, value_dim, initial_state, cu_dtype, seed=len(rows))
    rows += short_conv_case(bias=True, seed=1) + short_conv_case(bias=False, seed=2)
    rows += target_case(seed=3)
    control = negative_control(seed=4)
    section = format_section(rows, control, versions, command="make fla-interpret")
    print(section)
    if args.write:
        write_section(section, SECTION)
    return 0 if passed(rows, control) else 1


if __name__ == "__main__":
    sys.exit(main())
