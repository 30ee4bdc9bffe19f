"""The ``dataflex`` command line. Subcommands import their implementation lazily, so ``--help``,
``--version`` and ``dataflex plugins`` stay fast and never import torch."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from importlib import import_module
from typing import TYPE_CHECKING, Any

from . import __version__

if TYPE_CHECKING:
    from .block import DataflexConfig

#: subcommand -> "module:function" taking the parsed args and returning an exit code.
COMMANDS = {
    "plugins": "dataflex_bus.cli:cmd_plugins",
    "validate": "dataflex_bus.cli:cmd_validate",
    "run": "dataflex_bus.shim.commands:cmd_run",
    "compare": "dataflex_bus.shim.compare:cmd_compare",
    "doctor": "dataflex_bus.verl.doctor:cmd_doctor",
    "new-plugin": "dataflex_bus.template:cmd_new_plugin",
}
#: Commands that log (configuring costs a structlog import, which ``dataflex plugins`` must not pay).
LOGGING_COMMANDS = frozenset({"validate", "run", "compare", "doctor"})


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dataflex", description=__doc__.split("\n")[0])
    parser.add_argument("--version", action="version", version=f"dataflex-bus {__version__}")
    parser.add_argument("--log-json", action="store_true", help="log JSON lines instead of console text")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser("plugins", help="list installed plugins, what they provide and what failed")
    p.add_argument("--json", action="store_true", help="stable, sorted JSON instead of a table")
    p.add_argument("--check", action="store_true", help="exit 1 if any plugin failed to load")

    p = sub.add_parser("validate", help="check a config against the installed plugins; nothing trains")
    p.add_argument("config", help="YAML file with a `dataflex:` block")
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
                   help="replace an earlier comparison in --out and run directories written with another config "
                        "(identical finished runs are still reused)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")

    p = sub.add_parser("doctor", help="check the verl integration: version, trainer mode, plugins")
    p.add_argument("--json", action="store_true", help="the checks as JSON")

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
        parser.error(f"unrecognized arguments: {' '.join(stray or extra)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    if args.command in LOGGING_COMMANDS:
        # The application configures logging; the library never does (it may run inside verl).
        from .logs import configure

        configure(json=True if args.log_json else None)
    module_name, _, func = COMMANDS[args.command].partition(":")
    handler = getattr(import_module(module_name), func)
    from .errors import DataflexError

    try:
        return int(handler(args) or 0)
    except DataflexError as exc:
        print(f"dataflex {args.command}: error: {exc}", file=sys.stderr)
        return 2


# ---------------------------------------------------------------------------- plugins
def plugins_report() -> list[dict[str, Any]]:
    """The ``dataflex plugins --json`` document: sorted by name, then distribution."""
    from .discovery import get_plugins

    records = [r.as_json() for r in get_plugins().records]
    return sorted(records, key=lambda r: (r["name"], r["distribution"] or ""))


def _table(rows: list[list[str]], headers: list[str]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths)).rstrip(),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    return "\n".join(lines)


def cmd_plugins(args: argparse.Namespace) -> int:
    report = plugins_report()
    if args.json:
        print(json.dumps(report, indent=2, sort_keys=True))
    else:
        rows = []
        for r in report:
            comps = ", ".join(f"{c['name']} ({c['kind']})" for c in r["components"])
            detail = comps if r["status"] == "active" else (r["error"] or "")
            rows.append([r["name"], r["distribution"] or "-", r["version"] or "-", r["status"], detail])
        print(_table(rows, ["PLUGIN", "DISTRIBUTION", "VERSION", "STATUS", "COMPONENTS / ERROR"])
              if rows else "no dataflex plugins installed")
    failed = [r for r in report if r["status"] == "failed"]
    return 1 if args.check and failed else 0


# ---------------------------------------------------------------------------- validate
#: Top-level keys only a verl config has: such a config is checked with its verl context.
VERL_KEYS = ("actor_rollout_ref", "algorithm", "critic", "reward_model", "custom_reward_function")
#: The shim's own sections: a config with them (and no verl keys) is checked exactly as `dataflex run` does.
SHIM_SECTIONS = ("trainer", "model", "data")


def _context_value(config: dict[str, Any], path: tuple[str, ...], param: Any, issues: list[Any]) -> Any:
    """The value at ``path`` checked against ``param`` (``None`` when absent); a non-mapping on the way or
    a bad value becomes an issue naming its dotted key."""
    from .errors import ConfigIssue

    node: Any = config
    for depth, part in enumerate(path):
        if not isinstance(node, dict):
            issues.append(ConfigIssue(".".join(path[:depth]), f"expected a mapping, got {type(node).__name__} "
                                      f"{node!r}"))
            return None
        if part not in node or node[part] is None:
            return None
        node = node[part]
    value, issue = param.coerce(".".join(path), node)
    if issue is not None:
        issues.append(issue)
        return None
    return value


def host_context(config: dict[str, Any]) -> dict[str, Any]:
    """Facts about a verl host that validation checks against: ``algorithm.adv_estimator`` and
    ``actor_rollout_ref.rollout.n``, type-checked. Raises :class:`ConfigError` naming a bad key."""
    from .errors import ConfigError
    from .schema import Param

    issues: list[Any] = []
    ctx: dict[str, Any] = {}
    estimator = _context_value(config, ("algorithm", "adv_estimator"), Param(str, nonempty=True), issues)
    if estimator is not None:
        ctx["adv_estimator"] = estimator
    n = _context_value(config, ("actor_rollout_ref", "rollout", "n"), Param(int, low=1), issues)
    if n is not None:
        ctx["rollout_n"] = n
    if issues:
        raise ConfigError(issues)
    return ctx


def cmd_validate(args: argparse.Namespace) -> int:
    from .config import load_config
    from .errors import ConfigError, ConfigIssue
    from .validation import validate

    config = load_config(args.config, args.overrides)
    block = config.get("dataflex")
    if block is None:
        raise ConfigError(ConfigIssue("dataflex", f"{args.config} has no `dataflex:` block"))
    cfg: DataflexConfig | None = None
    if any(key in config for key in VERL_KEYS):
        issues: list[ConfigIssue] = []
        try:
            context = host_context(config)
        except ConfigError as exc:  # report the block's problems with the context's, all at once
            issues += exc.issues
            context = {}
        try:
            cfg = validate(block, context=context)
        except ConfigError as exc:
            issues += exc.issues
        if issues:
            raise ConfigError(issues)
        checked = "with the verl context" + "".join(f" {k}={v}" for k, v in context.items())
    elif any(key in config for key in SHIM_SECTIONS):
        from .shim.config import prepare

        cfg = prepare(config).method
        checked = "as a dataflex run config (every section, as `dataflex run` checks it)"
    else:
        cfg = validate(block)
        checked = "the dataflex block alone (no host sections)"
    if cfg is None:  # `dataflex: {}` or null: plain GRPO
        print(f"ok: no dataflex method (plain GRPO); checked {checked}")
        return 0
    for m in cfg.methods:
        name = f"{m.name}: " if len(cfg.methods) > 1 else ""
        print(f"ok: {name}mechanism={m.mechanism} scorer={m.scorer.name} actuator={m.actuator.name}")
    print(f"checked {checked}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
