"""The ``yaml hypotheses`` block of a pre-registered results document (``docs/results/regimes.md``,
``docs/results/robustness.md``), read and checked the one way every marks script reads it."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import yaml

HYPOTHESES = re.compile(r"```yaml hypotheses\n(.+?)\n```", re.S)


def read_hypotheses(doc: str, *, group: str, readings: Sequence[str], ops: Sequence[str]) -> list[dict[str, Any]]:
    """The document's hypotheses, each checked for ``id``, ``method``, ``against``, its ``group`` key (the regime or
    the experiment it is read in), a reading among ``readings`` and ``predict`` with an ``op`` among ``ops``."""
    found = HYPOTHESES.search(doc)
    if found is None:
        raise SystemExit("no ```yaml hypotheses block in the document")
    items = yaml.safe_load(found.group(1))
    for h in items:
        missing = [k for k in ("id", "method", "against", group, "reading", "predict") if k not in h]
        if missing or h["reading"] not in readings or h["predict"].get("op") not in ops:
            raise SystemExit(f"hypothesis {h.get('id')!r}: needs id, method, against, {group}, reading (one of "
                             f"{', '.join(readings)}) and predict {{op: {' or '.join(map(repr, ops))}, value}}; "
                             f"missing {missing}")
    return items
