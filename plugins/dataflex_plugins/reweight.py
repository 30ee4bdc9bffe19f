"""Plugin ``reweight``: the built-in reweighters (mechanism ``reweight``)."""

from dataflex_bus import hookimpl

_M = "dataflex_plugins.methods.reweight"


@hookimpl
def dataflex_register(register):
    register("reweighter", "advantage_reweight", f"{_M}:AdvantageReweight",
             summary="AR: per-token alpha*p + (1 - alpha), no re-normalisation")
    register("reweighter", "softmax", f"{_M}:Softmax",
             summary="N * softmax(score / T), row-mean-1 or token-mean-1")
    register("reweighter", "per_advantage", f"{_M}:PerAdvantage",
             summary="PER-style (N P)^(1 - beta) weights from |advantage| priorities, mean 1")
