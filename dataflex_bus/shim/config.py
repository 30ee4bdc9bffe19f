"""The shim's run config: ``trainer``, ``model``, ``data`` sections plus the optional ``dataflex`` block.

Every key is declared with a :class:`~dataflex_bus.Param`, so an unknown key or a bad value fails before
anything trains, with the key and the allowed values in the message. The ``dataflex`` block is checked
by the foundation when the :class:`~dataflex_bus.Runtime` is built.

.. code-block:: yaml

    trainer: {steps: 200, seed: 0, group_size: 8, prompts_per_step: 64, lr: 0.0005}
    data: {domains: [copy, sort, reverse, random], heldout: 600}
    dataflex: {...}          # optional; absent = plain GRPO
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from ..components import Param
from ..errors import ConfigError, ConfigIssue
from .split import heldout_issues
from .tasks import TASKS

TRAINER: dict[str, Param] = {
    "steps": Param(int, 200, low=1, doc="training steps"),
    "seed": Param(int, 0, low=0, doc="seed of the RL run: domain and prompt draws, rollouts, mini-batch order"),
    "group_size": Param(int, 8, low=1, doc="responses per prompt (verl's rollout.n)"),
    "prompts_per_step": Param(int, 64, low=1, doc="prompts drawn per step (verl's train_batch_size)"),
    "lr": Param(float, 0.0005, low=0.0, low_open=True, doc="Adam learning rate"),
    "clip_ratio": Param(float, 0.2, low=0.0, low_open=True, doc="PPO clip range"),
    "clip_ratio_c": Param(float, 3.0, low=1.0, low_open=True, doc="dual-clip bound for negative advantages"),
    "kl_coef": Param(float, 0.0, low=0.0, doc="KL-loss coefficient to the initial policy (k3); 0 = no ref"),
    "ppo_epochs": Param(int, 1, low=1, doc="passes over each step's batch"),
    "mini_batches": Param(int, 2, low=1, doc="optimizer steps per epoch (rows split evenly)"),
    "temperature": Param(float, 1.0, low=0.0, low_open=True, doc="sampling temperature"),
    "max_grad_norm": Param(float, 1.0, low=0.0, low_open=True, doc="gradient clipping"),
    "save_every": Param(int, 50, low=0, doc="checkpoint every N steps (0: only at the end)"),
    "eval_every": Param(int, 25, low=0, doc="exact greedy accuracy on every held-out prompt at step 0 and every "
                        "N steps (0: never)"),
    "threads": Param(int, 1, low=1, doc="torch CPU threads during the run"),
}
MODEL: dict[str, Param] = {
    "seed": Param(int, 0, low=0, doc="seed of the base policy (initialisation and warm start), which stays "
                  "fixed when trainer.seed changes, as a pretrained checkpoint does"),
    "hidden": Param(int, 64, low=1, doc="GRU width"),
    "layers": Param(int, 1, low=1, doc="GRU layers"),
    "pretrain_steps": Param(int, 500, low=0, doc="supervised warm start on noisy answers (0: cold start)"),
    "pretrain_batch": Param(int, 128, low=1, doc="prompts per warm-start step"),
}
DATA: dict[str, Param] = {
    "seed": Param(int, 0, low=0, doc="seed of the train/held-out split"),
    "heldout": Param(int, 600, low=1, doc="held-out prompts per domain (spread over its levels), never trained on"),
}
DATA_KEYS = ("domains", *DATA)
DEFAULT_DOMAINS = ["copy", "sort", "reverse", "random"]
SECTIONS = ("trainer", "model", "data", "dataflex")
#: Keys that may change between a checkpoint and its resume (they do not change what a step computes).
RESUMABLE = ("trainer.steps", "trainer.save_every")


def _section(raw: Any, key: str, spec: Mapping[str, Param], issues: list[ConfigIssue]) -> dict[str, Any]:
    raw = {} if raw is None else raw
    if not isinstance(raw, Mapping):
        issues.append(ConfigIssue(key, f"expected a mapping, got {type(raw).__name__}"))
        return {name: p.default for name, p in spec.items()}
    out: dict[str, Any] = {}
    for name in raw:
        if name not in spec:
            issues.append(ConfigIssue(f"{key}.{name}", "unknown key", sorted(spec)))
    for name, p in spec.items():
        if name in raw:
            value, issue = p.coerce(f"{key}.{name}", raw[name])
            if issue:
                issues.append(issue)
            out[name] = value
        else:
            out[name] = p.default
    return out


def resolve_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """Check the shim sections and fill defaults; the ``dataflex`` block is passed through unchanged.

    Raises :class:`ConfigError` listing every problem (unknown keys with the allowed ones, bad values).
    """
    issues: list[ConfigIssue] = []
    if not isinstance(config, Mapping):
        raise ConfigError(ConfigIssue("<config>", f"expected a mapping, got {type(config).__name__}"))
    for key in config:
        if key not in SECTIONS:
            issues.append(ConfigIssue(str(key), "unknown key", SECTIONS))
    trainer = _section(config.get("trainer"), "trainer", TRAINER, issues)
    model = _section(config.get("model"), "model", MODEL, issues)
    data_raw = config.get("data") or {}
    domains = list(DEFAULT_DOMAINS)
    data = {name: p.default for name, p in DATA.items()}
    if not isinstance(data_raw, Mapping):
        issues.append(ConfigIssue("data", f"expected a mapping, got {type(data_raw).__name__}"))
    else:
        for name in data_raw:
            if name not in DATA_KEYS:
                issues.append(ConfigIssue(f"data.{name}", "unknown key", DATA_KEYS))
        for name, p in DATA.items():
            if name in data_raw:
                data[name], issue = p.coerce(f"data.{name}", data_raw[name])
                if issue:
                    issues.append(issue)
        given = data_raw.get("domains", domains)
        if not isinstance(given, list) or not given or not all(isinstance(d, str) for d in given):
            issues.append(ConfigIssue("data.domains", f"expected a non-empty list of task names, got {given!r}",
                                      sorted(TASKS)))
        else:
            for d in given:
                if d not in TASKS:
                    issues.append(ConfigIssue("data.domains", f"unknown task {d!r}", sorted(TASKS)))
            if len(set(given)) != len(given):
                issues.append(ConfigIssue("data.domains", f"domains must be distinct, got {given!r}"))
            domains = list(given)
            if not issues:
                issues += heldout_issues(domains, data["heldout"])
    block = config.get("dataflex")
    if issues:
        raise ConfigError(issues)
    return {"trainer": trainer, "model": model, "data": {"domains": domains, **data},
            "dataflex": copy.deepcopy(block) if block else None}


def fingerprint(resolved: Mapping[str, Any]) -> dict[str, Any]:
    """What a checkpoint must agree on with the config that resumes it."""
    out = copy.deepcopy(dict(resolved))
    for dotted in RESUMABLE:
        section, key = dotted.split(".")
        out[section].pop(key, None)
    return out


def diff(saved: Any, now: Any, prefix: str = "") -> list[str]:
    """Dotted keys on which two nested configs disagree, with both values."""
    if isinstance(saved, Mapping) and isinstance(now, Mapping):
        out: list[str] = []
        for key in sorted(set(saved) | set(now), key=str):
            out += diff(saved.get(key), now.get(key), f"{prefix}.{key}" if prefix else str(key))
        return out
    return [] if saved == now else [f"{prefix}: checkpoint {saved!r}, config {now!r}"]
