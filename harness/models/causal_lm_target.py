"""Any transformers decoder-only causal LM as the frozen target: a checkpoint directory or a GGUF file.

:class:`CausalLMTarget` gives a model loaded by ``AutoModelForCausalLM`` (Llama, Qwen2/3, Mistral, Gemma, SmolLM2,
…) the interface of :class:`~harness.models.target.HybridTarget`: the outputs of the tapped decoder layers for a
:class:`~harness.models.layout.TokenBatch` (no final norm, no logits, nothing past the deepest tap: the forward
stops there), the LM-head logits for evaluation, and its embeddings and LM head for the drafter, which shares them.
Nothing about an architecture is named here: the layers are read off the model (``get_decoder().layers``), their
outputs by forward hooks, and documents are kept apart by transformers itself:

* padded rows: the key-padding mask, as transformers runs any batch;
* a packed ``[1, T]`` row: per-document ``position_ids`` and no attention mask, from which transformers' mask
  builder (``masking_utils``, with no KV cache) finds the documents and masks attention between them. A model
  whose attention ignores that gives other features packed than padded: ``batchlab-check --target`` compares the
  two layouts on every target, and tests do on a dense model.

:func:`load_target` picks the class: a Qwen3.5-style hybrid checkpoint (the default target's architecture, with
the packed GDN kernels) loads as :class:`~harness.models.target.HybridTarget`, anything else here.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from harness.models.config import SUPPORTED_MODEL_TYPES, build_target_layer_ids, check_tap_layer_ids
from harness.models.layout import TokenBatch
from harness.models.target import TargetFeatures, checked_input_ids

__all__ = ["CausalLMTarget", "check_causal_lm", "check_target_checkpoint", "is_hybrid_checkpoint", "load_target"]


class _DeepestTapReached(Exception):
    """Raised by the deepest tapped layer's hook: the layers after it are not run."""


def is_gguf(path: str | Path) -> bool:
    return Path(path).suffix.lower() == ".gguf"


def is_hybrid_checkpoint(path: str | Path) -> bool:
    """Whether ``path`` is a checkpoint directory of the Qwen3.5-style hybrid (its config.json's model_type)."""
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        return False
    raw = json.loads(config_file.read_text())
    kinds = {raw.get("model_type"), (raw.get("text_config") or {}).get("model_type")}
    return bool(kinds & set(SUPPORTED_MODEL_TYPES))


def check_causal_lm(path: str | Path) -> None:
    """Refuse, naming what it is and what to give, a path that is not a decoder-only causal LM transformers loads
    (its config only: nothing is allocated). A GGUF file needs the ``gguf`` package."""
    path = Path(path)
    if is_gguf(path):
        if not path.is_file():
            raise FileNotFoundError(f"target.pretrained={path}: no such GGUF file")
        import importlib.util

        if importlib.util.find_spec("gguf") is None:
            raise ValueError(f"target.pretrained={path} is a GGUF file: reading it needs the gguf and accelerate "
                             "packages (pip install -e '.[gguf]', or make install)")
        return
    if not path.is_dir() or not (path / "config.json").is_file():
        raise FileNotFoundError(f"target.pretrained={path}: give a checkpoint directory (config.json and "
                                "safetensors) or a .gguf file")
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path, local_files_only=True)
    architectures = list(getattr(config, "architectures", None) or [])
    causal = any(name.endswith("ForCausalLM") for name in architectures)
    if getattr(config, "is_encoder_decoder", False) or (architectures and not causal):
        named = ", ".join(architectures) or "no architectures"
        raise ValueError(f"{path} is a {config.model_type!r} checkpoint ({named}), not a decoder-only causal LM; "
                         "the target is one (a *ForCausalLM checkpoint: Llama, Qwen2/3, Mistral, Gemma, …) or a "
                         "Qwen3.5-style hybrid")


def check_target_checkpoint(path: str | Path) -> None:
    """Refuse a path that is no target checkpoint (its config only): a hybrid's config must build the hybrid, any
    other must be a decoder-only causal LM (:func:`check_causal_lm`)."""
    if is_hybrid_checkpoint(path):
        from harness.models.config import load_target_config

        load_target_config(path)
    else:
        check_causal_lm(path)


