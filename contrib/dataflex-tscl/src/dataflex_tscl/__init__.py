"""dataflex-tscl: the Teacher-Student Curriculum Learning mixer (arXiv 1707.00183) for dataflex-bus.

Import-light: listing plugins imports :mod:`dataflex_tscl.plugin` only; torch comes with
:mod:`dataflex_tscl.mixer` when the mixer is built.
"""

__version__ = "0.1.0"
