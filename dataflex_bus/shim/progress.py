"""A one-line progress bar on stderr with live reward, kept fraction and held-out accuracy."""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping


class Progress:
    """Redraws in place on a terminal; elsewhere (CI logs) prints a line every 10%."""

    def __init__(self, total: int, start: int) -> None:
        self.total, self.start = total, start
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
        parts = [f"reward {m.get('dataflex/rollout/reward_mean', float('nan')):.2f}",
                 f"kept {m.get('dataflex/kept_fraction', float('nan')):.2f}"]
        if "eval/heldout/learnable" in m:
            parts.append(f"held-out {m['eval/heldout/learnable']:.2f}")
        line = (f"[{'#' * filled}{'.' * (width - filled)}] {done}/{self.total}  " + "  ".join(parts)
                + f"  {rate:.1f} it/s  eta {eta:.0f}s")
        sys.stderr.write(("\r" + line + "\033[K") if self.tty else line + "\n")
        sys.stderr.flush()

    def close(self) -> None:
        if self.tty:
            sys.stderr.write("\n")
            sys.stderr.flush()
