"""The one engine that checks typed config keys: component parameters, the ``dataflex`` block's own keys
and the shim's ``trainer``/``model``/``data`` sections.

A key is declared with a :class:`Param` (type, default, range or choices, doc). :func:`check_section`
checks a mapping against a set of declarations and reports *every* problem at once as
:class:`~dataflex_bus.errors.ConfigIssue` objects, each naming its dotted key and what would be allowed,
with a did-you-mean for misspelt keys.
"""

from __future__ import annotations

import builtins
import copy
import difflib
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .errors import ConfigIssue

REQUIRED: Any = type("Required", (), {"__repr__": lambda self: "<required>"})()


@dataclass(frozen=True)
class Param:
    """A declared key: type, default and allowed range or choices.

    ``low``/``high`` bound numbers (``low_open``/``high_open`` make a bound exclusive); ``choices`` lists
    the allowed values (of each item, for a ``list`` key). ``item`` is the type of a list's items;
    ``unique`` asks for distinct items and ``nonempty`` refuses an empty string or list. A key without
    ``default`` is required; ``None`` is allowed when ``type`` includes ``type(None)``. ``example``: a value
    of a required key that ``dataflex info`` puts in its example block (when none of the declared type's
    placeholders would be valid, e.g. proportions that must name the dataset's domains).
    """

    type: builtins.type | tuple[builtins.type, ...]
    default: Any = REQUIRED
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    choices: tuple[Any, ...] | None = None
    doc: str = ""
    item: builtins.type | None = None
    unique: bool = False
    nonempty: bool = False
    example: Any = REQUIRED

    @property
    def required(self) -> bool:
        return self.default is REQUIRED

    @property
    def types(self) -> tuple[builtins.type, ...]:
        return self.type if isinstance(self.type, tuple) else (self.type,)

    def describe(self) -> str:
        """Human-readable allowed values, used in error messages and docs."""
        names = [t.__name__ if t is not type(None) else "null" for t in self.types]
        if self.item is not None:
            names = [f"list of {self.item.__name__}" if n == "list" else n for n in names]
        text = " or ".join(names)
        if self.choices is not None:
            what = "items from" if self.item is not None else "one of"
            return f"{text}: {what} " + ", ".join(repr(c) for c in self.choices)
        if self.low is not None or self.high is not None:
            lo = "(-inf" if self.low is None else ("(" if self.low_open else "[") + f"{self.low:g}"
            hi = "inf)" if self.high is None else f"{self.high:g}" + (")" if self.high_open else "]")
            text += f" in {lo}, {hi}"
        return text

    def coerce(self, key: str, value: Any) -> tuple[Any, ConfigIssue | None]:
        """Check and convert one value (an int where a float is declared becomes a float)."""
        types = self.types
        if value is None and type(None) in types:
            return None, None
        if isinstance(value, bool) and bool not in types:
            return value, ConfigIssue(key, f"expected {self.describe()}, got bool {value!r}")
        if not isinstance(value, types):
            if float in types and isinstance(value, int):
                value = float(value)
            else:
                return value, ConfigIssue(key, f"expected {self.describe()}, got {type(value).__name__} {value!r}")
        if isinstance(value, (list, tuple)) and self.item is not None:
            return self._coerce_items(key, list(value))
        if self.nonempty and isinstance(value, str) and not value:
            return value, ConfigIssue(key, f"expected a non-empty {self.describe()}")
        if self.choices is not None and value not in self.choices:
            words = [c for c in self.choices if isinstance(c, str)]
            hint = did_you_mean(value, words) if isinstance(value, str) else ""
            return value, ConfigIssue(key, f"{value!r} is not allowed", self.choices, hint=hint)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if isinstance(value, float) and not math.isfinite(value):
                return value, ConfigIssue(key, f"must be finite, got {value!r}")
            too_low = self.low is not None and (value <= self.low if self.low_open else value < self.low)
            too_high = self.high is not None and (value >= self.high if self.high_open else value > self.high)
            if too_low or too_high:
                return value, ConfigIssue(key, f"{value!r} is out of range: expected {self.describe()}")
        return value, None

    def _coerce_items(self, key: str, items: list[Any]) -> tuple[Any, ConfigIssue | None]:
        assert self.item is not None
        if self.nonempty and not items:
            return items, ConfigIssue(key, f"expected a non-empty {self.describe()}")
        wrong = [i for i in items if not isinstance(i, self.item) or (isinstance(i, bool) and self.item is not bool)]
        if wrong:
            return items, ConfigIssue(key, f"expected {self.describe()}, got {items!r}")
        if self.choices is not None:
            unknown = [i for i in items if i not in self.choices]
            if unknown:
                return items, ConfigIssue(key, f"unknown {', '.join(repr(u) for u in unknown)}", self.choices)
        if self.unique and len(set(items)) != len(items):
            return items, ConfigIssue(key, f"expected distinct items, got {items!r}")
        return items, None


