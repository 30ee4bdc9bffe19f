"""One config check for every command: a whole config file, checked the way the host that runs it would.

``dataflex validate`` and ``dataflex run --dry-run`` print the same report: a shim run config has every
section checked (``trainer``/``model``/``data`` and the ``dataflex`` block against the shim's host
description, every problem at once); a verl config has its ``dataflex`` block checked against verl's host
description of that config (:mod:`dataflex_bus.verl.host`: fields, capabilities, estimator, group size and
verl's own settings), the rest being verl's own business.
"""

from __future__ import annotations

import argparse
from typing import Any

#: Top-level keys only a verl config has: such a file is checked as verl's (the dataflex block against
#: verl's context), anything else as a shim run config (every section).
VERL_SECTIONS = frozenset({"actor_rollout_ref", "algorithm", "critic", "reward_model", "reward",
                           "custom_reward_function", "ray_kwargs", "transfer_queue", "global_profiler"})


def check_config(config: dict[str, Any]) -> Any:
    """Check a whole config file the way the host that runs it would, every problem at once: a verl config's
    ``dataflex`` block against verl's context, a shim config's every section. Returns the validated block
    (``None``: no method, plain GRPO); raises :class:`~dataflex_bus.errors.ConfigError`."""
    from .errors import ConfigError

    if VERL_SECTIONS & set(config):
        from .validation import validate
        from .verl.host import context_issues, describe

        issues: list[Any] = context_issues(config)
        block, cfg = config.get("dataflex"), None
        if block:
            try:
                cfg = validate(block, host=describe(config))
            except ConfigError as exc:
                issues.extend(exc.issues)
        if issues:
            raise ConfigError(issues)
        return cfg
    from .shim.config import prepare

    return prepare(config).method


def validation_report(cfg: Any) -> list[str]:
    """What ``dataflex validate`` and ``dataflex run --dry-run`` print for a valid config."""
    if cfg is None:
        return ["ok: no dataflex block: plain GRPO, no method"]
    lines = [f"warning: {warning}" for warning in cfg.warnings]
    for method in cfg.methods:
        name = f"{method.name}: " if cfg.stacked else ""
        lines.append(f"ok: {name}mechanism={method.mechanism} scorer={method.scorer.name} "
                     f"actuator={method.actuator.name}")
    return lines


def cmd_validate(args: argparse.Namespace) -> int:
    from .config import load_config

    print("\n".join(validation_report(check_config(load_config(args.config, args.overrides)))))
    return 0


