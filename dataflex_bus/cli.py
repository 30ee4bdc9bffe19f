"""The ``dataflex`` command line. Subcommands import their implementation lazily, so ``--help``,
``--version`` and ``dataflex plugins`` stay fast and never import torch."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from importlib import import_module

from . import __version__, hosts

#: subcommand -> "module:function" taking the parsed args and returning an exit code.
COMMANDS = {
    "plugins": "dataflex_bus.catalog:cmd_plugins",
    "info": "dataflex_bus.catalog:cmd_info",
    "validate": "dataflex_bus.checkconfig:cmd_validate",
    "run": "dataflex_bus.shim.commands:cmd_run",
    "compare": "dataflex_bus.shim.compare:cmd_compare",
    "doctor": "dataflex_bus.doctor:cmd_doctor",
    "new-plugin": "dataflex_bus.template:cmd_new_plugin",
}
#: Commands that log (configuring costs a structlog import, which ``dataflex plugins`` must not pay).
LOGGING_COMMANDS = frozenset({"validate", "run", "compare", "doctor"})



def description() -> str:
    labels = ", ".join(e.label for e in hosts.registered())
    return ("Data-centric training controls for GRPO (select, reweight, mix, replay, allocate) as plugins on one "
            f"event bus, run by its hosts ({labels}): list and inspect plugins, check configs, "
            "train on the CPU shim, compare methods, check a host integration.")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dataflex", description=description())
    parser.add_argument("--version", action="version", version=f"dataflex-bus {__version__}")
    parser.add_argument("--log-json", action="store_true", help="log JSON lines instead of console text")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser("plugins", help="list installed plugins, what they provide and what failed")
    p.add_argument("--json", action="store_true", help="stable, sorted JSON instead of a table")
    p.add_argument("--check", action="store_true",
                   help="also import every component in a separate process and check its declarations; "
                        "exit 1 on any failure")
    p.add_argument("--timeout", type=float, default=300.0, metavar="SECONDS",
                   help="--check: give up on a plugin whose import takes longer (default 300)")

    p = sub.add_parser("info", help="one component: parameters, timing, granularity, an example config")
    p.add_argument("name", help="component name, or distribution:name")
    from .mechanisms import component_kinds  # import-light: the registry of mechanisms, no torch

    p.add_argument("--kind", choices=[*component_kinds(), "actuator"],
                   help="when the name is both a scorer and an actuator")
    p.add_argument("--json", action="store_true", help="JSON (a list: one entry per matching component)")

    p = sub.add_parser("validate", help="check a config against the installed plugins; nothing trains")
    forms = " or ".join(e.check_form for e in hosts.registered() if e.check)
    p.add_argument("config", help=f"YAML file: {forms}")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. dataflex.actuator.params.low=0.1")

    p = sub.add_parser("run", help="train on the CPU shim with the configured method")
    p.add_argument("config", help="YAML run config (see examples/)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. dataflex.warmup_step=5")
    p.add_argument("--steps", type=int, help="training steps (overrides trainer.steps)")
    p.add_argument("--seed", type=int, help="random seed (overrides trainer.seed)")
    p.add_argument("--out", help="run directory (default runs/<config name>)")
    p.add_argument("--force", action="store_true", help="overwrite an existing run directory")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --out")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--dry-run", action="store_true",
                   help="check the config as `dataflex validate` does; nothing trains")
    p.add_argument("--regime", metavar="FILE",
                   help="a training regime (examples/regimes/): its trainer/data keys merged over the config, "
                        "recorded in run.json")

    p = sub.add_parser("compare", help="several configs on the same seeds: paired statistics, table and plot")
    p.add_argument("configs", nargs="+",
                   help="YAML run configs, finished run directories, or directories of them (one per seed)")
    p.add_argument("--steps", type=int, help="training steps for each run")
    p.add_argument("--seeds", type=int, nargs="+", help="seeds (default: the config's seed)")
    p.add_argument("--baseline", help="label (config stem or directory name) the others are compared with "
                                      "(default: the first input)")
    p.add_argument("--metric", default="eval/heldout/learnable",
                   help="held-out metric compared at each run's last eval point (default: %(default)s)")
    p.add_argument("--budget-reading", default="linear", choices=["linear", "floor"],
                   help="how a run is read at a rollout budget between eval points (default: %(default)s)")
    p.add_argument("--out", default="runs/compare", help="output directory for runs, compare.json, table and plot")
    p.add_argument("--force", action="store_true",
                   help="replace an earlier comparison in --out and start over every run that is not an identical "
                        "finished one (those are still reused); with --resume, only runs of another config")
    p.add_argument("--resume", action="store_true",
                   help="continue unfinished runs (an interrupted compare) from their checkpoints; finished runs "
                        "are reused")
    p.add_argument("--no-progress", action="store_true", help="no progress bars (each run is still named)")
    p.add_argument("--regime", metavar="FILE",
                   help="a training regime (examples/regimes/) merged over every config input; recorded in each "
                        "run.json and in compare.json")
    p.add_argument("--independent", action="store_true",
                   help="seed i sets trainer.seed, model.seed and data.seed to i: the base policy and the pool vary "
                        "with the seed too (one warm start per seed, cached); recorded in compare.json")
    p.add_argument("--tokens", action="store_true",
                   help="columns for generated tokens (prompt + response) and the difference at equal generated "
                        "tokens (compare.json's equal_tokens is written either way)")
    p.add_argument("--to-target", action="store_true",
                   help="a column for the symmetric rollouts-to-target factor: the baseline's rollouts over the "
                        "method's at the first crossing of the baseline's final level (mean of its last 3 eval "
                        "points); compare.json's to_target")

    # Every host with a doctor (``dataflex_bus.hosts``); ``dataflex_bus.doctor:cmd_doctor`` picks one: ``--host``,
    # else the host a ``--config`` file is written for, else the first.
    default, *others = doctors = hosts.doctors()
    picked = "".join(f", or {e.label} with --host {e.name}" for e in others)
    p = sub.add_parser("doctor", help=f"check a host integration ({default.label}{picked}): versions, the "
                                      "trainer, plugins")
    p.add_argument("--host", choices=sorted(e.name for e in doctors),
                   help=f"the host to check (default: the one a --config file is written for, else {default.name})")
    p.add_argument("--json", action="store_true", help="the checks as JSON")
    p.add_argument("--strict", action="store_true",
                   help="exit 1 on a warning too (e.g. a selection that keeps nothing of the probe batch)")
    p.add_argument("--config", metavar="FILE",
                   help="; ".join(f"{e.name}: {e.doctor_config}" for e in sorted(doctors, key=lambda e: e.name)))
    p.add_argument("overrides", nargs="*",
                   help="; ".join(f"{e.name}: {e.doctor_overrides}" for e in doctors) + ". Doctor then also checks "
                        "the dataflex block against the trainer that config runs")

    p = sub.add_parser("new-plugin", help="create a method pack from the template")
    p.add_argument("name", help="pack name, e.g. my-scorer (distribution dataflex-my-scorer)")
    p.add_argument("--dir", default=".", help="parent directory (default: current)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    # Overrides may come after options (`run cfg.yaml --steps 5 dataflex.warmup_step=2`): collect them.
    args, extra = parser.parse_known_args(argv)
    stray = [e for e in extra if "=" not in e and not e.startswith("~")]
    if extra and (not hasattr(args, "overrides") or stray):
        # The subcommand's own usage (its options), not the top-level one.
        subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        subparsers.choices[args.command].error(f"unrecognized arguments: {' '.join(stray or extra)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    if args.command in LOGGING_COMMANDS:
        # The application configures logging; the library never does (it may run inside verl).
        from .logs import configure

        configure(json=True if args.log_json else None)
    module_name, _, func = COMMANDS[args.command].partition(":")
    handler = getattr(import_module(module_name), func)
    from .errors import DataflexError

    code = None
    try:
        code = int(handler(args) or 0)
        sys.stdout.flush()  # here, not at exit, so a reader that stopped reading is met below
        return code
    except BrokenPipeError:
        _reader_gone()
        return 0 if code is None else code  # the command's own verdict, when it finished
    except DataflexError as exc:
        from .errors import clip_text, format_traceback

        if _debug():
            # The plugin's own frames (file and line), the cause chain first; the one-line error stays last.
            print(format_traceback(exc), file=sys.stderr, end="")
        print(f"dataflex {args.command}: error: {clip_text(str(exc))}", file=sys.stderr)
        for note in getattr(exc, "__notes__", ()):  # what the error means for the command's files
            print(f"dataflex {args.command}: {note}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:  # Ctrl-C (or a plugin raising it) is no crash: no traceback
        print(f"dataflex {args.command}: interrupted" + (f" ({exc})" if str(exc) else ""), file=sys.stderr)
        return 130


def _debug() -> bool:
    from .registry import debug_mode

    return debug_mode()


def _reader_gone() -> None:
    """stdout's reader closed the pipe (``dataflex info X | head -1``): it has what it wanted, which is no
    failure of ours (exit 0, or the command's own status). Python ignores SIGPIPE and raises instead; what is
    still buffered would raise again when the interpreter flushes at exit, so stdout goes to /dev/null."""
    import os

    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
