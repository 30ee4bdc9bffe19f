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


#: Top-level keys of TRL's config form (``dataflex doctor --host trl --config``, the trainer's ``dataflex=`` file).
TRL_SECTIONS = frozenset({"dataflex", "grpo", "model", "prompt_tokens"})
#: Those only TRL's form has: a shim run config has a ``model`` section too, never ``grpo`` or ``prompt_tokens``.
TRL_ONLY = frozenset({"grpo", "prompt_tokens"})
#: Top-level keys of a bare block (a ``dataflex=`` file may hold the block itself).
BLOCK_KEYS = frozenset({"mechanism", "methods"})


def config_host(config: dict[str, Any]) -> tuple[str, str]:
    """Which host a config file is written for, and why: ``verl`` (verl's sections), ``trl`` (``dataflex:`` alone,
    or with ``grpo:``/``prompt_tokens:`` and ``model:``; or a bare block: the forms TRL's ``dataflex=`` file and
    doctor take), ``shim`` (anything else: a run config's ``trainer``/``model``/``data`` sections), or ``""``
    for an empty file (no host said)."""
    keys = set(config)
    if VERL_SECTIONS & keys:
        return "verl", "it has verl's sections " + ", ".join(sorted(VERL_SECTIONS & keys))
    if BLOCK_KEYS & keys:
        return "trl", "a bare dataflex block, the form TRL's dataflex= file takes"
    if keys and keys <= TRL_SECTIONS and (keys <= {"dataflex"} or keys & TRL_ONLY):
        return "trl", "only " + " and ".join(f"`{k}:`" for k in sorted(keys)) + ", TRL's config form"
    if not keys:
        return "", "it is empty"
    return "shim", "a shim run config (sections " + ", ".join(sorted(keys)) + ")"


def check_verl_config(config: dict[str, Any]) -> Any:
    """A verl config's ``dataflex`` block against verl's description of that config, every problem at once
    (the validated block, ``None`` when there is none); raises :class:`~dataflex_bus.errors.ConfigError`."""
    from .errors import ConfigError
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


def check_config(config: dict[str, Any]) -> Any:
    """Check a whole config file the way the host that runs it would, every problem at once: a verl config's
    ``dataflex`` block against verl's context, a shim config's every section. Returns the validated block
    (``None``: no method, plain GRPO); raises :class:`~dataflex_bus.errors.ConfigError`."""
    if VERL_SECTIONS & set(config):
        return check_verl_config(config)
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


