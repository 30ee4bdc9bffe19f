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
