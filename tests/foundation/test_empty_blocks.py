"""A training block (a verl mini-batch) whose every row a method dropped follows ``on_empty``
(``dataflex_bus.carry.carry_out_advantage`` with ``blocks``)."""

from __future__ import annotations

import pytest
import torch

from dataflex_bus import Batch, build_pipeline
from dataflex_bus.carry import carry_out_advantage, empty_blocks, rows_in
from dataflex_bus.decision import Decision
from dataflex_bus.errors import DataflexError

#: 4 blocks of 2 rows, in a scrambled order (as a shuffled mini-batch iterator draws them).
BLOCKS = torch.tensor([[0, 5], [1, 4], [2, 7], [3, 6]])


def batch8() -> Batch:
    mask = torch.ones(8, 3, dtype=torch.long)
    mask[:, 2] = 0
    adv = torch.arange(1.0, 9.0)[:, None].expand(8, 3) * mask
    return Batch.from_tensors(uid=["a"] * 4 + ["b"] * 4, response_mask=mask, loss_mask=mask.clone(),
                              advantages=adv.contiguous())


def dropping(rows: list[int], policy: str = "skip", nonfinite: list[int] = ()) -> Decision:
    d = Decision()
    drop = torch.zeros(8, dtype=torch.bool)
    drop[rows] = True
    d.drop(drop, on_empty=policy)
    if nonfinite:
        bad = torch.zeros(8, dtype=torch.bool)
        bad[list(nonfinite)] = True
        d.drop(bad, on_empty=policy, nonfinite=True)
    return d


def test_empty_blocks_and_their_rows():
    trained = torch.tensor([True, False, False, True, False, False, True, False])
    assert empty_blocks(trained, BLOCKS).tolist() == [False, True, True, False]
    assert rows_in(BLOCKS, torch.tensor([False, True, True, False]), 8).nonzero().flatten().tolist() == [1, 2, 4, 7]


def test_skip_takes_the_emptied_blocks_out_of_the_update():
    action = carry_out_advantage(batch8(), dropping([1, 4, 6]), blocks=BLOCKS, block_multiple=2)
    assert action.empty_blocks == 1 and not action.skip_update
    assert action.remove.nonzero().flatten().tolist() == [1, 4]
    assert action.fields["loss_mask"][6].sum() == 0  # a drop in a block that still trains stays a drop
    assert action.keep.tolist() == [True, False, True, True, False, True, False, True]


def test_skip_falls_back_to_the_whole_update_when_blocks_cannot_be_removed():
    # blocks that differ per epoch (block_multiple=None), a batch that would lose its multiple, or all
    # blocks empty: the update of the step is skipped instead
    for multiple, rows in ((None, [1, 4]), (4, [1, 4]), (2, list(range(8)))):
        action = carry_out_advantage(batch8(), dropping(rows), blocks=BLOCKS, block_multiple=multiple)
        assert action.skip_update and action.empty_blocks >= 1 and action.fields == {}


def test_keep_all_trains_the_emptied_block_again_but_never_a_nonfinite_row():
    b = batch8()
    action = carry_out_advantage(b, dropping([1, 4, 2, 6], "keep_all"), blocks=BLOCKS, block_multiple=2)
    assert action.restored_rows == 2 and action.remove is None and not action.skip_update
    for row in (1, 4):  # restored with verl's own masks and advantages
        assert torch.equal(action.fields["loss_mask"][row], b["loss_mask"][row])
        assert torch.equal(action.fields["advantages"][row], b["advantages"][row])
    assert action.fields["loss_mask"][[2, 6]].sum() == 0  # their blocks still train: still dropped
    # block [2, 7]: 2 dropped by selection, 7 for a NaN score: only 2 comes back
    action = carry_out_advantage(b, dropping([2], "keep_all", nonfinite=[7]), blocks=BLOCKS, block_multiple=2)
    assert action.restored_rows == 1 and action.fields["loss_mask"][7].sum() == 0
    assert action.fields["loss_mask"][2].sum() == 2
    # block [0, 5] emptied by NaN scores only: nothing to restore, so it is skipped
    action = carry_out_advantage(b, dropping([], "keep_all", nonfinite=[0, 5]), blocks=BLOCKS, block_multiple=2)
    assert action.restored_rows == 0 and action.remove.nonzero().flatten().tolist() == [0, 5]


def test_error_raises_naming_the_policy():
    with pytest.raises(DataflexError, match=r"1 of 4 training block.*on_empty=error"):
        carry_out_advantage(batch8(), dropping([3, 6], "error"), blocks=BLOCKS, block_multiple=2)


def test_without_blocks_or_without_an_empty_block_nothing_changes():
    plain = carry_out_advantage(batch8(), dropping([1, 4]))
    assert plain.remove is None and plain.empty_blocks == 0
    blocked = carry_out_advantage(batch8(), dropping([1, 2]), blocks=BLOCKS, block_multiple=2)
    assert blocked.empty_blocks == 0
    assert all(torch.equal(plain.fields[k], carry_out_advantage(batch8(), dropping([1, 4])).fields[k])
               for k in plain.fields)


def test_the_strictest_policy_of_the_dropping_methods_wins():
    d = Decision()
    rows = torch.zeros(8, dtype=torch.bool)
    d.drop(rows, on_empty="keep_all")
    assert d.on_empty == "keep_all"
    d.restrict(~rows, on_empty="skip")
    d.drop(rows, on_empty="keep_all")
    assert d.on_empty == "skip"
    d.drop(rows, on_empty="error")
    assert d.on_empty == "error"


def test_a_method_records_its_policy_and_its_nonfinite_rows():
    from dataflex_bus.testing import make_batch

    b = make_batch(groups=2, group_size=4, seed=3)
    pipe = build_pipeline({"mechanism": "select", "on_empty": "keep_all",
                           "scorer": {"name": "advantage_magnitude"},
                           "actuator": {"name": "topk_fraction", "params": {"fraction": 0.25}}})
    d = pipe.apply(b, step=0)
    assert d.on_empty == "keep_all" and d.nonfinite is None and int(d.keep.sum()) == 2
