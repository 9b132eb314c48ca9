"""Token batches in the two layouts the models accept: padded ``[B, L]`` and packed ``[1, T]``.

A padded batch holds one document per row, right-padded, with an ``attention_mask``. A packed batch
holds all documents back to back in one row with int32 ``cu_seqlens`` (document starts, then the
total length) and ``position_ids`` that restart at 0 for every document. Both carry a
``loss_mask`` of the same shape as ``input_ids``. Both layouts expose the same per-document view
(``doc_lengths``) so that models and tests can compare them with running each document alone.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

Layout = Literal["padded", "packed"]


@dataclass
class TokenBatch:
    input_ids: torch.Tensor  # [B, L] padded, [1, T] packed; int64
    position_ids: torch.Tensor  # same shape; per-document positions
    loss_mask: torch.Tensor  # same shape; 1 where a token may be a label/anchor
    attention_mask: torch.Tensor | None = None  # [B, L] padded only; 1 = real token
    cu_seqlens: torch.Tensor | None = None  # [N + 1] int32, packed only
    # Host copy of ``cu_seqlens``, checked once when the batch is built (on the host, before any
    # device move): models use it instead of reading the device tensor back (a sync on CUDA).
    # Assigning a new ``cu_seqlens`` drops it, so a batch edited by hand is checked again.
    cu_seqlens_host: tuple[int, ...] | None = field(default=None, repr=False, compare=False)
    # (smallest, largest) real token id, found on the host when the batch is built: lets a model check
    # its vocabulary without reading input_ids back. Assigning new input_ids or attention_mask drops it.
    token_id_range: tuple[int, int] | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.input_ids.dim() != 2:
            raise ValueError(f"input_ids must be 2-D [batch, length], got shape {tuple(self.input_ids.shape)}")
        for name in ("position_ids", "loss_mask", "attention_mask"):
            value = getattr(self, name)
            if value is not None and value.shape != self.input_ids.shape:
                raise ValueError(
                    f"{name} has shape {tuple(value.shape)} but input_ids has {tuple(self.input_ids.shape)}; "
                    f"give one {name} entry per token"
                )
        if (self.attention_mask is None) == (self.cu_seqlens is None):
            raise ValueError("give exactly one of attention_mask (padded layout) or cu_seqlens (packed layout)")
        if self.cu_seqlens is not None:
            bounds = validate_cu_seqlens(self.cu_seqlens, total=self.input_ids.shape[1])
            if self.input_ids.shape[0] != 1:
                raise ValueError(
                    f"a packed batch is one row: input_ids has {self.input_ids.shape[0]} rows with cu_seqlens"
                )
            if self.cu_seqlens_host is not None and tuple(self.cu_seqlens_host) != bounds:
                raise ValueError(
                    f"cu_seqlens_host {tuple(self.cu_seqlens_host)} disagrees with cu_seqlens {bounds}"
                )
            object.__setattr__(self, "cu_seqlens_host", bounds)
        elif self.cu_seqlens_host is not None:
            raise ValueError("cu_seqlens_host is for packed batches only (with cu_seqlens)")

    def __setattr__(self, name: str, value: Any) -> None:
        # Host summaries describe the tensors they were built from: a new tensor drops them.
        if name == "cu_seqlens" and getattr(self, "cu_seqlens_host", None) is not None:
            object.__setattr__(self, "cu_seqlens_host", None)
        if name in ("input_ids", "attention_mask", "cu_seqlens") and getattr(self, "token_id_range", None) is not None:
            object.__setattr__(self, "token_id_range", None)
        object.__setattr__(self, name, value)

    @property
    def doc_lengths(self) -> torch.Tensor:
        """Length of every document (int64), in row order (padded) or row position (packed)."""
        if self.cu_seqlens is not None:
            return (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).long()
        return self.attention_mask.long().sum(dim=1)

    def packed_documents(self) -> PackedDocuments | None:
        """The packed boundaries for the models: from the trusted host copy when the batch has one
        (no check, no device read), else checked and read back from ``cu_seqlens``; None if padded."""
        if self.cu_seqlens is None:
            return None
        if self.cu_seqlens_host is not None:
            return PackedDocuments.trusted(self.cu_seqlens, self.cu_seqlens_host)
        return PackedDocuments.from_cu_seqlens(self.cu_seqlens, total=self.input_ids.shape[1])

    def _map(self, move: Callable[[torch.Tensor], torch.Tensor]) -> TokenBatch:
        """A batch of moved tensors built without checks (this one was checked when it was built)."""
        batch = object.__new__(TokenBatch)
        for name in ("input_ids", "position_ids", "loss_mask", "attention_mask", "cu_seqlens"):
            value = getattr(self, name)
            object.__setattr__(batch, name, None if value is None else move(value))
        object.__setattr__(batch, "cu_seqlens_host", self.cu_seqlens_host)
        object.__setattr__(batch, "token_id_range", self.token_id_range)
        return batch

    def to(self, device: torch.device | str, non_blocking: bool = False) -> TokenBatch:
        """The batch on ``device``: no validation and no read back (the host copy travels along)."""
        return self._map(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> TokenBatch:
        """Page-locked host copies (for ``non_blocking`` copies); unchanged without an accelerator."""
        if not _can_pin():
            return self
        return self._map(lambda t: t.pin_memory())

    @staticmethod
    def from_documents(
        documents: Sequence[torch.Tensor],
        layout: Layout,
        loss_masks: Sequence[torch.Tensor] | None = None,
        pad_token_id: int = 0,
    ) -> TokenBatch:
        """Build a batch from 1-D token tensors (and optional 1-D loss masks of equal length)."""
        if not documents:
            raise ValueError("from_documents needs at least one document")
        if loss_masks is None:
            loss_masks = [torch.ones_like(doc) for doc in documents]
        if len(loss_masks) != len(documents):
            raise ValueError(f"{len(loss_masks)} loss masks for {len(documents)} documents")
        for i, (doc, mask) in enumerate(zip(documents, loss_masks)):
            if doc.dim() != 1 or doc.numel() == 0:
                raise ValueError(f"document {i} must be a non-empty 1-D tensor, got shape {tuple(doc.shape)}")
            if mask.shape != doc.shape:
                raise ValueError(
                    f"loss mask of document {i} has length {mask.numel()} but the document has {doc.numel()} tokens"
                )
        lengths = [doc.numel() for doc in documents]
        token_id_range = None
        if all(doc.device.type == "cpu" for doc in documents):  # free on the host; never a device read
            token_id_range = (min(int(doc.min()) for doc in documents), max(int(doc.max()) for doc in documents))
        if layout == "packed":
            cu = torch.zeros(len(documents) + 1, dtype=torch.int32)
            cu[1:] = torch.cumsum(torch.tensor(lengths), 0)
            return TokenBatch(
                input_ids=torch.cat(list(documents)).long()[None],
                position_ids=torch.cat([torch.arange(n) for n in lengths])[None],
                loss_mask=torch.cat(list(loss_masks)).to(torch.int64)[None],
                cu_seqlens=cu,
                cu_seqlens_host=tuple(int(x) for x in cu.tolist()),
                token_id_range=token_id_range,
            )
        if layout != "padded":
            raise ValueError(f"layout must be 'padded' or 'packed', got {layout!r}")
        width = max(lengths)
        input_ids = torch.full((len(documents), width), pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(documents), width), dtype=torch.long)
        loss_mask = torch.zeros((len(documents), width), dtype=torch.long)
        for row, (doc, mask) in enumerate(zip(documents, loss_masks)):
            input_ids[row, : doc.numel()] = doc
            attention_mask[row, : doc.numel()] = 1
            loss_mask[row, : doc.numel()] = mask
        position_ids = torch.arange(width).expand(len(documents), width).clone()
        return TokenBatch(input_ids, position_ids, loss_mask, attention_mask=attention_mask,
                          token_id_range=token_id_range)


def _can_pin() -> bool:
    """Whether page-locked memory is available (it needs an accelerator)."""
    return torch.cuda.is_available() or (hasattr(torch, "accelerator") and torch.accelerator.is_available())


def validate_cu_seqlens(cu_seqlens: torch.Tensor, total: int) -> tuple[int, ...]:
    """Raise a clear error unless ``cu_seqlens`` is 1-D, starts at 0, ends at ``total`` and increases.

    Returns the boundaries as host ints (read back once: one device sync on CUDA).
    """
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must be 1-D with at least 2 entries, got shape {tuple(cu_seqlens.shape)}")
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"cu_seqlens must be int32 (or int64), got {cu_seqlens.dtype}")
    bounds = tuple(cu_seqlens.tolist())
    if bounds[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0, got cu_seqlens[0]={bounds[0]}")
    if bounds[-1] != total:
        raise ValueError(
            f"cu_seqlens must end at the packed length T={total}, got cu_seqlens[-1]={bounds[-1]}"
        )
    for doc, (start, stop) in enumerate(zip(bounds[:-1], bounds[1:])):
        if stop <= start:
            raise ValueError(
                f"cu_seqlens must increase strictly: document {doc} has length {stop - start} "
                f"(cu_seqlens[{doc}]={start}, cu_seqlens[{doc + 1}]={stop})"
            )
    return bounds


@dataclass(frozen=True, eq=False)
class PackedDocuments:
    """The document boundaries of one packed row, checked once and shared by every layer of a forward.

    Every op that takes ``cu_seqlens`` (attention, gated delta rule, short conv) also takes this. Given
    a raw tensor, each op must check it and read it back to the host; on CUDA each of those reads is
    a device sync, once per op per layer. A model builds this once per forward pass
    (:meth:`from_cu_seqlens`) instead: the host copy of the boundaries is read once, and index
    structures that depend only on the boundaries (the GDN chunk plan, an attention block mask) are
    built by the first layer that needs them and reused by the rest (:meth:`cached`). It holds its
    own copy of the boundaries, so later writes to the batch's ``cu_seqlens`` cannot make the device
    and host copies disagree; build a new one for every row.
    """

    cu_seqlens: torch.Tensor  # [N + 1] int32 on the device of the row
    bounds: tuple[int, ...]  # the same boundaries on the host
    _cache: dict = field(default_factory=dict, repr=False)

    @classmethod
    def from_cu_seqlens(cls, cu_seqlens: torch.Tensor, total: int,
                        device: torch.device | None = None) -> PackedDocuments:
        """Check ``cu_seqlens`` against the row length ``total`` (see :func:`validate_cu_seqlens`)."""
        bounds = validate_cu_seqlens(cu_seqlens, total=total)
        device = cu_seqlens.device if device is None else torch.device(device)
        return cls(cu_seqlens=cu_seqlens.to(device=device, dtype=torch.int32, copy=True), bounds=bounds)

    @classmethod
    def trusted(cls, cu_seqlens: torch.Tensor, bounds: Sequence[int]) -> PackedDocuments:
        """From boundaries checked earlier (``bounds`` on the host): no check, no device read."""
        return cls(cu_seqlens=cu_seqlens.to(dtype=torch.int32, copy=True), bounds=tuple(bounds))

    @property
    def total(self) -> int:
        return self.bounds[-1]

    @property
    def num_documents(self) -> int:
        return len(self.bounds) - 1

    @functools.cached_property
    def max_length(self) -> int:
        return max(stop - start for start, stop in zip(self.bounds[:-1], self.bounds[1:]))

    def int64_boundaries(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """``cu_seqlens`` as int64 on ``device`` and on the host, the same two tensors on every call.

        fla wants both (``cu_seqlens``, ``cu_seqlens_cpu``): with the host copy it plans its chunks
        without a device sync, and it caches that plan by tensor identity, so every layer must pass
        the very same tensor objects.
        """
        return self.cached(("int64-boundaries", torch.device(device)), lambda: (
            self.cu_seqlens.to(device=device, dtype=torch.long), torch.tensor(self.bounds, dtype=torch.long)))

    def cached(self, key: Hashable, build: Callable[[], Any]) -> Any:
        """``build()`` on first use of ``key``, the same object afterwards (index structures only).

        Built outside inference mode: an index built under ``torch.inference_mode()`` could not be
        saved for backward by a later call with gradients.
        """
        if key not in self._cache:
            with torch.inference_mode(False):
                self._cache[key] = build()
        return self._cache[key]


def packed_documents(cu_seqlens: torch.Tensor | PackedDocuments, total: int,
                     device: torch.device | None = None) -> PackedDocuments:
    """``cu_seqlens`` as :class:`PackedDocuments` for a row of ``total`` tokens (checked if raw)."""
    if isinstance(cu_seqlens, PackedDocuments):
        if cu_seqlens.total != total:
            raise ValueError(
                f"cu_seqlens must end at the packed length T={total}, got cu_seqlens[-1]={cu_seqlens.total}"
            )
        return cu_seqlens
    return PackedDocuments.from_cu_seqlens(cu_seqlens, total, device)
