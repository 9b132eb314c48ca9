"""The embedded chat corpus (``data.source=stdlib-chat``): conversations and a chat tokenizer built locally.

The same definitions as the embedded corpus (``data.max_documents``, ``data.subset_seed``) become
conversations in the OpenAI schema: a system prompt, the user giving a definition's header and docstring,
the assistant answering with its body; every third conversation holds two rounds (the next definition as
a second question), so multi-turn masks are exercised. The tokenizer is the embedded byte-level BPE
(trained with ``data.vocab_size - 2`` tokens) plus the two ChatML markers, in a Hugging Face
tokenizer directory whose chat template has ``{% generation %}`` markers and refuses turns that do not
alternate: the conversations then go through the same ``apply_chat_template`` path as a user's own
(:mod:`harness.data.chat.encode`). ``data.vocab_size`` is the chat tokenizer's whole vocabulary.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from harness.data import cache
from harness.data.config import DataConfig
from harness.data.corpus import select_documents
from harness.data.corpus_cache import corpus_documents, stdlib_samples
from harness.data.tokenizer import EOS_TOKEN, PAD_TOKEN

FORMAT_VERSION = 1
PREFIX = "stdlib-chat"
CONVERSATIONS_FILE = "conversations.jsonl"
TOKENIZER_DIR = "tokenizer"
CHAT_TOKENS = ("<|im_start|>", "<|im_end|>")
SYSTEM_PROMPT = "You complete Python definitions in the style of the standard library."
#: ChatML with generation markers around the assistant's reply (and its end marker), which it trains on
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if loop.index0 > 0 and message['role'] != 'system' and message['role'] == messages[loop.index0 - 1]['role'] -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['role'] == 'assistant' -%}"
    "{% generation %}{{- message['content'] + '<|im_end|>' -}}{% endgeneration %}{{- '\\n' -}}"
    "{%- else -%}"
    "{{- message['content'] + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def stdlib_chat(cfg: DataConfig, progress: bool = True) -> tuple[Path, Path, str]:
    """``(conversations.jsonl, tokenizer directory, cache key)`` of the embedded chat corpus (built once)."""

    base = replace(cfg, source="stdlib", vocab_size=cfg.vocab_size - len(CHAT_TOKENS), format="auto")
    bpe = stdlib_samples(base, progress=progress)  # the same definitions, the embedded BPE
    key = cache.digest({"format": FORMAT_VERSION, "samples": bpe.key, "template": CHAT_TEMPLATE,
                        "system": SYSTEM_PROMPT})

    def build(tmp: Path) -> dict:
        from transformers import PreTrainedTokenizerFast

        documents, _ = corpus_documents(cfg, progress)
        chosen = select_documents(documents, cfg.max_documents, cfg.subset_seed)
        conversations = _conversations(chosen)
        with (tmp / CONVERSATIONS_FILE).open("w") as out:
            out.writelines(json.dumps({"messages": turns}) + "\n" for turns in conversations)
        tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(bpe.tokenizer_path), eos_token=CHAT_TOKENS[1],
                                            pad_token=PAD_TOKEN, additional_special_tokens=list(CHAT_TOKENS),
                                            bos_token=None, unk_token=None)
        tokenizer.chat_template = CHAT_TEMPLATE
        tokenizer.save_pretrained(str(tmp / TOKENIZER_DIR))
        return {"conversations": len(conversations), "definitions": len(chosen), "vocab_size": len(tokenizer),
                "bpe": str(bpe.path), "end_of_text": EOS_TOKEN}

    entry, meta, _ = cache.ensure_entry(cfg.resolved_cache_dir(), PREFIX, key, build)
    if meta["vocab_size"] != cfg.vocab_size:
        raise ValueError(f"the embedded chat tokenizer has {meta['vocab_size']} tokens, not data.vocab_size="
                         f"{cfg.vocab_size} (the corpus allows fewer BPE merges); set data.vocab_size="
                         f"{meta['vocab_size']}")
    return entry / CONVERSATIONS_FILE, entry / TOKENIZER_DIR, key


def _conversations(documents: list) -> list[list[dict[str, str]]]:
    """One conversation per definition, every third with the next definition as a second round."""
    conversations, index = [], 0
    while index < len(documents):
        rounds = 2 if len(conversations) % 3 == 2 and index + 1 < len(documents) else 1
        turns = [{"role": "system", "content": SYSTEM_PROMPT}]
        for document in documents[index:index + rounds]:
            turns += [{"role": "user", "content": f"Complete this definition from {document.module}:\n"
                                                  f"{document.prompt}"},
                      {"role": "assistant", "content": document.completion}]
        conversations.append(turns)
        index += rounds
    return conversations
