"""`dataflex plugins` start-up cost vs `python -c "import pluggy, importlib.metadata"`.

Target (issue 2): median wall time at most 3x the baseline with the first-party packs installed, and
torch never imported. Prints ratios; no thresholds in tests.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time

RUNS = 15


def wall(cmd: list[str]) -> float:
    times = []
    for _ in range(RUNS):
        start = time.perf_counter()
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    py = sys.executable
    base = wall([py, "-c", "import pluggy, importlib.metadata"])
    table = wall([py, "-m", "dataflex_bus.cli", "plugins"])
    as_json = wall([py, "-m", "dataflex_bus.cli", "plugins", "--json"])
    probe = subprocess.run(
        [py, "-c", "import sys; from dataflex_bus.cli import main; main(['plugins','--json']);"
                   "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH', file=sys.stderr)"],
        capture_output=True, text=True, check=True)
    torch_free = "NO-TORCH" in probe.stderr
    print(f"baseline import pluggy, importlib.metadata: {base * 1e3:7.1f} ms (median of {RUNS})")
    for label, t in (("dataflex plugins", table), ("dataflex plugins --json", as_json)):
        ratio = t / base
        print(f"{label:<26}: {t * 1e3:7.1f} ms  ratio {ratio:4.2f}  target<=3x {'PASS' if ratio <= 3 else 'FAIL'}")
    print(f"torch imported by `dataflex plugins`: {'no' if torch_free else 'YES'} -> "
          f"{'PASS' if torch_free else 'FAIL'}")


if __name__ == "__main__":
    main()
