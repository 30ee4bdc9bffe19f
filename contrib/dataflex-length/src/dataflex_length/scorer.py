"""``response_length``: how long each response is, as a score.

``L_i = sum_t response_mask[i, t]`` on real rows, normalised by

* ``max_len`` (default): the response width ``T`` of the batch (verl's ``max_response_length``), so the
  score is comparable across steps and lies in ``[0, 1]``;
* ``batch_max``: the longest real response of this batch, so the longest scores 1;
* ``none``: the raw token count.

Padding rows score 0 and never enter the batch maximum. Pair it with ``topk_fraction`` (``largest:
false``) to train on the shortest responses, or with a reweighter to favour brevity.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch

from dataflex_bus import Param, Score, Scorer

NORMALISATIONS = ("max_len", "batch_max", "none")


class ResponseLength(Scorer):
    """Normalised response length per response (post_reward, response granularity)."""

    params: ClassVar[Mapping[str, Param]] = {
        "normalize": Param(str, default="max_len", choices=NORMALISATIONS),
    }
    requires: ClassVar[tuple[str, ...]] = ("response_mask",)
    timing: ClassVar[str] = "post_reward"
    granularity: ClassVar[str] = "response"

    normalize: str

    def score(self, batch: Any, step_id: int, **ctx: Any) -> Score:
        lengths = batch.lengths.to(torch.float32)
        if self.normalize == "max_len":
            denom = float(max(batch.token_mask.shape[1], 1))
        elif self.normalize == "batch_max":
            real = lengths[batch.valid_rows]
            denom = float(real.max()) if real.numel() else 1.0
            denom = max(denom, 1.0)
        else:
            denom = 1.0
        values = lengths / denom
        real = lengths[batch.valid_rows]
        metrics = {"length/mean": float(real.mean()) if real.numel() else 0.0,
                   "length/max": float(real.max()) if real.numel() else 0.0}
        return Score(values=values, granularity="response", metrics=metrics)
