"""Launching a run: its directory, its ranks and what they report when one fails."""
