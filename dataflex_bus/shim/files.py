"""The files of a run directory and how they are written: atomically, checked, under a lock.

``checkpoint.pt`` (trainer state behind a checksum header), ``metrics.jsonl`` (one JSON object per step),
``run.json`` (the run record) and ``curves.png``. While a run (or a resume) writes a directory it holds an
exclusive lock on ``.dataflex.lock`` there, so a second run on the same directory is refused, naming the
holder. Every write goes through a uniquely named temporary file and a rename, so a crash, or a second
writer, never leaves a half-written file behind; every ``OSError`` becomes a :class:`RunDirError` naming
the path.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO

from ..kit import TEMPORARY, DataflexError, discard, read_state, state_file
from ..kit import CheckpointError as CheckpointError  # the shim's readers raise it too
from ..kit import read_checked as read_checked  # the warm-start cache reads its entries with it

CHECKPOINT = "checkpoint.pt"
METRICS = "metrics.jsonl"
RECORD = "run.json"
PLOT = "curves.png"
LOCK = ".dataflex.lock"
#: Files a run directory holds; ``--force`` removes exactly these, nothing else.
RUN_FILES = (CHECKPOINT, METRICS, RECORD, PLOT)
class RunDirError(DataflexError):
    """The output directory cannot be used: it holds a run that would be overwritten, no run to resume,
    another run holds it, or it cannot be written."""


def io_error(path: Path, exc: OSError, doing: str) -> RunDirError:
    """A one-line :class:`RunDirError` for an ``OSError`` met while ``doing`` something to ``path``."""
    reason = exc.strerror or str(exc) or type(exc).__name__
    hint = {errno.EACCES: "; check the permissions or choose another --out",
            errno.EPERM: "; check the permissions or choose another --out",
            errno.EROFS: "; the file system is read-only: choose another --out",
            errno.ENOSPC: "; the disk is full: free space or choose another --out",
            errno.EDQUOT: "; the disk quota is exhausted: free space or choose another --out"}.get(exc.errno or 0, "")
    return RunDirError(f"{path}: cannot {doing} ({reason}){hint}")


# ---------------------------------------------------------------------------- atomic writes
def atomic_write_bytes(path: Path, write: Callable[[BinaryIO], object]) -> None:
    """:func:`~dataflex_bus.state_file.atomic_write` (a temporary file, then a rename): a crash, or a second
    writer, never leaves a half-written file. Raises :class:`RunDirError` naming ``path`` on any ``OSError``."""
    try:
        state_file.atomic_write(path, write)
    except OSError as exc:
        raise io_error(path, exc, "write") from exc


def _writer_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (unsure counts as alive: its temporary is then kept)."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (OSError, OverflowError, ValueError):
        return True
    return True


def remove_stale_temporaries(out: Path) -> None:
    """Remove the temporaries of writers that died between write and rename (kill -9). Called with the
    run directory's lock held, so no other run writes here; a writer still alive keeps its own."""
    try:
        entries = list(os.scandir(out))
    except OSError:
        return
    for entry in entries:
        found = TEMPORARY.match(entry.name)
        if found is not None and entry.is_file(follow_symlinks=False) and not _writer_alive(int(found["pid"])):
            discard(Path(entry.path))


def write_json(path: Path, data: Any) -> None:
    text = json.dumps(data, indent=2, sort_keys=True, default=str)
    atomic_write_bytes(path, lambda fh: fh.write(text.encode()))


def write_json_in_place(path: Path, data: Any) -> None:
    """Last resort when the directory no longer takes new files (read-only mid-run): rewrite the
    existing file itself. Not atomic, but it is how a failed run still gets marked failed."""
    text = json.dumps(data, indent=2, sort_keys=True, default=str).encode()
    try:
        with open(path, "r+b") as fh:
            fh.write(text)
            fh.truncate()
            fh.flush()
            os.fsync(fh.fileno())
    except OSError as exc:
        raise io_error(path, exc, "write") from exc


# ---------------------------------------------------------------------------- checkpoints
def save_checkpoint(state: dict[str, Any], out: Path) -> None:
    """Write ``checkpoint.pt`` atomically (a crash leaves the previous one), behind a header holding
    the payload's SHA-256 and size, so a damaged file is refused instead of loaded."""
    write_checked(out / CHECKPOINT, state)


