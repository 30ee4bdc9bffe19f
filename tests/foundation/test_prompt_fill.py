"""How a host carries out pre-rollout selection (PromptFill) and dynamic sampling with refill
(GroupFill): request sizes, bounds, shortfalls, exhaust policies, and the per-round carry-out functions."""

from __future__ import annotations

import pytest
import torch

from dataflex_bus.batch import Batch
from dataflex_bus.block import RefillConfig
from dataflex_bus.carry import carry_out_prompts
from dataflex_bus.decision import Decision
from dataflex_bus.errors import BatchFieldError, DataflexError
from dataflex_bus.fill import GroupFill, PromptCounts, PromptFill, kept_groups
from dataflex_bus.visits import EASY, HARD, OTHER

T, F = True, False


def mask(*bits: bool) -> torch.Tensor:
    return torch.tensor(bits, dtype=torch.bool)


# ---------------------------------------------------------------------------- PromptFill
def test_requests_adapt_to_the_keep_rate_and_stop_at_the_bound():
    fill = PromptFill(10, max_oversample=3.0)
    assert fill.request() == 10
    fill.add(mask(T, F, T, F, F, T, F, T, F, F))  # 4 of 10 kept
    # deficit 6 at an estimated keep rate (4 + 1) / (10 + 1): ceil(6 * 11 / 5) = 14
    assert fill.request() == 14
    fill.add(torch.zeros(14, dtype=torch.bool))
    # ceil(6 * 25 / 5) = 30 wanted, 30 - 24 = 6 left under the bound of 3 x 10
    assert fill.request() == 6
    fill.add(torch.zeros(6, dtype=torch.bool))
    assert fill.request() == 0
    chosen = fill.chosen()
    # the 4 kept, then the first 6 skipped candidates in draw order (forced), in draw order
    assert chosen.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]
    c = fill.counts
    assert (c.considered, c.skipped, c.forced, c.trimmed, c.generated, c.draws) == (30, 20, 6, 0, 10, 3)


def test_enough_kept_trims_the_surplus():
    fill = PromptFill(3, max_oversample=5.0, chunk=4)
    assert fill.request() == 4  # whole chunks
    fill.add(mask(F, T, F, T))
    assert fill.request() == 4  # deficit 1 at rate 3/5: ceil(5/3) = 2, rounded up to a chunk
    fill.add(mask(T, T, F, T))
    assert fill.request() == 0
    assert fill.chosen().tolist() == [1, 3, 4]
    assert (fill.counts.trimmed, fill.counts.skipped, fill.counts.forced) == (2, 3, 0)


def test_bound_is_in_whole_chunks_and_never_below_the_target():
    assert PromptFill(10, max_oversample=1.0, chunk=4).budget == 12
    assert PromptFill(10, max_oversample=2.5, chunk=4).budget == 28


def test_nothing_kept_fills_with_skipped_or_raises_under_error():
    fill = PromptFill(2, max_oversample=2.0)
    for n in iter(fill.request, 0):
        fill.add(torch.zeros(n, dtype=torch.bool))
    assert fill.chosen().tolist() == [0, 1] and fill.counts.forced == 2
    strict = PromptFill(2, max_oversample=2.0, on_empty="error", who="greso")
    for n in iter(strict.request, 0):
        strict.add(torch.zeros(n, dtype=torch.bool))
    with pytest.raises(DataflexError, match=r"greso skipped all 4 candidate prompts.*on_empty=error"):
        strict.chosen()


def test_partial_shortfall_is_filled_even_under_error():
    fill = PromptFill(3, max_oversample=1.0, on_empty="error")
    fill.add(mask(F, T, F))
    assert fill.request() == 0
    assert fill.chosen().tolist() == [0, 1, 2] and fill.counts.forced == 2


def candidates(visits: list[int], classes: list[int]) -> Batch:
    n = len(visits)
    return Batch.from_tensors(uid=torch.arange(n), prompt_index=torch.arange(n),
                              history_visits=torch.tensor(visits), history_class=torch.tensor(classes))


