"""Small components the contrib tests pair the packs with."""

from __future__ import annotations

from typing import Any

from dataflex_bus import Score, Scorer


class OutcomeReward(Scorer):
    """s_i = r_i (kept here so the tests do not depend on the first-party methods)."""

    requires = ("rm_scores", "response_mask")

    def score(self, batch: Any, step_id: int, **ctx: Any) -> Score:
        return Score(batch.rewards, "response")
