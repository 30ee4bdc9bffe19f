"""structlog set-up: human console lines by default, JSON lines with ``--log-json`` or
``DATAFLEX_LOG_FORMAT=json``. Imported only by commands that log (structlog costs ~0.1 s to import)."""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

_CONFIGURED: str | None = None


def configure(json: bool | None = None, level: int = logging.INFO) -> None:
    """Route structlog and the stdlib ``dataflex_bus`` logger to stderr in one format."""
    global _CONFIGURED
    import structlog

    if json is None:
        json = os.environ.get("DATAFLEX_LOG_FORMAT", "").lower() == "json"
    fmt = "json" if json else "console"
    if _CONFIGURED == fmt:
        return
    renderer: Any = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=False)
    shared = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    structlog.configure(
        processors=[*shared, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.make_filtering_bound_logger(level),
        cache_logger_on_first_use=False,
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
        foreign_pre_chain=shared,
    ))
    root = logging.getLogger("dataflex_bus")
    # Replace only our own handler (a reconfigure to JSON), never handlers others attached.
    root.handlers = [h for h in root.handlers if not getattr(h, "_dataflex", False)] + [handler]
    handler._dataflex = True  # type: ignore[attr-defined]
    root.setLevel(level)
    root.propagate = False
    _CONFIGURED = fmt


def get_logger(name: str = "dataflex_bus") -> Any:
    """A structlog logger writing through the configured handler."""
    import structlog

    if _CONFIGURED is None:
        configure()
    return structlog.get_logger(name)
