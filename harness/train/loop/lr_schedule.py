"""Learning rate as a function of tokens seen: linear warmup, then cosine to ``min_lr_ratio · lr``.

Written here rather than with ``torch.optim.lr_scheduler``: torch's schedulers count optimizer steps,
and strategies take different numbers of steps for the same tokens; counting tokens keeps one schedule
for every strategy of a sweep.
"""

from __future__ import annotations

import math

import torch


class TokenCosineSchedule:
    def __init__(self, optimizer: torch.optim.Optimizer, lr: float, total_tokens: int, warmup_fraction: float,
                 min_lr_ratio: float) -> None:
        self.optimizer = optimizer
        self.lr = lr
        self.total_tokens = max(int(total_tokens), 1)
        self.warmup_tokens = int(warmup_fraction * self.total_tokens)
        self.min_lr_ratio = min_lr_ratio
        self.set(0)

    def lr_at(self, tokens_seen: int) -> float:
        if self.warmup_tokens and tokens_seen < self.warmup_tokens:
            return self.lr * (tokens_seen + 1) / self.warmup_tokens
        span = max(self.total_tokens - self.warmup_tokens, 1)
        progress = min(max(tokens_seen - self.warmup_tokens, 0) / span, 1.0)
        cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.lr * (self.min_lr_ratio + (1.0 - self.min_lr_ratio) * cosine)

    def set(self, tokens_seen: int) -> float:
        """Set every param group's lr for a step that starts after ``tokens_seen`` tokens."""
        lr = self.lr_at(tokens_seen)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        return lr
