"""Multi-output agent-loop sessions: refused by name.

verl's v1 agent loop may return several outputs per session (an agent loop whose ``run`` returns a list); each is
put into TransferQueue under ``{uid}_{session}_{index}``, every output carries the session's final score, and GRPO
is computed on each session's final output only and broadcast to the others
(``verl/trainer/ppo/v1/utils.py``, ``compute_advantage_for_multi_trajectories``). dataflex's methods count rows as
samples (a group's size, its solve rate, a mixer's domain means), so they would weigh a session once per output;
the adapter refuses such a run at its first batch instead, naming the agent loop.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..kit import ConfigError, ConfigIssue

#: verl's agent loops that return one output per session (``verl/experimental/agent_loop``).
SINGLE_OUTPUT_LOOPS = ("single_turn_agent", "tool_agent")


def later_outputs(keys: Sequence[str]) -> list[str]:
    """The trajectory keys ``{uid}_{session}_{index}`` of a session's second or later output (``index > 0``)."""
    return [k for k in keys if k.rsplit("_", 1)[-1] != "0"]


def refuse_multi_output(keys: Sequence[str], agent_names: Sequence[Any], default_loop: str | None) -> None:
    """Raise when ``keys`` hold a multi-output session; ``agent_names``: the ``agent_name`` of those keys' rows
    (empty when the dataset names none: the config's ``default_agent_loop`` ran them)."""
    later = later_outputs(keys)
    if not later:
        return
    names = sorted({str(getattr(n, "data", n)) for n in agent_names}) or [str(default_loop)]
    raise ConfigError(ConfigIssue(
        "actor_rollout_ref.rollout.agent.default_agent_loop",
        f"agent loop {', '.join(map(repr, names))} returned several outputs per session (trajectory keys such as "
        f"{later[0]!r}); verl computes GRPO on each session's final output and broadcasts its advantage to the "
        "others, while dataflex's methods count every output as a sample (group sizes, solve rates, domain means). "
        "Return one AgentLoopOutput per session (as " + " and ".join(SINGLE_OUTPUT_LOOPS) + " do) or run "
        "without a dataflex block"))
