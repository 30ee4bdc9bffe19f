"""Where a checkpoint's config and the config resuming it differ, said as a user reads it.

Every host refuses to resume a checkpoint under another ``dataflex`` block (the methods' saved state
belongs to the block that wrote it). :func:`differences` names the keys that differ as dotted paths
(``dataflex.actuator.params.low``, ``dataflex.methods[1].name``) with both values; :func:`resume_refusal`
turns them into the one message every host prints: only the differing keys, which side has a block when
one side has none, and what to do instead. Import-light (no torch).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

#: The longest value a difference shows (a whole nested section would bury the key that differs).
VALUE_LIMIT = 160

#: What to do instead, the same on every host.
RESUME_FIX = ("resume with the dataflex block the checkpoint was written with, or start a fresh run (no resume, "
              "another output directory)")


def _short(value: Any, limit: int = VALUE_LIMIT) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 4] + " ..."


def describe_block(block: Mapping[str, Any]) -> str:
    """A block in one line: ``select group_solve_rate+threshold_band`` per method (a stack: ``; ``-joined)."""
    methods = block.get("methods")
    entries = methods if isinstance(methods, Sequence) and not isinstance(methods, str) else [block]
    parts = []
    for m in entries:
        if not isinstance(m, Mapping):
            return _short(block)
        scorer, actuator = (m.get(k) for k in ("scorer", "actuator"))
        names = [x.get("name") if isinstance(x, Mapping) else x for x in (scorer, actuator)]
        parts.append(f"{m.get('mechanism', '?')} {names[0]}+{names[1]}")
    return "; ".join(parts) or _short(block)


def _is_block(value: Any) -> bool:
    return isinstance(value, Mapping) and ("mechanism" in value or "methods" in value)


def differences(saved: Any, now: Any, prefix: str = "", *, saved_name: str = "checkpoint",
                now_name: str = "config") -> list[str]:
    """The dotted keys on which two nested configs disagree, each with both values (``saved_name`` and
    ``now_name`` label them). Lists of equal length are compared item by item (``key[i]``); a ``dataflex``
    block present on one side only is said as such, with the block in one line."""
    if isinstance(saved, Mapping) and isinstance(now, Mapping):
        out: list[str] = []
        for key in sorted(set(saved) | set(now), key=str):
            out += differences(saved.get(key), now.get(key), f"{prefix}.{key}" if prefix else str(key),
                               saved_name=saved_name, now_name=now_name)
        return out
    if (isinstance(saved, list) and isinstance(now, list) and len(saved) == len(now)
            and saved != now):
        return [line for i, (a, b) in enumerate(zip(saved, now))
                for line in differences(a, b, f"{prefix}[{i}]", saved_name=saved_name, now_name=now_name)]
    if saved == now:
        return []
    where = prefix or "(the whole config)"
    for has, lacks, block in ((saved_name, now_name, saved), (now_name, saved_name, now)):
        other = now if block is saved else saved
        if _is_block(block) and not other:
            return [f"{where}: {has}: a dataflex block ({describe_block(block)}); {lacks}: none"]
    return [f"{where}: {saved_name} {_short(saved)}, {now_name} {_short(now)}"]


def resume_refusal(saved: Mapping[str, Any] | None, now: Mapping[str, Any] | None, *, key: str = "dataflex",
                   fix: str = RESUME_FIX) -> str | None:
    """The message refusing to resume a checkpoint whose ``dataflex`` block (``saved``, ``None``: none) is not
    the block of this run (``now``); ``None`` when they agree."""
    lines = differences(saved or None, now or None, key, saved_name="checkpoint", now_name="this run")
    if not lines:
        return None
    if saved and not now:  # the block to pass, which this run does not have at hand
        fix += f"; the checkpoint's block: {json.dumps(saved, default=str)}"
    return ("checkpoint was written with a different dataflex config; refusing to resume:\n"
            + "\n".join(f"  - {line}" for line in lines) + f"\n{fix}")


__all__ = ["RESUME_FIX", "describe_block", "differences", "resume_refusal"]
