"""``dataflex doctor``: is the verl integration healthy in this environment?

Checks, in order: verl's version (and whether it is in the range the adapter's private hook points
were tested against), TransferQueue and Ray, the ``verl.plugins`` entry point, whether ``import verl``
registered the real ``dataflex_sync`` trainer (not the stand-in a failed import leaves), the
``VERL_USE_EXTERNAL_PLUGINS`` policy, and the dataflex plugin set. Exits 1 when anything is broken.
"""

from __future__ import annotations

import argparse
import json
import os
from importlib import metadata
from typing import Any

from . import TESTED_VERL, TRAINER_MODE

OK, WARN, FAIL = "ok", "warn", "FAIL"


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _in_range(version: str, low: str, high: str) -> bool:
    from packaging.version import Version

    return Version(low) <= Version(version) < Version(high)


def run_checks() -> list[dict[str, Any]]:
    """Every check as ``{"check", "status", "detail"}``."""
    checks: list[dict[str, Any]] = []

    def add(check: str, status: str, detail: str) -> None:
        checks.append({"check": check, "status": status, "detail": detail})

    verl_version = _version("verl")
    if verl_version is None:
        add("verl", FAIL, 'verl is not installed: pip install "dataflex-bus[verl]"')
        return checks
    tested = _in_range(verl_version, *TESTED_VERL)
    add("verl", OK if tested else FAIL,
        f"verl {verl_version}" + ("" if tested else f" is outside the tested range [{TESTED_VERL[0]}, "
                                  f"{TESTED_VERL[1]}): the adapter overrides private verl methods"))
    for dist in ("TransferQueue", "ray"):
        version = _version(dist)
        add(dist, OK if version else FAIL, f"{dist} {version}" if version else
            f"{dist} is not installed (the v1 trainer needs it): pip install \"verl[verl-core]\"")

    eps = [ep for ep in metadata.entry_points(group="verl.plugins") if ep.value == "dataflex_bus.verl.entry"]
    add("entry point", OK if eps else FAIL,
        f"verl.plugins: {eps[0].name} = {eps[0].value}" if eps else
        "no verl.plugins entry point for dataflex_bus.verl.entry (reinstall dataflex-bus)")

    policy = os.environ.get("VERL_USE_EXTERNAL_PLUGINS", "auto").strip().lower()
    names = {n.strip() for n in policy.split(",") if n.strip()}
    loads = policy == "auto" or (policy != "none" and "dataflex" in names)
    add("VERL_USE_EXTERNAL_PLUGINS", OK if loads else WARN,
        f"{policy!r}" + ("" if loads else ": verl will not load the dataflex plugin; unset it or include "
                         "'dataflex' (on every Ray node)"))

    try:
        import verl  # noqa: F401  (loads the entry points, as every verl process does)
        from verl.trainer.ppo.v1.trainer_base import TRAINER_REGISTRY
    except Exception as exc:
        add("import verl", FAIL, f"{type(exc).__name__}: {exc}")
        return checks
    # What `import verl` registered by itself is what main_ppo will find: read it before importing the
    # entry point ourselves (that import only serves to surface the adapter's own load error).
    registered = TRAINER_REGISTRY.get(TRAINER_MODE)
    from . import entry

    if entry.LOAD_ERROR is not None:
        add("trainer mode", FAIL, f"{TRAINER_MODE!r} is a stand-in: the adapter failed to import:\n"
            f"{entry.LOAD_TRACEBACK}")
    elif registered is None:
        why = (f"VERL_USE_EXTERNAL_PLUGINS={policy!r} excludes the 'dataflex' entry point" if not loads
               else "verl did not load the dataflex entry point")
        add("trainer mode", FAIL, f"`import verl` did not register {TRAINER_MODE!r} ({why}): main_ppo would fail "
            f"with \"Unknown trainer\" (available: {sorted(TRAINER_REGISTRY)})")
    else:
        add("trainer mode", OK, f"{TRAINER_MODE!r} -> {registered.__module__}.{registered.__qualname__}")

    from ..discovery import discover

    # Not strict, whatever DATAFLEX_STRICT_PLUGINS says: report every failed plugin instead of dying on
    # the first one (each failure is a FAIL below, so the exit status still says so).
    plugins = discover(strict=False)
    for record in plugins.records:
        components = ", ".join(sorted(f"{c.name} ({c.kind})" for c in record.components))
        status = {"active": OK, "disabled": WARN}.get(record.status, FAIL)
        add(f"plugin {record.name}", status,
            f"{record.pin} {record.status}: " + (components if record.status == "active" else record.error or ""))
    if not plugins.records:
        add("plugins", WARN, "no dataflex plugins installed: only in-process components are available")
    return checks


def cmd_doctor(args: argparse.Namespace) -> int:
    """Print the checks; exit status 1 if any failed."""
    checks = run_checks()
    if getattr(args, "json", False):
        print(json.dumps(checks, indent=2))
    else:
        width = max(len(c["check"]) for c in checks)
        for c in checks:
            print(f"[{c['status']:>4}] {c['check'].ljust(width)}  {c['detail']}")
    failed = [c["check"] for c in checks if c["status"] == FAIL]
    if not getattr(args, "json", False):
        print(f"dataflex doctor: {'broken: ' + ', '.join(failed) if failed else 'all checks passed'}")
    return 1 if failed else 0
