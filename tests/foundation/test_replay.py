"""The host kit's replay (``dataflex_bus/replay.py`` and the step drivers): the bounded store, what a step
replays and in which groups, the off-policy correction (DOTS's D1-D4 through the shim's loss), the compute
counters, checkpoints, and the bad inputs (empty buffer, stale records, NaN behaviour log-probs, another
dataset at resume, padding)."""

from __future__ import annotations

import pytest
import torch

from dataflex_bus.batch import Batch
from dataflex_bus.errors import ConfigError, DataflexError
from dataflex_bus.history import PromptTable
from dataflex_bus.host import ANY_HOST
from dataflex_bus.ops import grpo_outcome_advantage
from dataflex_bus.replay import Record, Replay, ReplayPart, ReplayRun, ReplayStore
from dataflex_bus.runtime import Runtime
from dataflex_bus.shim.losses import policy_loss
from dataflex_bus.steps import StepKit

PROMPTS = 12
N = 4


def block(**params):
    return {"mechanism": "replay", "scorer": {"name": "reward_difficulty"},
            "actuator": {"name": "rollout_replay", "params": params}}


DOTS = {"unit": "group", "priority": "uniform", "advantage": "own_group", "correction": "decoupled",
        "fresh_fraction": 0.5, "capacity": 4 * N, "dedup": True, "max_age_steps": 2}
REPO = {"unit": "prompt", "priority": "highest", "advantage": "split", "correction": "behaviour",
        "per_prompt": 2 * N, "min_to_replay": 2 * N, "replays": N, "capacity": 1000}


def runtime(params, host=ANY_HOST, prompts=PROMPTS):
    rt = Runtime(block(**params), host=host, check_writes=True)
    rt.set_prompts(PromptTable.full(["d"], [prompts], column="row"))
    return rt


