"""Gated DeltaNet's document-aware pieces, for the hybrid target: the gated delta rule and its short convolution,
each restarting at every document of a packed row."""
