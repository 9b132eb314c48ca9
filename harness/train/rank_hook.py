"""The one seam the tests have in a rank: ``BATCHLAB_RANK_HOOK=FILE.py`` runs the rank's work inside that file's
``installed(rank, run_dir)`` context.

Ranks start as fresh processes (torch elastic, torchrun, srun, submitit) and read their environment, so a test
can reach into a rank it did not start only this way. Unset (every run but the tests'), nothing is imported
and nothing changes. The tests' file (``tests/support/rank_hook.py``) injects failures, slows a drafter down and logs
the samples each rank consumed; none of that ships in the package.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from collections.abc import Iterator
from pathlib import Path

RANK_HOOK_ENV = "BATCHLAB_RANK_HOOK"


@contextlib.contextmanager
def rank_hook(rank: int, run_dir: str | Path) -> Iterator[None]:
    """Rank ``rank`` of the run in ``run_dir`` works inside the hook ``BATCHLAB_RANK_HOOK`` names, if any."""
    path = os.environ.get(RANK_HOOK_ENV)
    if not path:
        yield
        return
    spec = importlib.util.spec_from_file_location("batchlab_rank_hook", path)
    if spec is None or spec.loader is None or not Path(path).is_file():
        raise FileNotFoundError(f"{RANK_HOOK_ENV}={path!r} is not a Python file; unset it for a normal run")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with module.installed(rank, Path(run_dir)):
        yield
