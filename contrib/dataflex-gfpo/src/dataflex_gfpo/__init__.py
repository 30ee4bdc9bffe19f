"""dataflex-gfpo: the GFPO selector (arXiv 2508.09726) as a dataflex-bus method pack.

Import-light on purpose: ``dataflex plugins`` imports :mod:`dataflex_gfpo.plugin` (and so this module)
to list the pack; torch is imported only when the selector is built (:mod:`dataflex_gfpo.selector`).
"""

__version__ = "0.1.0"
