"""Domain-mixture prompt sampling for the ``mix`` mechanism, for every host that draws its own prompts.

:class:`DomainSampler`: per-domain pools of dataset row indices, each walked in its own seeded random
order (reshuffled when exhausted, like epochs), and a seeded draw of how many prompts each domain
gets from the pipeline's current domain probabilities. verl's ``dataflex_sync`` trainer draws by it in
``_fetch_one_gen_batch`` (the first batch of every step and every refill), TRL's host in its prompt
stream. All randomness comes from the sampler's own
generator, so the state (generator, orders, positions) is checkpointed and a resumed run draws exactly
what an uninterrupted run would.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from .errors import ConfigError, ConfigIssue

if TYPE_CHECKING:
    from .history import PromptTable
    from .runtime import Runtime


class DomainSampler:
    """Draw dataset row indices by domain probabilities from per-domain pools.

    ``labels``: the domain label of every dataset row (the ``domain_key`` column). ``domains``: the
    domains to sample (default: the sorted distinct labels); rows of other domains are never drawn.
    """

    def __init__(self, labels: Sequence[Any], *, domains: Sequence[str] | None = None, seed: int = 0,
                 key: str = "dataflex.domain_key") -> None:
        names = [str(label) for label in labels]
        present = sorted(set(names))
        self.domains = list(domains) if domains is not None else present
        missing = [d for d in self.domains if d not in present]
        if missing:
            raise ConfigError(ConfigIssue(key, f"domains {missing} have no rows in the training dataset", present))
        if not self.domains:
            raise ConfigError(ConfigIssue(key, "the training dataset has no rows to sample"))
        index = {d: i for i, d in enumerate(self.domains)}
        ids = torch.tensor([index.get(n, -1) for n in names], dtype=torch.long)
        order = torch.argsort(ids, stable=True)
        counts = torch.bincount(ids[ids >= 0], minlength=len(self.domains))
        start = int((ids < 0).sum())
        #: Row indices of each domain's pool, in dataset order.
        self.pools: list[Tensor] = list(torch.split(order[start:], counts.tolist()))
        self.generator = torch.Generator().manual_seed(int(seed))
        self.orders: list[Tensor] = [self._shuffle(pool) for pool in self.pools]
        self.positions = [0] * len(self.domains)
        self.epochs = [0] * len(self.domains)

    def _shuffle(self, pool: Tensor) -> Tensor:
        return pool[torch.randperm(pool.numel(), generator=self.generator)]

    def _take(self, d: int, count: int) -> Tensor:
        """The next ``count`` rows of domain ``d``'s walk (reshuffling the pool when it runs out)."""
        out = []
        while count > 0:
            order, pos = self.orders[d], self.positions[d]
            n = min(count, order.numel() - pos)
            out.append(order[pos:pos + n])
            self.positions[d] = pos + n
            count -= n
            if self.positions[d] >= order.numel():
                self.orders[d] = self._shuffle(self.pools[d])
                self.positions[d] = 0
                self.epochs[d] += 1
        return torch.cat(out) if out else torch.empty(0, dtype=torch.long)

    def draw(self, n: int, probabilities: Tensor) -> tuple[Tensor, Tensor]:
        """``n`` dataset row indices and their domain ids, domains drawn i.i.d. from ``probabilities``
        (float ``[D]`` aligned with :attr:`domains`, see :func:`dataflex_bus.decision.sampling_probabilities`).
        """
        picks = torch.multinomial(probabilities, n, replacement=True, generator=self.generator)
        rows = torch.empty(n, dtype=torch.long)
        counts = torch.bincount(picks, minlength=len(self.domains)).tolist()
        for d, count in enumerate(counts):  # one slice per domain (D is small), never per row
            if count:
                rows[picks == d] = self._take(d, count)
        return rows, picks

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        return {
            "domains": list(self.domains),
            "generator": self.generator.get_state(),
            "orders": [o.clone() for o in self.orders],
            "positions": list(self.positions),
            "epochs": list(self.epochs),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if list(state["domains"]) != self.domains:
            raise ConfigError(ConfigIssue("dataflex.domains", f"checkpoint sampled domains {state['domains']}, "
                                          f"this run samples {self.domains}"))
        sizes = [p.numel() for p in self.pools]
        if [o.numel() for o in state["orders"]] != sizes:
            raise ConfigError(ConfigIssue("data.train_files", "the training dataset changed since the checkpoint "
                                          "(per-domain pool sizes differ)"))
        self.generator.set_state(state["generator"])
        self.orders = [o.clone() for o in state["orders"]]
        self.positions = list(state["positions"])
        self.epochs = list(state["epochs"])


def domain_labels(dataset: Any, key: str, *, required: bool,
                  why: str = "a mixer samples by domain") -> list[str] | None:
    """The ``key`` column of a training dataset (anything with ``column_names`` and ``dataset[key]``) as
    strings; ``None`` when absent and not ``required`` (then every prompt is of one domain), else refused
    naming ``dataflex.domain_key``, ``why`` the column is needed, and the columns there are."""
    columns = list(getattr(dataset, "column_names", None) or [])
    if key not in columns:
        if required:
            raise ConfigError(ConfigIssue("dataflex.domain_key", f"column {key!r} is not in the training dataset; "
                                          f"{why}", columns))
        return None
    return [str(x) for x in dataset[key]]


def prepare_prompts(runtime: Runtime, table: Callable[[], PromptTable], *, labels: Sequence[str] | None = None,
                    domains: Sequence[str] | None = None, seed: int = 0) -> DomainSampler | None:
    """What every host does once its training prompts are known, before the first step: when a method mixes,
    the domains it samples go to the runtime (a :class:`DomainSampler` over the rows' ``labels``, returned, or
    the host's own ``domains`` when it samples by itself); when a method needs prompt ids, the prompt table
    (``table()``, built only then)."""
    sampler = None
    if runtime.plan.samples_domains:
        if domains is None:
            sampler = DomainSampler(labels or [], domains=runtime.configured_domains, seed=seed)
            domains = sampler.domains
        runtime.set_domains(domains)
    if runtime.plan.needs_prompt_ids:
        runtime.set_prompts(table())
    return sampler
