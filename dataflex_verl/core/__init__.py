"""``dataflex_verl.core``: the seed's component API (scorers, actuators, registration decorators)."""

from __future__ import annotations

from dataflex_bus._lazy import lazy_exports

_EXPORTS = {
    "Param": "components",
    "Score": "components",
    "Scorer": "components",
    "Selector": "components",
    "Selection": "components",
    "Reweighter": "components",
    "Reweighting": "components",
    "Mixer": "components",
    "register_scorer": "registry",
    "register_selector": "registry",
    "register_reweighter": "registry",
    "register_mixer": "registry",
}

__all__ = list(_EXPORTS)

# Resolved from dataflex_bus (the package the names live in), on first use.
__getattr__ = lazy_exports("dataflex_bus", _EXPORTS)
