"""The rows one insert put in the replay store, packed: a :class:`Chunk` (see :mod:`dataflex_bus.replay_store`).

A chunk holds, for its rows, the host's per-token payload fields packed (:class:`~dataflex_bus.packed.Packed`),
its one-value-per-row payload fields as narrow columns, and the behaviour log-probs ``mu``: packed, or not kept
at all when they equal a payload field (verl's ``rollout_log_probs``; ``mu_alias`` names it). Which store slot
each row sits in is ``slots`` (-1 once evicted). Everything here works on whole tensors; the store calls
:func:`make_chunk`, :func:`take_chunk` (drop evicted rows), :func:`merge_chunks` and :func:`read_rows`.
"""

from __future__ import annotations

from collections.abc import Container, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .errors import BatchFieldError
from .packed import DERIVED, Packed, cat, narrowest, pack, take, to_dense, wider

#: The payload field ``mu`` is most often equal to, tried first.
MU_TWIN = "rollout_log_probs"


class NonFinite(ValueError):
    """A saved chunk's behaviour log-probs are not all finite."""


@dataclass
class Chunk:
    """Rows stored together (see the module doc): ``slots`` ``[n]`` (long, -1: evicted), per-token ``fields``,
    per-row ``scalars`` ``[n]``, ``mu`` packed (``None`` when ``mu_alias`` names the payload field it equals)
    and the width ``mu`` was given at."""

    slots: Tensor
    fields: dict[str, Packed]
    scalars: dict[str, Tensor]
    mu: Packed | None
    mu_alias: str
    mu_width: int

    def __len__(self) -> int:
        return int(self.slots.numel())

    def nbytes(self) -> int:
        held = sum(p.nbytes() for p in self.fields.values()) + (0 if self.mu is None else self.mu.nbytes())
        return held + sum(t.numel() * t.element_size() for t in (self.slots, *self.scalars.values()))

    def row_bytes(self) -> Tensor:
        """Long ``[n]``: bytes each row's per-token values take."""
        out = torch.zeros(len(self), dtype=torch.long)
        for p in (*self.fields.values(), *(() if self.mu is None else (self.mu,))):
            out += p.row_bytes()
        return out


def make_chunk(slots: Tensor, payload: Mapping[str, Tensor], lengths: Mapping[str, Tensor], mu: Tensor,
               known: Container[str], scalar_names: set[str]) -> Chunk:
    """The rows of ``payload`` (dense ``[n, w, ...]`` per field, ``[n]`` for one value per row; ``lengths``:
    each row's length in a field, where the host has them) and ``mu`` ``[n, T]`` as a chunk in ``slots``.
    ``known``: the fields stored so far, ``scalar_names`` those of them stored one value per row (a field may
    not change between the two; new ones are added to it)."""
    fields: dict[str, Packed] = {}
    scalars: dict[str, Tensor] = {}
    for name, value in payload.items():
        per_row = value.dim() < 2
        if name in known and (name in scalar_names) != per_row:
            raise BatchFieldError("dataflex replay", name, "stored with one value per row before, now per token"
                                  if not per_row else "stored per token before, now with one value per row")
        if per_row:
            scalar_names.add(name)
            scalars[name] = value.to(narrowest(value)).clone()
        else:
            fields[name] = pack(value, lengths.get(name))
    mu = mu.to(torch.float32)
    alias = _twin(mu, payload, fields)
    return Chunk(slots.clone(), fields, scalars, None if alias else pack(mu), alias, int(mu.shape[1]))


def _twin(mu: Tensor, payload: Mapping[str, Tensor], fields: Mapping[str, Packed]) -> str:
    """The payload field whose values, as stored, equal ``mu`` (``""``: none)."""
    names = sorted((n for n, v in payload.items() if v.dim() == 2 and v.is_floating_point() and n in fields),
                   key=lambda n: n != MU_TWIN)
    for name in names:
        width = max(mu.shape[1], fields[name].width)
        stored = to_dense(fields[name], width, torch.float32)
        if torch.equal(_pad(mu, width), stored):
            return name
    return ""


def _pad(t: Tensor, width: int) -> Tensor:
    if t.shape[1] >= width:
        return t
    return torch.cat([t, t.new_zeros((t.shape[0], width - t.shape[1], *t.shape[2:]))], dim=1)


