"""Plugin ``replay``: the built-in replayer (mechanism ``replay``)."""

from dataflex_bus import hookimpl

_M = "dataflex_plugins.methods.replay"


@hookimpl
def dataflex_register(register):
    register("replayer", "rollout_replay", f"{_M}:RolloutReplay",
             summary="RePO / DOTS rollout replay: past rows trained again, off-policy corrected")
