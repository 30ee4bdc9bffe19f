"""The contrib packs' sources are importable in the main suite without installing them.

Their components are registered in-process by the tests (``dataflex_register_plugin``), so the main
environment's plugin set is unchanged; the real-wheel checks live in ``test_integration_packs.py``.
"""

import sys
from pathlib import Path

import pytest

from .helpers import OutcomeReward

CONTRIB = Path(__file__).resolve().parents[2] / "contrib"
for src in sorted(CONTRIB.glob("dataflex-*/src")):
    if str(src) not in sys.path:
        sys.path.insert(0, str(src))


@pytest.fixture
def contrib_components(dataflex_isolated_plugins, dataflex_register_plugin):
    """Only the contrib packs' components plus a reward scorer, registered in-process."""
    dataflex_register_plugin("selector", "gfpo", "dataflex_gfpo.selector:GFPO")
    dataflex_register_plugin("mixer", "tscl", "dataflex_tscl.mixer:TSCL")
    dataflex_register_plugin("scorer", "response_length", "dataflex_length.scorer:ResponseLength")
    dataflex_register_plugin("scorer", "outcome_reward", OutcomeReward)
    return dataflex_isolated_plugins
