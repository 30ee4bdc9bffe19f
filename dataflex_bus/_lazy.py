"""Lazy attribute exports for packages whose import must stay light (PEP 562 ``__getattr__``)."""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from importlib import import_module
from typing import Any


def lazy_exports(package: str, exports: Mapping[str, str], *, base: str | None = None) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package`` importing ``<base>.<exports[name]>`` on first access to ``name``.

    ``base`` defaults to ``package``; a plain module re-exporting from its siblings passes its parent package.
    The value is then cached in ``package``'s namespace, so later accesses cost nothing.
    """

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(import_module(f".{module}", base or package), name)
        sys.modules[package].__dict__[name] = value
        return value

    return __getattr__
