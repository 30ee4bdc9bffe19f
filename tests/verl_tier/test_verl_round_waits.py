"""A generation round's end is read from TransferQueue soon after it happens: the waits between reads start
short and double up to verl's poll_interval, so a round that ends in a fraction of a second is not held to the
next 2-second poll, and a long round is read no more often than verl reads it."""

from __future__ import annotations

import itertools

import pytest

pytest.importorskip("verl")

from dataflex_bus.verl import rounds

pytestmark = [pytest.mark.verl]


def test_waits_start_short_double_and_stop_at_the_poll_interval():
    waits = list(itertools.islice(rounds.terminal_waits(2.0), 12))
    assert waits[0] == rounds.FIRST_WAIT and all(b == min(2 * a, 2.0) for a, b in itertools.pairwise(waits))
    assert waits[-1] == 2.0 and list(itertools.islice(rounds.terminal_waits(0.001), 3)) == [0.001] * 3


class Buffer:
    """verl's replay buffer as _wait_terminal reads it: groups finish after a number of reads."""

    poll_interval = 2.0

    def __init__(self, finish_after: dict[str, int]) -> None:
        self.finish_after, self.reads = finish_after, 0
        self.finished_keys = {"train": set()}
        self.failure_keys = {"train": set()}

    def _sync_metadata_from_transfer_queue(self) -> None:
        self.reads += 1
        self.finished_keys["train"] = {u for u, n in self.finish_after.items() if self.reads >= n}


def test_a_round_is_seen_terminal_at_the_first_read_after_its_last_group(monkeypatch):
    slept: list[float] = []
    monkeypatch.setattr(rounds.time, "sleep", slept.append)
    buffer = Buffer({"a": 1, "b": 4, "c": 6})
    rounds.GenerationRounds._wait_terminal(object(), buffer, "train", {"a", "b", "c"})  # type: ignore[arg-type]
    assert buffer.reads == 6 and slept == [0.01, 0.02, 0.04, 0.08, 0.16]  # 0.31 s of waits, not 5 x 2 s
