"""A token-level decision (``Decision.tokens``): what a token selector returns, how the ``select`` mechanism
and validation place it, and how the host kit carries it out for every host (``carry_out_advantage``): through
the loss weights (KL and entropy keep every token) or, under ``mask_kl``, the loss masks; rows and training
blocks left without a kept token follow the row-drop rules."""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch

from dataflex_bus import Batch, Score, Scorer, Selection, Selector, build_pipeline
from dataflex_bus.carry import carry_out_advantage, carry_out_rollout, minibatch_index
from dataflex_bus.components import Param, class_attribute_problems
from dataflex_bus.decision import Decision
from dataflex_bus.errors import BatchFieldError, ConfigError, DataflexError
from dataflex_bus.runtime import Runtime
from dataflex_bus.steps import StepKit
from dataflex_bus.validation import validate

#: 4 rows of 4 tokens; row 3 has 2. Blocks of 2 rows, scrambled.
MASK = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 0, 0]])
BLOCKS = torch.tensor([[0, 2], [1, 3]])


def batch4(**extra) -> Batch:
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])[:, None] * MASK
    return Batch.from_tensors(uid=["a", "a", "b", "b"], response_mask=MASK, loss_mask=MASK.clone(),
                              advantages=adv, rm_scores=torch.zeros(4, 4), **extra)


