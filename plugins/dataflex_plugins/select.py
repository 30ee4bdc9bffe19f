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
    register("selector", "no_positive_resampling", "dataflex_plugins.methods.rules2026:NoPositiveResampling",
             summary="ScaleRL: drop a prompt for good once a visit's pass rate reached 0.9 (fed max_solve_rate)")
    register("selector", "snr_filter", "dataflex_plugins.methods.rules2026:SnrFilter",
             summary="RAGEN-2: keep the groups holding the top-rho mass of reward variance")
    register("selector", "learnability", "dataflex_plugins.methods.rules2026:Learnability",
             summary="LILO: select by p(1-p), before generation (predicted p) or after (observed p)")
    register("selector", "weighted_draw", "dataflex_plugins.methods.rules2026:WeightedDraw",
             summary="pre-rollout: draw B candidates without replacement by exp(score) (CurES's sampler)")
