"""Plugin ``mix``: the built-in mixers (mechanism ``mix``)."""

from dataflex_bus import hookimpl

_M = "dataflex_plugins.methods.mix"


@hookimpl
def dataflex_register(register):
    register("mixer", "dump_ucb", f"{_M}:DumpUCB",
             summary="DUMP: UCB over windowed mean |advantage| per domain, softmax")
    register("mixer", "reward_gap", f"{_M}:RewardGap",
             summary="favour domains whose mean reward lags the best, with a floor")
    register("mixer", "static", f"{_M}:Static", summary="fixed domain proportions (the baseline)")
    register("mixer", "sec", "dataflex_plugins.methods.rules2026:Sec",
             summary="SEC: TD(0) bandit over domains rewarded by mean |advantage|, Boltzmann sampling")
