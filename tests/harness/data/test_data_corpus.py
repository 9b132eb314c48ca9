"""The embedded corpus: definitions split into prompt/completion, tokenized with a trained BPE."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest

from harness.data.config import DataConfig
from harness.data.corpus import (
    CodeDocument,
    build_corpus,
    corpus_files,
    extract_documents,
    module_name,
    select_documents,
)
from harness.data.corpus_cache import corpus_documents
from harness.data.errors import DataValidationError
from harness.data.samples import load_samples
from harness.data.tokenizer import load_tokenizer

MODULE = '''\
"""Module docstring: not a definition."""
import functools

CONSTANT = "café"  # non-ASCII before the definitions: ast columns are UTF-8 bytes


@functools.lru_cache(maxsize=None)
@staticmethod
def decorated(x, y=lambda z: z[1:2]) -> dict[str, int]:
    """Docstring with a colon: here.

    Second paragraph.
    """
    total = {"é": x}  # body with non-ASCII
    return total


def no_docstring(a: int,
                 b: "str" = ":") -> None:  # multi-line header
    print(a, b)


async def coroutine():
    \'\'\'Single-quoted docstring.\'\'\'
    await something()


def one_liner(): return 1


def docstring_only():
    """Nothing else: skipped (no completion)."""


class Klass(Base, metaclass=Meta):
    """A class."""

    attribute = 1

    def method(self):
        return self.attribute


class Empty: pass


if True:
    def nested_not_top_level():
        return 2
'''


def _write(root: Path, relative: str, text: str) -> Path:
    path = root / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    root = tmp_path / "lib"
    _write(root, "mod.py", MODULE)
    _write(root, "pkg/__init__.py", "def init_func(x):\n    return x + 1\n")
    _write(root, "pkg/sub.py", "".join(f"def f{i}(x):\n    return x * {i} + {i}\n\n" for i in range(30)))
    _write(root, "broken.py", "def broken(:\n    pass\n")
    _write(root, "pkg/tests/test_x.py", "def test_excluded():\n    return 1\n")
    _write(root, "idlelib/x.py", "def excluded():\n    return 1\n")
    return root


def _segment(source: str, node: ast.AST) -> str:
    """The definition's source: decorators + ast.get_source_segment."""
    lines = source.split("\n")
    first = node.decorator_list[0].lineno if node.decorator_list else node.lineno
    decorators = "\n".join(lines[first - 1 : node.lineno - 1])
    segment = ast.get_source_segment(source, node)
    return (decorators + "\n" + segment) if decorators else segment


def test_prompt_completion_reconstruct_definitions():
    tree = ast.parse(MODULE)
    documents = {d.name: d for d in extract_documents(MODULE, "mod")}
    definitions = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
    assert set(documents) == {n.name for n in definitions} - {"docstring_only"}
    for node in definitions:
        if node.name in documents:
            document = documents[node.name]
            assert document.prompt + document.completion == _segment(MODULE, node), node.name
            assert document.module == "mod"
    decorated = documents["decorated"]
    assert decorated.prompt.startswith("@functools.lru_cache(maxsize=None)\n@staticmethod\ndef decorated(")
    assert decorated.prompt.endswith('Second paragraph.\n    """\n')  # docstring goes into the prompt
    assert decorated.completion.startswith('    total = {"é": x}')
    assert documents["no_docstring"].prompt == 'def no_docstring(a: int,\n                 b: "str" = ":") -> None:'
    assert documents["no_docstring"].completion.startswith("  # multi-line header\n    print")
    assert documents["coroutine"].prompt == "async def coroutine():\n    '''Single-quoted docstring.'''\n"
    assert documents["one_liner"] == CodeDocument("mod", "one_liner", "def one_liner():", " return 1")
    assert documents["Klass"].prompt == 'class Klass(Base, metaclass=Meta):\n    """A class."""\n'
    assert documents["Empty"].prompt == "class Empty:"


def test_files_modules_and_skips(tree: Path):
    files = [p.relative_to(tree).as_posix() for p in corpus_files(tree)]
    assert files == ["broken.py", "mod.py", "pkg/__init__.py", "pkg/sub.py"]  # sorted, excluded dirs gone
    assert module_name(tree / "pkg/__init__.py", tree) == "pkg"
    assert module_name(tree / "pkg/sub.py", tree) == "pkg.sub"
    documents, stats = build_corpus(tree, progress=False)
    assert stats.skipped_files == [str(tree / "broken.py")]
    assert stats.files == 3 and stats.skipped_empty == 1
    assert documents[0].module == "mod" and documents[0].name == "decorated"  # corpus order
    assert [d.name for d in documents if d.module == "pkg"] == ["init_func"]
    assert len(documents) == stats.documents == 6 + 1 + 30


