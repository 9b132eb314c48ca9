"""Where the target and the drafter run (the ``topology`` config group) and the link that carries the target's
features between ranks. Importing the package registers the built-in placements (``colocated``,
``disaggregated``); a plugin registers its own with :func:`register_placement`."""

from harness.train.placement import builtin  # noqa: F401 - registers the built-in placements
from harness.train.placement.registry import (
    Placement,
    PlacementKind,
    RankWorker,
    place,
    placement_kind,
    placement_names,
    register_placement,
)

__all__ = ["Placement", "PlacementKind", "RankWorker", "place", "placement_kind", "placement_names",
           "register_placement"]
