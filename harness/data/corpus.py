"""The embedded corpus: this interpreter's standard-library source, split into definitions.

Every top-level function and class of every standard-library module (test suites, GUI and legacy
packages excluded, see ``EXCLUDED_DIRS``) becomes one :class:`CodeDocument`:

- ``prompt`` = the decorators and the ``def``/``class`` header up to and including its colon (and
  the rest of that line when it holds only whitespace and the newline), plus the docstring when
  there is one;
- ``completion`` = the rest of the definition.

``prompt + completion`` is exactly the definition's source text, decorators included. Files that do
not decode or parse are skipped and counted; definitions with nothing after the prompt (a docstring
only) are skipped and counted as well, since they have nothing to supervise.

The corpus needs no download and is the same on every machine running the same Python build, so
runs are reproducible without a data set.
"""

from __future__ import annotations

import ast
import io
import os
import sysconfig
import tokenize
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

EXCLUDED_DIRS = frozenset(
    {
        "test",
        "tests",
        "idlelib",
        "tkinter",
        "turtledemo",
        "lib2to3",
        "site-packages",
        "dist-packages",
        "ensurepip",
        "__pycache__",
    }
)
DEFINITIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
_BRACKETS_OPEN = {"(", "[", "{"}
_BRACKETS_CLOSE = {")", "]", "}"}


@dataclass(frozen=True)
class CodeDocument:
    """One top-level definition.

    Attributes:
        module: dotted module name (``json.decoder``; a package's ``__init__`` is the package).
        name: the function or class name.
        prompt: decorators + header (+ docstring).
        completion: the rest of the body.
    """

    module: str
    name: str
    prompt: str
    completion: str

    @property
    def text(self) -> str:
        return self.prompt + self.completion


@dataclass
class CorpusStats:
    """What the builder saw: files read, skipped, definitions found and skipped."""

    files: int = 0
    skipped_files: list[str] = field(default_factory=list)
    documents: int = 0
    skipped_empty: int = 0

    def summary(self) -> dict:
        return {
            "files": self.files,
            "skipped_files": len(self.skipped_files),
            "documents": self.documents,
            "skipped_empty_completion": self.skipped_empty,
        }


def stdlib_root() -> Path:
    """The running interpreter's standard-library directory."""
    return Path(sysconfig.get_paths()["stdlib"])


def corpus_files(root: str | os.PathLike[str] | None = None) -> list[Path]:
    """The ``.py`` files of ``root`` (default: the stdlib) in sorted order, excluded dirs skipped."""
    root = stdlib_root() if root is None else Path(root)
    found: list[Path] = []
    for directory, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in EXCLUDED_DIRS]
        for name in files:
            if name.endswith(".py"):
                found.append(Path(directory) / name)
    return sorted(found, key=lambda path: path.relative_to(root).as_posix())


