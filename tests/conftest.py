"""Suite-wide settings: our own tests load plugins strictly, so a broken first-party pack fails loudly."""

import importlib.util
import logging
import os

import pytest

os.environ.setdefault("DATAFLEX_STRICT_PLUGINS", "1")


def pytest_configure(config: pytest.Config) -> None:
    # Locally the verl tier skips when verl is not installed; in CI a missing verl must be an error,
    # never a quietly skipped tier.
    if os.environ.get("CI", "").lower() in {"1", "true", "yes"} and importlib.util.find_spec("verl") is None:
        raise pytest.UsageError("CI=true but verl is not installed: install the `verl` extra")


@pytest.fixture
def dataflex_log(caplog, monkeypatch):
    """Every record of the library's logger, once. The command line's log set-up (if a CLI test ran
    earlier in the session) stops propagation, so the handler sits on the logger itself, with propagation
    off meanwhile."""
    logger = logging.getLogger("dataflex_bus")
    monkeypatch.setattr(logger, "propagate", False)
    monkeypatch.setattr(logger, "level", logging.DEBUG)
    logger.addHandler(caplog.handler)
    caplog.handler.setLevel(logging.DEBUG)
    yield caplog
    logger.removeHandler(caplog.handler)


@pytest.fixture
def register(dataflex_register_plugin):
    """``register(kind, name, cls)``: an in-process component for one test (the testing kit's fixture)."""
    return dataflex_register_plugin
