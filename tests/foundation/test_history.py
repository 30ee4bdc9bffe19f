"""Stable prompt ids and the per-prompt history: classes, streaks, the window, per-step counts, state,
and the errors a host gets for ids it cannot trust."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dataflex_bus.batch import Batch
from dataflex_bus.errors import BatchFieldError, ConfigError
from dataflex_bus.history import PromptHistory, PromptTable
from dataflex_bus.visits import EASY, HARD, OTHER, WINDOW, VisitClasses

#: Rewards of a two-row group of each class (zero_variance mode, rewards in {0, 1}).
REWARDS = {EASY: [1.0, 1.0], HARD: [0.0, 0.0], OTHER: [1.0, 0.0]}


def visits_batch(visits: list[tuple[int, int]], padding: int = 0) -> Batch:
    """One two-row group per visit ``(prompt_index, class)``, in order, then ``padding`` padding rows."""
    rewards = [r for _, c in visits for r in REWARDS[c]] + [1.0] * padding
    n = len(rewards)
    rm = torch.zeros(n, 2)
    rm[:, 1] = torch.tensor(rewards)
    prompt = torch.tensor([p for p, _ in visits for _ in range(2)] + [0] * padding)
    uid = torch.arange(n) // 2
    return Batch.from_tensors(uid=uid, rm_scores=rm, response_mask=torch.ones(n, 2, dtype=torch.long),
                              prompt_index=prompt,
                              is_padding=torch.tensor([False] * (n - padding) + [True] * padding))


def group_stats(rewards: list[list[float]]) -> tuple[torch.Tensor, ...]:
    mean = torch.tensor([sum(r) / len(r) for r in rewards], dtype=torch.float64)
    low = torch.tensor([min(r) for r in rewards], dtype=torch.float64)
    high = torch.tensor([max(r) for r in rewards], dtype=torch.float64)
    size = torch.tensor([len(r) for r in rewards])
    return mean, low, high, size


# ---------------------------------------------------------------------------- classes
def test_zero_variance_classes():
    groups = [[1, 1, 1], [0, 0], [0.5, 0.5], [1, 0], [1], [0]]
    cls = VisitClasses().classify(*group_stats(groups))
    assert cls.tolist() == [EASY, HARD, OTHER, OTHER, OTHER, OTHER]  # singletons are never a streak


def test_zero_variance_thresholds_are_inclusive():
    cls = VisitClasses(easy_min=0.5, hard_max=0.1).classify(*group_stats([[0.5, 0.5], [0.1, 0.1], [0.2, 0.2]]))
    assert cls.tolist() == [EASY, HARD, OTHER]


def test_greso_mode_classes_and_counts():
    classes = VisitClasses(mode="greso")
    groups = [[1] * 8, [1] * 7 + [0.1], [0.0, 0.1, 0.1], [0.1, 0.1], [0, 0], [1, 0.1]]
    stats = group_stats(groups)
    # mean >= 0.98 easy (7 of 8 right is 0.8875: other); mean <= 0.11 hard, even when not zero-variance
    assert classes.classify(*stats).tolist() == [EASY, OTHER, HARD, HARD, HARD, OTHER]
    # the per-step counts take only groups whose rewards all equal 1 (easy) or 0.1 (hard), as GRESO's code
    assert classes.count_class(*stats).tolist() == [EASY, OTHER, OTHER, HARD, OTHER, OTHER]


def test_greso_counts_compare_the_rewards_in_their_own_float32():
    # GRESO's R_hard counts groups whose float32 rewards all equal 0.1 (`reward_tensor == 0.1` rounds 0.1 to
    # float32); the history's rewards are float32 too, so a float64 0.1 would never match and R_hard stay 0
    history = PromptHistory(PromptTable.full(["d"], [3], column="row"), classes=VisitClasses(mode="greso"))
    rewards = torch.tensor([0.1] * 8 + [1.0] * 8 + [0.0] * 8)
    batch = Batch.from_tensors(uid=torch.arange(24) // 8, prompt_index=torch.arange(24) // 8,
                               rm_scores=rewards[:, None], response_mask=torch.ones(24, 1, dtype=torch.long))
    history.record(batch, 0)
    history.end_step(0)
    fields = history.fields(torch.arange(3))
    assert fields["history_class"].tolist() == [HARD, EASY, HARD]
    assert [int(fields[f"history_step_{k}"]) for k in ("groups", "easy", "hard")] == [3, 1, 1]
    # zero_variance mode: a reward value set as hard_max is matched the same way
    history = PromptHistory(PromptTable.full(["d"], [3], column="row"), classes=VisitClasses(hard_max=0.1))
    history.record(batch, 0)
    assert history.fields(torch.arange(3))["history_class"].tolist() == [HARD, EASY, HARD]


def test_unknown_mode_is_refused():
    with pytest.raises(ConfigError, match="mode"):
        VisitClasses(mode="zv")


# ---------------------------------------------------------------------------- prompt table
def test_table_maps_ids_to_dense_indices():
    table = PromptTable.from_labels(["b", "a", "b", "a"], [7, 3, 2, 9], column="extra_info.index")
    assert table.domains == ["a", "b"] and len(table) == 4
    # dense order: (a, 3), (a, 9), (b, 2), (b, 7)
    assert table.lookup_labels(["b", "a", "a", "b"], torch.tensor([2, 9, 3, 7])).tolist() == [2, 1, 0, 3]
    assert table.input_index.tolist() == [3, 0, 2, 1]


def test_full_table_numbers_every_row():
    table = PromptTable.full(["x", "y"], [3, 2], column="row")
    assert table.lookup(torch.tensor([0, 0, 0, 1, 1]), torch.tensor([0, 1, 2, 0, 1])).tolist() == [0, 1, 2, 3, 4]


def test_duplicate_ids_name_the_column_to_set():
    with pytest.raises(ConfigError, match=r"extra_info\.index.*3 prompts of domain 'math' have extra_info.index=0"):
        PromptTable.from_labels(["math"] * 3 + ["code"], [0, 0, 0, 1], column="extra_info.index")


def test_unknown_id_names_the_column():
    table = PromptTable.full(["x"], [3], column="extra_info.index")
    with pytest.raises(BatchFieldError, match=r"\('x', extra_info.index=5\) is not in the dataset"):
        table.lookup(torch.tensor([0]), torch.tensor([5]))
    with pytest.raises(BatchFieldError, match="'zz'"):
        table.lookup_labels(["zz"], torch.tensor([0]))


def test_negative_or_huge_rows_are_refused():
    with pytest.raises(ConfigError, match="integers in"):
        PromptTable(["x"], torch.tensor([0]), torch.tensor([-1]), column="extra_info.index")


def test_fingerprint_tells_datasets_apart():
    a = PromptTable.full(["x", "y"], [3, 2], column="row").fingerprint()
    assert a == PromptTable.full(["x", "y"], [3, 2], column="row").fingerprint()
    assert a != PromptTable.full(["x", "y"], [3, 3], column="row").fingerprint()
    assert a != PromptTable.full(["x", "z"], [3, 2], column="row").fingerprint()


# ---------------------------------------------------------------------------- recording visits
def history(n: int = 4, **kw) -> PromptHistory:
    return PromptHistory(PromptTable.full(["d"], [n], column="row"), **kw)


def test_streak_follows_the_update_rule():
    h = history()
    expected = []
    for step, cls in enumerate([EASY, EASY, HARD, HARD, HARD, OTHER, EASY]):
        h.record(visits_batch([(1, cls)]), step)
        expected.append((int(h.last_class[1]), int(h.streak[1])))
    assert expected == [(EASY, 1), (EASY, 2), (HARD, 1), (HARD, 2), (HARD, 3), (OTHER, 0), (EASY, 1)]
    assert int(h.visits[1]) == 7 and int(h.last_step[1]) == 6
    assert int(h.visits[0]) == 0 and int(h.last_step[0]) == -1


def test_several_visits_of_a_prompt_in_one_batch_compose_in_order():
    h = history()
    h.record(visits_batch([(2, EASY)]), 0)
    h.record(visits_batch([(2, EASY), (3, HARD), (2, EASY), (3, OTHER), (3, HARD)]), 1)
    assert (int(h.last_class[2]), int(h.streak[2]), int(h.visits[2])) == (EASY, 3, 3)
    assert (int(h.last_class[3]), int(h.streak[3]), int(h.visits[3])) == (HARD, 1, 3)


def test_window_fields_are_most_recent_first():
    h = history()
    for step, cls in enumerate([HARD, OTHER, EASY, EASY, EASY]):
        h.record(visits_batch([(0, cls)]), step)
    f = h.fields(torch.tensor([0, 1]))
    assert f["history_steps"].tolist() == [[4, 3, 2, 1], [-1] * WINDOW]
    assert f["history_classes"].tolist() == [[EASY, EASY, EASY, OTHER], [-1] * WINDOW]
    assert f["history_means"][0].tolist() == [1.0, 1.0, 1.0, 0.5]
    assert bool(torch.isnan(f["history_means"][1]).all())
    assert f["history_visits"].tolist() == [5, 0] and f["history_streak"].tolist() == [3, 0]
    assert f["history_class"].tolist() == [EASY, OTHER] and f["history_last_step"].tolist() == [4, -1]


def test_padding_rows_are_not_visits():
    h = history()
    h.record(visits_batch([(1, EASY)], padding=3), 0)
    assert h.visits.tolist() == [0, 1, 0, 0]


def test_step_counts_cover_every_round_and_close_at_step_end():
    h = history()
    h.record(visits_batch([(0, EASY), (1, HARD)]), 5)
    h.record(visits_batch([(2, HARD), (3, OTHER)]), 5)  # a refill round of the same step
    f = h.fields(torch.tensor([0]))
    assert int(f["history_counts_step"]) == -1  # nothing completed yet
    h.end_step(5)
    f = h.fields(torch.tensor([0]))
    counts = [int(f[k]) for k in ("history_counts_step", "history_step_groups", "history_step_easy",
                                  "history_step_hard")]
    assert counts == [5, 4, 1, 2]
    h.end_step(6)  # a step that rolled nothing out
    assert int(h.fields(torch.tensor([0]))["history_step_groups"]) == 0


def test_epoch_counts_passes_over_the_prompts():
    h = history(n=4)
    h.consider(3)
    assert h.epoch == 0
    h.consider(6)
    assert h.epoch == 2 and int(h.fields(torch.tensor([0]))["history_epoch"]) == 2


def test_the_counted_steps_epoch_is_the_pass_its_last_candidate_was_in():
    # GRESO adapts at the end of a step if the epoch it ends in is past the first: a step whose last candidate
    # is the first pass's last prompt ended in epoch 0, although the next draw starts epoch 1
    h = history(n=4)
    h.consider(2)
    h.end_step(0)
    h.consider(2)
    h.end_step(1)
    f = h.fields(torch.tensor([0]))
    assert (int(f["history_epoch"]), int(f["history_counts_epoch"])) == (1, 0)
    h.consider(1)
    h.end_step(2)
    assert int(h.fields(torch.tensor([0]))["history_counts_epoch"]) == 1
    again = history(n=4)
    again.load_state_dict(h.state_dict())
    assert int(again.fields(torch.tensor([0]))["history_counts_epoch"]) == 1
    old = {k: v for k, v in h.state_dict().items() if k != "completed_epoch"}  # a checkpoint from before
    again.load_state_dict(old)
    assert int(again.fields(torch.tensor([0]))["history_counts_epoch"]) == 1


def test_record_needs_consistent_prompt_ids():
    h = history()
    batch = visits_batch([(1, EASY)])
    with pytest.raises(BatchFieldError, match="prompt_index"):
        h.record(batch.derive(fields={k: v for k, v in batch.fields.items() if k != "prompt_index"}), 0)
    split = batch.with_fields(prompt_index=torch.tensor([1, 2]))
    with pytest.raises(BatchFieldError, match="same prompt_index"):
        h.record(split, 0)
    with pytest.raises(BatchFieldError, match=r"0\.\.3"):
        h.record(batch.with_fields(prompt_index=torch.tensor([9, 9])), 0)


# ---------------------------------------------------------------------------- against a sequential reference
def reference(batches: list[list[tuple[int, int]]], n: int) -> dict[str, list]:
    """The P1.2 rule applied one visit at a time, in Python."""
    visits, last, cls, streak = [0] * n, [-1] * n, [OTHER] * n, [0] * n
    ring: list[list[tuple[int, int]]] = [[] for _ in range(n)]
    for step, batch in enumerate(batches):
        for p, c in batch:
            streak[p] = streak[p] + 1 if (c == cls[p] and c != OTHER) else (1 if c != OTHER else 0)
            cls[p] = c
            visits[p] += 1
            last[p] = step
            ring[p] = ([(step, c)] + ring[p])[:WINDOW]
    return {"visits": visits, "last": last, "cls": cls, "streak": streak,
            "steps": [[s for s, _ in r] + [-1] * (WINDOW - len(r)) for r in ring],
            "classes": [[c for _, c in r] + [-1] * (WINDOW - len(r)) for r in ring]}


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.tuples(st.integers(0, 4), st.sampled_from([EASY, HARD, OTHER])), min_size=1,
                         max_size=12), min_size=1, max_size=6))
def test_vectorised_update_equals_the_sequential_rule(batches):
    h = history(n=5)
    for step, visits in enumerate(batches):
        h.record(visits_batch(visits), step)
    ref = reference(batches, 5)
    f = h.fields(torch.arange(5))
    assert f["history_visits"].tolist() == ref["visits"]
    assert f["history_last_step"].tolist() == ref["last"]
    assert f["history_class"].tolist() == ref["cls"]
    assert f["history_streak"].tolist() == ref["streak"]
    assert f["history_steps"].tolist() == ref["steps"]
    assert f["history_classes"].tolist() == ref["classes"]


# ---------------------------------------------------------------------------- state
def test_state_round_trip_is_exact():
    h = history()
    h.record(visits_batch([(0, EASY), (1, HARD), (0, EASY)]), 0)
    h.end_step(0)
    h.consider(7)
    h.record(visits_batch([(3, OTHER)]), 1)
    g = history()
    g.load_state_dict(h.state_dict())
    for name in ("visits", "last_step", "last_class", "streak", "ring_step", "ring_class"):
        assert torch.equal(getattr(g, name), getattr(h, name)), name
    assert torch.equal(g.ring_mean.nan_to_num(-9), h.ring_mean.nan_to_num(-9))
    assert (g.considered, g.current, g.completed) == (h.considered, h.current, h.completed)


def test_state_of_another_dataset_is_refused():
    h = history(n=4)
    other = PromptHistory(PromptTable.full(["d"], [5], column="extra_info.index"))
    with pytest.raises(ConfigError, match=r"another dataset \(saved: 4 prompts.*now: 5 prompts"):
        other.load_state_dict(h.state_dict())
    renamed = PromptHistory(PromptTable.full(["e"], [4], column="row"))
    with pytest.raises(ConfigError, match="another dataset"):
        renamed.load_state_dict(h.state_dict())
    greso = history(n=4, classes=VisitClasses(mode="greso"))
    with pytest.raises(ConfigError, match="classifies visits differently"):
        greso.load_state_dict(h.state_dict())
