"""Errors of the data layer."""

from __future__ import annotations


class DataValidationError(ValueError):
    """Samples the trainer cannot use. The message names the row, the field and the fix."""
