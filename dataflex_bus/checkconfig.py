"""One config check for every command: a whole config file, checked the way the host that runs it would.

Which host a file is for is read from it by the host registry (:mod:`dataflex_bus.hosts`): each host's
``claims`` says whether a file is written in its form, the fallback host takes any other non-empty file.
``dataflex validate`` and ``dataflex run --dry-run`` print the same report: the file checked by its host's
``check`` (a host with none, such as a form only its doctor reads, leaves it to the fallback host's).
"""

from __future__ import annotations

import argparse
from typing import Any

from . import hosts


def _claimants() -> list[hosts.HostEntry]:
    """The hosts a file may be claimed by, in the order they are asked: every host with ``claims``, then the
    fallback host (which claims any non-empty file no other host does)."""
    fallback = hosts.fallback()
    return [*(e for e in hosts.registered() if e.claims and not e.fallback), *([fallback] if fallback else [])]


def _claim(entry: hosts.HostEntry, config: dict[str, Any]) -> str | None:
    if entry.claims:
        return hosts.load(entry.claims)(config)
    return f"a {entry.name} run config (sections " + ", ".join(sorted(config)) + ")"


def config_host(config: dict[str, Any]) -> tuple[str, str]:
    """Which host a config file is written for, and why: the first registered host whose ``claims`` takes it,
    else the fallback host (the shim: a run config's ``trainer``/``model``/``data`` sections), or ``""`` for an
    empty file (no host said)."""
    if not config:
        return "", "it is empty"
    for entry in _claimants():
        why = _claim(entry, config)
        if why is not None:
            return entry.name, why
    return "", "no registered host claims it"


def check_config(config: dict[str, Any]) -> Any:
    """Check a whole config file the way the host that runs it would, every problem at once: by the ``check`` of
    the first host claiming it that has one, else the fallback host's. Returns the validated block (``None``:
    no method, plain GRPO); raises :class:`~dataflex_bus.errors.ConfigError`."""
    for entry in _claimants():
        if entry.check and (entry.fallback or _claim(entry, config) is not None):
            return hosts.load(entry.check)(config)
    raise hosts.UnknownHostError("no registered host checks config files (none has a `check`)")


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
