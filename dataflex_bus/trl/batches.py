"""The bus's batches built from TRL's rows: a round's ``on_rollout`` batch and a generation batch's
``on_advantage`` batch, every process's rows in TRL's global order, in verl's field names and layout."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..kit import Batch, Runtime
from .processes import Processes
from .records import Kept, RoundData, fit
from .rows import Layout, pad_left, pad_right

#: Fields a method may read that the host builds from token ids (verl's names).
TOKEN_FIELDS = frozenset({"prompts", "responses", "input_ids", "attention_mask"})


@dataclass
class BatchMaker:
    """What the batches of one TRL run are built from: the runtime (fields wanted, prompt ids), TRL's group
    size, pad token, the token ids that end a completion (``None``: TRL's ``mask_truncated_completions`` is
    off), reward weights, each dataset row's domain id (when prompts have ids) and the domain names."""

    runtime: Runtime
    group_size: int
    pad_id: int
    stops: frozenset[int] | None
    reward_weights: Tensor
    row_domain: Tensor | None
    domains: list[str] | None

    def masks(self, completion_ids: Sequence[Sequence[int]], tool_mask: Sequence[Sequence[int]] | None,
              width: int) -> tuple[Tensor, Tensor, Tensor]:
        """Lengths ``[R]``, the response mask and TRL's loss mask (``completion_mask x tool_mask``, truncated
        completions zeroed under ``mask_truncated_completions``), ``[R, width]``."""
        lengths = torch.tensor([len(c) for c in completion_ids], dtype=torch.long)
        response = (torch.arange(width)[None, :] < lengths[:, None]).to(torch.long)
        loss = response.clone()
        if tool_mask is not None:
            loss = loss * pad_right(tool_mask, 1, torch.long, width)
        if self.stops is not None:
            finished = torch.tensor([bool(c) and c[-1] in self.stops for c in completion_ids])
            loss = loss * finished[:, None].to(torch.long)
        return lengths, response, loss

    def rollout(self, prompt_ids: list[list[int]], completion_ids: list[list[int]],
                tool_mask: list[list[int]] | None, rewards: Tensor, labels: list[str] | None,
                rows: Tensor | None, uid: Tensor) -> tuple[Batch, Tensor]:
        """A round's on_rollout batch (every process's rows) and each row's loss-mask tokens: groups labelled
        ``uid``, the reward TRL logs (reward functions weighted and summed; every function
        ``None``: NaN) on the last response token."""
        R = len(completion_ids)
        width = max(1, max(len(c) for c in completion_ids))
        lengths, response, loss = self.masks(completion_ids, tool_mask, width)
        weights = self.reward_weights.detach().cpu().to(rewards.dtype)
        reward = (rewards * weights[None, :]).nansum(dim=1)
        reward[torch.isnan(rewards).all(dim=1)] = float("nan")
        rm = torch.zeros(R, width)
        rm[torch.arange(R), (lengths - 1).clamp_min(0)] = reward.to(torch.float32)
        fields: dict[str, Tensor] = {"response_mask": response, "rm_scores": rm, "loss_mask": loss}
        fields.update(self.token_fields(prompt_ids, completion_ids, response, self.runtime.fields("on_rollout")))
        if self.runtime.plan.reads_history:
            assert rows is not None
            fields["prompt_index"] = self.prompt_index(rows)
        batch = Batch.from_tensors(uid=uid, domains=labels,
                                   domain_names=self.domains if labels is not None else None, **fields)
        return batch, loss.sum(dim=1)

    def prompt_index(self, rows: Tensor) -> Tensor:
        """The prompt ids of dataset rows ``rows``."""
        assert self.row_domain is not None
        return self.runtime.prompt_index(self.row_domain[rows], rows)

    def token_fields(self, prompt_ids: Sequence[Sequence[int]], completion_ids: Sequence[Sequence[int]],
                     response: Tensor, wanted: frozenset[str]) -> dict[str, Tensor]:
        """``prompts``/``responses``/``input_ids``/``attention_mask`` (verl's names) when a method asks."""
        if not wanted & TOKEN_FIELDS:
            return {}
        prompts = pad_left(prompt_ids, self.pad_id, torch.long)
        responses = pad_right(completion_ids, self.pad_id, torch.long, response.size(1))
        out = {"prompts": prompts, "responses": responses, "input_ids": torch.cat([prompts, responses], dim=1),
               "attention_mask": torch.cat([pad_left([[1] * len(p) for p in prompt_ids], 0, torch.long), response],
                                           dim=1)}
        return {k: v for k, v in out.items() if k in wanted}

    def advantage(self, out: dict[str, Any], rounds: Sequence[RoundData], kept: Kept, layout: Layout,
                  wanted: frozenset[str], processes: Processes) -> Batch:
        """The on_advantage batch: the kept rows of every process, in global order (every process builds the
        same one, so every process decides the same)."""
        completion_ids = [rounds[a].completion_ids[b] for a, b in kept.refs]
        width = max(1, max(len(c) for c in completion_ids))
        tool = None if rounds[0].tool_mask is None else [rounds[a].tool_mask[b] for a, b in kept.refs]  # type: ignore[index]
        _, response, loss = self.masks(completion_ids, tool, width)
        rm = torch.zeros(len(kept), width)
        rm[torch.arange(len(kept)), (kept.lengths - 1).clamp_min(0)] = kept.rewards.to(torch.float32)
        adv = processes.gather_rows(out["advantages"].detach(), layout).to(torch.float32)
        # TRL's advantages are one per row (or per token, from an earlier write): verl's [K, T] layout.
        adv = adv[:, None].expand(-1, width) if adv.dim() == 1 else fit(adv, width)
        fields: dict[str, Tensor] = {"response_mask": response, "rm_scores": rm, "loss_mask": loss,
                                     "advantages": adv * response}
        fields.update(self.token_fields([rounds[a].prompt_ids[b] for a, b in kept.refs], completion_ids,
                                        response, wanted))
        # (``rollout_log_probs``: vLLM's sampling log-probs when TRL generated with vLLM, trl/vllm.py.)
        per_token = {"old_log_probs": out.get("old_per_token_logps", out.get("_dfx_old_logps")),
                     "ref_log_prob": out.get("ref_per_token_logps"), "entropy": out.get("_dfx_entropy"),
                     "rollout_log_probs": out.get("sampling_per_token_logps")}
        for name, value in per_token.items():
            if name in wanted and value is not None:
                fields[name] = fit(processes.gather_rows(value.detach().float(), layout), width)
        if self.runtime.plan.reads_history or self.runtime.plan.replays:
            fields["prompt_index"] = self.prompt_index(torch.stack([rounds[a].rows[b] for a, b in kept.refs]))  # type: ignore[index]
        return Batch.from_tensors(uid=kept.groups, domains=kept.labels,
                                  domain_names=self.domains if kept.labels is not None else None, **fields)
