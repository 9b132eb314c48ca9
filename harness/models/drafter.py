"""The DFlash drafter: a few Qwen3 decoder layers that draft a block of tokens from target features.

Architecture (docs/design.md §7, after z-lab's DFlash model code; parameter names follow it so its
checkpoints map one to one):

* **Context.** The outputs of the tapped target layers are concatenated on the feature axis,
  projected by ``fc`` (no bias) to the hidden size and normalised (``hidden_norm``): computed once
  per forward pass and shared by every drafter layer.
* **Blocks.** One block of ``B`` slots per anchor ``a``: ``[token at a, MASK x (B - 1)]``, embedded
  with the target's (frozen) embeddings, at positions ``a .. a + B - 1``.
* **KV injection.** In every layer Q comes from the block only; K and V are the same ``k_proj`` /
  ``v_proj`` (with ``k_norm`` on K) applied to the context and to the block, concatenated. RoPE uses
  context positions for the context keys and block positions for the block. The context skips the
  layer's input norm and MLP. The attention is ``softmax`` over [visible context ; own block]: the
  context strictly before the block's anchor within its own document, and all ``B`` slots of its
  own block (bidirectional); blocks never see each other, and unused (padding) blocks see nothing.
* **Output.** The drafter's own final ``norm``, then the target's (frozen) LM head on slots
  ``1 .. B-1``; slot ``k`` predicts the token at ``a + k`` (:mod:`harness.models.anchors`).

The drafter works per document: a padded batch, a packed row and each document alone give the same
blocks and the same numbers. Two attention paths compute the same thing (``attention_backend``):
``dense`` (the CPU default) runs one document at a time, so memory grows with the largest
document's ``blocks x context`` scores, never with a packed row's ``T x T`` (docs/design.md §8);
``flex`` (the CUDA default) is one FlexAttention call with a block mask of the visibility rule,
fused on CUDA so that no score matrix is stored at all (at 27B scale the dense scores of one
8K-token document with 512 anchors would take gigabytes).

**MASK token.** ``mask_token_id`` names an existing token of the target's vocabulary, whose frozen
embedding is then used. When it is ``None`` the vocabulary is extended by one: the MASK token gets id
``vocab_size`` and its embedding is a drafter parameter (``mask_embedding``, initialised to the mean
of the target's embedding rows, trained with the drafter); the LM head keeps the target's vocabulary,
so MASK is never predicted.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
import yaml
from torch import nn
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm, Qwen3RotaryEmbedding, rotate_half

from harness.models import attention as attention_ops
from harness.models.anchors import (
    BlockLayout,
    FlatDocuments,
    block_input_ids,
    block_targets,
    build_block_layout,
    context_visible,
    sample_anchors,
)
from harness.models.drafter_loss import DrafterLoss, drafter_loss, resolve_loss_decay_gamma
from harness.models.layout import TokenBatch


DRAFTER_ATTENTION_BACKENDS = ("auto", "dense", "flex")


@dataclass
class DrafterConfig:
    """Shape and training knobs of the drafter; the hidden size and vocabulary come from the target."""

    num_hidden_layers: int = 1
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 16
    intermediate_size: int = 128
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    attention_bias: bool = False
    max_position_embeddings: int = 32768
    block_size: int = 16
    num_anchors: int = 512
    loss_decay_gamma: float | None = None  # None: 7 for B=16, 5 for B=10, 4 for B=8
    mask_token_id: int | None = None  # None: add a MASK token (id = target vocab size)
    target_layer_ids: list[int] | None = None  # None: build_target_layer_ids(n_target, num_hidden_layers)
    attention_backend: str = "auto"  # auto: flex on CUDA, dense elsewhere (see DFlashAttention)
    initializer_range: float = 0.02
    extra: dict[str, Any] = field(default_factory=dict, repr=False)

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
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.attention_backend not in DRAFTER_ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {DRAFTER_ATTENTION_BACKENDS}, got {self.attention_backend!r}"
            )
        if self.mask_token_id is not None and self.mask_token_id < 0:
            raise ValueError(f"mask_token_id must be >= 0 or null, got {self.mask_token_id}")
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


def _qwen3_config(config: DrafterConfig, hidden_size: int, vocab_size: int) -> Qwen3Config:
    """The transformers Qwen3 config whose building blocks (MLP, RMSNorm, RoPE) the drafter reuses."""
    return Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        hidden_act=config.hidden_act,
        rms_norm_eps=config.rms_norm_eps,
        max_position_embeddings=config.max_position_embeddings,
        attention_bias=config.attention_bias,
        rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta},
    )


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on ``x`` ``[..., heads, head_dim]`` with ``cos``/``sin`` ``[..., head_dim]``."""
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    return x * cos + rotate_half(x) * sin


