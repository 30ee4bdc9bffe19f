"""Small, real components registered in-process for foundation tests (the decorators' path)."""

from __future__ import annotations

import torch

from dataflex_bus import Param, Reweighter, Reweighting, Score, Scorer, Selection, Selector
from dataflex_bus.components import Mixer
from dataflex_bus.registry import register_local, unregister_local


class ToyReward(Scorer):
    """Outcome reward per rollout."""

    requires = ("rm_scores", "response_mask")

    def score(self, batch, step_id, **ctx):
        return Score(batch.rewards, "response")


class ToyGroupRate(Scorer):
    """Share of a group's rollouts with reward > 0.5."""

    requires = ("rm_scores", "response_mask", "uid")
    granularity = "prompt"
    needs_groups = True

    def score(self, batch, step_id, **ctx):
        from dataflex_bus.ops import gather_segments, segment_sum

        hits = segment_sum((batch.rewards > 0.5).long(), batch.group_index, batch.num_groups)
        rate = hits.double() / batch.group_sizes.clamp_min(1)
        return Score(gather_segments(rate, batch.group_index).float(), "prompt")


class ToyTokenProb(Scorer):
    requires = ("old_log_probs", "response_mask")
    timing = "post_advantage"
    granularity = "token"

    def score(self, batch, step_id, **ctx):
        return Score(batch["old_log_probs"].exp(), "token")


class ToyNeedsAdvantage(Scorer):
    """Declares post_reward but reads advantages: a broken declaration validation must catch."""

    requires = ("advantages",)

    def score(self, batch, step_id, **ctx):
        return Score(batch["advantages"].sum(-1), "response")


class ToyBand(Selector):
    params = {
        "low": Param(float, 0.0, low=0.0, high=1.0),
        "high": Param(float, 1.0, low=0.0, high=1.0),
        "fraction": Param(float, 1.0, low=0.0, high=1.0, low_open=True),
        "mode": Param(str, "inclusive", choices=("inclusive", "strict")),
    }

    @classmethod
    def keeps_whole_groups(cls, granularity):
        return granularity == "prompt"

    @classmethod
    def check_params(cls, values):
        return [("low", f"low ({values['low']}) must be <= high ({values['high']})")] \
            if values["low"] > values["high"] else []

    def select(self, batch, score, step_id):
        v = score.values
        return Selection((v >= self.low) & (v <= self.high))


class ToyExplode(Selector):
    def select(self, batch, score, step_id):
        raise RuntimeError("kaboom")


class ToyScale(Reweighter):
    params = {"factor": Param(float, 2.0, low=0.0)}

    def reweight(self, batch, score, step_id):
        return Reweighting(torch.full((len(batch),), self.factor))


class ToyUniformMixer(Mixer):
    def update(self, batch, score, step_id):
        self.seen = getattr(self, "seen", 0) + 1
        return {"seen": self.seen}

    def probabilities(self):
        return torch.full((len(self.domains),), 1.0 / len(self.domains))


TOYS = {
    ("scorer", "toy_reward"): ToyReward,
    ("scorer", "toy_group_rate"): ToyGroupRate,
    ("scorer", "toy_token_prob"): ToyTokenProb,
    ("scorer", "toy_needs_adv"): ToyNeedsAdvantage,
    ("selector", "toy_band"): ToyBand,
    ("selector", "toy_explode"): ToyExplode,
    ("reweighter", "toy_scale"): ToyScale,
    ("mixer", "toy_mixer"): ToyUniformMixer,
}


def register_toys() -> None:
    for (kind, name), cls in TOYS.items():
        register_local(kind, name, cls)


def unregister_toys() -> None:
    for kind, name in TOYS:
        unregister_local(kind, name)


def toy_batch(rewards=(1, 0, 1, 1, 0, 0, 1, 0), uid="aabbccdd", padding=None, T=4, domains=None):
    B = len(rewards)
    rm = torch.zeros(B, T)
    rm[:, -1] = torch.tensor(rewards, dtype=torch.float32)
    from dataflex_bus import Batch

    return Batch.from_tensors(
        uid=list(uid), domains=domains, is_padding=padding,
        rm_scores=rm, response_mask=torch.ones(B, T), loss_mask=torch.ones(B, T),
        old_log_probs=torch.full((B, T), -0.5), advantages=torch.zeros(B, T))
