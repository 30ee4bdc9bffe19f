"""Mechanism ``replay``: rollouts, once generated, train more than one update.

A replayer's method acts at ``on_advantage``, where it decides which of the step's fresh rows enter the run's
buffer and with what priority (its scorer's value); the host kit keeps the buffer
(:mod:`dataflex_bus.replay`: bounded, tensor-backed, checkpointed) and, at a later step, adds the rows the
replayer picks to the batch *before* the old log-probs are computed, corrected for being off-policy
(:class:`~dataflex_bus.components.ReplaySettings`). A block holds at most one replayer (one buffer), a host
must be able to append rows before its old-log-prob pass (capability ``replay``), and dynamic sampling with
refill is refused beside it: both decide how many prompts a step generates.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from ..components import Actuator, Replayer, Scorer
from ..decision import ReplayDecision
from ..errors import BatchFieldError, ConfigIssue
from .base import Mechanism, MethodRun, MethodSettings, Need

if TYPE_CHECKING:
    from ..batch import Batch
    from ..decision import Decision
    from ..host import HostDescription

#: The field the host kit adds to the ``on_advantage`` batch: the step each row was generated at (fresh
#: rows: the current step).
VERSION_FIELD = "replay_version"


class Replay(Mechanism):
    name: ClassVar[str] = "replay"
    kind: ClassVar[str] = "replayer"
    base: ClassVar[type[Actuator]] = Replayer
    summary: ClassVar[str] = "past rollouts trained again, off-policy corrected (a buffer the bus keeps)"
    per_block: ClassVar[int | None] = 1
    per_block_reason: ClassVar[str] = "one replayer (the bus keeps one buffer of past rollouts per run)"
    refill_compatible: ClassVar[bool] = False

    def event(self, scorer: type[Scorer], actuator: type[Actuator]) -> str:
        return "on_advantage"

    def events(self, actuator: type[Actuator]) -> dict[str, str]:
        return {"on_advantage": "stores the step's fresh rows; stored rows join a later step before its old "
                                "log-probs"}

    def needs(self, method: MethodSettings, scorer: type[Scorer], actuator: type[Actuator]) -> dict[str, Need]:
        return {"replay": Need(f"mechanism {self.name!r} adds stored rows to a step before its old log-probs")}

    def check(self, method: MethodSettings, scorer: type[Scorer], actuator: type[Actuator], host: HostDescription,
              key: str) -> list[ConfigIssue]:
        issues = []
        if scorer.timing == "post_update":
            issues.append(ConfigIssue(f"{key}.scorer.name", f"scorer {method.scorer.name!r} runs post_update, after "
                                      "the step's rows are stored (on_advantage)"))
        if scorer.granularity not in ("prompt", "response"):
            issues.append(ConfigIssue(f"{key}.scorer.name", f"a replay priority is one value per stored row; scorer "
                                      f"{method.scorer.name!r} gives {scorer.granularity}-level scores",
                                      ["prompt", "response"]))
        return issues

    def apply(self, run: MethodRun, batch: Batch, step: int, decision: Decision) -> None:
        import torch

        view, score, dropped = run.score(batch, step, decision.metrics)
        replayer = run.actuator
        assert isinstance(replayer, Replayer)
        store = run.call("actuator", replayer.store, view, score, step)
        if not isinstance(store, torch.Tensor) or tuple(store.shape) != (len(view),):
            raise BatchFieldError(replayer.who, "store", f"expected a bool tensor of shape ({len(view)},)")
        if not view.has(VERSION_FIELD):
            raise BatchFieldError("dataflex replay", VERSION_FIELD, "the host kit adds it to the on_advantage "
                                  "batch (Step.advantage); a batch without it never went through the kit")
        # Only rows generated this step are stored: a replayed row is in the buffer already.
        fresh = view[VERSION_FIELD] == step
        store = store.to(torch.bool) & view.valid_rows & fresh
        if dropped is not None:
            # A row whose priority is NaN/inf is neither stored nor trained (as under every mechanism).
            decision.drop(dropped, on_empty=run.config.on_empty, nonfinite=True)
        priority = score.values.to(torch.float32)
        decision.replay = ReplayDecision(store=store, priority=torch.where(store, priority, 0.0))
        decision.metrics[f"{run.prefix}replay/marked_rows"] = float(store.sum())
