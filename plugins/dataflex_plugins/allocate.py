"""Plugin ``allocate``: the built-in allocators (mechanism ``allocate``) and their scorer."""

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