def tokens_of(rows: list[list[int]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.bool)


def token_decision(rows: list[list[int]], *, mask_kl: bool = False, on_empty: str = "skip") -> Decision:
    d = Decision()
    d.keep_tokens(tokens_of(rows), mask_kl=mask_kl, on_empty=on_empty)
    return d


KEEP = [[1, 0, 0, 1], [0, 1, 0, 0], [0, 0, 0, 0], [1, 0, 0, 0]]


# ---------------------------------------------------------------------------- the decision
def test_token_masks_and_and_mask_kl_sticks():
    d = token_decision([[1, 1, 0, 0]] * 4)
    d.keep_tokens(tokens_of([[0, 1, 1, 0]] * 4))
    assert d.tokens.int().tolist() == [[0, 1, 0, 0]] * 4 and not d.mask_kl and d.on_empty == "skip"
    d.keep_tokens(tokens_of([[1] * 4] * 4), mask_kl=True, on_empty="error")
    assert d.mask_kl and d.on_empty == "error" and "tokens=4/16" in repr(d)


def test_a_token_mask_before_advantages_is_refused():
    with pytest.raises(BatchFieldError, match="tokens"):
        carry_out_rollout(batch4(), token_decision(KEEP))


# ---------------------------------------------------------------------------- the carry-out
def test_the_weights_route_multiplies_the_mask_into_the_hosts_own_weights_only():
    own = torch.full((4, 4), 2.0)
    d = token_decision(KEEP)
    d.scale(torch.full((4, 4), 3.0))
    action = carry_out_advantage(batch4(rollout_is_weights=own), d)
    # KL, entropy and token-mean's denominator read the masks: untouched
    assert set(action.fields) == {"rollout_is_weights"} and action.keep is None and action.remove is None
    assert action.fields["rollout_is_weights"].tolist() == [
        [6, 0, 0, 6], [0, 6, 0, 0], [0, 0, 0, 0], [6, 0, 6, 6]]  # past row 3's end: not a real token, kept


def test_the_mask_route_writes_the_loss_masks_and_drops_nothing_by_itself():
    b = batch4()
    action = carry_out_advantage(b, token_decision(KEEP, mask_kl=True))
    assert action.fields["response_mask"].tolist() == action.fields["loss_mask"].tolist() == KEEP
    assert "rollout_is_weights" not in action.fields and "advantages" not in action.fields
    assert action.keep is None  # the mechanism drops a row left without a token (row 2): see below


def test_a_mismatched_token_mask_is_refused():
    d = Decision()
    d.keep_tokens(torch.ones(4, 3, dtype=torch.bool))
    with pytest.raises(BatchFieldError, match=r"'tokens'.*\(4, 4\)"):
        carry_out_advantage(batch4(), d)


@pytest.mark.parametrize("mask_kl", [False, True])
def test_a_block_left_without_a_kept_token_follows_on_empty(mask_kl):
    # rows 0 and 2 (block 0) keep no token: the block's policy-gradient term would be empty
    rows = [[0, 0, 0, 0], [0, 1, 0, 0], [0, 0, 0, 0], [1, 0, 0, 0]]
    b = batch4()

    def decided(policy: str) -> Decision:
        d = token_decision(rows, mask_kl=mask_kl, on_empty=policy)
        if mask_kl:  # the mechanism drops rows without a kept token under the mask route
            d.restrict(tokens_of(rows).any(dim=1), on_empty=policy)
        return d

    action = carry_out_advantage(b, decided("skip"), blocks=BLOCKS, block_multiple=2)
    assert action.empty_blocks == 1 and action.remove.tolist() == [True, False, True, False]
    assert not action.skip_update
    action = carry_out_advantage(b, decided("skip"), blocks=BLOCKS, block_multiple=4)
    assert action.skip_update  # the batch could not stay a multiple of 4
    with pytest.raises(DataflexError, match=r"1 of 2 training block.*kept no token.*on_empty=error"):
        carry_out_advantage(b, decided("error"), blocks=BLOCKS, block_multiple=2)
    action = carry_out_advantage(b, decided("keep_all"), blocks=BLOCKS, block_multiple=2)
    assert action.restored_rows == 2 and action.remove is None and not action.skip_update
    # the block trains as if nothing had been selected; the other block keeps its selection
    if mask_kl:
        assert action.fields["loss_mask"].tolist() == [[1, 1, 1, 1], [0, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]]
        assert action.keep.tolist() == [True, True, True, True]
    else:
        assert action.fields["rollout_is_weights"].tolist() == [
            [1, 1, 1, 1], [0, 1, 0, 0], [1, 1, 1, 1], [1, 0, 1, 1]]


def test_minibatch_index_is_the_first_epochs_block_of_each_row():
    blocks = torch.tensor([[0, 5], [1, 4], [2, 7], [3, 6], [6, 1], [0, 2], [5, 7], [3, 4]])  # two epochs
    assert minibatch_index(blocks, 8).tolist() == [0, 1, 2, 3, 1, 0, 3, 2]
    assert minibatch_index(None, 3).tolist() == [0, 0, 0]


# ---------------------------------------------------------------------------- the mechanism and validation
class Position(Scorer):
    """``s[i, t] = t``: later tokens score higher."""

    requires = ("response_mask",)
    timing = "post_advantage"
    granularity = "token"

    def score(self, batch, step, **ctx):
        return Score(torch.arange(batch["response_mask"].shape[1], dtype=torch.float32).expand(len(batch), -1)
                     .contiguous(), "token")


class LastTokens(Selector):
    """Keep tokens at positions >= ``start``, with weight 2 (a normalisation)."""

    selects_tokens = True
    accepts = ("token",)
    min_timing = "post_advantage"
    params: ClassVar = {"start": Param(int, 2), "mask_kl": Param(bool, False)}

    def select(self, batch, score, step):
        tokens = (score.values >= self.start) & batch.token_mask
        return Selection(keep=tokens.any(dim=1), tokens=tokens, token_weights=torch.where(tokens, 2.0, 1.0),
                         mask_kl=self.mask_kl)


TOKENS = {"mechanism": "select", "scorer": {"name": "t_position"}, "actuator": {"name": "t_last_tokens"}}


@pytest.fixture
def toy(register):
    register("scorer", "t_position", Position)
    register("selector", "t_last_tokens", LastTokens)


def test_a_token_selection_enters_the_decision_as_a_mask_and_weights(toy):
    d = build_pipeline(TOKENS).apply(batch4(), 0)
    assert d.tokens.int().tolist() == [[0, 0, 1, 1]] * 3 + [[0, 0, 0, 0]] and d.keep is None
    assert d.weights[d.tokens].tolist() == [2.0] * 6 and bool((d.weights[~d.tokens] == 1).all())
    assert d.metrics["dataflex/kept_tokens"] == 6 and d.metrics["dataflex/kept_token_fraction"] == 6 / 14
    assert d.metrics["dataflex/kept_rows"] == 3
    block = {**TOKENS, "actuator": {"name": "t_last_tokens", "params": {"mask_kl": True}}}
    d = build_pipeline(block).apply(batch4(), 0)
    assert d.mask_kl and d.keep.tolist() == [True, True, True, False]  # row 3 has nothing left in the loss


def test_a_token_selection_keeping_nothing_is_an_empty_selection(toy):
    block = {**TOKENS, "actuator": {"name": "t_last_tokens", "params": {"start": 9}}}
    d = build_pipeline(block).apply(batch4(), 0)
    assert d.skip_update and d.metrics["dataflex/empty_selection"] == 1
    d = build_pipeline({**block, "on_empty": "keep_all"}).apply(batch4(), 0)
    assert d.tokens is None and not d.skip_update


def test_validation_places_token_selections_and_refuses_what_cannot_work(toy, register):
    assert validate(TOKENS).methods[0].resolved.event == "on_advantage"
    # a token selector that would act at on_rollout is moved to on_advantage: a token mask lives in the loss
    class EarlyPosition(Position):
        timing = "post_reward"

    class Early(LastTokens):
        min_timing = "post_reward"

        @classmethod
        def keeps_whole_groups(cls, granularity):
            return True

    register("scorer", "t_early", EarlyPosition)
    register("selector", "t_early_tokens", Early)
    found = validate({**TOKENS, "scorer": {"name": "t_early"}, "actuator": {"name": "t_early_tokens"}})
    assert found.methods[0].resolved.event == "on_advantage"

    class RowsFromTokens(Selector):
        accepts = ("token", "response")

        def select(self, batch, score, step):
            return Selection(keep=batch.valid_rows)

    register("selector", "t_rows_from_tokens", RowsFromTokens)
    with pytest.raises(ConfigError, match="gives token-level scores, but selector 't_rows_from_tokens' keeps rows"):
        validate({**TOKENS, "actuator": {"name": "t_rows_from_tokens"}})
    stack = {"methods": [{**TOKENS, "name": "one"}, {**TOKENS, "name": "two"}]}
    with pytest.raises(ConfigError, match=r"dataflex\.methods\[1\].*one token selection"):
        validate(stack)


def test_a_token_selector_must_declare_token_scores():
    class Wrong(LastTokens):
        accepts = ("token", "response")

    assert any("Wrong.accepts" in p for p in class_attribute_problems(Wrong))
    assert not class_attribute_problems(LastTokens)


def test_stacked_methods_see_the_rows_a_mask_route_token_selection_dropped(toy):
    block = {"methods": [
        {**TOKENS, "name": "tokens", "actuator": {"name": "t_last_tokens", "params": {"mask_kl": True}}},
        {"name": "top", "mechanism": "select", "scorer": {"name": "advantage_magnitude"},
         "actuator": {"name": "topk_fraction", "params": {"fraction": 0.5}}}]}
    d = build_pipeline(block).apply(batch4(), 0)
    # row 3 (no kept token) is padding to the later method: it keeps the top half of the 3 rows left
    assert d.keep.tolist() == [True, True, False, False] and d.tokens is not None


def test_the_kit_fills_in_minibatch_index_for_a_method_that_reads_it(register):
    seen = {}

    class Reads(Selector):
        accepts = ("token",)
        selects_tokens = True
        min_timing = "post_advantage"

        @classmethod
        def requires_for(cls, values):
            return ("response_mask", "minibatch_index")

        def select(self, batch, score, step):
            seen["index"] = batch["minibatch_index"]
            return Selection(keep=batch.valid_rows, tokens=batch.token_mask)

    register("scorer", "t_position", Position)
    register("selector", "t_reads", Reads)
    runtime = Runtime({**TOKENS, "actuator": {"name": "t_reads"}})
    assert "minibatch_index" in runtime.fields("on_advantage")
    step = StepKit(runtime).begin(0)
    step.advantage(batch4(), blocks=BLOCKS, block_multiple=2)
    assert seen["index"].tolist() == [0, 1, 0, 1]
    step.advantage(batch4())
    assert seen["index"].tolist() == [0, 0, 0, 0]


def test_hosts_provide_minibatch_index_where_their_mini_batches_are_fixed_before_the_update():
    from dataflex_bus.shim.config import prepare
    from dataflex_bus.shim.host import describe as shim
    from dataflex_bus.verl.host import describe as verl

    def fields(host) -> tuple[bool, bool]:
        return "minibatch_index" in host.fields["on_advantage"], "minibatch_index" in host.fields["on_step_end"]

    one = shim(prepare({"trainer": {"mini_batches": 1}}).resolved)
    two = shim(prepare({"trainer": {"mini_batches": 2}}).resolved)
    assert fields(one) == (True, False) and fields(two) == (False, False)
    assert "trainer.mini_batches=1" in two.why_not("minibatch_index")
    actor = {"ppo_epochs": 2, "shuffle": True}
    shuffled = verl({"actor_rollout_ref": {"actor": actor}})
    assert fields(shuffled) == (False, False) and "shuffle=true" in shuffled.why_not("minibatch_index")
    for ok in ({**actor, "shuffle": False}, {**actor, "ppo_epochs": 1}):
        assert fields(verl({"actor_rollout_ref": {"actor": ok}})) == (True, False)


def test_observers_read_the_token_mask_and_cannot_change_it():
    from dataflex_bus.bus import DecisionView

    view = DecisionView(token_decision(KEEP))
    assert view.tokens.int().tolist() == KEEP and view.mask_kl is False
    with pytest.raises(AttributeError, match="read-only"):
        view.keep_tokens(tokens_of(KEEP))
    with pytest.raises(AttributeError, match="read-only"):
        view.mask_kl = True