def _fold(name: str) -> str:
    """A name as compared for a suggestion: case, dashes, dots and spaces do not count (``GROUP-SOLVE-RATE``)."""
    return re.sub(r"[-.\s]+", "_", name).lower()


def did_you_mean(name: str, known: list[str] | tuple[str, ...], n: int = 1) -> str:
    """``"did you mean 'x'?"`` for the closest known name (up to ``n`` of them), or ``""``. Names are compared
    folded (:func:`_fold`): an ALL-CAPS or dashed spelling of a known name is found, not only a title-cased one
    (difflib's ratio on the raw strings finds ``Mopps`` but not ``MOPPS``)."""
    by_fold: dict[str, str] = {}
    for k in map(str, known):
        by_fold.setdefault(_fold(k), k)
    folded = _fold(str(name))
    close = [by_fold[folded]] if folded in by_fold else []
    close += [by_fold[c] for c in difflib.get_close_matches(folded, list(by_fold), n=n, cutoff=0.6)
              if by_fold[c] not in close]
    close = close[:n]
    return f"did you mean {', '.join(repr(c) for c in close)}?" if close else ""


def unknown_key(key: str, name: str, allowed: list[str] | tuple[str, ...], what: str = "key") -> ConfigIssue:
    """An unknown key, with the allowed ones and a did-you-mean when one is close."""
    return ConfigIssue(key, f"unknown {what}", sorted(allowed), hint=did_you_mean(name, allowed))


def check_section(raw: Any, spec: Mapping[str, Param], key: str, issues: list[ConfigIssue], *,
                  extra: tuple[str, ...] = (), owner: str | None = None) -> dict[str, Any]:
    """Check the mapping ``raw`` against ``spec``; append every problem to ``issues``.

    Returns every declared key with its value (the default where absent or wrong, so later checks can go
    on). Keys in ``extra`` are allowed but left to the caller. With ``owner`` (a component class name) the
    keys are called that owner's parameters in messages.
    """
    raw = {} if raw is None else raw
    if not isinstance(raw, Mapping):
        issues.append(ConfigIssue(key, f"expected a mapping, got {type(raw).__name__} {raw!r}"))
        return {name: (None if p.required else p.default) for name, p in spec.items()}
    allowed = [*spec, *extra]
    what = f"parameter of {owner}" if owner else "key"
    for name in raw:
        if name not in allowed:
            issues.append(unknown_key(f"{key}.{name}", name, allowed, what))
    out: dict[str, Any] = {}
    for name, p in spec.items():
        if name in raw:
            value, issue = p.coerce(f"{key}.{name}", raw[name])
            if issue is not None:
                issues.append(issue)
                value = None if p.required else p.default
            out[name] = value
        elif p.required:
            issues.append(ConfigIssue(f"{key}.{name}", f"required {what} is missing ({p.describe()})"))
            out[name] = None
        else:
            # A fresh copy: a caller editing its resolved config must not edit the declaration.
            out[name] = copy.deepcopy(p.default)
    return out
