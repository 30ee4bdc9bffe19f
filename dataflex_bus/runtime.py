"""What a host loop holds for one run: the plugin set, the configured pipeline and the event bus.

The CPU shim and the verl trainer both build a :class:`Runtime` from the ``dataflex`` config block, so
the same plugin code runs in both places.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from .bus import EventBus
from .discovery import PluginSet, get_plugins
from .pipeline import Decision, Pipeline, build_pipeline

if TYPE_CHECKING:
    from .batch import Batch


class Runtime:
    """Plugins + pipeline + bus. ``dataflex`` may be ``None`` (plain GRPO: events still reach observers)."""

    def __init__(self, dataflex: Mapping[str, Any] | None, *, context: Mapping[str, Any] | None = None,
                 plugins: PluginSet | None = None) -> None:
        self.plugins = plugins if plugins is not None else get_plugins()
        self.pipeline: Pipeline | None = (
            build_pipeline(dataflex, self.plugins.registry(), context=context) if dataflex else None
        )
        self.bus = EventBus(self.plugins)
        if self.pipeline is not None:
            self.bus.add_participant(self.pipeline, self.pipeline_name)
        from .logs import get_logger

        # Every run records which plugins (name==version) and which resolved method it ran with.
        get_logger().info("dataflex.runtime", **self.record())

    @property
    def pipeline_name(self) -> str:
        if self.pipeline is None:
            return "none"
        p = self.pipeline.provenance
        return f"{p.get('scorer', self.pipeline.scorer.name)}+{p.get('actuator', self.pipeline.actuator.name)}"

    @property
    def mechanism(self) -> str | None:
        return self.pipeline.config.mechanism if self.pipeline else None

    def emit(self, event: str, batch: Batch, step: int) -> Decision:
        return self.bus.emit(event, batch, step)

    def record(self) -> dict[str, Any]:
        """Provenance written with every run: active plugins (``name==version``) and the resolved block."""
        return {
            "plugins": self.plugins.pins(),
            "failed_plugins": [{"name": r.name, "distribution": r.distribution, "error": r.error}
                               for r in self.plugins.failed],
            "dataflex": self.pipeline.config.to_dict() if self.pipeline else None,
            "components": dict(self.pipeline.provenance) if self.pipeline else {},
            "pipeline_event": self.pipeline.event if self.pipeline else None,
        }

    def state_dict(self) -> dict[str, Any]:
        return {"pipeline": self.pipeline.state_dict() if self.pipeline else None}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        saved = state.get("pipeline")
        if (saved is None) != (self.pipeline is None):
            from .errors import ConfigError, ConfigIssue

            raise ConfigError(ConfigIssue("dataflex", "checkpoint and config disagree on whether a dataflex "
                                          "method is configured"))
        if self.pipeline is not None and saved is not None:
            self.pipeline.load_state_dict(saved)
