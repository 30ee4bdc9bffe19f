"""A replay store restored from a checkpoint is checked as new rows are: a state that passed its file's checksum
but holds rows no insert could have written (a negative slot, prompt ids outside the table, NaN behaviour
log-probs, a missing column) is refused at restore, naming the column, not trained on (a silent divergence, or a
non-finite gradient later blamed on the method)."""

from __future__ import annotations

import pytest
import torch

from dataflex_bus.errors import ConfigError
from dataflex_bus.history import PromptTable
from dataflex_bus.replay import Record, ReplayStore
from dataflex_bus.replay import ReplayStore as Reexported
from dataflex_bus.replay_store import ReplayStore as Store
from dataflex_bus.replay_store import preallocated_bytes


def store(capacity: int = 8) -> ReplayStore:
    return ReplayStore(PromptTable.full(["d"], [10], column="row"), capacity=capacity)


def saved() -> dict:
    s = store()
    n = 4
    s.insert(Record(prompt=torch.tensor([0, 0, 3, 3]), group=torch.tensor([0, 0, 1, 1]),
                    version=torch.zeros(n, dtype=torch.long), reward=torch.tensor([1.0, 0.0, 1.0, 0.0]),
                    priority=torch.zeros(n), advantage=torch.zeros(n), domain=torch.zeros(n, dtype=torch.long),
                    length=torch.full((n,), 2), mu=-torch.ones(n, 2),
                    payload={"responses": torch.arange(2 * n).reshape(n, 2)}))
    return s.state_dict()


def test_a_sound_state_restores():
    s = store()
    s.load_state_dict(saved())
    assert len(s) == 4 and s["prompt"][s.occupied].tolist() == [0, 0, 3, 3]


def damage_slot(state):
    state["slots"][0] = -1


def damage_prompt(state):
    state["columns"]["prompt"][1] = 10


def damage_mu(state):
    state["chunks"][0]["mu"]["values"][1] = float("nan")


def damage_group(state):
    state["columns"]["group"][0] = -3


def drop_column(state):
    del state["columns"]["reward"]


def short_column(state):
    state["columns"]["seq"] = state["columns"]["seq"][:2]


def twice(state):
    state["slots"][1] = state["slots"][0]


@pytest.mark.parametrize(("damage", "column"), [
    (damage_slot, "slots holds slots outside"), (damage_prompt, "column 'prompt' holds values outside [0, 10)"),
    (damage_mu, "column 'mu' holds non-finite"), (damage_group, "column 'group' holds values outside"),
    (drop_column, "columns are"), (short_column, "column 'seq' has (2,) for 4 slots"),
    (twice, "slots holds a slot twice")])
def test_a_damaged_state_is_refused_naming_the_column(damage, column):
    state = saved()
    damage(state)
    s = store()
    with pytest.raises(ConfigError) as err:
        s.load_state_dict(state)
    message = str(err.value)
    assert "replay buffer in the checkpoint is damaged" in message and column in message
    assert len(s) == 0  # nothing half-restored


def with_objects(check=None) -> tuple[ReplayStore, dict]:
    """A store whose host keeps one object per row (TRL, verl), and its saved state."""
    s = store()
    s.object_check = check
    n = 4
    s.insert(Record(prompt=torch.tensor([0, 0, 3, 3]), group=torch.tensor([0, 0, 1, 1]),
                    version=torch.zeros(n, dtype=torch.long), reward=torch.zeros(n), priority=torch.zeros(n),
                    advantage=torch.zeros(n), domain=torch.zeros(n, dtype=torch.long), length=torch.full((n,), 2),
                    mu=-torch.ones(n, 2), objects=[{"row": r} for r in (0, 0, 3, 3)]))
    fresh = store()
    fresh.object_check = check
    return fresh, s.state_dict()


def row_in_range(obj):
    """A host's check of one stored object (here: a mapping whose 'row' is a row of a 10-row dataset)."""
    if not isinstance(obj, dict):
        return f"is a {type(obj).__name__}, not a mapping"
    if not 0 <= obj.get("row", -1) < 10:
        return f"'row' {obj.get('row')!r} is outside [0, 10)"
    return None


@pytest.mark.parametrize(("damage", "message"), [
    (lambda s: s.update(objects=s["objects"][:2]), "objects has 2 entries for 4 slots"),
    (lambda s: s.update(objects={"row": 0}), "objects is a dict, not a list"),
    (lambda s: s.update(objects=None), "objects is None, but this run's host stores one object per row"),
    (lambda s: s["objects"].__setitem__(1, None), "objects[1] is a NoneType, not a mapping"),
    (lambda s: s["objects"].__setitem__(2, 7), "objects[2] is a int, not a mapping"),
    (lambda s: s["objects"][3].update(row=99), "objects[3] 'row' 99 is outside [0, 10)"),
], ids=["short", "not-a-list", "none", "none-entry", "wrong-type", "out-of-range"])
def test_malformed_per_row_objects_are_refused_at_restore_naming_the_field(damage, message):
    """Before: a shortened list restored with None objects, accepted, then a raw TypeError at the first replay."""
    s, state = with_objects(row_in_range)
    damage(state)
    with pytest.raises(ConfigError) as err:
        s.load_state_dict(state)
    text = str(err.value)
    assert "replay buffer in the checkpoint is damaged" in text and message in text
    assert len(s) == 0  # nothing half-restored


def test_a_shortened_object_list_is_refused_without_a_host_check_too():
    s, state = with_objects()
    state["objects"] = state["objects"][:3]
    with pytest.raises(ConfigError, match="objects has 3 entries for 4 slots"):
        s.load_state_dict(state)
    s, state = with_objects(row_in_range)
    s.load_state_dict(state)  # sound objects restore
    assert s.gather(torch.nonzero(s.occupied).flatten()).objects == [{"row": 0}, {"row": 0}, {"row": 3}, {"row": 3}]


@pytest.mark.parametrize("emptied", [{}, {"table": saved()["table"]}], ids=["empty", "table-only"])
def test_an_emptied_store_is_refused_as_damaged_naming_the_missing_entries_not_as_another_dataset(emptied):
    with pytest.raises(ConfigError) as err:
        store().load_state_dict(emptied)
    text = str(err.value)
    assert "replay buffer in the checkpoint is damaged" in text and "'slots'" in text and "missing" in text
    assert "another dataset" not in text


def test_the_store_lives_in_its_own_module_and_stays_importable_from_replay():
    assert Store is Reexported
    assert preallocated_bytes(10) == store(10).nbytes()  # what a new store allocates, computed without it
