"""τ real without the target at every evaluation: greedy speculative decoding replayed on a cached continuation.

With greedy verification, every token speculative decoding keeps is the target's own greedy token (the accepted
drafts match it, and the round's last token is the target's): the decoded sequence *is* the target's greedy
continuation, whatever the drafter proposes. Only how many tokens each round gains depends on the drafter. So the
target's part can be computed once per run (:func:`prepare_replay`): each prompt's greedy continuation (transformers'
``generate`` with its KV cache, :func:`harness.eval.regenerate.decode_rows`) and the target's tapped features over
prompt + continuation (one forward; the target is causal, so a position's features are those a verification
forward computes there). Then each evaluation replays the schedule of :func:`~harness.eval.speculative
.speculative_decode_batch` with the drafter alone (:func:`replay_acceptance`): anchor on the newest token, draft
``B - 1`` tokens from the features of the positions before it, accept the longest prefix that matches the
continuation plus the token after it, move on. The accepted lengths equal live decoding's (tests: against
:func:`~harness.eval.speculative.speculative_decode_batch`, whose tokens equal plain greedy decoding's); a real
target's forward, the costly part, runs once per run instead of once per round per evaluation.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from harness.data import cache

from harness.eval.speculative import (
    SpeculativeResult,
    _check_request,
    _inference,
    _propose,
    _token_batch,
    acceptance_summary,
)

__all__ = ["ReplayPrompt", "cached_replay", "prepare_replay", "replay_acceptance", "replay_decode"]


@dataclass
class ReplayPrompt:
    """One prompt's cached target side: ``tokens`` = prompt + the target's greedy continuation, and the target's
    tapped outputs over them (``features[i]`` ``[len(tokens), D]``, tap ``i``)."""

    tokens: list[int]
    prompt_length: int
    features: list[torch.Tensor]


@torch.no_grad()
def prepare_replay(target: Any, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                   tap_layer_ids: Sequence[int], *, eos_id: int | None = None, batch_size: int = 16,
                   gdn_backend: str = "auto") -> list[ReplayPrompt]:
    """The target's part of greedy speculative decoding of ``prompts`` (module docstring), computed once."""
    from harness.eval.regenerate import RegenerateSettings, decode_rows

    checked = [_check_request(p, max_new_tokens) for p in prompts]
    settings = RegenerateSettings(max_new_tokens=int(max_new_tokens), eos_id=eos_id)
    continuations = decode_rows(target, checked, [int(max_new_tokens)] * len(checked), settings,
                                batch_size=batch_size) if max_new_tokens else [[] for _ in checked]
    out = []
    with _inference(target):
        for first in range(0, len(checked), batch_size):
            rows = list(range(first, min(first + batch_size, len(checked))))
            sequences = [checked[r] + continuations[r] for r in rows]
            features = target(_token_batch(sequences, target.device), tap_layer_ids=list(tap_layer_ids),
                              gdn_backend=gdn_backend).hidden_states
            out.extend(ReplayPrompt(sequence, len(checked[r]), [f[row, :len(sequence)] for f in features])
                       for row, (r, sequence) in enumerate(zip(rows, sequences)))
    return out


#: the cache entries of :func:`cached_replay` (``replay-<key>``) and the file inside one
REPLAY_PREFIX = "replay"
REPLAY_FILE = "replay.pt"


def replay_key(identity: dict[str, Any], prompts: Sequence[Sequence[int]], max_new_tokens: int,
               tap_layer_ids: Sequence[int], **options: Any) -> str:
    """The cache key of :func:`cached_replay`: every one of its arguments but the cache and the target's builder."""
    return cache.digest({"target": identity, "prompts": [[int(t) for t in p] for p in prompts],
                         "max_new_tokens": int(max_new_tokens), "taps": [int(t) for t in tap_layer_ids],
                         "options": options, "version": 1})


