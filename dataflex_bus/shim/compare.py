"""``dataflex compare``: several methods on the same seeds, with paired statistics against a baseline.

Each input (a config, a finished run directory, or a directory of run directories) becomes one method
label with one run per seed. A method's number is its held-out metric at its last eval point; against
the baseline it gets the paired difference on the same seeds (Student t interval, two-sided p). A
second reading compares every method with the baseline at *equal generated rollouts*: each pair of
runs (same seed) is read at the smaller of their final rollout counts, so neither side is credited with
rollouts the other did not generate; a third at *equal generated tokens* (prompt + response tokens of
every generated rollout, ``compute/generated_tokens``) in the same way. The reading between eval points is
linear interpolation (default) or the last eval point at or below the budget (``floor``); docs/shim.md
defines both. ``--to-target`` adds the symmetric rollouts-to-target factor (:func:`.analysis.to_target`) and
``--independent`` varies the base policy and the pool with the seed (``model.seed`` and ``data.seed`` set to
it, as ``trainer.seed`` is).

Outputs in ``--out``: ``compare.json`` (schema :data:`.analysis.SCHEMA`), ``table.md`` and ``compare.png``. An
earlier comparison there is never replaced without ``--force``.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..kit import ConfigError, ConfigIssue, DataflexError, PluginRuntimeError, add_note, article, load_config
from ..kit import differences as diff
from . import report
from .analysis import COUNTERS, READINGS, analyse, load_curve, read_run, run_seed, to_target
from .commands import interruption, signals_interrupt
from .config import RunConfig, fingerprint, prepare
from .files import RECORD, RunDirError, checkpoint_step, existing_run_files
from .regime import Regime, load_regime, regime_change, regime_words, same_regime
from .run import run_training

COMPARE_JSON = "compare.json"
COMPARE_TABLE = "table.md"
COMPARE_PLOT = "compare.png"
#: What an earlier comparison left in ``--out``; ``--force`` replaces exactly these.
COMPARE_FILES = (COMPARE_JSON, COMPARE_TABLE, COMPARE_PLOT)
#: The optional table columns (``compare.json["columns"]``) and the option that asks for each.
COLUMNS = {"tokens": "--tokens", "to_target": "--to-target"}


# ---------------------------------------------------------------------------- the command
@dataclass
class _Input:
    label: str
    source: str
    runs: dict[int, Path]
    #: for a config input: the checked config of each seed
    prepared: dict[int, RunConfig] | None = None


def _runs_in_dir(path: Path) -> dict[int, Path]:
    """A run directory holds one seed; a directory of run directories (``OUT/<label>``) holds several."""
    found: dict[int, Path] = {}
    single = (path / RECORD).exists()
    for child in [path] if single else sorted(p for p in path.iterdir() if (p / RECORD).exists()):
        seed = run_seed(child, read_run(child)[0])
        if seed in found:
            raise RunDirError(f"{path}: {found[seed].name} and {child.name} both hold seed {seed}")
        found[seed] = child
    if not found:
        raise RunDirError(f"{path}: neither a run directory nor a directory of run directories (no {RECORD})")
    return dict(sorted(found.items()))


def _label(path: Path) -> str:
    """Config stem, or directory name; a ``seed<k>`` run directory is named after its method's directory."""
    if not path.is_dir():
        return path.stem
    if re.fullmatch(r"seed\d+", path.name) and (path / RECORD).exists() and path.resolve().parent.name:
        return path.resolve().parent.name
    return path.name


def _reusable(run_dir: Path, resolved: dict[str, Any]) -> bool:
    """A finished run with the same config (steps and seed included) is read instead of re-run."""
    if not (run_dir / RECORD).exists():
        return False
    try:
        record, _ = read_run(run_dir)
    except DataflexError:
        return False
    saved = record.get("config") or {}
    return (fingerprint(saved) == fingerprint(resolved)
            and saved.get("trainer", {}).get("steps") == resolved["trainer"]["steps"])


@dataclass
class _Todo:
    """A run compare has to train: from scratch, over an old run (``restart``) or from its checkpoint."""

    input: _Input
    seed: int
    resume: bool = False
    restart: bool = False
    #: the checkpoint's step (``resume``)
    at: int = 0


