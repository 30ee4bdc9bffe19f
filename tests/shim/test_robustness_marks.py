"""The #46 pre-registration's marks (scripts/robustness_marks.py): Holm over its own family, the scoring rule
with censored seeds, and marks recomputed from the committed compact curves equal compare's own numbers."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import yaml

from dataflex_bus.cli import main
from dataflex_bus.shim.stats import holm, one_sided_p

from .conftest import tiny

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("robustness_marks", ROOT / "scripts" / "robustness_marks.py")
assert _spec is not None and _spec.loader is not None
marks = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(marks)


def test_holm_by_hand():
    # sorted: 0.01 x 3 = 0.03, 0.03 x 2 = 0.06, 0.04 x 1 = 0.04 -> 0.06 (never below the one before)
    assert holm([0.01, 0.04, 0.03]) == pytest.approx([0.03, 0.06, 0.06])
    assert holm([0.5, 0.9]) == pytest.approx([1.0, 1.0])


def test_one_sided_p():
    assert one_sided_p(0.0, 1.0, 5) == pytest.approx(0.5)
    assert one_sided_p(1.0, 1.0, 5, value=1.0) == pytest.approx(0.5)
    # t = 2.7764451 with 4 df is the 97.5% quantile: one-sided p 0.025
    assert one_sided_p(2.7764451051977934, 5 ** 0.5, 5) == pytest.approx(0.025, rel=1e-6)
    assert one_sided_p(0.3, None, 1) is None


@pytest.mark.parametrize(("lo", "hi", "p_holm", "censored", "n", "word"), [
    (0.01, 0.03, 0.01, 0, 10, "confirmed"),
    (0.01, 0.03, 0.08, 0, 10, "inconclusive"),   # the interval clears 0, Holm does not
    (-0.01, 0.03, 0.2, 0, 10, "inconclusive"),
    (-0.03, 0.0, 0.9, 0, 10, "refuted"),
    (1.1, 1.4, 0.001, 1, 10, "inconclusive"),    # a censored seed keeps a factor from being confirmed
    (1.1, 1.4, 0.001, 5, 10, "refuted"),         # half the seeds never reach the target
])
def test_the_scoring_rule(lo, hi, p_holm, censored, n, word):
    assert marks.verdict(0.0 if hi < 1 else 1.0, lo, hi, p_holm, censored, n) == word


def test_the_preregistration_holds_the_issue_hypotheses_and_no_result():
    doc = (ROOT / "docs" / "results" / "robustness.md").read_text()
    hs = marks.hypotheses(doc)
    assert len(hs) == 8
    seen = {(h["method"], h["against"], h["experiment"], h["reading"]) for h in hs}
    assert {("knapsack", "grpo_baseline", "independent", "delta_equal_rollouts"),
            ("repo_replay", "grpo_baseline", "independent", "delta_equal_rollouts"),
            ("knapsack", "grpo_baseline", "learnable", "delta_equal_rollouts"),
            ("repo_replay", "grpo_baseline", "learnable", "delta_equal_rollouts"),
            ("repo_replay", "grpo_ppo_epochs2", "independent", "delta_equal_rollouts"),
            ("knapsack", "grpo_baseline", "independent", "delta_equal_tokens"),
            ("repo_replay", "grpo_baseline", "independent", "delta_equal_tokens"),
            ("repo_replay", "grpo_baseline", "independent", "rollouts_to_target_symmetric")} == seen


@pytest.mark.integration
def test_marks_recompute_from_the_compact_curves(tmp_path, capsys):
    cfg = {"trainer": {"eval_every": 1}, "data": {"heldout": 300}}
    a = tmp_path / "grpo_baseline.yaml"
    b = tmp_path / "knapsack.yaml"
    a.write_text(yaml.safe_dump(tiny(**cfg)))
    b.write_text(yaml.safe_dump(tiny(trainer={"eval_every": 1, "lr": 0.01}, data={"heldout": 300})))
    out = tmp_path / "independent"
    assert main(["compare", str(a), str(b), "--steps", "3", "--seeds", "0", "1", "--independent", "--out", str(out),
                 "--no-progress"]) == 0
    curves = {"independent": marks.curves_of(out / "compare.json")}
    path = tmp_path / "curves.json"
    path.write_text(json.dumps(curves))
    report = json.loads((out / "compare.json").read_text())
    r = marks.reading({"method": "knapsack", "against": "grpo_baseline", "experiment": "independent",
                       "reading": "delta_equal_rollouts", "predict": {"op": ">", "value": 0.0}},
                      json.loads(path.read_text()))
    d = report["equal_rollouts"]["methods"]["knapsack"]["delta"]
    assert r["mean"] == d["mean"] and r["ci"] == d["ci95"]
    t = marks.reading({"method": "knapsack", "against": "grpo_baseline", "experiment": "independent",
                       "reading": "delta_equal_tokens", "predict": {"op": ">", "value": 0.0}}, curves)
    assert t["mean"] == report["equal_tokens"]["methods"]["knapsack"]["delta"]["mean"]
    assert curves["independent"]["independent"] is True
    doc = tmp_path / "doc.md"
    doc.write_text((ROOT / "docs" / "results" / "robustness.md").read_text())
    found = marks.fill(doc, path)
    assert found["R1"]["mark"].startswith(("**", "inconclusive")) and found["R5"]["mark"] == "not run"
    assert "knapsack vs grpo_baseline" in doc.read_text()
