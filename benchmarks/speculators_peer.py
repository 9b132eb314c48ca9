"""vLLM speculators' DFlash training step on batchlab's drafter weights, tokens, features and anchors.

For ``benchmarks/drafter_step.py``'s ``speculators`` path only: the public DFlash trainer a user would pick
instead, measured side by side on the same inputs. It is never a batchlab dependency: :func:`ensure_site`
installs ``speculators`` (and the few packages it imports that batchlab's venv lacks) with ``--no-deps`` into
``.speculators-site/``, and only the benchmark's child process puts that folder on its path. The peer runs
with its ``sdpa`` attention on CPU (its FlexAttention path has no backward there: "FlexAttention does not
support backward on CPU") and its default FlexAttention on CUDA; its loss is its own (KL to the verifier's logits over every anchored block, decayed per
slot; the eager implementation on CPU, its fused Triton kernel on CUDA); its anchors are batchlab's
(``select_anchors`` is replaced by the anchors batchlab drew).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
SITE = REPO / ".speculators-site"
#: speculators' own release and what importing its DFlash model needs beyond batchlab's venv (installed without
#: their dependencies: batchlab's torch and transformers serve; speculators 0.9.0 pins transformers <= 5.19)
PACKAGES = ("speculators==0.9.0", "hs-connectors==0.9.0", "loguru==0.7.3", "pydantic-settings", "openai")


def ensure_site() -> Path:
    """The folder holding speculators, installed from the package index on first use."""
    if not (SITE / "speculators" / "models" / "dflash").is_dir():
        print(f"installing {', '.join(PACKAGES)} into {SITE} (benchmark only, --no-deps)", flush=True)
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(SITE), *PACKAGES],
                       check=True)
    return SITE


def build_peer(drafter: Any, embed: Any, head: Any, taps: int, device: Any = "cpu") -> Any:
    """speculators' ``DFlashDraftModel`` holding ``drafter``'s weights, the target's embeddings and LM head (as
    ``lm_head`` and ``verifier_lm_head``): its ``sdpa`` attention on CPU, its default FlexAttention on CUDA."""
    import torch
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import Qwen3Config

    config = drafter.config
    layer_config = Qwen3Config(
        vocab_size=embed.num_embeddings, hidden_size=embed.embedding_dim, intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers, num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads, head_dim=config.head_dim, hidden_act=config.hidden_act,
        rms_norm_eps=config.rms_norm_eps, max_position_embeddings=config.max_position_embeddings,
        attention_bias=config.attention_bias, rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta})
    cuda = str(device).startswith("cuda")
    layer_config._attn_implementation = "simple_flex_attention" if cuda else "sdpa"  # noqa: SLF001 - its switch
    peer_config = DFlashSpeculatorConfig(
        transformer_layer_config=layer_config, draft_vocab_size=embed.num_embeddings, block_size=config.block_size,
        aux_hidden_state_layer_ids=list(range(taps)), mask_token_id=int(drafter.mask_token_id),
        speculators_config=SpeculatorsConfig(
            algorithm="dflash", default_proposal_method="greedy",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=config.block_size - 1)],
            verifier=VerifierConfig(name_or_path=None, architectures=[])))
    peer = DFlashDraftModel(peer_config)
    missing, unexpected = peer.load_state_dict(drafter.state_dict(), strict=False)
    frozen = {"embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight", "verifier_norm.weight"}
    if unexpected or set(missing) - frozen:
        raise RuntimeError(f"the weights do not map one to one: missing {sorted(set(missing) - frozen)}, "
                           f"unexpected {sorted(unexpected)}")
    with torch.no_grad():
        peer.embed_tokens.weight.copy_(embed.weight)
        peer.lm_head.weight.copy_(head.weight)
        peer.verifier_lm_head.weight.copy_(head.weight)
        peer.verifier_norm.weight.fill_(1.0)
    return peer


class PeerStep:
    """One training step of ``peer`` on batchlab's micro-batch: the same tokens, features and anchors."""

    def __init__(self, peer: Any, inputs: Any, features: Any, last_hidden: Any, gamma: float) -> None:
        """``features``: the tapped layers side by side, ``[1, tokens, taps * hidden]``."""
        import torch
        import speculators.models.dflash.core as core

        documents, layout = inputs.documents, inputs.layout
        kept = layout.keep
        self.anchors = (documents.doc_starts[layout.doc_index] + layout.anchor)[kept]  # sorted: documents in order
        core.select_anchors = self._our_anchors  # the peer draws its own otherwise
        self.peer, self.gamma = peer, gamma
        from speculators.losses import resolve_loss_config

        # its default loss, KL to the verifier's logits; the fused kernel needs Triton (CUDA), eager elsewhere
        fused = features.device.type == "cuda"
        self.loss_config = resolve_loss_config("kl_div", "fused" if fused else "eager")
        self.kwargs = {
            "hidden_states": features,
            "input_ids": documents.token_ids[None],
            "loss_mask": documents.loss_mask[None].to(torch.long),
            "verifier_last_hidden_states": last_hidden,
            "document_ids": documents.doc_of_token[None],
            "position_ids": documents.position_in_document[None],
        }

    def _our_anchors(self, loss_mask: Any, num_anchors: int, block_size: int) -> tuple[Any, Any]:  # noqa: ARG002
        import torch

        return self.anchors, torch.ones_like(self.anchors, dtype=torch.bool)

    def loss(self) -> Any:
        _, loss, _ = self.peer(**self.kwargs, max_anchors=int(self.anchors.numel()), gamma=self.gamma,
                               loss_config=self.loss_config)
        return loss

    def hidden(self) -> Any:
        """``[NB, B-1, D]`` after the final norm: what batchlab's ``forward_prepared`` returns."""
        hidden, *_ = self.peer._backbone_forward(**self.kwargs, max_anchors=int(self.anchors.numel()))  # noqa: SLF001
        return hidden.reshape(self.anchors.numel(), self.peer.block_size, -1)[:, 1:]
