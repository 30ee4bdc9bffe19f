"""Plugin ``allocate``: the built-in allocators (mechanism ``allocate``) and their scorers."""

from dataflex_bus import hookimpl

_M = "dataflex_plugins.methods.allocate"


@hookimpl
def dataflex_register(register):
    register("scorer", "knapsack_rate", f"{_M}:KnapsackRate",
             summary="pre-rollout: Knapsack RL's success-rate estimate from the prompt's last rewards (-1: not yet)")
    register("allocator", "knapsack", f"{_M}:Knapsack",
             summary="Knapsack RL: rollouts per prompt maximising sum Value(n, p) under the step's budget")
    register("allocator", "speed", f"{_M}:Speed",
             summary="SPEED: screen with the group size, continue the prompts with 0 < p < 1 in a second round")
    register("allocator", "pilot_commit", "dataflex_plugins.methods.pilot_commit:PilotCommit",
             summary="Pilot-Commit: a pilot with the group size, n_commit more for prompts in the diversity band")
    register("scorer", "max_solve_rate", "dataflex_plugins.methods.pilot_commit:MaxSolveRate",
             summary="pre-rollout: the highest success rate of any visit of the prompt so far (0: never rolled out)")
    register("allocator", "reinforce_ada", "dataflex_plugins.methods.reinforce_ada:ReinforceAda",
             summary="Reinforce-Ada: rounds of the group size for each prompt until it has both outcomes")
    register("allocator", "variance_split", "dataflex_plugins.methods.rules2026:VarianceSplit",
             summary="VIP / CurES: rollouts minimising sum p(1-p)/n under the budget, p predicted")
