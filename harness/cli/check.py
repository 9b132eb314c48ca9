"""``batchlab-check``: check that packing is exact on this machine before a long job.

Builds the configured target (random weights from a config, or a checkpoint directory's own
weights) and drafter, runs the same random documents (varied lengths, including length 1 and
lengths that are not multiples of the GDN chunk size 64) three ways — each document alone, as one
padded batch and as one packed row — and prints the largest relative difference from the separate
runs for every tapped target layer, for the drafter loss and for the drafter gradients (identical
anchors in all three runs). On CUDA it also compares the drafter's FlexAttention path (its CUDA
default) with its dense path, and, with flash-linear-attention installed, fla's gated delta rule
with the pure-PyTorch ``torch-chunk`` reference (the op, and the packed target features). ``--json``
prints the same as JSON with a top-level ``ok``; the exit status is 1 when any difference exceeds
its tolerance, 2 on bad input.

Relative difference = ``max |x - reference| / max |reference|`` over a tensor (for gradients, the
largest over the drafter's parameters); a difference that is not finite (NaN or inf) is never ok and
is written as ``null`` in the JSON, which stays strict JSON. Tolerances (:data:`TOLERANCES`):

* float32: 1e-4 — exact packing differs from separate runs by float32 rounding only, far below it
  (measured differences: docs/design/target-and-drafter.md);
* fla vs torch-chunk in float32: 2e-3 — fla's Triton kernels use TF32 dot products, which differ from
  fp32 references by up to ~1.5e-3 (docs/design/target-and-drafter.md);
* float32 with ``--tf32`` (CUDA matmuls and convolutions in TF32, 10 bits of mantissa): 2e-3 for
  features, loss and fla, 5e-3 for gradients;
* bfloat16: 2e-2 for features and loss, 5e-2 for gradients (bf16 keeps 8 bits of mantissa, 3.9e-3
  per rounding; padded and packed runs round at different places, and gradients pass more roundings;
  measured differences: docs/design/target-and-drafter.md).

``--negative-control`` lets the target's GDN state and short conv leak across the document boundaries
of the packed row: the check must then fail, which shows it can.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

EXIT_NOT_OK = 1
EXIT_BAD_INPUT = 2
DEFAULT_LENGTHS = (1, 17, 64, 65, 130, 203)
REPO_ROOT = Path(__file__).resolve().parents[2]
DTYPES = ("float32", "bfloat16")
TOLERANCES: dict[str, dict[str, float]] = {
    "float32": {"features": 1e-4, "loss": 1e-4, "grads": 1e-4, "fla": 2e-3},
    "tf32": {"features": 2e-3, "loss": 2e-3, "grads": 5e-3, "fla": 2e-3},
    "bfloat16": {"features": 2e-2, "loss": 2e-2, "grads": 5e-2, "fla": 2e-2},
}


class BadInput(ValueError):
    """A command-line value the command cannot use."""


@dataclass
class CheckRow:
    """One comparison: what, against what, the measured difference and whether it is within tolerance."""

    name: str
    comparison: str
    max_rel_diff: float
    tolerance: float

    @property
    def ok(self) -> bool:
        return self.max_rel_diff <= self.tolerance  # NaN compares False: not ok

    def to_dict(self) -> dict[str, Any]:
        """JSON-able: a difference that is not finite becomes ``None`` (JSON has no NaN or inf)."""
        values = asdict(self)
        if not math.isfinite(self.max_rel_diff):
            values["max_rel_diff"] = None
        return {**values, "ok": self.ok}


def build_parser() -> argparse.ArgumentParser:
    """The command's argument parser."""
    parser = argparse.ArgumentParser(
        prog="batchlab-check",
        description="Check that padded and packed batches give the same target features, drafter loss "
        "and drafter gradients as running each document alone (and fla vs the torch reference on CUDA).",
        epilog="max relative difference tolerances: "
        + "; ".join(
            f"{precision}: " + ", ".join(f"{what} {value:g}" for what, value in limits.items())
            for precision, limits in TOLERANCES.items()
        )
        + ". Exit status: 0 ok, 1 a difference over its tolerance, 2 bad input.",
    )
    parser.add_argument(
        "--target", default="conf/target/tiny.yaml",
        help="target: a config (YAML or config.json; random weights) or a checkpoint directory (its weights)",
    )
    parser.add_argument("--random-weights", action="store_true",
                        help="with a checkpoint directory: use its config only, with random weights")
    parser.add_argument("--drafter", default="conf/drafter/tiny.yaml", help="drafter config YAML")
    parser.add_argument("--device", default="auto", help="auto (cuda when available), cpu, cuda, cuda:1, ...")
    parser.add_argument("--dtype", default="float32", choices=DTYPES, help="parameter and activation dtype")
    parser.add_argument("--tf32", action="store_true", help="CUDA, float32 only: allow TF32 matmuls and convolutions")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights, documents and anchors")
    parser.add_argument(
        "--lengths",
        default=",".join(str(n) for n in DEFAULT_LENGTHS),
        help="comma-separated document lengths (default: %(default)s)",
    )
    parser.add_argument("--gdn-backend", default="auto", help="gated delta rule backend of the target runs")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument(
        "--negative-control",
        action="store_true",
        help="let GDN state leak across the documents of the packed row; the check must then fail",
    )
    return parser


