"""Per-row work on jagged per-token fields, without a dense ``[B, T]`` copy.

verl hands the driver its per-token fields as jagged nested tensors (``torch.jagged`` layout: one flat
``values()`` tensor of every row's tokens end to end, and ``offsets()``). With response lengths spread over three
orders of magnitude the flat values are a small part of the padded ``[B, T]`` tensor (about a sixth at 16,384 rows
of up to 8,192 log-uniform tokens), so :class:`~dataflex_bus.batch.Batch` keeps such fields jagged and reduces
rows (rewards, lengths, non-finite checks) from the values here, a slice of rows at a time; a dense view is made
only when a component reads a field per token.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

#: Rows reduced at a time: the temporaries of a reduction (a converted copy of the values) stay a slice of the
#: batch, not a batch-sized tensor.
ROW_CHUNK = 1024


def is_jagged(t: Tensor) -> bool:
    """Whether ``t`` is a jagged nested tensor (``[B, j]`` rows of different lengths, verl's per-token layout)."""
    return bool(t.is_nested) and t.layout == torch.jagged


def offsets_of(t: Tensor) -> Tensor:
    """Long ``[B + 1]``: where each row of the jagged ``t`` starts in its values (and where the last ends)."""
    return t.offsets()  # type: ignore[attr-defined]  # a jagged NestedTensor method, not in the stubs


def row_lengths(t: Tensor) -> Tensor:
    """Long ``[B]``: each row's length in the jagged ``t``."""
    return offsets_of(t).diff()


def longest(t: Tensor) -> int:
    """The longest row of the jagged ``t`` (0 without rows): the width of its dense view."""
    lengths = row_lengths(t)
    return int(lengths.max()) if lengths.numel() else 0


def _chunks(rows: int) -> range:
    return range(0, rows, ROW_CHUNK)


def _span(offsets: Tensor, first: int) -> tuple[Tensor, int, int]:
    """The offsets (from 0) and the value span of the :data:`ROW_CHUNK` rows from row ``first``."""
    bounds = offsets[first:first + ROW_CHUNK + 1]
    start, end = int(bounds[0]), int(bounds[-1])
    return bounds - start, start, end


def row_reduce(fn: Callable[..., Tensor], *fields: Tensor, width: int | None = None) -> Tensor:
    """``fn(*dense_rows)`` (a ``[k]`` result) over :data:`ROW_CHUNK` rows at a time of the jagged ``fields`` (the
    same rows each, :func:`same_rows`) padded to ``width`` (default: the longest row of ``fields[0]``, the dense
    view's): the very reduction the dense ``[B, T]`` view would get (a row's sum is the same bits whatever the rows
    around it), with a slice of rows padded at a time."""
    offsets = offsets_of(fields[0])
    rows = offsets.numel() - 1
    width = longest(fields[0]) if width is None else width
    parts = []
    for first in _chunks(rows):
        bounds, start, end = _span(offsets, first)
        lengths = bounds.diff()
        dense_rows = [torch.nested.to_padded_tensor(
            torch.nested.nested_tensor_from_jagged(f.values()[start:end], offsets=bounds,
                                                   max_seqlen=int(lengths.max()), min_seqlen=int(lengths.min())),
            0, output_size=(len(lengths), width, *f.values().shape[1:])) for f in fields]
        parts.append(fn(*dense_rows))
    if not parts:
        return fn(*[torch.zeros((0, width, *f.values().shape[1:]), dtype=f.dtype) for f in fields])
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def row_counts(t: Tensor) -> Tensor:
    """Long ``[B]``: each row's nonzero tokens in the jagged ``t`` (a mask's lengths), one segment reduction per
    :data:`ROW_CHUNK` rows over the flat values (float32 counts exactly far past any response length)."""
    offsets = offsets_of(t)
    rows = offsets.numel() - 1
    parts = []
    for first in _chunks(rows):
        bounds, start, end = _span(offsets, first)
        flags = t.values()[start:end].ne(0).to(torch.float32)
        parts.append(torch.segment_reduce(flags, "sum", offsets=bounds, axis=0))
    if not parts:
        return torch.zeros(0, dtype=torch.long)
    return (parts[0] if len(parts) == 1 else torch.cat(parts)).to(torch.long)


def row_any(t: Tensor, flags: Tensor) -> Tensor:
    """Bool ``[B]``: rows of the jagged ``t`` holding a true entry of ``flags`` (bool, like ``t.values()``)."""
    hits = torch.nonzero(flags).flatten()
    out = torch.zeros(offsets_of(t).numel() - 1, dtype=torch.bool)
    if hits.numel():
        out[torch.searchsorted(offsets_of(t), hits, right=True) - 1] = True
    return out


def like(t: Tensor, values: Tensor) -> Tensor:
    """A jagged tensor with ``t``'s rows holding ``values`` (one per value of ``t``), row-length bounds kept (a
    jagged tensor without them pads to its values' whole length)."""
    lengths = row_lengths(t)
    return torch.nested.nested_tensor_from_jagged(
        values, offsets=offsets_of(t), max_seqlen=int(lengths.max()) if lengths.numel() else 0,
        min_seqlen=int(lengths.min()) if lengths.numel() else 0)


def rows(t: Tensor, index: Tensor) -> Tensor:
    """The rows ``index`` (long, in that order) of the jagged ``t``, still jagged: one gather of their values."""
    offsets = offsets_of(t)
    lengths = offsets.diff()[index]
    total = int(lengths.sum())
    starts = torch.repeat_interleave(offsets[:-1][index], lengths, output_size=total)
    within = torch.arange(total) - torch.repeat_interleave(torch.cumsum(lengths, 0) - lengths, lengths,
                                                          output_size=total)
    values = t.values()[starts + within]
    new_offsets = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(lengths, 0)])
    return torch.nested.nested_tensor_from_jagged(
        values, offsets=new_offsets, max_seqlen=int(lengths.max()) if lengths.numel() else 0,
        min_seqlen=int(lengths.min()) if lengths.numel() else 0)


def dense(t: Tensor) -> Tensor:
    """The right-padded ``[B, longest]`` view of the jagged ``t`` (zeros, or ``False``, past each row's end)."""
    return torch.nested.to_padded_tensor(t, 0, output_size=(offsets_of(t).numel() - 1, longest(t),
                                                             *t.values().shape[1:]))


def same_rows(a: Tensor, b: Tensor) -> bool:
    """Whether the jagged ``a`` and ``b`` have the same rows (offsets), so their values line up token by token."""
    oa, ob = offsets_of(a), offsets_of(b)
    return oa is ob or (oa.shape == ob.shape and bool(torch.equal(oa, ob)))


__all__ = ["ROW_CHUNK", "dense", "is_jagged", "like", "longest", "offsets_of", "row_any", "row_counts",
           "row_lengths", "row_reduce", "rows", "same_rows"]