def test_skip_rates_by_history_class():
    fill = PromptFill(2, max_oversample=4.0)
    batch = candidates([0, 0, 3, 3, 3, 2], [OTHER, OTHER, EASY, EASY, HARD, OTHER])
    fill.add(mask(T, T, F, T, F, T), batch)
    m = fill.counts.metrics()
    assert m["dataflex/prompts_skip_rate/new"] == 0.0
    assert m["dataflex/prompts_skip_rate/easy"] == 0.5
    assert m["dataflex/prompts_skip_rate/hard"] == 1.0
    assert m["dataflex/prompts_skip_rate/other"] == 0.0


def ids_batch(ids: list[int]) -> Batch:
    return Batch.from_tensors(uid=torch.arange(len(ids)), prompt_index=torch.tensor(ids))


def test_a_prompt_is_chosen_at_most_once_per_fill():
    fill = PromptFill(3, max_oversample=2.0)
    fill.add(mask(T, T, T), ids_batch([5, 5, 7]))  # the second 5 repeats the first
    assert fill.request() == 2
    fill.add(mask(T, F), ids_batch([5, 9]))
    assert fill.request() == 1
    fill.add(mask(F), ids_batch([9]))
    assert fill.request() == 0
    # kept 5 and 7; the shortfall is filled with 9 once (its repeat and the repeats of 5 are not candidates)
    assert fill.chosen().tolist() == [0, 2, 4]
    c = fill.counts
    assert (c.considered, c.duplicate, c.skipped, c.forced, c.generated) == (6, 2, 1, 1, 3)
    assert c.considered == c.generated + c.skipped + c.trimmed + c.duplicate


def test_too_few_distinct_prompts_is_a_clear_error():
    fill = PromptFill(3, max_oversample=1.0)
    fill.add(mask(F, F, F), ids_batch([1, 1, 2]))
    with pytest.raises(DataflexError, match="of 2 distinct prompts"):
        fill.chosen()


def test_counts_add_up_over_the_draws_of_a_step():
    total = PromptCounts()
    for keep in (mask(T, F, T), mask(F, F, T)):
        fill = PromptFill(1, max_oversample=3.0)
        fill.add(keep, candidates([1, 1, 1], [EASY, HARD, OTHER]))
        fill.chosen()
        total += fill.counts
    m = total.metrics()
    assert m["dataflex/prompts_considered"] == 6 and m["dataflex/prompts_generated"] == 2
    assert m["dataflex/prompts_trimmed"] == 1 and m["dataflex/prompts_skipped"] == 3
    assert m["dataflex/prompts_skip_rate/easy"] == 0.5 and m["dataflex/prompts_skip_rate/hard"] == 1.0


def test_carry_out_prompts_keeps_only_real_candidates():
    batch = Batch.from_tensors(uid=torch.arange(4), prompt_index=torch.arange(4),
                               is_padding=mask(F, F, F, T))
    assert carry_out_prompts(batch, Decision()).tolist() == [T, T, T, F]
    decision = Decision()
    decision.keep = mask(T, F, T, T)
    assert carry_out_prompts(batch, decision).tolist() == [T, F, T, F]
    decision.weights = torch.ones(4, 1)
    with pytest.raises(BatchFieldError, match="before anything is generated"):
        carry_out_prompts(batch, decision)


# ---------------------------------------------------------------------------- GroupFill
def rounds(fill: GroupFill, kept: list[list[bool]]) -> list[int]:
    """Feed rounds of group keep flags while the fill asks; returns the requests it made."""
    asked = []
    for flags in kept:
        n = fill.request()
        if n == 0:
            break
        asked.append(n)
        fill.add(torch.tensor(flags[:n] + [False] * (n - len(flags)), dtype=torch.bool))
    asked.append(fill.request())
    return asked


