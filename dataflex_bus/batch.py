"""The framework-neutral batch every component reads.

A :class:`Batch` is a set of named tensors using verl's field names (``rm_scores``, ``response_mask``,
``old_log_probs``, ``advantages``, ``rollout_is_weights``, ...) plus three row labels: the group id
(``uid``), the domain (verl's ``data_source`` column by default) and a padding flag. Padding rows
(verl pads batches to a divisible size) belong to no group and no domain, and no component counts them.

A per-token field may be given jagged (a nested tensor of ``torch.jagged`` layout, as verl's TransferQueue holds
it): the batch keeps it so, reads rewards and lengths from its values (:mod:`.jagged`), and pads it to a dense
``[B, T]`` view (once, cached) only when a component reads it per token, ``batch[name]``.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping, Sequence
from functools import cached_property
from typing import Any

import torch
from torch import Tensor

from . import jagged
from .errors import BatchFieldError
from .fingerprint import fingerprint

#: Field names that are row labels rather than tensors; ``Batch.has`` answers for them too.
LABEL_FIELDS = ("uid", "data_source")
#: Rows reduced at a time where a ``[B]`` quantity is read from ``[B, T]`` fields (rewards, lengths): the
#: temporaries are a slice of the batch, not one more ``[B, T]`` tensor (a method reading only ``[B]``
#: quantities adds no dense copy on a long-response driver).
ROW_CHUNK = jagged.ROW_CHUNK


def row_reduce(fn: Any, rows: int) -> Tensor:
    """``fn(rows_slice)`` (a ``[k]`` result for ``k`` rows) over ``rows`` rows, :data:`ROW_CHUNK` at a time."""
    if rows <= ROW_CHUNK:
        return fn(slice(0, rows))
    return torch.cat([fn(slice(i, i + ROW_CHUNK)) for i in range(0, rows, ROW_CHUNK)])

#: How a host turns ``rm_scores`` into a row's outcome reward (:attr:`Batch.rewards`), so the bus reads the number
#: the host trains on. ``masked``: ``sum_t rm_scores * response_mask`` (the shim and TRL, whose score sits on the
#: last response token, which is always in the mask). ``row``: ``sum_t rm_scores`` over the whole row, mask or no
#: mask, as verl's GRPO sums ``token_level_rewards`` (``core_algos.py``); verl's agent loop writes the score on the
#: last response token whatever its mask, and a tool-agent trajectory cut after a tool response ends on mask-0
#: tokens.
REWARD_SPANS = {"masked": "sum of rm_scores * response_mask", "row": "sum of rm_scores over the row, mask or no mask"}


def _index_labels(labels: Sequence[Any], field: str) -> tuple[Tensor, list[Any]]:
    """Map labels to dense ids in order of first appearance (one C-level dict pass, no per-group work).

    Labels are compared as they are, never through ``str()``: the int ``1`` and the string ``"1"`` are
    two groups (equal values such as ``np.str_("a")`` and ``"a"`` are one).
    """
    names: dict[Any, int] = {}
    try:
        ids = [names.setdefault(label, len(names)) for label in labels]
    except TypeError as exc:  # an unhashable label (a list, a dict)
        raise BatchFieldError("Batch", field, f"labels must be hashable values (strings or integers): {exc}") from None
    return torch.tensor(ids, dtype=torch.long), list(names)


def _check_label_rows(field: str, labels: Any, rows: int | None) -> None:
    """One label per row, given as a sequence or a 1-D tensor (a string is one label, not a sequence)."""
    if isinstance(labels, (str, bytes)):
        raise BatchFieldError("Batch", field, f"expected one label per row (a list or a 1-D integer tensor), "
                              f"got the single string {labels!r}")
    if isinstance(labels, Tensor) and labels.dim() != 1:
        raise BatchFieldError("Batch", field, f"expected a 1-D tensor of labels, got shape {tuple(labels.shape)}")
    n = len(labels)
    if rows is not None and n != rows:
        raise BatchFieldError("Batch", field, f"{n} label(s) for {rows} rows: give exactly one label per row "
                              "(padding rows included)")


def _check_domain_names(names: Sequence[str]) -> None:
    if len(set(names)) != len(names):
        dup = sorted({str(n) for n in names if list(names).count(n) > 1})
        raise BatchFieldError("Batch", "domain_names", f"duplicate names {dup} in {list(names)}: "
                              "each domain must be listed once")


def _check_mask(mask: Tensor, valid: Tensor | None) -> None:
    """``response_mask`` holds 0 or 1 on real rows: it counts tokens and multiplies rewards, so any other
    value would silently scale a reward. One min/max reduction decides the common case (an integer 0/1
    mask); padding rows may carry anything."""
    if mask.dtype == torch.bool or mask.is_complex():
        return
    held_jagged = jagged.is_jagged(mask)
    flat = mask.values() if held_jagged else mask  # a jagged mask's tokens: the check never pads it
    if flat.numel() == 0:
        return
    lo, hi = torch.aminmax(flat)
    if not flat.is_floating_point() and int(lo) >= 0 and int(hi) <= 1:
        return
    bad = (flat != 0) & (flat != 1)
    if held_jagged:
        rows = jagged.row_any(mask, bad)
    else:
        rows = bad.reshape(mask.shape[0], -1).any(-1) if mask.dim() > 0 else bad.reshape(1)
    if valid is not None and rows.shape == valid.shape:
        rows = rows & valid
    if bool(rows.any()):
        first = torch.nonzero(rows).flatten()[:5].tolist()
        if held_jagged:
            values = torch.unique(flat[bad & rows.repeat_interleave(jagged.row_lengths(mask))])[:5].tolist()
        else:
            values = torch.unique(mask[rows][bad[rows]])[:5].tolist() if mask.dim() > 0 else [mask.item()]
        raise BatchFieldError("Batch", "response_mask", f"holds {values} on rows {first}: a mask must be 0 or 1 "
                              "on every real row (other values would scale rewards and lengths)")


def _check_uid_none(labels: list[Any], group_ids: Tensor, valid: Tensor | None) -> None:
    """A ``None`` group label would put every row lacking one into one spurious group."""
    if None not in labels:
        return
    rows = group_ids == labels.index(None)
    if valid is not None and rows.shape == valid.shape:
        rows = rows & valid
    if bool(rows.any()):
        first = torch.nonzero(rows).flatten()[:5].tolist()
        raise BatchFieldError("Batch", "uid", f"None on {int(rows.sum())} real row(s) (rows {first}): every real "
                              "row needs its prompt's group label (None would join unrelated rows into one group)")


def _integer_ids(field: str, ids: Tensor) -> Tensor:
    """An integer label tensor as int64; a float or bool tensor would silently truncate or merge groups."""
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise BatchFieldError("Batch", field, f"label tensors must have an integer dtype, got {ids.dtype} "
                              "(float ids are truncated into wrong groups: convert them or pass a list)")
    return ids.to(torch.long)


class Batch:
    """Named tensors of one training batch with group, domain and padding labels.

    Build it with :meth:`from_tensors`; ``uid`` and ``domains`` may be sequences of strings (any
    hashable labels) or integer tensors. All derived quantities (rewards, lengths, group sizes) are
    computed once, on whole tensors, and cached.
    """

    def __init__(
        self,
        fields: Mapping[str, Tensor],
        *,
        group_ids: Tensor | None,
        domain_ids: Tensor | None,
        domain_names: Sequence[str] = (),
        is_padding: Tensor | None = None,
        uid: Sequence[Any] | None = None,
        reward_span: str = "masked",
    ) -> None:
        if reward_span not in REWARD_SPANS:
            raise BatchFieldError("Batch", "reward_span", f"{reward_span!r} is not one of {sorted(REWARD_SPANS)}")
        #: How :attr:`rewards` reads ``rm_scores`` (:data:`REWARD_SPANS`): the host's own reward.
        self.reward_span = reward_span
        self.fields: dict[str, Tensor] = dict(fields)
        size = self._infer_size()
        self.is_padding = (
            torch.zeros(size, dtype=torch.bool) if is_padding is None else is_padding.to(torch.bool)
        )
        if self.is_padding.shape != (size,):
            raise BatchFieldError("Batch", "is_padding",
                                  f"expected shape ({size},), got {tuple(self.is_padding.shape)}")
        for label, ids in (("uid", group_ids), ("data_source", domain_ids)):
            if ids is not None and tuple(ids.shape) != (size,):
                raise BatchFieldError("Batch", label, f"expected one label per row, shape ({size},), "
                                      f"got {tuple(ids.shape)}")
        _check_domain_names(domain_names)
        self._raw_group_ids = group_ids
        self.domain_ids = domain_ids
        self.domain_names = list(domain_names)
        self.uid = list(uid) if uid is not None else None
        #: The ``response_mask`` that :meth:`from_tensors` checked (0/1 on real rows), so :attr:`lengths`
        #: need not check it again; a weak reference, which the write check does not count as a tensor.
        self._checked_mask: weakref.ref[Tensor] | None = None
        #: Dense views of jagged fields made so far: name -> (the jagged field, its view, the view's fingerprint
        #: when made). A dict, which the write check does not take for a field (a view made during a hook is no
        #: write); views written since are found by :meth:`written_views`.
        self._dense: dict[str, tuple[Tensor, Tensor, int]] = {}

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_tensors(
        cls,
        *,
        uid: Sequence[Any] | Tensor | None = None,
        domains: Sequence[Any] | Tensor | None = None,
        domain_names: Sequence[str] | None = None,
        is_padding: Tensor | Sequence[bool] | None = None,
        **fields: Tensor,
    ) -> Batch:
        """Build a batch from plain tensors.

        ``uid``: per-row group label (strings, or an integer tensor for speed). ``domains``: per-row
        domain label (strings, or integer ids into ``domain_names``). ``is_padding``: per-row flag.
        Rewards read ``masked`` (:data:`REWARD_SPANS`); a host reading them otherwise says so with
        :meth:`with_reward_span`.
        """
        rows = cls._row_count(fields)
        if domain_names is not None:
            _check_domain_names(domain_names)
        pad = None if is_padding is None else torch.as_tensor(is_padding, dtype=torch.bool)
        valid = None if pad is None else ~pad
        mask = fields.get("response_mask")
        if isinstance(mask, Tensor):
            _check_mask(mask, valid)
        uid_list: list[Any] | None = None
        group_ids: Tensor | None
        if uid is None:
            group_ids = None
        else:
            _check_label_rows("uid", uid, rows)
            if isinstance(uid, Tensor):
                group_ids = _integer_ids("uid", uid)
            else:
                uid_list = list(uid)
                group_ids, labels = _index_labels(uid_list, "uid")
                _check_uid_none(labels, group_ids, valid)
        if domains is None:
            domain_ids, names = None, list(domain_names or [])
        else:
            _check_label_rows("data_source", domains, rows)
            if isinstance(domains, Tensor):
                domain_ids = _integer_ids("data_source", domains)
                if domain_names is None:
                    raise BatchFieldError("Batch", "data_source", "integer domain ids need domain_names")
                names = list(domain_names)
            else:
                domain_ids, found = _index_labels(domains, "data_source")
                names = list(domain_names or [])
                # Domain names are strings (metric keys, config entries): labels that differ but print the
                # same (1 and "1") would merge into one domain.
                found_names = [str(n) for n in found]
                if len(set(found_names)) != len(found_names):
                    clash = sorted({n for n in found_names if found_names.count(n) > 1})
                    raise BatchFieldError("Batch", "data_source",
                                          f"distinct labels print as the same domain name {clash} "
                                          f"(labels: {found!r}); use one type for domain labels")
                if names:
                    known = {n: i for i, n in enumerate(names)}
                    extra = [n for n in found_names if n not in known]
                    if extra:
                        raise BatchFieldError("Batch", "data_source", f"labels {extra} not in domain_names {names}")
                    remap = torch.tensor([known[n] for n in found_names], dtype=torch.long)
                    domain_ids = remap[domain_ids]
                else:
                    names = found_names
        batch = cls(fields, group_ids=group_ids, domain_ids=domain_ids, domain_names=names,
                    is_padding=pad, uid=uid_list)
        if isinstance(mask, Tensor):
            batch._checked_mask = weakref.ref(mask)
        if isinstance(domains, Tensor) and domain_ids is not None and domain_ids.numel():
            # Real rows must name a listed domain (padding rows may carry anything): one reduction.
            lo, hi = torch.aminmax(torch.where(batch.valid_rows, domain_ids, 0))
            if int(lo) < 0 or int(hi) >= len(names):
                raise BatchFieldError("Batch", "data_source", f"domain ids must lie in [0, {len(names)}) for "
                                      f"domain_names {names}, got ids from {int(lo)} to {int(hi)}")
        return batch

    @staticmethod
    def _row_count(fields: Mapping[str, Tensor]) -> int | None:
        sizes = [t.shape[0] for t in fields.values() if isinstance(t, Tensor) and t.dim() > 0]
        return sizes[0] if sizes else None

    def _infer_size(self) -> int:
        sizes = {name: t.shape[0] for name, t in self.fields.items() if t.dim() > 0}
        if not sizes:
            raise BatchFieldError("Batch", "<fields>", "a batch needs at least one per-row tensor")
        first = next(iter(sizes.values()))
        bad = {k: v for k, v in sizes.items() if v != first}
        if bad:
            raise BatchFieldError("Batch", next(iter(bad)), f"row counts disagree: {sizes}")
        return first

    # ------------------------------------------------------------------ access
    def __len__(self) -> int:
        return int(self.is_padding.shape[0])

    def __getitem__(self, name: str) -> Tensor:
        """Field ``name`` as a tensor with one row per batch row: a jagged field as its dense ``[B, T]`` view
        (right-padded with zeros, made once and cached)."""
        value = self.held(name)
        return self._dense_view(name, value) if jagged.is_jagged(value) else value

    def held(self, name: str) -> Tensor:
        """Field ``name`` as the batch holds it (jagged where it was given jagged): for a whole-tensor reader of
        the token values that needs no padding (a sum, a count, a finiteness check)."""
        try:
            return self.fields[name]
        except KeyError:
            raise BatchFieldError("Batch", name, f"not in batch (present: {sorted(self.fields)})") from None

    def jagged_field(self, name: str) -> Tensor | None:
        """Field ``name`` when the batch holds it jagged (``None`` when dense or absent)."""
        value = self.fields.get(name)
        return value if value is not None and jagged.is_jagged(value) else None

    def width_of(self, name: str) -> int | None:
        """The token width of field ``name``'s ``[B, T]`` (dense view's) shape without making the view; ``None``
        when the field is absent or not per token."""
        value = self.fields.get(name)
        if value is None:
            return None
        if jagged.is_jagged(value):
            return jagged.longest(value)
        return int(value.shape[1]) if value.dim() >= 2 else None

    def _dense_view(self, name: str, value: Tensor) -> Tensor:
        made = self._dense.get(name)
        if made is not None and made[0] is value:
            return made[1]
        view = jagged.dense(value)
        self._dense[name] = (value, view, fingerprint(view))
        return view

    def dense_views(self) -> list[str]:
        """Names of the jagged fields whose dense view has been made (what components read per token)."""
        return [name for name, (value, _, _) in self._dense.items() if self.fields.get(name) is value]

    def written_views(self, names: Sequence[str] = ()) -> list[tuple[str, str]]:
        """Dense views written since they were made, as ``(name, how)``: ``in place`` (a view is fresh, version
        0), or for ``names`` also ``bypassed`` (its bytes changed behind the version counter: ``.data``, a NumPy
        view). The bus's write check reports them as writes to the field."""
        out = []
        for name, (value, view, made) in self._dense.items():
            if self.fields.get(name) is not value:
                continue
            if view._version:
                out.append((name, "in place"))
            elif name in names and fingerprint(view) != made:
                out.append((name, "bypassed"))
        return out

    def __contains__(self, name: str) -> bool:
        return self.has(name)

    def has(self, name: str) -> bool:
        """True if the tensor field, or the ``uid``/``data_source`` label, is present."""
        if name == "uid":
            return self._raw_group_ids is not None
        if name == "data_source":
            return self.domain_ids is not None
        return name in self.fields

    def get(self, name: str, default: Tensor | None = None) -> Tensor | None:
        """``batch[name]`` (a jagged field's dense view), or ``default`` when absent."""
        return self[name] if name in self.fields else default

    def require(self, component: str, names: Sequence[str]) -> None:
        """Raise a :class:`BatchFieldError` naming ``component`` if any of ``names`` is missing."""
        for name in names:
            if not self.has(name):
                raise BatchFieldError(component, name, f"required but missing (present: {sorted(self.fields)})")

    def nonfinite_rows(self, values: Tensor) -> Tensor | None:
        """Bool ``[B]``: real rows of a row-leading tensor holding NaN/inf on a real element (tokens only,
        for a ``[B, T]`` tensor shaped like the response mask); ``None`` when there is none.

        One min/max reduction decides the common all-finite case without a ``[B, T]`` copy.
        """
        if jagged.is_jagged(values):
            return self._nonfinite_jagged_rows(values)
        if not values.is_floating_point() or values.numel() == 0:
            return None
        if bool(torch.isfinite(torch.stack(torch.aminmax(values))).all()):
            return None
        bad = ~torch.isfinite(values)
        if values.dim() == 2 and "response_mask" in self.fields and values.shape == self.token_mask.shape:
            bad = bad & self.token_mask
        rows = bad.reshape(values.shape[0], -1).any(-1)
        if values.shape[0] == len(self):
            rows = rows & self.valid_rows
        return rows if bool(rows.any()) else None

    def _nonfinite_jagged_rows(self, values: Tensor) -> Tensor | None:
        """:meth:`nonfinite_rows` of a jagged field, from its flat values (tokens only where the response mask
        is jagged over the same rows)."""
        flat = values.values()
        if not flat.is_floating_point() or flat.numel() == 0:
            return None
        if bool(torch.isfinite(torch.stack(torch.aminmax(flat))).all()):
            return None
        bad = ~torch.isfinite(flat)
        mask = self.jagged_field("response_mask")
        if mask is not None and jagged.same_rows(mask, values):
            bad = bad & mask.values().ne(0).reshape(-1, *([1] * (bad.dim() - 1)))
        rows = jagged.row_any(values, bad.reshape(bad.shape[0], -1).any(-1)) & self.valid_rows
        return rows if bool(rows.any()) else None

    def check_finite(self, component: str, name: str, values: Tensor | None = None) -> None:
        """Raise if a field (restricted to real rows and tokens) holds NaN or inf."""
        bad = self.nonfinite_rows(self.held(name) if values is None else values)
        if bad is not None:
            rows = torch.nonzero(bad).flatten()[:5].tolist()
            raise BatchFieldError(component, name, f"non-finite values (NaN/inf) in rows {rows}")

    # ------------------------------------------------------------------ derived, cached
    @cached_property
    def valid_rows(self) -> Tensor:
        """Bool ``[B]``: rows that are not padding."""
        return ~self.is_padding

    @cached_property
    def token_mask(self) -> Tensor:
        """Bool ``[B, T]``: real response tokens of real rows."""
        mask = self["response_mask"].to(torch.bool)  # no copy when the mask is already bool
        # Skip the [B, T] AND when there is no padding row (the common case): one allocation fewer.
        return mask & self.valid_rows[:, None] if bool(self.is_padding.any()) else mask

    @cached_property
    def lengths(self) -> Tensor:
        """Long ``[B]``: number of real response tokens (0 on padding rows)."""
        mask = self.held("response_mask")
        if jagged.is_jagged(mask):
            return torch.where(self.valid_rows, jagged.row_counts(mask), 0)
        if mask.dim() == 2 and mask.dtype != torch.bool and not mask.is_floating_point() and mask.numel():
            # verl's masks are 0/1 int64: their row sum is the count, and summing int64 is several times
            # faster than reducing a bool [B, T] tensor (no conversion, no token_mask allocation).
            checked = self._checked_mask is not None and self._checked_mask() is mask
            lo, hi = (0, 1) if checked else torch.aminmax(mask)
            if int(lo) >= 0 and int(hi) <= 1:
                return torch.where(self.valid_rows, mask.sum(-1), 0)
        token_mask = self.token_mask.view(torch.uint8)
        return row_reduce(lambda r: token_mask[r].sum(-1, dtype=torch.int32), len(token_mask)).to(torch.long)

    @cached_property
    def rewards(self) -> Tensor:
        """Float ``[B]``: the host's outcome reward (0 on padding rows): ``sum_t rm_scores * response_mask``, or
        under ``reward_span="row"`` (verl) ``sum_t rm_scores`` over the whole row, as verl's GRPO reads it."""
        scores = self.held("rm_scores")
        mask = self.fields.get("response_mask")
        if jagged.is_jagged(scores) and (self.reward_span == "row" or (
                mask is not None and jagged.is_jagged(mask) and jagged.same_rows(mask, scores))):
            r = self._jagged_rewards(scores)
        elif jagged.is_jagged(scores):  # rows that do not line up with the mask's token by token
            r = self.derive(fields={"rm_scores": self["rm_scores"], "response_mask": self["response_mask"]}).rewards
        elif scores.dim() == 1:
            r = scores.to(torch.float32)
        elif self.reward_span == "row":
            r = scores.sum(-1, dtype=torch.float32)  # no converted [B, T] copy
        else:
            # Multiply by the mask as it is (int/bool promote to float32), a slice of rows at a time.
            mask = self["response_mask"]
            r = row_reduce(lambda rows: (scores[rows].to(torch.float32) * mask[rows]).sum(-1), len(scores))
            r = r.to(torch.float32)
            if not bool(torch.isfinite(r).all()):
                # NaN x 0 is NaN: a NaN/inf after a response's end must not decide (a [B] check first).
                token_mask = self.token_mask
                r = row_reduce(lambda rows: torch.where(token_mask[rows], scores[rows].to(torch.float32), 0.0)
                               .sum(-1), len(scores))
        return torch.where(self.valid_rows, r, torch.zeros_like(r))

    def _jagged_rewards(self, scores: Tensor) -> Tensor:
        """:attr:`rewards` (before padding rows are zeroed) from jagged ``rm_scores``, a slice of rows padded at a
        time: the same row sums as over the dense view, without a ``[B, T]`` temporary."""
        width = jagged.longest(scores)
        if self.reward_span == "row":
            return jagged.row_reduce(lambda s: s.sum(-1, dtype=torch.float32), scores, width=width)
        mask = self.held("response_mask")
        r = jagged.row_reduce(lambda s, m: (s.to(torch.float32) * m).sum(-1), scores, mask, width=width)
        if not bool(torch.isfinite(r).all()):
            # NaN x 0 is NaN: a NaN/inf on a mask-0 token must not decide.
            r = jagged.row_reduce(lambda s, m: torch.where(m.to(torch.bool), s.to(torch.float32), 0.0).sum(-1),
                                  scores, mask, width=width)
        return r.to(torch.float32)

    @cached_property
    def _groups(self) -> tuple[Tensor, int]:
        raw = self._raw_group_ids
        if raw is None:
            # Without uid every real row is its own group (the non-group estimators' view).
            raw = torch.arange(len(self))
        valid = self.valid_rows
        uniq, inverse = torch.unique(torch.where(valid, raw, raw.new_full((), -1)), return_inverse=True)
        # torch.unique sorts; a padding sentinel (-1) would take id 0 when present: shift it out.
        has_pad = bool((~valid).any()) and bool((uniq == -1).any())
        inverse = inverse - 1 if has_pad else inverse
        num = int(uniq.numel()) - (1 if has_pad else 0)
        group_index = torch.where(valid, inverse, torch.full_like(inverse, -1))
        return group_index, num

    @property
    def group_index(self) -> Tensor:
        """Long ``[B]``: dense group id per row, ``-1`` on padding rows."""
        return self._groups[0]

    @property
    def num_groups(self) -> int:
        return self._groups[1]

    @cached_property
    def group_sizes(self) -> Tensor:
        """Long ``[num_groups]``: real rows per group (mixed sizes and singletons are allowed)."""
        from .ops import segment_count

        return segment_count(self.group_index, self.num_groups)

    @cached_property
    def domain_index(self) -> Tensor:
        """Long ``[B]``: domain id per row, ``-1`` on padding rows (and everywhere if no domain labels)."""
        if self.domain_ids is None:
            return torch.full((len(self),), -1, dtype=torch.long)
        return torch.where(self.valid_rows, self.domain_ids, torch.full_like(self.domain_ids, -1))

    def per_domain(self, values: Tensor) -> tuple[Tensor, Tensor]:
        """``(rows, mean of values)`` per entry of ``domain_names`` over real rows (float64 means, NaN
        for a domain without rows); what both hosts report as per-domain reward."""
        from .ops import segment_count, segment_sum

        d = len(self.domain_names)
        rows = segment_count(self.domain_index, d)
        total = segment_sum(values.double(), self.domain_index, d)
        return rows, total / rows.double()

    # ------------------------------------------------------------------ transforms
    def select(self, rows: Tensor) -> Batch:
        """A new batch holding only ``rows`` (bool mask or index tensor), labels carried along."""
        if rows.dtype == torch.bool:
            rows = torch.nonzero(rows).flatten()
        fields = {k: jagged.rows(v, rows) if jagged.is_jagged(v) else v[rows] if v.dim() > 0 and v.shape[0] == len(self)
                  else v for k, v in self.fields.items()}
        uid = [self.uid[i] for i in rows.tolist()] if self.uid is not None else None
        return Batch(
            fields,
            group_ids=None if self._raw_group_ids is None else self._raw_group_ids[rows],
            domain_ids=None if self.domain_ids is None else self.domain_ids[rows],
            domain_names=self.domain_names,
            is_padding=self.is_padding[rows],
            uid=uid,
            reward_span=self.reward_span,
        )

    def derive(self, *, fields: Mapping[str, Tensor] | None = None, is_padding: Tensor | None = None,
               domain_ids: Tensor | None = None, domain_names: Sequence[str] | None = None,
               reward_span: str | None = None) -> Batch:
        """A new batch sharing this one's labels, with the given parts replaced."""
        out = Batch(
            self.fields if fields is None else fields,
            group_ids=self._raw_group_ids,
            domain_ids=self.domain_ids if domain_ids is None else domain_ids,
            domain_names=self.domain_names if domain_names is None else domain_names,
            is_padding=self.is_padding if is_padding is None else is_padding,
            uid=self.uid,
            reward_span=self.reward_span if reward_span is None else reward_span,
        )
        if fields is None and is_padding is None:  # the same mask on the same real rows: checked already
            out._checked_mask = self._checked_mask
        # Dense views of the jagged fields it still holds: padded once for both batches.
        out._dense = {name: made for name, made in self._dense.items() if out.fields.get(name) is made[0]}
        return out

    def with_reward_span(self, span: str) -> Batch:
        """The same batch with its outcome reward read as ``span`` (:data:`REWARD_SPANS`): the host's reward."""
        return self if span == self.reward_span else self.derive(reward_span=span)

    def with_fields(self, **fields: Tensor) -> Batch:
        """A new batch with some fields added or replaced (labels shared)."""
        return self.derive(fields={**self.fields, **fields})

    def with_domain_names(self, names: Sequence[str]) -> Batch:
        """The same batch with domain ids re-expressed in the order of ``names`` (a mixer's domains)."""
        names = list(names)
        if names == self.domain_names:
            return self
        if self.domain_ids is None:
            raise BatchFieldError("Batch", "data_source", "the batch has no domain labels")
        position = {n: i for i, n in enumerate(names)}
        remap = torch.tensor([position.get(n, -1) for n in self.domain_names] + [-1], dtype=torch.long)
        ids = remap[torch.where(self.domain_ids >= 0, self.domain_ids, torch.full_like(self.domain_ids, -1))]
        unknown = (ids < 0) & self.valid_rows
        if bool(unknown.any()):
            labels = sorted({self.domain_names[i] for i in self.domain_ids[unknown].tolist()})
            raise BatchFieldError("Batch", "data_source", f"domains {labels} are not among {names}")
        return self.derive(domain_ids=ids, domain_names=names)

    def __repr__(self) -> str:
        shapes = ", ".join(f"{k}={tuple(v.shape)}" for k, v in self.fields.items())
        return f"Batch(rows={len(self)}, padding={int(self.is_padding.sum())}, {shapes})"


def first_group(batch: Batch) -> Tensor:
    """Bool ``[B]``: the rows of the first real group (what an empty or skipped step carries on with)."""
    valid = torch.nonzero(batch.valid_rows).flatten()
    if valid.numel() == 0:
        return torch.ones(len(batch), dtype=torch.bool)
    return batch.group_index == batch.group_index[valid[0]]