def _record(run_dir: Path) -> dict[str, Any]:
    try:
        record = json.loads((run_dir / RECORD).read_text())
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def _held(run_dir: Path, record: Mapping[str, Any], at: int | None) -> str:
    """What an occupied run directory holds, in words (for the refusal that names it)."""
    status = record.get("status") or "unreadable"
    done = (record.get("counters") or {}).get("steps_done")
    state = f"{article(status)} {status} run" + (f" at step {done}" if isinstance(done, int) and status != "complete"
                                                 else "")
    return state + (f", its checkpoint at step {at}" if at is not None else ", no checkpoint")


def _todo(i: _Input, seed: int, args: argparse.Namespace, regime: Regime | None = None) -> _Todo | None:
    """What to do with one config input's seed (``None``: a finished identical run, read as it is). Refuses,
    naming the directory and the option that would do it, before anything trains."""
    assert i.prepared is not None
    run_dir, resolved = i.runs[seed], i.prepared[seed].resolved
    if _reusable(run_dir, resolved):
        return None
    if not existing_run_files(run_dir):
        return _Todo(i, seed)
    record = _record(run_dir)
    at = checkpoint_step(run_dir)
    changed = diff(fingerprint(record.get("config") or {}), fingerprint(resolved))
    if args.resume and not changed:
        other = regime_change(record.get("regime"), regime) if "config" in record else None
        if other:
            raise ConfigError(ConfigIssue("--regime", f"{run_dir}: {other}"))
        if at is None:  # nothing saved yet: a resume would redo those steps too
            return _Todo(i, seed, restart=True)
        steps = resolved["trainer"]["steps"]
        if at > steps:
            raise ConfigError(ConfigIssue("--steps", f"{run_dir} holds a checkpoint at step {at}, past the {steps} "
                                          "steps asked for: a resume cannot shorten a run; pass --steps "
                                          f"{at} or more, or --force to start it over"))
        return _Todo(i, seed, resume=True, at=at)
    if args.force:
        return _Todo(i, seed, restart=True)
    held = _held(run_dir, record, at)
    if changed:
        shown = "; ".join(c.replace("checkpoint ", "there ", 1) for c in changed[:3])
        more = f" and {len(changed) - 3} more" if len(changed) > 3 else ""
        raise RunDirError(f"{run_dir} holds {held}, written with another config ({shown}{more}); use --force to "
                          "re-run it (its files are replaced)")
    how = ("--resume to continue it from its checkpoint" if at is not None else
           "--resume (it has no checkpoint yet, so it starts over)")
    raise RunDirError(f"{run_dir} holds {held}; rerun with {how}, or --force to start it over (finished runs with "
                      "the same config are reused either way)")


def _interrupted(todo: _Todo, exc: KeyboardInterrupt) -> str:
    run_dir = todo.input.runs[todo.seed]
    at = checkpoint_step(run_dir)
    saved = f"its checkpoint ({run_dir}) holds step {at}" if at is not None else "no checkpoint was written yet"
    return (f"dataflex compare: interrupted{interruption(exc)} in {todo.input.label} seed {todo.seed}; {saved}; "
            "rerun the same command with --resume to continue: finished runs are reused, unfinished ones resume "
            "from their checkpoints")


