"""The allocation contract: counts in, rollouts out. An allocator's counts, whatever their pattern (a prefix of
the candidates, a suffix, scattered, the whole budget on the first, nothing at all), are exactly what every
host generates and trains: the rollouts of each prompt equal its count, no other prompt is generated. A host
that cannot generate ragged groups skips it (it refuses the block: test_contract.py)."""

from __future__ import annotations

import allocation_components  # noqa: F401  (registers contract_counts, the same on every host)
import pytest
from test_contract import needs
from world import N, StepRecord, World

pytestmark = pytest.mark.hosts

WORLD = World()
BATCH = 6  # the world's six prompts, drawn in dataset order: copy 0, 1, sort 2, 3, reverse 4, 5
COUNTS = {
    "first": [24, 0, 0, 0, 0, 0],
    "prefix": [12, 12, 0, 0, 0, 0],
    "suffix": [0, 0, 0, 0, 12, 12],
    "scattered": [6, 0, 8, 0, 0, 10],
    "all-zero": [0, 0, 0, 0, 0, 0],
}


def block(counts: list[int]) -> dict:
    return {"mechanism": "allocate", "on_empty": "skip", "scorer": {"name": "contract_prompt_index"},
            "actuator": {"name": "contract_counts", "params": {"counts": counts, "max_n": 24}}}


def per_prompt(record: StepRecord) -> list[int]:
    """Trained rollouts of each of the world's prompts, in dataset order."""
    out = [0] * len(WORLD.prompts)
    for _, row, _, _ in record.trained:
        out[row] += 1
    return out


@pytest.mark.parametrize("pattern", sorted(COUNTS))
def test_an_allocations_counts_are_the_rollouts_generated(host, pattern, tmp_path):
    counts = COUNTS[pattern]
    b = block(counts)
    lacking = sorted(needs(b) - host.description().capabilities)
    if lacking:
        pytest.skip(f"host {host.name!r} lacks {lacking}")
    (r,) = host.run(b, WORLD, batch=BATCH, steps=1, tmp_path=tmp_path)
    m = r.metrics
    if sum(counts) == 0:  # on_empty=skip: one candidate goes through at the group size, its update skipped
        assert r.skipped and not r.trained
        assert m["compute/generated_rollouts"] == N and m["dataflex/prompts_generated"] == 1
        assert m["dataflex/alloc/covered"] == 1
        return
    assert not r.skipped and per_prompt(r) == counts
    generated = sum(c > 0 for c in counts)
    assert m["compute/generated_rollouts"] == sum(counts) == m["dataflex/alloc/rollouts"]
    assert m["dataflex/prompts_generated"] == generated == m["dataflex/alloc/covered"]
    assert m["dataflex/alloc/skipped"] == len(counts) - generated


@pytest.mark.parametrize(("block", "key"), [
    ({"mechanism": "replay", "scorer": {"name": "reward_difficulty"},
      "actuator": {"name": "rollout_replay", "params": {"capacity": 10**10}}}, "capacity"),
    ({"mechanism": "allocate", "scorer": {"name": "knapsack_rate"},
      "actuator": {"name": "knapsack", "params": {"budget": 10**9, "max_n": 10**9}}}, "budget"),
], ids=["replay-capacity", "allocate-budget"])
def test_an_absurd_size_is_refused_at_validation_on_every_host(host, block, key):
    from dataflex_bus.errors import ConfigError
    from dataflex_bus.validation import validate

    description = host.description()
    # its needs read without the absurd parameter, which validation refuses first
    sane = {k: v for k, v in block.items() if k != "actuator"} | {"actuator": {"name": block["actuator"]["name"]}}
    lacking = sorted(needs(sane) - description.capabilities)
    if lacking:
        pytest.skip(f"host {host.name!r} lacks {lacking} (refused for that first)")
    with pytest.raises(ConfigError) as err:
        validate(block, host=description)
    assert f"dataflex.actuator.params.{key}:" in str(err.value) and "bytes) of memory" in str(err.value)
