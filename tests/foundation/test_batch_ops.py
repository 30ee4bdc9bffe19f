from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dataflex_bus import Batch
from dataflex_bus.errors import BatchFieldError
from dataflex_bus.ops import grpo_outcome_advantage, segment_mean_std


def test_group_index_skips_padding_and_keeps_sizes():
    b = Batch.from_tensors(uid=["p", "q", "p", "z", "q"], is_padding=[0, 0, 0, 1, 0],
                           rm_scores=torch.zeros(5, 2), response_mask=torch.ones(5, 2))
    assert b.group_index.tolist()[3] == -1
    gi = b.group_index.tolist()
    assert gi[0] == gi[2] and gi[1] == gi[4] and gi[0] != gi[1]
    assert b.num_groups == 2 and sorted(b.group_sizes.tolist()) == [2, 2]


def test_rewards_and_lengths_use_the_mask():
    rm = torch.tensor([[0.0, 0.0, 1.0], [0.0, 5.0, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    b = Batch.from_tensors(uid=["a", "a"], rm_scores=rm, response_mask=mask)
    assert b.rewards.tolist() == [1.0, 5.0] and b.lengths.tolist() == [3, 2]


def test_row_reward_span_reads_verls_sum_through_every_transform():
    """verl's GRPO sums rm_scores over the whole row: a tool-agent trajectory cut after a tool response carries its
    score on a mask-0 last token (row 0), two tool spans inside (row 1); padding rows still read 0."""
    from dataflex_bus.generation import concat_rounds, concat_rows

    rm = torch.tensor([[0.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.5], [0.0, 0.0, 0.0, 7.0]])
    mask = torch.tensor([[1, 0, 1, 0], [1, 0, 0, 1], [1, 1, 1, 1]])
    masked = Batch.from_tensors(uid=["a", "a", "b"], rm_scores=rm, response_mask=mask, is_padding=[0, 0, 1])
    row = masked.with_reward_span("row")
    assert masked.rewards.tolist() == [0.0, 0.5, 0.0] and row.rewards.tolist() == [1.0, 0.5, 0.0]
    for derived in (row.select(torch.tensor([0, 1])), row.with_fields(extra=torch.zeros(3)),
                    concat_rounds([row, row]), concat_rows(row, row)):
        assert derived.reward_span == "row" and derived.rewards[:2].tolist() == [1.0, 0.5]
    with pytest.raises(BatchFieldError, match=r"reward_span.*'masked', 'row'"):
        masked.with_reward_span("all")


def test_bad_batches_name_the_field():
    with pytest.raises(BatchFieldError, match="row counts disagree"):
        Batch.from_tensors(a=torch.zeros(3), b=torch.zeros(4))
    b = Batch.from_tensors(uid=["a"], rm_scores=torch.zeros(1, 2), response_mask=torch.ones(1, 2))
    with pytest.raises(BatchFieldError, match="my scorer: field 'old_log_probs'"):
        b.require("my scorer", ["old_log_probs"])
    with pytest.raises(BatchFieldError, match="not among"):
        Batch.from_tensors(domains=["x"], a=torch.zeros(1)).with_domain_names(["y"])


def test_domain_remap():
    b = Batch.from_tensors(domains=["b", "a", "b"], is_padding=[0, 0, 1], a=torch.zeros(3))
    r = b.with_domain_names(["a", "b", "c"])
    assert r.domain_index.tolist() == [1, 0, -1] and r.domain_names == ["a", "b", "c"]


def _loop_grpo(scores, index, eps=1e-6):
    out = torch.zeros_like(scores)
    groups = {}
    for i, g in enumerate(index.tolist()):
        groups.setdefault(g, []).append(i)
    for g, rows in groups.items():
        if g < 0:
            continue
        vals = scores[rows]
        if len(rows) == 1:
            mean, std = torch.tensor(0.0), torch.tensor(1.0)
        else:
            mean, std = vals.mean(), vals.std()
        out[rows] = (vals - mean) / (std + eps)
    return out


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(-1, 5), st.sampled_from([0.0, 1.0, 0.5, -2.0])), min_size=1, max_size=40))
def test_grpo_matches_reference_loop(rows):
    index = torch.tensor([r[0] for r in rows])
    scores = torch.tensor([r[1] for r in rows], dtype=torch.float32)
    got = grpo_outcome_advantage(scores, index, 6)
    assert torch.allclose(got, _loop_grpo(scores, index), atol=1e-5)


def test_segment_mean_std_singletons_are_nan():
    mean, std, count = segment_mean_std(torch.tensor([1.0, 2.0, 4.0]), torch.tensor([0, 0, 1]), 3)
    assert count.tolist() == [2, 1, 0] and mean[0] == 1.5 and torch.isnan(std[1]) and torch.isnan(mean[2])


