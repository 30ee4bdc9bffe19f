"""Rows of TRL's generation batch: how the TRL host lays them out over processes and moves them.

TRL shards a generation batch of ``B`` rows into equal, contiguous per-process slices (rank ``r`` holds
global rows ``[r*B/P, (r+1)*B/P)``) and splits each slice into ``steps_per_generation`` equal chunks, silently
dropping remainder rows. When a method removes rows, the kept ``K`` rows must be laid out the same way
(:class:`Layout`): if ``K`` splits into ``P x steps_per_generation`` equal parts that is exactly TRL's layout
for a batch of ``K`` rows; otherwise each process is padded with rows that train nothing (``REAL`` marks the
real ones), because TRL has no layout for that batch.

The dicts here are TRL's returned generation batch (``_generate_and_score_completions``): per-row tensors
(:data:`ROW_FIELDS`, padded on the side TRL pads them) and the 0-d ``num_items_in_batch``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

#: The marker of real rows (bool ``[B]``), present only when padding rows are.
REAL = "dataflex_real"
#: Per-token loss weights (float ``[B, T]``), multiplied into the advantages by the host's loss.
WEIGHTS = "dataflex_weights"
#: Per-token behaviour log-probs (float ``[B, T]``) on a step that replays stored rows: the log-probs the
#: rows were sampled with (what their off-policy correction is against), carried for inspection, never in the
#: loss.
BEHAVIOUR = "dataflex_behaviour_logps"
#: Per-row fields of TRL 1.16's generation batch and how to pad them: (side, value); ``None`` = pad token.
ROW_FIELDS: dict[str, tuple[str, float | int | None]] = {
    "prompt_ids": ("left", None),
    "prompt_mask": ("left", 0),
    "completion_ids": ("right", None),
    "completion_mask": ("right", 0),
    "advantages": ("right", 0.0),  # (B,) or (B, T)
    "old_per_token_logps": ("right", 0.0),
    "ref_per_token_logps": ("right", 0.0),
    "sampling_per_token_logps": ("right", 0.0),
    "importance_sampling_ratio": ("right", 1.0),  # (B, T), or (B, 1) in sequence modes
    "tool_mask": ("right", 1),
    REAL: ("right", False),
    WEIGHTS: ("right", 1.0),
    BEHAVIOUR: ("right", 0.0),
}
#: Multimodal fields of TRL's generation batch: the host refuses them (their rows are not plain tensors).
MULTIMODAL = ("pixel_values", "image_grid_thw", "pixel_attention_mask", "spatial_shapes", "image_sizes",
              "token_type_ids", "mm_token_type_ids", "image_position_ids", "num_images", "num_tiles")


@dataclass(frozen=True)
class Layout:
    """``total`` real rows over ``processes`` processes, each holding ``per_rank`` rows (a multiple of
    ``multiple``, at least one): rank ``r`` the real rows ``[r*per_rank, (r+1)*per_rank)`` that exist, then
    padding. Equal to TRL's sharding when ``total`` splits into ``processes x multiple`` equal parts."""

    total: int
    processes: int
    multiple: int

    @property
    def per_rank(self) -> int:
        rows = max(-(-self.total // self.processes), 1)
        return -(-rows // self.multiple) * self.multiple

    def span(self, rank: int) -> tuple[int, int]:
        """The global real rows ``[lo, hi)`` of ``rank``."""
        lo = min(rank * self.per_rank, self.total)
        return lo, min(lo + self.per_rank, self.total)

    @property
    def padded(self) -> bool:
        return self.per_rank * self.processes != self.total


def pad_width(t: Tensor, width: int, side: str, value: float | int) -> Tensor:
    """``t`` (``[B, W, ...]``) padded along dim 1 to ``width`` on ``side``."""
    extra = width - t.size(1)
    if extra <= 0:
        return t
    fill = torch.full((t.size(0), extra, *t.shape[2:]), value, dtype=t.dtype, device=t.device)
    return torch.cat([fill, t] if side == "left" else [t, fill], dim=1)


def pad_value(name: str, pad_id: int) -> tuple[str, float | int]:
    side, value = ROW_FIELDS[name]
    return side, pad_id if value is None else value


def cat_rows(parts: Sequence[dict[str, Tensor]], pad_id: int) -> dict[str, Tensor]:
    """Row dicts concatenated along dim 0 (the fields all of them hold), dim 1 padded to the widest."""
    keys = [k for k in parts[0] if all(k in p for p in parts)]
    out = {}
    for k in keys:
        ts = [p[k] for p in parts]
        if ts[0].dim() >= 2:
            side, value = pad_value(k, pad_id)
            width = max(t.size(1) for t in ts)
            ts = [pad_width(t, width, side, value) for t in ts]
        out[k] = torch.cat(ts, dim=0)
    return out


def trim(rows: dict[str, Tensor], prompt_width: int, completion_width: int) -> dict[str, Tensor]:
    """Cut the padding columns no row needs, so widths are what TRL's own padding of these rows gives."""
    out = {}
    for k, v in rows.items():
        side, _ = ROW_FIELDS[k]
        if v.dim() >= 2 and side == "left":
            v = v[:, v.size(1) - prompt_width:]
        elif v.dim() >= 2 and v.size(1) > 1:
            v = v[:, :completion_width]
        out[k] = v
    return out


def row_fields(out: dict[str, Any]) -> dict[str, Tensor]:
    """The per-row tensors of a generation batch (what moves with its rows)."""
    return {k: v for k, v in out.items() if k in ROW_FIELDS and isinstance(v, Tensor)}


def pad_right(seqs: Sequence[Sequence[Any]], value: float | int, dtype: torch.dtype,
              width: int | None = None) -> Tensor:
    """Lists of per-token values as a right-padded ``[B, width]`` tensor (``width``: the longest)."""
    width = max((len(s) for s in seqs), default=0) if width is None else width
    out = torch.full((len(seqs), width), value, dtype=dtype)
    for i, s in enumerate(seqs):
        if len(s):
            out[i, :len(s)] = torch.as_tensor(list(s), dtype=dtype)
    return out


def pad_left(seqs: Sequence[Sequence[Any]], value: float | int, dtype: torch.dtype) -> Tensor:
    """Lists of per-token values as a left-padded ``[B, longest]`` tensor (TRL pads prompts on the left)."""
    width = max((len(s) for s in seqs), default=0)
    out = torch.full((len(seqs), width), value, dtype=dtype)
    for i, s in enumerate(seqs):
        if len(s):
            out[i, width - len(s):] = torch.as_tensor(list(s), dtype=dtype)
    return out
