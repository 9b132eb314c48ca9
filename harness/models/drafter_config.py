"""The drafter's configuration: shape and training knobs (``conf/drafter/*.yaml``).

The hidden size and vocabulary come from the target. ``load_drafter_config`` rejects unknown keys.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from harness.models.drafter_loss import resolve_loss_decay_gamma


DRAFTER_ATTENTION_BACKENDS = ("auto", "sdpa", "dense", "flex")


@dataclass
class DrafterConfig:
    """Shape and training knobs of the drafter; the hidden size and vocabulary come from the target."""

    num_hidden_layers: int = 1
    """Decoder layers of the drafter."""
    num_attention_heads: int = 4
    """Attention heads (a multiple of ``num_key_value_heads``)."""
    num_key_value_heads: int = 2
    """Key and value heads (grouped-query attention)."""
    head_dim: int = 16
    """Dimension of each attention head (even, for the rotary embeddings)."""
    intermediate_size: int = 128
    """Width of the MLP."""
    hidden_act: str = "silu"
    """The MLP's activation function."""
    rms_norm_eps: float = 1e-6
    """Epsilon of the RMS norms."""
    rope_theta: float = 1_000_000.0
    """Base of the rotary position embeddings."""
    attention_bias: bool = False
    """Bias in the query, key, value and output projections."""
    max_position_embeddings: int = 32768
    """Longest position the rotary embeddings cover."""
    block_size: int = 16
    """Tokens per draft block: the anchor, then the slots predicted after it (at least 2)."""
    num_anchors: int = 512
    """The most anchor positions drawn per document (uniformly among its candidates, seeded per sample)."""
    loss_decay_gamma: float | None = None
    """Decay of the loss weight along a block's slots; null: 7 for block_size 16, 5 for 10, 4 for 8."""
    mask_token_id: int | None = None
    """Id of the MASK token in the predicted slots; null: add one (id = the target's vocabulary size)."""
    target_layer_ids: list[int] | None = None
    """Target layers whose hidden states feed the drafter; null: DFlash's rule, evenly spaced from 1 to n-3.

    ``harness.models.config.build_target_layer_ids(n_target, num_hidden_layers)``.
    """
    attention_backend: str = "auto"
    """The drafter's attention kernel: ``auto`` (flex on CUDA, sdpa elsewhere), ``sdpa``, ``dense`` or ``flex``.

    ``dense`` is the reference implementation (see ``DFlashAttention``).
    """
    initializer_range: float = 0.02
    """Standard deviation of the drafter's weight initialisation."""
    max_blocks: int | None = None
    """Cap on the blocks of one micro-batch (a memory bound); null: no cap.

    The kept blocks are those with the smallest anchor keys over the micro-batch (``drafter_inputs.py``).
    """
    loss_chunk_blocks: int = 256
    """Blocks per chunk of the LM head and cross-entropy (the logits of one chunk at a time bound memory)."""
    draft_vocab_size: int | None = None
    """The head predicts only this many of the target's tokens, the training data's most frequent labels.

    ``harness.models.draft_vocab``; EAGLE-3's and SpecForge's d2t/t2d. Null: the whole vocabulary.
    """
    distill_weight: float = 0.0
    """α: each slot's label is (1 - α)·the token + α·the target's next-token distribution; 0: hard labels.

    Soft labels are EAGLE's practice: the target's final norm and LM head over its last layer, which
    ``target_layer_ids`` must tap; 0 gives DFlash's hard labels. Training only: the held-out loss stays the hard
    labels' cross-entropy.
    """
    extra: dict[str, Any] = field(default_factory=dict, repr=False)
    """Unknown keys given to :func:`load_drafter_config`; any is refused, naming the known keys (not a config key)."""

    def __post_init__(self) -> None:
        if self.extra:
            raise ValueError(f"unknown drafter config keys {sorted(self.extra)}; known keys: {config_keys()}")
        if self.block_size < 2:
            raise ValueError(
                "block_size must be at least 2 (slot 0 holds the anchor, slots 1.. are predicted), "
                f"got {self.block_size}"
            )
        for name in ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                     "intermediate_size", "num_anchors"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.draft_vocab_size is not None and self.draft_vocab_size < 1:
            raise ValueError(f"draft_vocab_size={self.draft_vocab_size}: give at least 1, or null for the target's "
                             "whole vocabulary")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.attention_backend not in DRAFTER_ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {DRAFTER_ATTENTION_BACKENDS}, got {self.attention_backend!r}"
            )
        if self.max_blocks is not None and (isinstance(self.max_blocks, bool) or int(self.max_blocks) < 1):
            raise ValueError(f"max_blocks must be at least 1 or null (no cap), got {self.max_blocks}")
        if isinstance(self.loss_chunk_blocks, bool) or int(self.loss_chunk_blocks) < 1:
            raise ValueError(f"loss_chunk_blocks must be at least 1, got {self.loss_chunk_blocks}")
        if self.mask_token_id is not None and self.mask_token_id < 0:
            raise ValueError(f"mask_token_id must be >= 0 or null, got {self.mask_token_id}")
        if isinstance(self.distill_weight, bool) or not 0.0 <= float(self.distill_weight) <= 1.0:
            raise ValueError(f"distill_weight must be in [0, 1] (0: hard labels only), got {self.distill_weight}")
        resolve_loss_decay_gamma(self.block_size, self.loss_decay_gamma)

    @property
    def resolved_loss_decay_gamma(self) -> float:
        return resolve_loss_decay_gamma(self.block_size, self.loss_decay_gamma)

    def to_dict(self) -> dict[str, Any]:
        values = asdict(self)
        values.pop("extra")
        return values


def config_keys() -> list[str]:
    """Keys a drafter YAML may hold."""
    return [f.name for f in fields(DrafterConfig) if f.name != "extra"]


def load_drafter_config(path_or_dict: str | Path | Mapping[str, Any]) -> DrafterConfig:
    """Read a drafter config from a YAML file (e.g. ``conf/drafter/tiny.yaml``) or a mapping."""
    if isinstance(path_or_dict, Mapping):
        values = dict(path_or_dict)
    else:
        path = Path(path_or_dict)
        if not path.is_file():
            raise FileNotFoundError(f"drafter config {str(path)!r} does not exist; try conf/drafter/tiny.yaml")
        values = yaml.safe_load(path.read_text()) or {}
        if not isinstance(values, dict):
            raise ValueError(f"drafter config {str(path)!r} must be a mapping of keys to values")
    known = set(config_keys())
    extra = {key: values.pop(key) for key in list(values) if key not in known}
    return DrafterConfig(**values, extra=extra)
