"""Built-in mixers (mechanism ``mix``): sampling probabilities over domains for the *next* prompts.

The host calls ``set_domains`` once, ``update`` with each finished step's batch and score, and
``probabilities`` when it draws prompts. Per-domain statistics are kept as tensors and updated with
segment operations; padding rows (``domain_index == -1``) never count. Every mixer's state round-trips
through ``state_dict``/``load_state_dict`` (plain tensors and lists, safe for ``torch.save``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor

from dataflex_bus.batch import Batch
from dataflex_bus.components import Mixer, Param, Score
from dataflex_bus.errors import BatchFieldError, ConfigError, ConfigIssue
from dataflex_bus.ops import segment_count, segment_sum

from ._checks import check_row_values


def _domain_rows(mixer: Mixer, batch: Batch, score: Score) -> tuple[Tensor, Tensor]:
    """``(domain id, value)`` of every real row with a domain, ids in ``mixer.domains`` order."""
    who = mixer.who
    if not hasattr(mixer, "domains"):
        raise RuntimeError(f"{who}: set_domains() must be called before update()")
    batch = batch.with_domain_names(mixer.domains)
    d = batch.domain_index
    if bool(batch.valid_rows.any()) and bool((d[batch.valid_rows] < 0).all()):
        raise BatchFieldError(who, "data_source", "no real row carries a domain label; the mixer would learn "
                              "nothing (check dataflex.domain_key)")
    check_row_values(who, "score", score.values, batch)
    rows = torch.nonzero(d >= 0).flatten()
    return d[rows], score.values[rows].to(torch.float64)


def _state_tensor(state: Mapping[str, Any], key: str, like: Tensor, who: str) -> Tensor:
    value = torch.as_tensor(state[key], dtype=like.dtype).clone()
    if value.shape != like.shape:
        raise ValueError(f"{who}: state {key!r} has shape {tuple(value.shape)}, expected {tuple(like.shape)}")
    return value


def _check_domains(state: Mapping[str, Any], domains: list[str], who: str) -> None:
    saved = list(state.get("domains") or [])
    if saved != domains:
        raise ValueError(f"{who}: state was saved for domains {saved}, mixer has {domains}")


class DumpUCB(Mixer):
    """DUMP (arXiv 2504.09710): UCB over the windowed mean |advantage| per domain, then softmax.

    Each step, every real row contributes ``|s_i|`` to its domain's FIFO of the last ``window`` values
    (a ``[D, window]`` ring buffer); ``n_d`` counts all values ever seen. With
    ``mu_d = mean(window_d)`` (0 for a domain never seen), ``N = max(1, sum_d n_d)``:
    ``UCB_d = mu_d + c * sqrt(2 ln(N + 1) / (n_d + 1))`` and ``p = softmax(UCB / temperature)``.
    Feed it ``advantage_magnitude(agg=mean)``: under GRPO the advantage is constant over a rollout's
    tokens, so that score equals DUMP's ``|mean_t A[i, t]|``. Starts uniform.
    """

    requires: ClassVar = ("data_source",)
    accepts: ClassVar = ("prompt", "response")
    intended_scorers: ClassVar = ("advantage_magnitude",)
    params: ClassVar = {
        "c": Param(float, 1.0, low=0.0, doc="exploration coefficient"),
        "window": Param(int, 300, low=1, doc="FIFO length per domain"),
        "temperature": Param(float, 0.1, low=0.0, low_open=True, doc="softmax temperature"),
    }
    c: float
    window: int
    temperature: float

    def set_domains(self, domains: Sequence[str]) -> None:
        super().set_domains(domains)
        k = len(self.domains)
        self.buffer = torch.zeros(k, self.window, dtype=torch.float64)
        self.fill = torch.zeros(k, dtype=torch.long)
        self.ptr = torch.zeros(k, dtype=torch.long)
        self.counts = torch.zeros(k, dtype=torch.long)

    def update(self, batch: Batch, score: Score, step: int) -> dict[str, float]:
        d, v = _domain_rows(self, batch, score)
        k, w = len(self.domains), self.window
        v = v.abs()
        # Stable sort by domain keeps arrival (row) order inside a domain: FIFO order.
        order = torch.sort(d, stable=True).indices
        d, v = d[order], v[order]
        c = torch.bincount(d, minlength=k)
        j = torch.arange(d.shape[0]) - (torch.cumsum(c, 0) - c)[d]
        # Only a domain's last `window` values of this step can survive; their slots are distinct.
        last = j >= (c[d] - w)
        slot = (self.ptr[d] + j) % w
        self.buffer[d[last], slot[last]] = v[last]
        self.ptr = (self.ptr + c) % w
        self.fill = torch.clamp(self.fill + c, max=w)
        self.counts = self.counts + c
        mu, ucb = self._ucb()
        metrics: dict[str, float] = {}
        for name, m, u, n, b in zip(self.domains, mu.tolist(), ucb.tolist(), self.counts.tolist(), c.tolist()):
            metrics[f"domain/{name}/mu"] = m
            metrics[f"domain/{name}/ucb"] = u
            metrics[f"domain/{name}/n"] = float(n)
            metrics[f"domain/{name}/batch_rows"] = float(b)
        return metrics

    def _ucb(self) -> tuple[Tensor, Tensor]:
        mu = self.buffer.sum(1) / self.fill.clamp_min(1).to(torch.float64)
        total = max(1, int(self.counts.sum()))
        bonus = self.c * torch.sqrt(2.0 * math.log(total + 1) / (self.counts.to(torch.float64) + 1.0))
        return mu, mu + bonus

    def probabilities(self) -> Tensor:
        _, ucb = self._ucb()
        return torch.softmax(ucb / self.temperature, 0)

    def state_dict(self) -> dict[str, Any]:
        return {"domains": list(self.domains), "buffer": self.buffer.clone(), "fill": self.fill.clone(),
                "ptr": self.ptr.clone(), "counts": self.counts.clone()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        who = self.who
        _check_domains(state, self.domains, who)
        self.buffer = _state_tensor(state, "buffer", self.buffer, who)
        self.fill = _state_tensor(state, "fill", self.fill, who)
        self.ptr = _state_tensor(state, "ptr", self.ptr, who)
        self.counts = _state_tensor(state, "counts", self.counts, who)


class RewardGap(Mixer):
    """Favour domains whose mean score lags the best one, with a guaranteed floor.

    ``rbar_d`` is the mean score (e.g. ``reward_difficulty``) of domain ``d``'s rows in the latest update
    that contained it, smoothed as ``rbar <- momentum * rbar + (1 - momentum) * mean`` (``momentum=0``:
    the last update only; the first observation is taken as is). A domain never seen takes the lowest
    seen ``rbar`` (it is explored like the hardest known domain). Then
    ``q = softmax((max_e rbar_e - rbar_d) / temperature)`` and ``p = floor + (1 - K * floor) * q``, so every
    domain keeps at least ``floor``; ``K * floor < 1`` is checked at ``set_domains``. Starts uniform.
    """

    requires: ClassVar = ("data_source",)
    accepts: ClassVar = ("prompt", "response")
    params: ClassVar = {
        "temperature": Param(float, 0.1, low=0.0, low_open=True, doc="softmax temperature over reward gaps"),
        "floor": Param(float, 0.0, low=0.0, high=1.0, high_open=True, doc="minimum probability per domain"),
        "momentum": Param(float, 0.0, low=0.0, high=1.0, high_open=True, doc="EMA factor of rbar"),
    }
    temperature: float
    floor: float
    momentum: float

    def set_domains(self, domains: Sequence[str]) -> None:
        k = len(domains)
        if k == 0 or self.floor * k >= 1.0:
            raise ConfigError(ConfigIssue(
                "dataflex.actuator.params.floor",
                f"floor={self.floor!r} times {k} domains must be < 1 (allowed: floor < {1.0 / max(k, 1):g})"))
        super().set_domains(domains)
        self.rbar = torch.zeros(k, dtype=torch.float64)
        self.seen = torch.zeros(k, dtype=torch.bool)

    def update(self, batch: Batch, score: Score, step: int) -> dict[str, float]:
        d, v = _domain_rows(self, batch, score)
        k = len(self.domains)
        n = segment_count(d, k)
        present = n > 0
        mean = segment_sum(v, d, k) / n.clamp_min(1).to(torch.float64)
        blended = torch.where(self.seen, self.momentum * self.rbar + (1.0 - self.momentum) * mean, mean)
        self.rbar = torch.where(present, blended, self.rbar)
        self.seen = self.seen | present
        metrics: dict[str, float] = {}
        for name, r, s, b in zip(self.domains, self.rbar.tolist(), self.seen.tolist(), n.tolist()):
            if s:
                metrics[f"domain/{name}/rbar"] = r
            metrics[f"domain/{name}/batch_rows"] = float(b)
        return metrics

    def probabilities(self) -> Tensor:
        k = len(self.domains)
        if not bool(self.seen.any()):
            return torch.full((k,), 1.0 / k, dtype=torch.float64)
        lowest = self.rbar[self.seen].min()
        rbar = torch.where(self.seen, self.rbar, lowest)
        q = torch.softmax((rbar.max() - rbar) / self.temperature, 0)
        return self.floor + (1.0 - k * self.floor) * q

    def state_dict(self) -> dict[str, Any]:
        return {"domains": list(self.domains), "rbar": self.rbar.clone(), "seen": self.seen.clone()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        who = self.who
        _check_domains(state, self.domains, who)
        self.rbar = _state_tensor(state, "rbar", self.rbar, who)
        self.seen = _state_tensor(state, "seen", self.seen, who)


class Static(Mixer):
    """Fixed proportions, normalised to sum 1: the baseline every adaptive mixer is compared with.

    ``proportions`` is a mapping ``domain -> weight`` (it must name exactly the dataset's domains) or a
    list of weights in the order of the domains. Weights are finite, non-negative, not all zero.
    """

    params: ClassVar = {
        # The example names the shim's default domains (`dataflex run` with no data section).
        "proportions": Param((dict, list), doc="domain -> weight, or weights in domain order",
                             example={"copy": 1.0, "sort": 1.0, "reverse": 1.0, "random": 1.0}),
    }
    proportions: dict | list

    @classmethod
    def check_params(cls, values: Mapping[str, Any]) -> list[tuple[str, str]]:
        props = values["proportions"]
        items = list(props.items()) if isinstance(props, dict) else list(enumerate(props))
        issues: list[tuple[str, str]] = []
        for key, weight in items:
            ok = (isinstance(weight, (int, float)) and not isinstance(weight, bool)
                  and math.isfinite(weight) and weight >= 0)
            if not ok:
                issues.append(("proportions", f"weight of {key!r} must be a finite number >= 0, got {weight!r}"))
        if not issues and (not items or sum(float(w) for _, w in items) <= 0):
            issues.append(("proportions", "needs at least one positive weight"))
        return issues

    def set_domains(self, domains: Sequence[str]) -> None:
        domains = list(domains)
        props = self.proportions
        key = "dataflex.actuator.params.proportions"
        if isinstance(props, dict):
            missing = [d for d in domains if d not in props]
            extra = [d for d in props if d not in domains]
            if missing:
                raise ConfigError(ConfigIssue(key, f"no proportion for domain(s) {missing}", domains))
            if extra:
                raise ConfigError(ConfigIssue(key, f"proportions name unknown domain(s) {extra}", domains))
            raw = [float(props[d]) for d in domains]
        else:
            if len(props) != len(domains):
                raise ConfigError(ConfigIssue(
                    key, f"{len(props)} proportions for {len(domains)} domains {domains}"))
            raw = [float(w) for w in props]
        weights = torch.tensor(raw, dtype=torch.float64)
        if float(weights.sum()) <= 0:
            raise ConfigError(ConfigIssue(key, f"the proportions of domains {domains} are all zero"))
        super().set_domains(domains)
        self._probs = weights / weights.sum()

    def update(self, batch: Batch, score: Score, step: int) -> dict[str, float]:
        return {}

    def probabilities(self) -> Tensor:
        return self._probs.clone()
