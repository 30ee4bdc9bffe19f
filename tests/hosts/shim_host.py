"""The CPU shim as a host of the contract suite: its real step (``ShimTrainer.train_step``: the host kit's
drivers, old log-probs, GRPO advantages, the carry-out, the PPO update) on the scripted world's rollouts.

Only where prompts come from and what generation returns is the world's (the shim's own tasks would give
other prompts than verl's dataset): candidates are the world's dataset rows in dataset order, as verl's
sequential dataloader draws them (by verl's :class:`DomainSampler` when a method mixes), and a rollout is the
world's ``(domain, row, session)`` reward and length.
"""

from __future__ import annotations

from typing import Any

import torch
from world import (
    DOMAINS,
    N,
    StepRecord,
    World,
    add_row,
    behaviour_log_prob,
    kit_metrics,
    response_length,
    reward,
    row_record,
)

from dataflex_bus.batch import Batch
from dataflex_bus.history import PromptTable
from dataflex_bus.runtime import Runtime
from dataflex_bus.shim.config import prepare
from dataflex_bus.shim.host import describe
from dataflex_bus.shim.tasks import EOS, PAD
from dataflex_bus.shim.trainer import ShimTrainer
from dataflex_bus.steps import Candidates, Chosen

SEED = 7  # verl's data.seed in the harness: the domain sampler's seed


class WorldShim(ShimTrainer):
    """The shim trainer generating the world's rollouts (see the module doc)."""

    def __init__(self, resolved: dict[str, Any], runtime: Runtime, world: World) -> None:
        super().__init__(resolved, runtime, warm_start=False)
        self.world = world
        self.prompts = world.prompts
        self.cursor = 0
        labels = [d for d, _ in self.prompts]
        if runtime.plan.needs_prompt_ids:
            runtime.set_prompts(PromptTable.from_labels(labels, [r for _, r in self.prompts],
                                                        column="extra_info.index"))
        self.domain_sampler = None
        if runtime.plan.samples_domains:
            from dataflex_bus.sampler import DomainSampler

            self.domain_sampler = DomainSampler(labels, domains=runtime.configured_domains, seed=SEED)
            self.domains = self.domain_sampler.domains
            runtime.set_domains(self.domains)
        self.updates: list[Batch] = []

    def _candidates(self, probs: torch.Tensor, n: int) -> Candidates[torch.Tensor]:
        if self.domain_sampler is not None:  # verl fetches one prompt at a time here (data.gen_batch_size=1)
            rows = torch.cat([self.domain_sampler.draw(1, probs)[0] for _ in range(n)])
        else:  # verl's sequential dataloader, epoch after epoch
            rows = (torch.arange(self.cursor, self.cursor + n) % len(self.prompts))
            self.cursor += n
        table = self.runtime.prompt_table
        if table is None:
            return Candidates(rows)
        ids = torch.tensor([table.domains.index(self.prompts[int(i)][0]) for i in rows])
        return Candidates(rows, ids, rows.clone())

    @staticmethod
    def _join(chosen: Chosen[torch.Tensor]) -> torch.Tensor:  # type: ignore[override]
        only = chosen.only  # the shim's own shortcut (ShimTrainer._join): the whole draw, nothing indexed
        return only if only is not None else torch.cat(chosen.draws)[chosen.index]

    @staticmethod
    def _take(rows: torch.Tensor, index: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return rows[index]

    def _rollout(self, rows: torch.Tensor, counts: torch.Tensor | None = None,  # type: ignore[override]
                 uid: torch.Tensor | None = None) -> Batch:
        # Sessions number a prompt's rollouts within one generation request, as verl's agent loop does
        # (a continuation's start again at 0).
        domains, uids, rewards, lengths, sessions, rows_of = [], [], [], [], [], []
        sizes = [N] * len(rows) if counts is None else counts.tolist()
        for j, (i, n) in enumerate(zip(rows.tolist(), sizes, strict=True)):  # one count per prompt
            domain, row = self.prompts[i]
            if uid is None:
                self.next_uid += 1
            for s in range(n):
                domains.append(domain)
                uids.append(self.next_uid if uid is None else int(uid[j]))
                rewards.append(reward(domain, s))
                lengths.append(response_length(row, s))
                sessions.append(s)
                rows_of.append(row)
        width = 6
        length = torch.tensor(lengths)
        pos = torch.arange(width)[None, :]
        mask = (pos < length[:, None]).long()
        digits = (torch.tensor(rows_of)[:, None] * 11 + torch.tensor(sessions)[:, None] * 5 + pos) % 10
        responses = torch.where(pos == (length - 1)[:, None], EOS, torch.where(mask.bool(), digits, PAD))
        rm = torch.zeros(len(uids), width)
        rm[torch.arange(len(uids)), length - 1] = torch.tensor(rewards)
        extra = {}
        table = self.runtime.prompt_table
        if table is not None:
            extra["prompt_index"] = self.runtime.prompt_index(domains, torch.tensor(rows_of))
        prompts = (torch.tensor(rows_of)[:, None] * 7 + torch.arange(4)) % 10
        return Batch.from_tensors(uid=torch.tensor(uids), domains=domains, domain_names=list(self.domains),
                                  prompts=prompts, responses=responses, response_mask=mask, loss_mask=mask.clone(),
                                  rm_scores=rm, rollout_log_probs=behaviour_log_prob(
                                      torch.tensor(rows_of)[:, None], torch.tensor(sessions)[:, None], pos).float(),
                                  world_row=torch.tensor(rows_of), world_session=torch.tensor(sessions), **extra)

    def _update(self, batch: Batch) -> dict[str, float]:
        self.updates.append(batch)
        return super()._update(batch)


def config(block: dict[str, Any] | None, *, batch: int, steps: int) -> dict[str, Any]:
    return {"trainer": {"steps": steps, "group_size": N, "prompts_per_step": batch, "mini_batches": 1,
                        "eval_every": 0, "save_every": 0},
            "model": {"pretrain_steps": 0, "hidden": 8},
            "data": {"domains": list(DOMAINS), "heldout": 30},
            **({"dataflex": block} if block else {})}


def run(block: dict[str, Any] | None, world: World, *, batch: int, steps: int,
        tmp_path: Any = None, settings: Any = ()) -> list[StepRecord]:
    """``steps`` steps of ``block`` on the world; one record per step (``settings``: another host's framework
    settings a case needs, none here)."""
    prepared = prepare(config(block, batch=batch, steps=steps))
    runtime = Runtime(prepared.method, host=describe(prepared.resolved), check_writes=True)
    trainer = WorldShim(prepared.resolved, runtime, world)
    records = []
    for _ in range(steps):
        before = len(trainer.updates)
        metrics = trainer.train_step()
        record = StepRecord(metrics=kit_metrics(metrics), domain_probs=runtime.domain_probs)
        if len(trainer.updates) == before:
            record.skipped = True
        else:
            b = trainer.updates[-1]
            for i in range(len(b)):
                add_row(record, b.domain_names[int(b.domain_index[i])], int(b["world_row"][i]),
                        int(b["world_session"][i]),
                        row_record(b["advantages"][i], b["rollout_is_weights"][i], b["loss_mask"][i],
                                   b["old_log_probs"][i], b["rollout_log_probs"][i]))
        records.append(record)
    return records


def description() -> Any:
    return describe(prepare(config(None, batch=3, steps=1)).resolved)
