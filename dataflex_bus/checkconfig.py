"""One config check for every command: a whole config file, checked the way the host that runs it would.

``dataflex validate`` and ``dataflex run --dry-run`` print the same report: a shim run config has every
section checked (``trainer``/``model``/``data`` and the ``dataflex`` block, every problem at once); a verl
config has its ``dataflex`` block checked against verl's context (``algorithm.adv_estimator``,
``actor_rollout_ref.rollout.n``), the rest being verl's own business.
"""

from __future__ import annotations

import argparse
from typing import Any

#: Top-level keys only a verl config has: such a file is checked as verl's (the dataflex block against
#: verl's context), anything else as a shim run config (every section).
VERL_SECTIONS = frozenset({"actor_rollout_ref", "algorithm", "critic", "reward_model", "reward",
                           "custom_reward_function", "ray_kwargs", "transfer_queue", "global_profiler"})


def verl_context(config: dict[str, Any], issues: list[Any]) -> dict[str, Any]:
    """What validation checks a block against in a verl config: ``algorithm.adv_estimator`` and
    ``actor_rollout_ref.rollout.n`` (a non-integer ``n``, a non-string estimator or a section that is not a
    mapping is an issue naming its key, not a traceback)."""
    from .errors import ConfigIssue

    ctx: dict[str, Any] = {}
    algorithm = _section(config, ("algorithm",), issues)
    estimator = algorithm.get("adv_estimator")
    if estimator is not None:
        if isinstance(estimator, str) and estimator:
            ctx["adv_estimator"] = estimator
        else:
            issues.append(ConfigIssue("algorithm.adv_estimator", f"expected an estimator name (a string), got "
                                      f"{type(estimator).__name__} {estimator!r}"))
    rollout = _section(config, ("actor_rollout_ref", "rollout"), issues)
    if "n" in rollout:
        n = rollout["n"]
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            issues.append(ConfigIssue("actor_rollout_ref.rollout.n", f"expected an integer >= 1 (responses per "
                                      f"prompt), got {type(n).__name__} {n!r}"))
        else:
            ctx["rollout_n"] = n
    return ctx


def _section(config: dict[str, Any], path: tuple[str, ...], issues: list[Any]) -> dict[str, Any]:
    """The mapping at ``path`` (empty when absent); one that is not a mapping is an issue naming its key."""
    from .errors import ConfigIssue

    node: Any = config
    for depth in range(len(path)):
        node = node.get(path[depth])
        if node is None:
            return {}
        if not isinstance(node, dict):
            issues.append(ConfigIssue(".".join(path[: depth + 1]), f"expected a mapping, got "
                                      f"{type(node).__name__} {node!r}"))
            return {}
    return node


def check_config(config: dict[str, Any]) -> Any:
    """Check a whole config file the way the host that runs it would, every problem at once: a verl config's
    ``dataflex`` block against verl's context, a shim config's every section. Returns the validated block
    (``None``: no method, plain GRPO); raises :class:`~dataflex_bus.errors.ConfigError`."""
    from .errors import ConfigError

    if VERL_SECTIONS & set(config):
        from .validation import validate

        issues: list[Any] = []
        context = verl_context(config, issues)
        block, cfg = config.get("dataflex"), None
        if block:
            try:
                cfg = validate(block, context=context)
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


