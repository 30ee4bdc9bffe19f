"""Event dispatch overhead of the bus vs a bare pluggy hook call with the same implementations.

Target (issue 2): EventBus.emit costs at most 2x ``pm.hook.on_rollout(...)`` on a bare pluggy
PluginManager holding the same number of do-nothing implementations. Prints ratios; no thresholds in tests.
"""

from __future__ import annotations

import statistics
import timeit

import torch

from dataflex_bus import Batch, EventBus, hookimpl
from dataflex_bus.discovery import new_plugin_manager
from dataflex_bus.pipeline import Decision


class Impl:
    @hookimpl
    def on_rollout(self, batch, step, decision):
        return None


def bench(n_impls: int, number: int = 20000, repeat: int = 7) -> tuple[float, float]:
    batch = Batch.from_tensors(uid=torch.arange(4), rm_scores=torch.zeros(4, 2), response_mask=torch.ones(4, 2))
    bare = new_plugin_manager()
    for i in range(n_impls):
        bare.register(Impl(), name=f"p{i}")
    hook = bare.hook.on_rollout

    def bare_call():
        hook(batch=batch, step=0, decision=Decision())

    bus = EventBus()
    for i in range(n_impls):
        if i == 0:
            bus.add_participant(Impl(), f"p{i}")
        else:
            bus.add_observer(Impl(), f"p{i}")

    def bus_call():
        bus.emit("on_rollout", batch, 0)

    t_bare = statistics.median(timeit.repeat(bare_call, number=number, repeat=repeat)) / number
    t_bus = statistics.median(timeit.repeat(bus_call, number=number, repeat=repeat)) / number
    return t_bare, t_bus


def main() -> None:
    print(f"{'impls':>5}  {'bare pluggy (us)':>16}  {'EventBus.emit (us)':>18}  {'ratio':>6}  target<=2x")
    worst = 0.0
    for n in (1, 2, 4, 8):
        t_bare, t_bus = bench(n)
        ratio = t_bus / t_bare
        worst = max(worst, ratio)
        print(f"{n:>5}  {t_bare * 1e6:>16.2f}  {t_bus * 1e6:>18.2f}  {ratio:>6.2f}  {'PASS' if ratio <= 2 else 'FAIL'}")
    print(f"worst ratio {worst:.2f} -> {'PASS' if worst <= 2 else 'FAIL'}")


if __name__ == "__main__":
    main()