def cached_replay(cache_dir: Path, identity: dict[str, Any], target: Callable[[], Any], prompts: Sequence[Sequence[int]],
                  max_new_tokens: int, tap_layer_ids: Sequence[int], **options: Any) -> list[ReplayPrompt]:
    """:func:`prepare_replay` once for every run that asks the same: built into the batchlab cache (atomic, under its
    lock) and read back by the next run. ``identity`` names everything the target's side depends on besides the
    prompts, tokens and taps (the target's checkpoint or config, dtype, device, kernels); ``target()`` gives the
    target, called only on a miss."""
    key = replay_key(identity, prompts, max_new_tokens, tap_layer_ids, **options)

    def build(tmp: Path) -> dict[str, Any]:
        replay = prepare_replay(target(), prompts, max_new_tokens, tap_layer_ids, **options)
        torch.save([(r.tokens, r.prompt_length, [f.cpu() for f in r.features]) for r in replay], tmp / REPLAY_FILE)
        return {"prompts": len(replay), "max_new_tokens": int(max_new_tokens)}

    entry, _, _ = cache.ensure_entry(Path(cache_dir), REPLAY_PREFIX, key, build)
    return [ReplayPrompt(tokens, length, features)
            for tokens, length, features in torch.load(entry / REPLAY_FILE, weights_only=True)]


def replay_decode(drafter: Any, prompts: Sequence[ReplayPrompt], max_new_tokens: int,
                  eos_id: int | None = None) -> list[SpeculativeResult]:
    """:func:`~harness.eval.speculative.speculative_decode_batch`'s rounds on cached prompts: the same tokens and
    accepted lengths, one drafter forward a round for all unfinished prompts and no target forward."""
    block = int(drafter.block_size)
    device = prompts[0].features[0].device if prompts else torch.device("cpu")
    results = []
    for prompt in prompts:
        result = SpeculativeResult()
        continuation = prompt.tokens[prompt.prompt_length:]
        if max_new_tokens and continuation:
            result.tokens.append(continuation[0])  # the prefill's token
            result.target_forwards = 1
        results.append(result)

    def finished(i: int) -> bool:
        tokens, available = results[i].tokens, len(prompts[i].tokens) - prompts[i].prompt_length
        return (not tokens or len(tokens) >= min(max_new_tokens, available)
                or (eos_id is not None and tokens[-1] == eos_id))

    active = [i for i in range(len(results)) if not finished(i)]
    with _inference(drafter):
        while active:
            sequences = [prompts[i].tokens[:prompts[i].prompt_length + len(results[i].tokens)] for i in active]
            contexts = [[f[:len(s) - 1] for f in prompts[i].features] for i, s in zip(active, sequences)]
            drafts = _propose(drafter, sequences, contexts, device)
            still = []
            for i, sequence, draft in zip(active, sequences, drafts):
                prompt, result = prompts[i], results[i]
                truth = prompt.tokens[len(sequence):len(sequence) + block]  # the continuation after the anchor
                accepted = 0
                while accepted < min(block - 1, len(truth) - 1) and draft[accepted] == truth[accepted]:
                    accepted += 1
                new = truth[:accepted + 1][: max_new_tokens - len(result.tokens)]
                if eos_id is not None and eos_id in new:
                    new = new[: new.index(eos_id) + 1]
                result.tokens.extend(new)
                result.accepted_per_forward.append(len(new))
                result.target_forwards += 1
                if not finished(i):
                    still.append(i)
            active = still
    return results


def replay_acceptance(drafter: Any, prompts: Sequence[ReplayPrompt], max_new_tokens: int, *,
                      eos_id: int | None = None, batch_size: int = 16) -> dict[str, Any]:
    """:func:`~harness.eval.speculative.evaluate_acceptance`'s numbers from the cached prompts (no target)."""
    start = time.perf_counter()
    results: list[SpeculativeResult] = []
    for first in range(0, len(prompts), int(batch_size)):
        results.extend(replay_decode(drafter, prompts[first:first + int(batch_size)], max_new_tokens, eos_id))
    return acceptance_summary(results, int(drafter.block_size), len(prompts), time.perf_counter() - start)
