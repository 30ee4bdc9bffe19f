"""What every host's ``dataflex doctor`` shares: versions, the plugin set and the report.

Each host has its own checks (its registration's ``doctor`` in :mod:`dataflex_bus.hosts`, chosen with
``dataflex doctor --host``); a check is ``{"check", "status", "detail"}`` with ``status`` one of
:data:`OK`, :data:`WARN` and :data:`FAIL`, and the command exits 1 when any failed (``--strict``: or warned).
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Callable, Iterator
from importlib import metadata
from typing import Any

OK, WARN, FAIL = "ok", "warn", "FAIL"
Add = Callable[[str, str, str], None]


def version(dist: str) -> str | None:
    """The installed version of distribution ``dist`` (``None``: not installed)."""
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def in_range(version: str, low: str, high: str) -> bool:
    from packaging.version import Version

    return Version(low) <= Version(version) < Version(high)


def new_checks() -> tuple[list[dict[str, Any]], Add]:
    """An empty list of checks and the ``add(check, status, detail)`` that appends to it."""
    checks: list[dict[str, Any]] = []

    def add(check: str, status: str, detail: str) -> None:
        checks.append({"check": check, "status": status, "detail": detail})

    return checks, add


def tested_version(add: Add, dist: str, tested: tuple[str, str], install: str, why: str) -> bool:
    """Check that ``dist`` is installed (else FAIL with ``install``) and in the ``tested`` range ``[low, high)``
    (else FAIL saying ``why`` the range matters); False when it is not installed."""
    found = version(dist)
    if found is None:
        add(dist, FAIL, f"{dist} is not installed: {install}")
        return False
    ok = in_range(found, *tested)
    add(dist, OK if ok else FAIL,
        f"{dist} {found}" + ("" if ok else f" is outside the tested range [{tested[0]}, {tested[1]}): {why}"))
    return True


def plugin_checks(add: Add) -> None:
    """Every plugin as ``plugins --check`` sees it: each component imported (in a child process, never
    strict, so every failure is reported rather than the first raised), name collisions flagged."""
    from .catalog import checked_report

    report = checked_report()
    for r in report:
        pin = f"{r['distribution'] or r['name']}=={r['version'] or 'unknown'}"
        broken = [f"{c['name']} ({c['kind']}) cannot be used: {c['check']}" for c in r["components"]
                  if c.get("check") not in (None, "ok")]
        if r["status"] == "failed" or broken:
            status = FAIL
        elif r["status"] == "disabled" or r["warnings"]:
            status = WARN
        else:
            status = OK
        components = ", ".join(sorted(f"{c['name']} ({c['kind']})" for c in r["components"]))
        detail = components if r["status"] == "active" else r["error"] or f"by {r['disabled_by']}"
        add(f"plugin {r['name']}", status, "; ".join([f"{pin} {r['status']}: {detail}", *broken, *r["warnings"]]))
    if not report:
        add("plugins", WARN, "no dataflex plugins installed: only in-process components are available")


@contextlib.contextmanager
def block_warnings() -> Iterator[list[str]]:
    """The warnings dataflex-bus logs while a block is validated and built (a selection keeping nothing of the
    probe batch, a scorer other than its selector's statistic, a host's untested setting): collected for a
    WARN check instead of printed as log lines above the table (where they read as noise before an ok)."""
    seen: list[str] = []
    prefix = "dataflex: "

    def collect(record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        text = record.getMessage()
        seen.append(text[len(prefix):] if text.startswith(prefix) else text)
        return False

    logger = logging.getLogger("dataflex_bus")
    logger.addFilter(collect)
    try:
        yield seen
    finally:
        logger.removeFilter(collect)


def add_block(add: Add, detail: str, warnings: list[str]) -> None:
    """The ``dataflex block`` check of a block that validated: WARN with each warning when it has any."""
    if warnings:
        add("dataflex block", WARN, detail + "; but: " + "; ".join(warnings))
    else:
        add("dataflex block", OK, detail)


def report(checks: list[dict[str, Any]], *, as_json: bool = False, strict: bool = False) -> int:
    """Print the checks (a table, or JSON); the exit status: 1 if any failed (``strict``: or warned)."""
    if as_json:
        print(json.dumps(checks, indent=2))
    else:
        width = max(len(c["check"]) for c in checks)
        for c in checks:
            print(f"[{c['status']:>4}] {c['check'].ljust(width)}  {c['detail']}")
    failed = [c["check"] for c in checks if c["status"] == FAIL]
    warned = [c["check"] for c in checks if c["status"] == WARN]
    if not as_json:
        warnings = ", ".join(warned)
        if failed:
            verdict = "broken: " + ", ".join(failed) + (f"; warnings: {warnings}" if warned else "")
        elif warned:
            verdict = f"warnings: {warnings}" + (" (failing under --strict)" if strict else
                                                 "; no check failed (--strict fails on warnings)")
        else:
            verdict = "all checks passed"
        print(f"dataflex doctor: {verdict}")
    return 1 if failed or (strict and warned) else 0


def cmd_doctor(args: Any) -> int:
    """``dataflex doctor``: the checks of ``--host``; without it, of the host a ``--config`` file is written for
    (read first: a missing file is an error, not the default host's checks run beside it), else the default's
    (the first registered host with a doctor, :func:`dataflex_bus.hosts.doctors`). A host read from the file is
    said on stderr (stdout stays the table or the JSON), with how to pick the other."""
    import sys

    from . import hosts
    from .errors import ConfigError, ConfigIssue

    checked = [e.name for e in hosts.doctors()]
    host, path = getattr(args, "host", None), getattr(args, "config", None)
    if host is None and path is not None:
        from .checkconfig import config_host
        from .config import load_config

        host, why = config_host(load_config(path))
        others = " or ".join(f"--host {h}" for h in sorted(checked) if h != host)
        if host and host not in checked:  # a file of a host without a doctor: validate is what checks it
            raise ConfigError(ConfigIssue(path, f"{why}: doctor checks a host integration ({others}); "
                                                f"`dataflex validate {path}` checks a {host} run config"))
        if not host:
            host = checked[0]
            why += ", so no host is said"
        print(f"dataflex doctor: checking host {host!r} ({path}: {why}); {others} checks that host instead",
              file=sys.stderr)
    doctor = hosts.get(host or checked[0]).doctor
    if doctor is None:
        raise hosts.UnknownHostError(f"host {host!r} has no doctor (hosts with one: {', '.join(checked)})")
    return int(hosts.load(doctor)(args) or 0)
