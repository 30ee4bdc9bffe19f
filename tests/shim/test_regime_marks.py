"""The pre-registered hypotheses' marks (scripts/regime_marks.py): the scoring rule, and marks written from
compare.json into the document's result cells, never touching the hypotheses."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("regime_marks", ROOT / "scripts" / "regime_marks.py")
assert _spec is not None and _spec.loader is not None
marks = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(marks)


@pytest.mark.parametrize(("op", "value", "margin", "lo", "hi", "word"), [
    (">", 0.0, 0.0, 0.001, 0.02, "confirmed"),
    (">", 0.0, 0.0, -0.01, 0.02, "inconclusive"),
    (">", 0.0, 0.0, -0.02, 0.0, "refuted"),
    (">=", 0.0, 0.01, -0.009, 0.01, "confirmed"),
    (">=", 0.0, 0.01, -0.011, 0.01, "inconclusive"),
    (">=", 0.0, 0.01, -0.03, -0.001, "refuted"),
    (">=", 2.0, 0.0, 2.0, 3.0, "confirmed"),
    (">=", 2.0, 0.0, 1.2, 1.9, "refuted"),
])
def test_the_scoring_rule(op, value, margin, lo, hi, word):
    assert marks.verdict(op, value, margin, lo, hi) == word


def test_the_shipped_preregistration_parses_and_names_the_issue_hypotheses():
    hs = marks.hypotheses((ROOT / "docs" / "results" / "regimes.md").read_text())
    pairs = {(h["method"], h["regime"]) for h in hs}
    assert {("greso", "multi_epoch"), ("knapsack", "multi_epoch"), ("knapsack", "hard_tail"),
            ("mopps", "multi_epoch"), ("mopps", "hard_tail"), ("pilot_commit", "default"),
            ("reinforce_ada", "default")} <= pairs
    assert {"dots_replay", "repo_replay"} <= {h["method"] for h in hs}


def test_marks_are_written_from_compare_json(tmp_path):
    doc = tmp_path / "regimes.md"
    doc.write_text((ROOT / "docs" / "results" / "regimes.md").read_text())
    before = marks.hypotheses(doc.read_text())
    out = tmp_path / "cmp"
    out.mkdir()
    entry = {"delta": {"mean": 0.02, "ci95": [0.005, 0.035]}}
    (out / "compare.json").write_text(json.dumps({
        "baseline": "grpo_baseline", "metric": "eval/heldout/learnable", "seeds": [0, 1, 2],
        "runs": {"grpo_baseline": [], "knapsack": [], "mopps": []},
        "equal_rollouts": {"methods": {"knapsack": entry, "mopps": {"delta": {"mean": -0.01,
                                                                              "ci95": [-0.03, 0.01]}}},
                           "unavailable": {}}}))
    got = marks.fill(doc, {"multi_epoch": out})
    assert got["H2"].startswith("**confirmed**: +0.020 [+0.005, +0.035]")
    assert got["H4"].startswith("**inconclusive**")
    assert got["H1"] == "not run" and got["H3"] == "not run"  # greso absent; hard_tail not run
    text = doc.read_text()
    assert "<!-- result:H2 -->**confirmed**: +0.020" in text
    assert marks.hypotheses(text) == before
