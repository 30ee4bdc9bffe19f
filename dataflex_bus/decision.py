"""What the methods decided at one event: the :class:`Decision` participants fill and observers read.

This is a data type of the plugin contract (every event hook receives one). How a host carries a decision
out is the host kit's job (:mod:`dataflex_bus.carry`), written once for every host.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import Tensor


@dataclass
class ReplayDecision:
    """What a replay method decided at ``on_advantage``: the fresh rows to store in the run's buffer
    (``store``, bool ``[B]``) with their ``priority`` (``[B]``, the scorer's value)."""

    store: Tensor
    priority: Tensor


class Decision:
    """What the participants decided at one event; the host loop carries it out.

    ``keep``: bool ``[B]`` rows to keep (``None``: all). ``advantages``: recomputed ``[B, T]`` (subset
    selectors). ``weights``: ``[B, T]`` multiplied into ``rollout_is_weights`` (1 on tokens that do not
    count). ``domain_probs``: sampling probabilities for the next prompts (mix). ``skip_update``: an
    empty-selection policy asked to skip this step's policy update. ``metrics``: ``dataflex/...``.
    ``on_empty``: the strictest ``on_empty`` of the methods that dropped rows (what a host does with a
    training block all of whose rows were dropped). ``nonfinite``: bool ``[B]`` rows dropped for a
    non-finite score (never trained, whatever ``on_empty`` says). ``tokens``: bool ``[B, T]`` the response
    tokens whose policy-gradient term trains (a token selection; ``None``: all), carried out through the loss
    weights, so KL and entropy bonus keep every token unless ``mask_kl``: then the mask is written into
    ``response_mask`` and ``loss_mask`` too. ``replay``: the rows a replay method stores
    (:class:`ReplayDecision`; the host kit keeps the buffer). ``counts``: long ``[B]`` rollouts per row from an
    allocator (at ``on_prompts``: per candidate, 0 = skip; at ``on_rollout``: per row, the same on every row
    of a group, how many more rollouts the group gets in a continuation round).
    """

    __slots__ = ("advantages", "counts", "domain_probs", "keep", "mask_kl", "metrics", "nonfinite", "on_empty",
                 "replay", "skip_update", "tokens", "weights")

    def __init__(self) -> None:
        self.keep: Tensor | None = None
        self.advantages: Tensor | None = None
        self.weights: Tensor | None = None
        self.domain_probs: dict[str, float] | None = None
        self.skip_update = False
        self.metrics: dict[str, float] = {}
        self.on_empty: str | None = None
        self.nonfinite: Tensor | None = None
        self.replay: ReplayDecision | None = None
        self.tokens: Tensor | None = None
        self.mask_kl = False
        self.counts: Tensor | None = None

    def drop(self, rows: Tensor, *, on_empty: str | None = None, nonfinite: bool = False) -> None:
        """Drop ``rows`` (bool ``[B]``): keep masks of several methods AND. ``on_empty``: the dropping
        method's policy; ``nonfinite``: the rows are dropped because their score is NaN/inf."""
        self.restrict(~rows, on_empty=on_empty)
        if nonfinite:
            self.nonfinite = rows if self.nonfinite is None else self.nonfinite | rows

    def restrict(self, keep: Tensor, *, on_empty: str | None = None) -> None:
        """Keep only ``keep`` (bool ``[B]``) of what is kept so far (``on_empty``: as in :meth:`drop`)."""
        self.keep = keep if self.keep is None else self.keep & keep
        self._note(on_empty)

    def _note(self, policy: str | None) -> None:
        # A block emptied by several methods' drops follows the strictest of their policies: none of
        # them then trains on a row it refused, nor skips what another one asked to raise on.
        if policy is not None and (self.on_empty is None or _STRICTNESS[policy] > _STRICTNESS[self.on_empty]):
            self.on_empty = policy

    def keep_tokens(self, tokens: Tensor, *, mask_kl: bool = False, on_empty: str | None = None) -> None:
        """Train the policy-gradient term on ``tokens`` (bool ``[B, T]``) only: the token masks of several
        methods AND. ``mask_kl``: KL and entropy bonus leave the other tokens too. ``on_empty``: the method's
        policy for a training block left without a kept token (as for a block of dropped rows)."""
        self.tokens = tokens if self.tokens is None else self.tokens & tokens
        self.mask_kl = self.mask_kl or mask_kl
        self._note(on_empty)

    def scale(self, weights: Tensor) -> None:
        """Multiply ``[B, T]`` weights in: the weights of several methods multiply."""
        self.weights = weights if self.weights is None else self.weights * weights

    def __repr__(self) -> str:
        keep = None if self.keep is None else f"{int(self.keep.sum())}/{self.keep.numel()}"
        tokens = "" if self.tokens is None else f"tokens={int(self.tokens.sum())}/{self.tokens.numel()}, "
        return (f"Decision(keep={keep}, {tokens}advantages={self.advantages is not None}, "
                f"weights={self.weights is not None}, domain_probs={self.domain_probs}, "
                f"skip_update={self.skip_update}, counts={self.counts is not None})")


#: ``on_empty`` policies from the most lenient to the strictest.
_STRICTNESS = {"keep_all": 0, "skip": 1, "error": 2}
