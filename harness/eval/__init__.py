"""Evaluation against the target itself: real acceptance by greedy speculative decoding.

:mod:`harness.eval.speculative` decodes held-out prompts with the drafter proposing and the target
verifying, and reports the acceptance length the decoder actually reaches (``eval_tau_real``), next
to the teacher-forced τ of training.
"""

from harness.eval.prompts import heldout_prompts
from harness.eval.speculative import (
    SpeculativeResult,
    evaluate_acceptance,
    greedy_decode,
    speculative_decode,
    speculative_decode_batch,
)

__all__ = [
    "SpeculativeResult",
    "evaluate_acceptance",
    "greedy_decode",
    "heldout_prompts",
    "speculative_decode",
    "speculative_decode_batch",
]
