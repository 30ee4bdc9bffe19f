"""One configured method: a scorer times an actuator under one mechanism, acting at one bus event.

:meth:`Method.apply` scores a :class:`~dataflex_bus.Batch`, runs the actuator and folds the result into a
:class:`~dataflex_bus.decision.Decision` (rows dropped, advantages recomputed, weights multiplied, domain
probabilities published), applying the method's policies: warmup, ``on_empty`` for empty selections and
``on_nonfinite`` for NaN/inf scores. Every failure inside a component names its plugin.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from .block import MethodConfig
from .bus import BatchWatch, guarded_call
from .components import Mixer, Reweighter, Score, Scorer, Selector, as_score
from .decision import Decision, check_probabilities
from .errors import BatchFieldError, ConfigError, ConfigIssue, DataflexError
from .ops import segment_max, segment_min
from .weights import expand_weights

if TYPE_CHECKING:
    from torch import Tensor

    from .batch import Batch
    from .components import Component

log = logging.getLogger("dataflex_bus")
T = TypeVar("T")


class Method:
    """A built method. ``event`` is where it acts; ``prefix`` namespaces its metrics (``dataflex/`` alone,
    ``dataflex/<name>/`` in a stack of several)."""

    def __init__(self, config: MethodConfig, scorer: Scorer, actuator: Component, *, event: str,
                 provenance: Mapping[str, str] | None = None, domains: Sequence[str] | None = None,
                 prefix: str = "dataflex/", refill: bool = False) -> None:
        self.config = config
        self.scorer = scorer
        self.actuator = actuator
        self.event = event
        self.provenance = dict(provenance or {})
        self.prefix = prefix
        #: The host refills what this method drops (dataflex.refill): an empty round is refilled, not skipped.
        self.refill = refill and event == "on_rollout"
        self.configured_domains = list(domains) if domains else None
        self.domain_probs: dict[str, float] | None = None
        self.counters = {"empty_selections": 0, "nonfinite_rows": 0}
        #: Whether the domains were checked against the data: by a host (set_domains) or the first batch.
        self.domains_checked = False
        if isinstance(actuator, Mixer) and self.configured_domains:
            self.set_domains(self.configured_domains)
            self.domains_checked = False

    @property
    def name(self) -> str:
        return self.config.name

    # -------------------------------------------------------------- mix support
    def set_domains(self, domains: Sequence[str]) -> None:
        """Tell a mixer the dataset's domain names (in the sampler's order); starts uniform."""
        if not isinstance(self.actuator, Mixer):
            return
        if self.configured_domains and list(domains) != self.configured_domains:
            missing = sorted(set(self.configured_domains) - set(domains))
            if missing:
                raise ConfigError(ConfigIssue("dataflex.domains", f"domains {missing} are not in the dataset",
                                              list(domains)))
            domains = self.configured_domains
        self.actuator.set_domains(list(domains))
        self.domain_probs = {d: 1.0 / len(domains) for d in domains}
        self.domains_checked = True

    # -------------------------------------------------------------- the method
    def apply(self, batch: Batch, step: int, decision: Decision) -> None:
        """Run scorer and actuator on ``batch`` and fold the result into ``decision``."""
        mech = self.config.mechanism
        warm = step < self.config.warmup_step
        decision.metrics[f"{self.prefix}warmup"] = float(warm)
        if mech == "mix":
            self._apply_mix(batch, step, decision)
            return
        if warm:
            return
        view, score, dropped = self._score(batch, step, decision.metrics)
        if mech == "select":
            assert isinstance(self.actuator, Selector)
            self._apply_select(batch, view, score, dropped, step, decision)
        else:
            assert isinstance(self.actuator, Reweighter)
            self._apply_reweight(batch, view, score, dropped, step, decision)

    def _call(self, who: str, fn: Callable[..., T], *args: Any) -> T:
        """Call a component method; any failure (``SystemExit`` included) or write to the batch it was
        given names the component's plugin and the event."""
        component = self.scorer if who == "scorer" else self.actuator
        plugin = self.provenance.get(who, component.name)
        return guarded_call(fn, args, plugin, self.event, BatchWatch(args[0]) if args else None)

    def _score(self, batch: Batch, step: int, metrics: dict[str, float]) -> tuple[Batch, Score, Tensor | None]:
        """The score, and the rows ``on_nonfinite=drop`` dropped (``None``: none). The batch returned has
        those rows marked as padding, so no statistic, group or normalisation counts them."""
        batch.require(self.scorer.who, self.scorer.requires)
        batch.require(self.actuator.who, self.actuator.requires)
        score = self._call("scorer", self._scored, batch, step)
        values = score.values
        bad = batch.nonfinite_rows(values) if values.dim() >= 1 and values.shape[0] == len(batch) else None
        if bad is None:
            self._score_metrics(score, metrics)
            return batch, score, None
        if self.config.on_nonfinite == "error":
            rows = torch.nonzero(bad).flatten()[:5].tolist()
            raise BatchFieldError(self.scorer.who, "score", f"non-finite score (NaN/inf) on rows {rows}; "
                                  "fix the input or set dataflex.on_nonfinite=drop")
        count = int(bad.sum())
        self.counters["nonfinite_rows"] += count
        metrics[f"{self.prefix}nonfinite_rows"] = float(count)
        view = batch.derive(is_padding=batch.is_padding | bad)
        score = self._call("scorer", self._scored, view, step)
        self._score_metrics(score, metrics)
        return view, score, bad

    def _scored(self, batch: Batch, step: int) -> Score:
        """The scorer's output as a :class:`Score` (plain tensors accepted, shape and dtype checked)."""
        return as_score(self.scorer.score(batch, step), self.scorer, batch)

    def _score_metrics(self, score: Score, metrics: dict[str, float]) -> None:
        for k, v in score.metrics.items():
            metrics[f"{self.prefix}{k}"] = float(v)

    def _apply_select(self, batch: Batch, view: Batch, score: Score, dropped: Tensor | None, step: int,
                      decision: Decision) -> None:
        actuator = self.actuator
        assert isinstance(actuator, Selector)
        sel = self._call("actuator", actuator.select, view, score, step)
        keep = sel.keep.to(torch.bool)
        if keep.shape != (len(view),):
            raise BatchFieldError(actuator.who, "keep", f"expected shape ({len(view)},), got {tuple(keep.shape)}")
        keep = keep & view.valid_rows
        metrics = decision.metrics
        p = self.prefix
        real = int(view.valid_rows.sum())
        kept = int(keep.sum())
        metrics[f"{p}kept_fraction"] = kept / real if real else 0.0
        metrics[f"{p}kept_rows"] = float(kept)
        metrics[f"{p}kept_tokens"] = float(view.lengths[keep].sum()) if "response_mask" in view.fields else 0.0
        metrics[f"{p}kept_groups"] = float(torch.unique(view.group_index[keep]).numel())
        for k, v in sel.metrics.items():
            metrics[f"{p}{k}"] = float(v)
        if self.event == "on_prompts" or self.refill:
            # Skipping every candidate of one draw (or every group of one refill round) is not an empty
            # selection: the host draws more; on_empty (max_oversample spent) or on_exhaust (rounds spent)
            # decides later (decision.PromptFill, decision.GroupFill).
            if dropped is not None:
                decision.drop(dropped)
            if self.refill:
                self._check_whole_groups(view, keep)
            decision.restrict(keep)
            return
        if self._empty(batch, keep, step, decision, dropped):
            return
        if self.event == "on_rollout":
            self._check_whole_groups(view, keep)
        decision.restrict(keep, on_empty=self.config.on_empty)
        if sel.advantages is not None:
            view.check_finite(actuator.who, "advantages", sel.advantages)
            decision.advantages = sel.advantages

    def _empty(self, batch: Batch, keep: Tensor, step: int, decision: Decision, dropped: Tensor | None) -> bool:
        """Apply ``on_empty`` when no real row of ``batch`` survives this method (non-finite drops
        included); returns True when the method's own selection is then not applied."""
        metrics = decision.metrics
        if bool(keep.any()) or not bool(batch.valid_rows.any()):
            metrics[f"{self.prefix}empty_selection"] = 0.0
            if dropped is not None:
                decision.drop(dropped, on_empty=self.config.on_empty, nonfinite=True)
            return False
        self.counters["empty_selections"] += 1
        metrics[f"{self.prefix}empty_selection"] = 1.0
        policy = self.config.on_empty
        who = self.actuator.name
        if policy == "error":
            raise DataflexError(f"{self.actuator.who} kept no row at step {step} (dataflex.on_empty=error)")
        finite = None if dropped is None else batch.valid_rows & ~dropped
        keep_all = policy == "keep_all" and (finite is None or bool(finite.any()))
        n = self.counters["empty_selections"]
        # Warn on the 1st, 2nd, 4th, 8th ... empty step: visible, counted, but no log flood.
        if n & (n - 1) == 0:
            action = "keeping all rows" if keep_all else "skipping this step's update"
            log.warning("dataflex: %s kept no row at step %d; %s (on_empty=%s; %d empty step(s) so far, "
                        "counted in %sempty_selection)", who, step, action, policy, n, self.prefix)
        if keep_all:
            if dropped is not None:  # keep all rows, but never the non-finite ones
                decision.drop(dropped, on_empty=self.config.on_empty, nonfinite=True)
            return True
        decision.skip_update = True
        decision.restrict(torch.zeros(len(batch), dtype=torch.bool))
        return True

    def _check_whole_groups(self, batch: Batch, keep: Tensor) -> None:
        """At ``on_rollout`` a selector must keep or drop whole groups (it promised to)."""
        k = keep.to(torch.float32)
        gi, n = batch.group_index, batch.num_groups
        split = segment_max(k, gi, n) != segment_min(k, gi, n)
        if bool(split.any()):
            raise BatchFieldError(self.actuator.who, "keep",
                                  f"split {int(split.sum())} group(s) at on_rollout although it declares "
                                  "keeps_whole_groups; dropping part of a group before the advantage would "
                                  "change the GRPO baseline of the rest")

    def _apply_reweight(self, batch: Batch, view: Batch, score: Score, dropped: Tensor | None, step: int,
                        decision: Decision) -> None:
        actuator = self.actuator
        assert isinstance(actuator, Reweighter)
        out = self._call("actuator", actuator.reweight, view, score, step)
        w, stats = expand_weights(out.weights, view, actuator.who)
        metrics = decision.metrics
        if stats is not None:
            metrics.update(stats.metrics(self.prefix))
        for k, v in out.metrics.items():
            metrics[f"{self.prefix}{k}"] = float(v)
        if dropped is not None:
            # Rows with a non-finite score are dropped, not trained at a neutral weight.
            keep = batch.valid_rows & ~dropped
            if self._empty(batch, keep, step, decision, dropped):
                return
        decision.scale(w)

    def _apply_mix(self, batch: Batch, step: int, decision: Decision) -> None:
        mixer = self.actuator
        assert isinstance(mixer, Mixer)
        if self.domain_probs is None:
            self.set_domains(self.configured_domains or batch.domain_names)
        if not self.domains_checked:
            self._check_domains_in(batch)
        batch = batch.with_domain_names(mixer.domains)
        metrics = decision.metrics
        if (step + 1) % self.config.update_step == 0:
            view, score, _ = self._score(batch, step, metrics)
            for k, v in self._call("actuator", mixer.update, view, score, step).items():
                metrics[f"{self.prefix}{k}"] = float(v)
            if step + 1 >= self.config.warmup_step:
                probs = self._call("actuator", _checked_probabilities, mixer)
                self.domain_probs = {d: float(p) for d, p in zip(mixer.domains, probs.tolist())}
        decision.domain_probs = dict(self.domain_probs or {})
        for d, p in decision.domain_probs.items():
            metrics[f"{self.prefix}domain_prob/{d}"] = p

    def _check_domains_in(self, batch: Batch) -> None:
        """Without a host that told the pipeline its domains, check the configured ones against the first
        batch: a mixer favours a domain it never sees (no statistics, the largest exploration bonus)."""
        self.domains_checked = True
        unseen = [d for d in self.actuator.domains if d not in batch.domain_names]  # type: ignore[attr-defined]
        if unseen:
            log.warning("dataflex: dataflex.domains %s do not occur in the first batch (its domains: %s); %s would "
                        "give a domain it never sees most of the sampling probability. Remove it from "
                        "dataflex.domains if the data has none (a host states its domains with "
                        "Runtime.set_domains)", unseen, ", ".join(batch.domain_names) or "none",
                        self.actuator.name)

    # -------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        return {
            "scorer": self.scorer.state_dict(),
            "actuator": self.actuator.state_dict(),
            "domain_probs": self.domain_probs,
            "domains": getattr(self.actuator, "domains", None),
            "counters": dict(self.counters),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("domains") is not None and isinstance(self.actuator, Mixer):
            self.actuator.set_domains(state["domains"])
        self.scorer.load_state_dict(state.get("scorer") or {})
        self.actuator.load_state_dict(state.get("actuator") or {})
        self.domain_probs = state.get("domain_probs")
        self.counters.update(state.get("counters") or {})


def _checked_probabilities(mixer: Mixer) -> Tensor:
    """The mixer's probabilities, checked where they are published (a NaN names the mixer's plugin)."""
    probs = mixer.probabilities()
    check_probabilities(probs, mixer.domains, mixer.who)
    return probs
