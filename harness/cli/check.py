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
import sys
from collections.abc import Sequence
from typing import Any

from harness.cli.process_exit import exits_fast
from harness.models.packing_check import DEFAULT_LENGTHS, DTYPES, TOLERANCES, BadInput, CheckSettings, run_check

EXIT_NOT_OK = 1
EXIT_BAD_INPUT = 2


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
        report = run_check(CheckSettings(**{k: v for k, v in vars(args).items() if k != "json"}))
    except (BadInput, FileNotFoundError, ValueError) as err:
        print(f"batchlab-check: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(json.dumps(report, indent=2, allow_nan=False) if args.json else format_table(report))
    return 0 if report["ok"] else EXIT_NOT_OK


if __name__ == "__main__":
    exits_fast(main)()
