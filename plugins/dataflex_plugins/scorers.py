"""Plugin ``scorers``: the built-in scorers."""

from dataflex_bus import hookimpl

_M = "dataflex_plugins.methods.scorers"


@hookimpl
def dataflex_register(register):
    register("scorer", "reward_difficulty", f"{_M}:RewardDifficulty",
             summary="outcome reward of each rollout")
    register("scorer", "group_solve_rate", f"{_M}:GroupSolveRate",
             summary="fraction of a prompt's rollouts whose reward exceeds a threshold")
    register("scorer", "advantage_magnitude", f"{_M}:AdvantageMagnitude",
             summary="mean/sum/max of |advantage| over a rollout's tokens")
    register("scorer", "token_prob", f"{_M}:TokenProb",
             summary="per-token probability exp(old_log_probs)")
    register("scorer", "token_entropy", f"{_M}:TokenEntropy",
             summary="per-token entropy of the policy (the host's entropy field)")
    register("scorer", "zero_variance_streak", "dataflex_plugins.methods.prompts:ZeroVarianceStreak",
             summary="pre-rollout: signed length of the prompt's current run of all-right/all-wrong visits")
    register("scorer", "mopps", "dataflex_plugins.methods.mopps:Mopps",
             summary="pre-rollout: MoPPS Thompson draw from the prompt's Beta posterior, closeness to a target rate")
    register("scorer", "predicted", "dataflex_plugins.methods.predictors:Predicted",
             summary="pre-rollout: the block's predicted success rate (dataflex.predictor), or a column of it")
    register("scorer", "reward_variance", "dataflex_plugins.methods.rules2026:RewardVariance",
             summary="population variance of each group's rewards (RAGEN-2's SNR signal)")
    # Predictors (a component kind of their own, dataflex_bus.predictor) ship in this pack too.
    register("predictor", "cures", "dataflex_plugins.methods.predictors:Cures",
             summary="CurES: Beta(accepted + 1, rejected + 1) posterior mean per prompt")
    register("predictor", "dps", "dataflex_plugins.methods.predictors:Dps",
             summary="DPS: per-prompt hidden Markov model over unsolved / partially solved / solved")
    register("predictor", "vip", "dataflex_plugins.methods.predictors:Vip",
             summary="VIP: Gaussian process over a prompt's recent group success rates")
