"""``dataflex_verl.core.selector``: the seed's selector base class (mechanism ``select``)."""

from dataflex_bus.components import Param, Score, Selection, Selector

__all__ = ["Param", "Score", "Selection", "Selector"]
