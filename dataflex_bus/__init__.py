"""dataflex-bus: data-centric training controls for GRPO as pip-installable plugins.

The public API is importable from here; nothing heavy (torch, plugins) is imported until used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

__version__ = "0.1.0"

from ._lazy import lazy_exports
from .hookspecs import hookimpl, hookspec

_EXPORTS = {
    "Batch": "batch",
    "Component": "components",
    "Param": "components",
    "Score": "components",
    "Scorer": "components",
    "Selector": "mechanisms.select",
    "Selection": "mechanisms.select",
    "Reweighter": "mechanisms.reweight",
    "Reweighting": "mechanisms.reweight",
    "Mixer": "mechanisms.mix",
    "register_component": "registry",
    "register_scorer": "registry",
    "register_selector": "registry",
    "register_reweighter": "registry",
    "register_mixer": "registry",
    "DataflexConfig": "block",
    "MethodConfig": "block",
    "load_config": "config",
    "apply_overrides": "config",
    "Decision": "decision",
    "Method": "method",
    "Pipeline": "pipeline",
    "build_pipeline": "pipeline",
    "build_component": "pipeline",
    "validate": "validation",
    "EventBus": "bus",
    "Runtime": "runtime",
    "get_plugins": "discovery",
    "reset_plugins": "discovery",
}

__all__ = ["__version__", "hookimpl", "hookspec", *_EXPORTS]


__getattr__ = lazy_exports(__name__, _EXPORTS)


if TYPE_CHECKING:
    from .batch import Batch
    from .block import DataflexConfig, MethodConfig
    from .bus import EventBus
    from .components import Component, Param, Score, Scorer
    from .config import apply_overrides, load_config
    from .decision import Decision
    from .discovery import get_plugins, reset_plugins
    from .mechanisms.mix import Mixer
    from .mechanisms.reweight import Reweighter, Reweighting
    from .mechanisms.select import Selection, Selector
    from .method import Method
    from .pipeline import Pipeline, build_component, build_pipeline
    from .registry import (
        register_component,
        register_mixer,
        register_reweighter,
        register_scorer,
        register_selector,
    )
    from .runtime import Runtime
    from .validation import validate
