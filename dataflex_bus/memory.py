"""How much memory this machine has and whether a size a config asks for fits in it, checked before anything is
allocated: a parameter of absurd size (a replay ``capacity`` of 10^10 rows, an allocator ``budget`` of 10^9
rollouts) is refused at validation, on every host, naming the key and the bytes it would need."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .host import HostDescription

GIB = 1024 ** 3
#: Used when the machine does not say how much memory it has.
FALLBACK_MEMORY = 16 * GIB
#: The fewest bytes one rollout row takes in a step on any host: its token ids, masks, log-probs, advantages and
#: weights (8 tensors) over even a 16-token response, 8 bytes a value. A floor, not an estimate: a row of a real
#: model's sequence takes far more, so every host gives its own estimate (``HostDescription.row_bytes``) and this
#: is used only where none is known (validation without a host).
ROLLOUT_ROW_BYTES = 8 * 16 * 8
#: The fewest bytes one row in the replay store takes beyond its columns: its behaviour log-probs and token ids
#: (int32) over a 16-token response, and a 16-token prompt's ids. A floor, used where a host gives no estimate
#: (``HostDescription.stored_row_bytes``).
STORED_ROW_BYTES = 16 * 4 + 2 * 16 * 4


def machine_memory() -> int:
    """Physical memory in bytes (Linux, macOS); :data:`FALLBACK_MEMORY` where the OS does not say."""
    try:
        pages, size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return FALLBACK_MEMORY
    return pages * size if pages > 0 and size > 0 else FALLBACK_MEMORY


def format_bytes(n: int) -> str:
    """``n`` bytes as ``"1.5 GiB"`` (KiB to TiB)."""
    for unit, scale in (("TiB", 1024 ** 4), ("GiB", GIB), ("MiB", 1024 ** 2)):
        if n >= scale:
            return f"{n / scale:,.1f} {unit}"
    return f"{n / 1024:.1f} KiB"


def beyond_memory(nbytes: int, what: str, fix: str, limit: int | None = None) -> str | None:
    """The refusal of ``what`` needing ``nbytes`` when that exceeds ``limit`` (this machine's memory by
    default), ending with ``fix``; ``None`` when it fits."""
    limit = machine_memory() if limit is None else limit
    if nbytes <= limit:
        return None
    return (f"{what} need at least {format_bytes(nbytes)} ({nbytes:,} bytes) of memory, but this machine has "
            f"{format_bytes(limit)}; {fix}")


def rollout_row(host: HostDescription) -> tuple[int, str]:
    """``(bytes, basis)``: what one rollout row of ``host`` takes in a step (its own estimate, else the floor
    :data:`ROLLOUT_ROW_BYTES`) and how that was found, for a refusal."""
    if host.row_bytes is not None:
        return int(host.row_bytes), host.row_bytes_basis or f"host {host.name!r}'s estimate"
    return ROLLOUT_ROW_BYTES, "at least, the floor of any host"


def stored_row(host: HostDescription) -> tuple[int, str]:
    """``(bytes, basis)``: what one row of the replay store takes beyond its columns on ``host`` (its own
    estimate, else the floor :data:`STORED_ROW_BYTES`) and how that was found, for a refusal."""
    if host.stored_row_bytes is not None:
        return int(host.stored_row_bytes), host.stored_row_basis or f"host {host.name!r}'s estimate"
    return STORED_ROW_BYTES, "at least, the floor of any host"
