"""Hand-built batches for the method tests: every number in them is chosen by the test."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dataflex_bus.batch import Batch
from dataflex_bus.components import Score
from dataflex_bus.ops import grpo_outcome_advantage
from dataflex_bus.pipeline import build_pipeline


def batch_of(
    rewards: Sequence[float],
    uid: Sequence[object] | None = None,
    *,
    lengths: Sequence[int] | None = None,
    tokens: int = 6,
    padding: Sequence[bool] | None = None,
    domains: Sequence[str] | None = None,
    domain_names: Sequence[str] | None = None,
    advantages: torch.Tensor | None = None,
    old_log_probs: torch.Tensor | None = None,
    mask_dtype: torch.dtype = torch.long,
) -> Batch:
    """Rows with the given outcome rewards (placed on the last valid token) and group labels.

    Padding rows keep whatever reward/length is given, which must never be seen. Advantages default
    to verl's GRPO advantages broadcast over valid tokens.
    """
    n = len(rewards)
    lengths = list(lengths) if lengths is not None else [tokens] * n
    mask = (torch.arange(tokens)[None, :] < torch.tensor(lengths)[:, None]).to(mask_dtype)
    rm = torch.zeros(n, tokens)
    r = torch.tensor(rewards, dtype=torch.float32)
    for i, length in enumerate(lengths):
        if length > 0:
            rm[i, length - 1] = r[i]
    uid = list(uid) if uid is not None else [f"g{i}" for i in range(n)]
    fields: dict[str, torch.Tensor] = {"rm_scores": rm, "response_mask": mask}
    pad = torch.tensor(list(padding), dtype=torch.bool) if padding is not None else None
    b = Batch.from_tensors(uid=uid, domains=domains, domain_names=domain_names, is_padding=pad, **fields)
    if advantages is None:
        adv_rows = grpo_outcome_advantage(b.rewards, b.group_index, b.num_groups)
        advantages = adv_rows[:, None] * mask
    fields["advantages"] = advantages.to(torch.float32)
    if old_log_probs is None:
        old_log_probs = -torch.linspace(0.1, 2.0, n * tokens).view(n, tokens)
    fields["old_log_probs"] = old_log_probs
    return Batch.from_tensors(uid=uid, domains=domains, domain_names=domain_names, is_padding=pad, **fields)


def row_score(values: Sequence[float], granularity: str = "response", **kw: torch.Tensor) -> Score:
    return Score(values=torch.tensor(values, dtype=torch.float32), granularity=granularity, **kw)


def pipe(mechanism: str, scorer: str, actuator: str, scorer_params: dict | None = None,
         actuator_params: dict | None = None, **extra: object):
    """Build through the real entry-point discovery of the installed first-party plugins."""
    block = {"mechanism": mechanism, "scorer": {"name": scorer, "params": scorer_params or {}},
             "actuator": {"name": actuator, "params": actuator_params or {}}, **extra}
    return build_pipeline(block)


def component(slot: str, name: str, **params: object):
    from dataflex_bus.pipeline import build_component

    return build_component(slot, name, params)
