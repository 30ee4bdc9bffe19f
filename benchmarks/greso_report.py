"""Generation cost of selection methods, read from a ``dataflex compare`` output directory.

Two readings, per seed and as seed means (the runs are the ones ``compare.json`` lists):

* **rollouts per trained group**: ``compute/generated_rollouts / compute/trained_groups`` at the end of
  each run (every rollout generated, over every trained group; with dynamic sampling only informative
  groups train), and each method's ratio to ``--versus`` (e.g. GRESO against dynamic sampling);
* **rollouts to reach the baseline's accuracy**: for each seed, the generated rollouts at which the
  method's held-out metric first reaches the ``--baseline`` run's final value on the same seed (linear
  interpolation between eval points; ``not reached`` if it never does), against the rollouts the
  baseline itself generated, and the factor ``baseline / needed`` with its 95% t interval over seeds.

Run: ``python benchmarks/greso_report.py runs/compare --versus dynamic_sampling --baseline grpo_baseline``.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path
from typing import Any

from dataflex_bus.errors import DataflexError
from dataflex_bus.shim.analysis import load_curve
from dataflex_bus.shim.stats import mean_ci


def read_run(run_dir: Path, metric: str) -> dict[str, Any]:
    try:
        curve = load_curve(run_dir, metric)
    except DataflexError as exc:
        raise SystemExit(str(exc)) from None
    last = curve.metrics[-1]
    trained = last.get("compute/trained_groups")
    if not trained:
        raise SystemExit(f"{run_dir}: no compute/trained_groups (a run from before the counter existed?)")
    points = [(p.rollouts, p.value) for p in curve.points]
    return {"rollouts": last["compute/generated_rollouts"], "trained_groups": trained,
            "per_group": last["compute/generated_rollouts"] / trained, "points": points, "final": curve.final.value}


def reach(points: list[tuple[float, float]], target: float) -> float | None:
    """Rollouts at which the curve first reaches ``target`` (linear between eval points)."""
    prev = None
    for rollouts, value in points:
        if value >= target:
            if prev is None or prev[1] >= target:
                return rollouts
            (r0, v0) = prev
            return r0 + (rollouts - r0) * (target - v0) / (value - v0)
        prev = (rollouts, value)
    return None


def fewer(needed: list[float | None], base: list[float]) -> str:
    """How many times fewer rollouts than the baseline the method needed to reach its final accuracy, per
    seed ``baseline / needed``, with the 95% t interval of the mean over seeds (every seed must reach it)."""
    if any(n is None for n in needed):
        return "x fewer rollouts: not every seed reaches it, no interval"
    factor = [b / n for n, b in zip(needed, base) if n is not None]
    est = mean_ci(factor)
    ci = "" if est.ci is None else f" [95% CI {est.ci[0]:.2f}, {est.ci[1]:.2f}]"
    verdict = "" if est.ci is None else (" (interval above 1x)" if est.ci[0] > 1 else
                                         " (interval below 1x)" if est.ci[1] < 1 else " (interval includes 1x)")
    return f"x fewer rollouts than the baseline: {est.mean:.2f}x{ci}{verdict}; per seed {[round(f, 2) for f in factor]}"


def summary(values: list[float], digits: int = 1) -> str:
    if len(values) == 1:
        return f"{values[0]:,.{digits}f}"
    return f"{statistics.mean(values):,.{digits}f} ± {statistics.stdev(values):,.{digits}f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("compare_dir", type=Path)
    parser.add_argument("--versus", help="label the rollouts-per-trained-group ratio is taken against")
    parser.add_argument("--baseline", help="label whose final accuracy the others must reach")
    args = parser.parse_args()
    report = json.loads((args.compare_dir / "compare.json").read_text())
    metric, seeds = report["metric"], report["seeds"]
    runs = {label: [read_run(Path(d), metric) for d in dirs] for label, dirs in report["runs"].items()}
    for label in (args.versus, args.baseline):
        if label is not None and label not in runs:
            raise SystemExit(f"unknown label {label!r}; the comparison holds {sorted(runs)}")
    print(f"{args.compare_dir}: metric {metric}, seeds {seeds}")
    print("\nrollouts per trained group (final; mean ± std over seeds)")
    for label, rs in runs.items():
        per = [r["per_group"] for r in rs]
        line = f"  {label:24s} {summary(per):>18s}   per seed {[round(x, 1) for x in per]}"
        if args.versus and label != args.versus:
            ratios = [v["per_group"] / r["per_group"] for v, r in zip(runs[args.versus], rs)]
            line += f"   {args.versus}/this: {statistics.mean(ratios):.2f}x (per seed {[round(x, 2) for x in ratios]})"
        print(line)
    if args.baseline:
        base = runs[args.baseline]
        print(f"\nrollouts to reach {args.baseline}'s final {metric} (same seed)")
        print(f"  {args.baseline:24s} final {summary([r['final'] for r in base], 3)} at "
              f"{summary([r['rollouts'] for r in base], 0)} rollouts")
        for label, rs in runs.items():
            if label == args.baseline:
                continue
            needed = [reach(r["points"], b["final"]) for r, b in zip(rs, base)]
            got = [x for x in needed if x is not None]
            ratio = [n / b["rollouts"] for n, b in zip(needed, base) if n is not None]
            shown = ["not reached" if x is None else f"{x:,.0f}" for x in needed]
            mean = f"{statistics.mean(got):,.0f}" if got else "-"
            rel = f"{statistics.mean(ratio):.2f}x the baseline's" if ratio else "-"
            print(f"  {label:24s} {mean:>10s} rollouts ({len(got)}/{len(needed)} seeds reach it; {rel}); "
                  f"per seed {shown}")
            print(f"  {'':24s} {fewer(needed, [b['rollouts'] for b in base])}")
    return 0 if all(math.isfinite(r["per_group"]) for rs in runs.values() for r in rs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
