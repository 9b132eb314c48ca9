"""Plain text: a ``text`` column tokenized by the user's tokenizer (no chat template needed), every bad row reported
in one pass or dropped, the same counts for batchlab-plan as for the run, the vocabulary from the tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.data.config import DataConfig
from harness.data.samples import load_samples
from harness.data.text_tokenize import TextError

TEXTS = ["def f(x):\n    return x + 1", "Sorting in place: list.sort().", "A longer line of plain text " * 5]


@pytest.fixture(scope="module")
def plain_tokenizer(batchlab_cache, tmp_path_factory) -> Path:
    """The embedded chat tokenizer without its chat template (text needs none), grown past 1,024 tokens."""
    from transformers import AutoTokenizer

    embedded = load_samples(DataConfig(source="stdlib-chat", max_documents=40, vocab_size=514), progress=False)
    tokenizer = AutoTokenizer.from_pretrained(str(embedded.tokenizer_path), local_files_only=True)
    tokenizer.chat_template = None
    tokenizer.add_tokens([f"<extra_{i}>" for i in range(1200)])
    target = tmp_path_factory.mktemp("tokenizer") / "plain"
    tokenizer.save_pretrained(target)
    (target / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((target / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (target / "tokenizer_config.json").write_text(json.dumps(config))
    return target


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


def load(path: Path, tokenizer: Path, **options):
    return load_samples(DataConfig(source=str(path), tokenizer=str(tokenizer), vocab_size=4096, max_documents=None,
                                   cache_dir=str(path.parent / "cache"), **options), progress=False)


def test_texts_are_tokenized_by_the_tokenizer_and_trained_on_every_token_but_the_first(plain_tokenizer, tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(plain_tokenizer), local_files_only=True)
    samples = load(write_lines(tmp_path / "texts.jsonl", [json.dumps({"text": t, "id": i})
                                                           for i, t in enumerate(TEXTS)]), plain_tokenizer)
    assert len(samples) == 3 and "3 texts ('text' column)" in samples.source
    for row, text in enumerate(TEXTS):
        ids, mask = samples.sample(row)
        assert ids.tolist() == tokenizer(text)["input_ids"]
        assert mask.tolist() == [0] + [1] * (len(ids) - 1)
    assert samples.vocab_size == len(tokenizer)


def test_every_bad_text_row_is_reported_in_one_pass_and_dropped_on_request(plain_tokenizer, tmp_path):
    path = write_lines(tmp_path / "texts.jsonl", [
        json.dumps({"text": TEXTS[0]}),
        json.dumps({"text": 123}),  # line 2: not text
        json.dumps({"text": "   "}),  # line 3: empty
        json.dumps({"body": "x"}),  # line 4: no text key
        '{"text": "cut',  # line 5: not JSON
        json.dumps({"text": TEXTS[1]}),
    ])
    with pytest.raises(TextError) as refused:
        load(path, plain_tokenizer)
    report = str(refused.value)
    assert "4 of 6 rows are bad" in report and "nothing was tokenized" in report
    for where in ("line 2: 'text' is int '123', not text", "line 3: empty text", "line 4 has no 'text' key",
                  "line 5 is not valid JSON"):
        assert where in report, where
    for kind in ("content that is not text", "empty text", "no text key", "not valid JSON"):  # each kind's heading
        assert f"  {kind}, 1:" in report, kind
    assert "conversation" not in report
    assert not list((tmp_path / "cache").glob("text-*/data.arrow"))
    kept = load(path, plain_tokenizer, bad_rows="drop")
    assert len(kept) == 2 and "4 bad dropped" in kept.source


def test_plan_counts_text_tokens_as_the_run_does_and_refuses_text_without_a_tokenizer(plain_tokenizer, tmp_path,
                                                                                      capsys):
    from harness.cli.plan import main as plan_main

    path = write_lines(tmp_path / "texts.jsonl", [json.dumps({"text": t}) for t in TEXTS * 10])
    assert plan_main(["--lengths", str(path), "--epochs", "1"]) == 2
    assert "column 'text' holds text; lengths are token counts: give --tokenizer PATH" in capsys.readouterr().err
    assert plan_main(["--lengths", str(path), "--tokenizer", str(plain_tokenizer), "--max-tokens", "256",
                      "--epochs", "1", "--json", "--strategies", "sorted"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    trained = load(path, plain_tokenizer)
    assert row["real_tokens"] == int(trained.lengths.sum()) and row["samples_planned"] == 30


def test_a_random_weight_target_takes_the_text_tokenizers_vocabulary(plain_tokenizer, tmp_path):
    from harness.train.config import compose_run_config
    from harness.train.launch.run import prepared_config

    path = write_lines(tmp_path / "texts.jsonl", [json.dumps({"text": t}) for t in TEXTS])
    config = prepared_config(compose_run_config(["logger=none", f"data.source={path}",
                                                 f"data.tokenizer={plain_tokenizer}"]))
    from transformers import AutoTokenizer

    size = len(AutoTokenizer.from_pretrained(str(plain_tokenizer), local_files_only=True))
    assert config["data"]["vocab_size"] == config["target"]["vocab_size"] == size > 1024  # no chat template needed


def test_a_tokenizer_over_a_source_with_input_ids_is_refused(plain_tokenizer, tmp_path, capsys):
    """A run trains on a source's input_ids when it has them: planning its text with --tokenizer would count other
    tokens, so the combination is refused, naming the fix."""
    from harness.cli.plan import main as plan_main

    path = write_lines(tmp_path / "both.jsonl", [json.dumps({"input_ids": [1, 2, 3], "text": t}) for t in TEXTS])
    assert plan_main(["--lengths", str(path), "--tokenizer", str(plain_tokenizer), "--epochs", "1"]) == 2
    assert "has an input_ids column: a training run uses those token ids" in capsys.readouterr().err
