"""``dataflex doctor --host lean``: the lean host's one check (its description), in the shared report."""

from __future__ import annotations

from typing import Any

from dataflex_bus.kit import OK, new_checks, report


def cmd_doctor(args: Any) -> int:
    from .driver import description

    checks, add = new_checks()
    host = description()
    add("lean host", OK, "capabilities: " + ", ".join(sorted(host.capabilities)))
    return report(checks, as_json=getattr(args, "json", False), strict=getattr(args, "strict", False))