def mu_rows(chunk: Chunk, rows: Tensor, width: int) -> Tensor:
    """Float32 ``[len(rows), width]``: the behaviour log-probs of the chunk's ``rows``."""
    if chunk.mu is not None:
        return to_dense(take(chunk.mu, rows), width, torch.float32)
    twin = take(chunk.fields[chunk.mu_alias], rows)
    dense = to_dense(twin, max(twin.width, width, chunk.mu_width), torch.float32)[:, :chunk.mu_width]
    return _pad(dense, width)[:, :width]


def take_chunk(chunk: Chunk, rows: Tensor) -> Chunk:
    """The chunk's ``rows`` (long) alone."""
    return Chunk(chunk.slots[rows], {k: take(p, rows) for k, p in chunk.fields.items()},
                 {k: v[rows] for k, v in chunk.scalars.items()},
                 None if chunk.mu is None else take(chunk.mu, rows), chunk.mu_alias, chunk.mu_width)


def _absent(like: Packed, n: int) -> Packed:
    """``n`` rows without values of a field shaped like ``like`` (rows of a chunk that never had it)."""
    values = None if like.values is None else like.values.new_zeros((0, *like.rest))
    return Packed(values, torch.zeros(n, dtype=like.extent.dtype), 0, like.dtype, like.rest, like.derived, like.given)


def merge_chunks(chunks: Sequence[Chunk]) -> Chunk:
    """The rows of ``chunks`` one after another in one chunk."""
    names = sorted({k for c in chunks for k in c.fields})
    fields = {}
    for name in names:
        like = next(c.fields[name] for c in chunks if name in c.fields)
        fields[name] = cat([c.fields.get(name) or _absent(like, len(c)) for c in chunks])
    scalars = {}
    for name in sorted({k for c in chunks for k in c.scalars}):
        parts = [c.scalars.get(name) for c in chunks]
        dtype = next(p for p in parts if p is not None).dtype
        for p in parts:
            dtype = dtype if p is None else wider(dtype, p.dtype)
        scalars[name] = torch.cat([torch.zeros(len(c), dtype=dtype) if p is None else p.to(dtype)
                                   for c, p in zip(chunks, parts)])
    slots = torch.cat([c.slots for c in chunks])
    mu_width = max(c.mu_width for c in chunks)
    aliases = {c.mu_alias for c in chunks}
    if len(aliases) == 1 and chunks[0].mu_alias:
        return Chunk(slots, fields, scalars, None, chunks[0].mu_alias, mu_width)
    mus = [c.mu if c.mu is not None else pack(mu_rows(c, torch.arange(len(c)), c.mu_width)) for c in chunks]
    return Chunk(slots, fields, scalars, cat(mus), "", mu_width)


def read_rows(chunks: Mapping[int, Chunk], chunk_of: Tensor, row_of: Tensor, dtypes: Mapping[str, torch.dtype],
              scalar_names: set[str]) -> tuple[dict[str, Tensor], dict[str, Tensor], Tensor]:
    """``(payload, lengths, mu)`` of the rows ``row_of[i]`` of chunks ``chunk_of[i]``, in that order, dense
    (padded to the widest of them), in the dtypes the payload was given in."""
    n = int(chunk_of.numel())
    parts = [(chunks[i], torch.nonzero(chunk_of == i).flatten()) for i in torch.unique(chunk_of).tolist()]
    payload: dict[str, Tensor] = {}
    lengths: dict[str, Tensor] = {}
    for name, dtype in dtypes.items():
        if name in scalar_names:
            out = torch.zeros(n, dtype=dtype)
            for c, pos in parts:
                if name in c.scalars:
                    out[pos] = c.scalars[name][row_of[pos]].to(dtype)
            payload[name] = out
            continue
        have = [(c.fields[name], pos) for c, pos in parts if name in c.fields]
        width = max((p.width for p, _ in have), default=0)
        rest = have[0][0].rest if have else ()
        out = torch.zeros((n, width, *rest), dtype=dtype)
        length = torch.zeros(n, dtype=torch.long)
        for p, pos in have:
            rows = take(p, row_of[pos])
            out[pos] = to_dense(rows, width, dtype)
            length[pos] = rows.extent.to(torch.long)
        payload[name] = out
        if any(p.given for p, _ in have):
            lengths[name] = length
    width = max((c.mu_width for c, _ in parts), default=0)
    mu = torch.zeros((n, width), dtype=torch.float32)
    for c, pos in parts:
        mu[pos] = mu_rows(c, row_of[pos], width)
    return payload, lengths, mu


