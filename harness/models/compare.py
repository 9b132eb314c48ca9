"""The one measure every parity check uses: the largest difference relative to the reference's scale."""

from __future__ import annotations

from typing import Any

import torch


def max_relative_difference(value: Any, reference: Any) -> float:
    """``max |value - reference| / max |reference|`` in float64 (the absolute difference when the
    reference is all zero, so a zero reference never hides a difference behind a NaN)."""
    value = torch.as_tensor(value).detach().double().cpu()
    reference = torch.as_tensor(reference).detach().double().cpu()
    scale = reference.abs().max()
    difference = (value - reference).abs().max()
    if float(scale) == 0.0:
        return float(difference)
    return float(difference / scale)
