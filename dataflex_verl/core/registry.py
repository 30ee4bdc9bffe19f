"""``dataflex_verl.core.registry``: the seed's registration decorators (see :mod:`dataflex_bus.registry`)."""

from dataflex_bus.registry import register_mixer, register_reweighter, register_scorer, register_selector

__all__ = ["register_mixer", "register_reweighter", "register_scorer", "register_selector"]
