"""A cheap fingerprint of a tensor's contents, to see writes that torch's version counter does not.

A write through ``.data``, a NumPy view or a DLPack alias changes a tensor's bytes without bumping its
``_version``, so :class:`~dataflex_bus.bus.BatchWatch` also compares the fingerprints of the fields a
component declared it reads, before and after its call. The fingerprint is the wrapping integer sum of the
tensor's bytes read as 64-bit words (32-bit when the byte count asks for it): one streaming pass, exact and
independent of the thread count (integer addition modulo 2**64 is associative), and changed by any write
except one that keeps that sum (a permutation, compensating edits). ``benchmarks/bench_read_fingerprint.py``
measures its cost against a step's host work at 16,384 x 2,048.
"""

from __future__ import annotations

import torch
from torch import Tensor


def fingerprint(t: Tensor) -> int:
    """The wrapping sum of ``t``'s bytes as integer words (a copy only for a non-contiguous tensor; a nested
    tensor's flat values)."""
    if t.is_nested:
        t = t.values()
    flat = t.reshape(-1) if t.is_contiguous() else t.contiguous().reshape(-1)
    raw = flat.view(torch.uint8)
    if raw.numel() == 0:
        return 0
    # The widest word the byte count and the storage offset allow (a slice may start mid-word).
    for dtype, accumulate in ((torch.int64, torch.int64), (torch.int32, torch.int32)):
        try:
            return int(raw.view(dtype).sum(dtype=accumulate))
        except RuntimeError:
            continue
    return int(raw.sum(dtype=torch.int64))
