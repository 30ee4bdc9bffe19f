"""Rows of one per-token field kept packed: each row's values end to end in one flat tensor, with its extent.

A dense ``[n, width]`` field of a rollout batch is mostly padding when lengths spread over orders of magnitude
(a 16-token answer padded to the batch's 8,192). :class:`Packed` keeps only each row's first ``extent[i]``
values (its given length, or, without one, up to its last nonzero value: what follows was zeros and is zeros
again when read back), integer values in the narrowest type that holds them, and nothing at all for a field
whose every kept value is derivable from the extents (a mask of ones, position ids counting from 0). Row
offsets are computed from the extents when needed, not stored. :func:`pack`, :func:`take` and :func:`cat`
work on whole tensors; :func:`to_dense` pads back to a dense view only for the rows asked for.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
from torch import Tensor

INT_TYPES = (torch.uint8, torch.int16, torch.int32, torch.int64)
#: What a field's kept values can be derived as: nothing stored (``ones``: every kept value is 1;
#: ``positions``: each row's values count 0, 1, ... along the row).
DERIVED = ("ones", "positions")


def narrowest(t: Tensor) -> torch.dtype:
    """The narrowest integer dtype holding every value of the integer tensor ``t`` (its own otherwise)."""
    if t.is_floating_point() or t.dtype == torch.bool or t.is_complex() or t.numel() == 0:
        return t.dtype
    lo, hi = (int(x) for x in torch.aminmax(t))
    for dtype in INT_TYPES:
        info = torch.iinfo(dtype)
        if info.min <= lo and hi <= info.max:
            return dtype
    return t.dtype


def wider(a: torch.dtype, b: torch.dtype) -> torch.dtype:
    """The type that holds values of both ``a`` and ``b`` (integers: the wider of the two)."""
    if a in INT_TYPES and b in INT_TYPES:
        return INT_TYPES[max(INT_TYPES.index(a), INT_TYPES.index(b))]
    return torch.promote_types(a, b)


def _extent_type(width: int) -> torch.dtype:
    return torch.int16 if width < 2**15 else torch.int32


@dataclass
class Packed:
    """``n`` rows of one field, packed (see the module doc): ``values`` ``[sum(extent), *rest]`` (``None`` when
    ``derived``), ``extent`` ``[n]``, the dense ``width`` the rows were given at, the ``dtype`` they were given
    in and, for a field that had them, that the extents are the host's own lengths (``given``)."""

    values: Tensor | None
    extent: Tensor
    width: int
    dtype: torch.dtype
    rest: tuple[int, ...] = ()
    derived: str = ""
    given: bool = False

    def __len__(self) -> int:
        return int(self.extent.numel())

    def nbytes(self) -> int:
        held = 0 if self.values is None else self.values.numel() * self.values.element_size()
        return held + self.extent.numel() * self.extent.element_size()

    def row_bytes(self) -> Tensor:
        """Long ``[n]``: bytes each row's values take (0 for a derived field)."""
        if self.values is None:
            return torch.zeros(len(self), dtype=torch.long)
        per_value = self.values.element_size() * math.prod(self.rest)
        return self.extent.to(torch.long) * per_value

    def stored_values(self) -> Tensor:
        """The kept values, derived ones made (in the stored dtype)."""
        if self.values is not None:
            return self.values
        ext = self.extent.to(torch.long)
        if self.derived == "ones":
            return torch.ones((int(ext.sum()), *self.rest), dtype=self.dtype)
        starts = torch.cumsum(ext, 0) - ext
        total = int(ext.sum())
        return (torch.arange(total) - torch.repeat_interleave(starts, ext, output_size=total)).to(self.dtype)


def _positions(ext: Tensor, total: int) -> Tensor:
    starts = torch.cumsum(ext, 0) - ext
    return torch.arange(total) - torch.repeat_interleave(starts, ext, output_size=total)


