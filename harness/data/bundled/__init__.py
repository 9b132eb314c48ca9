"""The embedded default as shipped with the package: the tiny pretrained target and the completions it regenerated.

``data.source=bundled`` reads ``bundled/samples/`` (the stdlib corpus's prompts, each with the completion the target
regenerated greedily, tokenized; ``save_to_disk`` layout) and ``target.pretrained=bundled`` reads ``bundled/target/``
(a Hugging Face checkpoint). Both were built once by ``make bundle`` (:mod:`harness.cli.bundle`, the recipe
``data=stdlib-regenerated target=tiny-pretrained``) and are the same bytes on every machine, so a run on another CPU
differs from this one only in the drafter's own training: not in the corpus (which the running Python's standard
library would otherwise decide), the target's weights or its completions (which the CPU's rounding would otherwise
decide). ``manifest.json`` holds every file's sha256, the fingerprint over them, the recipe and the build's machine,
versions and date; :func:`verify` refuses a changed, missing or extra file by name before anything reads it.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

#: the value of ``data.source`` and ``target.pretrained`` that names the shipped artefact
BUNDLED = "bundled"
ROOT = Path(__file__).parent  # this package: the artefact lies beside its code
MANIFEST_FILE = "manifest.json"
SAMPLES_DIR = "samples"
TARGET_DIR = "target"
PARTS = (SAMPLES_DIR, TARGET_DIR)
TOKENIZER_FILE = "tokenizer.json"
REBUILD = "make bundle (python -m harness.cli.bundle --write)"


class BundleError(ValueError):
    """The shipped artefact is missing, or differs from its manifest."""


def samples_dir(root: Path = ROOT) -> Path:
    """The tokenized samples with regenerated completions (a ``save_to_disk`` directory)."""
    return Path(root) / SAMPLES_DIR


def target_dir(root: Path = ROOT) -> Path:
    """The tiny target's checkpoint directory (``config.json``, ``model.safetensors``, ``tokenizer.json``)."""
    return Path(root) / TARGET_DIR


def file_hashes(root: Path = ROOT) -> dict[str, str]:
    """``{relative path: sha256}`` of every file of the artefact's parts, sorted by path."""
    root = Path(root)
    hashes = {}
    for part in PARTS:
        for path in sorted((root / part).rglob("*")):
            if path.is_file():
                hashes[path.relative_to(root).as_posix()] = hashlib.sha256(path.read_bytes()).hexdigest()
    return dict(sorted(hashes.items()))


def fingerprint_of(hashes: dict[str, str]) -> str:
    """One sha256 over every file's path and sha256: the artefact's identity."""
    return hashlib.sha256(json.dumps(sorted(hashes.items())).encode()).hexdigest()


def read_manifest(root: Path = ROOT) -> dict[str, Any]:
    path = Path(root) / MANIFEST_FILE
    if not path.is_file():
        raise BundleError(f"{path} does not exist: the embedded default's artefact is not in this checkout; "
                          f"rebuild it with {REBUILD}, or give data.source and target.pretrained of your own")
    return json.loads(path.read_text())


def verify(root: Path = ROOT) -> dict[str, Any]:
    """The manifest, once every file matches it (raises :class:`BundleError` naming each file that does not)."""
    manifest = read_manifest(root)
    want, have = manifest["files"], file_hashes(root)
    problems = [f"{name}: missing" for name in want if name not in have]
    problems += [f"{name}: sha256 {have[name][:12]}… where the manifest has {want[name][:12]}…"
                 for name in want if name in have and have[name] != want[name]]
    problems += [f"{name}: not in the manifest" for name in have if name not in want]
    if problems:
        raise BundleError(f"the embedded default's artefact at {root} differs from its {MANIFEST_FILE} "
                          f"({len(problems)} file(s)): " + "; ".join(problems)
                          + f". Restore it from git (git checkout -- {root}) or rebuild it with {REBUILD}")
    if fingerprint_of(have) != manifest["fingerprint"]:
        raise BundleError(f"{root}/{MANIFEST_FILE}: its fingerprint is not the one of its files; rebuild with {REBUILD}")
    return manifest


def write_manifest(root: Path, record: dict[str, Any]) -> dict[str, Any]:
    """Hash the parts under ``root`` and write ``manifest.json``: ``record`` (recipe, machine, versions, date) plus
    ``files`` and ``fingerprint``. Returns the manifest."""
    hashes = file_hashes(root)
    manifest = {**record, "fingerprint": fingerprint_of(hashes), "files": hashes}
    (Path(root) / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2, sort_keys=False) + "\n")
    return manifest
