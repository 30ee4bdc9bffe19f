"""Generation rounds against verl's native DAPO path on a simulated agent loop (a script, not a test).

A discrete-event model of the rollout engine: ``--workers`` agent-loop workers (8) each run one request at a
time; a request's latency is log-normal (sigma ``--sigma``, 1; median 1 time unit), drawn once per request so
every policy sees the same latencies in the same dispatch order. A step needs ``--batch`` kept groups of
``--n`` rollouts; a group is kept when its rewards differ (each rollout succeeds with its prompt's solve rate,
drawn uniformly). Policies:

* ``dapo``: verl's native path: ``max_inflight_gen_batches`` (2) batches of prompts queued at a time, every
  finished group filtered as it arrives, a new batch queued when one drains, the step done at the last kept
  group's arrival;
* ``dynamic_sampling`` (``dataflex.refill``, today's ``verl/rounds.py``): a round of prompts dispatched, waited
  for until every group is terminal, filtered, the next round sized by the missing groups over the kept share;
* ``speed`` (today's rounds): a screening round of ``--screen`` rollouts a prompt, waited for whole, then one
  continuation round with the rest of the group for the prompts whose screening rewards differ, waited for;
* ``speed_per_group`` and ``dynamic_sampling_per_group`` (the dispatch issue 44 asks for, modelled, not yet
  what verl/rounds.py does): a group's continuation, and a refill, dispatched as soon as a group is decided.

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
    elif policy in ("dynamic_sampling", "speed"):
        wall = 0.0
        first = True
        while len(kept) < batch:
            missing = batch - len(kept)
            count = batch if first else max(1, math.ceil(missing / args.keep_estimate))
            first = False
            came: list[Group] = []
            if policy == "dynamic_sampling":
                dispatch(count, n, came.append)
                engine.run_until(lambda came=came, count=count: len(came) == count)
                kept.extend(g for g in came if g.varied)
            else:
                dispatch(count, args.screen, came.append)
                engine.run_until(lambda came=came, count=count: len(came) == count)
                passing = [g for g in came if g.varied]
                finished: list[Group] = []
                for g in passing:
                    extend(g, n - args.screen, finished.append)
                waiting = len(passing)
                engine.run_until(lambda finished=finished, waiting=waiting: len(finished) == waiting)
                kept.extend(finished)
            wall = engine.now
        del kept[batch:]
    elif policy in ("dynamic_sampling_per_group", "speed_per_group"):
        pending = [0]

        def decided(g: Group) -> None:
            pending[0] -= 1
            if g.varied and len(kept) < batch:
                kept.append(g)
            top_up()

        def screened(g: Group) -> None:
            if g.varied:
                extend(g, n - args.screen, decided)
            else:
                decided(g)

        def top_up() -> None:
            # keep enough groups in flight to fill the batch at the kept share
            want = math.ceil((batch - len(kept)) / args.keep_estimate)
            if pending[0] < want and len(kept) < batch:
                more = want - pending[0]
                pending[0] += more
                if policy == "speed_per_group":
                    dispatch(more, args.screen, screened)
                else:
                    dispatch(more, n, decided)

        top_up()
        wall = engine.run_until(enough)
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
    parser.add_argument("--keep-estimate", type=float, default=0.7, help="share of groups a refill expects kept")
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    policies = ("dapo", "dynamic_sampling", "speed", "dynamic_sampling_per_group", "speed_per_group")
    results = {}
    for policy in policies:
        runs = [simulate(policy, args, seed) for seed in range(args.steps)]
        results[policy] = (sum(w for w, _ in runs) / len(runs), sum(i for _, i in runs) / len(runs))
    dapo = results["dapo"][0]
    print(f"simulated agent loop: {args.workers} workers, log-normal latency sigma {args.sigma}, {args.batch} kept "
          f"groups of {args.n} a step, {args.steps} steps")
    print(f"{'policy':<30}{'step time':>10}{'vs dapo':>9}{'idle':>7}")
    for policy in policies:
        wall, idle = results[policy]
        print(f"{policy:<30}{wall:>10.1f}{wall / dapo:>8.2f}x{idle:>7.1%}")
    for policy in policies[1:]:
        wall, idle = results[policy]
        print(json.dumps({"measure": "rounds_step_time_vs_dapo", "value": round(wall / dapo, 3), "goal": 1.1,
                          "unit": "x", "method": policy}))
        print(json.dumps({"measure": "rounds_idle_fraction", "value": round(idle, 3), "goal": 0.1,
                          "unit": "fraction", "method": policy}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
