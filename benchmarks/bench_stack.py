"""Overhead of a method stack on the bus (issue 11): one 3-method stack against its three single-method
pipelines run one after the other on the same batch (a script printing the ratio; goal <= 1.1x).

The stack is DAPO's zero-variance filter (on_rollout) + AR token reweighting (on_advantage) + the DUMP
curriculum (on_step_end), each emitted through an EventBus as a host does. Both sides build a fresh batch
per event (derived values recomputed), so the ratio is the stack's own cost: one participant dispatching
three methods by event instead of three participants, plus the per-event method lookup.

Run: ``python benchmarks/bench_stack.py [--rows 16384 --group 16 --tokens 2048 --repeats 7]``.
"""

from __future__ import annotations

import argparse

from bench_methods import fresh_batch, make_data, single_thread, timeit_pair

from dataflex_bus import EventBus
from dataflex_bus.hookspecs import EVENTS
from dataflex_bus.pipeline import build_pipeline

METHODS = [
    {"name": "filter", "mechanism": "select", "scorer": {"name": "reward_difficulty"}, "actuator": {"name": "dapo"}},
    {"name": "ar", "mechanism": "reweight", "scorer": {"name": "token_prob"},
     "actuator": {"name": "advantage_reweight", "params": {"alpha": 0.3}}},
    {"name": "curriculum", "mechanism": "mix", "scorer": {"name": "advantage_magnitude"},
     "actuator": {"name": "dump_ucb"}},
]


def bus_of(*blocks: dict) -> EventBus:
    bus = EventBus()
    for i, block in enumerate(blocks):
        pipe = build_pipeline(block)
        pipe.set_domains(NAMES)
        bus.add_participant(pipe, f"p{i}")
    return bus


NAMES = ["math", "code", "logic", "science"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=16384)
    parser.add_argument("--group", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    data = make_data(args.rows, args.group, args.tokens, len(NAMES))
    stack = bus_of({"methods": METHODS})
    singles = bus_of(*({k: v for k, v in m.items() if k != "name"} for m in METHODS))

    def run(bus: EventBus) -> None:
        for event in EVENTS:
            bus.emit(event, fresh_batch(data, NAMES), 0)

    with single_thread():
        t_stack, t_singles = timeit_pair(lambda: run(stack), lambda: run(singles), args.repeats)
    ratio = t_stack / t_singles
    print(f"batch {args.rows} rows x {args.tokens} tokens, one thread, median of {args.repeats}")
    print(f"3-method stack:            {t_stack * 1e3:9.2f} ms per step (3 events)")
    print(f"3 single-method pipelines: {t_singles * 1e3:9.2f} ms per step (3 events)")
    print(f"ratio {ratio:.3f} (goal <= 1.1) -> {'PASS' if ratio <= 1.1 else 'MISS'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
