"""The train/held-out split of every domain's prompts, and the exact held-out evaluation.

Each (domain, level) *cell* of :mod:`~dataflex_bus.shim.tasks` is a finite set of prompts: the
``10**n`` digit strings of length ``n``, numbered by reading the string as a decimal number. The split
holds out a fixed-size random subset of every cell, drawn from a generator seeded by the run's seed and
the domain's *name* only, so the held-out prompts of ``sort`` are the same whatever the other domains,
the method or the domain mix. Training and the warm start draw only from the rest: a uniform rank among
a cell's training prompts is mapped past the held-out numbers with one ``searchsorted`` over all cells,
so a draw costs the same whatever the split and never rejects.

The held-out evaluation decodes every held-out prompt greedily, once, and scores it exactly: exact
match for the learnable domains, the exact expected reward
(:func:`~dataflex_bus.shim.tasks.random_match_probability`) for the unlearnable one. A domain's accuracy
is the mean over its levels of the level's accuracy, so it weighs levels as training draws them.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from ..kit import ConfigError, ConfigIssue, segment_count, segment_sum
from .policy import TinyPolicy, generate
from .tasks import DIGITS, MAX_DIGITS, TASKS, Prompts, build_prompts, exact_match, random_match_probability


def _domain_generator(seed: int, name: str) -> torch.Generator:
    # The name's CRC, not its position in data.domains: a domain's split ignores which others are trained.
    return torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))


def level_sizes(name: str) -> list[int]:
    """Number of prompts of each level of a task."""
    return [DIGITS**n for n in TASKS[name].lengths]


def digits_of(index: Tensor, lengths: Tensor) -> Tensor:
    """Prompt number -> its digit string ``[N, MAX_DIGITS]`` (the number's decimal digits, leading zeros
    included, 0 past the string's end)."""
    pos = torch.arange(MAX_DIGITS)[None, :]
    exponent = (lengths[:, None] - 1 - pos).clamp_min(0)
    return torch.where(pos < lengths[:, None], index[:, None] // DIGITS**exponent % DIGITS, 0)


def heldout_per_level(name: str, heldout: int) -> list[int]:
    """``heldout`` prompts spread evenly over the task's levels (the first levels take the remainder)."""
    n = len(TASKS[name].lengths)
    return [heldout // n + (lvl < heldout % n) for lvl in range(n)]


def heldout_issues(names: Sequence[str], heldout: int) -> list[ConfigIssue]:
    """``data.heldout`` problems: a level left without held-out prompts, or giving more than half of its own."""
    issues = []
    for name in names:
        n = len(TASKS[name].lengths)
        sizes = level_sizes(name)
        fits = min(size // 2 for size in sizes) * n
        if heldout < n or any(h > size // 2 for h, size in zip(heldout_per_level(name, heldout), sizes)):
            issues.append(ConfigIssue("data.heldout", f"{heldout} held-out prompts do not fit {name!r}: each of "
                                      f"its {n} levels (sizes {sizes}) needs at least one and may give at most "
                                      "half", [f"{n}..{fits}"]))
    return issues


class Split:
    """The held-out prompts of every domain, and a sampler of training prompts that never draws them.

    ``heldout`` prompts per domain are spread evenly over its levels (the first levels take the
    remainder); a level may give at most half of its prompts.
    """

    def __init__(self, names: Sequence[str], seed: int, heldout: int) -> None:
        issues = heldout_issues(names, heldout)
        if issues:
            raise ConfigError(issues)
        self.names = list(names)
        n_levels: list[int] = []
        first: list[int] = []
        lengths: list[int] = []
        sizes: list[int] = []
        held: list[int] = []
        domain_of: list[int] = []
        picks: list[Tensor] = []
        for d, name in enumerate(self.names):
            gen = _domain_generator(seed, name)
            first.append(len(sizes))
            n_levels.append(len(TASKS[name].lengths))
            for n, size, h in zip(TASKS[name].lengths, level_sizes(name), heldout_per_level(name, heldout)):
                picks.append(torch.randperm(size, generator=gen)[:h].sort().values)
                lengths.append(n)
                sizes.append(size)
                held.append(h)
                domain_of.append(d)
        t = torch.tensor
        self.n_levels, self.first_cell = t(n_levels), t(first)
        self.lengths = t(lengths)
        self.sizes, self.held = t(sizes), t(held)
        self.cell_domain = t(domain_of)
        self.train_sizes = self.sizes - self.held
        # Rank r of a cell's training prompts is number r + #{held-out j : h_j - j <= r}. Offsetting each
        # cell's keys h_j - j (in 0..train_size) by the running sum of (train_size + 1) keeps cells apart.
        self.offset = torch.cumsum(self.train_sizes + 1, 0) - (self.train_sizes + 1)
        self.held_before = torch.cumsum(self.held, 0) - self.held
        self.keys = torch.cat([self.offset[c] + p - torch.arange(len(p)) for c, p in enumerate(picks)])
        # For train_rows: held-out numbers offset by their cell's start in one numbering of all cells (sorted),
        # and each cell's first row among its domain's training prompts.
        self.size_offset = torch.cumsum(self.sizes, 0) - self.sizes
        self.heldout_keys = torch.cat([self.size_offset[c] + p for c, p in enumerate(picks)])
        before = torch.cumsum(self.train_sizes, 0) - self.train_sizes
        self.level_offset = before - before[self.first_cell[self.cell_domain]]
        #: Cell and number of every held-out prompt, cell by cell, in increasing number.
        self.heldout_cells = torch.repeat_interleave(torch.arange(len(picks)), self.held)
        self.heldout_index = torch.cat(picks)
        cells = self.heldout_cells
        # The unlearnable domain's held-out answers drawn here are never scored (see evaluate).
        self.heldout = build_prompts(self.cell_domain[cells], cells - self.first_cell[self.cell_domain[cells]],
                                     digits_of(self.heldout_index, self.lengths[cells]), self.names,
                                     torch.Generator().manual_seed(seed))
        self.learnable = torch.tensor([TASKS[n].learnable for n in self.names])

    def train_rows(self, prompts: Prompts) -> Tensor:
        """Each training prompt's row among its domain's training prompts (levels in order, then numbers in
        increasing order): a stable prompt id, the inverse of :meth:`draw`'s rank. Not for held-out prompts."""
        cells = self.first_cell[prompts.domains] + prompts.levels
        pos = torch.arange(prompts.digits.shape[1])[None, :]
        exponent = (prompts.lengths[:, None] - 1 - pos).clamp_min(0)
        number = torch.where(pos < prompts.lengths[:, None], prompts.digits * DIGITS**exponent, 0).sum(-1)
        held_below = torch.searchsorted(self.heldout_keys, self.size_offset[cells] + number) - self.held_before[cells]
        return self.level_offset[cells] + number - held_below

    def domain_train_sizes(self) -> list[int]:
        """Number of training prompts of each domain, in the names' order."""
        return segment_sum(self.train_sizes, self.cell_domain, len(self.names)).tolist()

    def train_index(self, cells: Tensor, rank: Tensor) -> Tensor:
        """The number of the ``rank``-th training prompt (``0 <= rank < train_sizes[cell]``) of each cell."""
        return rank + torch.searchsorted(self.keys, self.offset[cells] + rank, right=True) - self.held_before[cells]

    def draw(self, domains: Tensor, gen: torch.Generator) -> Prompts:
        """One training prompt per entry of ``domains`` (ids into the names): a uniform level, then a
        uniform prompt among the level's training prompts. ``gen`` is consumed the same way whatever the
        domains, so a run's prompts depend only on the seed and the sequence of domain ids."""
        n = domains.shape[0]
        u_level = torch.rand(n, generator=gen, dtype=torch.float64)
        u_rank = torch.rand(n, generator=gen, dtype=torch.float64)
        levels = torch.minimum((u_level * self.n_levels[domains]).long(), self.n_levels[domains] - 1)
        cells = self.first_cell[domains] + levels
        size = self.train_sizes[cells]
        rank = torch.minimum((u_rank * size).long(), size - 1)
        index = self.train_index(cells, rank)
        return build_prompts(domains, levels, digits_of(index, self.lengths[cells]), self.names, gen)

    @torch.no_grad()
    def evaluate(self, policy: TinyPolicy) -> dict[str, float]:
        """Greedy accuracy on every held-out prompt, scored exactly: ``eval/heldout/<domain>`` and
        ``eval/heldout/learnable`` (mean over the learnable domains)."""
        policy.eval()
        p = self.heldout
        responses, mask, _ = generate(policy, p.tokens, 1.0, None)
        score = torch.where(self.learnable[p.domains], exact_match(responses, mask, p.targets),
                            random_match_probability(responses, mask)).double()
        cells = len(self.sizes)
        per_cell = segment_sum(score, self.heldout_cells, cells) / segment_count(self.heldout_cells, cells)
        per_domain = segment_sum(per_cell, self.cell_domain, len(self.names)) / self.n_levels
        out = {f"eval/heldout/{name}": float(per_domain[d]) for d, name in enumerate(self.names)}
        if bool(self.learnable.any()):
            out["eval/heldout/learnable"] = float(per_domain[self.learnable].mean())
        return out

    def record(self) -> dict[str, Any]:
        """What ``run.json`` keeps: per domain, the string length, training and held-out sizes per level."""
        out: dict[str, Any] = {}
        for d, name in enumerate(self.names):
            cells = range(int(self.first_cell[d]), int(self.first_cell[d] + self.n_levels[d]))
            out[name] = {"lengths": list(TASKS[name].lengths),
                         "train": [int(self.train_sizes[c]) for c in cells],
                         "heldout": [int(self.held[c]) for c in cells]}
        return out


__all__ = ["Split"]
