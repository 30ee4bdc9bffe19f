"""The scripted world every host of the contract suite generates from, and what a step's update holds.

Prompts are dataset rows of three domains; each prompt has ``N`` rollouts (sessions) whose reward and
response length are fixed functions of ``(domain, row, session)``, as verl's harness agent loop writes
them. So the same prompts give the same rollouts in every host, and everything a method decides from
them (kept rows, advantages, weights, domain probabilities, refill rounds, metrics) must come out equal.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

N = 4
#: Per domain, the sessions (of N) that answer right: copy solves half, sort a quarter, reverse nothing.
SOLVED: dict[str, tuple[int, ...]] = {"copy": (0, 2), "sort": (0,), "reverse": ()}
DOMAINS = ("copy", "sort", "reverse")


def response_length(row: int, session: int) -> int:
    """The harness agent loop's response lengths (2..5 tokens)."""
    return 2 + (row + session) % 4


def behaviour_log_prob(row: Any, session: Any, token: Any) -> Any:
    """The harness agent loop's rollout log-probs (``verl_harness.behaviour_log_probs``), per token."""
    return -1.0 - 0.1 * ((row + session + token) % 4)


def reward(domain: str, session: int) -> float:
    """Right on the solved sessions of every block of ``N`` (an allocation's larger groups repeat the pattern)."""
    return 1.0 if session % N in SOLVED[domain] else 0.0


@dataclass(frozen=True)
class World:
    """``rows``: per domain, how many prompts (dataset rows in domain order, global row index)."""

    rows: tuple[tuple[str, int], ...] = (("copy", 2), ("sort", 2), ("reverse", 2))

    @property
    def prompts(self) -> list[tuple[str, int]]:
        """``(domain, row)`` of every dataset row, in dataset order (``extra_info.index`` = row)."""
        out: list[tuple[str, int]] = []
        for name, count in self.rows:
            out += [(name, len(out) + i) for i in range(count)]
        return out

    @property
    def counts(self) -> dict[str, int]:
        return dict(self.rows)


@dataclass
class Row:
    """One trained rollout: its per-token advantages and weights (``None``: no weight but 1) and its
    loss-mask tokens."""

    advantages: tuple[float, ...]
    weights: tuple[float, ...] | None
    tokens: int
    #: The old log-probs the loss took its ratio against and the behaviour (rollout) log-probs (replay cases).
    old: tuple[float, ...] | None = None
    mu: tuple[float, ...] | None = None


@dataclass
class StepRecord:
    """What one step's update trained on, keyed by ``(domain, row, session, k)`` (``k``: the prompt's k-th
    generation in the step, when a refill round draws it again); whether it skipped the update; the kit's
    metrics; the domain probabilities published at the step's end."""

    trained: dict[tuple[str, int, int, int], Row] = field(default_factory=dict)
    skipped: bool = False
    metrics: dict[str, float] = field(default_factory=dict)
    domain_probs: dict[str, float] | None = None


#: Metrics a host publishes beside the kit's (its own compute, draws and training blocks).
HOST_OWN = ("dataflex/compute/", "dataflex/drawn/", "dataflex/refill/dispatched_prompts", "dataflex/sample_prob/",
            "dataflex/empty_minibatches", "dataflex/restored_rows", "dataflex/removed_minibatch_rows",
            "compute/modelled_cost")


def kit_metrics(metrics: dict[str, Any]) -> dict[str, float]:
    """The kit's metrics of a step (one namespace on every host)."""
    return {k: float(v) for k, v in metrics.items()
            if k.startswith(("dataflex/", "compute/")) and not k.startswith(HOST_OWN)}


def add_row(record: StepRecord, domain: str, row: int, session: int, value: Row) -> None:
    """Add one trained row in update order, counting the prompt's repeated generations. Sessions are keyed
    modulo ``N`` (a session's reward and length repeat every ``N``): an allocation's group of 8 is two blocks
    of ``N``, whether a host numbers its rollouts 0-7 or 0-3 twice."""
    session %= N
    k = 0
    while (domain, row, session, k) in record.trained:
        k += 1
    record.trained[(domain, row, session, k)] = value


def row_record(advantages: Any, weights: Any, mask: Any, old: Any = None, mu: Any = None) -> Row:
    """A :class:`Row` from one row's dense advantages, weights (or ``None``) and loss mask (and, where
    recorded, its old and behaviour log-probs), on the loss-mask tokens (a token selection under mask_kl
    leaves gaps in the mask)."""
    on = mask[: len(advantages)] != 0
    length = int(on.sum())
    adv = tuple(round(float(a), 5) for a in advantages[: len(on)][on])
    w = None
    if weights is not None:
        values = tuple(round(float(x), 5) for x in weights[: len(on)][on])
        w = None if all(x == 1.0 for x in values) else values

    def values_of(t: Any) -> tuple[float, ...] | None:
        return None if t is None else tuple(round(float(x), 5) for x in t[: len(on)][on])

    return Row(adv, w, length, values_of(old), values_of(mu))
