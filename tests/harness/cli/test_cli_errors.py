"""Bad input at the argparse commands (batchlab-pretrain-target, batchlab-regenerate, batchlab-plan,
batchlab-report): one line on stderr naming the input, the value and the fix, exit status 2, the traceback
only behind --verbose; nothing is built."""

from __future__ import annotations

import pytest

from harness.cli import plan as plan_cli
from harness.cli import pretrain_target as pretrain_cli
from harness.cli import regenerate as regenerate_cli
from harness.cli import report as report_cli

COMMANDS = {"pretrain": pretrain_cli.main, "regenerate": regenerate_cli.main, "plan": plan_cli.main,
            "report": report_cli.main}

CASES = [
    ("pretrain", ["--target", "nope.yaml"], "--target nope.yaml: no such target config"),
    ("pretrain", ["--tokens", "0"], "argument --tokens: 0 is too small: give a number >= 1"),
    ("pretrain", ["--lr=-1e-3"], "argument --lr: -1e-3 is too small: give a number > 0"),
    ("pretrain", ["--vocab-size", "10"], "argument --vocab-size: 10 is too small: give a number >= 258"),
    ("pretrain", ["--max-documents", "many"], "'many': give a positive number of documents, or 'all'"),
    ("regenerate", ["--source", "nope.jsonl"], "data.source='nope.jsonl' does not exist; give 'stdlib'"),
    ("regenerate", ["--target", "{tmp}"], "not a checkpoint directory (no config.json)"),
    ("regenerate", ["--target", "{tmp}/nothing"], "no such checkpoint directory or target config"),
    ("regenerate", ["--temperature", "-1"], "argument --temperature: -1 is too small: give a number >= 0"),
    ("regenerate", ["--batch-size", "x"], "argument --batch-size: 'x' is not an integer"),
    ("plan", ["--lengths", "nope.txt"], "lengths source 'nope.txt' does not exist"),
    ("plan", ["--profile", "chat-902k", "--bogus"], "unrecognized arguments: --bogus"),
    ("report", ["{tmp}/no-sweep"], "no-sweep: no such directory"),
]


@pytest.mark.parametrize(("command", "argv", "message"), CASES, ids=[f"{c}-{a[0].split('=')[0]}" for c, a, _ in CASES])
def test_bad_input_is_one_line_and_exit_status_2(command, argv, message, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("BATCHLAB_CACHE", str(tmp_path / "cache"))
    argv = [a.format(tmp=tmp_path) for a in argv]
    try:
        status = COMMANDS[command](argv)
    except SystemExit as exit_request:  # argparse's own errors exit
        status = exit_request.code
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert status == 2, err
    assert len(lines) == 1 and message in lines[0] and "error:" in lines[0], err
    assert "Traceback" not in err
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())  # nothing built


def test_verbose_adds_the_traceback(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("BATCHLAB_CACHE", str(tmp_path / "cache"))
    assert regenerate_cli.main(["--source", "nope.jsonl", "--verbose"]) == 2
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and "FileNotFoundError" in err
    assert err.strip().splitlines()[-1].startswith("batchlab-regenerate: error: data.source='nope.jsonl'")
