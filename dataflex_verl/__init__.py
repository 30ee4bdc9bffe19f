"""Compatibility package: the module paths of the original dataflex-verl seed, on dataflex-bus.

The seed documented ``pip install dataflex-verl`` and imports such as
``from dataflex_verl.core.registry import register_scorer``. This package ships inside the
``dataflex-bus`` distribution (``pip install dataflex-bus``, or ``pip install -e .`` from a clone) and
re-exports the public API under those paths, so code written against the seed runs unchanged. New code
should import from :mod:`dataflex_bus`. Every name here *is* the dataflex-bus object, not a copy.
"""

from __future__ import annotations

from dataflex_bus import __version__

__all__ = ["__version__"]
