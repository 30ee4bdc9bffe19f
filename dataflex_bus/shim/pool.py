"""Where an RL run's training prompts come from: the training regime keys ``data.train_pool`` and
``data.level_weights`` (the warm start and the held-out prompts never see them).

* ``data.level_weights`` sets each domain's level mix (``{reverse: [1, 3]}``: a quarter of ``reverse``'s
  prompts of its first level, three quarters of its second); a domain not named draws its levels
  uniformly, as by default. The shim's base policy solves the longer levels far less often
  (``benchmarks/level_success.py``), so weighting them up is how a regime puts more of its training
  prompts into the hard tail (a success rate of a few percent).
* ``data.train_pool: N`` fixes, per domain, ``N`` distinct training prompts, drawn once from the training
  split by a generator seeded by ``data.seed`` and the domain's name only (the same pool for every
  ``trainer.seed`` and every method), spread over the levels by the level mix (largest remainder). The run
  then cycles through each domain's pool in epochs, a fresh permutation of the pool (from the run's
  ``data`` generator) each epoch, so a method sees every prompt of the pool again every ``N`` draws of its
  domain: the regime history-based methods were built for. ``data/epoch`` (the passes made over the whole
  pool: prompts drawn / pool size) is in each step's metrics.

Without either key the sampler is the split's own :meth:`~dataflex_bus.shim.split.Split.draw`, consumed
exactly as before (runs stay digit-identical).
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from ..kit import ConfigIssue
from .split import Split, digits_of, heldout_per_level, level_sizes
from .tasks import TASKS, Prompts, build_prompts


def level_mix(name: str, level_weights: Mapping[str, Sequence[float]]) -> list[float]:
    """The share of each level of a domain's training prompts (uniform unless ``level_weights`` names it)."""
    n = len(TASKS[name].lengths)
    weights = [float(w) for w in level_weights.get(name, [1.0] * n)]
    total = sum(weights)
    return [w / total for w in weights]


def pool_per_level(name: str, pool: int, level_weights: Mapping[str, Sequence[float]]) -> list[int]:
    """``pool`` prompts spread over a domain's levels by its level mix (largest remainder, ties to the first)."""
    exact = [pool * s for s in level_mix(name, level_weights)]
    counts = [int(e) for e in exact]
    by_remainder = sorted(range(len(exact)), key=lambda lvl: (counts[lvl] - exact[lvl], lvl))
    for lvl in by_remainder[: pool - sum(counts)]:
        counts[lvl] += 1
    return counts


def regime_issues(names: Sequence[str], heldout: int, pool: int,
                  level_weights: Mapping[str, Any]) -> list[ConfigIssue]:
    """Problems of ``data.level_weights`` and ``data.train_pool`` given the (valid) domains and held-out size."""
    issues: list[ConfigIssue] = []
    for name, weights in level_weights.items():
        key = f"data.level_weights.{name}"
        if name not in names:
            issues.append(ConfigIssue(key, f"{name!r} is not in data.domains", list(names)))
            continue
        n = len(TASKS[name].lengths)
        numbers = isinstance(weights, list) and all(
            isinstance(w, (int, float)) and not isinstance(w, bool) for w in weights)
        if not numbers or len(weights) != n:
            issues.append(ConfigIssue(key, f"expected a list of {n} weights (one per level of {name!r}, lengths "
                                      f"{list(TASKS[name].lengths)}), got {weights!r}"))
        elif any(not (w >= 0 and w != float("inf")) for w in weights) or sum(weights) <= 0:
            issues.append(ConfigIssue(key, f"weights must be finite, 0 or more and not all 0, got {weights!r}"))
    if pool and not issues:
        for name in names:
            sizes = [size - h for size, h in zip(level_sizes(name), heldout_per_level(name, heldout))]
            counts = pool_per_level(name, pool, level_weights)
            over = [(lvl, c, s) for lvl, (c, s) in enumerate(zip(counts, sizes)) if c > s]
            if over:
                lvl, c, s = over[0]
                issues.append(ConfigIssue("data.train_pool", f"{pool} prompts of {name!r} put {c} in its level {lvl}, "
                                          f"which has only {s} training prompts; use a smaller pool or another "
                                          "data.level_weights"))
    return issues


def _pool_generator(seed: int, name: str) -> torch.Generator:
    # Apart from the split's generator (another salt), and like it independent of the other domains.
    return torch.Generator().manual_seed((seed * 1_000_033 + zlib.crc32(b"pool:" + name.encode())) % (2**63))


