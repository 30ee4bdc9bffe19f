"""The CPU shim as a host: what it provides at each event and what it can carry out.

The shim generates, rewards, computes log-probs and advantages itself, so it can do everything the host
kit offers: select prompts before generation, refill with every policy, sample by domain, weight the loss
per token. It computes ``entropy`` (of the old policy, on temperature-scaled logits) at ``on_advantage``
only when a method or observer asks for it; it has no critic, no attention mask and no reference policy
unless ``trainer.kl_coef > 0``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..kit import CAPABILITIES, EVENT_FIELDS, MINIBATCH_INDEX, HostDescription
from .sizes import row_bytes

NAME = "shim"
ON_ROLLOUT = frozenset({"prompts", "responses", "response_mask", "loss_mask", "rm_scores", "rollout_log_probs",
                        "uid", "data_source"})
ON_ADVANTAGE = ON_ROLLOUT | {"old_log_probs", "advantages", "returns", "rollout_is_weights", "entropy"}
_MISSING = {
    "attention_mask": "the shim's prompts are fixed-width token ids",
    "input_ids": "the shim keeps prompts and responses apart (prompts, responses)",
    "values": "the shim trains GRPO without a critic",
    "token_level_rewards": "the shim's reward is rm_scores on the last response token",
}


def describe(resolved: Mapping[str, Any], *, group_size: bool = True) -> HostDescription:
    """The shim's description for a resolved run config (``group_size=False``: the group size is not
    known, e.g. ``trainer.group_size`` itself is invalid)."""
    trainer, model = resolved["trainer"], resolved["model"]
    advantage = set(ON_ADVANTAGE)
    missing = dict(_MISSING)
    if trainer["kl_coef"] > 0:
        advantage.add("ref_log_prob")
    else:
        missing["ref_log_prob"] = "trainer.kl_coef is 0, so the shim keeps no reference policy"
    step_end = frozenset(advantage)
    if trainer["mini_batches"] == 1:
        advantage.add(MINIBATCH_INDEX)  # one mini-batch: the whole batch (the host kit fills it in)
    else:
        missing[MINIBATCH_INDEX] = (f"trainer.mini_batches={trainer['mini_batches']} splits the batch at random in "
                                    "every epoch, after on_advantage; set trainer.mini_batches=1")
    fields = {"on_prompts": EVENT_FIELDS["on_prompts"], "on_rollout": ON_ROLLOUT,
              "on_advantage": frozenset(advantage), "on_step_end": step_end}
    return HostDescription(NAME, fields=fields, capabilities=frozenset(CAPABILITIES), adv_estimator="grpo",
                           group_size=int(trainer["group_size"]) if group_size else None, loss_agg="token-mean",
                           prompts_per_step=int(trainer["prompts_per_step"]) if group_size else None,
                           missing=missing, row_bytes=row_bytes(int(model["hidden"]), int(model["layers"])),
                           row_bytes_basis=f"model.hidden {model['hidden']}, model.layers {model['layers']}: "
                                           "the row's fields and its pass's activations")

