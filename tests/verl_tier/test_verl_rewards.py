"""The host's reward is the bus's reward: on verl, every method reads the outcome reward verl's GRPO trains on (the
sum of ``rm_scores`` over the row, mask or no mask), also on tool-agent trajectories whose score sits on a mask-0
last token (semi-e2e harness, see verl_harness.py)."""

from __future__ import annotations

import pytest
import torch

from dataflex_bus import Batch, hookimpl
from dataflex_bus.history import ID_SHIFT

pytestmark = [pytest.mark.verl]

#: band select on group_solve_rate (keeps 0.2 <= rate <= 0.8), reward_gap mix on the outcome reward, and GRESO
#: keeping every prompt (so the per-prompt history is kept).
STACK = ["+dataflex.methods=[{name: band, mechanism: select, scorer: {name: group_solve_rate}, "
         "actuator: {name: threshold_band, params: {low: 0.2, high: 0.8}}}, "
         "{name: gap, mechanism: mix, scorer: {name: reward_difficulty}, "
         "actuator: {name: reward_gap, params: {temperature: 0.5}}}, "
         "{name: greso, mechanism: select, scorer: {name: zero_variance_streak}, "
         "actuator: {name: greso, params: {p_easy_init: 1.0, p_hard_init: 1.0, p_max: 1.0, explore_floor: 1.0, "
         "adapt_from_epoch: 100}}}]"]


class Reader:
    """Records what the bus read at each event: its rewards, verl's row sums of rm_scores, the masked sums and
    (on_advantage) verl's advantages."""

    def __init__(self) -> None:
        self.rollouts: list[Batch] = []
        self.advantages: list[Batch] = []

    @hookimpl
    def on_rollout(self, batch, step):
        self.rollouts.append(batch)

    @hookimpl
    def on_advantage(self, batch, step):
        self.advantages.append(batch)


def test_tool_response_masks_end_on_tool_tokens_for_even_sessions(H):
    even, odd = H.tool_response(0), H.tool_response(1)
    assert even[-1] == 0 and odd[-1] == 1
    assert int((odd.diff() == -1).sum()) == 2  # two tool spans


@pytest.mark.tq
@pytest.mark.integration
def test_tool_agent_rewards_are_verls_for_scorer_history_and_mixer(H, tmp_path, clean_partition):
    data = H.write_dataset(tmp_path / "train.parquet", {"math": 3, "logic": 3, "code": 3})
    run = H.Run(H.base_overrides(data, tmp_path / "ckpt", batch=3, steps=2) + STACK)
    reader = Reader()
    run.trainer.dataflex.bus.add_observer(reader, "reader")
    run.setup().fit(shape="tool")
    assert len(reader.rollouts) == 2 and len(reader.advantages) == 2
    solved = {d: set(s) for d, s in H.SOLVED.items()}
    for batch in reader.rollouts:
        assert batch.reward_span == "row"
        verl = batch["rm_scores"].sum(-1)  # what verl's GRPO sums (core_algos.compute_grpo_outcome_advantage)
        masked = (batch["rm_scores"] * batch["response_mask"]).sum(-1)
        assert torch.equal(batch.rewards, verl)
        # The trajectories are shaped so the masked reading differs: every solved even session reads 0 there.
        assert float(verl.sum()) > float(masked.sum())
        # group_solve_rate on verl's numbers: math solves 2 of 4, logic 1 of 4, code none.
        names = [batch.domain_names[i] for i in batch.domain_index.tolist()]
        assert set(batch.rewards.tolist()) <= {0.0, 1.0}
        per_domain = {d: [r for n, r in zip(names, batch.rewards.tolist()) if n == d] for d in set(names)}
        for d, rs in per_domain.items():
            assert sum(rs) == pytest.approx(len(rs) / 4 * len(solved[d]))
    for logged, batch in zip(run.logged, reader.rollouts):
        names = [batch.domain_names[i] for i in batch.domain_index.tolist()]
        groups = {(g, n) for g, n in zip(batch.group_index.tolist(), names)}
        # the band keeps math (0.5) and logic (0.25), drops code (0): the masked reading would keep nothing
        kept = [v for k, v in logged.items() if k.startswith("dataflex/") and "band" in k and
                k.endswith("/kept_groups")]
        assert kept == [sum(n != "code" for _, n in groups)]
    # verl's advantage is GRPO on the very rewards the bus read: positive exactly where the reward beats its group
    for batch in reader.advantages:
        adv = batch["advantages"].sum(-1)
        real = batch.valid_rows
        gi, g = batch.group_index, batch.num_groups
        mean = torch.zeros(g).index_add_(0, gi[real], batch.rewards[real]) / batch.group_sizes.clamp_min(1)
        above = batch.rewards[real] > mean[gi[real]]
        assert torch.equal(adv[real] > 0, above) and bool(above.any())
    # the per-prompt history and the mixer saw verl's numbers
    history = run.trainer.dataflex.history
    assert history is not None
    table = run.trainer.dataflex.prompt_table
    seen = torch.nonzero(history.reward_count > 0).flatten()
    assert seen.numel() > 0
    for p in seen.tolist():
        domain = table.domains[int(table.ids[p]) >> ID_SHIFT]
        count = min(int(history.reward_count[p]), history.reward_window)
        assert float(history.reward_ring[p, :count].sum()) == pytest.approx(count / 4 * len(solved[domain]))
    methods = run.trainer.dataflex_state_dict()["runtime"]["pipeline"]["methods"]
    mix = next(m for name, m in methods.items() if "gap" in name)["actuator"]
    rbar = dict(zip(mix["domains"], mix["rbar"].tolist()))
    seen_domains = dict(zip(mix["domains"], mix["seen"].tolist()))
    for d, r in rbar.items():
        if seen_domains[d]:
            assert r == pytest.approx(len(solved[d]) / 4)
    assert seen_domains["math"] and rbar["math"] == pytest.approx(0.5)