class TrainingSampler:
    """The training prompts of a run: ``draw`` one per entry of ``domains``, by the regime's keys."""

    def __init__(self, split: Split, data: Mapping[str, Any]) -> None:
        self.split = split
        names = split.names
        weights: Mapping[str, Sequence[float]] = data.get("level_weights") or {}
        self.pool = int(data.get("train_pool") or 0)
        width = int(split.n_levels.max())
        self.cdf: Tensor | None = None
        if weights:
            mix = torch.zeros(len(names), width, dtype=torch.float64)
            for d, name in enumerate(names):
                mix[d, : len(TASKS[name].lengths)] = torch.tensor(level_mix(name, weights), dtype=torch.float64)
            self.cdf = mix.cumsum(1)
        if self.pool:
            cells, index = [], []
            for d, name in enumerate(names):
                gen = _pool_generator(data["seed"], name)
                first = int(split.first_cell[d])
                for lvl, k in enumerate(pool_per_level(name, self.pool, weights)):
                    cell = first + lvl
                    rank = torch.randperm(int(split.train_sizes[cell]), generator=gen)[:k]
                    cells.append(torch.full((k,), cell))
                    index.append(split.train_index(torch.full((k,), cell), rank))
            #: ``[D, N]``: the cell and number of every pool prompt, domain by domain.
            self.pool_cells = torch.cat(cells).view(len(names), self.pool)
            self.pool_index = torch.cat(index).view(len(names), self.pool)
            #: Each domain's current permutation of its pool, the position in it and the prompts drawn so far.
            self.order = torch.zeros(len(names), self.pool, dtype=torch.long)
            self.cursor = torch.full((len(names),), self.pool, dtype=torch.long)  # a permutation is due
            self.drawn = torch.zeros(len(names), dtype=torch.long)

    def draw(self, domains: Tensor, gen: torch.Generator) -> Prompts:
        if not self.pool and self.cdf is None:
            return self.split.draw(domains, gen)
        split = self.split
        if not self.pool:
            assert self.cdf is not None
            n = domains.shape[0]
            u_level = torch.rand(n, generator=gen, dtype=torch.float64)
            u_rank = torch.rand(n, generator=gen, dtype=torch.float64)
            cdf = self.cdf[domains]
            levels = torch.minimum((u_level[:, None] >= cdf).sum(1), split.n_levels[domains] - 1)
            cells = split.first_cell[domains] + levels
            size = split.train_sizes[cells]
            index = split.train_index(cells, torch.minimum((u_rank * size).long(), size - 1))
        else:
            pick = torch.empty_like(domains)
            counts = torch.bincount(domains, minlength=len(split.names))
            for d in torch.nonzero(counts).flatten().tolist():  # a handful of domains
                pick[domains == d] = self._next(d, int(counts[d]), gen)
            self.drawn += counts
            cells, index = self.pool_cells[domains, pick], self.pool_index[domains, pick]
            levels = cells - split.first_cell[domains]
        return build_prompts(domains, levels, digits_of(index, split.lengths[cells]), split.names, gen)

    def _next(self, d: int, k: int, gen: torch.Generator) -> Tensor:
        """The next ``k`` positions of domain ``d``'s pool in its epochs' permutations."""
        taken = []
        while k:
            if int(self.cursor[d]) == self.pool:
                self.order[d] = torch.randperm(self.pool, generator=gen)
                self.cursor[d] = 0
            at = int(self.cursor[d])
            step = min(k, self.pool - at)
            taken.append(self.order[d, at: at + step].clone())  # the next epoch overwrites the row
            self.cursor[d] += step
            k -= step
        return torch.cat(taken)

    def metrics(self) -> dict[str, float]:
        """``data/epoch``: passes over the whole pool so far (none without a pool)."""
        if not self.pool:
            return {}
        return {"data/epoch": float(self.drawn.sum()) / (self.pool * len(self.split.names))}

    def state_dict(self) -> dict[str, Any]:
        if not self.pool:
            return {}
        return {"order": self.order.clone(), "cursor": self.cursor.clone(), "drawn": self.drawn.clone()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if not self.pool:
            return
        for name in ("order", "cursor", "drawn"):
            value = state[name]
            own = getattr(self, name)
            if not isinstance(value, Tensor) or value.shape != own.shape:
                raise ValueError(f"pool entry {name!r} does not fit a pool of {self.pool} prompts per domain")
            own.copy_(value)


__all__ = ["TrainingSampler", "level_mix", "pool_per_level", "regime_issues"]
