"""pytest plugin shipped with dataflex-bus (entry point ``pytest11``): fixtures for plugin authors.

Kept import-light: pytest loads it in every session of every project that has dataflex-bus installed.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture
def dataflex_fresh_plugins() -> Iterator[None]:
    """Forget memoised plugin discovery before and after the test."""
    from dataflex_bus.discovery import reset_plugins

    reset_plugins()
    yield
    reset_plugins()
