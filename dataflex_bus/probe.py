"""The probe batch validation runs a block's selections on, bounded whatever the sizes.

It holds one group per number of right rollouts (0..g of g, binary rewards on the last token) with the
fields a host has at ``on_advantage``: what a selection's scorer and selector may read. ``g`` is the
host's group size up to :data:`MAX_GROUP`; beyond it, groups of :data:`MAX_GROUP` stand in (the built-in
selectors act on rates and fractions, which such groups cover finely), so the probe never holds more than
``(MAX_GROUP + 1) * MAX_GROUP`` rows of :data:`WIDTH` tokens, however large ``rollout_n`` is.
"""

from __future__ import annotations

import torch

from .batch import Batch
from .ops import grpo_outcome_advantage

#: Largest group the probe builds: 65 groups of 64 rows of 4 tokens is about 4,000 rows (a few MiB at most).
MAX_GROUP = 64
#: Response width (every response is this long) and prompt width of the probe's rows.
WIDTH = 4
PROMPT_WIDTH = 4
_VOCAB = 64


def probe_group_size(n: int) -> int:
    """The group size the probe uses for a host's ``n`` responses per prompt."""
    return max(1, min(int(n), MAX_GROUP))


def outcome_probe(n: int) -> Batch:
    """One group per outcome (``k`` of ``g`` right for every ``k`` in 0..g, ``g = probe_group_size(n)``),
    ``g`` rows each, one domain (``math``), GRPO advantages, ``old_log_probs`` and every mask; deterministic.
    Built on whole tensors: no Python work per row."""
    g = probe_group_size(n)
    groups = g + 1
    rows = groups * g
    gen = torch.Generator().manual_seed(0)
    # Group k: its first k rows are right.
    rewards = (torch.arange(g)[None, :] < torch.arange(groups)[:, None]).flatten().to(torch.float32)
    mask = torch.ones(rows, WIDTH, dtype=torch.long)
    rm_scores = torch.zeros(rows, WIDTH, dtype=torch.float32)
    rm_scores[:, -1] = rewards
    prompts = torch.randint(1, _VOCAB, (rows, PROMPT_WIDTH), generator=gen)
    group_index = torch.arange(groups).repeat_interleave(g)
    advantages = grpo_outcome_advantage(rewards, group_index, groups)[:, None].expand(rows, WIDTH).contiguous()
    return Batch.from_tensors(
        uid=group_index, domains=torch.zeros(rows, dtype=torch.long), domain_names=["math"],
        prompts=prompts, responses=torch.randint(1, _VOCAB, (rows, WIDTH), generator=gen), response_mask=mask,
        loss_mask=mask.clone(), attention_mask=torch.ones(rows, PROMPT_WIDTH + WIDTH, dtype=torch.long),
        rm_scores=rm_scores, advantages=advantages, returns=advantages.clone(),
        old_log_probs=-(0.01 + 3.0 * torch.rand(rows, WIDTH, generator=gen)))
