"""dataflex-bus's one cache directory on this machine, for everything it keeps between runs.

``$DATAFLEX_CACHE_DIR`` (set but empty: no disk cache), else ``$XDG_CACHE_HOME/dataflex``, else
``~/.cache/dataflex``. The shim's warm-started base policies live under ``warmstart/``; the TRL examples'
float32 SmolLM2 copy under ``smollm2-135m-instruct-f32/``. Import-light.
"""

from __future__ import annotations

import os
from pathlib import Path

#: The one variable naming the cache directory.
ENV_CACHE = "DATAFLEX_CACHE_DIR"


def cache_root() -> Path | None:
    """The cache directory (``None``: ``DATAFLEX_CACHE_DIR`` is set but empty, no disk cache)."""
    raw = os.environ.get(ENV_CACHE)
    if raw is not None:
        return Path(raw).expanduser() if raw.strip() else None
    xdg = os.environ.get("XDG_CACHE_HOME", "").strip()
    return (Path(xdg) if xdg else Path.home() / ".cache") / "dataflex"


__all__ = ["ENV_CACHE", "cache_root"]
