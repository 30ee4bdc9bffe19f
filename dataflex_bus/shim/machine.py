"""The machine a run ran on, as far as its numbers depend on it.

Runs are bit-identical on one machine; another CPU (another instruction set, other kernels) gives other
digits, so the record of a run (``run.json``), the comparison table and the warm-start cache name it.
"""

from __future__ import annotations

import functools
import os
import platform
from typing import Any

import torch

from .. import __version__


@functools.cache
def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo`` on Linux, ``sysctl`` on macOS), else the architecture."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                if line.lower().startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    if platform.system() == "Darwin":
        import subprocess

        try:
            out = subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True,
                                 timeout=5)
            if out.returncode == 0 and out.stdout.strip():
                return out.stdout.strip()
        except (OSError, subprocess.SubprocessError):
            pass
    return platform.processor() or platform.machine() or "unknown CPU"


def cpu_capability() -> str:
    """The instruction set torch dispatches its CPU kernels to (``AVX2``, ``AVX512``, ``DEFAULT`` ...)."""
    try:
        return str(torch.backends.cpu.get_cpu_capability())
    except (AttributeError, RuntimeError):
        return "unknown"


def machine_info() -> dict[str, Any]:
    """What ``run.json`` records under ``machine``."""
    return {"platform": platform.platform(), "python": platform.python_version(),
            "processor": platform.processor() or platform.machine(), "cpu": cpu_model(),
            "cpu_capability": cpu_capability(), "cpu_count": os.cpu_count(), "torch": torch.__version__,
            "dataflex_bus": __version__}