# ---------------------------------------------------------------------------- label checks
def _fields(rows=4):
    return {"rm_scores": torch.zeros(rows, 2), "response_mask": torch.ones(rows, 2)}


@pytest.mark.parametrize(("labels", "message"), [
    (["a", "a", "b"], "3 label(s) for 4 rows"),
    (["a"], "1 label(s) for 4 rows"),                                      # would broadcast to every row
    (["a"] * 5, "5 label(s) for 4 rows"),
    (torch.tensor([0, 0, 1]), "3 label(s) for 4 rows"),
    (torch.tensor([0.0, 0.4, 0.6, 1.0]), "integer dtype, got torch.float32"),   # would truncate 0.4 -> 0
    (torch.tensor([True, False, True, False]), "integer dtype, got torch.bool"),
    (torch.zeros(4, 1, dtype=torch.long), "1-D tensor of labels, got shape (4, 1)"),
    ("aabb", "got the single string 'aabb'"),
    ([["a"], ["a"], ["b"], ["b"]], "labels must be hashable"),
])
def test_bad_uid_labels_name_the_field(labels, message):
    with pytest.raises(BatchFieldError) as err:
        Batch.from_tensors(uid=labels, **_fields())
    assert "field 'uid'" in str(err.value) and message in str(err.value)


def test_int_and_str_labels_are_distinct_groups_and_equal_values_are_one():
    import numpy as np

    b = Batch.from_tensors(uid=[1, "1", 1, "1"], **_fields())
    assert b.num_groups == 2 and b.group_index.tolist() == [0, 1, 0, 1]
    b = Batch.from_tensors(uid=[np.str_("p"), "p", np.int64(3), 3], **_fields())
    assert b.group_index.tolist() == [0, 0, 1, 1]
    b = Batch.from_tensors(uid=np.array(["x", "y", "x", "y"], dtype=object), **_fields())
    assert b.num_groups == 2
    assert b.select(torch.tensor([0, 1])).uid == ["x", "y"]


def test_integer_uid_tensors_keep_their_fast_path():
    uid = torch.tensor([7, 7, 3, 3], dtype=torch.int32)
    b = Batch.from_tensors(uid=uid, **_fields())
    assert b._raw_group_ids.dtype == torch.long and b.uid is None and b.num_groups == 2


@pytest.mark.parametrize(("kwargs", "field", "message"), [
    ({"domains": ["a", "b", "a", "b"], "domain_names": ["a", "b", "a"]}, "domain_names", "duplicate names ['a']"),
    ({"domains": torch.tensor([0, 1, 0, 1]), "domain_names": ["m", "m"]}, "domain_names", "duplicate names ['m']"),
    ({"domains": [1, "1", 1, "1"]}, "data_source", "print as the same domain name ['1']"),
    ({"domains": ["a", "b"]}, "data_source", "2 label(s) for 4 rows"),
    ({"domains": torch.tensor([0, 1, 2, 0]), "domain_names": ["a", "b"]}, "data_source", "ids from 0 to 2"),
    ({"domains": torch.tensor([0, -1, 0, 0]), "domain_names": ["a", "b"]}, "data_source", "ids from -1 to 0"),
    ({"domains": torch.tensor([0.0, 1.0, 0.0, 1.0]), "domain_names": ["a", "b"]}, "data_source", "integer dtype"),
])
def test_bad_domain_labels_name_the_field(kwargs, field, message):
    with pytest.raises(BatchFieldError) as err:
        Batch.from_tensors(**kwargs, **_fields())
    assert f"field '{field}'" in str(err.value) and message in str(err.value)


def test_padding_rows_may_carry_any_domain_id():
    b = Batch.from_tensors(domains=torch.tensor([0, 1, 9, 0]), domain_names=["a", "b"], is_padding=[0, 0, 1, 0],
                           **_fields())
    assert b.domain_index.tolist() == [0, 1, -1, 0]


def test_derived_batches_check_their_labels_too():
    b = Batch.from_tensors(uid=["a", "a", "b", "b"], **_fields())
    with pytest.raises(BatchFieldError, match="field 'data_source'"):
        b.derive(domain_ids=torch.zeros(3, dtype=torch.long), domain_names=["x"])
    with pytest.raises(BatchFieldError, match="field 'domain_names'"):
        b.derive(domain_ids=torch.zeros(4, dtype=torch.long), domain_names=["x", "x"])


# ---------------------------------------------------------------------------- masks and missing labels
@pytest.mark.parametrize("mask", [
    torch.tensor([[1, 1], [2, 0], [1, 0], [1, 1]]),                    # int: a 2 would double a reward
    torch.tensor([[1, 1], [1, -1], [1, 0], [1, 1]]),
    torch.tensor([[1.0, 1.0], [0.5, 0.0], [1.0, 0.0], [1.0, 1.0]]),    # float: a 0.5 would halve one
])
def test_a_response_mask_other_than_0_1_is_refused(mask):
    with pytest.raises(BatchFieldError) as err:
        Batch.from_tensors(uid=["a", "a", "b", "b"], rm_scores=torch.ones(4, 2), response_mask=mask)
    assert "field 'response_mask'" in str(err.value) and "0 or 1" in str(err.value)


