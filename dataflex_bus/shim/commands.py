"""``dataflex run``: the CPU shim from the command line (``dataflex compare`` is in :mod:`.compare`).

It validates the config (shim sections and the ``dataflex`` block) before anything trains or any old
run is removed, and never overwrites a run directory without ``--force``.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any

from ..config import load_config
from ..errors import ConfigError, ConfigIssue, PluginRuntimeError
from . import report
from .config import prepare
from .files import CHECKPOINT, PLOT
from .run import run_training


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
    if args.dry_run:
        from ..cli import validation_report

        print("\n".join(validation_report(prepared.method)))
        return 0
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
    print(f"final reward per domain: {per}")
    print(f"kept fraction {s.get('train/kept_fraction', 1.0):.3f} (rows trained / rows generated), "
          f"{int(s.get('train/skipped_updates', 0))} of {len(result.metrics)} updates skipped")
    evals = [m for m in result.metrics if "eval/heldout/learnable" in m]
    if evals:
        print(f"held-out accuracy on learnable domains: {evals[0]['eval/heldout/learnable']:.3f} (step "
              f"{evals[0]['step']:.0f}) -> {evals[-1]['eval/heldout/learnable']:.3f} (step {evals[-1]['step']:.0f})")
    print(_plot(result.metrics, resolved, out / PLOT, f"{Path(args.config).stem} (seed {resolved['trainer']['seed']})"))
    return 0
