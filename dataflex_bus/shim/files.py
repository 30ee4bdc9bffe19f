"""The files of a run directory and how they are written: atomically, so a crash never leaves a
half-written checkpoint, metrics file or run record behind.

``checkpoint.pt`` (trainer state), ``metrics.jsonl`` (one JSON object per step), ``run.json`` (the run
record) and ``curves.png``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..errors import DataflexError

CHECKPOINT = "checkpoint.pt"
METRICS = "metrics.jsonl"
RECORD = "run.json"
PLOT = "curves.png"
#: Files a run directory holds; ``--force`` removes exactly these, nothing else.
RUN_FILES = (CHECKPOINT, METRICS, RECORD, PLOT)


class RunDirError(DataflexError):
    """The output directory holds a run that would be overwritten, or no run to resume."""


class CheckpointError(DataflexError):
    """A checkpoint cannot be read, or was written by a different config or method."""


def atomic_write_bytes(path: Path, write: Callable[[Any], None]) -> None:
    """Write through a temporary file in the same directory, then rename over ``path``."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as fh:
        write(fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def save_checkpoint(state: dict[str, Any], out: Path) -> None:
    """Write ``checkpoint.pt`` atomically: a crash leaves the previous one."""
    atomic_write_bytes(out / CHECKPOINT, lambda fh: torch.save(state, fh))


def load_checkpoint(path: Path) -> dict[str, Any]:
    if not path.exists():
        raise RunDirError(f"{path.parent}: no checkpoint to resume from ({path.name} missing)")
    try:
        # Our own file (it holds optimizer and plugin state, plain containers and tensors).
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as exc:
        raise CheckpointError(f"{path}: cannot read the checkpoint ({type(exc).__name__}: {exc}); "
                              "start a fresh run (--force)") from exc


def write_json(path: Path, data: Any) -> None:
    text = json.dumps(data, indent=2, sort_keys=True, default=str)
    atomic_write_bytes(path, lambda fh: fh.write(text.encode()))


def metrics_line(metrics: dict[str, float]) -> str:
    return json.dumps(metrics, sort_keys=True) + "\n"


def write_metrics(path: Path, rows: list[dict[str, float]]) -> None:
    """Rewrite ``metrics.jsonl`` with ``rows``."""
    text = "".join(metrics_line(m) for m in rows)
    atomic_write_bytes(path, lambda fh: fh.write(text.encode()))


def read_metrics(path: Path) -> list[dict[str, float]]:
    """The per-step metrics of a run directory (``metrics.jsonl``)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def existing_run_files(out: Path) -> list[str]:
    return [name for name in RUN_FILES if (out / name).exists()] if out.exists() else []


def check_run_dir(out: Path, *, force: bool) -> None:
    """Refuse to overwrite a run unless ``force``; with ``force``, remove only the run's own files."""
    found = existing_run_files(out)
    if not found:
        return
    if not force:
        raise RunDirError(f"{out} already holds a run ({', '.join(found)}); use --force to overwrite it or "
                          "--resume to continue it")
    for name in found:
        (out / name).unlink()
