"""docs/authoring.md's Python blocks run as written: its components pass the kit's contracts, its
examples (including the seed's, through ``dataflex_verl``) build pipelines by name."""

from __future__ import annotations

import inspect
import re
import sys
import types
from pathlib import Path

import pytest

from dataflex_bus.registry import local_specs, unregister_local

DOC = Path(__file__).resolve().parents[2] / "docs" / "authoring.md"
FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def python_blocks() -> list[str]:
    return FENCE.findall(DOC.read_text(encoding="utf-8"))


@pytest.fixture
def doc_namespace(dataflex_fresh_plugins):
    """Run every block, in order, in one module (as a reader pasting them into a file would)."""
    module = types.ModuleType("authoring_doc")
    sys.modules[module.__name__] = module
    before = {(s.kind, s.name) for s in local_specs()}
    try:
        for index, block in enumerate(python_blocks()):
            exec(compile(block, f"{DOC.name}[python block {index}]", "exec"), module.__dict__)
        yield module.__dict__
    finally:
        for spec in local_specs():
            if (spec.kind, spec.name) not in before:
                unregister_local(spec.kind, spec.name)
        del sys.modules[module.__name__]


def test_the_doc_has_the_promised_blocks():
    text = "\n".join(python_blocks())
    for needle in ("class RewardPerToken(Scorer)", "Score(values", "def select(self, batch, score, step)",
                   "def reweight(self, batch, score, step)", "def update(self, batch, score, step)",
                   "def probabilities(self)", "Param(float", "from dataflex_verl.core.registry import register_scorer",
                   "from dataflex_verl.core.scorer import Scorer", "check_scorer(", 'batch["'):
        assert needle in text, needle


def test_every_block_runs_and_every_doc_test_passes(doc_namespace):
    tests = {name: fn for name, fn in doc_namespace.items() if name.startswith("test_") and callable(fn)}
    runnable = {n: f for n, f in tests.items() if not inspect.signature(f).parameters}
    assert {"test_contracts", "test_reward_per_token_by_hand", "test_above_mean_by_hand"} <= set(runnable)
    for fn in runnable.values():
        fn()
    # The tests that take fixtures are real pytest tests of a pack: they only need the installed pack.
    assert set(tests) - set(runnable) == {"test_plugin_is_discovered_and_active", "test_trains"}


def test_doc_components_are_rejected_when_broken(doc_namespace):
    """The contract checks the doc relies on can fail: a mutated copy of the doc's scorer is caught."""
    from dataflex_bus.testing import check_scorer

    base = doc_namespace["RewardPerToken"]

    class CountsPadding(base):
        def score(self, batch, step, **ctx):
            return super().score(batch, step).values / len(batch)

    with pytest.raises(AssertionError, match="padding rows changed"):
        check_scorer(CountsPadding())


def test_every_install_command_works_from_a_clone():
    """Until the packages are published, every `pip install` in the page's shell blocks installs from
    the clone (or a wheel built from it), unless its comment says it needs a published package."""
    blocks = re.findall(r"^```bash\n(.*?)^```", DOC.read_text(encoding="utf-8"), re.S | re.M)
    commands = [line for block in blocks for line in block.splitlines() if "pip install" in line]
    assert len(commands) >= 4
    for line in commands:
        command, _, comment = line.partition("#")
        for part in command.split("&&"):
            if "pip install" not in part:
                continue
            args = part.split("pip install", 1)[1].split()
            local = [a for a in args if a.startswith(("-e", ".", "./", "dist/")) or a.endswith(".whl")
                     or a.startswith("'.") or a.startswith('".')]
            named = [a for a in args if not a.startswith("-") and a not in local and "torch" not in a]
            assert not named or "published" in comment, f"needs a published package: {line!r}"


def test_the_doc_says_a_pack_runs_unchanged_in_trl():
    """Once the page never mentioned TRL, where a pack runs unchanged."""
    text = DOC.read_text(encoding="utf-8")
    section = text[text.index("### The same pack on the shim, in verl and in TRL"):text.index("## 7.")]
    for needle in ("unchanged", "from dataflex_bus.trl import DataflexGRPOTrainer", "processing_class=tokenizer",
                   '"scorer": {"name": "my_scorer"}', "trainer.train()", "dataflex doctor --host trl"):
        assert needle in section, needle
