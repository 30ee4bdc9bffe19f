"""One configured method: a scorer times an actuator under one mechanism, acting at one bus event.

:meth:`Method.apply` runs the method's mechanism (:mod:`dataflex_bus.mechanisms`), which scores a
:class:`~dataflex_bus.Batch`, runs the actuator and folds the result into a
:class:`~dataflex_bus.decision.Decision`; the method provides what every mechanism shares: warmup, the
scorer's checked output with ``on_nonfinite`` for NaN/inf scores, ``on_empty`` for empty selections, and
the guard that names a component's plugin in every failure.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from .block import MethodConfig
from .bus import BatchWatch, guarded_call
from .components import Actuator, Score, Scorer, as_score, reads
from .errors import BatchFieldError, DataflexError
from .mechanisms import mechanism
from .mechanisms.mix import Mixer

if TYPE_CHECKING:
    from torch import Tensor

    from .batch import Batch
    from .decision import Decision

log = logging.getLogger("dataflex_bus")
T = TypeVar("T")


class Method:
    """A built method. ``event`` is where it acts; ``prefix`` namespaces its metrics (``dataflex/`` alone,
    ``dataflex/<name>/`` in a stack of several)."""

    def __init__(self, config: MethodConfig, scorer: Scorer, actuator: Actuator, *, event: str,
                 provenance: Mapping[str, str] | None = None, domains: Sequence[str] | None = None,
                 prefix: str = "dataflex/", refill: bool = False) -> None:
        self.config = config
        self.mechanism = mechanism(config.mechanism)
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
        if self.mechanism.samples_domains and self.configured_domains:
            self.set_domains(self.configured_domains)
            self.domains_checked = False

    @property
    def name(self) -> str:
        return self.config.name

    # -------------------------------------------------------------- domains (mechanisms that sample them)
    def set_domains(self, domains: Sequence[str]) -> None:
        """Tell the method the dataset's domain names, in the sampler's order (a mixer starts uniform)."""
        self.mechanism.set_domains(self, domains)

    # -------------------------------------------------------------- the method
    def apply(self, batch: Batch, step: int, decision: Decision) -> None:
        """Run scorer and actuator on ``batch`` and fold the result into ``decision`` (the mechanism's rule)."""
        warm = step < self.config.warmup_step
        decision.metrics[f"{self.prefix}warmup"] = float(warm)
        if warm and not self.mechanism.during_warmup:
            return
        self.mechanism.apply(self, batch, step, decision)

    def call(self, who: str, fn: Callable[..., T], *args: Any) -> T:
        """Call a component method; any failure (``SystemExit`` included) or write to the batch it was
        given names the component's plugin and the event."""
        component = self.scorer if who == "scorer" else self.actuator
        plugin = self.provenance.get(who, component.name)
        watch = BatchWatch.for_component(args[0], reads(component)) if args else None
        return guarded_call(fn, args, plugin, self.event, watch)

    def score(self, batch: Batch, step: int, metrics: dict[str, float]) -> tuple[Batch, Score, Tensor | None]:
        """The score, and the rows ``on_nonfinite=drop`` dropped (``None``: none). The batch returned has
        those rows marked as padding, so no statistic, group or normalisation counts them."""
        batch.require(self.scorer.who, reads(self.scorer))
        batch.require(self.actuator.who, reads(self.actuator))
        score = self.call("scorer", self._scored, batch, step)
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
        score = self.call("scorer", self._scored, view, step)
        self._score_metrics(score, metrics)
        return view, score, bad

    def _scored(self, batch: Batch, step: int) -> Score:
        """The scorer's output as a :class:`Score` (plain tensors accepted, shape and dtype checked)."""
        return as_score(self.scorer.score(batch, step), self.scorer, batch)

    def _score_metrics(self, score: Score, metrics: dict[str, float]) -> None:
        for k, v in score.metrics.items():
            metrics[f"{self.prefix}{k}"] = float(v)

    def empty(self, batch: Batch, keep: Tensor, step: int, decision: Decision, dropped: Tensor | None) -> bool:
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

