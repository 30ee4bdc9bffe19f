"""Reading finished shim runs and comparing them: eval curves, readings at equal budgets, paired statistics.

``dataflex compare`` (:mod:`.compare`) runs or collects the runs; this module reads their ``metrics.jsonl`` and
``run.json`` and builds the ``compare.json`` document. The marks scripts and the TRL table read runs through it too.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..kit import DataflexError
from .files import METRICS, RECORD, RunDirError, read_metrics
from .stats import mean_ci, paired_difference

SCHEMA = "dataflex-compare/1"
METRIC = "eval/heldout/learnable"
CONFIDENCE = 0.95
#: Budget fields (compare.json names) -> the cumulative counters of metrics.jsonl they are read from.
COUNTERS = {
    "generated_rollouts": "compute/generated_rollouts",
    "trained_tokens": "compute/trained_tokens",
    "modelled_cost": "compute/modelled_cost",
}
#: The generated-tokens budget (prompt + response tokens), read where every eval line of a run has it counted
#: with its prompt tokens: a run written before that has no ``compute/generated_response_tokens`` (its
#: ``generated_tokens`` then counted response tokens only) and gets no equal-tokens reading.
TOKENS = ("generated_tokens", "compute/generated_tokens", "compute/generated_response_tokens")
STEP_TIME = "time/step_s"
READINGS = ("linear", "floor")
#: ``--to-target``: the baseline's final level is the mean of its last this-many eval points.
TARGET_POINTS = 3


class RunDataError(DataflexError):
    """A run directory lacks (or holds a non-finite) metric or counter that compare reads."""


@dataclass(frozen=True)
class Reading:
    """A run read at one point: the metric, the (possibly fractional) step, and the budget spent so far."""

    value: float
    step: float
    budget: dict[str, float]

    @property
    def rollouts(self) -> float:
        return self.budget["generated_rollouts"]


@dataclass(frozen=True)
class RunCurve:
    """One run's eval points (in step order) and its raw metrics (for the plot)."""

    run_dir: Path
    seed: int
    domains: tuple[str, ...]
    points: tuple[Reading, ...]
    metrics: tuple[dict[str, float], ...]
    #: the CPU the run ran on (``run.json``'s ``machine.cpu``; ``None`` for a record without it)
    cpu: str | None = None

    @property
    def final(self) -> Reading:
        return self.points[-1]


# ---------------------------------------------------------------------------- reading runs
def read_run(run_dir: Path) -> tuple[dict[str, Any], list[dict[str, float]]]:
    """``run.json`` and ``metrics.jsonl`` of a finished run (a clear error for anything else)."""
    try:
        record = json.loads((run_dir / RECORD).read_text())
    except (OSError, ValueError) as exc:
        raise RunDirError(f"{run_dir}: not a finished run directory ({RECORD}: {exc})") from exc
    if not isinstance(record, dict) or record.get("status") != "complete":
        status = record.get("status") if isinstance(record, dict) else None
        raise RunDirError(f"{run_dir}: run is {status!r}, not complete")
    return record, read_metrics(run_dir / METRICS)


def run_seed(run_dir: Path, record: Mapping[str, Any]) -> int:
    seed = record.get("seed")
    if not isinstance(seed, int):
        raise RunDataError(f"{run_dir}: {RECORD} has no integer 'seed' (got {seed!r})")
    return seed


def _step(line: Mapping[str, Any]) -> str:
    step = line.get("step")
    return str(int(step)) if isinstance(step, (int, float)) and float(step).is_integer() else repr(step)


def _number(run_dir: Path, line: Mapping[str, Any], key: str, why: str) -> float:
    value = line.get(key)
    step = _step(line)
    if value is None:
        raise RunDataError(f"{run_dir}: {METRICS} has no '{key}' at step {step} ({why})")
    if not isinstance(value, (int, float)) or value != value or value in (float("inf"), float("-inf")):
        raise RunDataError(f"{run_dir}: '{key}' at step {step} is {value!r}, not a finite number ({why})")
    return float(value)


