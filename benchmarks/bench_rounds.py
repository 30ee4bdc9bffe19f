"""Generation rounds against verl's native DAPO path on a simulated agent loop (a script, not a test).

A discrete-event model of the rollout engine: ``--workers`` agent-loop workers (8) each run one request at a
time; a request's latency is log-normal (sigma ``--sigma``, 1; median 1 time unit), drawn once per request so
every policy sees the same latencies in the same dispatch order. A step needs ``--batch`` kept groups of
``--n`` rollouts; a group is kept when its rewards differ (each rollout succeeds with its prompt's solve rate,
drawn uniformly). Policies:

* ``dapo``: verl's native path: ``max_inflight_gen_batches`` (2) batches of prompts queued at a time, every
  finished group filtered as it arrives, a new batch queued when one drains, the step done at the last kept
  group's arrival;
* ``dynamic_sampling`` (``dataflex.refill``, as ``verl/rounds.py`` runs it): rounds sized by the kit's own
  :class:`~dataflex_bus.fill.GroupFill` (``--refill-policy``, default ``greso``), each waited for until every group
  is terminal (the fill's rule reads the round's kept count), until ``--batch`` groups are kept;
* ``speed`` (SPEED under ``dataflex.refill``, as ``verl/rounds.py`` runs it now): screening rounds of ``--screen``
  rollouts a prompt, sized by the same fill; each group's continuation (the rest of its ``--n``) is dispatched as
  soon as the kit's :class:`~dataflex_bus.screening.RoundScreening` releases it (SPEED's cap, the groups still
  needed in dispatch order, can no longer turn it away), the rest once the round's screening is whole; the next
  round waits for the last continuation;
* ``speed_whole_rounds``: SPEED with every round and continuation waited for whole (before issue 44).

The round sizes, which groups count as kept and when a continuation is released are the kit's code (``GroupFill``,
``RoundScreening``); the latencies, the rewards and SPEED's qualification (rewards that differ) are the model's.

Prints per policy the mean step wall time over ``--steps`` steps, its ratio to DAPO's
(``rounds_step_time_vs_dapo``, goal 1.1) and the engine-idle fraction (workers idle over workers x wall time,
``rounds_idle_fraction``, goal 0.10), one JSON line each. Run: ``python benchmarks/bench_rounds.py``.
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from dataflex_bus.block import RefillConfig
from dataflex_bus.fill import GroupFill
from dataflex_bus.screening import RoundScreening


@dataclass
class Engine:
    """``workers`` slots serving requests first come first served; ``spans`` the time each request ran."""

    workers: int
    rng: random.Random
    sigma: float
    now: float = 0.0
    spans: list[tuple[float, float]] = field(default_factory=list)
    free: list[float] = field(default_factory=list)
    done: list[tuple[float, int, Callable[[float], None]]] = field(default_factory=list)
    seq: int = 0

    def __post_init__(self) -> None:
        self.free = [0.0] * self.workers

    def submit(self, on_done: Callable[[float], None]) -> None:
        """One request, dispatched now; ``on_done(t)`` runs at its completion."""
        latency = math.exp(self.rng.gauss(0.0, self.sigma))
        start = max(self.now, heapq.heappop(self.free))
        heapq.heappush(self.free, start + latency)
        self.spans.append((start, start + latency))
        self.seq += 1
        heapq.heappush(self.done, (start + latency, self.seq, on_done))

    def busy(self, until: float) -> float:
        """Worker time spent on requests before ``until``."""
        return sum(min(end, until) - start for start, end in self.spans if start < until)

    def run_until(self, finished: Callable[[], bool]) -> float:
        while not finished():
            t, _, on_done = heapq.heappop(self.done)
            self.now = t
            on_done(t)
        return self.now


class Group:
    """One prompt's rollouts: ``rate`` its solve rate, ``results`` the rewards so far."""

    def __init__(self, rng: random.Random) -> None:
        self.rate, self.results, self.rng = rng.random(), [], rng

    def result(self) -> None:
        self.results.append(self.rng.random() < self.rate)

    @property
    def varied(self) -> bool:
        return 0 < sum(self.results) < len(self.results)