def test_a_response_mask_of_0_1_passes_in_any_dtype():
    for dtype in (torch.bool, torch.int64, torch.int32, torch.uint8, torch.float32):
        mask = torch.tensor([[1, 1], [1, 0]]).to(dtype)
        assert Batch.from_tensors(uid=["a", "a"], rm_scores=torch.ones(2, 2), response_mask=mask).lengths.tolist() \
            == [2, 1]


def test_padding_rows_may_carry_any_mask_value():
    b = Batch.from_tensors(uid=["a", "a", "p"], is_padding=[0, 0, 1], rm_scores=torch.ones(3, 2),
                           response_mask=torch.tensor([[1, 1], [1, 0], [7, 7]]))
    assert b.rewards.tolist() == [2.0, 1.0, 0.0]


def test_a_uid_of_none_on_a_real_row_is_refused():
    for uid in ([None] * 4, ["a", "a", None, None]):
        with pytest.raises(BatchFieldError) as err:
            Batch.from_tensors(uid=uid, **_fields())
        assert "field 'uid'" in str(err.value) and "None" in str(err.value)
    # Padding rows belong to no group: what they carry does not matter.
    b = Batch.from_tensors(uid=["a", "a", None, None], is_padding=[0, 0, 1, 1], **_fields())
    assert b.num_groups == 1


def test_nan_on_masked_tokens_never_decides():
    rm = torch.tensor([[0.0, 1.0, float("nan")], [0.0, 0.0, 0.0], [1.0, float("nan"), float("inf")]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0]])
    b = Batch.from_tensors(uid=["a", "a", "a"], rm_scores=rm, response_mask=mask)
    assert b.rewards.tolist() == [1.0, 0.0, 1.0]
    # NaN on a real token is still NaN: the score is refused (or dropped) by on_nonfinite.
    rm[1, 2] = float("nan")
    assert torch.isnan(Batch.from_tensors(uid=["a", "a", "a"], rm_scores=rm, response_mask=mask).rewards[1])


def test_a_method_is_not_refused_for_nan_after_the_response_end():
    from dataflex_bus.testing import apply_method, make_batch

    b = make_batch(groups=4, group_size=4, max_len=8, min_len=2, seed=1)
    rm = b["rm_scores"].clone()
    rm[~b.token_mask] = float("nan")                    # what a reward model may write past the end
    nan_tail = b.with_fields(rm_scores=rm)
    block = {"mechanism": "select", "scorer": {"name": "group_solve_rate"},
             "actuator": {"name": "threshold_band", "params": {"low": 0.2, "high": 0.8}}}
    assert torch.equal(apply_method(block, nan_tail).keep, apply_method(block, b).keep)


def test_segment_slots_number_each_segments_rows_in_order_and_skip_padding():
    from dataflex_bus.ops import segment_slots

    index = torch.tensor([2, 0, 2, -1, 0, 1, 2])
    assert segment_slots(index, 3).tolist() == [0, 0, 1, -1, 1, 0, 2]
    assert segment_slots(torch.zeros(0, dtype=torch.long), 0).tolist() == []


def test_rewards_and_lengths_are_read_a_slice_of_rows_at_a_time_with_the_same_values(monkeypatch):
    """A method reading only [B] quantities adds no dense [B, T] copy: rewards and lengths are reduced
    ROW_CHUNK rows at a time, and equal the one-pass values bit for bit (NaN after a response's end too)."""
    import dataflex_bus.batch as batch_module
    from dataflex_bus.batch import Batch

    g = torch.Generator().manual_seed(3)
    rows, width = 70, 33
    mask = torch.arange(width)[None, :] < torch.randint(0, width + 1, (rows,), generator=g)[:, None]
    scores = torch.randn(rows, width, generator=g)
    scores[5, -1] = float("nan") if not bool(mask[5, -1]) else scores[5, -1]
    uid = torch.arange(rows) // 7
    for m in (mask, mask.long()):
        whole = Batch.from_tensors(uid=uid, response_mask=m, rm_scores=scores)
        want = (whole.rewards.clone(), whole.lengths.clone())
        monkeypatch.setattr(batch_module, "ROW_CHUNK", 8)
        sliced = Batch.from_tensors(uid=uid, response_mask=m, rm_scores=scores)
        assert torch.equal(sliced.rewards, want[0]) and torch.equal(sliced.lengths, want[1])
        monkeypatch.undo()
