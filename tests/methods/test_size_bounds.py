"""Sizes a block asks for are checked against the host and this machine at validation, before anything is
allocated: a replay capacity or an allocator budget/max_n too large for memory (refused naming the key and the
bytes), a replay buffer that could never hold what it is to replay, and knapsack's step-0 floors (its budget
and max_n against the host's group size), by `dataflex validate` as by every host."""

from __future__ import annotations

import pytest

from dataflex_bus.cli import main
from dataflex_bus.errors import ConfigError
from dataflex_bus.host import ANY_HOST
from dataflex_bus.shim import run_training
from dataflex_bus.validation import validate

SHIM_HOST = ANY_HOST.replace(name="shim", group_size=4, prompts_per_step=8)


def replay(**params):
    return {"mechanism": "replay", "scorer": {"name": "reward_difficulty"},
            "actuator": {"name": "rollout_replay", "params": params}}


def knapsack(**params):
    return {"mechanism": "allocate", "scorer": {"name": "knapsack_rate"},
            "actuator": {"name": "knapsack", "params": params}}


def refusal(block, host=ANY_HOST) -> str:
    with pytest.raises(ConfigError) as err:
        validate(block, host=host)
    return str(err.value)


@pytest.mark.parametrize(("block", "key"), [
    (replay(capacity=10**10), "capacity"),
    (knapsack(budget=10**9, max_n=10**9), "budget"),
    (knapsack(max_n=10**9), "max_n"),
], ids=["replay-capacity", "allocate-budget", "allocate-max_n"])
def test_a_size_beyond_this_machines_memory_is_refused_naming_the_key_and_the_bytes(block, key):
    message = refusal(block)  # any host: the bound is this machine's, not a host's
    assert f"dataflex.actuator.params.{key}:" in message and "bytes) of memory, but this machine has" in message


def test_the_shim_refuses_an_absurd_capacity_before_allocating_or_writing_a_run(tmp_path):
    cfg = {"trainer": {"steps": 1, "group_size": 4, "prompts_per_step": 4}, "model": {"pretrain_steps": 0},
           "dataflex": replay(capacity=10**10)}
    with pytest.raises(ConfigError, match=r"capacity=10,000,000,000 stored rows at .* a row .* need at least"):
        run_training(cfg, out=tmp_path / "run")
    assert not (tmp_path / "run" / "run.json").exists()


def test_a_buffer_smaller_than_a_group_is_refused():
    message = refusal(replay(unit="prompt", capacity=3), SHIM_HOST)
    assert "dataflex.actuator.params.capacity" in message and "less than one group of 4" in message
    validate(replay(unit="prompt", capacity=4), host=SHIM_HOST)


def test_a_group_buffer_smaller_than_one_steps_replay_is_warned_about():
    # fresh_fraction 0.5 of 8 prompts: 4 stored groups of 4 replace fresh ones each step
    (warning,) = validate(replay(capacity=12), host=SHIM_HOST).warnings
    assert warning.key == "dataflex.actuator.params.capacity"
    assert "holds 3 of the 4 groups of 4 one step replays" in warning.message and "capacity >= 16" in warning.message
    assert not validate(replay(capacity=16), host=SHIM_HOST).warnings


@pytest.mark.parametrize(("params", "key", "text"), [
    ({"budget": 8}, "budget", "budget of 8 rollouts is below the floors' 32"),
    ({"max_n": 3}, "max_n", "group size 4 of host 'shim', outside [min_n=2, max_n=3]"),
    ({"min_n": 6, "max_n": 8}, "min_n", "outside [min_n=6, max_n=8]"),
])
def test_knapsacks_step_zero_floors_are_known_at_validation(params, key, text):
    message = refusal(knapsack(**params), SHIM_HOST)
    assert f"dataflex.actuator.params.{key}" in message and text in message
    validate(knapsack(**params))  # without the host's group size nothing is known yet


def test_dataflex_validate_refuses_knapsacks_floors_from_a_shim_config(tmp_path, capsys):
    path = tmp_path / "cfg.yaml"
    path.write_text("trainer: {steps: 3, group_size: 4, prompts_per_step: 8}\n"
                    "dataflex:\n  mechanism: allocate\n  scorer: {name: knapsack_rate}\n"
                    "  actuator: {name: knapsack, params: {budget: 8}}\n")
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err
    assert "dataflex.actuator.params.budget" in err and "below the floors' 32" in err


# ---------------------------------------------------------------------------- knapsack's DP (solver: dp)
GIB = 1024 ** 3


def test_knapsacks_dp_table_beyond_memory_is_refused_at_validation_naming_solver_and_bytes():
    """budget 40,000 x max_n 40,000: each prompt's DP row is a [40,001 x 39,999] float64 maximum (12.8 GB, twice
    over while it is built), which validation bounded only as 40,000 rollouts of 1 KiB: it trained until
    effective prompts appeared, then died allocating."""
    host = SHIM_HOST.replace(memory_limit=16 * GIB)
    message = refusal(knapsack(budget=40_000, max_n=40_000, solver="dp"), host)
    assert "dataflex.actuator.params.solver:" in message
    assert "budget=40,000" in message and "max_n=40,000" in message and "bytes) of memory" in message
    assert "solver: greedy" in message
    validate(knapsack(budget=40_000, max_n=40_000), host=host)  # greedy: an [E, max_n - min_n] sort


def test_a_modest_knapsack_dp_is_accepted_without_a_warning():
    cfg = validate(knapsack(budget=64, max_n=16, solver="dp"), host=SHIM_HOST.replace(memory_limit=GIB))
    assert not cfg.warnings