@dataclass(frozen=True)
class _DocumentSlice:
    """The blocks of one document and the context positions they may see."""

    blocks: slice  # rows of the block tensors
    context: slice  # rows of the flat context (the document's positions 0 .. max anchor - 1)
    visible: torch.Tensor  # [nb, context_len] bool


@dataclass(frozen=True)
class _SharedLayerInputs:
    """What every drafter layer reads besides the block hidden states: the fused context and the layout."""

    context: torch.Tensor  # [N, D] fused context of every real token
    context_rope: tuple[torch.Tensor, torch.Tensor]  # cos, sin [N, head_dim] at in-document positions
    block_rope: tuple[torch.Tensor, torch.Tensor]  # cos, sin [NB, B, head_dim] at anchor + k
    documents: list[_DocumentSlice]  # documents that hold at least one block, in block order
    keep: torch.Tensor  # [NB] bool, False for padding blocks
    block_mask: Any = None  # FlexAttention BlockMask over [blocks x (context ; blocks)]; None: dense path


def _document_slices(documents: FlatDocuments, layout: BlockLayout) -> list[_DocumentSlice]:
    slices = []
    block_start = 0
    counts = layout.blocks_per_document.tolist()
    starts = documents.doc_starts.tolist()
    # Positions at or after a document's last kept anchor are never visible: leave them out altogether.
    kept_anchor = torch.where(layout.keep, layout.anchor, 0)
    context_lengths = torch.zeros_like(layout.blocks_per_document).scatter_reduce_(
        0, layout.doc_index, kept_anchor, reduce="amax"
    ).tolist()
    for doc, (n_blocks, context_len) in enumerate(zip(counts, context_lengths)):
        if n_blocks == 0:
            continue
        rows = slice(block_start, block_start + n_blocks)
        block_start += n_blocks
        anchor, keep = layout.anchor[rows], layout.keep[rows]
        slices.append(
            _DocumentSlice(
                blocks=rows,
                context=slice(starts[doc], starts[doc] + context_len),
                visible=context_visible(anchor, keep, context_len),
            )
        )
    return slices