def checkpoint_vocab_size(path: str | Path) -> int:
    """The vocabulary of a target checkpoint (a hybrid or any causal LM directory, or a GGUF file), from its config
    alone (nothing is loaded but its metadata)."""
    path = Path(path)
    if is_hybrid_checkpoint(path):
        from harness.models.config import load_target_config

        return int(load_target_config(path).vocab_size)
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(dequantized(path) if is_gguf(path) else path, local_files_only=True)
    return int(config.get_text_config().vocab_size if hasattr(config, "get_text_config") else config.vocab_size)


#: the cache entries of :func:`dequantized` (``gguf-<key>``) and the checkpoint directory inside one
GGUF_PREFIX = "gguf"
GGUF_CHECKPOINT = "checkpoint"


def dequantized(path: str | Path) -> Path:
    """A GGUF file's model de-quantized to fp32 once, as a local safetensors checkpoint in the batchlab cache
    (``$BATCHLAB_CACHE`` or ``~/.cache/batchlab``; keyed by the file's path, size and time; atomic): every later
    load reads it instead of parsing the GGUF file again (transformers parses its metadata, tokenizer included,
    for the config and again for the weights: about 3 s each on 2 cores, five times in a run). The weights are
    the same fp32 values a direct load gives; a run casts them to its dtype."""
    from harness.data import cache
    from harness.data.config import DataConfig

    path = Path(path).expanduser().resolve()
    cache_dir = DataConfig().resolved_cache_dir()
    key = cache.digest({"gguf": cache.path_signature(path), "version": 1})

    def build(tmp: Path) -> dict:
        from transformers import AutoModelForCausalLM

        from safetensors.torch import save_model

        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32,
                                                     local_files_only=True)
        # save_pretrained refuses a model loaded from GGUF (marked quantized although de-quantized): its config
        # without the GGUF marks, and its tensors (tied ones once) in the file from_pretrained reads
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        target = tmp / GGUF_CHECKPOINT
        target.mkdir()
        (target / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
        save_model(model, str(target / "model.safetensors"), metadata={"format": "pt"})
        return {"gguf": str(path)}

    entry, _, _ = cache.ensure_entry(cache_dir, GGUF_PREFIX, key, build)
    return entry / GGUF_CHECKPOINT


class CausalLMTarget(nn.Module):
    """A frozen transformers causal LM that returns the outputs of its tapped decoder layers.

    Args:
        model: a transformers ``*ForCausalLM`` (its ``get_decoder()`` holds ``layers``, ``norm`` and the
            embeddings).
        tap_layer_ids: default layers to tap; if None, DFlash's rule for ``num_draft_layers``.
        num_draft_layers: drafter depth used by the default tap rule.
    """

    def __init__(self, model: nn.Module, *, tap_layer_ids: Sequence[int] | None = None,
                 num_draft_layers: int = 1) -> None:
        super().__init__()
        self.model = model
        self.config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        decoder = model.get_decoder()
        layers = getattr(decoder, "layers", None)
        if not isinstance(layers, nn.ModuleList) or len(layers) != self.config.num_hidden_layers:
            raise ValueError(f"{type(model).__name__}: its decoder has no list of {self.config.num_hidden_layers} "
                             "layers (.layers) to tap; the target takes a decoder-only causal LM")
        self._decoder, self._layers = decoder, layers
        self.tap_layer_ids = (build_target_layer_ids(self.num_layers, num_draft_layers) if tap_layer_ids is None
                              else check_tap_layer_ids(tap_layer_ids, self.num_layers))
        self.leak_across_documents = False  # no recurrent state to leak: the hybrid's negative control only
        self.requires_grad_(False)
        self.eval()

    # ----------------------------------------------------------------- accessors for the drafter
    @property
    def embed_tokens(self) -> nn.Embedding:
        return self.model.get_input_embeddings()

    @property
    def lm_head(self) -> nn.Linear:
        return self.model.get_output_embeddings()

    @property
    def num_layers(self) -> int:
        return int(self.config.num_hidden_layers)

    @property
    def hidden_size(self) -> int:
        return int(self.config.hidden_size)

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    def train(self, mode: bool = True) -> CausalLMTarget:
        """The target is frozen: it always stays in eval mode whatever ``mode`` says."""
        return super().train(False)

    # ----------------------------------------------------------------- forward
    @torch.no_grad()
    def forward(self, batch: TokenBatch, tap_layer_ids: Sequence[int] | None = None,
                gdn_backend: str = "auto") -> TargetFeatures:
        """Outputs of the tapped decoder layers for ``batch`` (padded or packed), without gradients; the layers
        after the deepest tap are not run. ``gdn_backend`` is the hybrid's and means nothing here."""
        layer_ids = check_tap_layer_ids(self.tap_layer_ids if tap_layer_ids is None else tap_layer_ids,
                                        self.num_layers)
        deepest, outputs = max(layer_ids), {}

        def capture(index: int) -> Any:
            def hook(module: nn.Module, args: Any, output: Any) -> None:
                outputs[index] = output[0] if isinstance(output, tuple) else output
                if index == deepest:
                    raise _DeepestTapReached

            return hook

        hooks = [self._layers[i].register_forward_hook(capture(i)) for i in sorted(set(layer_ids))]
        try:
            self._decoder(**self._inputs(batch))
        except _DeepestTapReached:
            pass
        finally:
            for hook in hooks:
                hook.remove()
        return TargetFeatures(layer_ids=layer_ids, hidden_states=[outputs[i] for i in layer_ids])

    @torch.no_grad()
    def logits(self, batch: TokenBatch, gdn_backend: str = "auto") -> torch.Tensor:
        """Next-token logits ``[B, L, V]`` (padded) or ``[1, T, V]`` (packed): every layer, the final norm and the
        LM head, as the model's own forward computes them."""
        return self.model(**self._inputs(batch)).logits

    @property
    def final_norm(self) -> nn.Module:
        """The norm between the last decoder layer and the LM head."""
        return self._decoder.norm

    def next_token_logits(self, last_hidden: torch.Tensor) -> torch.Tensor:
        """Logits from the last decoder layer's output (the final norm, then the LM head)."""
        return self.lm_head(self.final_norm(last_hidden))

    def _inputs(self, batch: TokenBatch) -> dict[str, Any]:
        if batch.input_ids.device != self.device:
            batch = batch.to(self.device)
        inputs = {"input_ids": checked_input_ids(batch, int(self.config.vocab_size)),
                  "position_ids": batch.position_ids, "use_cache": False}
        if batch.cu_seqlens is None:
            inputs["attention_mask"] = batch.attention_mask
        # packed: no mask, so that transformers finds the documents from the restarting position_ids (module doc)
        return inputs

    # ----------------------------------------------------------------- loading
    @classmethod
    def from_pretrained(cls, path: str | Path, *, dtype: torch.dtype | None = None,
                        device: str | torch.device | None = None, tap_layer_ids: Sequence[int] | None = None,
                        num_draft_layers: int = 1) -> CausalLMTarget:
        """Load a checkpoint directory or a GGUF file (de-quantized to ``dtype``; default fp32 on CPU, bf16 on
        CUDA) with ``AutoModelForCausalLM``, from local files only."""
        from transformers import AutoModelForCausalLM

        check_causal_lm(path)
        path = Path(path)
        device = torch.device(device if device is not None else "cpu")
        if dtype is None:
            dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        model = AutoModelForCausalLM.from_pretrained(str(dequantized(path) if is_gguf(path) else path), dtype=dtype,
                                                     local_files_only=True)
        return cls(model.to(device), tap_layer_ids=tap_layer_ids, num_draft_layers=num_draft_layers)


def load_target(path: str | Path, *, dtype: torch.dtype | None = None, device: str | torch.device | None = None,
                tap_layer_ids: Sequence[int] | None = None, num_draft_layers: int = 1,
                attention_backend: str = "auto") -> nn.Module:
    """The frozen target of a checkpoint: a Qwen3.5-style hybrid directory as
    :class:`~harness.models.target.HybridTarget` (``attention_backend`` is its packed-attention kernel), any other
    causal LM (a directory or a GGUF file) as :class:`CausalLMTarget`."""
    if is_hybrid_checkpoint(path):
        from harness.models.target import HybridTarget

        return HybridTarget.from_pretrained(path, dtype=dtype, device=device, tap_layer_ids=tap_layer_ids,
                                            num_draft_layers=num_draft_layers, attention_backend=attention_backend)
    return CausalLMTarget.from_pretrained(path, dtype=dtype, device=device, tap_layer_ids=tap_layer_ids,
                                          num_draft_layers=num_draft_layers)
