"""Greedy speculative decoding with the DFlash drafter and the frozen target: real acceptance.

Teacher-forced τ (training's ``eval_tau``) scores drafts against the dataset's tokens; what a
speculative decoder gains is measured against the *target's own* continuation, by decoding
(docs/design/training-runs.md, "Target and acceptance"). One decoding round, for a sequence ``x_0 .. x_t``
whose newest token ``x_t`` sits at position ``t``:

1. **Draft.** ``x_t`` anchors one drafter block: the block input is ``[x_t, MASK x (B-1)]`` at
   positions ``t .. t+B-1``, and the block sees the target's context features of positions ``< t``
   only — training's visibility rule (:func:`harness.models.anchors.context_visible`), so the
   drafter runs exactly as in training, through
   :meth:`~harness.models.drafter.DFlashDrafter.forward` with ``anchors=[[t]]``. The drafter's
   document is the sequence followed by ``B - 1`` placeholder tokens (:data:`PLACEHOLDER_ID`),
   because a given anchor must leave a label position inside its document (``a <= length - 2``);
   placeholders and the features at positions ``>= t`` are never visible to the block (test), and
   those features are passed as zeros. Slot ``k`` of the block predicts the token at ``t + k``: the
   drafts ``d_1 .. d_{B-1}`` are the argmax of slots ``1 .. B-1``.
2. **Verify.** ONE target forward over ``x_0 .. x_t, d_1 .. d_{B-1}`` gives the target's greedy
   tokens ``g_1 .. g_B`` after positions ``t .. t+B-1``. The longest prefix of drafts with
   ``d_k == g_k`` (``n`` drafts) is accepted, plus the target's own next token ``g_{n+1}``: the round
   gains ``n + 1`` tokens (1 to ``B``), each the token plain greedy decoding would produce.
3. **Next context.** The target is causal, so the verification forward's features at positions
   ``0 .. t+n`` are those of the new sequence ``x_0 .. x_t, d_1 .. d_n, g_{n+1}`` up to (excluding)
   its newest token: they are the next block's context, with no further target forward.

The first anchor is the target's greedy next token after the prompt (the prefill: one target
forward, also giving the prompt's context features). Decoding stops after ``max_new_tokens`` tokens
(the last round is truncated) or at ``eos_id`` (kept). The output equals :func:`greedy_decode`
token for token (tests).

The tiny models recompute the full forward each step (no KV cache): a verification forward costs a
forward over the whole sequence. Logits are the target's final norm and LM head on its last decoder
layer's output (``HybridTarget.forward`` returns tapped layer outputs without the final norm).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from harness.eval.prompts import heldout_prompts
from harness.models.layout import TokenBatch

__all__ = [
    "PLACEHOLDER_ID",
    "SpeculativeResult",
    "evaluate_acceptance",
    "greedy_decode",
    "heldout_prompts",
    "speculative_decode",
    "speculative_decode_batch",
]

#: token after the anchor in the drafter's document (never visible to the block; any id works)
PLACEHOLDER_ID = 0


@dataclass
class SpeculativeResult:
    """The tokens one prompt's speculative decoding produced, and what each target forward gained.

    ``accepted_per_forward[i]`` is the number of new tokens of the ``i``-th verification forward
    (accepted drafts + the target's own token, 1 .. B; the last one may be truncated by
    ``max_new_tokens`` or ``eos_id``). The prefill forward, which yields the first token, is not in it:
    ``tokens`` has ``1 + sum(accepted_per_forward)`` entries (when any), in ``target_forwards``
    = ``1 + len(accepted_per_forward)`` target forwards.
    """

    tokens: list[int] = field(default_factory=list)
    accepted_per_forward: list[int] = field(default_factory=list)
    target_forwards: int = 0


# ---------------------------------------------------------------------- target helpers
def _token_batch(documents: Sequence[Sequence[int]], device: torch.device) -> TokenBatch:
    """A right-padded batch of the documents (the target and drafter keep padded rows apart)."""
    batch = TokenBatch.from_documents([torch.tensor(list(doc), dtype=torch.long) for doc in documents], "padded")
    return batch if device.type == "cpu" else batch.to(device)


def _target_forward(
    target: Any,
    documents: Sequence[Sequence[int]],
    tap_layer_ids: Sequence[int],
    positions: Sequence[Sequence[int]],
    gdn_backend: str,
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """One target forward over the (padded) documents.

    Returns the tapped layer outputs ``[n, L, D]`` (``tap_layer_ids`` order) and the greedy next
    token after each of ``positions[i]`` of document ``i`` (``[n, len(positions[i])]``, all the same
    length): the LM head runs on those positions only.
    """
    last = target.num_layers - 1
    batch = _token_batch(documents, target.device)
    features = target(batch, tap_layer_ids=[*tap_layer_ids, last], gdn_backend=gdn_backend)
    hidden_last = features.hidden_states[-1]
    rows = torch.arange(len(documents), device=hidden_last.device)[:, None]
    cols = torch.tensor([list(p) for p in positions], dtype=torch.long, device=hidden_last.device)
    greedy = target.next_token_logits(hidden_last[rows, cols]).argmax(dim=-1)  # final norm, LM head
    return features.hidden_states[:-1], greedy


@contextlib.contextmanager
def _inference(*modules: Any) -> Iterator[None]:
    """``torch.no_grad`` with the modules in eval mode; their training mode is restored afterwards."""
    modes = [(m, m.training) for m in modules if isinstance(getattr(m, "training", None), bool)]
    try:
        for module, _ in modes:
            module.train(False)
        with torch.no_grad():
            yield
    finally:
        for module, mode in modes:
            module.train(mode)


def _check_request(prompt_ids: Sequence[int], max_new_tokens: int) -> list[int]:
    prompt = [int(x) for x in prompt_ids]
    if not prompt:
        raise ValueError("prompt_ids is empty: give at least one prompt token")
    if isinstance(max_new_tokens, bool) or int(max_new_tokens) < 0:
        raise ValueError(f"max_new_tokens={max_new_tokens!r}: give a non-negative integer")
    return prompt


# ---------------------------------------------------------------------- plain greedy
def greedy_decode(
    target: Any,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    eos_id: int | None = None,
    *,
    gdn_backend: str = "auto",
) -> list[int]:
    """The target's greedy continuation of ``prompt_ids``: up to ``max_new_tokens`` new tokens,
    stopping after ``eos_id`` (kept) when given.

    One target forward per token, each over the whole sequence: the tiny models need no KV cache
    (the reference for :func:`speculative_decode`, not a fast decoder).
    """
    sequence = _check_request(prompt_ids, max_new_tokens)
    new: list[int] = []
    with _inference(target):
        while len(new) < int(max_new_tokens):
            _, greedy = _target_forward(target, [sequence], [], [[len(sequence) - 1]], gdn_backend)
            token = int(greedy[0, 0])
            new.append(token)
            sequence.append(token)
            if eos_id is not None and token == eos_id:
                break
    return new


# ---------------------------------------------------------------------- speculative
def _propose(
    drafter: Any, sequences: Sequence[list[int]], contexts: Sequence[list[torch.Tensor]], device: torch.device
) -> list[list[int]]:
    """The drafter's ``B - 1`` proposals after the newest token of every sequence.

    Each sequence ``x_0 .. x_t`` is one drafter document ``x_0 .. x_t`` + ``B - 1`` placeholders with
    one block anchored at ``t``; its target features are ``contexts`` (positions ``< t``) followed by
    zeros (positions ``>= t``, never visible to the block).
    """
    block = drafter.block_size
    documents = [seq + [PLACEHOLDER_ID] * (block - 1) for seq in sequences]
    width = max(len(doc) for doc in documents)
    features = []
    for layer in range(len(contexts[0])):
        reference = contexts[0][layer]
        padded = reference.new_zeros((len(documents), width, reference.shape[-1]))
        for row, context in enumerate(contexts):
            padded[row, : context[layer].shape[0]] = context[layer]
        features.append(padded)
    anchors = [torch.tensor([len(seq) - 1], dtype=torch.long, device=device) for seq in sequences]
    output = drafter(_token_batch(documents, device), features, anchors=anchors)
    # target ids of the argmax (a drafter with a draft vocabulary maps its indices back)
    tokens = drafter.draft_tokens(output.logits) if hasattr(drafter, "draft_tokens") else output.logits.argmax(-1)
    return tokens.tolist()  # [n, B - 1]: one block per document, in order


def speculative_decode_batch(
    target: Any,
    drafter: Any,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    eos_id: int | None = None,
    *,
    gdn_backend: str = "auto",
    drafter_context: Callable[[], contextlib.AbstractContextManager] | None = None,
) -> list[SpeculativeResult]:
    """:func:`speculative_decode` of several prompts at once: every round drafts for all unfinished
    prompts in one drafter forward and verifies them in one (padded) target forward.

    Each prompt's result is its own (the rows never see each other): the same as decoding it alone,
    counting only its own rounds. ``drafter_context()`` wraps each drafter forward (the drafter's own
    autocast, where it differs from the target's).
    """
    sequences = [_check_request(p, max_new_tokens) for p in prompts]
    max_new_tokens = int(max_new_tokens)
    results = [SpeculativeResult() for _ in sequences]
    if not sequences or max_new_tokens == 0:
        return results
    block = int(drafter.block_size)
    taps = list(drafter.target_layer_ids)
    device = target.device

    def finished(result: SpeculativeResult) -> bool:
        return len(result.tokens) >= max_new_tokens or (eos_id is not None and result.tokens[-1] == eos_id)

    with _inference(target, drafter):
        # Prefill: the target's next token after each prompt, and the prompt's context features.
        features, greedy = _target_forward(target, sequences, taps, [[len(s) - 1] for s in sequences], gdn_backend)
        contexts: list[list[torch.Tensor]] = []
        for row, (sequence, result) in enumerate(zip(sequences, results)):
            contexts.append([f[row, : len(sequence)] for f in features])
            token = int(greedy[row, 0])
            sequence.append(token)
            result.tokens.append(token)
            result.target_forwards = 1
        active = [i for i, r in enumerate(results) if not finished(r)]
        while active:
            with drafter_context() if drafter_context is not None else contextlib.nullcontext():
                drafts = _propose(drafter, [sequences[i] for i in active], [contexts[i] for i in active], device)
            # Verification: one forward over sequence + drafts; the target's token after x_t .. d_{B-1}.
            candidates = [sequences[i] + draft for i, draft in zip(active, drafts)]
            positions = [list(range(len(sequences[i]) - 1, len(sequences[i]) - 1 + block)) for i in active]
            features, greedy = _target_forward(target, candidates, taps, positions, gdn_backend)
            greedy = greedy.tolist()
            still = []
            for row, i in enumerate(active):
                draft, truth = drafts[row], greedy[row]
                accepted = 0
                while accepted < block - 1 and draft[accepted] == truth[accepted]:
                    accepted += 1
                new = draft[:accepted] + [truth[accepted]]
                result = results[i]
                new = new[: max_new_tokens - len(result.tokens)]
                if eos_id is not None and eos_id in new:
                    new = new[: new.index(eos_id) + 1]
                # context of the next block: features of positions < its anchor (the newest token),
                # all computed by this forward (positions 0 .. t + accepted hold the new sequence)
                contexts[i] = [f[row, : len(sequences[i]) + accepted] for f in features]
                sequences[i].extend(new)
                result.tokens.extend(new)
                result.accepted_per_forward.append(len(new))
                result.target_forwards += 1
                if not finished(result):
                    still.append(i)
                else:
                    contexts[i] = []
            active = still
    return results


def speculative_decode(
    target: Any,
    drafter: Any,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    eos_id: int | None = None,
    *,
    gdn_backend: str = "auto",
) -> SpeculativeResult:
    """Greedy speculative decoding of one prompt (see the module docstring): the drafter proposes
    ``B - 1`` tokens from the target's context features, the target verifies them in one forward, the
    longest matching prefix plus the target's own next token is accepted. The tokens equal
    :func:`greedy_decode`'s.

    ``drafter`` is a :class:`~harness.models.drafter.DFlashDrafter` over ``target`` (or anything with
    its ``block_size``, ``target_layer_ids`` and ``forward(batch, target_hidden_states, anchors=...)``
    returning ``.logits`` ``[blocks, B - 1, vocab]``).
    """
    return speculative_decode_batch(target, drafter, [prompt_ids], max_new_tokens, eos_id,
                                    gdn_backend=gdn_backend)[0]


def evaluate_acceptance(
    target: Any,
    drafter: Any,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int = 32,
    *,
    eos_id: int | None = None,
    batch_size: int = 16,
    gdn_backend: str = "auto",
    drafter_context: Callable[[], contextlib.AbstractContextManager] | None = None,
) -> dict[str, Any]:
    """Real acceptance of ``drafter`` on ``prompts``: greedy speculative decoding against ``target``
    (``drafter_context``: see :func:`speculative_decode_batch`).

    Returns:
        ``eval_tau_real``: mean tokens gained per verification forward, over all verification
        forwards of all prompts (the acceptance length a speculative decoder reaches; 1 .. B).
        ``eval_tau_real_hist``: ``[count of forwards that gained 1, 2, ..., B tokens]``.
        ``eval_speedup_bound``: new tokens per target forward, the prefill included (plain greedy
        makes one target forward per token): the speed-up over plain greedy decoding that this
        acceptance allows at best. It does not count the drafter's own cost (one drafter forward per
        round), nor that a verification forward over ``B`` new positions costs more than a one-token
        decoding step; it is a bound, not a measured speed-up.
        ``eval_prompts``: number of prompts; ``eval_real_tokens``, ``eval_real_target_forwards``:
        the totals behind the ratios; ``eval_real_time_s``: wall time of the decoding;
        ``eval_accepted_per_prompt``: per prompt, the tokens each of its verification forwards gained.

    Runs under ``torch.no_grad`` with the modules in eval mode; the drafter's training mode is
    restored afterwards. Prompts are decoded ``batch_size`` at a time (padded rows, independent).
    """
    if isinstance(batch_size, bool) or int(batch_size) < 1:
        raise ValueError(f"batch_size={batch_size!r}: give at least 1")
    block = int(drafter.block_size)
    start = time.perf_counter()
    results: list[SpeculativeResult] = []
    with _inference(target, drafter):
        for first in range(0, len(prompts), int(batch_size)):
            results.extend(speculative_decode_batch(
                target, drafter, prompts[first : first + int(batch_size)], max_new_tokens, eos_id,
                gdn_backend=gdn_backend, drafter_context=drafter_context))
    return acceptance_summary(results, block, len(prompts), time.perf_counter() - start)


def acceptance_summary(results: Sequence[SpeculativeResult], block: int, prompts: int,
                       elapsed: float) -> dict[str, Any]:
    """:func:`evaluate_acceptance`'s numbers from the prompts' results (live, or replayed: harness.eval.replay)."""
    gains = [g for r in results for g in r.accepted_per_forward]
    hist = [0] * block
    for gain in gains:
        hist[gain - 1] += 1
    tokens = sum(len(r.tokens) for r in results)
    forwards = sum(r.target_forwards for r in results)
    return {
        "eval_tau_real": sum(gains) / len(gains) if gains else math.nan,
        "eval_tau_real_hist": hist,
        "eval_speedup_bound": tokens / forwards if forwards else math.nan,
        "eval_prompts": prompts,
        "eval_real_tokens": tokens,
        "eval_real_target_forwards": forwards,
        "eval_real_time_s": elapsed,
        "eval_accepted_per_prompt": [list(r.accepted_per_forward) for r in results],
    }
