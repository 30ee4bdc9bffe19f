"""Write the results of ``docs/results/methods_2026.md`` from its two ``dataflex compare`` directories: the marks
(``regime_marks.fill``, the scoring rule of regimes.md), each regime's table (``methods_2026_<regime>.md``) and the
predictors' calibration, descriptively (no hypothesis is scored on it).

    python scripts/methods_2026_results.py default=runs/methods2026/default multi_epoch=runs/methods2026/multi_epoch
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from regime_marks import fill  # noqa: E402  (scripts/ is no package)

from dataflex_bus.shim.stats import mean_ci  # noqa: E402

DOC = ROOT / "docs" / "results" / "methods_2026.md"
MARKERS = ("<!-- methods2026-results:start -->", "<!-- methods2026-results:end -->")
KEYS = ("dataflex/predictor/spearman", "dataflex/predictor/brier")


def window_mean(rows: list[dict[str, float]], key: str, lo: int, hi: int) -> float:
    values = [r[key] for r in rows[lo:hi] if key in r and math.isfinite(r[key])]
    return sum(values) / len(values) if values else math.nan


def calibration(compare: Path) -> list[str]:
    """Per method with a predictor: Spearman and Brier over the first and the last tenth of the steps."""
    report = json.loads((compare / "compare.json").read_text())
    lines = ["| method | Spearman, first 10% of steps | Spearman, last 10% | Brier, first 10% | Brier, last 10% |",
             "|---|---|---|---|---|"]
    for method, runs in report["runs"].items():
        per_seed = []
        for run in runs:
            rows = [json.loads(x) for x in (Path(run) / "metrics.jsonl").read_text().splitlines() if x.strip()]
            rows = [r for r in rows if "dataflex/predictor/brier" in r]
            if not rows:
                break
            tenth = max(1, len(rows) // 10)
            per_seed.append([window_mean(rows, k, a, b) for k in KEYS for a, b in ((0, tenth), (-tenth, None))])
        if not per_seed or len(per_seed) != len(runs):
            continue
        cells = []
        for column in zip(*per_seed):
            est = mean_ci([v for v in column if math.isfinite(v)])
            ci = "" if est.ci is None else f" [{est.ci[0]:.3f}, {est.ci[1]:.3f}]"
            cells.append(f"{est.mean:.3f}{ci}")
        order = [cells[0], cells[1], cells[2], cells[3]]
        lines.append(f"| {method} | " + " | ".join(order) + " |")
    return lines


def main() -> None:
    dirs = {k: Path(v) for k, v in (a.split("=", 1) for a in sys.argv[1:])}
    if not dirs:
        raise SystemExit(__doc__)
    marks = fill(DOC, dirs)
    body: list[str] = []
    for regime, where in dirs.items():
        report = json.loads((where / "compare.json").read_text())
        out = DOC.parent / f"methods_2026_{regime}.md"
        out.write_text(f"# The 2026 methods in the {regime} regime\n\n"
                       f"{len(report['runs'])} examples, seeds {report['seeds']}; written by "
                       "`scripts/methods_2026_results.py` from `dataflex compare`'s table.\n\n"
                       + (where / "table.md").read_text())
        body.append(f"- `{regime}`: [{out.name}]({out.name}) ({len(report['runs'])} examples, seeds "
                    f"{report['seeds']})")
        cal = calibration(where)
        if len(cal) > 2:
            body += ["", f"Calibration in `{regime}` (mean over the seeds, 95% t interval; descriptive):", "", *cal]
    doc = DOC.read_text()
    start, end = doc.index(MARKERS[0]) + len(MARKERS[0]), doc.index(MARKERS[1])
    DOC.write_text(doc[:start] + "\n" + "\n".join(body) + "\n" + doc[end:])
    for hid, text in marks.items():
        print(f"{hid}: {text}")


if __name__ == "__main__":
    main()
