"""The run's log file (``RUN_DIR/train.log``): a copy of everything the run's processes print.

``batchlab-train`` copies its own output there once the run has its directory, and every rank (a
process torch elastic spawns, or one an external launcher starts) copies its own: the start and
closing lines, warnings, progress bars in their final state, and the traceback of anything that
fails. Written by hand: the run's processes print with ``print``, ``warnings`` and tqdm, and no
library copies a Python process's ``sys.stdout`` / ``sys.stderr`` into a file while the terminal keeps
its bars; each process appends whole lines, so the ranks' lines never tear.
"""

from __future__ import annotations

import contextlib
import io
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

#: the run's log, in its run directory (also Hydra's job log: ``hydra.job.name`` is ``train``)
RUN_LOG = "train.log"


class _Copy(io.TextIOBase):
    """A text stream that writes to ``stream`` and appends each complete line to ``log``.

    A line redrawn with carriage returns (a progress bar) goes to the log as its last state only."""

    def __init__(self, stream: IO[str], log: IO[str]) -> None:
        super().__init__()
        self.stream, self.log, self._partial = stream, log, ""

    def write(self, text: str) -> int:
        self.stream.write(text)
        self._partial += text
        if "\n" in self._partial:
            *lines, self._partial = self._partial.split("\n")
            last_states = [line.rsplit("\r", 1)[-1] for line in lines]
            # a bar cleared when it closed (tqdm's leave=False) leaves nothing to keep
            kept = [last for line, last in zip(lines, last_states) if last.strip() or "\r" not in line]
            self.log.write("".join(line + "\n" for line in kept))
            self.log.flush()
        return len(text)

    def flush(self) -> None:
        self.stream.flush()

    def close_copy(self) -> None:
        """Append what is left of an unfinished line."""
        last = self._partial.rsplit("\r", 1)[-1]
        if last.strip():
            self.log.write(last + "\n")
            self.log.flush()
        self._partial = ""

    def isatty(self) -> bool:
        # a library that kept this copy as its stdout may ask after the stream closed (colorama at exit)
        return not getattr(self.stream, "closed", False) and self.stream.isatty()

    def fileno(self) -> int:
        return self.stream.fileno()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return getattr(self.stream, "encoding", "utf-8")

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


@contextlib.contextmanager
def copied_to(path: str | Path) -> Iterator[None]:
    """Within the block, this process's ``sys.stdout`` and ``sys.stderr`` are also appended to ``path``.

    A no-op where they are copied already (a run on one rank is the ``batchlab-train`` process itself)."""
    if isinstance(sys.stdout, _Copy) or isinstance(sys.stderr, _Copy):
        yield
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    saved = sys.stdout, sys.stderr
    with path.open("a", encoding="utf-8", buffering=1) as log:
        copies = _Copy(saved[0], log), _Copy(saved[1], log)
        sys.stdout, sys.stderr = copies
        try:
            yield
        finally:
            for copy in copies:
                copy.flush()
                copy.close_copy()
            sys.stdout, sys.stderr = saved
