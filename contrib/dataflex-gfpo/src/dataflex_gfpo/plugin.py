"""Registration module of the ``gfpo`` plugin (entry point ``dataflex: gfpo``)."""

from dataflex_bus import hookimpl


@hookimpl
def dataflex_register(register):
    register("selector", "gfpo", "dataflex_gfpo.selector:GFPO",
             summary="GFPO: per group keep the k shortest (or most reward-per-token) responses, "
                     "advantages recomputed over the kept set")