def module_name(path: Path, root: Path) -> str:
    """Dotted module name of ``path`` relative to ``root``."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts and parts[-1] == "__init__" and len(parts) > 1:
        parts = parts[:-1]
    return ".".join(parts)


def build_corpus(
    root: str | os.PathLike[str] | None = None,
    files: Sequence[str | os.PathLike[str]] | None = None,
    progress: bool = True,
) -> tuple[list[CodeDocument], CorpusStats]:
    """Parse ``files`` (default: every corpus file under ``root``, default the stdlib).

    Args:
        root: directory the module names are relative to (default: the stdlib).
        files: the files to read, in order (default: :func:`corpus_files` of ``root``).
        progress: show a tqdm bar on stderr.

    Returns:
        The documents in corpus order, and the builder's counts.
    """
    from tqdm import tqdm

    root = stdlib_root() if root is None else Path(root)
    paths = corpus_files(root) if files is None else [Path(f) for f in files]
    stats = CorpusStats()
    documents: list[CodeDocument] = []
    for path in tqdm(paths, desc="parsing corpus", unit=" files", disable=not progress, leave=False):
        try:
            with tokenize.open(path) as handle:
                source = handle.read()
            tree = ast.parse(source, filename=str(path))
        except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
            stats.skipped_files.append(str(path))
            continue
        stats.files += 1
        module = module_name(path, root)
        for document in extract_documents(source, module, tree=tree, stats=stats):
            documents.append(document)
    stats.documents = len(documents)
    return documents, stats


def extract_documents(
    source: str, module: str, tree: ast.Module | None = None, stats: CorpusStats | None = None
) -> Iterable[CodeDocument]:
    """The top-level definitions of one module's source (newlines already ``\\n``)."""
    if tree is None:
        tree = ast.parse(source)
    lines = source.split("\n")  # ast counts lines on \n only (form feeds are not line breaks)
    line_starts = np.zeros(len(lines) + 1, dtype=np.int64)
    np.cumsum([len(line) + 1 for line in lines], out=line_starts[1:])

    def offset(lineno: int, col_bytes: int) -> int:
        """Character offset in ``source`` of an ast (line, UTF-8 byte column) position."""
        line = lines[lineno - 1]
        col = len(line.encode("utf-8")[:col_bytes].decode("utf-8")) if not line.isascii() else col_bytes
        return int(line_starts[lineno - 1]) + col

    for node in tree.body:
        if not isinstance(node, DEFINITIONS):
            continue
        first_line = node.decorator_list[0].lineno if node.decorator_list else node.lineno
        start = int(line_starts[first_line - 1])  # top level: the '@' or 'def' starts its line
        end = offset(node.end_lineno, node.end_col_offset)
        segment = source[start:end]
        header = offset(node.lineno, node.col_offset) - start
        split = _header_end(segment, header)
        docstring = _docstring_node(node)
        if docstring is not None:
            split = max(split, offset(docstring.end_lineno, docstring.end_col_offset) - start)
        split = _through_line_end(segment, split)
        prompt, completion = segment[:split], segment[split:]
        if not completion.strip():
            if stats is not None:
                stats.skipped_empty += 1
            continue
        yield CodeDocument(module=module, name=node.name, prompt=prompt, completion=completion)


def select_documents(
    documents: Sequence[CodeDocument], max_documents: int | None, subset_seed: int
) -> list[CodeDocument]:
    """A seeded random subset of ``max_documents`` documents, kept in corpus order."""
    if max_documents is None or max_documents >= len(documents):
        return list(documents)
    rng = np.random.default_rng(subset_seed)
    chosen = np.sort(rng.choice(len(documents), size=max_documents, replace=False))
    return [documents[i] for i in chosen]


def _docstring_node(node: ast.AST) -> ast.Expr | None:
    body = getattr(node, "body", [])
    if (
        body
        and isinstance(body[0], ast.Expr)
        and isinstance(body[0].value, ast.Constant)
        and isinstance(body[0].value.value, str)
    ):
        return body[0]
    return None


def _header_end(segment: str, keyword_at: int) -> int:
    """Offset just past the colon that ends the header starting at ``keyword_at`` (``def``,
    ``async def`` or ``class``): the first ``:`` operator outside brackets."""
    depth = 0
    text = segment[keyword_at:]
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if token.type != tokenize.OP:
            continue
        if token.string in _BRACKETS_OPEN:
            depth += 1
        elif token.string in _BRACKETS_CLOSE:
            depth -= 1
        elif token.string == ":" and depth == 0:
            row, col = token.end  # 1-based row, character column
            position = 0
            for _ in range(row - 1):
                position = text.index("\n", position) + 1
            return keyword_at + position + col
    raise ValueError("definition header without a colon")  # pragma: no cover - ast parsed it


def _through_line_end(segment: str, split: int) -> int:
    """Move ``split`` past trailing spaces and the newline when only whitespace is left on the line."""
    position = split
    while position < len(segment) and segment[position] in " \t":
        position += 1
    if position < len(segment) and segment[position] == "\n":
        return position + 1
    return split
