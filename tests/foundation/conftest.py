import pytest

from .toys import register_toys, unregister_toys


@pytest.fixture
def toys():
    register_toys()
    yield
    unregister_toys()


@pytest.fixture
def caplog(caplog):
    """The ``dataflex_bus`` logger does not propagate once structlog is configured: attach caplog to it."""
    import logging

    logger = logging.getLogger("dataflex_bus")
    logger.addHandler(caplog.handler)
    yield caplog
    logger.removeHandler(caplog.handler)