def _plan(args: argparse.Namespace, out: Path, regime: Regime | None = None) -> list[_Input]:
    inputs: list[_Input] = []
    for item in args.configs:
        path = Path(item)
        label = _label(path)
        if any(i.label == label for i in inputs):
            raise ConfigError(ConfigIssue(item, f"two inputs share the label {label!r}; rename one"))
        if path.is_dir():
            runs = _runs_in_dir(path)
            if args.seeds:
                missing = [s for s in args.seeds if s not in runs]
                if missing:
                    raise ConfigError(ConfigIssue("--seeds", f"{path} holds no run for seed(s) {missing} (it "
                                                  f"holds seed(s) {sorted(runs)})"))
                runs = {s: runs[s] for s in args.seeds}
            if args.independent:
                _check_independent(runs)
            inputs.append(_Input(label, item, runs))
            continue
        config = load_config(path)
        if regime is not None:
            config = regime.apply(config)
        if args.seeds:
            prepared = {seed: prepare(independent(config, seed) if args.independent else config, steps=args.steps,
                                      seed=seed) for seed in args.seeds}
        else:
            base = prepare(config, steps=args.steps)
            prepared = {base.resolved["trainer"]["seed"]: base}
        inputs.append(_Input(label, item, {s: out / label / f"seed{s}" for s in prepared}, prepared))
    seeds_of = {i.label: list(i.runs) for i in inputs}
    if len({frozenset(v) for v in seeds_of.values()}) > 1:
        found = ", ".join(f"{label}: {seeds}" for label, seeds in seeds_of.items())
        raise ConfigError(ConfigIssue("--seeds", f"the inputs are not on the same seeds ({found}); pass --seeds "
                                      "so every config runs on the seeds of the others"))
    order = list(inputs[0].runs)  # pairs are formed by position: one seed order for every input
    for i in inputs:
        i.runs = {seed: i.runs[seed] for seed in order}
    return inputs


def independent(config: Mapping[str, Any], seed: int) -> dict[str, Any]:
    """``config`` with its base policy and pool seeded by ``seed`` (``model.seed`` and ``data.seed``)."""
    out = dict(config)
    for section in ("model", "data"):
        own = out.get(section)
        if own is not None and not isinstance(own, Mapping):
            continue  # the config check names the section
        out[section] = {**(own or {}), "seed": seed}
    return out


def _check_independent(runs: Mapping[int, Path]) -> None:
    """``--independent`` over finished runs: each must have been run with model.seed and data.seed = its seed."""
    for seed, run_dir in runs.items():
        config = _record(run_dir).get("config") or {}
        got = {f"{s}.seed": (config.get(s) or {}).get("seed") for s in ("model", "data")}
        wrong = {k: v for k, v in got.items() if v != seed}
        if wrong:
            shown = ", ".join(f"{k} {v!r}" for k, v in wrong.items())
            raise ConfigError(ConfigIssue("--independent", f"{run_dir} is seed {seed} with {shown}: not an "
                                          "independent run (--independent sets model.seed and data.seed to the "
                                          "seed); compare it without --independent"))


def _regime_of(inputs: Sequence[_Input], regime: Regime | None) -> dict[str, Any] | None:
    """The one regime every compared run is (or will be) trained under, as recorded (``None``: none): the
    configs run under ``--regime`` (or none), and each finished run directory was run under the regime its
    ``run.json`` records. Runs of two regimes are refused, naming a directory and both regimes: their pairs
    would compare testbeds, not methods, under one label in ``compare.json``."""
    dirs = [(run_dir, _record(run_dir).get("regime")) for i in inputs if i.prepared is None
            for run_dir in i.runs.values()]
    if regime is not None:
        expected: Any = regime.record()
        theirs = f"--regime {regime.file} asks for {regime_words(expected)}"
    elif any(i.prepared is not None for i in inputs) or not dirs:
        expected, theirs = None, "the config inputs run without --regime (no regime)"
    else:  # only finished runs and no --regime: theirs, if they share one
        expected = dirs[0][1]
        theirs = f"{dirs[0][0]} was run under {regime_words(expected)}"
    for run_dir, recorded in dirs:
        if not same_regime(recorded, expected):
            raise ConfigError(ConfigIssue("--regime", f"{run_dir} was run under {regime_words(recorded)}, but "
                                          f"{theirs}: compared runs must share one regime (compare run "
                                          "directories of one regime, under that --regime or none)"))
    return expected if isinstance(expected, dict) else None


def _baseline(args: argparse.Namespace, inputs: Sequence[_Input]) -> str:
    if args.baseline is None:
        return inputs[0].label
    for i in inputs:
        if args.baseline in (i.label, i.source):
            return i.label
    raise ConfigError(ConfigIssue("--baseline", f"{args.baseline!r} is none of the compared inputs",
                                  [i.label for i in inputs]))


