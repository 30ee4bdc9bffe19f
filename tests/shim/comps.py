"""Small, real components and an observer used by the shim tests (registered in-process)."""

from __future__ import annotations

import torch

from dataflex_bus import Param, Score, Scorer, Selection, Selector, hookimpl
from dataflex_bus.components import Mixer
from dataflex_bus.registry import register_local, unregister_local


class RewardScore(Scorer):
    """Outcome reward per rollout (post_reward)."""

    requires = ("rm_scores", "response_mask")

    def score(self, batch, step_id, **ctx):
        return Score(batch.rewards, "response")


class AdvantageScore(Scorer):
    """|mean advantage| per rollout (post_advantage)."""

    requires = ("advantages", "response_mask")
    timing = "post_advantage"

    def score(self, batch, step_id, **ctx):
        mask = batch["response_mask"].to(torch.float32)
        return Score((batch["advantages"].abs() * mask).sum(-1) / mask.sum(-1).clamp_min(1), "response")


class EvenGroups(Selector):
    """Keep the groups with an even uid (whole groups)."""

    requires = ("uid",)

    @classmethod
    def keeps_whole_groups(cls, granularity):
        return True

    def select(self, batch, score, step_id):
        return Selection(batch.group_index % 2 == 0)


class FirstHalf(Selector):
    """Keep the first half of the rows and hand back doubled advantages (a subset selector)."""

    min_timing = "post_advantage"

    def select(self, batch, score, step_id):
        keep = torch.arange(len(batch)) < len(batch) // 2
        return Selection(keep, advantages=batch["advantages"] * 2)


class KeepNone(Selector):
    def select(self, batch, score, step_id):
        return Selection(torch.zeros(len(batch), dtype=torch.bool))


class FailAt(Selector):
    """Raises at step ``at`` (a plugin bug mid-run)."""

    params = {"at": Param(int, 2, low=0)}

    def select(self, batch, score, step_id):
        if step_id == self.at:
            raise RuntimeError(f"boom at step {step_id}")
        return Selection(torch.ones(len(batch), dtype=torch.bool))


class AllOnFirst(Mixer):
    """After the warmup, every prompt comes from the first domain; counts updates (state)."""

    def update(self, batch, score, step_id):
        self.updates = getattr(self, "updates", 0) + 1
        return {"updates": float(self.updates)}

    def probabilities(self):
        p = torch.zeros(len(self.domains))
        p[0] = 1.0
        return p

    def state_dict(self):
        return {"updates": getattr(self, "updates", 0)}

    def load_state_dict(self, state):
        self.updates = state["updates"]


COMPONENTS = {
    ("scorer", "t_reward"): RewardScore,
    ("scorer", "t_adv"): AdvantageScore,
    ("selector", "t_even_groups"): EvenGroups,
    ("selector", "t_first_half"): FirstHalf,
    ("selector", "t_keep_none"): KeepNone,
    ("selector", "t_fail_at"): FailAt,
    ("mixer", "t_all_on_first"): AllOnFirst,
}


def register() -> None:
    for (kind, name), cls in COMPONENTS.items():
        register_local(kind, name, cls)


def unregister() -> None:
    for kind, name in COMPONENTS:
        unregister_local(kind, name)


class Recorder:
    """An observer: records every event with the batch it saw."""

    def __init__(self) -> None:
        self.events: list[tuple[str, int, object, object]] = []

    def _rec(self, name, batch, step, decision):
        self.events.append((name, step, batch, decision))

    @hookimpl
    def on_prompts(self, batch, step, decision):
        self._rec("on_prompts", batch, step, decision)

    @hookimpl
    def on_rollout(self, batch, step, decision):
        self._rec("on_rollout", batch, step, decision)

    @hookimpl
    def on_advantage(self, batch, step, decision):
        self._rec("on_advantage", batch, step, decision)

    @hookimpl
    def on_step_end(self, batch, step, decision):
        self._rec("on_step_end", batch, step, decision)
