"""Realistic GRPO batches for component tests.

The batches look like what the verl adapter and the CPU shim hand to components: right-padded
responses of variable length, a binary outcome reward on the last valid token (``rm_scores``), verl's
GRPO advantages broadcast over the response tokens, negative ``old_log_probs``, ``uid`` group labels,
optional domain labels (``data_source``) and optional padding rows (verl pads batches to a divisible
size; those rows have empty masks, zero rewards and belong to no group).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..batch import Batch
from ..ops import grpo_outcome_advantage

#: Domain names used when ``domains`` is an integer.
DEFAULT_DOMAINS = ("math", "code", "logic", "science", "writing", "trivia", "puzzles", "geometry")


def _domain_names(domains: int | Sequence[str] | None) -> list[str] | None:
    if domains is None:
        return None
    if isinstance(domains, int):
        if domains < 1:
            raise ValueError(f"make_batch: domains must be >= 1, got {domains}")
        return [DEFAULT_DOMAINS[i] if i < len(DEFAULT_DOMAINS) else f"domain{i}" for i in range(domains)]
    names = [str(d) for d in domains]
    if not names or len(set(names)) != len(names):
        raise ValueError(f"make_batch: domains must be distinct, non-empty names, got {names}")
    return names


def make_batch(
    *,
    groups: int = 4,
    group_size: int = 4,
    max_len: int = 16,
    padding_rows: int = 0,
    domains: int | Sequence[str] | None = None,
    seed: int = 0,
    with_advantages: bool = True,
    group_sizes: Sequence[int] | None = None,
    mixed_group_sizes: bool = False,
    min_len: int = 1,
    reward_rate: float = 0.5,
    rewards: Sequence[float] | None = None,
    lengths: Sequence[int] | None = None,
    prompt_len: int = 4,
    vocab_size: int = 64,
    with_is_weights: bool = False,
) -> Batch:
    """A GRPO-shaped :class:`~dataflex_bus.Batch` with ``groups`` prompts.

    Group sizes: ``group_sizes`` if given, else random in ``[1, group_size]`` when
    ``mixed_group_sizes`` (failed rollouts leave short groups and singletons), else ``group_size``.
    Response lengths are uniform in ``[min_len, max_len]`` unless ``lengths`` (one per real row) is
    given; rewards are Bernoulli(``reward_rate``) unless ``rewards`` is given. Rows are ordered by
    group; ``padding_rows`` padding rows follow the real ones. With ``domains`` (a count or names) each
    group gets one domain, round robin, so every domain appears when ``groups >= len(domains)``.
    ``with_advantages`` adds verl's GRPO ``advantages`` and ``returns`` (via
    :func:`dataflex_bus.ops.grpo_outcome_advantage`) and ``old_log_probs``; ``with_is_weights`` adds
    ``rollout_is_weights`` (ones). Deterministic for a given ``seed``.
    """
    if groups < 1 or group_size < 1 or max_len < 1 or padding_rows < 0:
        raise ValueError(f"make_batch: need groups, group_size, max_len >= 1 and padding_rows >= 0, got "
                         f"groups={groups}, group_size={group_size}, max_len={max_len}, "
                         f"padding_rows={padding_rows}")
    if not 1 <= min_len <= max_len:
        raise ValueError(f"make_batch: min_len must lie in [1, max_len={max_len}], got {min_len}")
    gen = torch.Generator().manual_seed(seed)
    if group_sizes is not None:
        sizes = torch.tensor([int(s) for s in group_sizes], dtype=torch.long)
        if sizes.numel() == 0 or bool((sizes < 1).any()):
            raise ValueError(f"make_batch: group_sizes must be positive, got {list(group_sizes)}")
    elif mixed_group_sizes:
        sizes = torch.randint(1, group_size + 1, (groups,), generator=gen)
    else:
        sizes = torch.full((groups,), group_size, dtype=torch.long)
    n_groups = int(sizes.numel())
    real = int(sizes.sum())
    rows = real + padding_rows
    group_of_row = torch.repeat_interleave(torch.arange(n_groups), sizes)

    if lengths is not None:
        lens = torch.tensor([int(v) for v in lengths], dtype=torch.long)
        if lens.shape != (real,) or bool((lens < 1).any()) or bool((lens > max_len).any()):
            raise ValueError(f"make_batch: lengths must be {real} values in [1, max_len={max_len}]")
    else:
        lens = torch.randint(min_len, max_len + 1, (real,), generator=gen)
    if rewards is not None:
        r = torch.tensor([float(v) for v in rewards], dtype=torch.float32)
        if r.shape != (real,):
            raise ValueError(f"make_batch: rewards must hold {real} values (one per real row), "
                             f"got {r.numel()}")
    else:
        r = (torch.rand(real, generator=gen) < reward_rate).to(torch.float32)

    all_lens = torch.cat([lens, torch.zeros(padding_rows, dtype=torch.long)])
    positions = torch.arange(max_len)
    response_mask = (positions[None, :] < all_lens[:, None]).to(torch.long)
    last = (all_lens - 1).clamp_min(0)
    rm_scores = torch.zeros(rows, max_len, dtype=torch.float32)
    rm_scores[torch.arange(real), last[:real]] = r
    responses = torch.randint(1, vocab_size, (rows, max_len), generator=gen) * response_mask
    prompts = torch.randint(1, vocab_size, (rows, prompt_len), generator=gen)
    attention_mask = torch.cat([torch.ones(rows, prompt_len, dtype=torch.long), response_mask], dim=1)

    uid = [f"prompt-{seed}-{g}" for g in group_of_row.tolist()] + [f"pad-{i}" for i in range(padding_rows)]
    names = _domain_names(domains)
    domain_labels = None
    if names is not None:
        per_group = [names[g % len(names)] for g in range(n_groups)]
        domain_labels = [per_group[g] for g in group_of_row.tolist()] + [names[0]] * padding_rows
    is_padding = torch.cat([torch.zeros(real, dtype=torch.bool), torch.ones(padding_rows, dtype=torch.bool)])

    fields = {
        "prompts": prompts,
        "responses": responses,
        "response_mask": response_mask,
        "loss_mask": response_mask.clone(),
        "attention_mask": attention_mask,
        "rm_scores": rm_scores,
    }
    batch = Batch.from_tensors(uid=uid, domains=domain_labels, domain_names=names, is_padding=is_padding,
                               **fields)
    if not with_advantages and not with_is_weights:
        return batch
    extra: dict[str, torch.Tensor] = {}
    mask = batch.token_mask.to(torch.float32)
    if with_advantages:
        adv = grpo_outcome_advantage(batch.rewards, batch.group_index, batch.num_groups)
        extra["advantages"] = adv[:, None] * mask
        extra["returns"] = extra["advantages"].clone()
        extra["old_log_probs"] = -(0.01 + 3.0 * torch.rand(rows, max_len, generator=gen)) * mask
    if with_is_weights:
        extra["rollout_is_weights"] = torch.ones(rows, max_len, dtype=torch.float32)
    return batch.with_fields(**extra)


def make_prompt_batch(
    *,
    prompts: int = 12,
    domains: int | Sequence[str] = 2,
    table_rows: int = 16,
    visits: int = 40,
    seed: int = 0,
    group_size: int = 4,
) -> Batch:
    """An ``on_prompts`` batch: ``prompts`` candidates drawn from a table of ``table_rows`` prompts per
    domain whose history already holds ``visits`` rolled-out groups (all right, all wrong or mixed, over
    several steps), as a host hands it to a ``pre_rollout`` scorer: ``prompt_index``, domain labels and
    every ``history_*`` field (some candidates never seen). Deterministic for a given ``seed``.
    """
    from ..history import PromptHistory, PromptTable

    names = _domain_names(domains) or ["math"]
    if prompts < 1 or table_rows < 1 or visits < 0 or group_size < 2:
        raise ValueError(f"make_prompt_batch: need prompts, table_rows >= 1, visits >= 0 and group_size >= 2, got "
                         f"prompts={prompts}, table_rows={table_rows}, visits={visits}, group_size={group_size}")
    gen = torch.Generator().manual_seed(seed)
    table = PromptTable.full(names, [table_rows] * len(names), column="row")
    history = PromptHistory(table)
    n = len(table)
    # Only the first half of the table is ever rolled out, so candidates from the rest are new.
    seen = max(1, n // 2)
    for step in range(4):
        count = visits // 4 + (step < visits % 4)
        if count == 0:
            continue
        prompt = torch.randint(0, seen, (count,), generator=gen)
        kind = torch.randint(0, 3, (count,), generator=gen)  # 0 all right, 1 all wrong, 2 mixed
        rewards = torch.where(kind[:, None] == 0, 1.0, torch.where(kind[:, None] == 1, 0.0,
                              (torch.arange(group_size)[None, :] % 2).float())).flatten()
        rm = torch.zeros(count * group_size, 1)
        rm[:, 0] = rewards
        history.record(Batch.from_tensors(uid=torch.arange(count).repeat_interleave(group_size), rm_scores=rm,
                                          response_mask=torch.ones(count * group_size, 1, dtype=torch.long),
                                          prompt_index=prompt.repeat_interleave(group_size)), step)
        history.end_step(step)
    index = torch.randint(0, n, (prompts,), generator=gen)
    domain_ids = torch.div(index, table_rows, rounding_mode="floor")
    return Batch.from_tensors(uid=torch.arange(prompts), domains=domain_ids, domain_names=names,
                              prompt_index=index, **history.fields(index))