def test_subset_is_seeded_and_keeps_order(tree: Path):
    documents, _ = build_corpus(tree, progress=False)
    first = select_documents(documents, 10, subset_seed=0)
    assert first == select_documents(documents, 10, subset_seed=0)
    other = select_documents(documents, 10, subset_seed=1)
    assert [d.name for d in first] != [d.name for d in other]
    positions = [documents.index(d) for d in first]
    assert positions == sorted(positions) and len(first) == 10
    assert select_documents(documents, None, 0) == documents
    assert select_documents(documents, 1000, 0) == documents


def _check_tokenized(samples, documents_by_key, vocab_size):
    tokenizer = load_tokenizer(samples.tokenizer_path)
    assert samples.vocab_size == tokenizer.get_vocab_size() <= vocab_size
    names = samples.dataset["name"]
    modules = samples.dataset["module"]
    for row in range(len(samples)):
        ids, mask = samples.sample(row)
        assert ids.dtype == np.int64 and mask.dtype == bool and ids.shape == mask.shape
        assert ids.size == samples.lengths[row]
        assert ids.min() >= 0 and ids.max() < vocab_size
        document = documents_by_key[(modules[row], names[row])]
        # mask is 0 exactly over the prompt's tokens, 1 over the completion's
        prompt_tokens = int((~mask).sum())
        assert not mask[:prompt_tokens].any() and mask[prompt_tokens:].all()
        assert tokenizer.decode(ids[:prompt_tokens].tolist()) == document.prompt
        assert tokenizer.decode(ids[prompt_tokens:].tolist()) == document.completion


def test_load_samples_on_a_small_tree(tree: Path, tmp_path: Path):
    cfg = DataConfig(max_documents=12, vocab_size=300, cache_dir=str(tmp_path / "cache"))
    samples = load_samples(cfg, progress=False, corpus_root=str(tree))
    documents, _ = build_corpus(tree, progress=False)
    assert len(samples) == 12
    _check_tokenized(samples, {(d.module, d.name): d for d in documents}, 300)
    chosen = select_documents(documents, 12, 0)
    assert list(samples.dataset["name"]) == [d.name for d in chosen]
    assert samples.lengths.dtype == np.int64
    again = load_samples(cfg, progress=False, corpus_root=str(tree))
    assert again.fingerprint == samples.fingerprint
    reseeded = load_samples(
        DataConfig(max_documents=12, vocab_size=300, subset_seed=5, cache_dir=cfg.cache_dir),
        progress=False, corpus_root=str(tree),
    )
    assert reseeded.fingerprint != samples.fingerprint
    assert list(reseeded.dataset["name"]) != list(samples.dataset["name"])
    # the build is deterministic: another cache directory gives the same tokens and fingerprint
    elsewhere = load_samples(
        DataConfig(max_documents=12, vocab_size=300, cache_dir=str(tmp_path / "other")),
        progress=False, corpus_root=str(tree),
    )
    assert elsewhere.fingerprint == samples.fingerprint
    assert [elsewhere.sample(i)[0].tolist() for i in range(12)] == [samples.sample(i)[0].tolist() for i in range(12)]
    with pytest.raises(DataValidationError, match="data.split='train' applies only to a DatasetDict"):
        load_samples(DataConfig(split="train", cache_dir=cfg.cache_dir), progress=False, corpus_root=str(tree))


@pytest.fixture(scope="module")
def stdlib_cache(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("stdlib-cache"))


def test_real_stdlib_small_slice(stdlib_cache: str):
    cfg = DataConfig(max_documents=16, vocab_size=512, cache_dir=stdlib_cache)
    samples = load_samples(cfg, progress=False)
    assert len(samples) == 16 and "stdlib corpus" in samples.source
    documents, summary = corpus_documents(cfg, progress=False)  # the parse cached by load_samples
    assert summary["files"] > 100 and len(documents) > 1000
    assert not any(d.module.split(".")[0] in ("tkinter", "idlelib", "test", "lib2to3") for d in documents)
    _check_tokenized(samples, {(d.module, d.name): d for d in documents}, 512)
    assert samples.tokenizer_path.endswith("tokenizer.json")
    assert len(samples.fingerprint) == 64
