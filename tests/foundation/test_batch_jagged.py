"""A batch holding per-token fields jagged (verl's TransferQueue layout) reads exactly what the same batch padded
to ``[B, T]`` reads: rewards under both spans, lengths, token masks, selections and non-finite checks, from the
jagged values, without padding a field until a component reads it per token; and a component writing such a
field's dense view is named by the bus as one writing the field."""

from __future__ import annotations

import pytest
import torch

from dataflex_bus import Batch, Runtime, Score, Scorer
from dataflex_bus.errors import BatchFieldError, PluginRuntimeError


def jagged(values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(lengths, 0)])
    return torch.nested.nested_tensor_from_jagged(values, offsets=offsets, max_seqlen=int(lengths.max()),
                                                  min_seqlen=int(lengths.min()))


def twins(rows: int = 12, seed: int = 0, padding: bool = True, span: str = "row") -> tuple[Batch, Batch]:
    """The same batch twice: per-token fields jagged, and padded to dense ``[B, T]`` (what the verl adapter gave
    before). Several nonzero scores per row (sums whose order matters), mask-0 tokens inside rows, a NaN score on a
    mask-0 token, an empty row and padding rows."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 40, (rows,), generator=g)
    lengths[3] = 0
    total = int(lengths.sum())
    scores = torch.randn(total, generator=g) * torch.rand(total, generator=g).lt(0.3)
    mask = torch.rand(total, generator=g).lt(0.85)
    scores[torch.nonzero(~mask).flatten()[0]] = float("nan")
    fields = {"rm_scores": jagged(scores, lengths), "response_mask": jagged(mask, lengths),
              "old_log_probs": jagged(-torch.rand(total, generator=g), lengths)}
    dense = {name: value.to_padded_tensor(0) for name, value in fields.items()}
    labels = {"uid": [f"g{i // 3}" for i in range(rows)], "domains": [("a", "b")[i % 2] for i in range(rows)],
              "is_padding": torch.arange(rows) >= rows - 2 if padding else None}
    return (Batch.from_tensors(**labels, **fields).with_reward_span(span),
            Batch.from_tensors(**labels, **dense).with_reward_span(span))


@pytest.mark.parametrize("span", ["row", "masked"])
def test_a_jagged_batch_reads_what_its_dense_twin_reads(span):
    held, dense = twins(span=span)
    # rewards: the same bits (a row's sum over the same zero-padded width), NaN only where the dense twin has it
    assert torch.equal(held.rewards.nan_to_num(7.0), dense.rewards.nan_to_num(7.0))
    assert torch.equal(held.lengths, dense.lengths) and held.lengths.dtype == dense.lengths.dtype
    assert torch.equal(held.group_index, dense.group_index) and torch.equal(held.group_sizes, dense.group_sizes)
    for name in ("rm_scores", "response_mask", "old_log_probs"):
        assert torch.equal(held[name].nan_to_num(7.0), dense[name].nan_to_num(7.0)), name
    assert torch.equal(held.token_mask, dense.token_mask)


def test_rewards_span_chunks_of_rows_as_one_pass(monkeypatch):
    """More rows than one chunk: the row reductions go a slice of rows at a time and give the same bits."""
    import dataflex_bus.jagged as jagged_module

    monkeypatch.setattr(jagged_module, "ROW_CHUNK", 5)
    for span in ("row", "masked"):
        held, dense = twins(rows=23, seed=3, span=span)
        assert torch.equal(held.rewards.nan_to_num(7.0), dense.rewards.nan_to_num(7.0))
        assert torch.equal(held.lengths, dense.lengths)


def test_row_quantities_leave_the_fields_jagged():
    held, _ = twins()
    held.rewards, held.lengths, held.group_sizes, held.per_domain(held.rewards.double())
    held.check_finite("t", "old_log_probs")
    assert held.dense_views() == []
    view = held["old_log_probs"]
    assert held["old_log_probs"] is view and held.get("old_log_probs") is view  # padded once
    assert held.dense_views() == ["old_log_probs"] and held.width_of("old_log_probs") == view.shape[1]
    assert held.derive(reward_span="masked")["old_log_probs"] is view  # a derived batch shares the view
    assert held.jagged_field("old_log_probs") is held.fields["old_log_probs"]


def test_a_selection_keeps_rows_jagged():
    held, dense = twins(seed=5)
    rows = torch.tensor([7, 0, 3, 5])
    picked, expected = held.select(rows), dense.select(rows)
    assert picked.jagged_field("rm_scores") is not None and picked.dense_views() == []
    width = picked.width_of("old_log_probs")
    assert width == int(picked.fields["old_log_probs"].offsets().diff().max())
    for name in ("rm_scores", "response_mask", "old_log_probs"):
        assert torch.equal(picked[name].nan_to_num(7.0), expected[name][:, :width].nan_to_num(7.0)), name
    assert torch.equal(picked.rewards.nan_to_num(7.0), expected.rewards.nan_to_num(7.0))
    assert torch.equal(picked.lengths, expected.lengths)


def test_non_finite_values_on_real_tokens_are_found_in_the_jagged_values():
    held, _ = twins(span="masked", padding=False)
    assert held.nonfinite_rows(held.fields["rm_scores"]) is None  # the NaN sits on a mask-0 token
    values = held.fields["old_log_probs"].values()
    row, mask = 6, held.fields["response_mask"]
    start = int(mask.offsets()[row])
    first_real = start + int(torch.nonzero(mask.values()[start:]).flatten()[0])
    values[first_real] = float("inf")
    found = held.nonfinite_rows(held.fields["old_log_probs"])
    assert found is not None and torch.nonzero(found).flatten().tolist() == [int(torch.searchsorted(
        mask.offsets(), torch.tensor(first_real), right=True)) - 1]
    with pytest.raises(BatchFieldError, match="non-finite"):
        held.check_finite("t", "old_log_probs")


def test_a_jagged_mask_holding_other_than_0_or_1_is_refused():
    lengths = torch.tensor([2, 3])
    with pytest.raises(BatchFieldError, match=r"response_mask.*holds \[2\] on rows \[1\]"):
        Batch.from_tensors(response_mask=jagged(torch.tensor([1, 0, 1, 2, 1]), lengths),
                           rm_scores=jagged(torch.zeros(5), lengths))


class WritesItsView(Scorer):
    """Reads the scores per token and 'normalises' them in place: through the view, or behind its counter."""

    requires = ("rm_scores", "response_mask")
    how = "in place"

    def score(self, batch, step_id, **ctx):
        rewards = batch.rewards.clone()
        if self.how == "in place":
            batch["rm_scores"].sub_(1.0)
        else:
            batch["rm_scores"].data.zero_()
        return Score(rewards, "response")


@pytest.mark.parametrize("how", ["in place", "data"])
def test_a_component_writing_a_jagged_fields_view_is_named(toys, register, monkeypatch, how):
    monkeypatch.delenv("DATAFLEX_DEBUG", raising=False)
    register("scorer", "t_view_writer", type("ViewWriter", (WritesItsView,), {"how": how}))
    held, _ = twins(padding=False, span="masked")
    block = {"mechanism": "select", "scorer": {"name": "t_view_writer"},
             "actuator": {"name": "toy_band", "params": {"low": 0.0, "high": 1.0}}}
    with pytest.raises(PluginRuntimeError) as info:
        Runtime(block).emit("on_advantage", held, 0)
    expected = "written in place behind torch's version counter" if how == "data" else "written in place"
    assert info.value.plugin == "local:t_view_writer" and f"'rm_scores': {expected}" in str(info.value)


def test_reading_a_jagged_batch_passes_the_write_check(toys):
    """Views made during a hook are reads, not writes: an honest selection and a token scorer run as before."""
    held, _ = twins(padding=False, span="masked")
    Runtime({"mechanism": "select", "scorer": {"name": "toy_reward"},
             "actuator": {"name": "toy_band", "params": {"low": 0.0, "high": 1.0}}}).emit("on_advantage", held, 0)
    assert held.dense_views() == []  # it reads rewards only
    Runtime({"mechanism": "reweight", "scorer": {"name": "toy_reward"},
             "actuator": {"name": "toy_scale"}}).emit("on_advantage", held, 0)
    assert held.dense_views() == ["response_mask"]  # its row weights go to the tokens of the mask
