"""The replay buffer's store: a bounded ring of past rows (rollouts) for one run, sized by the tokens it holds.

:class:`ReplayStore` keeps one slot per row, keyed by the prompt table's dense index. Per row it keeps the
prompt, the stored group, the insertion order, the step the row was generated at (the policy version), its
reward, priority and advantage, its domain (fixed columns, preallocated: :func:`preallocated_bytes`), and, per
insert, a :class:`Chunk`: its behaviour log-probs ``mu`` and the host's own fields of the rollout (its
*payload*: token ids, masks, ...) packed (:mod:`dataflex_bus.packed`: each row's values end to end, integer ids
in their narrowest type, masks and position ids derived from the extents, ``mu`` not kept again when it equals
a payload field such as ``rollout_log_probs``), plus, for a host that has them, per-row Python objects such as
verl's non-tensor columns. Memory follows the tokens held, not ``capacity`` x the widest row: evicted rows are
dropped from their chunk once they hold an eighth of its bytes (``benchmarks/bench_replay.py``). A
:class:`Record` is rows going in or read back (dense, padded to the widest of them). What a step replays, and
how, is :mod:`dataflex_bus.replay`'s.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor

from .errors import BatchFieldError, ConfigError, ConfigIssue
from .ops import segment_count
from .packed import rows_of
from .replay_chunks import Chunk, NonFinite, chunk_state, load_chunk, make_chunk, merge_chunks, read_rows, take_chunk


class StoreTable(Protocol):
    """What the store needs of the run's prompt table (:class:`dataflex_bus.history.PromptTable`): how many
    prompts it holds (the ids a row may carry) and its fingerprint, checked again at restore. The store knows
    no step and no host: it sits with the base types, below the contract that bounds its capacity."""

    def __len__(self) -> int: ...

    def fingerprint(self) -> Any: ...

    def check_saved(self, saved: Any, what: str) -> None: ...

#: The per-row columns of the store, with their dtypes.
_COLUMNS: dict[str, torch.dtype] = {"prompt": torch.long, "group": torch.long, "seq": torch.long,
                                    "version": torch.long, "reward": torch.float32, "priority": torch.float32,
                                    "advantage": torch.float32, "domain": torch.long, "length": torch.long}
#: Per slot, besides the columns: the chunk it is in and its row there (long each).
_SLOT_MAP_BYTES = 2 * 8
#: The entries of a saved store (:meth:`ReplayStore.state_dict`).
_SAVED = ("table", "capacity", "per_prompt", "slots", "columns", "dtypes", "objects", "next_seq", "next_group")
#: Saved by a store that kept dense columns (read back, packed, on restore).
_DENSE_SAVED = ("mu", "payload", "lengths")
#: Chunks at most before they are merged into one (a gather visits each chunk its rows are in).
MAX_CHUNKS = 64
#: A chunk is rewritten without its evicted rows once they hold this share of its bytes.
DEAD_SHARE = 1 / 8
#: A host's check of one stored per-row object: ``None`` when it is sound, else what is wrong with it.
ObjectCheck = Callable[[Any], str | None]


def preallocated_bytes(capacity: int) -> int:
    """Bytes a store of ``capacity`` rows allocates when it is made (its fixed columns and slot map; the
    packed rows grow with the tokens stored), computed without allocating anything."""
    per_row = sum(torch.empty((), dtype=dtype).element_size() for dtype in _COLUMNS.values())
    return int(capacity) * (per_row + _SLOT_MAP_BYTES)


def pad_to(t: Tensor, width: int) -> Tensor:
    """``t`` ``[n, w]`` right-padded with zeros to ``[n, width]`` (``w <= width``)."""
    if t.shape[1] == width:
        return t
    return torch.cat([t, t.new_zeros((t.shape[0], width - t.shape[1], *t.shape[2:]))], dim=1)


@dataclass
class Record:
    """Rows to store or stored rows read back, in row order: the kit's columns (see the module doc), ``mu``
    ``[n, T]``, the host's ``payload`` (dense ``[n, w]`` per field, ``[n]`` for one value per row;
    ``lengths[name]``: each row's length in it, values past it are padding, absent for a field whose rows are
    all full) and its per-row ``objects`` (``None``: the host has none). Read back, dense fields are padded
    with zeros to the widest of the rows read."""

    prompt: Tensor
    group: Tensor
    version: Tensor
    reward: Tensor
    priority: Tensor
    advantage: Tensor
    domain: Tensor
    length: Tensor
    mu: Tensor
    payload: dict[str, Tensor] = field(default_factory=dict)
    lengths: dict[str, Tensor] = field(default_factory=dict)
    objects: list[Any] | None = None
    seq: Tensor | None = None

    def __len__(self) -> int:
        return int(self.prompt.numel())


class ReplayStore:
    """The bounded store of past rows of one run (see the module doc). ``capacity``: rows at most (the oldest
    groups are evicted first); ``per_prompt``: rows per prompt at most (the oldest rows of a prompt first; 0:
    no bound). ``object_check``: set by a host that stores one object per row (what it reads back to train the
    row again), so a restored object it could not read is refused at restore, not at the first replay."""

    def __init__(self, table: StoreTable, capacity: int, *, per_prompt: int = 0,
                 object_check: ObjectCheck | None = None) -> None:
        if capacity < 1:
            raise ValueError(f"replay store capacity must be at least 1 row, got {capacity}")
        self.table = table
        self.capacity = int(capacity)
        self.per_prompt = int(per_prompt)
        self.columns = {name: torch.full((self.capacity,), -1, dtype=dtype) for name, dtype in _COLUMNS.items()}
        #: Each slot's chunk id and row in it (-1: empty).
        self.chunk_of = torch.full((self.capacity,), -1, dtype=torch.long)
        self.row_of = torch.full((self.capacity,), -1, dtype=torch.long)
        self.chunks: dict[int, Chunk] = {}
        self._next_chunk = 0
        #: The dtype each payload field is handed back in (it may be stored narrower).
        self.dtypes: dict[str, torch.dtype] = {}
        #: Payload fields given one value per row (``[n]``): handed back as ``[n]``.
        self.scalars: set[str] = set()
        self.objects: list[Any] | None = None
        self.next_seq = 0
        self.next_group = 0
        self.object_check = object_check

    # ------------------------------------------------------------------ reading
    @property
    def occupied(self) -> Tensor:
        """Bool ``[C]``: slots holding a row."""
        return self.columns["prompt"] >= 0

    def __len__(self) -> int:
        return int(self.occupied.sum())

    def __getitem__(self, name: str) -> Tensor:
        return self.columns[name]

    @property
    def num_groups(self) -> int:
        return int(torch.unique(self.columns["group"][self.occupied]).numel())

    def nbytes(self) -> int:
        """Bytes of every tensor the store holds: its columns and slot map, and its chunks' packed rows."""
        fixed = [*self.columns.values(), self.chunk_of, self.row_of]
        return sum(t.numel() * t.element_size() for t in fixed) + sum(c.nbytes() for c in self.chunks.values())

    def gather(self, slots: Tensor) -> Record:
        """The rows in ``slots`` (long), in that order, payload in the dtypes it was given in."""
        c = {name: col[slots] for name, col in self.columns.items()}
        payload, lengths, mu = read_rows(self.chunks, self.chunk_of[slots], self.row_of[slots], self.dtypes,
                                         self.scalars)
        objects = None if self.objects is None else [self.objects[i] for i in slots.tolist()]
        return Record(prompt=c["prompt"], group=c["group"], version=c["version"], reward=c["reward"],
                      priority=c["priority"], advantage=c["advantage"], domain=c["domain"], length=c["length"],
                      mu=mu, payload=payload, lengths=lengths, objects=objects, seq=c["seq"])

    def held(self) -> Record:
        """Every stored row, oldest first (what two stores compare by: their layouts in chunks may differ)."""
        occ = torch.nonzero(self.occupied).flatten()
        return self.gather(occ[torch.argsort(self.columns["seq"][occ])])

    # ------------------------------------------------------------------ writing
    def evict(self, slots: Tensor) -> int:
        """Free the slots selected by ``slots`` (bool ``[C]``); returns how many held a row."""
        slots = slots & self.occupied
        count = int(slots.sum())
        if count:
            for col in self.columns.values():
                col.masked_fill_(slots, -1)
            freed = torch.nonzero(slots).flatten()
            chunk_of = self.chunk_of[freed]
            for cid in torch.unique(chunk_of).tolist():
                self.chunks[cid].slots[self.row_of[freed[chunk_of == cid]]] = -1
            self.chunk_of[freed] = -1
            self.row_of[freed] = -1
            if self.objects is not None:
                for i in freed.tolist():
                    self.objects[i] = None
            self._tidy()
        return count

    def evict_stale(self, step: int, max_age_steps: int) -> int:
        """Evict rows generated more than ``max_age_steps`` steps before ``step`` (0: none)."""
        if max_age_steps <= 0:
            return 0
        return self.evict(self.occupied & (self.columns["version"] < step - max_age_steps))

    def dedup(self) -> int:
        """Keep only each prompt's newest stored group (DOTS: the newest copy of a prompt)."""
        occ = self.occupied
        if not bool(occ.any()):
            return 0
        prompt, group = self.columns["prompt"], self.columns["group"]
        newest = torch.full((len(self.table),), -1, dtype=torch.long)
        newest.scatter_reduce_(0, prompt[occ], group[occ], "amax")
        return self.evict(occ & (group != newest[prompt.clamp_min(0)]))

    def insert(self, record: Record) -> dict[str, int]:
        """Store ``record``'s rows (its ``group`` is a group id local to it; the store numbers groups itself),
        evicting the oldest groups when full and the oldest rows of a prompt beyond ``per_prompt``."""
        n = len(record)
        out = {"inserted": 0, "evicted_capacity": 0, "evicted_per_prompt": 0, "truncated": 0}
        if n == 0:
            return out
        order = torch.arange(n)
        if n > self.capacity:
            order = self._newest_groups(record.group, self.capacity)
            out["truncated"] = n - int(order.numel())
            n = int(order.numel())
        for name, value in record.payload.items():
            given = self.dtypes.get(name, value.dtype)
            if given != value.dtype:
                raise BatchFieldError("dataflex replay", name, f"stored as {given}, now given as {value.dtype}")
        # Packed before anything is evicted: a field refused leaves the store as it was.
        chunk = make_chunk(torch.zeros(n, dtype=torch.long), {k: rows_of(v, order) for k, v in record.payload.items()},
                           {k: v[order] for k, v in record.lengths.items()}, record.mu[order], self.dtypes,
                           self.scalars)
        for name, value in record.payload.items():
            self.dtypes.setdefault(name, value.dtype)
        free = int((~self.occupied).sum())
        if free < n:
            out["evicted_capacity"] = self._evict_oldest_groups(n - free)
        slots = torch.nonzero(~self.occupied).flatten()[:n]
        groups = torch.unique(record.group[order], return_inverse=True)[1] + self.next_group
        self.next_group = int(groups.max()) + 1
        for name in ("prompt", "version", "reward", "priority", "advantage", "domain", "length"):
            self.columns[name][slots] = getattr(record, name)[order].to(_COLUMNS[name])
        self.columns["group"][slots] = groups
        self.columns["seq"][slots] = torch.arange(self.next_seq, self.next_seq + n)
        self.next_seq += n
        chunk.slots = slots.clone()
        self._place(chunk)
        if record.objects is not None:
            if self.objects is None:
                self.objects = [None] * self.capacity
            for slot, i in zip(slots.tolist(), order.tolist()):
                self.objects[slot] = record.objects[i]
        out["inserted"] = n
        if self.per_prompt > 0:
            out["evicted_per_prompt"] = self._evict_per_prompt()
        self._tidy()
        return out

    def _place(self, chunk: Chunk) -> None:
        """Add ``chunk`` under a new id and point its live slots at it."""
        cid = self._next_chunk
        self._next_chunk += 1
        self.chunks[cid] = chunk
        live = torch.nonzero(chunk.slots >= 0).flatten()
        self.chunk_of[chunk.slots[live]] = cid
        self.row_of[chunk.slots[live]] = live

    def _tidy(self) -> None:
        """Drop chunks without live rows, rewrite those whose evicted rows hold :data:`DEAD_SHARE` of their
        bytes, and merge them all when there are more than :data:`MAX_CHUNKS`."""
        for cid, chunk in list(self.chunks.items()):
            live = chunk.slots >= 0
            if not bool(live.any()):
                del self.chunks[cid]
            elif not bool(live.all()):
                weight = chunk.row_bytes() + 1
                if int(weight[~live].sum()) > DEAD_SHARE * int(weight.sum()):
                    del self.chunks[cid]
                    self._place(take_chunk(chunk, torch.nonzero(live).flatten()))
        if len(self.chunks) > MAX_CHUNKS:
            parts = [take_chunk(c, torch.nonzero(c.slots >= 0).flatten()) for c in self.chunks.values()]
            self.chunks = {}
            self._place(merge_chunks(parts))

    @staticmethod
    def _newest_groups(group: Tensor, room: int) -> Tensor:
        """Rows (long, in order) of the newest whole groups of ``group`` that fit in ``room`` rows (a group
        larger than the room: its last ``room`` rows)."""
        uniq, inverse = torch.unique(group, return_inverse=True)
        last = torch.full((uniq.numel(),), -1, dtype=torch.long).scatter_reduce(
            0, inverse, torch.arange(group.numel()), "amax")
        newest_first = torch.argsort(last, descending=True)
        sizes = segment_count(inverse, uniq.numel())[newest_first]
        fits = newest_first[torch.cumsum(sizes, 0) <= room]
        if fits.numel() == 0:
            return torch.arange(group.numel() - room, group.numel())
        return torch.nonzero(torch.isin(inverse, fits)).flatten()

    def _evict_oldest_groups(self, rows: int) -> int:
        """Free at least ``rows`` slots by evicting the oldest stored groups, whole."""
        occ = torch.nonzero(self.occupied).flatten()
        oldest = occ[torch.argsort(self.columns["seq"][occ])][:rows]
        groups = torch.unique(self.columns["group"][oldest])
        return self.evict(self.occupied & torch.isin(self.columns["group"], groups))

    def _evict_per_prompt(self) -> int:
        occ = torch.nonzero(self.occupied).flatten()
        prompt, seq = self.columns["prompt"][occ], self.columns["seq"][occ]
        # Newest first within each prompt: sort by seq descending, then stably by prompt.
        by_seq = torch.argsort(seq, descending=True)
        order = by_seq[torch.sort(prompt[by_seq], stable=True).indices]
        p = prompt[order]
        counts = torch.unique_consecutive(p, return_counts=True)[1]
        starts = torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
        rank = torch.arange(p.numel()) - starts
        drop = torch.zeros(self.capacity, dtype=torch.bool)
        drop[occ[order[rank >= self.per_prompt]]] = True
        return self.evict(drop)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """The occupied slots and their rows (the packed chunks as they are: shared, not copied, as nothing
        writes them in place), the counters and the prompt table's fingerprint."""
        occ = torch.nonzero(self.occupied).flatten()
        ids = sorted(self.chunks)
        position = {cid: i for i, cid in enumerate(ids)}
        renumber = torch.tensor([position.get(i, -1) for i in range(self._next_chunk)] or [-1], dtype=torch.long)
        return {
            "table": self.table.fingerprint(), "capacity": self.capacity, "per_prompt": self.per_prompt,
            "slots": occ.clone(), "columns": {k: v[occ].clone() for k, v in self.columns.items()},
            "chunks": [chunk_state(self.chunks[i]) for i in ids],
            "chunk_of": renumber[self.chunk_of[occ]], "row_of": self.row_of[occ].clone(),
            "dtypes": {k: str(v).removeprefix("torch.") for k, v in self.dtypes.items()},
            "scalars": sorted(self.scalars),
            "objects": None if self.objects is None else [self.objects[i] for i in occ.tolist()],
            "next_seq": self.next_seq, "next_group": self.next_group,
        }

    def _check_restored(self, state: Mapping[str, Any], slots: Tensor) -> None:
        """Refuse a saved store whose rows no :meth:`insert` could have written (a checksum proves the file is
        the one written, not that what was written is sound): naming the column and what is wrong with it."""
        damaged = _damaged
        n = int(slots.numel())
        if n and (int(slots.min()) < 0 or int(slots.max()) >= self.capacity):
            raise damaged("slots", f"holds slots outside [0, {self.capacity})")
        if int(torch.unique(slots).numel()) != n:
            raise damaged("slots", "holds a slot twice")
        columns = state["columns"]
        if set(columns) != set(_COLUMNS):
            raise damaged("columns", f"are {sorted(columns)}, expected {sorted(_COLUMNS)}")
        for name, value in columns.items():
            if not isinstance(value, Tensor) or value.shape[:1] != (n,):
                shape = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
                raise damaged(f"column {name!r}", f"has {shape} for {n} slots")
        bounds = {"prompt": (0, len(self.table)), "group": (0, int(state["next_group"])),
                  "seq": (0, int(state["next_seq"])), "version": (0, None), "domain": (-1, None),
                  "length": (0, None)}
        for name, (low, high) in bounds.items():
            value = columns[name]
            if value.is_floating_point() or value.dtype == torch.bool:
                raise damaged(f"column {name!r}", f"is {value.dtype}, expected integer ids")
            if n and (int(value.min()) < low or (high is not None and int(value.max()) >= high)):
                where = f"[{low}, {high})" if high is not None else f">= {low}"
                raise damaged(f"column {name!r}", f"holds values outside {where}")
        self._check_objects(state["objects"], n)

    def _check_objects(self, objects: Any, n: int) -> None:
        """The per-row objects: one per slot, each one the host can read (its :attr:`object_check`)."""
        if objects is None:
            if n and self.object_check is not None:
                raise _damaged("objects", "is None, but this run's host stores one object per row")
            return
        if not isinstance(objects, list):
            raise _damaged("objects", f"is a {type(objects).__name__}, not a list")
        if len(objects) != n:
            raise _damaged("objects", f"has {len(objects)} entries for {n} slots")
        if self.object_check is not None:
            for i, obj in enumerate(objects):  # (Python objects, read once at restore)
                why = self.object_check(obj)
                if why is not None:
                    raise _damaged(f"objects[{i}]", why)

    def _restored_chunks(self, state: Mapping[str, Any], slots: Tensor) -> list[Chunk]:
        """The saved chunks with each slot placed in its row, checked (a store saved with dense columns is
        packed here into one chunk)."""
        n = int(slots.numel())
        if "chunks" not in state:
            missing = [k for k in _DENSE_SAVED if k not in state]
            if missing:
                raise _damaged("entries", f"{['chunks', *missing]} are missing (it holds {sorted(state)})")
            mu = state["mu"]
            if not isinstance(mu, Tensor) or mu.shape[:1] != (n,):
                raise _damaged("column 'mu'", f"has {getattr(mu, 'shape', type(mu).__name__)} for {n} slots")
            if not bool(torch.isfinite(mu.to(torch.float32)).all()):
                raise _damaged("column 'mu'", "holds non-finite behaviour log-probs (insert stores finite ones only)")
            scalars = set(state.get("scalars", ()))
            payload = {k: v[:, 0] if k in scalars else v for k, v in state["payload"].items()}
            chunk = make_chunk(slots, payload, {k: v.to(torch.long) for k, v in state["lengths"].items()}, mu,
                               (), set())
            return [chunk]
        saved, chunk_of, row_of = state["chunks"], state.get("chunk_of"), state.get("row_of")
        if not isinstance(saved, list):
            raise _damaged("chunks", f"is a {type(saved).__name__}, not a list")
        try:
            chunks = [load_chunk(c, f"chunk {i}") for i, c in enumerate(saved)]
        except NonFinite as exc:
            raise _damaged("column 'mu'", str(exc)) from None
        except ValueError as exc:
            raise _damaged("chunks", str(exc)) from None
        for name, value in (("chunk_of", chunk_of), ("row_of", row_of)):
            if not isinstance(value, Tensor) or value.shape != (n,) or value.is_floating_point():
                raise _damaged(name, f"is not {n} integer indices, one per slot")
        assert isinstance(chunk_of, Tensor) and isinstance(row_of, Tensor)
        sizes = torch.tensor([len(c) for c in chunks] or [0], dtype=torch.long)
        if n and (int(chunk_of.min()) < 0 or int(chunk_of.max()) >= len(chunks)):
            raise _damaged("chunk_of", f"holds chunks outside [0, {len(chunks)})")
        if n and (bool((row_of < 0).any()) or bool((row_of >= sizes[chunk_of]).any())):
            raise _damaged("row_of", "holds rows outside their chunk")
        if n and int(torch.unique(chunk_of * (int(sizes.max()) + 1) + row_of).numel()) != n:
            raise _damaged("row_of", "places two slots in one row")
        for i, chunk in enumerate(chunks):
            mine = chunk_of == i
            chunk.slots[row_of[mine]] = slots[mine]
        return chunks

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if not isinstance(state, Mapping):
            raise _damaged("the store", f"is a {type(state).__name__}, not a mapping")
        missing = [k for k in _SAVED if k not in state]
        if missing:  # (an emptied store is damaged, not one of another dataset: its table is missing too)
            raise _damaged("entries", f"{missing} are missing (it holds {sorted(state)})")
        self.table.check_saved(state.get("table"), "the replay buffer")
        slots = state["slots"].to(torch.long)
        if state["capacity"] != self.capacity or state["per_prompt"] != self.per_prompt:
            raise ConfigError(ConfigIssue("dataflex", f"the replay buffer in the checkpoint holds {state['capacity']} "
                                          f"rows ({state['per_prompt']} per prompt); this run's holds {self.capacity} "
                                          f"({self.per_prompt})"))
        self._check_restored(state, slots)
        chunks = self._restored_chunks(state, slots)
        self.__init__(self.table, self.capacity, per_prompt=self.per_prompt,  # type: ignore[misc]
                      object_check=self.object_check)
        for name, value in state["columns"].items():
            self.columns[name][slots] = value.to(_COLUMNS[name])
        for chunk in chunks:
            self._place(chunk)
        self.dtypes = {k: getattr(torch, v) for k, v in state["dtypes"].items()}
        self.scalars = set(state.get("scalars", ()))
        if state["objects"] is not None:
            self.objects = [None] * self.capacity
            for slot, obj in zip(slots.tolist(), state["objects"]):
                self.objects[slot] = obj
        self.next_seq, self.next_group = int(state["next_seq"]), int(state["next_group"])
        self._tidy()


def _damaged(column: str, what: str) -> ConfigError:
    return ConfigError(ConfigIssue("dataflex", f"the replay buffer in the checkpoint is damaged: {column} {what}; "
                                   "start the run afresh (without resume) or restore another checkpoint"))


def take_rows(record: Record, keep: Tensor) -> Record:
    """The rows ``keep`` (long) of ``record``."""
    return Record(prompt=record.prompt[keep], group=record.group[keep], version=record.version[keep],
                  reward=record.reward[keep], priority=record.priority[keep], advantage=record.advantage[keep],
                  domain=record.domain[keep], length=record.length[keep], mu=record.mu[keep],
                  payload={k: v[keep] for k, v in record.payload.items()},
                  lengths={k: v[keep] for k, v in record.lengths.items()},
                  objects=None if record.objects is None else [record.objects[i] for i in keep.tolist()],
                  seq=None if record.seq is None else record.seq[keep])


__all__ = ["Record", "ReplayStore", "preallocated_bytes"]
