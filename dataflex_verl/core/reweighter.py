"""``dataflex_verl.core.reweighter``: the seed's reweighter base class (mechanism ``reweight``)."""

from dataflex_bus.components import Param, Reweighter, Reweighting, Score

__all__ = ["Param", "Reweighter", "Reweighting", "Score"]
