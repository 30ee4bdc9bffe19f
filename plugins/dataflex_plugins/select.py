"""Plugin ``select``: the built-in selectors (mechanism ``select``)."""

from dataflex_bus import hookimpl

_M = "dataflex_plugins.methods.select"


@hookimpl
def dataflex_register(register):
    register("selector", "threshold_band", f"{_M}:ThresholdBand",
             summary="keep rows whose score lies in [low, high] (group rates decided on integer counts)")
    register("selector", "dapo", f"{_M}:DapoFilter",
             summary="DAPO dynamic sampling: keep groups whose rewards are not all equal")
    register("selector", "topk_fraction", f"{_M}:TopKFraction",
             summary="keep the top fraction of rows by score, stable ties")
    register("selector", "max_variance", f"{_M}:MaxVariance",
             summary="PODS: per group keep the max-variance subset, advantages recomputed")
    register("selector", "top_entropy", "dataflex_plugins.methods.tokens:TopEntropy",
             summary="token selection: train the policy gradient on the top-rho tokens by score (80/20 rule)")
    register("selector", "greso", "dataflex_plugins.methods.prompts:Greso",
             summary="GRESO: skip prompts likely zero-variance again, before generation (adaptive exploration)")
    register("selector", "top_b", "dataflex_plugins.methods.mopps:TopB",
             summary="pre-rollout: keep the B best-scored candidates of a pool of pool x B (MoPPS)")
    register("selector", "exclude_solved", "dataflex_plugins.methods.pilot_commit:ExcludeSolved",
             summary="drop prompts scored at or above exclude_threshold (Pilot-Commit's eviction of solved prompts)")
    register("selector", "ada_downsample", "dataflex_plugins.methods.reinforce_ada:AdaDownsample",
             summary="Reinforce-Ada: per group keep n balanced rows, advantages against the whole pool's mean")
