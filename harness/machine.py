"""The machine a number was measured on, as the records name it (a calibration's identity, an artefact's build)."""

from __future__ import annotations

import os
import platform
from pathlib import Path


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (Linux), else the platform's processor string."""
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return model


def machine_name(accelerator: str | None = None) -> str:
    """What a run's record names its machine by: the CPU model and core count, then the accelerator it used."""
    name = f"{cpu_model()}, {os.cpu_count()} cores"
    return f"{name}, {accelerator}" if accelerator else name
