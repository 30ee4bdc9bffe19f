"""``dataflex run`` and ``dataflex compare``: the CPU shim from the command line.

Both validate every config (shim sections and the ``dataflex`` block) before anything trains or any
old run is removed, and never overwrite a run directory without ``--force``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from ..config import load_config
from ..errors import ConfigError, ConfigIssue, PluginRuntimeError
from . import report
from .config import fingerprint, prepare
from .files import CHECKPOINT, METRICS, PLOT, RECORD, RunDirError, check_run_dir, read_metrics
from .run import run_training

COMPARE_PLOT = "compare.png"
COMPARE_TABLE = "table.md"
COMPARE_SUMMARY = "summary.json"


def _plot(metrics: list[dict[str, float]], resolved: dict[str, Any], path: Path, title: str) -> str:
    block = resolved.get("dataflex") or {}
    try:
        report.plot_run(metrics, resolved["data"]["domains"], path, title, mix=block.get("mechanism") == "mix")
    except report.PlottingUnavailable as exc:
        return str(exc)
    return f"plot: {path}"


# ---------------------------------------------------------------------------- run
def cmd_run(args: argparse.Namespace) -> int:
    if args.force and args.resume:
        raise ConfigError(ConfigIssue("--force/--resume", "choose one: --force starts over, --resume continues"))
    prepared = prepare(load_config(args.config, args.overrides), steps=args.steps, seed=args.seed)
    resolved = prepared.resolved
    out = Path(args.out) if args.out else Path("runs") / Path(args.config).stem
    try:
        result = run_training(prepared, out=out, resume=args.resume, force=args.force,
                              progress=not args.no_progress)
    except PluginRuntimeError:
        ckpt = out / CHECKPOINT
        where = f"the last checkpoint ({ckpt}) is intact; fix the plugin and --resume" if ckpt.exists() \
            else "no checkpoint was written yet"
        print(f"dataflex run: stopped: {where}", file=sys.stderr)
        raise
    s = result.summary
    domains = resolved["data"]["domains"]
    print(f"done: {len(result.metrics)} steps in {result.record['wall_s']:.1f}s -> {out}")
    first = report.series(result.metrics[: max(1, len(result.metrics) // 10)], "reward/learnable")
    start = [v for v in first if math.isfinite(v)]
    if start and "reward/learnable" in s:
        print(f"reward on learnable domains: {sum(start) / len(start):.3f} (first 10%) -> "
              f"{s['reward/learnable']:.3f} (last 10%)")
    per = "  ".join(f"{d} {s[f'reward/{d}']:.2f}" for d in domains if f"reward/{d}" in s)
    print(f"final reward per domain: {per}   kept fraction {s.get('train/kept_fraction_all', 1.0):.3f}")
    print(_plot(result.metrics, resolved, out / PLOT, f"{Path(args.config).stem} (seed {resolved['trainer']['seed']})"))
    return 0


# ---------------------------------------------------------------------------- compare
def _read_run(run_dir: Path) -> tuple[dict[str, Any], list[dict[str, float]]]:
    try:
        record = json.loads((run_dir / RECORD).read_text())
    except (OSError, ValueError) as exc:
        raise RunDirError(f"{run_dir}: not a finished run directory ({RECORD}: {exc})") from exc
    if record.get("status") != "complete":
        raise RunDirError(f"{run_dir}: run is {record.get('status')!r}, not complete")
    return record, read_metrics(run_dir / METRICS)


def _reusable(run_dir: Path, resolved: dict[str, Any]) -> bool:
    """A finished run with the same config (steps and seed included) is read instead of re-run."""
    if not (run_dir / RECORD).exists():
        return False
    try:
        record, _ = _read_run(run_dir)
    except RunDirError:
        return False
    saved = record.get("config") or {}
    return (fingerprint(saved) == fingerprint(resolved)
            and saved.get("trainer", {}).get("steps") == resolved["trainer"]["steps"])


def cmd_compare(args: argparse.Namespace) -> int:
    out = Path(args.out)
    plans: list[tuple[str, list[tuple[Path, dict[str, Any] | None, dict[str, Any] | None]]]] = []
    labels: set[str] = set()
    seeds_of: dict[str, list[int]] = {}
    # Validate everything first: a typo in the third config must not cost the first two runs.
    for item in args.configs:
        path = Path(item)
        label = path.name if path.is_dir() else path.stem
        if label in labels:
            raise ConfigError(ConfigIssue(item, f"two inputs share the label {label!r}; rename one"))
        labels.add(label)
        if path.is_dir():
            record, _ = _read_run(path)
            seeds_of[label] = [record.get("seed")]
            plans.append((label, [(path, None, None)]))
            continue
        config = load_config(path)
        base = prepare(config, steps=args.steps).resolved
        seeds = args.seeds or [base["trainer"]["seed"]]
        runs = []
        for seed in seeds:
            resolved = prepare(config, steps=args.steps, seed=seed).resolved
            runs.append((out / label / f"seed{seed}", config, resolved))
        seeds_of[label] = list(seeds)
        plans.append((label, runs))
    if len({tuple(v) for v in seeds_of.values()}) > 1:
        found = ", ".join(f"{label}: {seeds}" for label, seeds in seeds_of.items())
        raise ConfigError(ConfigIssue("--seeds", f"the inputs are not on the same seeds ({found}); pass --seeds "
                                      "so every config runs on the seeds of the others"))
    # Only now, with every input checked, may --force remove a stale run.
    for _, runs in plans:
        for run_dir, _, resolved in runs:
            if resolved is not None and not _reusable(run_dir, resolved):
                check_run_dir(run_dir, force=args.force)

    groups: dict[str, list[list[dict[str, float]]]] = {}
    rows: list[dict[str, Any]] = []
    domains: list[str] = []
    for label, runs in plans:
        metrics_per_seed, records = [], []
        for run_dir, config, resolved in runs:
            if config is not None and resolved is not None and not _reusable(run_dir, resolved):
                if not args.no_progress:
                    print(f"{label} seed {resolved['trainer']['seed']}:", file=sys.stderr)
                run_training(config, steps=args.steps, seed=resolved["trainer"]["seed"], out=run_dir,
                             progress=not args.no_progress)
            record, metrics = _read_run(run_dir)
            records.append(record)
            metrics_per_seed.append(metrics)
            for d in record.get("domains") or []:
                if d not in domains:
                    domains.append(d)
        groups[label] = metrics_per_seed
        row: dict[str, Any] = {"config": label, "seeds": ",".join(str(r.get("seed")) for r in records),
                               "steps": min(len(m) for m in metrics_per_seed)}
        for key in ["reward/mean", "reward/learnable", *(f"reward/{d}" for d in domains), "eval/learnable"]:
            vals = [r["summary"][key] for r in records if key in r.get("summary", {})]
            row[key] = sum(vals) / len(vals) if vals else math.nan
        kept = [r["summary"].get("train/kept_fraction_all", math.nan) for r in records]
        row["kept_fraction"] = sum(kept) / len(kept)
        row["wall_s"] = sum(float(r.get("wall_s", math.nan)) for r in records) / len(records)
        rows.append(row)

    columns = ["config", "seeds", "steps", "reward/mean", "reward/learnable",
               *(f"reward/{d}" for d in domains), "eval/learnable", "kept_fraction", "wall_s"]
    table = report.format_table(rows, columns)
    out.mkdir(parents=True, exist_ok=True)
    note = ("final = mean over the last 10% of steps (training reward) / last held-out eval; "
            "kept_fraction = rows trained / rows rolled out, over the whole run")
    (out / COMPARE_TABLE).write_text(table + "\n\n" + note + "\n")
    (out / COMPARE_SUMMARY).write_text(json.dumps(rows, indent=2, sort_keys=True, default=str))
    print(table)
    print(note)
    try:
        print(f"plot: {report.plot_compare(groups, domains, out / COMPARE_PLOT)}")
    except report.PlottingUnavailable as exc:
        print(str(exc))
    print(f"table: {out / COMPARE_TABLE}")
    return 0
