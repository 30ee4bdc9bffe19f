"""Absurd sizes are validation errors naming the key, before any work; the sizes a laptop runs pass."""

from __future__ import annotations

import pytest

from dataflex_bus.errors import ConfigError
from dataflex_bus.shim.config import prepare
from dataflex_bus.shim.sizes import GIB, check_memory, estimate, machine_memory

from .conftest import tiny


@pytest.mark.parametrize(("section", "key", "value", "named"), [
    ("trainer", "group_size", 100_000_000_000, "trainer.group_size"),
    ("trainer", "prompts_per_step", 10**12, "trainer.prompts_per_step"),
    ("model", "hidden", 10**7, "model.hidden"),
    ("model", "layers", 10**9, "model.layers"),
    ("model", "pretrain_batch", 10**11, "model.pretrain_batch"),
    ("trainer", "steps", 10**13, "trainer.steps"),
])
def test_absurd_sizes_name_their_key(section, key, value, named):
    sections = {section: {key: value}}
    with pytest.raises(ConfigError) as info:
        prepare(tiny(**sections))
    assert [i.key for i in info.value.issues] == [named]
    message = info.value.issues[0].message
    assert message.startswith(f"{value} makes the run need about") and f"reduce {named}" in message


def test_held_out_prompts_cost_only_when_evaluated():
    def heldout_bytes(every):
        terms = estimate(prepare(tiny(trainer={"eval_every": every}, data={"heldout": 900})).resolved)
        return next(t.bytes for t in terms if t.key == "data.heldout")

    assert heldout_bytes(0) == 0 and heldout_bytes(5) > 0


def test_sizes_are_checked_with_other_problems_at_once():
    with pytest.raises(ConfigError) as info:
        prepare(tiny(trainer={"group_size": 100_000_000_000, "lr": "fast"}))
    assert sorted(i.key for i in info.value.issues) == ["trainer.group_size", "trainer.lr"]


def test_default_and_example_sizes_pass():
    prepare({})
    prepare(tiny(trainer={"prompts_per_step": 256, "group_size": 16}, model={"hidden": 256, "layers": 2}))


def test_the_estimate_grows_with_each_size_and_the_limit_decides():
    base = prepare(tiny()).resolved
    total = sum(t.bytes for t in estimate(base))
    for section, key in (("trainer", "group_size"), ("trainer", "prompts_per_step"), ("model", "hidden"),
                         ("model", "layers"), ("model", "pretrain_batch"), ("trainer", "steps")):
        bigger = prepare(tiny(**{section: {key: base[section][key] * 4}})).resolved
        assert sum(t.bytes for t in estimate(bigger)) > total, key
    assert check_memory(base, limit=total) is None
    issue = check_memory(base, limit=total - 1)
    assert issue is not None and "this machine has" in issue.message


def test_machine_memory_is_known_here():
    assert machine_memory() >= GIB
