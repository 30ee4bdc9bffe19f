"""A host's dataflex state file: written atomically behind a checksum header, read back checked.

Every host keeps the state of its dataflex block (the runtime's plugins, the host kit's counters, its own
prompt sampler) in one file beside its framework's checkpoint: the shim's ``checkpoint.pt``, verl's
``global_step_N/dataflex_state.pt``, TRL's ``checkpoint-N/dataflex_state.pt``. The file is a
``torch.save`` payload behind one header line (its SHA-256 and size), written through a uniquely named
temporary file and a rename, so a kill mid-save leaves the previous file (or none), never a truncated
one; a file that is missing its header, truncated, altered or not a mapping is refused naming the file,
and each entry a host restores is named when it is missing or does not fit (:func:`restore`).
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import re
import secrets
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, BinaryIO

import torch

from .errors import ConfigError, ConfigIssue, DataflexError

log = logging.getLogger("dataflex_bus")

#: First line of a state file: the SHA-256 and size of the ``torch.save`` payload after it.
MAGIC = b"dataflex-checkpoint/1"
#: The temporary names :func:`atomic_write` uses: ``.NAME.PID.RANDOM.tmp``.
TEMPORARY = re.compile(r"^\.(?P<name>.+)\.(?P<pid>\d+)\.[0-9a-f]{8}\.tmp$")


class CheckpointError(DataflexError):
    """A state file (or a run's metrics or record) cannot be read, is damaged, or does not fit this run."""


def atomic_write(path: Path, write: Callable[[BinaryIO], object]) -> None:
    """Write through a uniquely named temporary file in the same directory, then rename over ``path``.

    The name is unique per process and call, so two writers never share a temporary file; a failure removes
    it. ``OSError`` propagates (the caller names what it was writing)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    # O_EXCL: never reuse whatever is at that name; the mode leaves the umask to the OS (as open()).
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        discard(tmp)
        raise


def discard(path: Path) -> None:
    """Remove ``path`` if it can be removed."""
    try:
        path.unlink()
    except OSError:
        pass


#: Digits of the size in a header written ahead of its payload (:func:`write_checked`), zero-padded.
SIZE_DIGITS = 20


def header(digest: str, size: int) -> bytes:
    """The header line of a payload of SHA-256 ``digest`` and ``size`` bytes (fixed width, so it can be
    written in front of a payload streamed after it)."""
    return MAGIC + f" sha256={digest} bytes={size:0{SIZE_DIGITS}d}\n".encode()


class _Hashing:
    """A writable stream passing what it is given to ``fh`` while hashing and counting it."""

    def __init__(self, fh: BinaryIO) -> None:
        self.fh, self.sha, self.size = fh, hashlib.sha256(), 0

    def write(self, data: bytes | memoryview) -> int:
        self.sha.update(data)
        self.size += len(data)
        return self.fh.write(data)

    def flush(self) -> None:
        self.fh.flush()


def checked_bytes(state: Any) -> tuple[bytes, memoryview]:
    """``(header, payload)`` of ``torch.save(state)`` in memory: what :func:`read_checked` verifies (for a small
    state; :func:`write_checked` streams to the file instead)."""
    buf = io.BytesIO()
    torch.save(state, buf)
    payload = buf.getbuffer()
    return header(hashlib.sha256(payload).hexdigest(), len(payload)), payload


def write_checked(path: Path, state: Any, *, atomic: Callable[[Path, Callable[[BinaryIO], object]], None]
                  = atomic_write) -> None:
    """``torch.save(state)`` to ``path`` atomically, behind the checksum header (``atomic``: the writer, which
    may wrap ``OSError`` in its own error). The payload is streamed to the file and hashed as it goes, the
    header written over a placeholder of its width at the end: no second copy of the state in memory."""

    def write(fh: BinaryIO) -> None:
        fh.write(header("0" * 64, 0))
        stream = _Hashing(fh)
        torch.save(state, stream)  # type: ignore[arg-type]  # (a writable stream: torch.save calls write only)
        fh.seek(0)
        fh.write(header(stream.sha.hexdigest(), stream.size))
        fh.seek(0, os.SEEK_END)

    atomic(path, write)


def save_state(path: str | os.PathLike[str], state: Mapping[str, Any]) -> None:
    """A host's state file: :func:`write_checked`, an ``OSError`` refused naming the file."""
    target = Path(path)
    try:
        write_checked(target, dict(state))
    except OSError as exc:
        raise CheckpointError(f"{target}: cannot write the dataflex state ({exc.strerror or exc})") from exc


class Retention:
    """A host's checkpoint retention applied to the state files written beside its checkpoints: of the files
    this process saved, the newest ``keep`` stay (``None``: all), as the host keeps its own (verl's checkpoint
    manager counts the checkpoints its process saved, ``trainer.max_actor_ckpt_to_keep``). A removed file's
    folder goes too when nothing else is left in it."""

    def __init__(self, keep: int | None) -> None:
        self.keep = keep if isinstance(keep, int) and not isinstance(keep, bool) and keep > 0 else None
        self.saved: list[Path] = []

    def wrote(self, path: str | os.PathLike[str]) -> list[Path]:
        """Record ``path`` as just written; returns the older files removed."""
        target = Path(path)
        self.saved = [p for p in self.saved if p != target] + [target]
        if self.keep is None or len(self.saved) <= self.keep:
            return []
        old, self.saved = self.saved[:-self.keep], self.saved[-self.keep:]
        for p in old:
            discard(p)
            try:
                p.parent.rmdir()  # only when empty
            except OSError:
                pass
        return old


def read_checked(path: Path, fresh: str) -> bytes:
    """The payload of a file :func:`write_checked` wrote, verified against its header; a missing header, a
    wrong size or checksum is a :class:`CheckpointError` naming the file and ending in ``fresh`` (the fix)."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read the checkpoint ({exc.strerror or exc})") from exc
    head, sep, payload = data.partition(b"\n")
    fields = head.split(b" ")
    if not sep or fields[0] != MAGIC or len(fields) != 3:
        why = "the file is empty" if not data else "not written by dataflex, or damaged at its start"
        raise CheckpointError(f"{path}: cannot read the checkpoint (no {MAGIC.decode()} header: {why}); {fresh}")
    try:
        digest = fields[1].removeprefix(b"sha256=").decode("ascii")
        size = int(fields[2].removeprefix(b"bytes="))
    except (UnicodeDecodeError, ValueError):
        raise CheckpointError(f"{path}: cannot read the checkpoint (damaged header {head[:80]!r}); "
                              f"{fresh}") from None
    if len(payload) != size:
        raise CheckpointError(f"{path}: the checkpoint is truncated or extended ({len(payload)} bytes after the "
                              f"header, the header says {size}); {fresh}")
    if hashlib.sha256(payload).hexdigest() != digest:
        raise CheckpointError(f"{path}: checksum mismatch, the checkpoint is damaged (SHA-256 differs from the "
                              f"one written with it); {fresh}")
    return payload


def read_state(path: str | os.PathLike[str], fresh: str, *, weights_only: bool = True) -> dict[str, Any]:
    """The mapping in a state file, checked (:func:`read_checked`). ``weights_only``: unpickle plain
    containers and tensors only (what the hosts' state files hold), so a file never runs code when read."""
    target = Path(path)
    payload = read_checked(target, fresh)
    try:
        state = torch.load(io.BytesIO(payload), map_location="cpu", weights_only=weights_only)
    except Exception as exc:
        raise CheckpointError(f"{target}: cannot read the checkpoint ({type(exc).__name__}: {exc}); "
                              f"{fresh}") from exc
    if not isinstance(state, dict):
        raise CheckpointError(f"{target}: cannot read the checkpoint (it holds a {type(state).__name__}, not a "
                              f"mapping); {fresh}")
    return state


def check_format(path: str | os.PathLike[str], state: Mapping[str, Any], what: str, formats: tuple[int, ...],
                 fresh: str) -> int:
    """The state's ``format`` entry, refused naming the file unless it is one of ``formats``."""
    found = state.get("format")
    if found not in formats:
        raise CheckpointError(f"{path}: not a dataflex {what} state (entry 'format' holds {found!r}, expected "
                              f"{' or '.join(map(str, formats))}); {fresh}")
    return int(found)


def restore(path: str | os.PathLike[str], state: Mapping[str, Any],
            loaders: Mapping[str, Callable[[Any], None]], fresh: str) -> None:
    """Hand each entry of ``state`` to its loader, in order; a missing entry, or one its loader cannot take (a
    damaged value), is refused naming the file and the entry. A loader's own refusal of the config (a
    :class:`~dataflex_bus.errors.ConfigError`: the checkpoint of another block, say) keeps its type and keys,
    each issue saying where it was read."""
    for entry, load in loaders.items():
        if entry not in state:
            raise CheckpointError(f"{path}: entry {entry!r} is missing (the file holds {sorted(state)}); {fresh}")
        try:
            load(state[entry])
        except ConfigError as exc:  # the checkpoint of another block, say: its issues, with where they were read
            raise ConfigError([ConfigIssue(i.key, f"{i.message} (read from {path}, entry {entry!r})", i.allowed,
                                           i.hint) for i in exc.issues]) from exc
        except DataflexError as exc:
            raise CheckpointError(f"{path}: entry {entry!r}: {exc}") from exc
        except (KeyError, TypeError, ValueError, IndexError, AttributeError, RuntimeError) as exc:
            raise CheckpointError(f"{path}: entry {entry!r} does not fit this run ({type(exc).__name__}: {exc}); "
                                  f"{fresh}") from exc


def warn_no_state(host: str, step: int, folder: Any, name: str) -> None:
    """A host resumed from a checkpoint holding no dataflex state file (written without a block, or by
    another tool): the method starts fresh, said once."""
    log.warning("dataflex: resumed %s at step %d from %s, which holds no %s; the dataflex method starts fresh",
                host, step, folder, name)