def kit_rounds(policy: str, args: argparse.Namespace, engine: Engine, rng: random.Random,
               extend: Callable[[Group, int, Callable[[Group], None]], None],
               dispatch: Callable[[int, int, Callable[[Group], None]], None], kept: list[Group]) -> float:
    """One step of ``dataflex.refill`` rounds as ``verl/rounds.py`` runs them, sized and closed by the kit's own
    :class:`~dataflex_bus.fill.GroupFill` (``--refill-policy``) and, for SPEED, screened as its groups arrive by the
    kit's own :class:`~dataflex_bus.screening.RoundScreening`: a group's continuation is dispatched as soon as SPEED's
    cap (the groups still needed, first in dispatch order) can no longer turn it away; the rest once the round's
    screening is whole. Each round is waited for whole before the fill sizes the next (its rule reads the round's
    kept count). ``speed_whole_rounds``: SPEED with every round and continuation whole (before issue 44). Returns
    the step's wall time."""
    n, screen = args.n, args.screen
    fill = GroupFill(args.batch, RefillConfig(max_rounds=0, policy=args.refill_policy, on_exhaust="train_short"))
    while (count := fill.request()) > 0:
        needed = args.batch - fill.kept
        if policy == "dynamic_sampling":
            came: list[Group] = []
            dispatch(count, n, came.append)
            engine.run_until(lambda came=came, count=count: len(came) == count)
            fill.add(torch.tensor([g.varied for g in came]))
            kept.extend(g for g in came if g.varied)
            continue
        groups = [Group(rng) for _ in range(count)]
        # The kit's screening of the round (Generation.screen): SPEED's cap takes the groups still needed, first
        # in dispatch order; a continuation is released once no later arrival can turn it away.
        screening = RoundScreening(range(count), needed, "dispatch")
        screened: list[int] = []
        sent: dict[int, bool] = {}
        done: list[Group] = []

        def on_screen(g: Group, i: int, screening: RoundScreening = screening, screened: list[int] = screened,
                      sent: dict[int, bool] = sent, done: list[Group] = done, groups: list[Group] = groups) -> None:
            screened.append(i)
            if policy != "speed":
                return
            for j in screening.add([i], torch.tensor([n - screen if g.varied else 0])):
                sent[j] = True
                extend(groups[j], n - screen, done.append)

        for i, g in enumerate(groups):
            extend(g, screen, lambda g, i=i, on_screen=on_screen: on_screen(g, i))
        engine.run_until(lambda screened=screened, count=count: len(screened) == count)
        # SPEED's rule on the whole round: the first groups still needed of the qualified, in dispatch order
        qualified = [i for i, g in enumerate(groups) if g.varied][:needed]
        for i in qualified:
            if i not in sent:
                extend(groups[i], n - screen, done.append)
        want = len(qualified)
        engine.run_until(lambda done=done, want=want: len(done) == want)
        chosen = set(qualified)
        keep = [i in chosen for i in range(count)]
        fill.add(torch.tensor(keep))
        kept.extend(g for g, k in zip(groups, keep) if k)
    return engine.now


def simulate(policy: str, args: argparse.Namespace, seed: int) -> tuple[float, float]:
    """``(wall, idle fraction)`` of one step under ``policy``."""
    rng = random.Random(seed)
    engine = Engine(args.workers, random.Random(seed + 1), args.sigma)
    kept: list[Group] = []
    n, batch = args.n, args.batch

    def extend(g: Group, rollouts: int, on_group: Callable[[Group], None]) -> None:
        left = [rollouts]

        def one(t: float) -> None:
            g.result()
            left[0] -= 1
            if left[0] == 0:
                on_group(g)

        for _ in range(rollouts):
            engine.submit(one)

    def dispatch(count: int, rollouts: int, on_group: Callable[[Group], None]) -> None:
        for _ in range(count):
            extend(Group(rng), rollouts, on_group)

    enough = lambda: len(kept) >= batch  # noqa: E731
    if policy == "dapo":
        inflight = [0]

        def arrived(g: Group) -> None:
            if g.varied and len(kept) < batch:
                kept.append(g)
            inflight[0] -= 1
            if inflight[0] <= batch * (args.inflight - 1) and len(kept) < batch:
                inflight[0] += batch
                dispatch(batch, n, arrived)

        inflight[0] = batch * args.inflight
        dispatch(batch * args.inflight, n, arrived)
        wall = engine.run_until(enough)
    elif policy in ("dynamic_sampling", "speed", "speed_whole_rounds"):
        wall = kit_rounds(policy, args, engine, rng, extend, dispatch, kept)
    else:
        raise ValueError(policy)
    return wall, 1.0 - engine.busy(wall) / (args.workers * wall)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--sigma", type=float, default=1.0)
    parser.add_argument("--batch", type=int, default=32, help="kept groups a step trains (train_batch_size)")
    parser.add_argument("--n", type=int, default=8, help="rollouts a group")
    parser.add_argument("--screen", type=int, default=4, help="SPEED: screening rollouts a prompt")
    parser.add_argument("--inflight", type=int, default=2, help="DAPO: max_inflight_gen_batches")
    parser.add_argument("--refill-policy", default="greso", choices=("fixed", "credit2", "greso"),
                        help="dataflex.refill.policy: the kit's round sizes (GroupFill)")
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    policies = ("dapo", "dynamic_sampling", "speed", "speed_whole_rounds")
    results = {}
    for policy in policies:
        runs = [simulate(policy, args, seed) for seed in range(args.steps)]
        results[policy] = (sum(w for w, _ in runs) / len(runs), sum(i for _, i in runs) / len(runs))
    dapo = results["dapo"][0]
    print(f"simulated agent loop: {args.workers} workers, log-normal latency sigma {args.sigma}, {args.batch} kept "
          f"groups of {args.n} a step, refill policy {args.refill_policy}, {args.steps} steps")
    print(f"{'policy':<30}{'step time':>10}{'vs dapo':>9}{'idle':>7}")
    for policy in policies:
        wall, idle = results[policy]
        print(f"{policy:<30}{wall:>10.1f}{wall / dapo:>8.2f}x{idle:>7.1%}")
    for policy in policies[1:3]:  # what the code runs now; speed_whole_rounds is printed above for reference
        wall, idle = results[policy]
        print(json.dumps({"measure": "rounds_step_time_vs_dapo", "value": round(wall / dapo, 3), "goal": 1.1,
                          "unit": "x", "method": policy}))
        print(json.dumps({"measure": "rounds_idle_fraction", "value": round(idle, 3), "goal": 0.1,
                          "unit": "fraction", "method": policy}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
