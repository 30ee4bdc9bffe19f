"""TRL runs that stop and resume: the last generation batch of a run that ``max_steps`` ends inside is still
counted, logged and recorded (also after a mid-batch resume), and a checkpoint's per-prompt state (history,
replay buffer) resumes only on the dataset it was written for, identified by its content, not its size."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("trl")

import torch
import trl_tiny as T

from dataflex_bus.trl import DataflexGRPOTrainer

pytestmark = pytest.mark.trl

MIXED, FLAT = T.prompts()
#: Keeps a per-prompt history (GRESO reads it before generation): state keyed by the dataset's rows.
GRESO = {"methods": [
    {"name": "greso", "mechanism": "select", "scorer": {"name": "zero_variance_streak"},
     "actuator": {"name": "greso", "params": {"p_easy_init": 0.5, "p_hard_init": 0.5, "adapt_from_epoch": 0}}},
    {"name": "dapo", "mechanism": "select", "scorer": {"name": "reward_difficulty"}, "actuator": {"name": "dapo"}}]}


def _generated(run: dict[str, Any]) -> float:
    return float(run["trainer"].dataflex_kit.counters["generated_rollouts"])


def test_max_steps_inside_a_generation_batch_still_counts_logs_and_records_that_batch():
    """Before: 2 optimizer steps per generation batch and max_steps=3: the second batch's 16 rollouts were
    generated and trained but its step never ended (no metrics, no history step), the last log saying 16."""
    run = T.train(DataflexGRPOTrainer, rows=T.interleave(MIXED[:8], FLAT[:8], 2, 2), rows_per_gen=16, spg=2,
                  steps=3, trainer_kwargs={"dataflex": GRESO})
    trainer = run["trainer"]
    assert len(trainer.dataflex_metrics) == 2
    last = trainer.dataflex_metrics[-1]
    assert last["compute/generated_rollouts"] == _generated(run) >= 32
    assert run["logs"][-1]["step"] == 3 and run["logs"][-1]["compute/generated_rollouts"] == _generated(run)
    assert trainer.dataflex.history.completed[0] == 1  # the history closed the second batch's step


def test_max_steps_inside_a_generation_batch_after_a_mid_batch_resume_still_ends_that_batch(tmp_path):
    kw = dict(rows=T.interleave(MIXED[:8], FLAT[:8], 2, 2), rows_per_gen=16, spg=2, steps=4, save_strategy="steps",
              save_steps=1, trainer_kwargs={"dataflex": GRESO})
    T.train(DataflexGRPOTrainer, out=str(tmp_path / "whole"), **kw)
    # Resumed at step 1, inside the first batch: TRL generates it again (steps 2-3), then a batch cut at step 4.
    resumed = T.train(DataflexGRPOTrainer, out=str(tmp_path / "resumed"), resume=str(tmp_path / "whole" /
                      "checkpoint-1"), **kw)
    trainer = resumed["trainer"]
    assert len(trainer.dataflex_metrics) == 2
    assert resumed["logs"][-1]["step"] == 4
    assert resumed["logs"][-1]["compute/generated_rollouts"] == _generated(resumed)
    assert trainer.dataflex_metrics[-1]["compute/generated_rollouts"] == _generated(resumed)


REPLAY = {"mechanism": "replay", "scorer": {"name": "reward_difficulty"},
          "actuator": {"name": "rollout_replay", "params": {
              "unit": "prompt", "priority": "highest", "advantage": "mixed", "correction": "behaviour",
              "per_prompt": 8, "min_to_replay": 4, "replays": 2, "capacity": 256}}}
ROWS = T.interleave(MIXED[:8], FLAT[:8], 2, 2)


def _reordered(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return rows[::-1]


def _replaced(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [*rows[:-1], MIXED[20]]  # one prompt swapped for another: same size


def _checkpoint(tmp_path: Any, block: dict[str, Any]) -> Any:
    T.train(DataflexGRPOTrainer, rows=ROWS, rows_per_gen=16, steps=2, save_strategy="steps", save_steps=1,
            out=str(tmp_path / "run"), trainer_kwargs={"dataflex": block})
    return tmp_path / "run" / "checkpoint-1"


@pytest.mark.parametrize("change", [_reordered, _replaced], ids=["reordered", "replaced"])
@pytest.mark.parametrize("block", [GRESO, REPLAY], ids=["history", "replay"])
def test_resume_on_another_dataset_of_the_same_size_is_refused_naming_the_checkpoint_and_the_column(
        tmp_path, block, change):
    """Before: TRL's prompt ids are row positions and only the row count was checked, so a reordered or
    replaced dataset of the same size resumed: each prompt's history (or stored rows) joined whatever prompt
    now sits at its row."""
    from dataflex_bus.errors import ConfigError

    checkpoint = _checkpoint(tmp_path, block)
    with pytest.raises(ConfigError) as err:
        T.train(DataflexGRPOTrainer, rows=change(ROWS), rows_per_gen=16, steps=2, out=str(tmp_path / "resumed"),
                resume=str(checkpoint), trainer_kwargs={"dataflex": block})
    text = str(err.value)
    assert str(checkpoint / "dataflex_state.pt") in text and "train_dataset" in text
    assert "of the same size (16 rows)" in text and "'prompt'" in text and "reordered or replaced" in text


def test_resume_on_a_dataset_of_another_size_says_the_row_counts(tmp_path):
    from dataflex_bus.errors import ConfigError

    checkpoint = _checkpoint(tmp_path, GRESO)
    with pytest.raises(ConfigError, match=r"written for a training dataset of 16 rows; this run's has 15"):
        T.train(DataflexGRPOTrainer, rows=ROWS[:15], rows_per_gen=16, steps=2, out=str(tmp_path / "resumed"),
                resume=str(checkpoint), trainer_kwargs={"dataflex": GRESO})


def test_a_checkpoint_without_the_dataset_s_identity_is_refused_where_state_is_keyed_by_row(tmp_path):
    """A checkpoint written before the dataset's content was recorded: per-prompt state cannot be checked
    against this dataset, so it is refused saying why; a block keeping nothing per row resumes as before."""
    from dataflex_bus.errors import ConfigError
    from dataflex_bus.state_file import read_state, save_state

    def strip(checkpoint: Any) -> None:
        path = checkpoint / "dataflex_state.pt"
        save_state(path, {k: v for k, v in read_state(path, "").items() if k != "dataset"})

    checkpoint = _checkpoint(tmp_path / "a", GRESO)
    strip(checkpoint)
    with pytest.raises(ConfigError, match=r"records only the training dataset's size.*cannot be checked"):
        T.train(DataflexGRPOTrainer, rows=ROWS, rows_per_gen=16, steps=2, out=str(tmp_path / "resumed"),
                resume=str(checkpoint), trainer_kwargs={"dataflex": GRESO})
    dapo = {k: v for k, v in GRESO["methods"][1].items() if k != "name"}
    checkpoint = _checkpoint(tmp_path / "b", dapo)
    strip(checkpoint)
    resumed = T.train(DataflexGRPOTrainer, rows=ROWS, rows_per_gen=16, steps=2, out=str(tmp_path / "resumed-b"),
                      resume=str(checkpoint), trainer_kwargs={"dataflex": dapo})
    assert resumed["trainer"].dataflex_batch.generations == 2


def test_a_dataset_s_identity_is_its_content_in_row_order_whatever_its_arrow_layout():
    """The same rows reached through a slice, an indices mapping or flattened indices hash the same (a resume
    on the same data is never refused); reordered or edited rows do not."""
    from datasets import Dataset

    from dataflex_bus.trl.dataset_id import identify

    rows = [{"prompt": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]} for r in MIXED[:20]]
    base = identify(Dataset.from_list(rows))
    padded = Dataset.from_list([*rows[:3], *rows])
    assert identify(padded.select(range(3, 23))) == base
    assert identify(padded.select(range(3, 23)).flatten_indices()) == base
    assert identify(Dataset.from_list(rows + rows).train_test_split(test_size=0.5, shuffle=False)["test"]) == base
    assert identify(Dataset.from_list(rows[::-1]))["columns"]["prompt"] != base["columns"]["prompt"]
    edited = identify(Dataset.from_list([*rows[:-1], {**rows[-1], "answer": "x"}]))
    assert edited["columns"]["prompt"] == base["columns"]["prompt"] != edited["columns"]["answer"]
    assert identify([dict(r) for r in rows]) == identify([dict(r) for r in rows])  # a plain list: row by row


@pytest.fixture(scope="module")
def replay_checkpoint(tmp_path_factory: Any) -> Any:
    """A checkpoint whose replay buffer holds rows (16 stored at step 1), written once for the module."""
    folder = tmp_path_factory.mktemp("replay")
    return _checkpoint(folder, REPLAY)


def _set(index: int, value: Any) -> Any:
    def damage(objects: list[Any]) -> list[Any]:
        objects[index] = value
        return objects
    return damage


def _entry(index: int, **changes: Any) -> Any:
    def damage(objects: list[Any]) -> list[Any]:
        objects[index] = {**objects[index], **changes}
        return objects
    return damage


@pytest.mark.parametrize(("damage", "message"), [
    (lambda objects: objects[:-3], "objects has 13 entries for 16 slots"),
    (lambda objects: None, "objects is None, but this run's host stores one object per row"),
    (_set(2, None), "objects[2] is None, not a stored row"),
    (_set(4, 7), "objects[4] is a int, not a stored row"),
    (_entry(5, row=99), "objects[5] 'row' is 99, outside the training dataset's rows [0, 16)"),
    (_entry(6, prompt_ids="1+2="), "objects[6] 'prompt_ids' is a str, not a list of token ids"),
    (_entry(7, rewards=torch.zeros(3)), "objects[7] 'rewards' holds 3 values, not 1 (one per reward function)"),
], ids=["short", "none", "none-entry", "wrong-type", "row-out-of-range", "ids-wrong-type", "rewards-shape"])
def test_a_replay_buffer_with_malformed_per_row_objects_is_refused_at_resume_naming_the_file_and_field(
        tmp_path, replay_checkpoint, damage, message):
    """Behind a valid checksum: before, a shortened, None or malformed object list resumed, then failed with a
    raw TypeError (or assertion) at the first replay."""
    import shutil

    from dataflex_bus.errors import ConfigError
    from dataflex_bus.state_file import read_state, save_state

    checkpoint = tmp_path / "checkpoint-1"
    shutil.copytree(replay_checkpoint, checkpoint)
    path = checkpoint / "dataflex_state.pt"
    state = read_state(path, "")
    store = state["runtime"]["replay"]["store"]
    assert len(store["objects"]) == 16
    store["objects"] = damage(store["objects"])
    save_state(path, state)
    with pytest.raises(ConfigError) as err:
        T.train(DataflexGRPOTrainer, rows=ROWS, rows_per_gen=16, steps=3, out=str(tmp_path / "resumed"),
                resume=str(checkpoint), trainer_kwargs={"dataflex": REPLAY})
    text = str(err.value)
    assert str(path) in text and "replay buffer in the checkpoint is damaged" in text and message in text
