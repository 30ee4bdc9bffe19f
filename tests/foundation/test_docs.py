"""The hook reference in docs/DESIGN.md is the hookspec docstrings, verbatim (datasette's practice,
taken one step further: the text is compared, not just the names)."""

import re
from pathlib import Path

import pytest

from dataflex_bus.hookspecs import EVENTS, documented_hooks, markdown

DESIGN = Path(__file__).resolve().parents[2] / "docs" / "DESIGN.md"


@pytest.mark.parametrize("hook", sorted(documented_hooks()))
def test_hookspec_has_a_docstring(hook):
    assert documented_hooks()[hook].__doc__.strip()


def test_design_embeds_the_hookspec_docstrings_verbatim():
    found = re.search(r"<!-- hooks:start -->\n(.*)<!-- hooks:end -->", DESIGN.read_text(), re.S)
    assert found, "docs/DESIGN.md lost its hooks:start/hooks:end markers"
    assert found.group(1) == markdown(), ("docs/DESIGN.md's hook reference differs from dataflex_bus/hookspecs.py; "
                                         "paste the output of dataflex_bus.hookspecs.markdown() between the markers")


def test_events_are_the_documented_order():
    assert EVENTS == ("on_prompts", "on_rollout", "on_advantage", "on_step_end")
    text = DESIGN.read_text()
    positions = [text.index(f"`{e}(") for e in EVENTS]
    assert positions == sorted(positions)


def test_every_module_is_in_the_design_table():
    package = DESIGN.parents[1] / "dataflex_bus"
    table = DESIGN.read_text()
    modules = sorted(p.name for p in package.glob("*.py") if not p.name.startswith("_"))
    missing = [m for m in modules if f"`{m}`" not in table]
    assert not missing, f"docs/DESIGN.md's module table lacks {missing}"


def test_the_readme_block_lists_every_mechanism():
    """Once the README's YAML comment listed ``select | reweight | mix | replay`` (no ``allocate``)."""
    from dataflex_bus.mechanisms import mechanisms

    readme = (DESIGN.parents[1] / "README.md").read_text()
    found = re.search(r"^\s*mechanism: \w+\s+# (.*)$", readme, re.M)
    assert found, "README.md's example block lost its `mechanism:` comment"
    assert [m.strip() for m in found.group(1).split("|")] == [m.name for m in mechanisms()]
