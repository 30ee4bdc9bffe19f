"""Why a component name may be unknown although the pack that should provide it is installed.

Two causes the registry alone cannot see: a plugin that failed to load (its components never reached the
registry; the ones it declared before failing are named), and a distribution called ``dataflex-*`` that
declares no ``dataflex`` entry point (discovery never looks at it). Both are explained only on the error
path: scanning every installed distribution costs about 0.1 s, which listing plugins must not pay.
"""

from __future__ import annotations

from collections.abc import Sequence
from importlib import metadata
from typing import TYPE_CHECKING

from .registry import normalize_name, slot_of

if TYPE_CHECKING:
    from .discovery import PluginRecord

GROUP = "dataflex"
#: How a pack declares its plugin (what a distribution without one lacks).
ENTRY_POINT_FIX = "declare [project.entry-points.dataflex] in its pyproject.toml and reinstall it"


def _declares_entry_point(dist: metadata.Distribution) -> bool:
    return any(ep.group == GROUP for ep in dist.entry_points)


def dists_without_entry_point() -> list[str]:
    """``name version`` of every installed distribution named ``dataflex*`` with no ``dataflex`` entry point."""
    found = {}
    for dist in metadata.distributions():
        name = dist.metadata["Name"] or ""
        if normalize_name(name).startswith("dataflex") and not _declares_entry_point(dist):
            found[normalize_name(name)] = f"{name} {dist.version}"
    return sorted(found.values())


def installed_without_entry_point(name: str) -> str | None:
    """``name version`` if ``name`` is an installed distribution that declares no ``dataflex`` entry point."""
    try:
        dist = metadata.distribution(name)
    except (metadata.PackageNotFoundError, ValueError):
        return None
    return None if _declares_entry_point(dist) else f"{dist.metadata['Name']} {dist.version}"


def unknown_hint(failed: Sequence[PluginRecord], slot: str, bare: str) -> str:
    """``; ...`` sentences naming what may hide the ``slot`` component ``bare`` (empty when nothing does)."""
    hints = []
    declared = [r for r in failed if any(slot_of(s.kind) == slot and s.name == bare for s in r.declared)]
    for r in declared:
        hints.append(f"{slot} {bare!r} is declared by {r.label}, which failed to load: {r.error}")
    others = [r for r in failed if r not in declared]
    if others:
        shown = "; ".join(f"{r.label}: {r.error}" for r in others[:3])
        more = f" and {len(others) - 3} more" if len(others) > 3 else ""
        hints.append(f"plugins that failed to load (what they provide is unknown): {shown}{more}")
    if not declared:
        silent = dists_without_entry_point()
        if silent:
            hints.append(f"installed but invisible, declaring no 'dataflex' entry point: {', '.join(silent)} "
                         f"({ENTRY_POINT_FIX})")
    return "".join(f"; {h}" for h in hints)