def test_fixed_policy_repeats_the_generation_batch_and_cuts_at_the_target():
    fill = GroupFill(4, RefillConfig(gen_batch_size=5))
    asked = rounds(fill, [[T, F, F, T, F], [F, T, T, T, F]])
    assert asked == [5, 5, 0]
    train, m = fill.train()
    assert train.tolist() == [T, F, F, T, F, F, T, T, F, F]  # the first 4 kept groups in arrival order
    assert m["dataflex/refill/discarded_groups"] == 1 and m["dataflex/refill/rounds"] == 2
    assert m["dataflex/refill/generated_groups"] == 10 and m["dataflex/refill/trained_groups"] == 4


def test_credit2_asks_twice_the_dropped_groups():
    fill = GroupFill(4, RefillConfig(policy="credit2"))
    assert rounds(fill, [[T, F, T, F], [T, T, T, T]]) == [4, 4, 0]
    fill = GroupFill(8, RefillConfig(policy="credit2"))
    assert rounds(fill, [[T] * 7 + [F]]) == [8, 2]


def test_greso_policy_estimates_the_refill_and_announces_the_last_round():
    fill = GroupFill(32, RefillConfig(gen_batch_size=48, policy="greso", beta=1.25, on_exhaust="train_short"))
    first = [T] * 20 + [F] * 28
    # deficit 12, zero-variance share z = 28/48: floor(1.25 * 12 / (1 - z)) = 36 <= 48 -> the last round
    assert rounds(fill, [first]) == [48, 36]
    fill.add(torch.tensor([T] * 5 + [F] * 31))
    assert fill.exhausted and fill.request() == 0
    train, m = fill.train()
    assert int(train.sum()) == 25 and m["dataflex/refill/short_groups"] == 7


def test_greso_policy_floor_and_all_dropped_round():
    fill = GroupFill(32, RefillConfig(gen_batch_size=48, policy="greso", min_gen_batch=10))
    # everything dropped (z = 1): GRESO divides by zero; here the next round is gen_batch_size, not the last
    assert rounds(fill, [[F] * 48]) == [48, 48]
    assert not fill.exhausted
    # deficit 1 at z = 17/48: floor(1.25 * 1 * 48 / 31) = 1 is raised to min_gen_batch
    fill = GroupFill(32, RefillConfig(gen_batch_size=48, policy="greso", min_gen_batch=10))
    fill.add(torch.tensor([T] * 31 + [F] * 17))
    assert fill.request() == 10


def test_max_rounds_then_exhaust_policies():
    cfg = dict(gen_batch_size=2, max_rounds=2)
    fill = GroupFill(3, RefillConfig(**cfg))
    rounds(fill, [[T, F], [F, F], [T, T]])
    assert fill.exhausted
    with pytest.raises(DataflexError, match=r"after 2 generation round\(s\) \(4 groups\).*kept 1 of the 3"):
        fill.train()
    fill = GroupFill(3, RefillConfig(**cfg, on_exhaust="train_short"))
    rounds(fill, [[T, F], [F, F]])
    assert fill.train()[0].tolist() == [T, F, F, F]
    fill = GroupFill(3, RefillConfig(**cfg, on_exhaust="pad_with_filtered"))
    rounds(fill, [[T, F], [F, F]])
    train, m = fill.train()
    assert train.tolist() == [T, T, T, F] and m["dataflex/refill/padded_groups"] == 2


def test_unbounded_rounds_go_on_until_the_target():
    fill = GroupFill(2, RefillConfig(gen_batch_size=1, max_rounds=0))
    assert rounds(fill, [[F]] * 20 + [[T], [T]]) == [1] * 22 + [0]


def test_kept_groups_reads_the_keep_mask_not_skip_update():
    batch = Batch.from_tensors(uid=torch.tensor([5, 5, 7, 7, 9, 9]), rm_scores=torch.zeros(6, 1),
                               response_mask=torch.ones(6, 1, dtype=torch.long))
    decision = Decision()
    decision.keep = mask(T, T, F, F, T, T)
    assert kept_groups(batch, decision).tolist() == [T, F, T]
    empty = Decision()
    empty.keep = torch.zeros(6, dtype=torch.bool)
    empty.skip_update = True
    assert kept_groups(batch, empty).tolist() == [F, F, F]
    assert kept_groups(batch, Decision()).tolist() == [T, T, T]