def load_curve(run_dir: Path, metric: str) -> RunCurve:
    """The eval points of a finished run: the metric with the cumulative budget on the same line.

    The budget's ``wall_s`` is the sum of ``time/step_s`` up to and including the line (eval and
    checkpoint time are not training cost).
    """
    record, metrics = read_run(run_dir)
    if not metrics:
        raise RunDataError(f"{run_dir}: {METRICS} is empty")
    if not any(metric in m for m in metrics):
        near = sorted({k for m in metrics for k in m if k.startswith("eval/")})
        raise RunDataError(f"{run_dir}: {METRICS} has no '{metric}' on any step (eval keys there: "
                           f"{', '.join(near) or 'none'}); choose the metric with --metric")
    last_eval = max(i for i, m in enumerate(metrics) if metric in m)
    counts_tokens = all(TOKENS[2] in m for m in metrics[: last_eval + 1] if metric in m)
    points: list[Reading] = []
    wall = 0.0
    for m in metrics[: last_eval + 1]:
        wall += _number(run_dir, m, STEP_TIME, "needed on every step for the wall-time budget")
        if metric not in m:
            continue
        budget = {name: _number(run_dir, m, key, "a cumulative counter, needed on every eval step")
                  for name, key in COUNTERS.items()}
        budget["wall_s"] = wall
        if counts_tokens:
            budget[TOKENS[0]] = _number(run_dir, m, TOKENS[1], "a cumulative counter")
        if points and budget["generated_rollouts"] < points[-1].rollouts:
            raise RunDataError(f"{run_dir}: '{COUNTERS['generated_rollouts']}' decreases at step {_step(m)} "
                               "(a cumulative counter)")
        points.append(Reading(_number(run_dir, m, metric, "the compared metric"), float(m.get("step", 0)), budget))
    machine = record.get("machine")
    cpu = machine.get("cpu") if isinstance(machine, dict) and isinstance(machine.get("cpu"), str) else None
    return RunCurve(run_dir, run_seed(run_dir, record), tuple(record.get("domains") or ()), tuple(points),
                    tuple(metrics), cpu)


def read_at_rollouts(curve: RunCurve, rollouts: float, reading: str = "linear") -> Reading | None:
    """The run read at a generated-rollouts budget (``None`` if the budget precedes its first eval point).

    ``floor``: the last eval point whose count is at or below the budget. ``linear``: an eval point at
    exactly the budget if there is one (the last of equal counts: the most trained policy for that
    spend), else linear interpolation of the metric, the step and every budget field between the eval
    points just below and just above it.
    """
    return read_at(curve, "generated_rollouts", rollouts, reading)


def read_at(curve: RunCurve, key: str, amount: float, reading: str = "linear") -> Reading | None:
    """The run read where its budget field ``key`` (``generated_rollouts``, ``generated_tokens``) is ``amount``,
    as :func:`read_at_rollouts` reads rollouts."""
    if reading not in READINGS:
        raise ValueError(f"reading must be one of {', '.join(READINGS)} (got {reading!r})")
    rollouts = amount
    xs = [p.budget[key] for p in curve.points]
    below = [i for i, x in enumerate(xs) if x <= rollouts]
    if not below:
        return None
    i = below[-1]
    if reading == "floor" or xs[i] == rollouts or i + 1 == len(xs):
        return curve.points[i]
    lo, hi = curve.points[i], curve.points[i + 1]
    w = (rollouts - xs[i]) / (xs[i + 1] - xs[i])
    budget = {k: lo.budget[k] + w * (hi.budget[k] - lo.budget[k]) for k in lo.budget}
    budget[key] = rollouts
    return Reading(lo.value + w * (hi.value - lo.value), lo.step + w * (hi.step - lo.step), budget)


# ---------------------------------------------------------------------------- statistics
def _interval(ci: tuple[float, float] | None) -> list[float] | None:
    return None if ci is None else [ci[0], ci[1]]


def _entry(readings: Sequence[Reading], baseline: Sequence[Reading] | None) -> dict[str, Any]:
    values = [r.value for r in readings]
    est = mean_ci(values, CONFIDENCE)
    delta = None
    if baseline is not None:
        d = paired_difference(values, [r.value for r in baseline], CONFIDENCE)
        delta = {"mean": d.mean, "std": d.std, "ci95": _interval(d.ci), "p_value": d.p_value}
    # the fields the readings carry: every counter on the shim; a host without a cost model has no modelled_cost
    budget = {k: sum(r.budget[k] for r in readings) / len(readings) for k in readings[0].budget}
    return {"n": est.n, "mean": est.mean, "std": est.std, "ci95": _interval(est.ci), "delta": delta,
            "budget": budget, "values": values, "at_step": [r.step for r in readings]}


def analyse(curves: Mapping[str, Sequence[RunCurve]], *, baseline: str, metric: str = METRIC,
            reading: str = "linear") -> dict[str, Any]:
    """The ``compare.json`` document. ``curves[label][i]`` is seed ``i`` of every label (same seed order)."""
    if baseline not in curves:
        raise ValueError(f"baseline {baseline!r} is not among the methods ({', '.join(curves)})")
    base = curves[baseline]
    seeds = [c.seed for c in base]
    for label, runs in curves.items():
        if [c.seed for c in runs] != seeds:
            raise ValueError(f"{label} is on seeds {[c.seed for c in runs]}, the baseline on {seeds}")
    methods = {label: _entry([c.final for c in runs], None if label == baseline else [c.final for c in base])
               for label, runs in curves.items()}
    return {
        "schema": SCHEMA, "metric": metric, "baseline": baseline, "seeds": seeds, "confidence": CONFIDENCE,
        "methods": methods,
        "equal_rollouts": _equal(curves, baseline, methods, "generated_rollouts", reading),
        "equal_tokens": _equal(curves, baseline, methods, TOKENS[0], reading),
        "runs": {label: [str(c.run_dir) for c in runs] for label, runs in curves.items()},
        # Runs are bit-identical on one CPU, not across CPUs: the numbers say where they were computed.
        "cpus": sorted({c.cpu for runs in curves.values() for c in runs if c.cpu is not None}),
    }