def test_a_slow_knapsack_dp_is_warned_about_with_its_seconds_per_allocation():
    """256 prompts x budget 16,384 (max_n 128): 5 x 10^8 DP cells, seconds per allocation (the greedy: 0.01 s)."""
    host = SHIM_HOST.replace(group_size=8, prompts_per_step=256)
    cfg = validate(knapsack(budget=16_384, solver="dp"), host=host)
    (warning,) = cfg.warnings
    assert warning.key == "dataflex.actuator.params.solver"
    assert "s per allocation" in warning.message and "solver: greedy" in warning.message
    assert not validate(knapsack(budget=16_384), host=host).warnings


def test_a_knapsack_dp_that_cannot_run_in_reasonable_time_is_refused():
    """1,024 prompts x budget 262,144 x max_n 512: 1.4 x 10^11 cells, about an hour per allocation, though its
    tables (3 GiB) fit."""
    host = SHIM_HOST.replace(group_size=8, prompts_per_step=1024, memory_limit=64 * GIB)
    message = refusal(knapsack(budget=262_144, max_n=512, solver="dp"), host)
    assert "dataflex.actuator.params.solver:" in message and "per allocation" in message


# ---------------------------------------------------------------------------- what a host's rows hold
def _shim_host():
    from dataflex_bus.shim.config import resolve_config
    from dataflex_bus.shim.host import describe

    return describe(resolve_config({"trainer": {"group_size": 4, "prompts_per_step": 8}}))


def _verl_host(prompt: int, response: int):
    from dataflex_bus.verl.host import describe

    return describe({"data": {"max_prompt_length": prompt, "max_response_length": response, "train_batch_size": 8},
                     "actor_rollout_ref": {"rollout": {"n": 4}}})


def test_every_host_sizes_a_rollout_row_from_what_its_rows_hold_not_the_floor():
    from dataflex_bus.memory import ROLLOUT_ROW_BYTES
    from dataflex_bus.shim.sizes import row_bytes

    shim = _shim_host()
    assert shim.row_bytes == row_bytes(64, 1) > 30 * ROLLOUT_ROW_BYTES  # the default GRU, 64 wide, one layer
    # verl's driver batch: 6 int64 ids/masks and 9 float32 values a response token (512 + 512: 54 KiB)
    assert _verl_host(512, 512).row_bytes == 3 * 1024 * 8 + 512 * 8 + 2 * 512 * 8 + 9 * 512 * 4
    assert _verl_host(1024, 4096).row_bytes > 6 * _verl_host(512, 512).row_bytes


@pytest.mark.parametrize(("host", "budget", "basis"), [
    ("shim", 200_000, "model.hidden 64"),
    ("verl", 1_000_000, "data.max_response_length 4096"),
])
def test_a_budget_beyond_memory_at_the_hosts_rows_is_refused_though_the_floor_would_pass(host, budget, basis):
    """The 1 KiB floor passed both (0.2 and 1 GB); the shim's rows take 34 KiB, verl's at 1,024 + 4,096 tokens
    336 KiB."""
    described = (_shim_host() if host == "shim" else _verl_host(1024, 4096)).replace(memory_limit=4 * GIB)
    message = refusal(knapsack(budget=budget, max_n=budget), described)
    assert "dataflex.actuator.params.budget:" in message and f"budget={budget:,}" in message
    assert f"a row on host {host!r}" in message and basis in message
    validate(knapsack(budget=budget, max_n=budget), host=ANY_HOST.replace(memory_limit=4 * GIB))  # the floor


def test_a_replay_capacity_is_sized_at_the_hosts_longest_rows():
    """verl at 2,048 + 8,192 tokens: a stored row takes about 215 KiB (packed, at the longest lengths), so a
    million rows (about 205 GiB) are refused on a 64 GiB machine naming capacity, the bytes per row and in all,
    and the fix; the default 4,096 rows (under 1 GiB) pass. The 1 KiB floor passed both."""
    from dataflex_bus.memory import STORED_ROW_BYTES, format_bytes
    from dataflex_bus.replay_store import preallocated_bytes

    host = _verl_host(2048, 8192).replace(memory_limit=64 * GIB, check=None)  # (its rules on correction aside)
    per_row = host.stored_row_bytes + preallocated_bytes(1)
    assert 200 * 1024 < per_row < 230 * 1024 and host.stored_row_bytes > 100 * STORED_ROW_BYTES
    message = refusal(replay(capacity=1_000_000), host)
    assert "dataflex.actuator.params.capacity:" in message and "capacity=1,000,000 stored rows" in message
    assert f"at {format_bytes(per_row)} a row" in message and "data.max_response_length 8192" in message
    assert f"need at least {format_bytes(1_000_000 * per_row)}" in message and "GiB" in message
    assert f"lower capacity (at most about {64 * GIB // per_row:,} rows fit)" in message
    validate(replay(capacity=4096), host=host)
    validate(replay(capacity=1_000_000), host=ANY_HOST.replace(memory_limit=64 * GIB))  # the floor would pass


def test_trl_sizes_a_stored_row_from_max_completion_length():
    from dataflex_bus.trl.host import describe

    short, long = (describe({"max_completion_length": c, "num_generations": 4}) for c in (256, 8192))
    assert long.stored_row_bytes > 20 * 8192 > short.stored_row_bytes
    assert "max_completion_length" in long.stored_row_basis
