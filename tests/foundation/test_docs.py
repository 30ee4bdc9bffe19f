"""Every hookspec is documented in docs/DESIGN.md and carries a docstring (datasette's practice)."""

from pathlib import Path

import pytest

from dataflex_bus.hookspecs import EVENTS, documented_hooks

DESIGN = Path(__file__).resolve().parents[2] / "docs" / "DESIGN.md"


@pytest.mark.parametrize("hook", sorted(documented_hooks()))
def test_hookspec_is_documented(hook):
    assert documented_hooks()[hook].__doc__.strip()
    assert f"`{hook}" in DESIGN.read_text(), f"docs/DESIGN.md does not document hook {hook}"


def test_events_are_the_documented_order():
    assert EVENTS == ("on_rollout", "on_advantage", "on_step_end")
    text = DESIGN.read_text()
    positions = [text.index(f"`{e}(") for e in EVENTS]
    assert positions == sorted(positions)