def _equal(curves: Mapping[str, Sequence[RunCurve]], baseline: str, methods: Mapping[str, Any], key: str,
           reading: str) -> dict[str, Any]:
    """Every method against the baseline at an equal budget of ``key``: each seed's pair read where both have
    spent min(their final amounts) (``compare.json``'s ``equal_rollouts`` / ``equal_tokens``)."""
    words = key.replace("_", " ")
    base = curves[baseline]
    equal: dict[str, Any] = {}
    unavailable: dict[str, str] = {}
    for label, runs in curves.items():
        if label == baseline:
            equal[label] = methods[label]
            continue
        mine, theirs, problem = [], [], None
        for run, ref in zip(runs, base):
            lacking = next((c for c in (run, ref) if key not in c.final.budget), None)
            if lacking is not None:
                problem = (f"seed {run.seed}: {lacking.run_dir} has no {TOKENS[1]} counted with prompt tokens on "
                           f"its eval steps (no {TOKENS[2]}: a run written before they were counted)")
                break
            budget = min(run.final.budget[key], ref.final.budget[key])
            a, b = read_at(run, key, budget, reading), read_at(ref, key, budget, reading)
            if a is None or b is None:
                late = run if a is None else ref
                problem = (f"seed {run.seed}: the common budget ({budget:g} {words}) lies before the "
                           f"first eval point of {late.run_dir} ({late.points[0].budget[key]:g})")
                break
            mine.append(a)
            theirs.append(b)
        if problem is not None:
            equal[label] = None
            unavailable[label] = problem
            continue
        entry = _entry(mine, theirs)
        entry["delta"]["baseline_mean"] = sum(r.value for r in theirs) / len(theirs)
        equal[label] = entry
    return {"reading": reading, "methods": equal, "unavailable": unavailable}


def first_crossing(curve: RunCurve, target: float, key: str = "generated_rollouts") -> float | None:
    """The budget ``key`` at which the curve first reaches ``target``: linear between the eval point below it
    and the first at or above it (that point's budget when it is the first point, or the one before is at or
    above too); ``None``: never reached (censored)."""
    prev: Reading | None = None
    for p in curve.points:
        if p.value >= target:
            if prev is None or prev.value >= target:
                return p.budget[key]
            x0 = prev.budget[key]
            return x0 + (p.budget[key] - x0) * (target - prev.value) / (p.value - prev.value)
        prev = p
    return None


def target_level(curve: RunCurve, last: int = TARGET_POINTS) -> float:
    """A run's final level, smoothed: the mean of its last ``last`` eval points."""
    tail = curve.points[-last:]
    return sum(p.value for p in tail) / len(tail)


def to_target(curves: Mapping[str, Sequence[RunCurve]], baseline: str, key: str = "generated_rollouts",
              last: int = TARGET_POINTS) -> dict[str, Any]:
    """The symmetric rollouts-to-target factor of every method (``compare.json["to_target"]``).

    Per seed, the target is the baseline's final level smoothed (:func:`target_level`); the baseline and the
    method are both read at their *first* crossing of it (:func:`first_crossing`, the same interpolation),
    and the factor is the baseline's budget there over the method's (above 1: the method needs less). A seed
    where either never reaches the target is censored: listed, never dropped silently; the mean and its 95%
    t interval are over the seeds that reach it (``reached`` of ``n``).
    """
    base = curves[baseline]
    out: dict[str, Any] = {}
    for label, runs in curves.items():
        if label == baseline:
            continue
        factors: list[float | None] = []
        at_method: list[float | None] = []
        at_base: list[float | None] = []
        targets: list[float] = []
        for run, ref in zip(runs, base):
            target = target_level(ref, last)
            theirs, mine = first_crossing(ref, target, key), first_crossing(run, target, key)
            targets.append(target)
            at_base.append(theirs)
            at_method.append(mine)
            factors.append(theirs / mine if theirs is not None and mine is not None and mine > 0 else None)
        reached = [f for f in factors if f is not None]
        est = mean_ci(reached, CONFIDENCE) if reached else None
        out[label] = {"n": len(factors), "reached": len(reached),
                      "censored": [r.seed for r, f in zip(runs, factors) if f is None],
                      "mean": None if est is None else est.mean, "std": None if est is None else est.std,
                      "ci95": None if est is None else _interval(est.ci), "per_seed": factors,
                      "method_at": at_method, "baseline_at": at_base, "target": targets}
    return {"budget": key, "target": f"mean of {baseline}'s last {last} eval points (per seed)",
            "last_points": last, "methods": out}
