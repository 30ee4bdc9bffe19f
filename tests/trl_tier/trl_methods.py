"""Method blocks, test components and checks that the TRL tier (tests/trl_tier) and the vllm tier (tests/vllm_tier,
TRL with ``use_vllm=True``) both train: written once, so a check means the same on both generation paths.

Imports dataflex_bus and torch only (never trl or vllm): the tiers' modules import it after their own skips.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import torch

from dataflex_bus import Reweighter, Reweighting, Score, Scorer, Selection, Selector
from dataflex_bus.components import ALLOCATION_PARAMS, Allocation, Allocator, Param

Block = dict[str, Any]
#: The testing kit's ``register(kind, name, cls)`` fixture.
Register = Callable[[str, str, type], None]

#: DAPO's dynamic sampling: groups whose rewards are all equal leave the batch.
DAPO: Block = {"mechanism": "select", "scorer": {"name": "reward_difficulty"}, "actuator": {"name": "dapo"}}
#: A selection keeping every group (solve rates always lie in [0, 1]): the whole select path, nothing dropped.
KEEP_ALL: Block = {"mechanism": "select", "scorer": {"name": "group_solve_rate"},
                   "actuator": {"name": "threshold_band", "params": {"low": 0.0, "high": 1.0}}}


# ---------------------------------------------------------------------------------------------- reweight
class Twice(Reweighter):
    """Weight 2 on every token: a power of two, so a weighted gradient is exactly twice the plain one."""

    def reweight(self, batch, score, step):
        return Reweighting(weights=torch.full((len(batch),), 2.0))


#: :class:`Twice`'s reweight block (register it as ``test_twice``).
TWICE: Block = {"mechanism": "reweight", "scorer": {"name": "reward_difficulty"}, "actuator": {"name": "test_twice"}}


def assert_twice_the_gradient(weighted: dict[str, Any], plain: dict[str, Any]) -> None:
    """One optimizer step each: every accumulated gradient of ``weighted`` is exactly twice ``plain``'s."""
    (ga,), (gb,) = weighted["grads"], plain["grads"]
    assert all(torch.equal(ga[n], 2 * gb[n]) for n in gb)


# ---------------------------------------------------------------------------------------------- token selection
class TokenPosition(Scorer):
    """``s[i, t] = t``: a token's position in its response."""

    requires = ("response_mask",)
    timing = "post_advantage"
    granularity = "token"

    def score(self, batch, step, **ctx):
        width = batch["response_mask"].shape[1]
        return Score(torch.arange(width, dtype=torch.float32).expand(len(batch), -1).contiguous(), "token")


class EvenTokens(Selector):
    """Train the tokens at even positions only, out of every loss term (``mask_kl``): each row keeps its first."""

    selects_tokens = True
    accepts = ("token",)
    min_timing = "post_advantage"

    def select(self, batch, score, step):
        tokens = (score.values.long() % 2 == 0) & batch.token_mask
        return Selection(keep=tokens.any(dim=1), tokens=tokens, mask_kl=True)


def even_tokens(register: Register) -> Block:
    """:class:`TokenPosition` and :class:`EvenTokens` registered; the select block training even positions only."""
    register("scorer", "test_position", TokenPosition)
    register("selector", "test_even_tokens", EvenTokens)
    return {"mechanism": "select", "scorer": {"name": "test_position"}, "actuator": {"name": "test_even_tokens"}}


# ---------------------------------------------------------------------------------------------- allocate
class PromptPosition(Scorer):
    """A candidate's position in its draw (pre_rollout)."""

    timing: ClassVar = "pre_rollout"
    granularity: ClassVar = "prompt"

    def score(self, batch, step, **ctx):
        return Score(torch.arange(len(batch), dtype=torch.float64), "prompt")


class ByPosition(Allocator):
    """``counts[i % len(counts)]`` rollouts to the candidate at position ``i``."""

    params: ClassVar = {**ALLOCATION_PARAMS, "counts": Param(list, [4], item=int, doc="rollouts by position")}
    counts: list[int]

    def allocate(self, batch, score, step, budget):
        pattern = torch.tensor(self.counts, dtype=torch.long)
        return Allocation(pattern[torch.arange(len(batch)) % pattern.numel()])


def by_position(register: Register, counts: list[int], **params: Any) -> Block:
    """:class:`PromptPosition` and :class:`ByPosition` registered; the allocate block giving ``counts`` by position
    (at most 16 rollouts a prompt; ``params``: more allocation parameters)."""
    register("scorer", "test_position", PromptPosition)
    register("allocator", "test_by_position", ByPosition)
    return {"mechanism": "allocate", "scorer": {"name": "test_position"},
            "actuator": {"name": "test_by_position", "params": {"counts": counts, "max_n": 16, **params}}}


# ---------------------------------------------------------------------------------------------- replay
def replayer(**params: Any) -> Block:
    """The replay block of ``rollout_replay`` with ``params``."""
    return {"mechanism": "replay", "scorer": {"name": "reward_difficulty"},
            "actuator": {"name": "rollout_replay", "params": params}}


#: RePO: each prompt's best stored rows train again in a group of their own, clipped against their mu.
REPO = replayer(unit="prompt", priority="highest", advantage="split", correction="behaviour", per_prompt=8,
                min_to_replay=4, replays=2, capacity=256)
#: DOTS's cap on its per-token importance weight.
DOTS_CAP = 2.0
#: DOTS: half of each step's groups come from the store, every row weighted by min(pi_old / mu, DOTS_CAP).
DOTS = replayer(unit="group", priority="uniform", advantage="own_group", correction="decoupled", is_cap=DOTS_CAP,
                fresh_fraction=0.5, capacity=64)


def dots_weights(old: torch.Tensor, mu: torch.Tensor) -> torch.Tensor:
    """DOTS's per-token weights: the old policy's probability over the behaviour policy's, truncated at the cap."""
    return torch.exp(old - mu).clamp(max=DOTS_CAP)


# ---------------------------------------------------------------------------------------------- references
class Once:
    """``train``'s runs by their arguments, each trained once per module (several tests compare against one)."""

    def __init__(self, train: Callable[..., dict[str, Any]]) -> None:
        self.train = train
        self.runs: dict[str, dict[str, Any]] = {}

    def __call__(self, **kw: Any) -> dict[str, Any]:
        key = repr(sorted(kw.items(), key=lambda item: item[0]))
        if key not in self.runs:
            self.runs[key] = self.train(**kw)
        return self.runs[key]
