import pytest

from .toys import register_toys, unregister_toys


@pytest.fixture
def toys():
    register_toys()
    yield
    unregister_toys()
