"""TRL's ``GRPOTrainer`` as a dataflex host: ``from dataflex_bus.trl import DataflexGRPOTrainer``.

This package is the only place in dataflex-bus that imports TRL, and importing it does not: the trainer
is loaded on first use of :class:`DataflexGRPOTrainer` (``import dataflex_bus`` never imports trl), while
:mod:`dataflex_bus.trl.host` (the host description) and :mod:`dataflex_bus.trl.doctor` stay import-light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..kit import lazy_exports

#: The TRL versions whose private hook points (``_generate_and_score_completions``, ``_calculate_rewards``,
#: ``_generate``, ``_compute_loss``, ...) the adapter was written and tested against: [low, high).
TESTED_TRL = ("1.16.0", "1.17.0")

if TYPE_CHECKING:
    from .trainer import DataflexGRPOTrainer

__getattr__ = lazy_exports(__name__, {"DataflexGRPOTrainer": "trainer"})


__all__ = ["TESTED_TRL", "DataflexGRPOTrainer"]
