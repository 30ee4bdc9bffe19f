"""Components of the contract suite whose output the scripted world makes the same on every host.

The 80/20 cases cannot use ``token_entropy``: each host's entropy comes from its own model (the shim's GRU,
the verl harness's tiny Llama). ``contract_token_score`` reads only what the world fixes (response lengths and
rewards), so the token selection fed with it must train the same tokens with the same weights everywhere.
"""

from __future__ import annotations

import torch

from dataflex_bus import Score, Scorer, register_scorer


@register_scorer("contract_token_score")
class TokenScore(Scorer):
    """``s[i, t] = t / L_i + r_i / 2`` on valid tokens, 0 elsewhere: later tokens and right answers score higher,
    with ties between rows of equal length and reward (which the quantile form keeps or drops together)."""

    requires = ("response_mask", "rm_scores")
    timing = "post_advantage"
    granularity = "token"

    def score(self, batch, step, **ctx):
        width = batch["response_mask"].shape[1]
        position = torch.arange(width, dtype=torch.float32)[None, :]
        values = position / batch.lengths.clamp_min(1).to(torch.float32)[:, None] + batch.rewards[:, None] / 2
        return Score(torch.where(batch.token_mask, values, 0.0), "token")