@pytest.mark.tq
def test_multi_output_sessions_are_refused_naming_the_agent_loop(H, tmp_path, clean_partition):
    """verl's GRPO reads each session's final output only; counting every output would weigh a session twice."""
    from seed_config import SEED

    from dataflex_bus.errors import ConfigError

    data = H.write_dataset(tmp_path / "train.parquet", {"math": 3, "code": 3})
    run = H.Run(H.base_overrides(data, tmp_path / "ckpt", batch=2, steps=1) + SEED).setup()
    with pytest.raises(ConfigError) as err:
        run.fit(shape="multi")
    text = str(err.value)
    assert "'two_output_agent' returned several outputs per session" in text and "_1'" in text
    assert err.value.issues[0].key == "actor_rollout_ref.rollout.agent.default_agent_loop"
    assert "update_actor" not in run.events


@pytest.mark.tq
@pytest.mark.integration
def test_validation_runs_through_verl_without_bus_events(H, tmp_path, clean_partition):
    """val_before_train and test_freq=1 with a block: verl's own _validate on the val partition (its buffer sample,
    its metrics), and no dataflex event fires on a validation batch."""
    from seed_config import SEED

    data = H.write_dataset(tmp_path / "train.parquet", {"math": 3, "logic": 3, "code": 3})
    over = [s for s in H.base_overrides(data, tmp_path / "ckpt", batch=3, steps=2)
            if not s.startswith(("trainer.test_freq", "trainer.val_before_train"))]
    run = H.Run(over + SEED + ["trainer.val_before_train=True", "trainer.test_freq=1"]).setup()
    validations: list[dict] = []
    validate = run.trainer._validate

    def spy():
        run.events.append("validate")
        out = validate()
        validations.append(out)
        return out

    run.trainer._validate = spy
    run.fit()
    bus = {"on_prompts", "on_rollout", "on_advantage", "on_step_end"}
    marks = [i for i, event in enumerate(run.events) if event == "validate"]
    # before training, after step 1 and after step 2 (verl validates after its last step too)
    assert len(marks) == 3 and run.events.count("update_actor") == 2
    for i in marks:  # the validation's own generation follows at once: nothing emitted on its batch
        assert run.events[i + 1] == "generate" and not bus & set(run.events[i + 1:i + 2])
    emitted = [(event, batch) for event, _, batch in run.decisions]
    assert [event for event, _ in emitted] == [e for e in run.events if e in bus]
    rollouts = [batch for event, batch in emitted if event == "on_rollout"]
    # two training batches (3 prompts x rollout.n=4), never a validation one (9 prompts x 1 session)
    assert len(rollouts) == 2 and all(b.group_sizes.tolist() == [4, 4, 4] for b in rollouts)
    assert len(validations) == 3
    for metrics in validations:
        # verl's own metrics of the 9 validation prompts (one session each: math and logic solve session 0)
        by_domain = {k.split("/")[1]: v for k, v in metrics.items() if k.startswith("val-core/") and "reward" in k}
        assert by_domain == {"math": 1.0, "logic": 1.0, "code": 0.0}
        assert not any(k.startswith("dataflex/") for k in metrics)
    assert len(run.trainer.actor_rollout_wg.updates) == 2
