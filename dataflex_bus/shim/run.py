"""``run_training``: one shim run from config to run directory.

Checks the whole config before anything trains, refuses to overwrite a run directory, writes per-step
metrics and atomic checkpoints as it goes, and keeps the run record (``run.json``: config, provenance,
sessions, status, summary) true whether the run completes, fails or is resumed.
"""

from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .. import __version__
from ..runtime import Runtime
from .config import RunConfig, host_context, prepare
from .files import (
    CHECKPOINT,
    METRICS,
    RECORD,
    CheckpointError,
    RunDirError,
    check_run_dir,
    load_checkpoint,
    metrics_line,
    read_metrics,
    save_checkpoint,
    write_json,
    write_metrics,
)
from .progress import Progress
from .summary import summarize
from .trainer import ShimTrainer


@dataclass
class RunResult:
    """What :func:`run_training` returns: one metrics dict per step, the run record and the directory."""

    metrics: list[dict[str, float]]
    record: dict[str, Any]
    out: Path | None = None
    summary: dict[str, float] = field(default_factory=dict)


def machine_info() -> dict[str, Any]:
    return {"platform": platform.platform(), "python": platform.python_version(),
            "processor": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
            "torch": torch.__version__, "dataflex_bus": __version__}


def run_training(config: Mapping[str, Any] | RunConfig, *, steps: int | None = None, seed: int | None = None,
                 out: str | Path | None = None, resume: bool = False, force: bool = False,
                 progress: bool = False) -> RunResult:
    """Train the shim's tiny policy with GRPO and the configured dataflex methods (if any).

    ``config`` holds ``trainer``/``model``/``data`` sections and an optional ``dataflex`` block (or is
    what :func:`~dataflex_bus.shim.config.prepare` returned: then it is not checked again);
    ``steps``/``seed`` override ``trainer.steps``/``trainer.seed``. With ``out=None`` nothing is written
    to disk. With ``out``, per-step metrics go to ``metrics.jsonl``, the run record to ``run.json`` and
    checkpoints (atomic) to ``checkpoint.pt``; an existing run there is never overwritten unless
    ``force``, and ``resume=True`` continues it. Everything is checked before the first step.
    """
    prepared = prepare(config, steps=steps, seed=seed)
    out_dir = Path(out) if out is not None else None
    if resume and out_dir is None:
        raise RunDirError("resume needs a run directory (out=...)")
    if out_dir is not None and not resume:
        check_run_dir(out_dir, force=force)
    resolved = prepared.resolved
    runtime = Runtime(prepared.method, context=host_context(resolved))
    threads = torch.get_num_threads()
    torch.set_num_threads(resolved["trainer"]["threads"])
    try:
        return _train(resolved, runtime, out_dir, resume, progress)
    finally:
        torch.set_num_threads(threads)


def _resume(trainer: ShimTrainer, out_dir: Path, record: dict[str, Any]) -> list[dict[str, float]]:
    """Restore the checkpoint and the metrics up to it; returns the metrics history."""
    trainer.load_state_dict(load_checkpoint(out_dir / CHECKPOINT), source=str(out_dir / CHECKPOINT))
    history = read_metrics(out_dir / METRICS)[: trainer.step]
    if len(history) != trainer.step:
        raise CheckpointError(f"{out_dir / METRICS} holds {len(history)} steps but the checkpoint is at "
                              f"step {trainer.step}")
    previous = out_dir / RECORD
    if previous.exists():
        try:
            record["sessions"] = json.loads(previous.read_text()).get("sessions", [])
        except (OSError, ValueError):
            record["sessions"] = []
    # Drop metrics of steps after the checkpoint (a crash between saves): they are redone.
    write_metrics(out_dir / METRICS, history)
    return history


def _train(resolved: dict[str, Any], runtime: Runtime, out_dir: Path | None, resume: bool,
           progress: bool) -> RunResult:
    t = resolved["trainer"]
    # A resumed run takes its weights from the checkpoint: no warm start to redo.
    trainer = ShimTrainer(resolved, runtime, warm_start=not resume)
    history: list[dict[str, float]] = []
    record: dict[str, Any] = {
        "config": resolved, "seed": t["seed"], "steps": t["steps"], "domains": trainer.domains,
        "split": trainer.split.record(), "dataflex": runtime.record(), "machine": machine_info(), "sessions": [],
        "status": "running",
    }
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        if resume:
            history = _resume(trainer, out_dir, record)
        write_json(out_dir / RECORD, record)

    show = Progress(t["steps"], trainer.step) if progress else None
    session = {"start_step": trainer.step, "started": time.time()}
    started = time.perf_counter()
    metrics_fh = open(out_dir / METRICS, "a") if out_dir is not None else None
    try:
        while trainer.step < t["steps"]:
            m = trainer.train_step()
            history.append(m)
            if metrics_fh is not None and out_dir is not None:
                metrics_fh.write(metrics_line(m))
                metrics_fh.flush()
                every = t["save_every"]
                if (every and trainer.step % every == 0) or trainer.step == t["steps"]:
                    save_checkpoint(trainer.state_dict(), out_dir)
            if show is not None:
                show.update(trainer.step, m)
    except BaseException as exc:
        record["status"] = "failed"
        record["error"] = f"{type(exc).__name__}: {exc}"
        raise
    else:
        record["status"] = "complete"
    finally:
        if metrics_fh is not None:
            metrics_fh.close()
        if show is not None:
            show.close()
        wall = time.perf_counter() - started
        session.update(end_step=trainer.step, wall_s=round(wall, 3))
        record["sessions"].append(session)
        record["wall_s"] = round(sum(s.get("wall_s", 0.0) for s in record["sessions"]), 3)
        record["summary"] = summarize(history, trainer.domains)
        record["counters"] = {"skipped_updates": trainer.skipped_updates, "steps_done": trainer.step,
                              **trainer.compute}
        if out_dir is not None:
            write_json(out_dir / RECORD, record)
    return RunResult(metrics=history, record=record, out=out_dir, summary=record["summary"])
