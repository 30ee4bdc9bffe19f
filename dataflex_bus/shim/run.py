"""``run_training``: one shim run from config to run directory.

The one owner of a shim run and its directory (``dataflex run`` and ``dataflex compare`` call it; the
command line adds only signals and what it prints). Checks the whole config (and the memory it needs) before
anything trains; takes an exclusive lock on the run directory and checks it can be written before the warm
start; refuses to overwrite a run; writes per-step metrics and checksummed, atomic checkpoints as it goes;
keeps the run record (``run.json``: config, provenance, every session, events, status, summary) true whether
the run completes, fails, is interrupted, killed or resumed; and draws the curves, if asked, before the
directory is released.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import torch

from .. import __version__
from ..kit import ConfigError, ConfigIssue, Runtime, SignalInterrupt, clip_text, format_traceback
from . import report
from .config import RunConfig, prepare
from .files import (
    CHECKPOINT,
    METRICS,
    PLOT,
    RECORD,
    CheckpointError,
    RunDirError,
    check_run_dir,
    check_writable,
    claimed_run_dir,
    io_error,
    load_checkpoint,
    metrics_line,
    read_metrics,
    save_checkpoint,
    write_json,
    write_json_in_place,
    write_metrics,
)
from .host import describe
from .machine import machine_info
from .progress import Progress
from .regime import Regime, regime_change
from .summary import summarize
from .trainer import ShimTrainer

log = logging.getLogger("dataflex_bus")


@dataclass
class RunResult:
    """What :func:`run_training` returns: one metrics dict per step, the run record and the directory."""

    metrics: list[dict[str, float]]
    record: dict[str, Any]
    out: Path | None = None
    summary: dict[str, float] = field(default_factory=dict)
    #: Where the curves were drawn, or why they were not (``plot=``); ``None`` when not asked.
    plot: str | None = None


def run_training(config: Mapping[str, Any] | RunConfig, *, steps: int | None = None, seed: int | None = None,
                 out: str | Path | None = None, resume: bool = False, force: bool = False,
                 progress: bool = False, regime: Regime | None = None, plot: str | None = None) -> RunResult:
    """Train the shim's tiny policy with GRPO and the configured dataflex methods (if any).

    ``config`` holds ``trainer``/``model``/``data`` sections and an optional ``dataflex`` block (or is
    what :func:`~dataflex_bus.shim.config.prepare` returned: then it is not checked again);
    ``steps``/``seed`` override ``trainer.steps``/``trainer.seed``. With ``out=None`` nothing is written
    to disk. With ``out``, per-step metrics go to ``metrics.jsonl``, the run record to ``run.json`` and
    checkpoints (atomic, checksummed) to ``checkpoint.pt``; the directory is locked for the whole run
    (a second run there is refused), an existing run is never overwritten unless ``force``, and
    ``resume=True`` continues it. Everything is checked before the first step. ``regime``: the
    :class:`~dataflex_bus.shim.regime.Regime` already merged into ``config``, recorded in ``run.json``; a
    resume under another regime than the run's is refused. ``plot``: with ``out``, the run's name: its
    curves, titled ``<plot> (seed N)``, are drawn to ``curves.png`` after it completes, while the directory is
    still held.
    """
    prepared = prepare(config, steps=steps, seed=seed)
    out_dir = Path(out) if out is not None else None
    if resume and out_dir is None:
        raise RunDirError("resume needs a run directory (out=...)")
    resolved = prepared.resolved
    # The shim is where plugins are tried: every hook's batch writes are checked (cheap at this size).
    runtime = Runtime(prepared.method, host=describe(resolved), check_writes=True)
    if out_dir is None:
        return _with_threads(resolved, lambda: _train(resolved, runtime, None, None, progress, regime=regime))
    with claimed_run_dir(out_dir, resume=resume):
        if not resume:
            check_run_dir(out_dir, force=force)
        check_writable(out_dir)
        saved = _read_checkpoint(out_dir, resolved) if resume else None
        previous = _previous_record(out_dir) if resume else None
        if previous is not None and "config" in previous:  # a real record (not one missing at resume)
            changed = regime_change(previous.get("regime"), regime)
            if changed:
                raise ConfigError(ConfigIssue("--regime", changed))
        result = _with_threads(resolved, lambda: _train(resolved, runtime, out_dir, saved, progress, previous,
                                                        regime))
        if plot is not None:
            result.plot = _plot(result, runtime, out_dir / PLOT, f"{plot} (seed {resolved['trainer']['seed']})")
        return result


def _plot(result: RunResult, runtime: Runtime, path: Path, title: str) -> str:
    """Draw the run's curves (domain probabilities too when a mixer samples domains); the line that says where,
    or why not (matplotlib missing)."""
    try:
        report.plot_run(result.metrics, result.record["config"]["data"]["domains"], path, title,
                        mix=bool(runtime.plan.samples_domains))
    except report.PlottingUnavailable as exc:
        return str(exc)
    return f"plot: {path}"


def _with_threads(resolved: Mapping[str, Any], body: Callable[[], RunResult]) -> RunResult:
    threads = torch.get_num_threads()
    torch.set_num_threads(resolved["trainer"]["threads"])
    try:
        return body()
    finally:
        torch.set_num_threads(threads)


def _read_checkpoint(out_dir: Path, resolved: Mapping[str, Any]) -> dict[str, Any]:
    """The checkpoint to resume from, refused before any work if it is past the requested steps."""
    state = load_checkpoint(out_dir / CHECKPOINT)
    at, steps = state.get("step"), resolved["trainer"]["steps"]
    if isinstance(at, int) and not isinstance(at, bool) and steps < at:
        raise ConfigError(ConfigIssue("trainer.steps", f"{steps} is below the step of the checkpoint in {out_dir} "
                                      f"({at}): a resume continues a run, it cannot shorten it; use --steps {at} or "
                                      "more, or start over with --force"))
    return state


def _provenance(runtime: Runtime) -> dict[str, Any]:
    """What produced a checkpoint: the plugin packs (``name==version``) and dataflex-bus itself."""
    return {"plugins": runtime.provenance()["plugins"], "dataflex_bus": __version__}


def _version_changes(before: Any, after: dict[str, Any]) -> list[str]:
    if not isinstance(before, Mapping):
        return []

    def pins(p: Mapping[str, Any]) -> dict[str, str]:
        out = {"dataflex-bus": str(p.get("dataflex_bus"))}
        for pin in p.get("plugins") or []:
            name, _, version = str(pin).partition("==")
            out[name] = version
        return out

    old, new = pins(before), pins(after)
    return [f"{name} {old.get(name, 'absent')} -> {new.get(name, 'absent')}"
            for name in sorted(set(old) | set(new)) if old.get(name) != new.get(name)]


def _previous_record(out_dir: Path) -> dict[str, Any]:
    """The run record a resume continues (empty, with a note, if it is missing). A damaged one is refused
    before any work: it is the only list of the earlier sessions, and the resume would overwrite it."""
    path = out_dir / RECORD
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return {"events": [{"event": "record_missing", "detail": f"{RECORD} was missing at resume"}]}
    except OSError as exc:
        raise io_error(path, exc, "read the run record") from exc
    keep = ("; it lists the run's earlier sessions and a resume would overwrite it: repair it, or move it away "
            "to resume without them")
    try:
        record = json.loads(data.decode("utf-8"))
    except ValueError as exc:  # UnicodeDecodeError included
        raise CheckpointError(f"{path}: is not valid JSON ({exc}){keep}") from None
    if not isinstance(record, dict):
        raise CheckpointError(f"{path}: holds a JSON {type(record).__name__}, not an object{keep}")
    for key in ("sessions", "events"):
        entries = record.get(key, [])
        if not isinstance(entries, list):
            raise CheckpointError(f"{path}: {key!r} holds {type(entries).__name__}, not a list of objects{keep}")
        odd = next((e for e in entries if not isinstance(e, dict)), None)
        if odd is not None:
            raise CheckpointError(f"{path}: {key!r} holds a list with {type(odd).__name__}, not a list of "
                                  f"objects{keep}")
    return record


def _resume(trainer: ShimTrainer, out_dir: Path, state: dict[str, Any], record: dict[str, Any],
            provenance: dict[str, Any], previous: dict[str, Any]) -> list[dict[str, float]]:
    """Restore the checkpoint, the metrics up to it and the run history; returns the metrics history."""
    trainer.load_state_dict(state, source=str(out_dir / CHECKPOINT))
    history = read_metrics(out_dir / METRICS, limit=trainer.step)
    if len(history) != trainer.step:
        raise CheckpointError(f"{out_dir / METRICS} holds {len(history)} steps but the checkpoint is at "
                              f"step {trainer.step}")
    sessions, events = list(previous.get("sessions") or []), list(previous.get("events") or [])
    for i, s in enumerate(sessions):
        # Nobody else holds the lock, so a session still "running" is one whose process died.
        if s.get("status", "running") == "running":
            s["status"] = "interrupted"
            s.setdefault("error", "the process ended without closing the run (killed?)")
            if i == len(sessions) - 1:  # it may have saved a checkpoint after its last record update
                s["end_step"] = s["checkpoint_step"] = trainer.step
    if previous.get("status") == "running":
        events.append({"event": "interrupted", "step": trainer.step, "time": time.time(),
                       "detail": "the previous session ended without closing the run; resumed from the last "
                                 "checkpoint, the steps after it are redone"})
    changes = _version_changes(state.get("provenance"), provenance)
    if changes:
        log.warning("dataflex: resuming %s with different package versions than the checkpoint was written "
                    "with: %s", out_dir, "; ".join(changes))
        events.append({"event": "versions_changed", "step": trainer.step, "time": time.time(), "changes": changes,
                       "before": state.get("provenance"), "after": provenance})
    events.append({"event": "resumed", "step": trainer.step, "time": time.time()})
    record["sessions"], record["events"] = sessions, events
    # Drop metrics of steps after the checkpoint (a crash between saves): they are redone.
    write_metrics(out_dir / METRICS, history)
    return history


class _RecordWriter:
    """Writes ``run.json``; when the directory stops taking new files (read-only mid-run) it rewrites the
    file in place, so a failed run is still marked failed."""

    def __init__(self, out_dir: Path | None) -> None:
        self.path = None if out_dir is None else out_dir / RECORD

    def write(self, record: dict[str, Any]) -> None:
        if self.path is None:
            return
        try:
            write_json(self.path, record)
        except RunDirError:
            if not self.path.exists():
                raise
            write_json_in_place(self.path, record)


def _train(resolved: dict[str, Any], runtime: Runtime, out_dir: Path | None, saved: dict[str, Any] | None,
           progress: bool, previous: dict[str, Any] | None = None, regime: Regime | None = None) -> RunResult:
    t = resolved["trainer"]
    provenance = _provenance(runtime)
    # A resumed run takes its weights from the checkpoint: no warm start to redo.
    trainer = ShimTrainer(resolved, runtime, warm_start=saved is None, progress=progress)
    history: list[dict[str, float]] = []
    record: dict[str, Any] = {
        "config": resolved, "regime": None if regime is None else regime.record(), "seed": t["seed"],
        "steps": t["steps"], "domains": trainer.domains,
        "split": trainer.split.record(), "dataflex": runtime.provenance(), "machine": machine_info(), "sessions": [],
        "events": [],
        "status": "running",
    }
    writer = _RecordWriter(out_dir)
    if out_dir is not None and saved is not None:
        history = _resume(trainer, out_dir, saved, record, provenance, previous or {})
    session: dict[str, Any] = {"pid": os.getpid(), "start_step": trainer.step, "end_step": trainer.step,
                               "started": time.time(), "status": "running", **provenance}
    record["sessions"].append(session)
    writer.write(record)

    show = Progress(t["steps"], trainer.step) if progress else None
    started = time.perf_counter()
    metrics_fh = _open_metrics(out_dir)
    try:
        while trainer.step < t["steps"]:
            m = trainer.train_step()
            history.append(m)
            if metrics_fh is not None and out_dir is not None:
                _append(metrics_fh, out_dir / METRICS, m)
                every = t["save_every"]
                if (every and trainer.step % every == 0) or trainer.step == t["steps"]:
                    save_checkpoint({**trainer.state_dict(), "provenance": provenance}, out_dir)
                    session["end_step"] = session["checkpoint_step"] = trainer.step
                    _close_session(session, record, trainer, history, runtime, started, "running")
                    writer.write(record)
            if show is not None:
                show.update(trainer.step, m)
    except KeyboardInterrupt as exc:
        if isinstance(exc, SignalInterrupt):
            exc.step = trainer.step
        record["status"] = "interrupted"
        record["error"] = clip_text(f"interrupted at step {trainer.step}" + (f": {exc}" if str(exc) else ""))
        raise
    except BaseException as exc:
        record["status"] = "failed"
        record["error"] = clip_text(f"{type(exc).__name__}: {exc}")
        # Where it happened (a plugin's file and line), for whoever reads the record after the terminal is gone.
        record["traceback"] = format_traceback(exc)
        raise
    else:
        record["status"] = "complete"
        record.pop("error", None)
    finally:
        if metrics_fh is not None:
            try:
                metrics_fh.close()
            except OSError:
                pass  # the failed write was already reported
        if show is not None:
            show.close()
        for key in ("error", "traceback"):  # the session keeps them after a resumed run completes
            if record.get(key):
                session[key] = record[key]
        _close_session(session, record, trainer, history, runtime, started, record["status"])
        _final_write(writer, record)
    return RunResult(metrics=history, record=record, out=out_dir, summary=record["summary"])


def _close_session(session: dict[str, Any], record: dict[str, Any], trainer: ShimTrainer,
                   history: list[dict[str, float]], runtime: Runtime, started: float, status: str) -> None:
    """Bring the session and the record's totals up to date (at every checkpoint and at the end)."""
    session.update(status=status, wall_s=round(time.perf_counter() - started, 3))
    if status != "running":
        session["end_step"] = trainer.step
    record["wall_s"] = round(sum(s.get("wall_s", 0.0) or 0.0 for s in record["sessions"]), 3)
    record["summary"] = summarize(history, trainer.domains)
    record["counters"] = {"steps_done": trainer.step, **trainer.kit.state_dict()}
    session["observer_failures"] = runtime.observer_failures
    record["observer_failures"] = [{**failure, "session": i} for i, s in enumerate(record["sessions"])
                                   for failure in s.get("observer_failures") or []]


def _final_write(writer: _RecordWriter, record: dict[str, Any]) -> None:
    """Write the closing record. When a run is already failing, a record that cannot be written is
    logged (the run's own error goes on); a completed run whose record cannot be written fails."""
    failing = record["status"] != "complete"
    try:
        writer.write(record)
    except RunDirError as exc:
        if not failing:
            raise
        log.error("dataflex: could not mark the run %s in %s: %s", record["status"], writer.path, exc)


def _open_metrics(out_dir: Path | None) -> IO[str] | None:
    if out_dir is None:
        return None
    try:
        return open(out_dir / METRICS, "a")
    except OSError as exc:
        raise io_error(out_dir / METRICS, exc, "open for writing") from exc


def _append(fh: IO[str], path: Path, metrics: dict[str, float]) -> None:
    try:
        fh.write(metrics_line(metrics))
        fh.flush()
    except OSError as exc:
        raise io_error(path, exc, f"append step {int(metrics.get('step', -1))}") from exc