def _config_path(value: str) -> str:
    """``value`` as given when it exists, else relative to the repository (for the bundled conf/)."""
    path = Path(value)
    if path.exists() or path.is_absolute():
        return value
    bundled = REPO_ROOT / path
    return str(bundled) if bundled.exists() else value


def _has_weights(path: str) -> bool:
    """True for a checkpoint: a directory with safetensors files beside its config.json, or a GGUF file."""
    from harness.models.causal_lm_target import is_gguf

    checkpoint = Path(path)
    return (checkpoint.is_dir() and any(checkpoint.glob("*.safetensors"))) or is_gguf(checkpoint)


def _parse_lengths(text: str) -> list[int]:
    try:
        lengths = [int(part) for part in text.split(",") if part.strip()]
    except ValueError as err:
        raise BadInput(f"--lengths {text!r} must be comma-separated integers, e.g. 1,17,65") from err
    if not lengths or min(lengths) < 1:
        raise BadInput(f"--lengths {text!r} must hold at least one length, every length >= 1")
    return lengths



def _documents(lengths: Sequence[int], vocab_size: int, generator: Any) -> tuple[list[Any], list[Any]]:
    """Random tokens, and loss masks whose first quarter (a prompt) is 0."""
    import torch

    tokens = [torch.randint(0, vocab_size, (n,), generator=generator) for n in lengths]
    loss_masks = []
    for n in lengths:
        mask = torch.ones(n, dtype=torch.long)
        mask[: n // 4] = 0
        loss_masks.append(mask)
    return tokens, loss_masks


def _run_layout(target: Any, drafter: Any, batch: Any, anchors: list[Any], gdn_backend: str) -> dict[str, Any]:
    """Tapped features (flattened to real tokens), drafter loss sums and gradients for one batch."""
    import torch

    from harness.models.anchors import FlatDocuments

    features = target(batch, tap_layer_ids=drafter.target_layer_ids, gdn_backend=gdn_backend)
    flat = FlatDocuments.from_batch(batch)
    result = drafter.compute_loss(batch, features, anchors=anchors)
    params = list(drafter.parameters())
    grads = torch.autograd.grad(result.weighted_ce_sum, params, allow_unused=True, materialize_grads=True)
    return {
        "features": [flat.gather(states).detach().float() for states in features.hidden_states],
        "loss": result,
        "grads": [g.detach().float() for g in grads],
    }


def _merge_separate(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Join per-document runs: features concatenated in document order, loss sums and gradients added."""
    import torch

    loss = runs[0]["loss"]
    for run in runs[1:]:
        loss = loss + run["loss"]
    return {
        "features": [torch.cat([run["features"][i] for run in runs]) for i in range(len(runs[0]["features"]))],
        "loss": loss,
        "grads": [sum(run["grads"][i] for run in runs) for i in range(len(runs[0]["grads"]))],
    }


def _fla_rows(
    target: Any, drafter: Any, packed: Any, lengths: Sequence[int], tolerance: float, seed: int
) -> list[CheckRow]:
    """fla vs torch-chunk: the gated delta rule on a random packed row, then the packed target features."""
    import torch

    from harness.models.compare import max_relative_difference
    from harness.models.gdn.gated_delta import gated_delta_rule

    device, dtype = target.device, target.dtype
    generator = torch.Generator(device="cpu").manual_seed(seed)
    total, heads, value_heads, dim = sum(lengths), 2, 4, 64
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(device=device, dtype=dtype)

    q, k, v = rand(1, total, heads, dim), rand(1, total, heads, dim), rand(1, total, value_heads, dim)
    g = -torch.nn.functional.softplus(rand(1, total, value_heads).float()).to(dtype)
    beta = torch.sigmoid(rand(1, total, value_heads))
    outputs = {}
    for backend in ("fla", "torch-chunk"):
        outputs[backend] = gated_delta_rule(
            q, k, v, g, beta, use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens,
            output_final_state=True, backend=backend,
        )
    rows = [
        CheckRow("gated delta rule output", "fla vs torch-chunk",
                 max_relative_difference(outputs["fla"][0], outputs["torch-chunk"][0]), tolerance),
        CheckRow("gated delta rule final states", "fla vs torch-chunk",
                 max_relative_difference(outputs["fla"][1], outputs["torch-chunk"][1]), tolerance),
    ]
    features = {
        backend: target(packed, tap_layer_ids=drafter.target_layer_ids, gdn_backend=backend).hidden_states
        for backend in ("fla", "torch-chunk")
    }
    for layer, fla_states, torch_states in zip(drafter.target_layer_ids, features["fla"], features["torch-chunk"]):
        rows.append(CheckRow(_layer_name(target, layer), "packed fla vs torch-chunk",
                             max_relative_difference(fla_states, torch_states), tolerance))
    return rows


def _drafter_attention_rows(target: Any, drafter: Any, packed: Any, anchors: list[Any], gdn_backend: str,
                            tolerances: dict[str, float]) -> list[CheckRow]:
    """The drafter's FlexAttention path vs its dense path on the packed row: loss and gradients."""
    import dataclasses

    from harness.models.compare import max_relative_difference
    from harness.models.drafter import DFlashDrafter

    runs = {}
    for backend in ("flex", "dense"):
        copy = DFlashDrafter.from_target(target, dataclasses.replace(drafter.config, attention_backend=backend))
        copy.load_state_dict(drafter.state_dict())
        runs[backend] = _run_layout(target, copy, packed, anchors, gdn_backend)
    flex, dense = runs["flex"], runs["dense"]
    loss_difference = max(max_relative_difference(getattr(flex["loss"], name), getattr(dense["loss"], name))
                          for name in ("weighted_ce_sum", "weight_sum"))
    grad_difference = max(max_relative_difference(grad, ref) for grad, ref in zip(flex["grads"], dense["grads"]))
    return [
        CheckRow("drafter loss (sum w*CE, sum w)", "packed flex vs dense attention", loss_difference,
                 tolerances["loss"]),
        CheckRow("drafter gradients", "packed flex vs dense attention", grad_difference, tolerances["grads"]),
    ]


def _layer_name(target: Any, layer: int) -> str:
    kinds = getattr(target.config, "layer_types", None)  # the hybrid's; a dense causal LM's are all decoder layers
    return f"target layer {layer} ({kinds[layer] if kinds else 'decoder'})"


def run_check(args: argparse.Namespace) -> dict[str, Any]:
    """Build the models, run separate / padded / packed, and return the JSON-able report."""
    import torch

    from harness.models.anchors import FlatDocuments, sample_anchors
    from harness.models.compare import max_relative_difference
    from harness.models.drafter import DFlashDrafter, load_drafter_config
    from harness.models.kernel_libraries import fla_available
    from harness.models.layout import TokenBatch
    from harness.models.target import HybridTarget

    lengths = _parse_lengths(args.lengths)
    if args.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        try:
            device = torch.device(args.device)
        except RuntimeError as err:
            raise BadInput(f"--device {args.device!r} is not a device; use auto, cpu, cuda or cuda:N") from err
    if device.type == "cuda" and not torch.cuda.is_available():
        raise BadInput(f"--device {args.device} asks for CUDA but torch sees no GPU; use --device cpu")
    dtype = getattr(torch, args.dtype)
    precision = args.dtype
    if args.tf32:
        if device.type != "cuda" or args.dtype != "float32":
            raise BadInput(f"--tf32 needs --device cuda and --dtype float32, got {device} and {args.dtype}")
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        precision = "tf32"
    tolerances = TOLERANCES[precision]
    torch.manual_seed(args.seed)
    drafter_config = load_drafter_config(_config_path(args.drafter))
    target_path = _config_path(args.target)
    target_options = dict(num_draft_layers=drafter_config.num_hidden_layers,
                          tap_layer_ids=drafter_config.target_layer_ids)
    if _has_weights(target_path) and not args.random_weights:
        # a Qwen3.5-style hybrid checkpoint, or any transformers causal LM (a directory or a GGUF file)
        from harness.models.causal_lm_target import check_target_checkpoint, is_hybrid_checkpoint, load_target

        check_target_checkpoint(target_path)  # a checkpoint of another kind: one line (main), nothing loaded
        if args.negative_control and not is_hybrid_checkpoint(target_path):
            raise BadInput(f"--negative-control makes a Gated DeltaNet's state leak across packed documents; "
                           f"{target_path} is a causal LM without such layers: leave the flag out")
        target = load_target(target_path, dtype=dtype, device=device, **target_options)
        target_weights = f"checkpoint {target_path}"
    else:
        target = HybridTarget(target_path, dtype=dtype, **target_options).to(device)
        target_weights = f"random (seed {args.seed})"
    drafter = DFlashDrafter.from_target(target, drafter_config)
    target.leak_across_documents = bool(args.negative_control)

    generator = torch.Generator().manual_seed(args.seed)
    tokens, loss_masks = _documents(lengths, target.config.vocab_size, generator)
    packed = TokenBatch.from_documents(tokens, "packed", loss_masks).to(device)
    padded = TokenBatch.from_documents(tokens, "padded", loss_masks).to(device)
    anchors = sample_anchors(FlatDocuments.from_batch(packed), drafter_config.num_anchors,
                             torch.Generator().manual_seed(args.seed + 1), block_size=drafter_config.block_size)
    runs = {
        "separate": _merge_separate([
            _run_layout(target, drafter, TokenBatch.from_documents([doc], "padded", [mask]).to(device), [doc_anchors],
                        args.gdn_backend)
            for doc, mask, doc_anchors in zip(tokens, loss_masks, anchors)
        ]),
        "padded": _run_layout(target, drafter, padded, anchors, args.gdn_backend),
        "packed": _run_layout(target, drafter, packed, anchors, args.gdn_backend),
    }
    reference = runs["separate"]
    rows: list[CheckRow] = []
    for layout in ("padded", "packed"):
        comparison = f"{layout} vs separate"
        for i, layer in enumerate(drafter.target_layer_ids):
            rows.append(CheckRow(_layer_name(target, layer), comparison,
                                 max_relative_difference(runs[layout]["features"][i], reference["features"][i]),
                                 tolerances["features"]))
        loss, reference_loss = runs[layout]["loss"], reference["loss"]
        loss_difference = max(max_relative_difference(getattr(loss, name), getattr(reference_loss, name))
                               for name in ("weighted_ce_sum", "weight_sum"))
        rows.append(CheckRow("drafter loss (sum w*CE, sum w)", comparison, loss_difference, tolerances["loss"]))
        grad_difference = max(max_relative_difference(grad, ref)
                              for grad, ref in zip(runs[layout]["grads"], reference["grads"]))
        rows.append(CheckRow("drafter gradients", comparison, grad_difference, tolerances["grads"]))

    notes = []
    if not int(reference["loss"].block_count):
        notes.append("no document has an anchor: the drafter rows compare nothing; give longer --lengths")
    if not isinstance(target, HybridTarget):
        notes.append("fla vs torch-chunk skipped: the target has no Gated DeltaNet layers")
    elif device.type == "cuda" and fla_available():
        rows.extend(_fla_rows(target, drafter, packed, lengths, tolerances["fla"], args.seed))
    else:
        notes.append("fla vs torch-chunk skipped: needs CUDA and flash-linear-attention")
    if device.type == "cuda":
        rows.extend(_drafter_attention_rows(target, drafter, packed, anchors, args.gdn_backend, tolerances))
    if args.negative_control:
        notes.append("negative control: GDN state leaks across packed documents; packed rows must fail")
    return {
        "ok": all(row.ok for row in rows),
        "device": str(device),
        "dtype": args.dtype,
        "precision": precision,
        "seed": args.seed,
        "gdn_backend": args.gdn_backend,
        "drafter_attention": drafter.attention_backend(device),
        "target_weights": target_weights,
        "document_lengths": lengths,
        "blocks": int(reference["loss"].block_count),
        "tolerances": tolerances,
        "checks": [row.to_dict() for row in rows],
        "notes": notes,
    }


def format_table(report: dict[str, Any]) -> str:
    """The report as a plain-text table."""
    header = (f"batchlab-check  device={report['device']} precision={report['precision']} seed={report['seed']} "
              f"gdn={report['gdn_backend']} drafter-attention={report['drafter_attention']}  "
              f"target weights: {report['target_weights']}\n"
              f"documents={report['document_lengths']}  blocks={report['blocks']}")
    name_width = max(len(c["name"]) for c in report["checks"])
    comparison_width = max(len(c["comparison"]) for c in report["checks"])
    columns = f"{'check':<{name_width}}  {'comparison':<{comparison_width}}  {'max rel diff':>12}  {'tolerance':>9}  ok"
    lines = [header, "", columns, "-" * len(columns)]
    for c in report["checks"]:
        difference = "not finite" if c["max_rel_diff"] is None else f"{c['max_rel_diff']:.2e}"
        lines.append(f"{c['name']:<{name_width}}  {c['comparison']:<{comparison_width}}  "
                     f"{difference:>12}  {c['tolerance']:>9.0e}  {'ok' if c['ok'] else 'FAIL'}")
    lines.extend(["", *report["notes"]])
    failed = sum(not c["ok"] for c in report["checks"])
    lines.append("ok: every difference within tolerance" if report["ok"]
                 else f"NOT OK: {failed} of {len(report['checks'])} checks exceed their tolerance")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command; returns the exit status (0 ok, 1 a difference over tolerance, 2 bad input)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_request:  # argparse already printed the usage error
        return int(exit_request.code or 0)
    try:
        report = run_check(args)
    except (BadInput, FileNotFoundError, ValueError) as err:
        print(f"batchlab-check: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(json.dumps(report, indent=2, allow_nan=False) if args.json else format_table(report))
    return 0 if report["ok"] else EXIT_NOT_OK


if __name__ == "__main__":
    sys.exit(main())
