"""What seeing writes behind torch's version counter costs per step at verl scale (issue 25, item 3).

A write through ``.data`` or a NumPy view changes a field without bumping its ``_version``, so the
identity-and-version check around every scorer/actuator call misses it. Two ways to close the hole were
weighed, at 16,384 rows x 2,048 tokens (verl dtypes: ``response_mask`` int64, the rest float32):

* **fingerprint** (chosen, always on): the wrapping integer sum of each field the component declared it
  reads (``requires``), before and after its call (:mod:`dataflex_bus.fingerprint`, one streaming pass per
  field and side); a change names the plugin and the field;
* **copies**: hand each component its declared fields as copies it cannot write through to the host
  (torch has no read-only tensors, so that is a clone per field per call); a write is then harmless but
  unseen.

"One step's host work" here is the bus's share of it: for each event, a fresh ``Batch`` built from the
host's tensors (as verl's adapter builds one per event) and emitted through an ``EventBus`` with the
method(s), fingerprinting off. That leaves out everything else the host does in a step (TransferQueue
transfers, carrying the decision out, verl's own advantage and bookkeeping), so each ratio printed is an
upper bound of the share of a real step. Prints ratios; no thresholds in tests.

Run: ``python benchmarks/bench_read_fingerprint.py [--rows 16384 --group 16 --tokens 2048 --repeats 5]``.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import torch
from bench_methods import fresh_batch, make_data, single_thread, timeit, timeit_pair
from bench_stack import METHODS as STACK

from dataflex_bus import EventBus, bus
from dataflex_bus.fingerprint import fingerprint
from dataflex_bus.hookspecs import EVENTS
from dataflex_bus.pipeline import build_pipeline

NAMES = ["math", "code", "logic", "science"]
CASES: dict[str, dict[str, Any]] = {
    "band (group_solve_rate + threshold_band)": {
        "mechanism": "select", "scorer": {"name": "group_solve_rate"},
        "actuator": {"name": "threshold_band", "params": {"low": 0.2, "high": 0.8}}},
    "AR (token_prob + advantage_reweight)": {
        "mechanism": "reweight", "scorer": {"name": "token_prob"},
        "actuator": {"name": "advantage_reweight", "params": {"alpha": 0.3}}},
    "stack (DAPO filter + AR + DUMP)": {"methods": STACK},
}


def declared_reads(step: Callable[[], None]) -> list[tuple[str, ...]]:
    """The ``requires`` of every component call one step makes (recorded through the watch's constructor)."""
    calls: list[tuple[str, ...]] = []
    original = bus.BatchWatch.for_component.__func__  # type: ignore[attr-defined]

    def record(cls: type, batch: Any, requires: Any) -> Any:
        if isinstance(getattr(batch, "fields", None), dict):
            calls.append(tuple(r for r in requires if isinstance(batch.fields.get(r), torch.Tensor)))
        return original(cls, batch, requires)

    bus.BatchWatch.for_component = classmethod(record)  # type: ignore[method-assign, assignment]
    try:
        step()
    finally:
        bus.BatchWatch.for_component = classmethod(original)  # type: ignore[method-assign, assignment]
    return calls


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=16384)
    parser.add_argument("--group", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    data = make_data(args.rows, args.group, args.tokens, len(NAMES))
    print(f"batch {args.rows:,} rows x {args.tokens:,} tokens, one thread, median of {args.repeats}")
    with single_thread():
        per_field = {k: timeit(lambda v=v: fingerprint(v), args.repeats) for k, v in data.items()
                     if isinstance(v, torch.Tensor) and v.dim() == 2}
        clone = {k: timeit(lambda v=data[k]: v.clone(), args.repeats) for k in per_field}
        print("one fingerprint pass: " + ", ".join(f"{k} {t * 1e3:.1f} ms" for k, t in per_field.items()))
        for label, block in CASES.items():
            runtime_bus = EventBus()
            pipe = build_pipeline(block)
            pipe.set_domains(NAMES)
            runtime_bus.add_participant(pipe, "p")

            def step(b: EventBus = runtime_bus) -> None:
                for event in EVENTS:
                    b.emit(event, fresh_batch(data, NAMES), 0)

            calls = declared_reads(step)

            def off(s: Callable[[], None] = step) -> None:
                """The same step with the fingerprint a no-op: what the bus cost before it."""
                bus.fingerprint = lambda t: 0  # type: ignore[assignment]
                try:
                    s()
                finally:
                    bus.fingerprint = fingerprint

            t_on, host = timeit_pair(step, off, args.repeats)
            passes = sum(2 * per_field[f] for reads in calls for f in reads)
            copies = sum(clone[f] for reads in calls for f in reads)
            print(f"\n{label}: {len(calls)} component calls per step, reading {sorted({f for c in calls for f in c})}")
            print(f"  host work of the step (fingerprints off): {host * 1e3:9.1f} ms")
            print(f"  with fingerprints (as shipped):           {t_on * 1e3:9.1f} ms   on/off {t_on / host:.3f}")
            print(f"  fingerprint passes alone:                 {passes * 1e3:9.1f} ms   ratio to host work "
                  f"{passes / host:.3f}")
            print(f"  copies of the declared fields instead:    {copies * 1e3:9.1f} ms   ratio to host work "
                  f"{copies / host:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