def rollouts(prompts: list[int], step: int, *, padding: int = 0, mu: float | None = None) -> Batch:
    """One group of N rows per prompt: rewards a fixed function of (prompt, session), behaviour log-probs
    ``mu`` (default a function of prompt, session and step), then ``padding`` padding rows."""
    n = len(prompts) * N
    rows = n + padding
    width = 3
    session = torch.arange(n) % N
    prompt = torch.tensor(prompts).repeat_interleave(N)
    reward = ((prompt + session) % 3 == 0).to(torch.float32)
    mask = torch.ones(rows, width, dtype=torch.long)
    rm = torch.zeros(rows, width)
    rm[:n, -1] = reward
    lp = -(1.0 + 0.1 * ((torch.cat([prompt, torch.zeros(padding, dtype=torch.long)]) + step) % 5))
    rollout_lp = (lp[:, None].expand(rows, width) if mu is None else torch.full((rows, width), mu)).clone()
    uid = torch.cat([torch.arange(n) // N, torch.arange(padding) + 10_000])
    return Batch.from_tensors(uid=uid, rm_scores=rm, response_mask=mask, loss_mask=mask.clone(),
                              responses=(torch.arange(rows)[:, None] * 10 + torch.arange(width)) % 97,
                              rollout_log_probs=rollout_lp,
                              prompt_index=torch.cat([prompt, torch.zeros(padding, dtype=torch.long)]),
                              is_padding=torch.cat([torch.zeros(n, dtype=torch.bool),
                                                    torch.ones(padding, dtype=torch.bool)]))


def with_advantages(batch: Batch, old_shift: float = 0.05) -> Batch:
    """A host's old-log-prob and GRPO passes: pi_old a little off the behaviour policy."""
    adv = grpo_outcome_advantage(batch.rewards, batch.group_index, batch.num_groups)
    mask = batch["response_mask"].to(torch.float32)
    return batch.with_fields(old_log_probs=batch["rollout_log_probs"] + old_shift, advantages=adv[:, None] * mask,
                             rollout_is_weights=torch.ones_like(mask))


def host_step(kit: StepKit, i: int, prompts_of, target: int = 4, **kw):
    """One step of a minimal host: fresh prompts, replay, advantages, on_advantage, store, trained, end."""
    step = kit.begin(i)
    fresh_n = part(step).fresh_prompts(target)
    fresh = rollouts(prompts_of(i, fresh_n), i, **kw)
    step.count_generated(fresh)
    replayed = part(step).replay(fresh)
    batch = fresh if replayed is None else replayed.append_to(fresh)
    batch = with_advantages(batch)
    action = step.advantage(batch)
    part(step).store()
    trained = batch.with_fields(**action.fields)
    step.trained_batch(trained)
    return step, trained, step.end(trained)


def part(step) -> ReplayPart:
    """The step's replay part (the block has a replay method)."""
    found = ReplayPart.of(step)
    assert found is not None
    return found


def buffer(rt: Runtime) -> Replay:
    """The run's replay buffer (the host gave its prompt table)."""
    run = ReplayRun.of(rt)
    assert run is not None and run.buffer is not None
    return run.buffer


def cycle(i: int, n: int) -> list[int]:
    return [(i * n + k) % PROMPTS for k in range(n)]


# ---------------------------------------------------------------------------- DOTS
def test_dots_generates_its_fresh_share_and_replays_whole_stored_groups():
    kit = StepKit(runtime(DOTS))
    _, first, m0 = host_step(kit, 0, cycle)
    # an empty buffer: the first step generates every prompt and trains fresh rows only, counted
    assert m0["dataflex/replay/fresh_prompts"] == 4 and m0["dataflex/replay/empty"] == 1
    assert len(first) == 4 * N and m0["compute/replayed_rows"] == 0
    step, batch, m1 = host_step(kit, 1, cycle)
    assert m1["dataflex/replay/fresh_prompts"] == 2 and m1["dataflex/replay/groups"] == 2
    replayed = batch["replay_row"] >= 0
    assert int(replayed.sum()) == 2 * N and m1["dataflex/replay/rows"] == 2 * N
    # own_group: each stored group is its own group again, so its advantages are the ones it was stored with
    rec = part(step).replayed.record
    assert torch.allclose(batch["advantages"][replayed][:, 0], rec.advantage, atol=1e-6)
    assert m1["compute/replayed_rows"] == 2 * N and m1["compute/trained_rows"] == 4 * N + 4 * N
    assert m1["compute/generated_rollouts"] == 4 * N + 2 * N
    assert m1["compute/generated_rollouts"] == (m1["compute/trained_rows"] - m1["compute/replayed_rows"]
                                                + m1["compute/dropped_rows"])
    assert m1["dataflex/kept_fraction"] == 1.0  # of the generated rows


def test_dots_weights_every_row_by_the_truncated_decoupled_ratio():
    kit = StepKit(runtime({**DOTS, "is_cap": 1.02}))
    host_step(kit, 0, cycle)
    _, batch, _ = host_step(kit, 1, cycle)
    # pi_old = mu + 0.05 on every row: min(exp(0.05), 1.02) = 1.02 on the response tokens, fresh rows too
    assert torch.allclose(batch["rollout_is_weights"], torch.full_like(batch["rollout_is_weights"], 1.02))


def test_a_host_weighting_rows_itself_gets_no_second_weight():
    host = ANY_HOST.replace(name="tis", rollout_is="token")
    kit = StepKit(runtime(DOTS, host=host))
    host_step(kit, 0, cycle)
    _, batch, _ = host_step(kit, 1, cycle)
    assert bool((batch["rollout_is_weights"] == 1).all())


@pytest.mark.parametrize("logp, mu, old, adv, dots, ppo_vs_mu", [
    (-1.0, -1.2, -1.1, +1, -1.221403, -1.2),   # D1
    (-0.8, -1.2, -1.1, +1, -1.326205, -1.2),   # D2
    (-1.5, -1.2, -1.1, -1, 0.884137, 0.8),     # D3
    (-1.0, -1.0, -1.0, +1, -1.0, -1.0),        # D4 (a fresh row: mu = pi_old)
])
def test_d1_d4_the_correction_gives_dotss_and_repos_losses(logp, mu, old, adv, dots, ppo_vs_mu):
    batch = Batch.from_tensors(uid=torch.tensor([0]), response_mask=torch.ones(1, 1, dtype=torch.long),
                               rm_scores=torch.zeros(1, 1), old_log_probs=torch.tensor([[old]]),
                               rollout_log_probs=torch.tensor([[mu]]), replay_version=torch.tensor([0 if mu != old
                                                                                                    else 1]))
    theta, a = torch.tensor([[logp]]), torch.tensor([[float(adv)]])
    for params, want in (({**DOTS, "is_cap": 1e9}, dots), (REPO, ppo_vs_mu)):
        fields = buffer(runtime(params)).correct(batch, None, step=1)
        old_lp = fields.get("old_log_probs", batch["old_log_probs"])
        loss, _ = policy_loss(theta, old_lp, a, batch["response_mask"], clip_ratio=0.2,
                              rollout_is_weights=fields.get("rollout_is_weights"))
        assert float(loss) == pytest.approx(want, abs=1e-6), params["correction"]


def test_records_past_max_age_steps_leave_the_store():
    rt = runtime({**DOTS, "max_age_steps": 1, "dedup": False, "capacity": 100})
    kit = StepKit(rt)
    host_step(kit, 0, cycle)
    host_step(kit, 1, cycle)
    _, batch, m2 = host_step(kit, 3, cycle)  # steps 0 and 1 are older than 1 step at step 3
    assert m2["dataflex/replay/evicted_stale"] > 0 and m2["dataflex/replay/empty"] == 1
    assert not bool((batch["replay_row"] >= 0).any()) if batch.has("replay_row") else True


def test_d5_the_dots_buffer_keeps_the_newest_copy_of_each_prompt_and_the_newest_groups():
    table = PromptTable.full(["d"], [6], column="row")
    store = ReplayStore(table, capacity=4 * 2)  # C = 4 groups of 2 rows

    def groups(prompts: list[int], step: int) -> Record:
        n = 2 * len(prompts)
        return Record(prompt=torch.tensor(prompts).repeat_interleave(2), group=torch.arange(n) // 2,
                      version=torch.full((n,), step), reward=torch.zeros(n), priority=torch.zeros(n),
                      advantage=torch.zeros(n), domain=torch.zeros(n, dtype=torch.long),
                      length=torch.ones(n, dtype=torch.long), mu=torch.zeros(n, 1))

    store.insert(groups([1, 2], step=0))   # p1(t-2), p2(t-2)
    store.insert(groups([3, 1], step=1))   # p3(t-1), p1(t-1)
    assert store.dedup() == 2              # the older p1 leaves
    kept = store.gather(torch.nonzero(store.occupied).flatten())
    assert sorted(zip(kept.prompt.tolist()[::2], kept.version.tolist()[::2])) == [(1, 1), (2, 0), (3, 1)]
    store.insert(groups([4, 5], step=2))   # the fresh sigma*B = 2 groups: the oldest (p2) makes room
    left = store.gather(torch.nonzero(store.occupied).flatten())
    assert sorted(zip(left.prompt.tolist()[::2], left.version.tolist()[::2])) == [(1, 1), (3, 1), (4, 2), (5, 2)]


# ---------------------------------------------------------------------------- RePO
def test_repo_replays_a_prompts_rows_once_enough_are_stored_in_a_group_of_their_own():
    kit = StepKit(runtime(REPO))
    same = lambda i, n: [0, 1, 2, 3]  # noqa: E731  (every step draws the same prompts)
    _, _, m0 = host_step(kit, 0, same)
    _, _, m1 = host_step(kit, 1, same)
    assert m0["dataflex/replay/rows"] == m1["dataflex/replay/rows"] == 0  # fewer than 2N stored per prompt
    step, batch, m2 = host_step(kit, 2, same)
    assert m2["dataflex/replay/fresh_prompts"] == 4 and m2["dataflex/replay/rows"] == 4 * N
    replayed = batch["replay_row"] >= 0
    rec = part(step).replayed.record
    # highest_k: the N best stored rows of each prompt, older first among equals
    assert rec.prompt.tolist() == [p for p in [0, 1, 2, 3] for _ in range(N)]
    # split: a prompt's replayed rows form a group apart from its fresh rows
    assert set(batch.group_index[replayed].tolist()).isdisjoint(batch.group_index[~replayed].tolist())
    # behaviour: the replayed rows' PPO ratio is taken against the stored mu, weights untouched
    assert torch.equal(batch["old_log_probs"][replayed], batch["rollout_log_probs"][replayed])
    assert not torch.equal(batch["old_log_probs"][~replayed], batch["rollout_log_probs"][~replayed])
    assert bool((batch["rollout_is_weights"] == 1).all())
    assert m2["compute/generated_rollouts"] == 3 * 4 * N and m2["compute/replayed_rows"] == 4 * N


def test_mixed_advantage_mode_puts_replayed_rows_in_their_prompts_fresh_group():
    kit = StepKit(runtime({**REPO, "advantage": "mixed"}))
    same = lambda i, n: [0, 1, 2, 3]  # noqa: E731
    host_step(kit, 0, same)
    host_step(kit, 1, same)
    _, batch, _ = host_step(kit, 2, same)
    assert batch.num_groups == 4 and bool((batch.group_sizes == 2 * N).all())


def test_a_replayed_group_of_one_row_is_not_replayed():
    kit = StepKit(runtime({**REPO, "replays": 1, "min_to_replay": 1}))
    host_step(kit, 0, lambda i, n: [0, 1, 2, 3])
    _, _, m = host_step(kit, 1, lambda i, n: [0, 1, 2, 3])
    assert m["dataflex/replay/singletons"] == 4 and m["dataflex/replay/rows"] == 0


# ---------------------------------------------------------------------------- the store
def test_padding_rows_never_enter_the_store():
    rt = runtime(DOTS)
    kit = StepKit(rt)
    host_step(kit, 0, cycle, padding=3)
    assert len(buffer(rt).store) == 4 * N


def test_rows_with_nonfinite_behaviour_log_probs_are_trained_but_not_stored():
    rt = runtime(REPO)
    kit = StepKit(rt)
    _, _, m = host_step(kit, 0, cycle, mu=float("nan"))
    assert m["dataflex/replay/nonfinite_rows"] == 4 * N and len(buffer(rt).store) == 0
    assert m["dataflex/trained/rows"] == 4 * N


def record(prompts, groups, step=0, width=2):
    n = len(prompts)
    return Record(prompt=torch.tensor(prompts), group=torch.tensor(groups), version=torch.full((n,), step),
                  reward=torch.arange(n, dtype=torch.float32), priority=torch.zeros(n), advantage=torch.zeros(n),
                  domain=torch.zeros(n, dtype=torch.long), length=torch.full((n,), width),
                  mu=-torch.ones(n, width), payload={"responses": torch.arange(n * width).reshape(n, width) * 1000},
                  lengths={"responses": torch.full((n,), width)})


def test_a_full_store_evicts_its_oldest_groups_whole():
    store = ReplayStore(PromptTable.full(["d"], [10], column="row"), capacity=5)
    store.insert(record([0, 0, 1, 1], [0, 0, 1, 1]))
    out = store.insert(record([2, 2], [0, 0]))
    assert out["evicted_capacity"] == 2 and sorted(store["prompt"][store.occupied].tolist()) == [1, 1, 2, 2]
    out = store.insert(record([3] * 7, [0] * 7))  # more than it holds: its last 5 rows
    assert out["truncated"] == 2 and len(store) == 5


def test_the_per_prompt_bound_evicts_a_prompts_oldest_rows():
    store = ReplayStore(PromptTable.full(["d"], [10], column="row"), capacity=50, per_prompt=3)
    store.insert(record([4, 4], [0, 0], step=0))
    store.insert(record([4, 4, 5], [0, 0, 1], step=1))
    rows = store.gather(torch.nonzero(store.occupied & (store["prompt"] == 4)).flatten())
    assert sorted(rows.version.tolist()) == [0, 1, 1] and len(store) == 4


def test_integer_payload_is_stored_narrow_and_handed_back_as_given():
    store = ReplayStore(PromptTable.full(["d"], [10], column="row"), capacity=8)
    store.insert(record([0, 1], [0, 1]))
    (chunk,) = store.chunks.values()
    assert chunk.fields["responses"].values.dtype == torch.int16
    back = store.gather(torch.nonzero(store.occupied).flatten())
    assert back.payload["responses"].dtype == torch.long
    assert back.payload["responses"].tolist() == [[0, 1000], [2000, 3000]]
    wide = record([2], [0])
    wide.payload["responses"] = torch.tensor([[2**40, 1, 2]])
    wide.lengths["responses"] = torch.tensor([3])
    wide.mu = -torch.ones(1, 3)
    store.insert(wide)  # wider values and a wider row: read back at the widest, nothing is cut
    back = store.gather(torch.nonzero(store.occupied).flatten())
    assert back.payload["responses"][-1].tolist() == [2**40, 1, 2] and back.payload["responses"].shape[1] == 3
    assert back.payload["responses"][0].tolist() == [0, 1000, 0] and back.lengths["responses"].tolist() == [2, 2, 3]
    assert store.nbytes() > 0


def test_a_checkpointed_store_resumes_exactly_and_refuses_another_dataset():
    rt = runtime(DOTS)
    kit = StepKit(rt)
    for i in range(3):
        host_step(kit, i, cycle)
    state = rt.state_dict()
    again = runtime(DOTS)
    again.load_state_dict(state)
    for name, col in buffer(rt).store.columns.items():
        assert torch.equal(col, buffer(again).store.columns[name]), name
    a, b = StepKit(rt), StepKit(again)
    _, x, _ = host_step(a, 3, cycle)
    _, y, _ = host_step(b, 3, cycle)
    assert torch.equal(x["responses"], y["responses"]) and torch.equal(x["rollout_is_weights"], y["rollout_is_weights"])
    other = runtime(DOTS, prompts=PROMPTS + 1)
    with pytest.raises(ConfigError, match="replay buffer in the checkpoint was written for another dataset"):
        other.load_state_dict(state)


def test_a_host_that_forgets_to_store_is_told_at_the_step_end():
    kit = StepKit(runtime(DOTS))
    step = kit.begin(0)
    fresh = rollouts(cycle(0, part(step).fresh_prompts(4)), 0)
    step.count_generated(fresh)
    part(step).replay(fresh)
    step.advantage(with_advantages(fresh))
    with pytest.raises(DataflexError, match=r"never handed them to ReplayPart\.store"):
        step.end(fresh)


def test_a_step_skipped_before_its_replay_stores_nothing():
    rt = runtime(DOTS)
    kit = StepKit(rt)
    step = kit.begin(0)
    fresh = rollouts(cycle(0, part(step).fresh_prompts(4)), 0)
    step.count_generated(fresh)  # an empty selection at on_rollout: the host goes on without ReplayPart.replay
    action = step.advantage(with_advantages(fresh))
    assert action.store is None
    step.end(fresh)
    assert len(buffer(rt).store) == 0


def test_replay_is_refused_with_refill_and_on_a_host_without_the_capability():
    from dataflex_bus.validation import validate

    with pytest.raises(ConfigError, match="dynamic sampling with refill: use one of the two"):
        validate({**block(**DOTS), "refill": {"gen_batch_size": 8}})
    host = ANY_HOST.replace(name="tiny", capabilities=ANY_HOST.capabilities - {"replay"},
                            missing={"replay": "it has no old-log-prob pass"})
    with pytest.raises(ConfigError, match=r"adds stored rows .* host .tiny. cannot carry out: it lacks replay "
                                          r"\(it has no old-log-prob pass\)"):
        validate(block(**DOTS), host=host)
    with pytest.raises(ConfigError, match="one replayer"):
        validate({"methods": [{**block(**DOTS), "name": "a"}, {**block(**REPO), "name": "b"}]})


def test_the_store_is_bounded_by_its_capacity_whatever_the_run_length():
    rt = runtime({**DOTS, "capacity": 8 * N, "dedup": False, "max_age_steps": 0})
    kit = StepKit(rt)
    sizes = []
    for i in range(12):
        host_step(kit, i, cycle)
        sizes.append(buffer(rt).store.nbytes())
    store = buffer(rt).store
    assert len(store) == 8 * N
    # Sized by the tokens held: once full, the bytes stay within a bound set by the rows held (not growing
    # with the run), the evicted rows' share of a chunk at most DEAD_SHARE.
    held = max(sizes[4:])
    tokens = int(store["length"][store.occupied].sum())
    assert max(sizes[4:]) - min(sizes[4:]) < held / 2
    # per stored token: ids at 1 byte, rm_scores and mu at 4, the row's columns over its few tokens
    assert store.nbytes() / tokens < 60
