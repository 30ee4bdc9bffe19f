"""Time to the first training step of `dataflex run`: the first run of a testbed (which pretrains the base
policy and caches it) against a second identical run (which reads it from the warm-start cache).

Target (issue 24, item 6): the second run reaches step 1 at least 3x sooner than the first. Each repeat
uses a fresh cache directory. Time is measured from starting the process to its progress line for step 1
(so imports, config checks and the warm start count, the plot and the summary do not). Prints ratios; no
thresholds in tests.

    python benchmarks/bench_warmstart.py [--config examples/grpo_baseline.yaml] [--repeats 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def to_step_1(config: str, out: Path, cache: Path) -> float:
    """Seconds from starting ``dataflex run`` to its progress line for step 1 (then the run is stopped)."""
    env = {**os.environ, "DATAFLEX_CACHE_DIR": str(cache)}
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "dataflex_bus.cli", "run", config, "--steps", "2", "--out",
                             str(out), "--force"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env=env, cwd=ROOT)
    assert proc.stderr is not None
    try:
        for line in proc.stderr:  # not a terminal: one progress line per 10% (and per step of a 2-step run)
            if line.startswith("[") and " 1/2 " in line:
                return time.perf_counter() - start
        raise RuntimeError(f"the run ended without reaching step 1 (exit {proc.wait()})")
    finally:
        proc.kill()
        proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="examples/grpo_baseline.yaml")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    firsts, seconds = [], []
    for _ in range(args.repeats):
        with tempfile.TemporaryDirectory(prefix="dataflex-bench-") as tmp:
            cache, out = Path(tmp) / "cache", Path(tmp) / "run"
            firsts.append(to_step_1(args.config, out, cache))
            seconds.append(to_step_1(args.config, out, cache))
    first, second = statistics.median(firsts), statistics.median(seconds)
    ratio = first / second
    print(f"{args.config}: time to step 1, median of {args.repeats}")
    print(f"  first run  (pretrains the base policy, caches it): {first:6.2f} s  {[round(t, 2) for t in firsts]}")
    print(f"  second run (base policy from the cache):           {second:6.2f} s  {[round(t, 2) for t in seconds]}")
    print(f"  ratio {ratio:.2f}  target>=3x {'PASS' if ratio >= 3 else 'FAIL'}")


if __name__ == "__main__":
    main()
