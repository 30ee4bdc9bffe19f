"""The shim's run config: ``trainer``, ``model``, ``data`` sections plus the optional ``dataflex`` block.

Every key is declared with a :class:`~dataflex_bus.Param`, so an unknown key or a bad value fails before
anything trains, with the key and the allowed values in the message. :func:`prepare` checks these sections
and the ``dataflex`` block together and reports every problem at once.

.. code-block:: yaml

    trainer: {steps: 200, seed: 0, group_size: 8, prompts_per_step: 64, lr: 0.0005}
    data: {domains: [copy, sort, reverse, random], heldout: 600}
    dataflex: {...}          # optional; absent = plain GRPO
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..kit import ConfigError, ConfigIssue, DataflexConfig, check_section, unknown_key, validate
from .host import describe
from .pool import regime_issues
from .sections import DATA, MODEL, SECTIONS, TRAINER
from .sizes import check_memory
from .split import heldout_issues

#: Keys that may change between a checkpoint and its resume (they do not change what a step computes).
RESUMABLE = ("trainer.steps", "trainer.save_every")


def resolve_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """Check the shim sections and fill defaults; the ``dataflex`` block is passed through unchanged.

    Raises :class:`ConfigError` listing every problem (unknown keys with the allowed ones, bad values).
    """
    issues: list[ConfigIssue] = []
    resolved = _resolve_sections(config, issues)
    if issues:
        raise ConfigError(issues)
    return resolved


def _resolve_sections(config: Any, issues: list[ConfigIssue]) -> dict[str, Any]:
    if not isinstance(config, Mapping):
        issues.append(ConfigIssue("<config>", f"expected a mapping, got {type(config).__name__}"))
        config = {}
    for key in config:
        if key not in SECTIONS:
            issues.append(unknown_key(str(key), str(key), SECTIONS))
    block = config.get("dataflex")
    trainer = check_section(config.get("trainer"), TRAINER, "trainer", issues)
    model = check_section(config.get("model"), MODEL, "model", issues)
    data = check_section(config.get("data"), DATA, "data", issues)
    # Whether the held-out prompts fit the domains' levels is only known once both keys are valid.
    if not any(i.key in ("data.domains", "data.heldout") for i in issues):
        misfit = heldout_issues(data["domains"], data["heldout"])
        if misfit:
            issues.extend(misfit)
            data["heldout"] = DATA["heldout"].default  # as for any bad value: later checks go on sound
        # A bad data.train_pool already holds its default (0), so the level weights are checked either way.
        wrong = regime_issues(data["domains"], data["heldout"], data["train_pool"], data["level_weights"])
        if wrong:
            issues.extend(wrong)
            data["train_pool"], data["level_weights"] = DATA["train_pool"].default, {}
    return {"trainer": trainer, "model": model, "data": data,
            "dataflex": copy.deepcopy(block) if block else None}


@dataclass
class RunConfig:
    """A checked run config: the resolved shim sections (and the raw ``dataflex`` block under
    ``"dataflex"``) and the validated method block (``None``: plain GRPO)."""

    resolved: dict[str, Any]
    method: DataflexConfig | None


def prepare(config: Mapping[str, Any] | RunConfig, *, steps: int | None = None,
            seed: int | None = None) -> RunConfig:
    """Apply the ``steps``/``seed`` overrides, check the shim sections and validate the ``dataflex``
    block against the installed plugins, reporting every problem of every section at once."""
    if isinstance(config, RunConfig):
        if steps is None and seed is None:
            return config
        config = config.resolved
    raw = dict(config) if isinstance(config, Mapping) else config
    if isinstance(raw, dict) and (steps is not None or seed is not None):
        trainer = raw.get("trainer")
        if trainer is None or isinstance(trainer, Mapping):
            trainer = dict(trainer or {})
            if steps is not None:
                trainer["steps"] = steps
            if seed is not None:
                trainer["seed"] = seed
            raw["trainer"] = trainer
    issues: list[ConfigIssue] = []
    resolved = _resolve_sections(raw, issues)
    # Sizes first, before anything that allocates (validation runs plugins' code on a probe batch). Keys
    # with a bad value hold their default in `resolved`, so the estimate is sound either way.
    too_big = check_memory(resolved)
    if too_big is not None:
        issues.append(too_big)
    method = None
    if resolved["dataflex"]:
        # The group size is only known when trainer.group_size itself was valid.
        host = describe(resolved, group_size=not any(i.key == "trainer.group_size" for i in issues))
        try:
            method = validate(resolved["dataflex"], host=host)
        except ConfigError as exc:
            issues.extend(exc.issues)
    if method is not None and method.domains and not any(i.key == "data.domains" for i in issues):
        # The mixer would otherwise refuse them only after the warm start (and `validate` never).
        missing = [d for d in method.domains if d not in resolved["data"]["domains"]]
        if missing:
            issues.append(ConfigIssue("dataflex.domains", f"domains {missing} are not in data.domains",
                                      resolved["data"]["domains"]))
    if issues:
        raise ConfigError(issues)
    return RunConfig(resolved, method)


def fingerprint(resolved: Mapping[str, Any]) -> dict[str, Any]:
    """What a checkpoint must agree on with the config that resumes it."""
    out = copy.deepcopy(dict(resolved))
    for dotted in RESUMABLE:
        section, key = dotted.split(".")
        out[section].pop(key, None)
    return out


def check_config(config: Mapping[str, Any]) -> Any:
    """A shim run config checked whole (every section, the ``dataflex`` block against the shim's description),
    every problem at once: the validated block (``None``: plain GRPO); raises
    :class:`~dataflex_bus.errors.ConfigError`."""
    return prepare(config).method