# ---------------------------------------------------------------------------- saved chunks
def packed_state(p: Packed) -> dict[str, Any]:
    return {"values": p.values, "extent": p.extent, "width": p.width, "dtype": str(p.dtype).removeprefix("torch."),
            "rest": list(p.rest), "derived": p.derived, "given": p.given}


def chunk_state(chunk: Chunk) -> dict[str, Any]:
    """A chunk as plain containers and tensors (its tensors are shared, not copied: they are never written in
    place; its slots are not saved, the store's saved slot map says them)."""
    return {"fields": {k: packed_state(p) for k, p in chunk.fields.items()}, "scalars": dict(chunk.scalars),
            "mu": None if chunk.mu is None else packed_state(chunk.mu), "mu_alias": chunk.mu_alias,
            "mu_width": chunk.mu_width}


def load_packed(state: Any, where: str) -> Packed:
    """A saved :class:`Packed`, checked: raises ``ValueError`` naming what is wrong (the store names the
    checkpoint)."""
    if not isinstance(state, Mapping):
        raise ValueError(f"{where} is a {type(state).__name__}, not a mapping")
    extent, values, width = state.get("extent"), state.get("values"), state.get("width")
    derived, rest = state.get("derived"), tuple(state.get("rest") or ())
    dtype = getattr(torch, str(state.get("dtype")), None)
    if not isinstance(extent, Tensor) or extent.dim() != 1 or extent.is_floating_point():
        raise ValueError(f"{where} 'extent' is not a 1-D integer tensor")
    if not isinstance(width, int) or not isinstance(dtype, torch.dtype) or derived not in ("", *DERIVED):
        raise ValueError(f"{where} has width {width!r}, dtype {state.get('dtype')!r}, derived {derived!r}")
    if extent.numel() and (int(extent.min()) < 0 or int(extent.max()) > width):
        raise ValueError(f"{where} 'extent' holds values outside [0, {width}]")
    total = int(extent.to(torch.long).sum())
    if derived:
        values = None
    elif not isinstance(values, Tensor) or tuple(values.shape) != (total, *rest):
        shape = tuple(values.shape) if isinstance(values, Tensor) else type(values).__name__
        raise ValueError(f"{where} 'values' has {shape} for {total} values of {rest} each")
    return Packed(values, extent, width, dtype, rest, str(derived), bool(state.get("given")))


def load_chunk(state: Any, where: str) -> Chunk:
    """A saved chunk (:func:`chunk_state`), checked, its slots unset (-1)."""
    if not isinstance(state, Mapping) or not isinstance(state.get("fields"), Mapping):
        raise ValueError(f"{where} is not a saved chunk")
    fields = {k: load_packed(v, f"{where} field {k!r}") for k, v in state["fields"].items()}
    mu = None if state.get("mu") is None else load_packed(state["mu"], f"{where} 'mu'")
    alias = str(state.get("mu_alias") or "")
    sizes = {len(p) for p in (*fields.values(), *(() if mu is None else (mu,)))}
    scalars = dict(state.get("scalars") or {})
    sizes |= {int(v.shape[0]) if isinstance(v, Tensor) else -1 for v in scalars.values()}
    if len(sizes) > 1 or -1 in sizes:
        raise ValueError(f"{where} holds fields of different numbers of rows {sorted(sizes)}")
    if (mu is None) == (alias == "") or (alias and alias not in fields):
        raise ValueError(f"{where} holds no behaviour log-probs ('mu' {mu is not None}, alias {alias!r})")
    twin = mu if mu is not None else fields[alias]
    if twin.values is not None and not bool(torch.isfinite(twin.values.to(torch.float32)).all()):
        raise NonFinite(f"holds non-finite behaviour log-probs in {where} (insert stores finite ones only)")
    n = sizes.pop() if sizes else 0
    return Chunk(torch.full((n,), -1, dtype=torch.long), fields, scalars, mu, alias, int(state.get("mu_width", 0)))


__all__ = ["Chunk", "NonFinite", "chunk_state", "load_chunk", "make_chunk", "merge_chunks", "mu_rows", "read_rows",
           "take_chunk"]
