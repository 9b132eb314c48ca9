"""The frozen Qwen3.5-style hybrid target (Gated DeltaNet + gated full attention) that feeds the drafter.

:class:`HybridTarget` computes the outputs of chosen decoder layers (DFlash's tapped layers) for a
:class:`~harness.models.layout.TokenBatch` in either layout: no logits, no layers past the last tapped
one, no autograd graph. For evaluation, :meth:`HybridTarget.logits` runs every layer, the final norm
and the LM head (still without autograd; :meth:`HybridTarget.compute_logits` is the same computation
with autograd, for pretraining the target). Documents never see each other:

* padded ``[B, L]`` rows: attention with a causal + key-padding mask, and the linear (GDN) layers zero
  the padded positions before mixing (transformers' ``apply_mask_to_padding_states``), so right (and
  left) padding matches running each document alone;
* a packed ``[1, T]`` row: the GDN recurrence and its short conv restart at every ``cu_seqlens``
  boundary (:func:`~harness.models.gdn.gated_delta.gated_delta_rule`,
  :func:`~harness.models.gdn.short_conv.causal_conv1d`) and attention is per document
  (:func:`~harness.models.attention.document_causal_attention`) with RoPE from the per-document
  ``position_ids``.

Parameter names and math are those of transformers' ``Qwen3_5ForCausalLM``: the token mixers subclass
transformers' ``Qwen3_5GatedDeltaNet`` / ``Qwen3_5Attention`` (their ``__init__`` defines the exact
parameter names and shapes; only ``forward`` is replaced, to add the packed layout), and the norms,
MLP and rotary embedding are transformers' own modules. A transformers state dict, or a local Hugging
Face checkpoint directory (:meth:`HybridTarget.from_pretrained`), loads without renaming.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn
from transformers import Qwen3_5TextConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import (
    Qwen3_5Attention,
    Qwen3_5GatedDeltaNet,
    Qwen3_5MLP,
    Qwen3_5RMSNorm,
    Qwen3_5TextRotaryEmbedding,
    apply_rotary_pos_emb,
)

from harness.models.attention import document_causal_attention
from harness.models.config import build_target_layer_ids, check_tap_layer_ids, load_target_config
from harness.models.gdn.gated_delta import gated_delta_rule
from harness.models.layout import PackedDocuments, TokenBatch
from harness.models.gdn.short_conv import causal_conv1d

__all__ = ["HybridTarget", "TargetFeatures", "checked_input_ids"]


@dataclass
class TargetFeatures:
    """Outputs of tapped target layers: ``hidden_states[i]`` is the output of decoder layer ``layer_ids[i]``.

    Each tensor has the batch's token shape plus the hidden size: ``[B, L, D]`` (padded) or
    ``[1, T, D]`` (packed). It equals transformers' ``output_hidden_states[layer_ids[i] + 1]`` (for the
    model's last layer, transformers applies the final norm there; this does not).
    """

    layer_ids: list[int]
    hidden_states: list[torch.Tensor]

    def concatenated(self) -> torch.Tensor:
        """The tapped outputs joined on the feature axis, ``[..., len(layer_ids) * D]`` (DFlash's ``fc`` input)."""
        return torch.cat(self.hidden_states, dim=-1)


class GatedDeltaNetMixer(Qwen3_5GatedDeltaNet):
    """transformers' Qwen3.5 Gated DeltaNet layer with a forward that also takes packed rows."""

    def forward(  # type: ignore[override]
        self,
        hidden_states: torch.Tensor,
        *,
        padding_mask: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | PackedDocuments | None = None,
        gdn_backend: str = "auto",
    ) -> torch.Tensor:
        """Mix ``[B, L, D]`` hidden states; ``padding_mask`` ``[B, L]`` zeroes pads, ``cu_seqlens`` splits documents."""
        if padding_mask is not None:
            hidden_states = (hidden_states * padding_mask[:, :, None]).to(hidden_states.dtype)
        batch, length, _ = hidden_states.shape
        mixed_qkv = causal_conv1d(
            self.in_proj_qkv(hidden_states), self.conv1d.weight, self.conv1d.bias,
            activation=self.activation, cu_seqlens=cu_seqlens,
        )
        query, key, value = torch.split(mixed_qkv, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        query = query.reshape(batch, length, -1, self.head_k_dim)
        key = key.reshape(batch, length, -1, self.head_k_dim)
        value = value.reshape(batch, length, -1, self.head_v_dim)
        z = self.in_proj_z(hidden_states).reshape(-1, self.head_v_dim)
        beta = self.in_proj_b(hidden_states).sigmoid()
        # fp32 decay, as transformers does (A_log.exp() may overflow in half precision)
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(hidden_states).float() + self.dt_bias)
        core, _ = gated_delta_rule(
            query, key, value, g, beta, use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens, backend=gdn_backend,
        )
        core = self.norm(core.reshape(-1, self.head_v_dim), z).reshape(batch, length, -1)
        return self.out_proj(core)


class GatedAttentionMixer(Qwen3_5Attention):
    """transformers' Qwen3.5 gated full attention with a forward that keeps documents apart."""

    def forward(  # type: ignore[override]
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        *,
        attention_mask: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | PackedDocuments | None = None,
        attention_backend: str = "auto",
    ) -> torch.Tensor:
        """Attend within documents; ``position_embeddings`` are (cos, sin) ``[B, L, rotary_dim]``."""
        input_shape = hidden_states.shape[:-1]
        query, gate = torch.chunk(
            self.q_proj(hidden_states).view(*input_shape, -1, self.head_dim * 2), 2, dim=-1
        )
        gate = gate.reshape(*input_shape, -1)
        query = self.q_norm(query)
        key = self.k_norm(self.k_proj(hidden_states).view(*input_shape, -1, self.head_dim))
        value = self.v_proj(hidden_states).view(*input_shape, -1, self.head_dim)
        cos, sin = position_embeddings
        query, key = apply_rotary_pos_emb(query, key, cos, sin, unsqueeze_dim=2)  # [B, L, H, hd] layout
        out = document_causal_attention(
            query, key, value, attention_mask=attention_mask, cu_seqlens=cu_seqlens, scale=self.scaling,
            backend=attention_backend,
        )
        out = out.reshape(*input_shape, -1) * torch.sigmoid(gate)
        return self.o_proj(out)


class Fp32RotaryEmbedding(Qwen3_5TextRotaryEmbedding):
    """transformers' rotary embedding whose inverse frequencies stay fp32 when the model is cast.

    ``model.to(torch.bfloat16)`` would otherwise round ``inv_freq`` to bf16 (relative error up to 2**-9),
    shifting RoPE angles by up to ~5 rad at position 4096 on the 27B config; transformers keeps them in
    fp32 when it loads a model in bf16, and so must we. Device moves still apply.
    """

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Fp32RotaryEmbedding:
        exact = dict(self.named_buffers(recurse=False))
        super()._apply(fn, recurse)
        for name, before in exact.items():
            after = getattr(self, name)
            if after is not None and after.dtype != before.dtype:
                setattr(self, name, before.to(after.device))
        return self


class HybridDecoderLayer(nn.Module):
    """One pre-norm decoder layer: a token mixer (GDN or attention) then the SwiGLU MLP, both residual."""

    def __init__(self, config: Qwen3_5TextConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_type = config.layer_types[layer_idx]
        if self.layer_type == "linear_attention":
            self.linear_attn = GatedDeltaNetMixer(config, layer_idx)
        else:
            self.self_attn = GatedAttentionMixer(config, layer_idx)
        self.mlp = Qwen3_5MLP(config, config.intermediate_size)
        self.input_layernorm = Qwen3_5RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3_5RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(
        self,
        hidden_states: torch.Tensor,
        *,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None,
        attention_mask: torch.Tensor | None,
        padding_mask: torch.Tensor | None,
        cu_seqlens: PackedDocuments | None,
        linear_cu_seqlens: PackedDocuments | None,
        gdn_backend: str,
        attention_backend: str,
    ) -> torch.Tensor:
        """Apply the layer; linear layers read ``linear_cu_seqlens``, attention layers ``cu_seqlens``."""
        normed = self.input_layernorm(hidden_states)
        if self.layer_type == "linear_attention":
            mixed = self.linear_attn(
                normed, padding_mask=padding_mask, cu_seqlens=linear_cu_seqlens, gdn_backend=gdn_backend
            )
        else:
            mixed = self.self_attn(
                normed, position_embeddings, attention_mask=attention_mask, cu_seqlens=cu_seqlens,
                attention_backend=attention_backend,
            )
        hidden_states = hidden_states + mixed
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class HybridTextModel(nn.Module):
    """Embeddings, decoder layers and final norm, under transformers' names (``model.*`` in a checkpoint)."""

    def __init__(self, config: Qwen3_5TextConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList(HybridDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = Qwen3_5RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = Fp32RotaryEmbedding(config=config)


class HybridTarget(nn.Module):
    """Frozen Qwen3.5-style hybrid target that returns the outputs of its tapped layers.

    Args:
        config: a ``Qwen3_5TextConfig``, or anything :func:`~harness.models.config.load_target_config`
            takes (a ``conf/target/*.yaml`` path, a dict, a checkpoint directory).
        tap_layer_ids: default layers to tap; if None, DFlash's rule for ``num_draft_layers``.
        num_draft_layers: drafter depth used by the default tap rule.
        dtype: parameter dtype (fp32 by default; bf16 is the GPU choice; RoPE frequencies stay fp32).
        attention_backend: packed-row attention kernel (``auto``, ``sdpa``, ``flex``, ``flash``).

    All parameters are frozen (``requires_grad=False``) and the module stays in eval mode.
    ``embed_tokens`` and ``lm_head`` are exposed for the drafter, which shares them.
    """

    def __init__(
        self,
        config: Qwen3_5TextConfig | str | Path | Mapping[str, Any],
        *,
        tap_layer_ids: Sequence[int] | None = None,
        num_draft_layers: int = 1,
        dtype: torch.dtype | None = None,
        attention_backend: str = "auto",
    ) -> None:
        super().__init__()
        self.config = load_target_config(config)
        self.model = HybridTextModel(self.config)
        self.lm_head = nn.Linear(self.config.hidden_size, self.config.vocab_size, bias=False)
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        n_layers = self.config.num_hidden_layers
        self.tap_layer_ids = (
            build_target_layer_ids(n_layers, num_draft_layers)
            if tap_layer_ids is None
            else check_tap_layer_ids(tap_layer_ids, n_layers)
        )
        self.attention_backend = attention_backend
        # Negative control (`batchlab-check --negative-control`, tests): when True the linear layers
        # ignore cu_seqlens, so GDN state and the short conv leak across the documents of a packed row,
        # as in implementations without document isolation. Never set it for training.
        self.leak_across_documents = False
        self.requires_grad_(False)
        self.eval()
        if dtype is not None:
            self.to(dtype)

    # ----------------------------------------------------------------- accessors for the drafter
    @property
    def embed_tokens(self) -> nn.Embedding:
        """The (frozen) token embedding, shared with the drafter."""
        return self.model.embed_tokens

    @property
    def num_layers(self) -> int:
        """Number of decoder layers."""
        return self.config.num_hidden_layers

    @property
    def hidden_size(self) -> int:
        """Width of every tapped feature."""
        return self.config.hidden_size

    @property
    def device(self) -> torch.device:
        """Device of the parameters."""
        return self.model.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """dtype of the parameters (and of the returned features)."""
        return self.model.embed_tokens.weight.dtype

    def train(self, mode: bool = True) -> HybridTarget:
        """The target is frozen: it always stays in eval mode whatever ``mode`` says."""
        return super().train(False)

    # ----------------------------------------------------------------- forward
    @torch.no_grad()
    def forward(
        self,
        batch: TokenBatch,
        tap_layer_ids: Sequence[int] | None = None,
        gdn_backend: str = "auto",
    ) -> TargetFeatures:
        """Outputs of the tapped decoder layers for ``batch`` (padded or packed), without gradients.

        Args:
            batch: a :class:`TokenBatch`; moved to the model's device if needed.
            tap_layer_ids: decoder layers to return, in this order (repeats allowed); default
                ``self.tap_layer_ids``. Layers after the deepest one are not run.
            gdn_backend: backend of the gated delta rule (``auto``, ``torch-chunk``,
                ``torch-recurrent``, ``fla``).

        Raises:
            ValueError: a real token id outside ``[0, vocab_size)`` (naming its position and value),
                a tap id outside the model, or ``cu_seqlens`` not running from 0 to T.
        """
        layer_ids = check_tap_layer_ids(self.tap_layer_ids if tap_layer_ids is None else tap_layer_ids,
                                        self.num_layers)
        _, outputs = self._run_layers(batch, set(layer_ids), max(layer_ids), gdn_backend)
        return TargetFeatures(layer_ids=layer_ids, hidden_states=[outputs[i] for i in layer_ids])

    @torch.no_grad()
    def logits(self, batch: TokenBatch, gdn_backend: str = "auto") -> torch.Tensor:
        """Next-token logits ``[B, L, V]`` (padded) or ``[1, T, V]`` (packed), without gradients.

        Every decoder layer, then the final norm and the LM head: the evaluation path (speculative
        decoding's verifier, held-out perplexity). Logits at pad positions are computed but mean
        nothing. :meth:`forward`, the drafter's training path, still stops at the deepest tap.
        """
        return self.compute_logits(batch, gdn_backend)

    @property
    def final_norm(self) -> nn.Module:
        """The norm between the last decoder layer and the LM head."""
        return self.model.norm

    def next_token_logits(self, last_hidden: torch.Tensor) -> torch.Tensor:
        """Logits from the last decoder layer's output (the final norm, then the LM head)."""
        return self.lm_head(self.final_norm(last_hidden))

    def compute_logits(self, batch: TokenBatch, gdn_backend: str = "auto") -> torch.Tensor:
        """:meth:`logits` without ``no_grad``: records autograd for parameters that require grad.

        For pretraining the target itself (:mod:`harness.pretrain`), which first calls
        ``requires_grad_(True)``; the frozen target never needs it.
        """
        hidden, _ = self._run_layers(batch, set(), self.num_layers - 1, gdn_backend)
        return self.lm_head(self.model.norm(hidden))

    def _run_layers(
        self, batch: TokenBatch, wanted: set[int], deepest: int, gdn_backend: str
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Run decoder layers ``0..deepest``; return the last output and the outputs of ``wanted`` layers."""
        if batch.input_ids.device != self.device:
            batch = batch.to(self.device)
        input_ids = checked_input_ids(batch, self.config.vocab_size)
        packed = batch.cu_seqlens is not None
        cu_seqlens = None
        if packed:  # built once here; every layer shares it (and what it caches). A batch built by
            # TokenBatch.from_documents carries its host copy (no check, no device read); a raw one is checked.
            cu_seqlens = batch.packed_documents()
        padding_mask = None
        attention_mask = None
        if not packed:
            attention_mask = batch.attention_mask
            # Always applied (times 1 is exact where there is no padding): asking whether the batch has
            # padding would read the mask back to the host.
            padding_mask = attention_mask.to(self.dtype)
        linear_cu_seqlens = None if self.leak_across_documents else cu_seqlens

        hidden = self.model.embed_tokens(input_ids)
        position_embeddings = None
        if "full_attention" in self.config.layer_types[: deepest + 1]:
            # Text positions on all three mRoPE axes, [3, B, L]: the one form every supported transformers
            # release takes (docs/design/target-and-drafter.md).
            position_embeddings = self.model.rotary_emb(hidden, batch.position_ids[None].expand(3, -1, -1))
        outputs: dict[int, torch.Tensor] = {}
        for index, layer in enumerate(self.model.layers[: deepest + 1]):
            hidden = layer(
                hidden,
                position_embeddings=position_embeddings,
                attention_mask=attention_mask,
                padding_mask=padding_mask,
                cu_seqlens=cu_seqlens,
                linear_cu_seqlens=linear_cu_seqlens,
                gdn_backend=gdn_backend,
                attention_backend=self.attention_backend,
            )
            if index in wanted:
                outputs[index] = hidden
        return hidden, outputs

    # ----------------------------------------------------------------- loading
    @classmethod
    def from_pretrained(
        cls,
        directory: str | Path,
        *,
        dtype: torch.dtype | None = None,
        device: str | torch.device | None = None,
        tap_layer_ids: Sequence[int] | None = None,
        num_draft_layers: int = 1,
        attention_backend: str = "auto",
    ) -> HybridTarget:
        """Load a local Hugging Face checkpoint directory (config.json + safetensors, sharded or not).

        Accepts ``Qwen3_5ForCausalLM`` checkpoints (``model.*``, ``lm_head.*``) and multimodal
        ``Qwen3_5ForConditionalGeneration`` ones (``model.language_model.*``; vision and MTP weights are
        ignored). ``dtype`` defaults to bf16 on CUDA and fp32 elsewhere; ``device`` to CPU. The model is
        built on the meta device and the tensors are assigned as read, so nothing is allocated twice.
        """
        directory = Path(directory)
        device = torch.device(device if device is not None else "cpu")
        if dtype is None:
            dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        config = load_target_config(directory)
        with torch.device("meta"):
            model = cls(config, tap_layer_ids=tap_layer_ids, num_draft_layers=num_draft_layers,
                        attention_backend=attention_backend)
        state = _read_checkpoint_state(directory, device, dtype)
        tied = config.tie_word_embeddings
        if tied:
            state.pop("lm_head.weight", None)
        expected = set(model.state_dict())
        missing = sorted(expected - set(state) - ({"lm_head.weight"} if tied else set()))
        unexpected = sorted(set(state) - expected)
        if missing or unexpected:
            raise ValueError(
                f"checkpoint {directory} does not match the Qwen3.5 text model of its config.json: "
                f"missing {missing[:8]}{' ...' if len(missing) > 8 else ''}, "
                f"unexpected {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}"
            )
        model.load_state_dict(state, strict=False, assign=True)
        if tied:
            model.lm_head.weight = model.model.embed_tokens.weight
        # non-persistent rotary buffers were created on the meta device
        model.model.rotary_emb = Fp32RotaryEmbedding(config=config).to(device)
        model.requires_grad_(False)
        return model.eval()


def checked_input_ids(batch: TokenBatch, vocab_size: int) -> torch.Tensor:
    """Token ids with pads replaced by 0; raise on a real token id outside ``[0, vocab_size)``, naming it."""
    input_ids = batch.input_ids
    real = None if batch.attention_mask is None else batch.attention_mask.bool()
    known = batch.token_id_range
    if known is not None and 0 <= known[0] and known[1] < vocab_size:
        # ids checked on the host when the batch was built: nothing to read back
        return input_ids if real is None else input_ids.masked_fill(~real, 0)
    bad = (input_ids < 0) | (input_ids >= vocab_size)
    if real is not None:
        bad &= real
    if bool(bad.any()):
        row, col = (int(x) for x in torch.nonzero(bad)[0])
        raise ValueError(
            f"input_ids[{row}, {col}]={int(input_ids[row, col])} is not a token id: the target's vocabulary "
            f"is 0..{vocab_size - 1} (vocab_size={vocab_size}); tokenize with the target's tokenizer"
        )
    if real is not None:
        input_ids = input_ids.masked_fill(~real, 0)
    return input_ids


def _rename_checkpoint_key(name: str) -> str | None:
    """Map a checkpoint tensor name to this model's name; None for tensors the target does not use."""
    if name.startswith(("mtp.", "model.visual.", "visual.", "model.mtp.")):
        return None
    if name.startswith("model.language_model."):
        return "model." + name[len("model.language_model."):]
    return name


def _checkpoint_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [directory / name for name in sorted(set(weight_map.values()))]
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"no *.safetensors in {directory}; save the checkpoint with safetensors "
            "(save_pretrained(..., safe_serialization=True))"
        )
    return files


def _read_checkpoint_state(directory: Path, device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for path in _checkpoint_files(directory):
        with safe_open(str(path), framework="pt", device=str(device)) as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open handles are not iterable
                target_name = _rename_checkpoint_key(name)
                if target_name is None:
                    continue
                tensor = handle.get_tensor(name)
                state[target_name] = tensor.to(dtype) if tensor.is_floating_point() else tensor
    return state
