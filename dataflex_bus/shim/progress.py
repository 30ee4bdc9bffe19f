"""A one-line progress bar on stderr with live reward, kept fraction and held-out accuracy."""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping


class Progress:
    """Redraws in place on a terminal; elsewhere (CI logs) prints a line every 10%. ``label`` leads each line
    (the warm start's bar says what it is); metrics a line lacks are left out."""

    def __init__(self, total: int, start: int, label: str = "") -> None:
        self.total, self.start, self.label = total, start, label
        self.t0 = time.perf_counter()
        self.tty = sys.stderr.isatty()
        self.last_pct = -1

    def update(self, done: int, m: Mapping[str, float]) -> None:
        pct = int(100 * done / self.total)
        if not self.tty and pct // 10 == self.last_pct // 10 and done != self.total:
            return
        self.last_pct = pct
        width = 24
        filled = int(width * done / self.total)
        rate = (done - self.start) / max(time.perf_counter() - self.t0, 1e-9)
        eta = (self.total - done) / rate if rate > 0 else 0.0
        shown = {"dataflex/rollout/reward_mean": "reward", "dataflex/kept_fraction": "kept",
                 "eval/heldout/learnable": "held-out"}
        parts = [f"{name} {m[key]:.2f}" for key, name in shown.items() if key in m]
        bar = f"[{'#' * filled}{'.' * (width - filled)}] {done}/{self.total}  "
        line = (f"{self.label} " if self.label else "") + bar + "".join(f"{p}  " for p in parts) + \
            f"{rate:.1f} it/s  eta {eta:.0f}s"
        sys.stderr.write(("\r" + line + "\033[K") if self.tty else line + "\n")
        sys.stderr.flush()

    def close(self) -> None:
        if self.tty:
            sys.stderr.write("\n")
            sys.stderr.flush()