def cmd_compare(args: argparse.Namespace) -> int:
    out = Path(args.out)
    if args.budget_reading not in READINGS:
        raise ConfigError(ConfigIssue("--budget-reading", f"unknown reading {args.budget_reading!r}", READINGS))
    args.independent = getattr(args, "independent", False)
    if args.independent and not args.seeds:
        raise ConfigError(ConfigIssue("--independent", "needs --seeds: seed i sets trainer.seed, model.seed and "
                                      "data.seed to i"))
    # Validate everything first: a typo in the third config must not cost the first two runs.
    regime = load_regime(args.regime) if getattr(args, "regime", None) else None
    inputs = _plan(args, out, regime)
    shared_regime = _regime_of(inputs, regime)
    baseline = _baseline(args, inputs)
    earlier = [name for name in COMPARE_FILES if (out / name).exists()]
    if earlier and not args.force:
        raise RunDirError(f"{out} already holds a comparison ({', '.join(earlier)}); use --force to replace it "
                          "(finished runs with the same config are still reused)")
    todos = [t for i in inputs if i.prepared is not None for seed in i.runs
             if (t := _todo(i, seed, args, regime))]
    # Runs that already exist are checked for the metric and counters before anything trains.
    pending = {(t.input.label, t.seed) for t in todos}
    read = {(i.label, seed): load_curve(run_dir, args.metric)
            for i in inputs for seed, run_dir in i.runs.items() if (i.label, seed) not in pending}
    with signals_interrupt():  # SIGTERM stops a compare as Ctrl-C does: recorded, resumable
        for todo in todos:
            i, seed = todo.input, todo.seed
            # Which run is training, with or without progress bars (a log must say what each line belongs to).
            doing = f" resuming from its checkpoint at step {todo.at}" if todo.resume else (
                " starting over" if todo.restart else "")
            print(f"{i.label} seed {seed}:{doing}", file=sys.stderr)
            assert i.prepared is not None
            try:
                run_training(i.prepared[seed], out=i.runs[seed], resume=todo.resume, force=todo.restart,
                             progress=not args.no_progress, regime=regime)
            except KeyboardInterrupt as exc:
                print(_interrupted(todo, exc), file=sys.stderr)
                return 130
            except PluginRuntimeError as exc:
                at = checkpoint_step(i.runs[seed])
                add_note(exc, f"stopped in {i.label} seed {seed}" + (
                    f"; its checkpoint holds step {at}: fix the plugin and rerun with --resume" if at is not None
                    else ""))
                raise

    curves = {i.label: [read.get((i.label, s)) or load_curve(i.runs[s], args.metric) for s in i.runs]
              for i in inputs}
    summary = analyse(curves, baseline=baseline, metric=args.metric, reading=args.budget_reading)
    if args.independent:
        summary["independent"] = True
    if getattr(args, "to_target", False):
        summary["to_target"] = to_target(curves, baseline)
    columns = [name for name in COLUMNS if getattr(args, name, False)]
    if columns:
        summary["columns"] = columns
    if shared_regime is not None:
        summary["regime"] = shared_regime
    domains: list[str] = []
    for runs in curves.values():
        for c in runs:
            domains += [d for d in c.domains if d not in domains]

    out.mkdir(parents=True, exist_ok=True)
    for name in earlier:  # only reached with --force; a stale PNG must not outlive its comparison
        (out / name).unlink()
    (out / COMPARE_JSON).write_text(json.dumps(summary, indent=2, allow_nan=False) + "\n")
    table = report.compare_table(summary)
    (out / COMPARE_TABLE).write_text(table + "\n")
    print(table)
    groups = {label: [list(c.metrics) for c in runs] for label, runs in curves.items()}
    try:
        path = report.plot_compare(groups, metric=args.metric, domains=domains, path=out / COMPARE_PLOT,
                                   baseline=baseline, rollouts_key=COUNTERS["generated_rollouts"])
        print(f"plot: {path}")
    except report.PlottingUnavailable as exc:
        print(str(exc))
    print(f"table: {out / COMPARE_TABLE}\njson: {out / COMPARE_JSON}")
    return 0
