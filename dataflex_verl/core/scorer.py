"""``dataflex_verl.core.scorer``: the seed's scorer base class.

``score(self, batch, step, **ctx)`` may return a :class:`Score` or a plain tensor shaped by the
declared granularity (``[B]``, ``[B, T]`` or ``[D]``).
"""

from dataflex_bus.components import Param, Score, Scorer

__all__ = ["Param", "Score", "Scorer"]