class DFlashAttention(nn.Module):
    """Attention with KV injection: Q from the block, K/V from [context ; block] with shared projections."""

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scaling = self.head_dim**-0.5
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=bias)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def forward(self, block_hidden: torch.Tensor, shared: _SharedLayerInputs) -> torch.Tensor:
        """``block_hidden`` ``[NB, B, D]`` (already normed) and the shared context -> ``[NB, B, D]``."""
        context, keep = shared.context, shared.keep
        num_blocks, block_size, _ = block_hidden.shape
        groups = self.num_heads // self.num_kv_heads
        kv_shape = (self.num_kv_heads, self.head_dim)
        q = self.q_norm(self.q_proj(block_hidden).view(num_blocks, block_size, self.num_heads, self.head_dim))
        k_block = self.k_norm(self.k_proj(block_hidden).view(num_blocks, block_size, *kv_shape))
        v_block = self.v_proj(block_hidden).view(num_blocks, block_size, *kv_shape)
        k_context = self.k_norm(self.k_proj(context).view(-1, *kv_shape))
        v_context = self.v_proj(context).view(-1, *kv_shape)
        q, k_block = _rotate(q, *shared.block_rope), _rotate(k_block, *shared.block_rope)
        k_context = _rotate(k_context, *shared.context_rope)
        if shared.block_mask is not None:
            attended = self._flex(q, k_block, v_block, k_context, v_context, shared.block_mask)
            return self.o_proj(attended.reshape(num_blocks, block_size, self.num_heads * self.head_dim))
        # [NB, B, H, d] -> [NB, B, H_kv, groups, d]: query heads grouped by the key/value head they share.
        q = q.view(num_blocks, block_size, self.num_kv_heads, groups, self.head_dim) * self.scaling
        # Written by hand rather than with SDPA: each block attends to [its document's context prefix ;
        # its own B slots], which SDPA could only express with a dense (blocks x B) by
        # (context + blocks x B) mask. Scores against the own block are batched over all blocks.
        block_scores = torch.einsum("nbhgd,nchd->nbhgc", q, k_block)  # [NB, B, H_kv, g, B]
        outputs = []
        for doc in shared.documents:
            rows = doc.blocks
            q_doc = q[rows]
            context_scores = torch.einsum("nbhgd,thd->nbhgt", q_doc, k_context[doc.context])
            scores = torch.cat([context_scores, block_scores[rows]], dim=-1)
            scores = scores.to(torch.promote_types(scores.dtype, torch.float32))  # softmax in >= fp32
            visible = torch.cat(
                [doc.visible, keep[rows, None].expand(-1, block_size)], dim=-1
            )[:, None, None, None, :]
            # A finite fill keeps rows that see nothing (padding blocks) free of NaN; the product
            # with `visible` then zeroes them exactly.
            scores = scores.masked_fill(~visible, torch.finfo(scores.dtype).min)
            probs = (torch.softmax(scores, dim=-1) * visible).to(q.dtype)
            context_len = doc.visible.shape[1]
            out = torch.einsum("nbhgt,thd->nbhgd", probs[..., :context_len], v_context[doc.context])
            out = out + torch.einsum("nbhgc,nchd->nbhgd", probs[..., context_len:], v_block[rows])
            outputs.append(out)
        if outputs:
            attended = torch.cat(outputs, dim=0)
        else:
            attended = q.new_zeros(q.shape)
        return self.o_proj(attended.reshape(num_blocks, block_size, self.num_heads * self.head_dim))

    def _flex(self, q: torch.Tensor, k_block: torch.Tensor, v_block: torch.Tensor, k_context: torch.Tensor,
              v_context: torch.Tensor, block_mask: Any) -> torch.Tensor:
        """The same attention as one FlexAttention call: queries are all block slots, keys/values are
        [context ; all block slots], and ``block_mask`` (:func:`block_attention_mask`) admits exactly
        what the dense path admits. Scores are never materialised on CUDA (a fused kernel that skips
        fully masked tiles); on CPU FlexAttention runs unfused, so there the dense path is the default.
        """
        num_blocks, block_size = q.shape[:2]
        queries = q.reshape(num_blocks * block_size, self.num_heads, self.head_dim).transpose(0, 1)[None]
        keys = torch.cat([k_context, k_block.reshape(-1, self.num_kv_heads, self.head_dim)]).transpose(0, 1)[None]
        values = torch.cat([v_context, v_block.reshape(-1, self.num_kv_heads, self.head_dim)]).transpose(0, 1)[None]
        attend = attention_ops.flex_attention_kernel(q.device)
        out = attend(queries, keys, values, block_mask=block_mask, scale=self.scaling,
                     enable_gqa=self.num_heads != self.num_kv_heads)
        return out[0].transpose(0, 1)  # [NB * B, H, d]; rows that see nothing (padding blocks) are 0


def block_attention_mask(documents: FlatDocuments, layout: BlockLayout, device: torch.device) -> Any:
    """FlexAttention block mask of the drafter's attention (the rule of :func:`context_visible`).

    Queries: the ``NB * B`` block slots. Keys: the ``N`` context tokens, then the ``NB * B`` block
    slots. Slot ``q`` of block ``n`` sees context token ``t`` when ``t`` is in block ``n``'s document
    strictly before its anchor, and every slot of block ``n``; padding blocks see nothing.
    """
    from torch.nn.attention.flex_attention import create_block_mask

    num_tokens, num_blocks, block_size = documents.num_tokens, layout.num_blocks, layout.block_size
    block_slots = num_blocks * block_size
    block_of_slot = torch.arange(num_blocks, device=device).repeat_interleave(block_size)
    # Per key: document and position of a context token (-1 / 0 for block slots), and block of a
    # block slot (-1 for context tokens).
    key_document = torch.cat([documents.doc_of_token.to(device), torch.full((block_slots,), -1, device=device)])
    key_position = torch.cat([documents.position_in_document.to(device),
                              torch.zeros(block_slots, dtype=torch.long, device=device)])
    key_block = torch.cat([torch.full((num_tokens,), -1, device=device), block_of_slot])
    block_document, anchor, keep = (t.to(device) for t in (layout.doc_index, layout.anchor, layout.keep))

    def drafter_visible(batch, head, q_idx, kv_idx):  # noqa: ARG001 - FlexAttention's mask_mod signature
        block = block_of_slot[q_idx]
        in_context = (key_document[kv_idx] == block_document[block]) & (key_position[kv_idx] < anchor[block])
        return keep[block] & (in_context | (key_block[kv_idx] == block))

    return create_block_mask(drafter_visible, None, None, block_slots, num_tokens + block_slots, device=device,
                             _compile=device.type == "cuda")


