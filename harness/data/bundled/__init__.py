"""The embedded default as shipped with the package: the tiny pretrained target and the completions it regenerated.

``data.source=bundled`` reads ``bundled/samples/`` (the stdlib corpus's prompts, each with the completion the target
regenerated greedily, tokenized; ``save_to_disk`` layout) and ``target.pretrained=bundled`` reads ``bundled/target/``
(a Hugging Face checkpoint). Both were built once by ``make bundle`` (:mod:`harness.cli.bundle`, the recipe
``data=stdlib-regenerated target=tiny-pretrained``) and are the same bytes on every machine, so a run on another CPU
differs from this one only in the drafter's own training: not in the corpus (which the running Python's standard
library would otherwise decide), the target's weights or its completions (which the CPU's rounding would otherwise
decide). ``manifest.json`` holds every file's sha256, the fingerprint over them, the recipe and the build's machine,
versions and date; :func:`verify` refuses a changed, missing or extra file by name before anything reads it.

The real-model study's data is shipped the same way (:data:`SHAREGPT_SMOLLM2`, ``data.source=sharegpt-smollm2``:
ShareGPT V3's conversations with every assistant turn SmolLM2-135M-Instruct's greedy reply, tokenized, in
``bundled/sharegpt_smollm2/``), so that its pilot and confirmatory runs, on any machine, train on one set of bytes.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, replace
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


@dataclass(frozen=True)
class Artefact:
    """One shipped artefact: its folders (``parts``) under ``root`` and the ``manifest.json`` that names their bytes."""

    source: str  # the config value that names it (data.source, target.pretrained)
    root: Path
    parts: tuple[str, ...]
    title: str  # what it is, in the messages
    rebuild: str  # the command that builds it again

    def at(self, root: Path) -> "Artefact":
        """The same artefact read from another folder (a copy, a build in progress)."""
        return replace(self, root=Path(root))

    def samples_dir(self) -> Path:
        return self.root / SAMPLES_DIR

    def file_hashes(self) -> dict[str, str]:
        """``{relative path: sha256}`` of every file of the artefact's parts, sorted by path."""
        hashes = {}
        for part in self.parts:
            for path in sorted((self.root / part).rglob("*")):
                if path.is_file():
                    hashes[path.relative_to(self.root).as_posix()] = hashlib.sha256(path.read_bytes()).hexdigest()
        return dict(sorted(hashes.items()))

    def read_manifest(self) -> dict[str, Any]:
        path = self.root / MANIFEST_FILE
        if not path.is_file():
            raise BundleError(f"{path} does not exist: {self.title} is not in this checkout; rebuild it with "
                              f"{self.rebuild}, or give data.source and target.pretrained of your own")
        return json.loads(path.read_text())

    def verify(self) -> dict[str, Any]:
        """The manifest, once every file matches it (raises :class:`BundleError` naming each file that does not)."""
        manifest = self.read_manifest()
        want, have = manifest["files"], self.file_hashes()
        problems = [f"{name}: missing" for name in want if name not in have]
        problems += [f"{name}: sha256 {have[name][:12]}… where the manifest has {want[name][:12]}…"
                     for name in want if name in have and have[name] != want[name]]
        problems += [f"{name}: not in the manifest" for name in have if name not in want]
        if problems:
            raise BundleError(f"{self.title} at {self.root} differs from its {MANIFEST_FILE} ({len(problems)} "
                              "file(s)): " + "; ".join(problems)
                              + f". Restore it from git (git checkout -- {self.root}) or rebuild it with "
                              + self.rebuild)
        if fingerprint_of(have) != manifest["fingerprint"]:
            raise BundleError(f"{self.root}/{MANIFEST_FILE}: its fingerprint is not the one of its files; rebuild "
                              f"with {self.rebuild}")
        return manifest

    def write_manifest(self, record: dict[str, Any]) -> dict[str, Any]:
        """Hash the parts and write ``manifest.json``: ``record`` (recipe, machine, versions, date) plus ``files`` and
        ``fingerprint``. Returns the manifest."""
        hashes = self.file_hashes()
        manifest = {**record, "fingerprint": fingerprint_of(hashes), "files": hashes}
        (self.root / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2, sort_keys=False) + "\n")
        return manifest


#: the main job's target and data (``data.source=bundled``, ``target.pretrained=bundled``)
EMBEDDED = Artefact(BUNDLED, ROOT, PARTS, "the embedded default's artefact", REBUILD)
#: the real-model study's data: ShareGPT V3 with SmolLM2-135M-Instruct's greedy replies, tokenized
SHAREGPT_SMOLLM2 = Artefact("sharegpt-smollm2", ROOT / "sharegpt_smollm2", (SAMPLES_DIR,),
                            "the real-model study's shipped data",
                            "make study-data (python -m harness.cli.bundle --artefact sharegpt-smollm2 --write)")
#: every shipped artefact of data, by the ``data.source`` that names it
SHIPPED_DATA = {artefact.source: artefact for artefact in (EMBEDDED, SHAREGPT_SMOLLM2)}


def samples_dir(root: Path = ROOT) -> Path:
    """The tokenized samples with regenerated completions (a ``save_to_disk`` directory)."""
    return Path(root) / SAMPLES_DIR


def target_dir(root: Path = ROOT) -> Path:
    """The tiny target's checkpoint directory (``config.json``, ``model.safetensors``, ``tokenizer.json``)."""
    return Path(root) / TARGET_DIR


def file_hashes(root: Path = ROOT) -> dict[str, str]:
    """The embedded default's :meth:`Artefact.file_hashes` (read from ``root``)."""
    return EMBEDDED.at(root).file_hashes()


def fingerprint_of(hashes: dict[str, str]) -> str:
    """One sha256 over every file's path and sha256: the artefact's identity."""
    return hashlib.sha256(json.dumps(sorted(hashes.items())).encode()).hexdigest()


def read_manifest(root: Path = ROOT) -> dict[str, Any]:
    return EMBEDDED.at(root).read_manifest()


def verify(root: Path = ROOT) -> dict[str, Any]:
    """The embedded default's :meth:`Artefact.verify` (read from ``root``)."""
    return EMBEDDED.at(root).verify()
