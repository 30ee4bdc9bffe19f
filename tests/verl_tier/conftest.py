"""Fixtures of the verl tier (the Ray + TransferQueue session, ``tq_session``, is the suite's: tests/conftest.py).

Nothing here imports verl at module import, so collecting this directory costs nothing when the verl
tier is deselected (``-m "not verl"``).
"""

from __future__ import annotations

import pytest


@pytest.fixture
def verl_components():
    """Register the tests' small components in-process (see verl_components.py)."""
    import verl_components  # noqa: F401  (registers on import)

    yield


@pytest.fixture
def H(clean_partition, verl_components):
    """The harness module (verl_harness.py) with an empty TransferQueue partition and the tests' components."""
    import verl_harness

    return verl_harness
