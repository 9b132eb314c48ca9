"""Conversations: read and checked (read), rendered and tokenized with a chat template (encode), and the embedded
corpus as conversations (corpus)."""
