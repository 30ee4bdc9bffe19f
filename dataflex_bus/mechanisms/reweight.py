"""Mechanism ``reweight``: per-token loss weights, multiplied into the policy-gradient term.

A reweighter returns non-negative finite weights per row or per token; the weights of several methods
multiply, and the host multiplies them into its own importance weights (``rollout_is_weights``), never
replacing them. A row whose score is non-finite under ``on_nonfinite=drop`` is dropped, not trained at a
neutral weight.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

from ..components import Actuator, Scorer
from ..errors import ConfigIssue
from .base import Mechanism, MethodRun, MethodSettings, Need

if TYPE_CHECKING:
    from torch import Tensor

    from ..batch import Batch
    from ..components import Score
    from ..decision import Decision
    from ..host import HostDescription


@dataclass
class Reweighting:
    """A reweighter's output: non-negative finite weights ``[B]`` or ``[B, T]``, multiplied into the loss."""

    weights: Tensor
    metrics: dict[str, float] = field(default_factory=dict)


class Reweighter(Actuator):
    """Mechanism ``reweight``: per-token loss weights (multiplied into ``rollout_is_weights``)."""

    kind: ClassVar[str] = "reweighter"
    min_timing: ClassVar[str] = "post_advantage"
    accepts: ClassVar[Sequence[str]] = ("prompt", "response", "token")

    def reweight(self, batch: Batch, score: Score, step: int) -> Reweighting:
        raise NotImplementedError(f"{type(self).__name__}.reweight")


class Reweight(Mechanism):
    name: ClassVar[str] = "reweight"
    kind: ClassVar[str] = "reweighter"
    base: ClassVar[type[Actuator]] = Reweighter
    summary: ClassVar[str] = "per-token loss weights (multiplied into rollout_is_weights)"

    def event(self, scorer: type[Scorer], actuator: type[Actuator]) -> str:
        return "on_advantage"

    def events(self, actuator: type[Actuator]) -> dict[str, str]:
        return {"on_advantage": ""}

    def needs(self, method: MethodSettings, scorer: type[Scorer], actuator: type[Actuator]) -> dict[str, Need]:
        return {"loss_weights": Need(f"mechanism {self.name!r} multiplies per-token weights into the loss")}

    def check(self, method: MethodSettings, scorer: type[Scorer], actuator: type[Actuator], host: HostDescription,
              key: str) -> list[ConfigIssue]:
        issues = []
        if scorer.timing == "post_update":
            issues.append(ConfigIssue(f"{key}.scorer.name", f"scorer {method.scorer.name!r} runs post_update, after "
                                      "the loss it would reweight"))
        return issues

    def apply(self, run: MethodRun, batch: Batch, step: int, decision: Decision) -> None:
        from .weights import expand_weights

        view, score, dropped = run.score(batch, step, decision.metrics)
        actuator = run.actuator
        assert isinstance(actuator, Reweighter)
        out = run.call("actuator", actuator.reweight, view, score, step)
        w, stats = expand_weights(out.weights, view, actuator.who)
        metrics = decision.metrics
        if stats is not None:
            metrics.update(stats.metrics(run.prefix))
        for k, v in out.metrics.items():
            metrics[f"{run.prefix}{k}"] = float(v)
        if dropped is not None:
            # Rows with a non-finite score are dropped, not trained at a neutral weight.
            keep = batch.valid_rows & ~dropped
            if run.empty(batch, keep, step, decision, dropped):
                return
        decision.scale(w)
