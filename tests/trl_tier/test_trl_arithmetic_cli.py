"""examples/trl/arithmetic.py's command line: ``--help`` shows every default, the defaults are the run
docs/trl.md's table measured (30 steps), and ``--smoke`` is a small preset that explicit flags override.
Imports only the script's command line (no TRL, no model)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def arithmetic():
    spec = importlib.util.spec_from_file_location("arithmetic_cli", ROOT / "examples" / "trl" / "arithmetic.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_help_shows_every_default(arithmetic, capsys):
    """Before: ``--help`` listed the options without a default."""
    with pytest.raises(SystemExit):
        arithmetic.parse_args(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    for needle in ("--steps", "(default: 30; with --smoke: 2)", "(default: 8; with --smoke: 4)",
                   "default: 1e-05", "default: runs/trl_arithmetic", "--smoke"):
        assert needle in out, needle


def test_the_defaults_are_the_documented_run(arithmetic):
    """Before: 20 steps by default, where docs/trl.md's table measured 30."""
    args = arithmetic.parse_args([])
    assert (args.steps, args.prompts, args.generations, args.max_new_tokens) == (30, 2, 8, 8)
    doc = (ROOT / "docs" / "trl.md").read_text()
    assert re.search(rf"{args.steps} steps each of {args.prompts}\s+prompts x {args.generations} completions x at "
                     rf"most {args.max_new_tokens} new tokens", doc)
    assert "11-12 s" in arithmetic.__doc__ and "half a minute" not in arithmetic.__doc__


def test_smoke_is_a_small_preset_that_flags_override(arithmetic):
    smoke = arithmetic.parse_args(["--smoke"])
    assert (smoke.steps, smoke.generations, smoke.max_new_tokens) == (2, 4, 4)
    assert arithmetic.parse_args(["--smoke", "--steps", "3"]).steps == 3
