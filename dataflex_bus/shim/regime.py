"""Training regimes: a YAML overlay of ``trainer``/``data`` keys merged over any run config
(``dataflex run CONFIG --regime FILE``, ``dataflex compare A B ... --regime FILE``).

A regime changes the testbed, never the method or the base policy: only the ``trainer`` and ``data``
sections may appear in it, and each of their keys replaces the config's own (a ``data.level_weights``
mapping as a whole). The merged config is checked as any config is, so a bad key names itself. The run
record (``run.json``) keeps the regime (its name, file and overlay) and a resume refuses a regime that
is not the one the run was started with. ``examples/regimes/`` holds the shipped ones.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..kit import ConfigError, ConfigIssue, load_yaml

#: The sections a regime may set.
REGIME_SECTIONS = ("trainer", "data")


@dataclass(frozen=True)
class Regime:
    """A loaded regime overlay: its name (the file's stem), the file and the overlay itself."""

    name: str
    file: str
    overlay: dict[str, Any]

    def record(self) -> dict[str, Any]:
        """What ``run.json`` and ``compare.json`` keep under ``"regime"``."""
        return {"name": self.name, "file": self.file, "overlay": copy.deepcopy(self.overlay)}

    def apply(self, config: Mapping[str, Any]) -> dict[str, Any]:
        """``config`` with the overlay's keys merged over its sections (a new dict; ``config`` is untouched)."""
        out = copy.deepcopy(dict(config))
        for section, keys in self.overlay.items():
            own = out.get(section)
            merged = dict(own) if isinstance(own, Mapping) else {}
            merged.update(copy.deepcopy(keys))
            out[section] = merged
        return out


def load_regime(path: str | Path) -> Regime:
    """Read and check a regime file: a mapping of :data:`REGIME_SECTIONS` to mappings of keys."""
    overlay = load_yaml(path)
    issues = []
    for section, keys in overlay.items():
        if section not in REGIME_SECTIONS:
            issues.append(ConfigIssue(f"{path}: {section}", "a regime sets only the testbed's sections (not the "
                                      "method's dataflex block nor the base policy's model)", REGIME_SECTIONS))
        elif not isinstance(keys, Mapping):
            issues.append(ConfigIssue(f"{path}: {section}", f"expected a mapping of keys, got "
                                      f"{type(keys).__name__} {keys!r}"))
    if not overlay:
        issues.append(ConfigIssue(str(path), "an empty regime: it would change nothing"))
    if issues:
        raise ConfigError(issues)
    return Regime(Path(path).stem, str(path), {s: dict(k) for s, k in overlay.items()})


def regime_words(recorded: Any) -> str:
    """A recorded regime (``run.json``'s ``"regime"``, or :meth:`Regime.record`) in words: ``regime 'NAME'
    (OVERLAY)``, or ``no regime``."""
    if not isinstance(recorded, Mapping):
        return "no regime"
    return f"regime {recorded.get('name')!r} ({recorded.get('overlay')})"


def same_regime(recorded: Any, other: Any) -> bool:
    """Whether two recorded regimes are one: only the overlay counts (a renamed file of the same keys is)."""
    def overlay(r: Any) -> Any:
        return r.get("overlay") if isinstance(r, Mapping) else None

    return bool(overlay(recorded) == overlay(other))


def regime_change(recorded: Any, regime: Regime | None) -> str | None:
    """Why a run recorded with ``recorded`` (``run.json``'s ``"regime"``) may not be resumed under ``regime``
    (``None``: it may). Only the overlay counts: a renamed file holding the same keys is the same regime."""
    before = recorded.get("overlay") if isinstance(recorded, Mapping) else None
    now = None if regime is None else regime.overlay
    if before == now:
        return None
    was = f"regime {recorded.get('name')!r} ({before})" if isinstance(recorded, Mapping) else "no regime"
    asked = f"regime {regime.name!r} ({now})" if regime is not None else "no regime"
    return (f"the run was started with {was}, this resume asks for {asked}; resume with the regime it was "
            "started with, or start over (--force)")


__all__ = ["REGIME_SECTIONS", "Regime", "load_regime", "regime_change", "regime_words", "same_regime"]
