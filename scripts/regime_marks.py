"""Score the pre-registered hypotheses of ``docs/results/regimes.md`` from the regime comparisons and write
their marks (confirmed / refuted / inconclusive, with the interval) into that file.

The hypotheses are the file's ``yaml hypotheses`` block; each names a method, the label it is read
against, a regime and a reading (the file's "Scoring" section defines them). ``compare_dirs`` maps a
regime name to its ``dataflex compare`` output directory (``compare.json`` and the runs it lists).
``scripts/regenerate_results.py --regimes`` calls :func:`fill`; it can also run alone:

    python scripts/regime_marks.py docs/results/regimes.md default=runs/regimes/default multi_epoch=...
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "scripts"))

from greso_report import reach  # noqa: E402  (benchmarks/ is no package)
from preregistration import read_hypotheses  # noqa: E402  (scripts/ is no package)

from dataflex_bus.shim.analysis import load_curve  # noqa: E402
from dataflex_bus.shim.stats import mean_ci  # noqa: E402

READINGS = ("delta_equal_rollouts", "per_group_ratio", "rollouts_to_target")


def hypotheses(doc: str) -> list[dict[str, Any]]:
    """The pre-registered hypotheses of the document, checked."""
    return read_hypotheses(doc, group="regime", readings=READINGS, ops=(">", ">="))


def verdict(op: str, value: float, margin: float, lo: float, hi: float) -> str:
    """The scoring rule of the document's "Scoring" section."""
    if lo > value - margin if op == ">" else lo >= value - margin:
        return "confirmed"
    if hi <= value if op == ">" else hi < value:
        return "refuted"
    return "inconclusive"


def _final(run_dir: str, metric: str) -> dict[str, Any]:
    curve = load_curve(Path(run_dir), metric)
    last = curve.metrics[-1]
    return {"rollouts": last["compute/generated_rollouts"], "per_group":
            last["compute/generated_rollouts"] / max(last.get("compute/trained_groups", 0.0), 1.0),
            "points": [(p.rollouts, p.value) for p in curve.points], "final": curve.final.value}


def reading(h: Mapping[str, Any], report: Mapping[str, Any]) -> tuple[float, tuple[float, float] | None, str]:
    """The hypothesis's number (mean), its 95% interval (``None`` with one seed) and a note."""
    method, against = h["method"], h["against"]
    if h["reading"] == "delta_equal_rollouts":
        if against != report["baseline"]:
            raise SystemExit(f"{h['id']}: delta_equal_rollouts is read against the compare's baseline "
                             f"{report['baseline']!r}, not {against!r}")
        entry = report["equal_rollouts"]["methods"].get(method)
        if entry is None:
            why = report["equal_rollouts"]["unavailable"].get(method, "no equal-rollouts entry")
            raise LookupError(why)
        d = entry["delta"]
        ci = d["ci95"]
        return d["mean"], None if ci is None else (ci[0], ci[1]), "Δ at equal rollouts"
    metric = report["metric"]
    mine = [_final(r, metric) for r in report["runs"][method]]
    theirs = [_final(r, metric) for r in report["runs"][against]]
    if h["reading"] == "per_group_ratio":
        values = [t["per_group"] / m["per_group"] for m, t in zip(mine, theirs)]
        note = f"rollouts per trained group, {against} / {method}"
    else:
        needed = [reach(m["points"], t["final"]) for m, t in zip(mine, theirs)]
        if any(n is None or n <= 0 for n in needed):
            reached = sum(n is not None for n in needed)
            raise LookupError(f"{reached}/{len(needed)} seeds reach {against}'s final accuracy")
        values = [t["rollouts"] / n for n, t in zip(needed, theirs) if n is not None]
        note = f"{against}'s rollouts / {method}'s to reach {against}'s final accuracy"
    est = mean_ci(values)
    return est.mean, est.ci, note


def mark(h: Mapping[str, Any], compare_dirs: Mapping[str, Path]) -> str:
    """The result mark of one hypothesis, as the document shows it."""
    where = compare_dirs.get(h["regime"])
    if where is None or not (where / "compare.json").exists():
        return "not run"
    report = json.loads((where / "compare.json").read_text())
    if h["method"] not in report["runs"] or h["against"] not in report["runs"]:
        return "not run"
    try:
        mean, ci, note = reading(h, report)
    except LookupError as exc:
        return f"inconclusive ({exc})"
    n = len(report["seeds"])
    shown = "{:+.3f}" if h["reading"] == "delta_equal_rollouts" else "{:.2f}x"
    if ci is None:
        return f"inconclusive ({note} {shown.format(mean)}, {n} seed: no interval)"
    p = h["predict"]
    word = verdict(p["op"], float(p["value"]), float(p.get("margin", 0.0)), ci[0], ci[1])
    return (f"**{word}**: {shown.format(mean)} [{shown.format(ci[0])}, {shown.format(ci[1])}] ({note}, "
            f"{n} seeds)")


def fill(doc_path: Path, compare_dirs: Mapping[str, Path]) -> dict[str, str]:
    """Write every hypothesis's mark into the document; returns ``id -> mark``."""
    doc = doc_path.read_text()
    marks = {h["id"]: mark(h, compare_dirs) for h in hypotheses(doc)}
    for hid, text in marks.items():
        pattern = re.compile(rf"(<!-- result:{re.escape(hid)} -->)(.*?)(<!-- /result:{re.escape(hid)} -->)", re.S)
        if not pattern.search(doc):
            raise SystemExit(f"{doc_path}: no result mark for {hid}")
        shown = text.replace("|", "/")  # a table cell
        doc = pattern.sub(lambda m, shown=shown: m.group(1) + shown + m.group(3), doc)
    doc_path.write_text(doc)
    return marks


def main() -> None:
    if len(sys.argv) < 3:
        raise SystemExit(__doc__)
    dirs = dict(arg.split("=", 1) for arg in sys.argv[2:])
    for hid, text in fill(Path(sys.argv[1]), {k: Path(v) for k, v in dirs.items()}).items():
        print(f"{hid}: {text}")


if __name__ == "__main__":
    main()
