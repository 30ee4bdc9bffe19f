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
    state["mu"][2, 1] = float("nan")


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


def test_the_store_lives_in_its_own_module_and_stays_importable_from_replay():
    assert Store is Reexported
    assert preallocated_bytes(10) == store(10).nbytes()  # what a new store allocates, computed without it