class DFlashDecoderLayer(nn.Module):
    """A Qwen3 decoder layer whose attention also reads the shared context (which skips norm and MLP)."""

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        self.self_attn = DFlashAttention(config)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, block_hidden: torch.Tensor, shared: _SharedLayerInputs) -> torch.Tensor:
        """One pre-norm residual attention + MLP step on the block hidden states ``[NB, B, D]``."""
        attended = self.self_attn(self.input_layernorm(block_hidden), shared)
        block_hidden = block_hidden + attended
        return block_hidden + self.mlp(self.post_attention_layernorm(block_hidden))


@dataclass
class DrafterOutput:
    """Logits of slots ``1 .. B-1`` of every block, with their labels and the block layout."""

    logits: torch.Tensor  # [NB, B - 1, vocab]
    labels: torch.Tensor  # [NB, B - 1]
    label_valid: torch.Tensor  # [NB, B - 1] bool
    layout: BlockLayout
    anchors: list[torch.Tensor]  # per document, the anchors used


class DFlashDrafter(nn.Module):
    """DFlash drafter over a frozen target's embeddings and LM head (see the module docstring)."""

    def __init__(
        self,
        config: DrafterConfig,
        embed_tokens: nn.Embedding,
        lm_head: nn.Linear,
        num_target_layers: int,
    ) -> None:
        super().__init__()
        hidden_size = embed_tokens.embedding_dim
        if lm_head.in_features != hidden_size:
            raise ValueError(
                f"lm_head takes {lm_head.in_features} features but embed_tokens has {hidden_size}; "
                "pass the embeddings and LM head of the same target"
            )
        self.config = config
        self.hidden_size = hidden_size
        self.vocab_size = embed_tokens.num_embeddings
        self.block_size = config.block_size
        self.loss_decay_gamma = config.resolved_loss_decay_gamma
        self.target_layer_ids = self._resolve_target_layer_ids(config, num_target_layers)
        # The target's embeddings and LM head are used, never owned: kept outside the module tree (a
        # plain tuple is not registered), so they are not drafter parameters, not in its state dict,
        # and not moved by drafter.to(); they are frozen here.
        for module in (embed_tokens, lm_head):
            module.requires_grad_(False)
        self._target_io = (embed_tokens, lm_head)
        qwen3 = _qwen3_config(config, hidden_size, self.vocab_size)
        self.fc = nn.Linear(len(self.target_layer_ids) * hidden_size, hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(hidden_size, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashDecoderLayer(qwen3) for _ in range(config.num_hidden_layers))
        self.norm = Qwen3RMSNorm(hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(qwen3)
        self._inv_freq_fp32 = self.rotary_emb.inv_freq.detach().clone().float()
        if config.mask_token_id is None:
            self.mask_token_id = self.vocab_size
            mean_row = embed_tokens.weight.detach().float().mean(dim=0).to(embed_tokens.weight.dtype)
            self.mask_embedding = nn.Parameter(mean_row.clone())
        else:
            if config.mask_token_id >= self.vocab_size:
                raise ValueError(
                    f"mask_token_id={config.mask_token_id} is outside the target vocabulary of {self.vocab_size} "
                    "tokens; name an existing token or set mask_token_id to null to add one"
                )
            self.mask_token_id = config.mask_token_id
            self.mask_embedding = None
        self._init_weights(config.initializer_range)

    def _apply(self, fn: Any, recurse: bool = True) -> DFlashDrafter:
        # `.to(bfloat16)` would also round the rotary frequencies; keep them fp32 (cos/sin are
        # computed in fp32 and cast to the activations' dtype, as in transformers).
        super()._apply(fn, recurse)
        self.rotary_emb.inv_freq = self._inv_freq_fp32.to(self.rotary_emb.inv_freq.device)
        return self

    @classmethod
    def from_target(cls, target: nn.Module, config: DrafterConfig) -> DFlashDrafter:
        """Build a drafter over ``target`` (``.embed_tokens``, ``.lm_head``, ``.config.num_hidden_layers``)."""
        drafter = cls(config, target.embed_tokens, target.lm_head, target.config.num_hidden_layers)
        return drafter.to(device=target.embed_tokens.weight.device, dtype=target.embed_tokens.weight.dtype)

    @staticmethod
    def _resolve_target_layer_ids(config: DrafterConfig, num_target_layers: int) -> list[int]:
        if config.target_layer_ids is not None:
            layer_ids = [int(i) for i in config.target_layer_ids]
        else:
            from harness.models.config import build_target_layer_ids

            layer_ids = list(build_target_layer_ids(num_target_layers, config.num_hidden_layers))
        if not layer_ids or any(not 0 <= i < num_target_layers for i in layer_ids):
            raise ValueError(
                f"target_layer_ids={layer_ids} must be a non-empty list of target layers in "
                f"[0, {num_target_layers - 1}] (the target has {num_target_layers} layers)"
            )
        return layer_ids

    def _init_weights(self, std: float) -> None:
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, mean=0.0, std=std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)

    def attention_backend(self, device: torch.device) -> str:
        """The attention path on ``device``: ``flex`` (CUDA default) or ``dense`` (CPU default).

        ``auto`` keeps the dense path for head dims under 16, which FlexAttention's CUDA kernel does
        not take.
        """
        backend = self.config.attention_backend
        if backend == "auto":
            return "flex" if device.type == "cuda" and self.config.head_dim >= 16 else "dense"
        if (backend == "flex" and device.type != "cuda" and torch.is_grad_enabled()
                and any(p.requires_grad for p in self.parameters())):
            raise ValueError(
                f"attention_backend='flex' cannot train on {device.type}: FlexAttention has no backward "
                "off CUDA; use attention_backend 'dense' (or 'auto'), or run under torch.no_grad()"
            )
        return backend

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self._target_io[0]

    @property
    def lm_head(self) -> nn.Linear:
        return self._target_io[1]

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Target embeddings, with the drafter's own MASK row when MASK was added to the vocabulary."""
        if self.mask_embedding is None:
            return self.embed_tokens(token_ids)
        is_mask = token_ids == self.mask_token_id
        embedded = self.embed_tokens(token_ids.masked_fill(is_mask, 0))
        return torch.where(is_mask[..., None], self.mask_embedding.to(embedded.dtype), embedded)

    def fuse_context(self, documents: FlatDocuments, target_hidden_states: Sequence[torch.Tensor]) -> torch.Tensor:
        """``[N, D]`` context of every real token: ``hidden_norm(fc(cat(tapped layers)))``."""
        gathered = [documents.gather(states) for states in target_hidden_states]
        fused = torch.cat(gathered, dim=-1).to(self.fc.weight.dtype)
        return self.hidden_norm(self.fc(fused))

    def _check_inputs(self, batch: TokenBatch, target_hidden_states: Any) -> list[torch.Tensor]:
        layer_ids = getattr(target_hidden_states, "layer_ids", None)
        if layer_ids is not None and list(layer_ids) != self.target_layer_ids:
            raise ValueError(
                f"target features are from layers {list(layer_ids)} but the drafter taps "
                f"{self.target_layer_ids}; run the target with tap_layer_ids=drafter.target_layer_ids"
            )
        states = list(getattr(target_hidden_states, "hidden_states", target_hidden_states))
        if len(states) != len(self.target_layer_ids):
            raise ValueError(
                f"got {len(states)} tapped target layers but the drafter taps {len(self.target_layer_ids)} "
                f"({self.target_layer_ids})"
            )
        expected = (*batch.input_ids.shape, self.hidden_size)
        for i, states_i in enumerate(states):
            if tuple(states_i.shape) != expected:
                raise ValueError(
                    f"target_hidden_states[{i}] has shape {tuple(states_i.shape)}, expected {expected} "
                    "(the batch's input_ids shape and the target hidden size)"
                )
        return states

    def _check_token_ids(self, documents: FlatDocuments) -> None:
        ids = documents.token_ids  # real tokens only: pad ids may be anything
        bad = (ids < 0) | (ids >= self.vocab_size)
        if bool(bad.any()):
            index = int(torch.nonzero(bad)[0])
            doc = int(documents.doc_of_token[index])
            raise ValueError(
                f"token id {int(ids[index])} at position {index - int(documents.doc_starts[doc])} of document "
                f"{doc} is outside the target vocabulary [0, {self.vocab_size}); tokenize with the target's tokenizer"
            )

    def forward(
        self,
        batch: TokenBatch,
        target_hidden_states: Any,
        anchors: Sequence[torch.Tensor] | None = None,
        generator: torch.Generator | None = None,
        blocks_per_document: int | None = None,
    ) -> DrafterOutput:
        """Draft every block of ``batch`` and return the logits of slots ``1 .. B-1`` with labels.

        ``target_hidden_states`` is the target's ``TargetFeatures`` (or a list of tapped layer
        outputs, each shaped like ``input_ids`` plus the hidden size). Anchors are ``anchors`` (one
        tensor of in-document positions per document) or else drawn with ``generator`` (the run's
        RNG, a fresh draw every step). ``blocks_per_document`` pads each document with unused blocks.
        """
        states = self._check_inputs(batch, target_hidden_states)
        documents = FlatDocuments.from_batch(batch)
        self._check_token_ids(documents)
        if anchors is None:
            if generator is None:
                raise ValueError("give anchors (one tensor per document) or a torch.Generator to draw them")
            anchors = sample_anchors(documents, self.config.num_anchors, generator)
        layout = build_block_layout(documents, anchors, self.block_size, blocks_per_document)
        context = self.fuse_context(documents, states)
        hidden = self.embed(block_input_ids(documents, layout, self.mask_token_id)).to(self.fc.weight.dtype)
        use_flex = self.attention_backend(context.device) == "flex" and layout.num_blocks > 0
        shared = _SharedLayerInputs(
            context=context,
            context_rope=tuple(r[0] for r in self.rotary_emb(context, documents.position_in_document[None])),
            block_rope=self.rotary_emb(hidden, layout.slot_positions()),
            documents=[] if use_flex else _document_slices(documents, layout),
            keep=layout.keep,
            block_mask=block_attention_mask(documents, layout, context.device) if use_flex else None,
        )
        for layer in self.layers:
            hidden = layer(hidden, shared)
        logits = self.lm_head(self.norm(hidden[:, 1:]).to(self.lm_head.weight.dtype))
        targets = block_targets(documents, layout)
        return DrafterOutput(logits, targets.labels, targets.valid, layout, [a.clone() for a in anchors])

    def loss(self, output: DrafterOutput) -> DrafterLoss:
        """Decayed CE, accuracy and τ sums of ``output`` (see :mod:`harness.models.drafter_loss`).

        Every trainable parameter is in the graph of ``weighted_ce_sum``, even for a micro-batch with
        no block at all (documents too short, or no loss-masked token): its gradient is then zero rather
        than absent, so data-parallel gradient reduction sees the same parameters on every rank.
        """
        result = drafter_loss(output.logits, output.labels, output.label_valid, output.layout.keep,
                              self.loss_decay_gamma)
        if output.layout.num_blocks == 0 and torch.is_grad_enabled():
            trainable = [p for p in self.parameters() if p.requires_grad]
            if trainable:
                zero = torch.stack([p.reshape(-1)[:1].sum() for p in trainable]).sum() * 0.0
                result = dataclasses.replace(result, weighted_ce_sum=result.weighted_ce_sum + zero.to(
                    result.weighted_ce_sum.dtype))
        return result

    def compute_loss(
        self,
        batch: TokenBatch,
        target_hidden_states: Any,
        anchors: Sequence[torch.Tensor] | None = None,
        generator: torch.Generator | None = None,
        blocks_per_document: int | None = None,
    ) -> DrafterLoss:
        """``forward`` then ``loss``: the numerator/denominator sums of one micro-batch."""
        return self.loss(self.forward(batch, target_hidden_states, anchors, generator, blocks_per_document))
