"""Whether packing is exact on this machine (``batchlab-check``, :mod:`harness.cli.check`, is the command).

The configured target and drafter run the same random documents three ways (each alone, one padded batch, one
packed row); :func:`run_check` compares the padded and packed runs with the separate ones, tapped target layer by
layer, the drafter loss and the drafter gradients, against :data:`TOLERANCES` (and fla against torch-chunk, flex
against dense attention, on CUDA). The definitions and tolerances are explained in docs/commands/batchlab-check.md.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

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


def parse_lengths(text: str) -> list[int]:
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


@dataclass(frozen=True)
class CheckSettings:
    """What to check: the models (a config or checkpoint path each), where, at what precision, on which documents."""

    target: str = "conf/target/tiny.yaml"
    random_weights: bool = False  # a checkpoint directory's config only, with random weights
    drafter: str = "conf/drafter/tiny.yaml"
    device: str = "auto"  # auto (cuda when available), cpu, cuda, cuda:1, ...
    dtype: str = "float32"
    tf32: bool = False  # CUDA, float32 only: TF32 matmuls and convolutions
    seed: int = 0
    lengths: str = ",".join(str(n) for n in DEFAULT_LENGTHS)  # comma-separated document lengths
    gdn_backend: str = "auto"
    negative_control: bool = False  # GDN state leaks across the packed row's documents: the check must fail


def check_device(text: str) -> Any:
    """The torch device ``text`` names (``auto``: cuda when available); BadInput for one that is not there."""
    import torch

    if text == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        try:
            device = torch.device(text)
        except RuntimeError as err:
            raise BadInput(f"--device {text!r} is not a device; use auto, cpu, cuda or cuda:N") from err
    if device.type == "cuda" and not torch.cuda.is_available():
        raise BadInput(f"--device {text} asks for CUDA but torch sees no GPU; use --device cpu")
    return device


def check_precision(settings: CheckSettings, device: Any) -> str:
    """The precision whose tolerances apply: the dtype, or ``tf32`` (then allowed in torch's CUDA matmuls)."""
    import torch

    if not settings.tf32:
        return settings.dtype
    if device.type != "cuda" or settings.dtype != "float32":
        raise BadInput(f"--tf32 needs --device cuda and --dtype float32, got {device} and {settings.dtype}")
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    return "tf32"


def build_models(settings: CheckSettings, device: Any) -> tuple[Any, Any, str]:
    """The target (a checkpoint's weights, or random ones from a config), the drafter on it, and what weights the
    target has in words."""
    import torch

    from harness.models.drafter import DFlashDrafter, load_drafter_config
    from harness.models.target import HybridTarget

    dtype = getattr(torch, settings.dtype)
    torch.manual_seed(settings.seed)
    drafter_config = load_drafter_config(_config_path(settings.drafter))
    target_path = _config_path(settings.target)
    target_options = dict(num_draft_layers=drafter_config.num_hidden_layers,
                          tap_layer_ids=drafter_config.target_layer_ids)
    if _has_weights(target_path) and not settings.random_weights:
        # a Qwen3.5-style hybrid checkpoint, or any transformers causal LM (a directory or a GGUF file)
        from harness.models.causal_lm_target import check_target_checkpoint, is_hybrid_checkpoint, load_target

        check_target_checkpoint(target_path)  # a checkpoint of another kind: one line (main), nothing loaded
        if settings.negative_control and not is_hybrid_checkpoint(target_path):
            raise BadInput(f"--negative-control makes a Gated DeltaNet's state leak across packed documents; "
                           f"{target_path} is a causal LM without such layers: leave the flag out")
        target = load_target(target_path, dtype=dtype, device=device, **target_options)
        target_weights = f"checkpoint {target_path}"
    else:
        target = HybridTarget(target_path, dtype=dtype, **target_options).to(device)
        target_weights = f"random (seed {settings.seed})"
    drafter = DFlashDrafter.from_target(target, drafter_config)
    target.leak_across_documents = bool(settings.negative_control)
    return target, drafter, target_weights


def layout_rows(target: Any, runs: dict[str, dict[str, Any]], layer_ids: Sequence[int],
                tolerances: dict[str, float]) -> list[CheckRow]:
    """The padded and packed runs against the separate ones: every tapped layer, the loss and the gradients."""
    from harness.models.compare import max_relative_difference

    reference = runs["separate"]
    rows: list[CheckRow] = []
    for layout in ("padded", "packed"):
        comparison = f"{layout} vs separate"
        for i, layer in enumerate(layer_ids):
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
    return rows


def run_check(settings: CheckSettings) -> dict[str, Any]:
    """Build the models, run separate / padded / packed, and return the JSON-able report."""
    import torch

    from harness.models.anchors import FlatDocuments, sample_anchors
    from harness.models.kernel_libraries import fla_available
    from harness.models.layout import TokenBatch
    from harness.models.target import HybridTarget

    lengths = parse_lengths(settings.lengths)
    device = check_device(settings.device)
    precision = check_precision(settings, device)
    tolerances = TOLERANCES[precision]
    target, drafter, target_weights = build_models(settings, device)
    generator = torch.Generator().manual_seed(settings.seed)
    tokens, loss_masks = _documents(lengths, target.config.vocab_size, generator)
    packed = TokenBatch.from_documents(tokens, "packed", loss_masks).to(device)
    padded = TokenBatch.from_documents(tokens, "padded", loss_masks).to(device)
    anchors = sample_anchors(FlatDocuments.from_batch(packed), drafter.config.num_anchors,
                             torch.Generator().manual_seed(settings.seed + 1), block_size=drafter.config.block_size)
    runs = {
        "separate": _merge_separate([
            _run_layout(target, drafter, TokenBatch.from_documents([doc], "padded", [mask]).to(device), [doc_anchors],
                        settings.gdn_backend)
            for doc, mask, doc_anchors in zip(tokens, loss_masks, anchors)
        ]),
        "padded": _run_layout(target, drafter, padded, anchors, settings.gdn_backend),
        "packed": _run_layout(target, drafter, packed, anchors, settings.gdn_backend),
    }
    rows = layout_rows(target, runs, drafter.target_layer_ids, tolerances)
    blocks = int(runs["separate"]["loss"].block_count)
    notes = []
    if not blocks:
        notes.append("no document has an anchor: the drafter rows compare nothing; give longer --lengths")
    if not isinstance(target, HybridTarget):
        notes.append("fla vs torch-chunk skipped: the target has no Gated DeltaNet layers")
    elif device.type == "cuda" and fla_available():
        rows.extend(_fla_rows(target, drafter, packed, lengths, tolerances["fla"], settings.seed))
    else:
        notes.append("fla vs torch-chunk skipped: needs CUDA and flash-linear-attention")
    if device.type == "cuda":
        rows.extend(_drafter_attention_rows(target, drafter, packed, anchors, settings.gdn_backend, tolerances))
    if settings.negative_control:
        notes.append("negative control: GDN state leaks across packed documents; packed rows must fail")
    return {
        "ok": all(row.ok for row in rows), "device": str(device), "dtype": settings.dtype, "precision": precision,
        "seed": settings.seed, "gdn_backend": settings.gdn_backend,
        "drafter_attention": drafter.attention_backend(device), "target_weights": target_weights,
        "document_lengths": lengths, "blocks": blocks, "tolerances": tolerances,
        "checks": [row.to_dict() for row in rows], "notes": notes,
    }
