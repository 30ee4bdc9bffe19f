"""``dataflex_verl.core.mixer``: the seed's mixer base class (mechanism ``mix``)."""

from dataflex_bus.components import Mixer, Param, Score

__all__ = ["Mixer", "Param", "Score"]
