"""The DFlash drafter: a few Qwen3 decoder layers that draft a block of tokens from target features.

Architecture (docs/design/target-and-drafter.md, after z-lab's DFlash model code; parameter names follow it so its
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
blocks and the same numbers. Three attention paths compute the same thing (``attention_backend``):
``sdpa`` (the CPU default) makes one fused ``scaled_dot_product_attention`` call per chunk of a
document's blocks with the visibility rule as a mask: no score matrix is kept for the backward, so
memory stays flat in a document's ``blocks x context``; ``dense`` writes the rule out with einsums
one document at a time (the reference: its stored scores grow with the largest document's
``blocks x context``, gigabytes for one 8K-token document with 512 anchors; docs/design/performance.md);
``flex`` (the CUDA default) is one FlexAttention call with a block mask of the visibility rule,
fused on CUDA.

**Training path.** :class:`~harness.models.drafter_inputs.DrafterInputs` is built on the host (in the
DataLoader's collate) and moved with one ``non_blocking`` copy; :meth:`DFlashDrafter.forward_prepared`
and :meth:`DFlashDrafter.prepared_loss` then run without host reads, the latter with the LM head and
cross-entropy in chunks of ``loss_chunk_blocks`` blocks so that logits of all blocks never exist at
once. :meth:`DFlashDrafter.forward` / :meth:`DFlashDrafter.compute_loss` (tests, ``batchlab-check``)
take a batch and anchors (or a generator), build the same inputs and run the same code.

**MASK token.** ``mask_token_id`` names an existing token of the target's vocabulary, whose frozen
embedding is then used. When it is ``None`` the vocabulary is extended by one: the MASK token gets id
``vocab_size`` and its embedding is a drafter parameter (``mask_embedding``, initialised to the mean
of the target's embedding rows, trained with the drafter); the LM head keeps the target's vocabulary,
so MASK is never predicted.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, Qwen3RotaryEmbedding

from harness.models.anchors import BlockLayout, FlatDocuments, build_block_layout, sample_anchors
from harness.models.drafter_attention import (
    DFlashAttention,
    DFlashDecoderLayer,
    _SharedLayerInputs,
    block_attention_mask,
    document_slices,
    sdpa_chunks,
)
from harness.models.drafter_config import (
    DRAFTER_ATTENTION_BACKENDS,
    DrafterConfig,
    config_keys,
    load_drafter_config,
)
from harness.models.drafter_inputs import DrafterInputs, _check_token_ids
from harness.models.drafter_loss import BlockLosses, DrafterLoss, block_losses, chunked_drafter_loss, drafter_loss
from harness.models.layout import TokenBatch

if TYPE_CHECKING:
    from harness.models.draft_vocab import DraftVocabulary

__all__ = [
    "DRAFTER_ATTENTION_BACKENDS", "DFlashAttention", "DFlashDecoderLayer", "DFlashDrafter", "DrafterConfig",
    "DrafterInputs", "DrafterOutput", "block_attention_mask", "config_keys", "load_drafter_config",
]


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
        draft_vocab: DraftVocabulary | None = None,
        final_norm: nn.Module | None = None,
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
        # with a draft vocabulary the head is the target's restricted to its rows (a frozen copy, outside the tree)
        if draft_vocab is not None and draft_vocab.target_vocab_size != lm_head.out_features:
            raise ValueError(f"the draft vocabulary maps {draft_vocab.target_vocab_size} target tokens, but the "
                             f"target's LM head has {lm_head.out_features}")
        self.draft_vocab = draft_vocab
        self._target_io = (embed_tokens, lm_head if draft_vocab is None else draft_vocab.head(lm_head))
        # soft labels (config.distill_weight): the target's own next-token distribution, its final norm and LM head
        # over the deepest tap, which must be its last layer; the norm is the target's, frozen, outside the tree
        self.distill_weight = float(config.distill_weight)
        self._teacher_tap = None
        if self.distill_weight > 0:
            last = num_target_layers - 1
            if last not in self.target_layer_ids:
                raise ValueError(
                    f"distill_weight={self.distill_weight} needs the target's own next-token distribution, from its "
                    f"last layer ({last}), but target_layer_ids={self.target_layer_ids} do not tap it; add {last} to "
                    "target_layer_ids, or set distill_weight to 0"
                )
            if final_norm is None:
                raise ValueError(f"distill_weight={self.distill_weight} needs the target's final norm (final_norm)")
            final_norm.requires_grad_(False)
            self._teacher_tap = self.target_layer_ids.index(last)
        self._final_norm = (final_norm,)
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
    def from_target(cls, target: nn.Module, config: DrafterConfig,
                    draft_vocab: DraftVocabulary | None = None) -> DFlashDrafter:
        """Build a drafter over ``target`` (``.embed_tokens``, ``.lm_head``, ``.config.num_hidden_layers``)."""
        drafter = cls(config, target.embed_tokens, target.lm_head, target.config.num_hidden_layers, draft_vocab,
                      getattr(target, "final_norm", None))
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
        """The attention path on ``device``: ``flex`` (CUDA default), ``sdpa`` (default elsewhere) or
        ``dense`` (the reference).

        ``auto`` keeps ``sdpa`` for head dims under 16, which FlexAttention's CUDA kernel does not take.
        """
        backend = self.config.attention_backend
        if backend == "auto":
            return "flex" if device.type == "cuda" and self.config.head_dim >= 16 else "sdpa"
        if (backend == "flex" and device.type != "cuda" and torch.is_grad_enabled()
                and any(p.requires_grad for p in self.parameters())):
            raise ValueError(
                f"attention_backend='flex' cannot train on {device.type}: FlexAttention has no backward "
                "off CUDA; use attention_backend 'sdpa' (or 'auto'), or run under torch.no_grad()"
            )
        return backend

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self._target_io[0]

    @property
    def lm_head(self) -> nn.Linear:
        """The target's LM head (frozen), restricted to the draft vocabulary when there is one."""
        return self._target_io[1]

    def _labels(self, labels: torch.Tensor, label_valid: torch.Tensor, loss_weights: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """``(labels, loss_weights, misses)`` for the head: the target's ids as they are, or their draft indices
        (:meth:`~harness.models.draft_vocab.DraftVocabulary.map_labels`)."""
        if self.draft_vocab is None:
            return labels, loss_weights, None
        mapped = self.draft_vocab.map_labels(labels, label_valid, loss_weights)
        return mapped.labels, mapped.loss_weights, mapped.misses

    def draft_tokens(self, logits: torch.Tensor) -> torch.Tensor:
        """The target token ids of the head's argmax (draft indices mapped back through the draft vocabulary)."""
        tokens = logits.argmax(dim=-1)
        return tokens if self.draft_vocab is None else self.draft_vocab.to_target(tokens)

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

    def _check_inputs(self, token_shape: tuple[int, ...], target_hidden_states: Any) -> list[torch.Tensor]:
        """The tapped layer outputs, checked against the drafter's taps and the batch shape (no host read)."""
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
        expected = (*token_shape, self.hidden_size)
        for i, states_i in enumerate(states):
            if tuple(states_i.shape) != expected:
                raise ValueError(
                    f"target_hidden_states[{i}] has shape {tuple(states_i.shape)}, expected {expected} "
                    "(the batch's input_ids shape and the target hidden size)"
                )
        return states

    def prepare_inputs(
        self,
        batch: TokenBatch,
        anchors: Sequence[torch.Tensor] | None = None,
        generator: torch.Generator | None = None,
        blocks_per_document: int | None = None,
    ) -> tuple[DrafterInputs, list[torch.Tensor]]:
        """:class:`DrafterInputs` of ``batch`` (on its device) for given ``anchors`` or drawn with ``generator``.

        The path of :meth:`forward` / :meth:`compute_loss` (tests, ``batchlab-check``): checks token
        ids and anchors, reads back what it needs. Training builds its inputs in the collate instead
        (:meth:`DrafterInputs.build`, anchors per sample). Returns the inputs and the anchors used.
        """
        documents = FlatDocuments.from_batch(batch)
        _check_token_ids(documents, self.vocab_size)
        if anchors is None:
            if generator is None:
                raise ValueError("give anchors (one tensor per document) or a torch.Generator to draw them")
            anchors = sample_anchors(documents, self.config.num_anchors, generator, block_size=self.block_size)
        layout = build_block_layout(documents, anchors, self.block_size, blocks_per_document)
        inputs = DrafterInputs.from_layout(
            documents, layout, token_shape=tuple(batch.input_ids.shape), mask_token_id=self.mask_token_id,
            loss_decay_gamma=self.loss_decay_gamma,
        )
        return inputs, [a.clone() for a in anchors]

    def _check_prepared(self, inputs: DrafterInputs) -> None:
        if inputs.block_size != self.block_size or inputs.mask_token_id != self.mask_token_id:
            raise ValueError(
                f"inputs were prepared for block_size={inputs.block_size}, mask_token_id={inputs.mask_token_id} "
                f"but the drafter has block_size={self.block_size}, mask_token_id={self.mask_token_id}; build "
                "DrafterInputs with the drafter's config.block_size and drafter.mask_token_id"
            )

    def forward_prepared(self, inputs: DrafterInputs, target_hidden_states: Any) -> torch.Tensor:
        """``[NB, B-1, D]`` hidden states of block slots ``1 .. B-1`` after the final norm.

        ``inputs`` on the device of ``target_hidden_states`` (:meth:`DrafterInputs.to`). Nothing is
        read back to the host: the dense path slices with the host ints of ``inputs.dense_slices``,
        the flex path builds its block mask from device tensors.
        """
        self._check_prepared(inputs)
        states = self._check_inputs(inputs.token_shape, target_hidden_states)
        documents, layout = inputs.documents, inputs.layout
        context = self.fuse_context(documents, states)
        hidden = self.embed(inputs.block_input_ids).to(self.fc.weight.dtype)
        backend = self.attention_backend(context.device)
        use_flex = backend == "flex" and layout.num_blocks > 0
        shared = _SharedLayerInputs(
            context=context,
            context_rope=tuple(r[0] for r in self.rotary_emb(context, inputs.context_positions[None])),
            block_rope=self.rotary_emb(hidden, layout.slot_positions()),
            documents=document_slices(layout, inputs.dense_slices) if backend == "dense" else [],
            keep=layout.keep,
            block_mask=block_attention_mask(documents, layout, context.device) if use_flex else None,
            chunks=sdpa_chunks(layout, inputs.dense_slices, context.dtype) if backend == "sdpa" else None,
        )
        for layer in self.layers:
            hidden = layer(hidden, shared)
        return self.norm(hidden[:, 1:])

    def teacher_hidden(self, inputs: DrafterInputs, target_hidden_states: Any) -> torch.Tensor:
        """``[NB, B-1, D]`` the target's last hidden state after its final norm at ``anchor + k - 1`` for slot ``k``:
        where the target predicted the slot's label (a slot past its document's end takes the last token's)."""
        states = self._check_inputs(inputs.token_shape, target_hidden_states)
        documents, layout = inputs.documents, inputs.layout
        last = documents.gather(states[self._teacher_tap])  # [N, D]
        slots = torch.arange(self.block_size - 1, device=last.device)
        lengths = documents.doc_lengths[layout.doc_index]
        position = torch.minimum(layout.anchor[:, None] + slots, lengths[:, None] - 1)  # documents are never empty
        flat = documents.doc_starts[layout.doc_index][:, None] + position
        return self._final_norm[0](last[flat])

    def prepared_loss(self, inputs: DrafterInputs, hidden: torch.Tensor,
                      target_hidden_states: Any = None) -> DrafterLoss:
        """Decayed CE, accuracy and τ sums of ``hidden`` (:meth:`forward_prepared`), chunked.

        With ``config.distill_weight`` > 0 each slot's label is mixed with the target's own next-token distribution
        (:meth:`teacher_hidden` of ``target_hidden_states``, the features ``hidden`` was computed from).

        The LM head and cross-entropy run ``config.loss_chunk_blocks`` blocks at a time, in forward
        and in backward (:func:`~harness.models.drafter_loss.chunked_drafter_loss`): memory for
        logits is one chunk's whatever the number of blocks. The same sums as :func:`drafter_loss`.
        Every trainable parameter is in the graph of ``weighted_ce_sum``, even for a micro-batch with
        no block at all: its gradient is then zero rather than absent, so data-parallel gradient
        reduction sees the same parameters on every rank.
        """
        head = self.lm_head
        labels, weights, misses = self._labels(inputs.labels, inputs.label_valid, inputs.loss_weights)
        teacher = None
        if self.distill_weight > 0:
            if target_hidden_states is None:
                raise ValueError(f"distill_weight={self.distill_weight}: give prepared_loss the target features")
            # the target's side at the target's precision: outside the drafter's autocast (here and in the head)
            with torch.no_grad(), torch.autocast(hidden.device.type, enabled=False):
                teacher = self.teacher_hidden(inputs, target_hidden_states).to(head.weight.dtype)
        result = chunked_drafter_loss(
            hidden.to(head.weight.dtype), head, labels, weights, inputs.label_valid, inputs.layout.keep,
            self.config.loss_chunk_blocks, misses, teacher, self.distill_weight,
        )
        return self._keep_parameters_in_graph(result, inputs.layout.num_blocks)

    @torch.no_grad()
    def prepared_block_losses(self, inputs: DrafterInputs, hidden: torch.Tensor) -> BlockLosses:
        """:meth:`prepared_loss`'s sums without a gradient, also kept per block (the evaluation's per-sample
        numbers: :func:`~harness.models.drafter_loss.block_losses`)."""
        head = self.lm_head
        labels, weights, misses = self._labels(inputs.labels, inputs.label_valid, inputs.loss_weights)
        return block_losses(hidden.to(head.weight.dtype), head, labels, weights, inputs.label_valid,
                            inputs.layout.keep, self.config.loss_chunk_blocks, misses)

    def empty_loss(self, device: torch.device | str) -> DrafterLoss:
        """The sums of a micro-batch with no token at all (a short last step): zeros, with every trainable
        parameter in the graph of ``weighted_ce_sum``, as for a batch with no block."""
        return self._keep_parameters_in_graph(DrafterLoss.zeros(self.block_size - 1, device), 0)

    def _keep_parameters_in_graph(self, result: DrafterLoss, num_blocks: int) -> DrafterLoss:
        if num_blocks == 0 and torch.is_grad_enabled():
            trainable = [p for p in self.parameters() if p.requires_grad]
            if trainable:
                zero = torch.stack([p.reshape(-1)[:1].sum() for p in trainable]).sum() * 0.0
                result = dataclasses.replace(result, weighted_ce_sum=result.weighted_ce_sum + zero.to(
                    result.weighted_ce_sum.dtype))
        return result

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
        tensor of in-document positions per document) or else drawn with ``generator``
        (:func:`~harness.models.anchors.sample_anchors`). ``blocks_per_document`` pads each document
        with unused blocks. Materialises the logits of every block: for tests and checks; training
        uses :meth:`forward_prepared` and :meth:`prepared_loss`.
        """
        self._check_inputs(tuple(batch.input_ids.shape), target_hidden_states)
        inputs, anchors = self.prepare_inputs(batch, anchors, generator, blocks_per_document)
        hidden = self.forward_prepared(inputs, target_hidden_states)
        logits = self.lm_head(hidden.to(self.lm_head.weight.dtype))
        return DrafterOutput(logits, inputs.labels, inputs.label_valid, inputs.layout, anchors)

    def loss(self, output: DrafterOutput) -> DrafterLoss:
        """Decayed CE, accuracy and τ sums of ``output`` (see :mod:`harness.models.drafter_loss`).

        Every trainable parameter is in the graph of ``weighted_ce_sum``, even for a micro-batch with
        no block at all (see :meth:`prepared_loss`).
        """
        labels, _, misses = self._labels(output.labels, output.label_valid)  # as indices of the logits' rows
        result = drafter_loss(output.logits, labels, output.label_valid, output.layout.keep, self.loss_decay_gamma,
                              misses)
        return self._keep_parameters_in_graph(result, output.layout.num_blocks)

    def compute_loss(
        self,
        batch: TokenBatch,
        target_hidden_states: Any,
        anchors: Sequence[torch.Tensor] | None = None,
        generator: torch.Generator | None = None,
        blocks_per_document: int | None = None,
    ) -> DrafterLoss:
        """The numerator/denominator sums of one micro-batch: :meth:`prepare_inputs`, then
        :meth:`forward_prepared` and :meth:`prepared_loss` (the training code path)."""
        self._check_inputs(tuple(batch.input_ids.shape), target_hidden_states)
        inputs, _ = self.prepare_inputs(batch, anchors, generator, blocks_per_document)
        return self.prepared_loss(inputs, self.forward_prepared(inputs, target_hidden_states), target_hidden_states)
