"""GFPO selection: vectorised (one lexicographic sort) vs a per-group Python loop, at verl batch sizes.

Prints wall time per call and the ratio; no thresholds. Run: ``python contrib/dataflex-gfpo/benchmarks/bench_gfpo.py``
(needs ``dataflex_gfpo`` importable: the pack installed, or ``PYTHONPATH=contrib/dataflex-gfpo/src``).
"""

from __future__ import annotations

import functools
import math
import time

import torch
from dataflex_gfpo.selector import GFPO

from dataflex_bus import Score
from dataflex_bus.testing import make_batch


def loop_select(batch, k: int) -> torch.Tensor:
    keep = torch.zeros(len(batch), dtype=torch.bool)
    lengths, gi = batch.lengths.tolist(), batch.group_index.tolist()
    rows_of: dict[int, list[int]] = {}
    for i, g in enumerate(gi):
        if g >= 0:
            rows_of.setdefault(g, []).append(i)
    r = batch.rewards
    for rows in rows_of.values():
        kept = sorted(rows, key=lambda i: (lengths[i], i))[:k]
        vals = r[kept]
        _ = (vals - vals.mean()) / ((vals.std() if len(kept) > 1 else 1.0) + 1e-6)
        keep[kept] = True
    return keep


def timed(fn, repeat: int = 5) -> float:
    fn()
    best = math.inf
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def main() -> None:
    torch.set_num_threads(1)
    print(f"{'rows':>7} {'groups':>7} {'vectorised ms':>14} {'loop ms':>9} {'loop/vectorised':>16}")
    for groups, size in [(64, 16), (512, 16), (1024, 16)]:
        batch = make_batch(groups=groups, group_size=size, max_len=64, seed=0)
        sel = GFPO(k=size // 2)
        score = Score(batch.rewards, "response")
        assert torch.equal(sel.select(batch, score, 0).keep, loop_select(batch, size // 2))
        v = timed(functools.partial(sel.select, batch, score, 0))
        loop = timed(functools.partial(loop_select, batch, size // 2), repeat=2)
        print(f"{len(batch):>7} {groups:>7} {v * 1e3:>14.2f} {loop * 1e3:>9.1f} {loop / v:>16.1f}")


if __name__ == "__main__":
    main()
