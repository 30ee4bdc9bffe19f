"""Allocation on TRL, exact where plain TRL has the same run: an allocation of ``num_generations`` rollouts to
every prompt is plain TRL bit for bit (the host's advantages over ragged groups reproduce TRL's), and an
allocation of 8 rollouts to half the candidates (0 to the rest) is plain TRL run with ``num_generations=8`` on
those prompts alone, bit for bit. Groups of unequal sizes get TRL's formula per group (test_trl_advantages.py)."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("trl")

import torch
import trl_tiny as T
from trl_methods import by_position

from dataflex_bus.trl import DataflexGRPOTrainer

pytestmark = pytest.mark.trl

MIXED, FLAT = T.prompts()


@pytest.fixture
def allocate(register):
    """``allocate(counts, **params)``: the block allocating ``counts[i % len(counts)]`` rollouts to position ``i``."""

    def block(counts: list[int], **params: Any) -> dict[str, Any]:
        return by_position(register, counts, **params)

    return block


@pytest.mark.parametrize(("loss_type", "spg", "ga", "it"), [("dapo", 1, 1, 1), ("grpo", 2, 2, 1), ("bnpo", 2, 1, 1),
                                                            ("dr_grpo", 1, 1, 2)])
def test_num_generations_for_every_prompt_is_plain_trl_bit_for_bit(allocate, loss_type, spg, ga, it):
    rows = MIXED[:4] + FLAT[:4]
    kw = dict(rows=rows, rows_per_gen=16, spg=spg, ga=ga, num_iterations=it, loss_type=loss_type,
              steps=2 * spg * it // ga)
    a = T.train(DataflexGRPOTrainer, trainer_kwargs={"dataflex": allocate([T.G])}, **kw)
    b = T.train(**kw)
    metrics = a["trainer"].dataflex_metrics
    assert [m["dataflex/alloc/rollouts"] for m in metrics] == [16.0, 16.0]
    assert [m["dataflex/compute/filler_rollouts"] for m in metrics] == [0.0, 0.0]
    assert T.compare(a, b) == 0.0
    assert a["losses"] == b["losses"]


@pytest.mark.parametrize(("scale_rewards", "aggregation"), [("group", "sum_then_normalize"),
                                                            ("batch", "sum_then_normalize"),
                                                            ("none", "sum_then_normalize"),
                                                            ("group", "normalize_then_sum")])
def test_eight_rollouts_for_half_the_prompts_is_plain_trl_with_groups_of_eight(allocate, scale_rewards,
                                                                               aggregation):
    """Counts [8, 8, 0, 0] over draws of 4 candidates: the kept prompts' groups of 8 trained as plain TRL
    with num_generations=8 trains them (two reward functions, every advantage mode)."""
    kept, skipped = MIXED[:4], FLAT[:4]
    common = dict(rows_per_gen=16, spg=2, ga=2, steps=2, reward_funcs=[T.correct, T.length],
                  scale_rewards=scale_rewards, multi_objective_aggregation=aggregation)
    draws = [row for i in (0, 2) for row in kept[i:i + 2] + skipped[i:i + 2]]  # kept, kept, skipped, skipped
    a = T.train(DataflexGRPOTrainer, rows=draws,
                trainer_kwargs={"dataflex": allocate([8, 8, 0, 0])}, **common)
    b = T.train(rows=kept, num_generations=8, **common)
    metrics = a["trainer"].dataflex_metrics
    assert [m["dataflex/alloc/rollouts"] for m in metrics] == [16.0, 16.0]
    assert [m["dataflex/alloc/skipped"] for m in metrics] == [2.0, 2.0]
    assert [m["compute/generated_rollouts"] for m in metrics] == [16.0, 32.0]
    assert T.compare(a, b) == 0.0
    assert a["losses"] == b["losses"]


def test_ragged_groups_train_each_group_with_its_own_statistics(allocate):
    """Counts [2, 6, 1, 7]: every rollout generated is trained, with TRL's advantage over its own group (a
    group of one: 0), and counted."""
    a = T.train(DataflexGRPOTrainer, rows=MIXED[:8], rows_per_gen=16, spg=2, ga=2, steps=2,
                trainer_kwargs={"dataflex": allocate([2, 6, 1, 7], min_n=1, singletons=True)})
    m = a["trainer"].dataflex_metrics
    assert [x["compute/generated_rollouts"] for x in m] == [16.0, 32.0]
    assert [x["dataflex/trained/rows"] for x in m] == [16.0, 16.0]
    assert [x["dataflex/alloc/max"] for x in m] == [7.0, 7.0] and [x["dataflex/alloc/min"] for x in m] == [1.0, 1.0]
    trainer = a["trainer"]
    logged = list(trainer._logs["advantages"])[-16:]
    rewards = torch.tensor(list(trainer._logs["rewards"]["correct"])[-16:])
    sizes = [2, 6, 1, 7]
    at = 0
    for size in sizes:
        r, adv = rewards[at:at + size], torch.tensor(logged[at:at + size])
        if size == 1 or bool((r == r[0]).all()):
            assert bool((adv == 0).all()), (size, r, adv)
        else:
            want = (r - r.mean()) / (r.std() + 1e-4)
            assert torch.allclose(adv, want, atol=1e-6), (size, r, adv)
        at += size


def test_server_mode_vllm_generation_refuses_an_allocation_naming_the_mode(allocate):
    """Colocated vLLM generates one completion per request (any count per prompt); server mode cannot."""
    from dataflex_bus.errors import ConfigError
    from dataflex_bus.trl.host import describe
    from dataflex_bus.validation import validate

    with pytest.raises(ConfigError) as err:
        validate(allocate([4]), host=describe({"num_generations": 4, "use_vllm": True, "vllm_mode": "server"}))
    text = str(err.value)
    assert "'trl'" in text and "ragged_groups" in text and "vllm_mode='colocate'" in text
    validate(allocate([4]), host=describe({"num_generations": 4}))
    validate(allocate([4]), host=describe({"num_generations": 4, "use_vllm": True}))


@pytest.mark.parametrize("name", ["knapsack", "speed", "pilot_commit", "reinforce_ada"])
def test_the_allocation_examples_train_in_trl_unchanged(name):
    """Each example's block as written, three generation batches: what it allocates is what TRL generated."""
    from pathlib import Path

    from dataflex_bus.config import load_config

    block = load_config(Path(__file__).resolve().parents[2] / "examples" / f"{name}.yaml")["dataflex"]
    # 200 distinct prompts: Pilot-Commit's pilot rounds draw 192 at a time
    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(20) for b in range(10)]
    a = T.train(DataflexGRPOTrainer, rows=rows, rows_per_gen=16, steps=3, trainer_kwargs={"dataflex": block})
    m = a["trainer"].dataflex_metrics
    assert len(m) == 3
    assert m[-1]["compute/generated_rollouts"] == sum(x["dataflex/alloc/rollouts"] for x in m) > 0
    assert all(x["dataflex/trained/rows"] > 0 or x["dataflex/skipped_update"] == 1 for x in m)
