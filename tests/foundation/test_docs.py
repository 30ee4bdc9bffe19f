"""The hook reference in docs/hooks.md is the hookspec docstrings, verbatim (datasette's practice, taken one
step further: the text is compared, not just the names); docs/layers.json places every module."""

import json
import re
from pathlib import Path

import pytest

from dataflex_bus.hookspecs import EVENTS, documented_hooks, markdown

ROOT = Path(__file__).resolve().parents[2]
DESIGN = ROOT / "docs" / "DESIGN.md"
HOOKS = ROOT / "docs" / "hooks.md"
LAYERS = ROOT / "docs" / "layers.json"


@pytest.mark.parametrize("hook", sorted(documented_hooks()))
def test_hookspec_has_a_docstring(hook):
    assert documented_hooks()[hook].__doc__.strip()


def test_the_hook_reference_embeds_the_hookspec_docstrings_verbatim():
    found = re.search(r"<!-- hooks:start -->\n(.*)<!-- hooks:end -->", HOOKS.read_text(), re.S)
    assert found, "docs/hooks.md lost its hooks:start/hooks:end markers"
    assert found.group(1) == markdown(), ("docs/hooks.md's hook reference differs from dataflex_bus/hookspecs.py; "
                                         "paste the output of dataflex_bus.hookspecs.markdown() between the markers")


def test_events_are_the_documented_order():
    assert EVENTS == ("on_prompts", "on_rollout", "on_advantage", "on_step_end")
    for doc, mark in ((HOOKS, "`{}("), (DESIGN, "{}(batch")):  # the reference, and DESIGN.md's step diagram
        text = doc.read_text()
        positions = [text.index(mark.format(e)) for e in EVENTS]
        assert positions == sorted(positions), doc.name


def test_the_layering_whiteboard_places_every_module():
    """docs/layers.json, the project's layering whiteboard, puts every module of dataflex_bus/ on a part (a file, or
    a folder ending in /) and names no path that is gone; DESIGN.md points to it instead of listing modules."""
    board = json.loads(LAYERS.read_text())
    paths = [path for part in board["parts"].values() for path in part["is"]]
    gone = [path for path in paths if not (ROOT / path).exists()]
    assert not gone, f"docs/layers.json places paths that do not exist: {gone}"
    modules = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "dataflex_bus").rglob("*.py")
                     if "__pycache__" not in p.parts)
    unplaced = [m for m in modules if not any(m == p or (p.endswith("/") and m.startswith(p)) for p in paths)]
    assert not unplaced, f"docs/layers.json leaves {unplaced} on no part"


def test_the_readme_block_lists_every_mechanism():
    """Once the README's YAML comment listed ``select | reweight | mix | replay`` (no ``allocate``)."""
    from dataflex_bus.mechanisms import mechanisms

    readme = (ROOT / "README.md").read_text()
    found = re.search(r"^\s*mechanism: \w+\s+# (.*)$", readme, re.M)
    assert found, "README.md's example block lost its `mechanism:` comment"
    assert [m.strip() for m in found.group(1).split("|")] == [m.name for m in mechanisms()]
