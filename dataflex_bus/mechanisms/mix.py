"""Mechanism ``mix``: sampling probabilities over domains for the *next* prompts.

A mixer folds each step's statistics in at ``on_step_end`` (also during warm-up) and, every
``update_step`` steps from ``warmup_step`` on, publishes probabilities over the host's domains; the host
draws the next prompts by them. A block holds at most one mixer: the sampler draws from one distribution.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar

from ..components import Actuator, Scorer
from ..errors import BatchFieldError, ConfigError, ConfigIssue
from .base import Mechanism, MethodRun, MethodSettings, Need

if TYPE_CHECKING:
    from torch import Tensor

    from ..batch import Batch
    from ..components import Score
    from ..decision import Decision

log = logging.getLogger("dataflex_bus")


class Mixer(Actuator):
    """Mechanism ``mix``: sampling probabilities over domains for the *next* prompts.

    The host calls :meth:`set_domains` once with the dataset's domain names, :meth:`update` at the end
    of each step with that step's batch and score, and :meth:`probabilities` when it draws prompts.
    """

    kind: ClassVar[str] = "mixer"
    accepts: ClassVar[Sequence[str]] = ("prompt", "response", "domain")

    domains: list[str]

    def set_domains(self, domains: Sequence[str]) -> None:
        self.domains = list(domains)

    def update(self, batch: Batch, score: Score, step: int) -> dict[str, float]:
        """Fold this step's statistics in; returns metrics."""
        raise NotImplementedError(f"{type(self).__name__}.update")

    def probabilities(self) -> Tensor:
        """Float ``[D]`` summing to 1, aligned with ``self.domains``."""
        raise NotImplementedError(f"{type(self).__name__}.probabilities")


class Mix(Mechanism):
    name: ClassVar[str] = "mix"
    kind: ClassVar[str] = "mixer"
    base: ClassVar[type[Actuator]] = Mixer
    summary: ClassVar[str] = "which domain the next prompts are drawn from"
    per_block: ClassVar[int | None] = 1
    per_block_reason: ClassVar[str] = ("one mixer (the sampler draws the next prompts from one set of domain "
                                       "probabilities)")
    during_warmup: ClassVar[bool] = True
    samples_domains: ClassVar[bool] = True

    def event(self, scorer: type[Scorer], actuator: type[Actuator]) -> str:
        return "on_step_end"

    def events(self, actuator: type[Actuator]) -> dict[str, str]:
        return {"on_step_end": "statistics updated after each step; probabilities used for the next prompts"}

    def needs(self, method: MethodSettings, scorer: type[Scorer], actuator: type[Actuator]) -> dict[str, Need]:
        return {"domain_sampling": Need(f"mechanism {self.name!r} draws the next prompts by the domain "
                                        "probabilities its mixer publishes")}

    def check_domains(self, actuator: Actuator, domains: Sequence[str]) -> list[ConfigIssue]:
        """Rules that join a mixer's parameters and the configured domains (a floor times K, proportions
        naming every domain) are checked by the mixer's own ``set_domains``: here, before training."""
        assert isinstance(actuator, Mixer)
        try:
            actuator.set_domains(list(domains))
        except ConfigError as exc:
            return list(exc.issues)
        return []

    def set_domains(self, run: MethodRun, domains: Sequence[str]) -> None:
        """Tell the mixer the dataset's domain names (in the sampler's order); it starts uniform."""
        mixer = run.actuator
        assert isinstance(mixer, Mixer)
        configured = run.configured_domains
        if configured and list(domains) != configured:
            missing = sorted(set(configured) - set(domains))
            if missing:
                raise ConfigError(ConfigIssue("dataflex.domains", f"domains {missing} are not in the dataset",
                                              list(domains)))
            domains = configured
        mixer.set_domains(list(domains))
        run.domain_probs = {d: 1.0 / len(domains) for d in domains}
        run.domains_checked = True

    def apply(self, run: MethodRun, batch: Batch, step: int, decision: Decision) -> None:
        mixer = run.actuator
        assert isinstance(mixer, Mixer)
        if run.domain_probs is None:
            self.set_domains(run, run.configured_domains or batch.domain_names)
        if not run.domains_checked:
            _check_domains_in(run, batch)
        batch = batch.with_domain_names(mixer.domains)
        metrics = decision.metrics
        if (step + 1) % run.config.update_step == 0:
            view, score, _ = run.score(batch, step, metrics)
            for k, v in run.call("actuator", mixer.update, view, score, step).items():
                metrics[f"{run.prefix}{k}"] = float(v)
            if step + 1 >= run.config.warmup_step:
                probs = run.call("actuator", _checked_probabilities, mixer)
                run.domain_probs = {d: float(p) for d, p in zip(mixer.domains, probs.tolist())}
        decision.domain_probs = dict(run.domain_probs or {})
        for d, p in decision.domain_probs.items():
            metrics[f"{run.prefix}domain_prob/{d}"] = p


def check_probabilities(values: Tensor, domains: Sequence[str], who: str) -> None:
    """Raise unless ``values`` are ``len(domains)`` finite, non-negative probabilities with a positive sum
    (checked where a mixer publishes them, so a bad mixer is named at once)."""
    if tuple(values.shape) != (len(domains),):
        raise BatchFieldError(who, "probabilities", f"expected shape ({len(domains)},) for domains {list(domains)}, "
                              f"got {tuple(values.shape)}")
    import torch

    v = values.double()
    if not bool(torch.isfinite(v).all()) or bool((v < 0).any()) or float(v.sum()) <= 0:
        shown = {d: float(x) for d, x in zip(domains, v.tolist())}
        raise BatchFieldError(who, "probabilities",
                              f"must be finite, non-negative and sum to more than 0, got {shown}")


def _checked_probabilities(mixer: Mixer) -> Tensor:
    """The mixer's probabilities, checked where they are published (a NaN names the mixer's plugin)."""
    probs = mixer.probabilities()
    check_probabilities(probs, mixer.domains, mixer.who)
    return probs


def _check_domains_in(run: MethodRun, batch: Batch) -> None:
    """Without a host that told the pipeline its domains, check the configured ones against the first
    batch: a mixer favours a domain it never sees (no statistics, the largest exploration bonus)."""
    run.domains_checked = True
    mixer = run.actuator
    assert isinstance(mixer, Mixer)
    unseen = [d for d in mixer.domains if d not in batch.domain_names]
    if unseen:
        log.warning("dataflex: dataflex.domains %s do not occur in the first batch (its domains: %s); %s would "
                    "give a domain it never sees most of the sampling probability. Remove it from "
                    "dataflex.domains if the data has none (a host states its domains with "
                    "Runtime.set_domains)", unseen, ", ".join(batch.domain_names) or "none", mixer.name)