def write_checked(path: Path, state: Any) -> None:
    """``torch.save(state)`` to ``path`` atomically, behind the checksum header :func:`read_checked` verifies."""
    state_file.write_checked(path, state, atomic=atomic_write_bytes)


def load_checkpoint(path: Path) -> dict[str, Any]:
    """Read a checkpoint written by :func:`save_checkpoint`; refuses a missing, truncated or altered one."""
    if not path.exists():
        raise RunDirError(f"{path.parent}: no checkpoint to resume from ({path.name} missing)")
    # Our own file (it holds optimizer and plugin state, plain containers and tensors).
    return read_state(path, "start a fresh run (--force)")


def checkpoint_step(out: Path) -> int | None:
    """The step the checkpoint in ``out`` holds, or ``None`` when there is none (or it cannot be read):
    what a message about an interrupted run tells its reader."""
    if not (out / CHECKPOINT).exists():
        return None
    try:
        step = load_checkpoint(out / CHECKPOINT).get("step")
    except DataflexError:
        return None
    return step if isinstance(step, int) and not isinstance(step, bool) else None


# ---------------------------------------------------------------------------- metrics
def metrics_line(metrics: dict[str, float]) -> str:
    return json.dumps(metrics, sort_keys=True) + "\n"


def write_metrics(path: Path, rows: list[dict[str, float]]) -> None:
    """Rewrite ``metrics.jsonl`` with ``rows``."""
    text = "".join(metrics_line(m) for m in rows)
    atomic_write_bytes(path, lambda fh: fh.write(text.encode()))


def read_metrics(path: Path, limit: int | None = None) -> list[dict[str, float]]:
    """The per-step metrics of a run directory (``metrics.jsonl``); blank lines are skipped.

    With ``limit``, only the first ``limit`` steps are read and lines after them are not looked at (a
    resume redoes those steps, so a line cut short by a crash there loses nothing). Raises
    :class:`CheckpointError` naming the file and the line of any line that is not a JSON object.
    """
    if not path.exists():
        return []
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read ({exc.strerror or exc})") from exc
    rows: list[dict[str, float]] = []
    for number, raw in enumerate(data.split(b"\n"), start=1):
        if limit is not None and len(rows) >= limit:
            break
        if not raw.strip():
            continue
        try:
            row = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as exc:
            raise CheckpointError(f"{path}: line {number} is not UTF-8 text (byte {exc.start}); the file is "
                                  "damaged") from None
        except ValueError as exc:
            raise CheckpointError(f"{path}: line {number} is not valid JSON ({exc}); the file is damaged") from None
        if not isinstance(row, dict):
            raise CheckpointError(f"{path}: line {number} holds a JSON {type(row).__name__}, not an object; the "
                                  "file is damaged")
        rows.append(row)
    return rows


# ---------------------------------------------------------------------------- the run directory
def existing_run_files(out: Path) -> list[str]:
    return [name for name in RUN_FILES if (out / name).exists()] if out.is_dir() else []


def check_run_dir(out: Path, *, force: bool) -> None:
    """Refuse to overwrite a run unless ``force``; with ``force``, remove only the run's own files. Called
    holding the directory (:func:`claimed_run_dir`), so no other run's files are ever removed."""
    found = existing_run_files(out)
    if not found:
        return
    if not force:
        raise RunDirError(f"{out} already holds a run ({', '.join(found)}); use --force to overwrite it or "
                          "--resume to continue it")
    for name in found:
        try:
            (out / name).unlink()
        except OSError as exc:
            raise io_error(out / name, exc, "remove the old run's file") from exc


