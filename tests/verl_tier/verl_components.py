"""Small, exactly predictable components for the verl tests, registered in-process.

They keep the verl tests independent of the built-in methods' tuning: each one's effect on verl is
known in closed form (a fixed weight per domain; all probability on the lowest-reward domain).
"""

from __future__ import annotations

import torch

from dataflex_bus import (
    Mixer,
    Param,
    Reweighter,
    Reweighting,
    Score,
    Scorer,
    register_mixer,
    register_reweighter,
    register_scorer,
)
from dataflex_bus.ops import segment_count, segment_sum


@register_scorer("vt_reward")
class RowReward(Scorer):
    """s_i = r_i (outcome reward per response)."""

    requires = ("rm_scores", "response_mask")
    timing = "post_reward"
    granularity = "response"

    def score(self, batch, step_id, **ctx):
        return Score(values=batch.rewards, granularity="response")


@register_scorer("vt_nan_for")
class NanForDomain(Scorer):
    """s_i = r_i, but NaN on every row of ``domain`` (a scorer failing on part of the batch)."""

    requires = ("rm_scores", "response_mask")
    timing = "post_advantage"
    granularity = "response"
    params = {"domain": Param(str)}

    def score(self, batch, step_id, **ctx):
        names = batch.domain_names
        target = names.index(self.domain) if self.domain in names else -2
        values = torch.where(batch.domain_index == target, torch.tensor(float("nan")), batch.rewards)
        return Score(values=values, granularity="response")


@register_reweighter("vt_domain_weight")
class DomainWeight(Reweighter):
    """Weight ``weight`` on every real token of rows from ``domain``, 1 elsewhere."""

    params = {"domain": Param(str), "weight": Param(float, low=0.0)}

    def reweight(self, batch, score, step_id):
        names = batch.domain_names
        target = names.index(self.domain) if self.domain in names else -2
        w = torch.where(batch.domain_index == target, torch.tensor(self.weight), torch.tensor(1.0))
        return Reweighting(weights=w, metrics={"vt_weighted_rows": float((batch.domain_index == target).sum())})


@register_mixer("vt_focus_hard")
class FocusHard(Mixer):
    """p_d = softmax(-mean_reward_d / temperature) over cumulative per-domain reward means."""

    params = {"temperature": Param(float, default=0.05, low=0.0, low_open=True)}

    def set_domains(self, domains):
        super().set_domains(domains)
        self.sums = torch.zeros(len(self.domains), dtype=torch.float64)
        self.counts = torch.zeros(len(self.domains), dtype=torch.long)

    def update(self, batch, score, step_id):
        d = len(self.domains)
        self.sums += segment_sum(score.values.double(), batch.domain_index, d)
        self.counts += segment_count(batch.domain_index, d)
        return {"vt_rows_seen": float(self.counts.sum())}

    def probabilities(self):
        mean = torch.where(self.counts > 0, self.sums / self.counts.clamp(min=1), torch.zeros_like(self.sums))
        return torch.softmax(-mean / self.temperature, dim=0).float()

    def state_dict(self):
        return {"sums": self.sums.clone(), "counts": self.counts.clone()}

    def load_state_dict(self, state):
        self.sums, self.counts = state["sums"].clone(), state["counts"].clone()
