"""A few steps of the CPU shim, for "does my method train end to end" tests."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

#: Sizes that keep a test run to a fraction of a second per step; keys the caller sets win.
SMALL = {"trainer": {"group_size": 4, "prompts_per_step": 8, "eval_every": 0, "save_every": 0},
         "model": {"hidden": 16, "pretrain_steps": 30, "pretrain_batch": 64}}


def run_short_training(config: Mapping[str, Any], *, steps: int = 3, seed: int = 0,
                       small: bool = True) -> list[dict[str, float]]:
    """Train ``steps`` steps on the CPU shim with ``config`` and return the per-step metrics.

    ``config`` is a full run config (the YAML ``dataflex run`` reads) or just a ``dataflex`` block
    (``{"mechanism": ..., "scorer": ..., "actuator": ...}``), which is wrapped as ``{"dataflex": block}``.
    With ``small`` (default) trainer and model sizes the config does not set are made small
    (:data:`SMALL`: 8 prompts x 4 responses, a short warm start, no evaluation), the shim's defaults
    fill in the rest.
    Nothing is written to disk (``out=None``). Components registered in-process
    (``dataflex_register_plugin``) are visible to the run: the shim resolves names through the same
    registry.
    """
    if steps < 1:
        raise ValueError(f"run_short_training: steps must be >= 1, got {steps}")
    cfg = dict(config)
    if "dataflex" not in cfg and "mechanism" in cfg:
        cfg = {"dataflex": cfg}
    if small:
        for section, defaults in SMALL.items():
            given = cfg.get(section)
            cfg[section] = {**defaults, **(dict(given) if isinstance(given, Mapping) else {})}
    try:
        from dataflex_bus.shim import run_training
    except ImportError as exc:  # pragma: no cover - only while the shim is not installed
        raise RuntimeError(f"run_short_training needs the CPU shim (dataflex_bus.shim): {exc}") from exc
    result = run_training(cfg, steps=steps, seed=seed, out=None)
    return [dict(m) for m in result.metrics]