def pack(dense: Tensor, lengths: Tensor | None = None) -> Packed:
    """``dense`` ``[n, width, *rest]`` packed: each row's first ``lengths[i]`` values (``None``: up to its last
    nonzero value). Values past a row's length are padding and read back as zeros. A jagged nested tensor
    (verl's per-token fields in TransferQueue) is packed as it is: its rows' lengths are its offsets'."""
    if dense.is_nested:
        kept = dense.values()
        ext = dense.offsets().diff().to(torch.long)  # type: ignore[attr-defined]
        width = int(ext.max()) if ext.numel() else 0
        return _packed(kept, ext, width, dense.dtype, tuple(kept.shape[1:]), True)
    n, width, rest = dense.shape[0], dense.shape[1], tuple(dense.shape[2:])
    if lengths is not None:
        ext = lengths.to(torch.long).clamp(0, width)
    else:
        nonzero = dense != 0
        if rest:
            nonzero = nonzero.reshape(n, width, -1).any(-1)
        last = (nonzero * torch.arange(1, width + 1, dtype=torch.int32)).amax(1) if width else \
            torch.zeros(n, dtype=torch.int32)
        ext = last.to(torch.long)
    kept = dense[torch.arange(width)[None, :] < ext[:, None]]
    return _packed(kept, ext, width, dense.dtype, rest, lengths is not None)


def _packed(kept: Tensor, ext: Tensor, width: int, dtype: torch.dtype, rest: tuple[int, ...],
            given: bool) -> Packed:
    """Kept values ``kept`` of rows of extents ``ext``: derived when they can be, else narrowed."""
    out = Packed(None, ext.to(_extent_type(width)), width, dtype, rest, given=given)
    total = int(kept.shape[0])
    if not kept.is_complex():
        if bool((kept == 1).all()):
            return replace(out, derived="ones")
        if not rest and total and bool((kept == _positions(ext, total).to(kept.dtype)).all()):
            return replace(out, derived="positions")
    return replace(out, values=kept.to(narrowest(kept)).contiguous())


def rows_of(value: Tensor, keep: Tensor) -> Tensor:
    """The rows ``keep`` (long) of a dense or jagged nested tensor."""
    if not value.is_nested:
        return value[keep]
    if keep.numel() == value.shape[0] and bool((keep == torch.arange(keep.numel())).all()):
        return value
    p = take(pack(value), keep)
    ext = p.extent.to(torch.long)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(ext, 0)])
    return torch.nested.nested_tensor_from_jagged(p.stored_values().to(value.dtype), offsets=offsets)


def take(p: Packed, rows: Tensor) -> Packed:
    """The rows ``rows`` (long, in that order) of ``p``, packed."""
    ext = p.extent.to(torch.long)
    picked = ext[rows]
    values = None
    if p.values is not None:
        total = int(picked.sum())
        src = torch.repeat_interleave((torch.cumsum(ext, 0) - ext)[rows], picked, output_size=total)
        values = p.values[src + _positions(picked, total)]
    return replace(p, values=values, extent=p.extent[rows])


def cat(parts: Sequence[Packed]) -> Packed:
    """The rows of ``parts`` one after another, in one :class:`Packed` (the widest width, a type that holds
    every part's values; derived only when every part is derived alike)."""
    first = parts[0]
    if any(q.rest != first.rest for q in parts):
        raise ValueError(f"packed rows of different shapes per token: {sorted({q.rest for q in parts})}")
    width = max(q.width for q in parts)
    extent = torch.cat([q.extent.to(_extent_type(width)) for q in parts])
    given = all(q.given for q in parts)
    kinds = {q.derived for q in parts}
    if len(kinds) == 1 and first.derived:
        return Packed(None, extent, width, first.dtype, first.rest, first.derived, given)
    stored = [q.stored_values() for q in parts]
    dtype = stored[0].dtype
    for s in stored[1:]:
        dtype = wider(dtype, s.dtype)
    return Packed(torch.cat([s.to(dtype) for s in stored]), extent, width, first.dtype, first.rest, "", given)


def to_dense(p: Packed, width: int | None = None, dtype: torch.dtype | None = None) -> Tensor:
    """``p``'s rows as a dense ``[n, width, *rest]`` tensor (zeros past each row's extent) in ``dtype`` (the
    dtype the rows were given in by default)."""
    width = p.width if width is None else width
    ext = p.extent.to(torch.long)
    out = torch.zeros((len(p), width, *p.rest), dtype=dtype or p.dtype)
    if len(p) and width:
        if int(ext.max()) > width:
            raise ValueError(f"rows of up to {int(ext.max())} values do not fit in width {width}")
        out[torch.arange(width)[None, :] < ext[:, None]] = p.stored_values().to(out.dtype)
    return out


__all__ = ["DERIVED", "Packed", "cat", "narrowest", "pack", "rows_of", "take", "to_dense", "wider"]