def make_run_dir(out: Path) -> bool:
    """Create ``out`` (and its parents) if needed; returns whether it was created. Refuses, naming the
    culprit, a path that is a file, lies under a file, or cannot be created."""
    if out.is_dir():
        return False
    if out.exists():
        raise RunDirError(f"{out}: exists and is not a directory; choose another --out")
    for parent in out.parents:
        if parent.exists() and not parent.is_dir():
            raise RunDirError(f"{out}: cannot create the run directory: {parent} is a file, not a directory")
    try:
        out.mkdir(parents=True)
    except FileExistsError:  # created meanwhile by someone else: fine if it is a directory
        if not out.is_dir():
            raise RunDirError(f"{out}: exists and is not a directory; choose another --out") from None
        return False
    except OSError as exc:
        raise io_error(out, exc, "create the run directory") from exc
    return True


def check_writable(out: Path) -> None:
    """Create, write, rename and remove a file in ``out`` (what every save does), before any training."""
    probe = out / ".dataflex-write-probe"
    atomic_write_bytes(probe, lambda fh: fh.write(b"probe\n"))
    try:
        probe.unlink()
    except OSError as exc:
        raise io_error(probe, exc, "remove a file") from exc


# ---------------------------------------------------------------------------- the lock
#: Run directories (resolved) this process holds. ``flock`` locks belong to an open file, so a second ``open`` +
#: ``flock`` in the same process would refuse its own run with another process's message; this names it right.
_HELD: set[Path] = set()
_HELD_GUARD = threading.Lock()


def _holder(path: Path) -> str:
    try:
        info = json.loads(path.read_text() or "{}")
    except (OSError, ValueError):
        info = {}
    if not isinstance(info, dict) or "pid" not in info:
        return "another process (pid unknown)"
    where = f" on {info['host']}" if info.get("host") and info.get("host") != socket.gethostname() else ""
    since = f", since {info['since']}" if info.get("since") else ""
    return f"pid {info['pid']}{where}{since}"


@contextmanager
def claimed_run_dir(out: Path, *, resume: bool = False) -> Iterator[None]:
    """Create the run directory ``out`` (or, to resume, require it) and hold its lock for the duration."""
    if resume and not out.is_dir():
        raise RunDirError(f"{out}: no run to resume (no such directory)")
    make_run_dir(out)
    with run_dir_lock(out):
        yield


@contextmanager
def run_dir_lock(out: Path) -> Iterator[None]:
    """Hold an exclusive lock on the run directory ``out`` (which must exist) for the duration.

    A second holder, in another process or in this one (another thread, or nested use: the run directory has
    one owner, :func:`~dataflex_bus.shim.run.run_training`), is refused with a :class:`RunDirError` naming
    the holder's pid. Uses ``fcntl.flock`` (Linux, macOS); where locking is unsupported the
    error says so rather than running unprotected. The lock file stays; only the lock is released (also
    by the kernel when the holder dies), so a crash never leaves a stale lock behind.
    """
    key = out.resolve()
    with _HELD_GUARD:  # claimed before the flock, so two threads of this process never race to it
        if key in _HELD:
            raise RunDirError(f"{out} is in use by another run in this process (pid {os.getpid()}); "
                              "choose another --out")
        _HELD.add(key)
    try:
        with _flock(out):
            yield
    finally:
        with _HELD_GUARD:
            _HELD.discard(key)


@contextmanager
def _flock(out: Path) -> Iterator[None]:
    """``flock`` on ``out``'s lock file, naming this process as the holder while held (other processes)."""
    try:
        import fcntl
    except ImportError:
        raise RunDirError(f"{out}: cannot lock the run directory: file locking (fcntl) is not available on "
                          f"{sys.platform}; dataflex run needs it to keep two runs out of one directory") from None
    path = out / LOCK
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    except OSError as exc:
        raise io_error(path, exc, "create the run directory's lock file") from exc
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RunDirError(f"{out} is in use by another dataflex run ({_holder(path)}); wait for it to finish "
                              "or choose another --out") from None
        except OSError as exc:
            raise RunDirError(f"{out}: cannot lock the run directory ({exc.strerror or exc}); file locking is not "
                              "supported on this file system: choose a local --out") from None
        info = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%d %H:%M:%S")}
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(info).encode(), 0)
        except OSError:
            pass  # the holder's name is a courtesy for the refused run; the lock itself is held
        try:
            remove_stale_temporaries(out)
            yield
        finally:
            try:
                os.ftruncate(fd, 0)  # no holder while unlocked
            except OSError:
                pass
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)
