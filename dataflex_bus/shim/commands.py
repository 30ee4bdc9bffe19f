"""``dataflex run``: the CPU shim from the command line (``dataflex compare`` is in :mod:`.compare`).

It validates the config (shim sections and the ``dataflex`` block) before anything trains or any old
run is removed, and never overwrites a run directory without ``--force``.
"""

from __future__ import annotations

import argparse
import math
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType

from ..kit import ConfigError, ConfigIssue, PluginRuntimeError, SignalInterrupt, add_note, apply_overrides, load_config
from . import report
from .config import prepare
from .files import CHECKPOINT, checkpoint_step
from .regime import load_regime
from .run import run_training


# ---------------------------------------------------------------------------- run
def _on_signal(signum: int, frame: FrameType | None) -> None:
    raise SignalInterrupt(signal.Signals(signum).name)


def interruption(exc: KeyboardInterrupt) -> str:
    """`` (SIGTERM) at step 12``: what interrupted a run and where (empty for a bare interrupt)."""
    if isinstance(exc, SignalInterrupt):
        return f" ({exc.signal_name})" + (f" at step {exc.step}" if exc.step is not None else "")
    return f" ({exc})" if str(exc) else ""


@contextmanager
def signals_interrupt() -> Iterator[None]:
    """While training, SIGTERM (a scheduler's stop, `kill`) and SIGINT (Ctrl-C) end the run as an interrupt:
    recorded as interrupted at its step, the last checkpoint intact, and never blamed on the plugin whose
    code was running when the signal arrived. The library itself installs no handler (it may run in verl)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, _on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _checkpoint_note(out: Path) -> str:
    step = checkpoint_step(out)
    if step is not None:
        return f"the last checkpoint ({out / CHECKPOINT}, step {step}) is intact; --resume continues from it"
    return "no checkpoint was written yet"


def cmd_run(args: argparse.Namespace) -> int:
    if args.force and args.resume:
        raise ConfigError(ConfigIssue("--force/--resume", "choose one: --force starts over, --resume continues"))
    regime = load_regime(args.regime) if getattr(args, "regime", None) else None
    config = load_config(args.config)
    # The overlay first, the command line's overrides last: `key=value` still wins over the regime.
    config = apply_overrides(config if regime is None else regime.apply(config), args.overrides)
    if args.dry_run:
        from ..kit import validation_report

        print("\n".join(validation_report(prepare(config, steps=args.steps, seed=args.seed).method)))
        return 0
    out = Path(args.out) if args.out else Path("runs") / Path(args.config).stem
    # run_training checks the config, holds the run directory (the plot included) and writes every file in it.
    with signals_interrupt():
        try:
            result = run_training(config, steps=args.steps, seed=args.seed, out=out, resume=args.resume,
                                  force=args.force, progress=not args.no_progress, regime=regime,
                                  plot=Path(args.config).stem)
        except PluginRuntimeError as exc:
            add_note(exc, f"stopped: {_checkpoint_note(out)}")  # printed after the error it explains
            raise
        except KeyboardInterrupt as exc:
            print(f"dataflex run: interrupted{interruption(exc)}; {_checkpoint_note(out)}", file=sys.stderr)
            return 130
        s = result.summary
        domains = result.record["config"]["data"]["domains"]
        print(f"done: {len(result.metrics)} steps in {result.record['wall_s']:.1f}s -> {out}")
        first = report.series(result.metrics[: max(1, len(result.metrics) // 10)], "reward/learnable")
        start = [v for v in first if math.isfinite(v)]
        if start and "reward/learnable" in s:
            print(f"reward on learnable domains: {sum(start) / len(start):.3f} (first 10%) -> "
                  f"{s['reward/learnable']:.3f} (last 10%)")
        rewards = {d: s.get(f"dataflex/rollout/reward_mean/{d}") for d in domains}
        per = "  ".join(f"{d} {r:.2f}" for d, r in rewards.items() if r is not None)
        print(f"final reward per domain: {per}")
        print(f"kept fraction {s.get('dataflex/kept_fraction', 1.0):.3f} (rows trained / rows generated), "
              f"{int(s.get('dataflex/skipped_updates', 0))} of {len(result.metrics)} updates skipped")
        if s.get("compute/replayed_rows"):
            print(f"replayed rows trained again: {int(s['compute/replayed_rows'])} (not generated: "
                  "compute/replayed_rows)")
        evals = [m for m in result.metrics if "eval/heldout/learnable" in m]
        if evals:
            print(f"held-out accuracy on learnable domains: {evals[0]['eval/heldout/learnable']:.3f} (step "
                  f"{evals[0]['step']:.0f}) -> {evals[-1]['eval/heldout/learnable']:.3f} "
                  f"(step {evals[-1]['step']:.0f})")
        print(result.plot)
    return 0
