"""What TRL reports of a generation batch whose update the host skipped (an empty selection: the optimizer
step is not taken, the LR schedule and ``global_step`` still advance, as documented).

:class:`SkippedUpdates` is a mixin of :class:`~dataflex_bus.trl.DataflexGRPOTrainer` (before
``GRPOTrainer`` in its bases): TRL logs no ``grad_norm`` for a skipped optimizer step (the norm of a
gradient that was thrown away would read as an update; ``dataflex/skipped_update`` flags the step), and
``train()`` ends with one warning line, naming each selection and what it kept, when most updates were
skipped. It reads the trainer's ``dataflex_batch.skip``, ``dataflex`` and ``dataflex_metrics``.
"""

from __future__ import annotations

import logging
from typing import Any

from ..step_metrics import skipped_summary

log = logging.getLogger("dataflex_bus")


class SkippedUpdates:
    """Skipped updates in TRL's logs: no ``grad_norm``, and a summary when most were skipped."""

    dataflex_batch: Any
    dataflex: Any
    dataflex_metrics: Any

    def _get_grad_norm(self, model: Any, grad_norm: Any = None) -> Any:
        # transformers logs what this returns as grad_norm; None logs none.
        if self.dataflex_batch.skip:
            return None
        return super()._get_grad_norm(model, grad_norm=grad_norm)  # type: ignore[misc]

    def train(self, *args: Any, **kwargs: Any) -> Any:
        out = super().train(*args, **kwargs)  # type: ignore[misc]
        line = skipped_summary(self.dataflex, list(self.dataflex_metrics))
        if line is not None:
            log.warning(line)
        return out


__all__ = ["SkippedUpdates"]
