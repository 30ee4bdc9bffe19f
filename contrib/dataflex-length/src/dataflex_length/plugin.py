"""Registration module of the ``length`` plugin (entry point ``dataflex: length``)."""

from dataflex_bus import hookimpl


@hookimpl
def dataflex_register(register):
    register("scorer", "response_length", "dataflex_length.scorer:ResponseLength",
             summary="response length L_i, normalised by the response width, the batch maximum, or not")
