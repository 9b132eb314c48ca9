"""``make bundle``, ``make study-data``: build a shipped artefact (the embedded default's, or the real study's data).

The main job reads its target and data from ``harness/data/bundled/`` (:mod:`harness.data.bundled`) so that every
machine trains its drafters on the same bytes. This command is how those bytes were made, and how to make them again:
it builds the recipe ``data=stdlib-regenerated target=tiny-pretrained`` through the trainer's own builders (the
running Python's standard library, a byte-level BPE, the target pretrained on the training rows, its greedy
completions of every prompt; about 4 minutes on 2 cores), copies the checkpoint and the dataset, and writes
``manifest.json`` (every file's sha256, the fingerprint, the recipe, machine, versions, date).

    python -m harness.cli.bundle            # build into the cache and say what would change
    python -m harness.cli.bundle --write    # replace harness/data/bundled/ (then commit it, and rerun the main job)
    python -m harness.cli.bundle --out DIR  # write the artefact elsewhere

``--artefact sharegpt-smollm2`` builds the real-model study's data instead (``data=sharegpt target=smollm2``: ShareGPT
V3's conversations, every assistant turn regenerated greedily by SmolLM2-135M-Instruct, about 10 minutes on 2 cores)
into ``harness/data/bundled/sharegpt_smollm2/``.
"""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Sequence
from pathlib import Path

from harness.cli.process_exit import exits_fast
from harness.command_errors import OneLineParser, one_line_errors
from harness.data import bundled
from harness.train.launch.bundle import build_bundle, build_study_data

#: each artefact, with the function that builds it
BUILDERS = {bundled.EMBEDDED.source: (bundled.EMBEDDED, build_bundle),
            bundled.SHAREGPT_SMOLLM2.source: (bundled.SHAREGPT_SMOLLM2, build_study_data)}


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="python -m harness.cli.bundle", description=__doc__.splitlines()[0])
    parser.add_argument("--artefact", choices=sorted(BUILDERS), default=bundled.EMBEDDED.source,
                        help="which artefact: the embedded default's target and data (default), or the real-model "
                             "study's data")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--write", action="store_true",
                       help="replace the shipped artefact (under harness/data/bundled/)")
    where.add_argument("--out", type=Path, help="write the artefact to this directory instead")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides of the recipe (key=value)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return one_line_errors("bundle", lambda: _bundle(args))


def _bundle(args: argparse.Namespace) -> int:
    artefact, build = BUILDERS[args.artefact]
    shipped = artefact.root / bundled.MANIFEST_FILE
    before = artefact.read_manifest()["fingerprint"] if shipped.is_file() else None
    if args.write or args.out:
        out = artefact.root if args.write else args.out
        manifest = build(out, args.overrides)
        print(f"bundle: wrote {out} ({len(manifest['files'])} files, fingerprint {manifest['fingerprint'][:12]}, "
              f"rows {manifest['rows']})")
    else:
        with tempfile.TemporaryDirectory() as scratch:
            manifest = build(Path(scratch) / "artefact", args.overrides)
        same = "the same" if before == manifest["fingerprint"] else "different: --write replaces it"
        print(f"bundle: built fingerprint {manifest['fingerprint'][:12]} (rows {manifest['rows']}); shipped: "
              f"{before[:12] if before else 'none'} ({same})")
    return 0


if __name__ == "__main__":
    exits_fast(main)()
