"""Registration module of the ``tscl`` plugin (entry point ``dataflex: tscl``)."""

from dataflex_bus import hookimpl


@hookimpl
def dataflex_register(register):
    register("mixer", "tscl", "dataflex_tscl.mixer:TSCL",
             summary="TSCL window: sample domains by |slope| of their recent score curve "
                     "(Boltzmann or epsilon-greedy)")
