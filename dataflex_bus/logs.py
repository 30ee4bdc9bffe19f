"""Logging. The library configures nothing: it logs through the standard-library logger
``dataflex_bus`` (via structlog's stdlib integration, so key-value context travels as ``extra``), and
whatever handlers the application set up decide where it goes; inside verl, that is verl's logging.

Only an application configures output: the ``dataflex`` command line calls :func:`configure` (human
console lines by default, JSON lines with ``--log-json`` or ``DATAFLEX_LOG_FORMAT=json``).
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

LOGGER = "dataflex_bus"
_HANDLER_MARK = "_dataflex_cli"


def get_logger(name: str = LOGGER) -> Any:
    """A structlog logger writing through the standard-library logger ``name``; configures nothing."""
    import structlog

    return structlog.wrap_logger(
        logging.getLogger(name),
        wrapper_class=structlog.stdlib.BoundLogger,
        processors=[structlog.stdlib.filter_by_level, structlog.stdlib.render_to_log_kwargs],
    )


def configure(json: bool | None = None, level: int = logging.INFO) -> None:
    """Route the ``dataflex_bus`` logger to stderr in one format (for the command line only)."""
    import structlog

    if json is None:
        json = os.environ.get("DATAFLEX_LOG_FORMAT", "").lower() == "json"
    renderer: Any = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=False)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
        foreign_pre_chain=[structlog.stdlib.add_log_level, structlog.processors.TimeStamper(fmt="iso", utc=True),
                           structlog.stdlib.ExtraAdder()],
    ))
    setattr(handler, _HANDLER_MARK, True)
    logger = logging.getLogger(LOGGER)
    # Replace only the handler this function added before (a switch to JSON), never others'.
    logger.handlers = [h for h in logger.handlers if not getattr(h, _HANDLER_MARK, False)] + [handler]
    logger.setLevel(level)
    logger.propagate = False
