"""One generation batch of the TRL host: the step's generation rounds, each a call of TRL's own
``_generate_and_score_completions`` (a *pass*), and the batch TRL trains on.

* ``native``: TRL's method runs whole, untouched; on_rollout is emitted from inside it, once its rewards are
  known (``_calculate_rewards``).
* ``collect``: when a method may drop rows at on_rollout (or refill runs), a round stops right after its
  rewards: its old/reference log-prob passes are skipped, nothing is spent on rows that may be dropped.
* ``replay``: once the rounds are done, TRL's method runs once more on the kept rows, its generation and
  rewards replayed from the rounds: TRL itself pads them, computes the old/reference log-probs, advantages
  (group or batch statistics), ``num_items_in_batch`` and its metrics, on a batch that never held the
  dropped groups, laid out over the processes as TRL lays out a batch of that many rows.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from ..kit import Candidates, DataflexError, ReplayPart, RolloutOutcome, Step, concat_rows
from . import replays
from .advantages import trl_advantages
from .processes import unlog_padding
from .records import Collected, Kept, Pass, RoundData
from .rows import Layout

if TYPE_CHECKING:
    from .trainer import DataflexGRPOTrainer


def generation_batch(trainer: DataflexGRPOTrainer, inputs: list[dict[str, Any]]) -> dict[str, Any]:
    """The kit's step on one TRL generation batch: prompts, generation rounds and on_rollout, then the batch
    TRL trains on with on_advantage carried out (:func:`~dataflex_bus.trl.update.after_generation`)."""
    from .update import after_generation

    step = trainer.dataflex_kit.begin(trainer.dataflex_batch.generations)
    trainer.dataflex_batch.generations += 1
    settings = trainer.dataflex_settings
    probs = step.domain_probabilities(settings.domains or []) if trainer.dataflex.plan.samples_domains else None
    # A replay method may fill part of the step from its store (DOTS's fresh share): fewer prompts generated.
    replay = ReplayPart.of(step)
    target = trainer.dataflex_settings.target
    gen = trainer.dataflex_batch.gen = step.generation(replay.fresh_prompts(target) if replay is not None else target)
    trainer.dataflex_batch.fillers = 0
    rounds: list[RoundData] = []
    out: dict[str, Any] | None = None
    try:
        while (n := gen.request()) > 0:
            request = round_inputs(trainer, step, n, inputs, probs)
            if trainer.dataflex_settings.collects:
                data = collect(trainer, request)
                while (more := gen.continuation()) is not None:  # an allocator's continuation rounds
                    extra = collect(trainer, continuation(trainer, data, more.rows, more.counts))
                    data.extend(extra, concat_rows(data.batch, extra.batch))
                rounds.append(data)
            else:
                out, data = native(trainer, request)
                rounds.append(data)
        outcome = gen.finish()
    finally:
        trainer.dataflex_batch.gen = None
    if trainer.dataflex_settings.ragged:  # the host's own cost, beside the kit's compute/generated_rollouts
        step.metrics["dataflex/compute/filler_rollouts"] = float(trainer.dataflex_batch.fillers)
    settings.processes.agree("on_rollout", *(k for k in outcome.keeps if k is not None),
                             torch.tensor([outcome.skip_update]))
    if not rounds:  # (only a replayer planning the whole step from its store gets here)
        raise DataflexError(f"dataflex TRL host: step {step.index} generates no prompt: the replayer's replay_groups "
                            "planned every group of the step from its store, and TRL's generation batch needs at "
                            "least one generated round; plan at most target - 1 groups (as rollout_replay does)")
    if trainer.dataflex_settings.collects:
        kept = Kept.of(rounds, kept_refs(rounds, outcome))
        if trainer.dataflex.plan.replays and len(kept) and not outcome.skip_update:
            rounds, kept = with_replayed(trainer, step, rounds, kept)
        out, layout = trainer._dfx_replay(rounds, kept)
    else:
        if any(k is not None for k in outcome.keeps) or outcome.skip_update:
            raise DataflexError("dataflex TRL host: an on_rollout decision to drop rows reached a generation "
                                "batch that was not collected for it (a bug: please report it)")
        assert out is not None
        kept = Kept.of(rounds, [(0, i) for i in range(len(rounds[0]))])
        layout = Layout(len(kept), trainer.dataflex_settings.processes.count, 1)
    return after_generation(trainer, step, out, rounds, kept, layout, outcome)


def with_replayed(trainer: DataflexGRPOTrainer, step: Step, rounds: list[RoundData],
                  kept: Kept) -> tuple[list[RoundData], Kept]:
    """The stored rows the step replays (``ReplayPart.replay``) joined to its kept rows as one more round
    (:mod:`~dataflex_bus.trl.replays`)."""
    batches = trainer.dataflex_settings.batches
    replay = ReplayPart.of(step)
    replayed = replay.replay(replays.fresh_batch(rounds, kept, batches)) if replay is not None else None
    if replayed is None:
        return rounds, kept
    stored = replays.stored_round(replayed, rounds[0], batches)
    return [*rounds, stored], replays.joined(kept, stored, len(rounds), replayed)


def round_inputs(trainer: DataflexGRPOTrainer, step: Step, n: int, inputs: list[dict[str, Any]],
                 probs: Tensor | None) -> Pass:
    """The collect or native pass of a round of ``n`` prompts: TRL's own rows (the dataloader's generation
    batch) or, with a stream, ``n`` prompts (rounded up to whole rows per process) chosen by ``Step.prompts``,
    each with the group size's rollouts or an allocation's count (this process's rows in ``Pass.inputs``)."""
    stream = trainer.dataflex_settings.stream
    kind = "collect" if trainer.dataflex_settings.collects else "native"
    if stream is None:
        step.prompts(n, lambda k: Candidates(inputs))
        return Pass(kind, inputs=inputs)
    n = -(-n // trainer.dataflex_settings.unit) * trainer.dataflex_settings.unit
    table_ids = trainer.dataflex_settings.batches.row_domain

    def draw(k: int) -> Candidates[Tensor]:
        rows, _ = stream.draw(k, probs)
        if table_ids is None:
            return Candidates(rows)
        return Candidates(rows, table_ids[rows], rows.clone())

    chosen = step.prompts(n, draw)
    prompts = torch.cat(chosen.draws)[chosen.index]
    sizes = chosen.counts if chosen.counts is not None else torch.full((prompts.numel(),),
                                                                       trainer.dataflex_settings.group_size)
    rows = prompts.repeat_interleave(sizes)
    dataset: Any = trainer.train_dataset
    read: dict[int, dict[str, Any]] = {}  # each prompt's row read once, copied per rollout (TRL adds to them)
    return sharded(trainer, Pass(kind, rows=rows, uid=torch.arange(prompts.numel()).repeat_interleave(sizes)),
                   [read[i] if i in read else read.setdefault(i, dict(dataset[i])) for i in rows.tolist()])


def continuation(trainer: DataflexGRPOTrainer, data: RoundData, first: Tensor, counts: Tensor) -> Pass:
    """The collect pass of a continuation round: ``counts`` more rollouts of the groups whose first rows in
    ``data`` are ``first``, under the groups' labels."""
    index = first.repeat_interleave(counts)
    assert data.inputs is not None and data.uid is not None
    return sharded(trainer, Pass("collect", rows=None if data.rows is None else data.rows[index],
                                 uid=data.uid[index], extends=True), [data.inputs[i] for i in index.tolist()])


def sharded(trainer: DataflexGRPOTrainer, p: Pass, rows: list[dict[str, Any]]) -> Pass:
    """``p`` with this process's slice of a round's rows (every process's, in TRL's global order) as its
    inputs: TRL gathers rewards across processes, so every process generates as many rows, the last process
    making up the difference with filler copies of the last row (``Pass.fillers``, left out of everything)."""
    processes = trainer.dataflex_settings.processes
    p.fillers = -len(rows) % processes.count
    rows = rows + rows[-1:] * p.fillers
    per = len(rows) // processes.count
    p.inputs = [dict(x) for x in rows[processes.rank * per:(processes.rank + 1) * per]]
    return p


def native(trainer: DataflexGRPOTrainer, p: Pass) -> tuple[dict[str, Any], RoundData]:
    """TRL's generation batch, untouched; on_rollout is emitted from inside it (``_calculate_rewards``)."""
    p.old_entropy = trainer._dfx_old_entropy()
    trainer.dataflex_batch.current_pass = p
    try:
        out = trainer._dfx_trl_generation(p.inputs)
    finally:
        trainer.dataflex_batch.current_pass = None
    assert p.round is not None
    if p.entropies is not None:
        out["_dfx_entropy"] = p.entropies
    return out, p.round


def collect(trainer: DataflexGRPOTrainer, p: Pass) -> RoundData:
    """One generation round: TRL's method up to its rewards (and on_rollout), then stopped."""
    trainer.dataflex_batch.current_pass = p
    try:
        trainer._dfx_trl_generation(p.inputs)
    except Collected:
        pass
    else:
        raise DataflexError("dataflex TRL host: TRL's generation batch never computed its rewards")
    finally:
        trainer.dataflex_batch.current_pass = None
    assert p.round is not None
    trainer.dataflex_batch.fillers += p.fillers
    return p.round


def kept_refs(rounds: Sequence[RoundData], outcome: RolloutOutcome) -> list[tuple[int, int]]:
    """``(round, row)`` of every row the on_rollout decisions kept, in global order."""
    refs = []
    for r, keep in enumerate(outcome.keeps):
        index = range(len(rounds[r])) if keep is None else torch.nonzero(keep).flatten().tolist()
        refs += [(r, int(i)) for i in index]
    return refs


def replay(trainer: DataflexGRPOTrainer, rounds: Sequence[RoundData], kept: Kept) -> tuple[dict[str, Any], Layout]:
    """TRL's method on the kept rows alone, laid out over the processes as TRL lays out a batch of that
    many rows, generation and rewards replayed from the rounds."""
    processes, spg = trainer.dataflex_settings.processes, trainer.dataflex_settings.steps_per_generation
    # Replayed rows make groups of any size (their own, or joined to their prompt's fresh group).
    ragged = trainer.dataflex_settings.ragged or kept.replayed is not None
    layout = Layout(len(kept), processes.count, spg)
    lo, hi = layout.span(processes.rank)
    refs = kept.refs[lo:hi]
    # Padding rows copy one of this process's rows (its widths stay TRL's) and train nothing.
    mine = refs + [refs[-1] if refs else kept.refs[0]] * (layout.per_rank - len(refs))
    first = rounds[0]

    def col(name: str) -> list[Any] | None:
        if getattr(first, name) is None:
            return None
        return [getattr(rounds[a], name)[b] for a, b in mine]

    extra: dict[str, Any] = {}
    for key, value in first.extra.items():
        extra[key] = [rounds[a].extra[key][b] for a, b in mine] if isinstance(value, list) else value
    generated = (col("prompt_ids"), col("completion_ids"), col("tool_mask"), col("completions"),
                 col("logprobs"), extra, None, col("tool_images") or [])
    rewards = torch.stack([rounds[a].rewards[b] for a, b in kept.refs]).to(trainer.accelerator.device)
    pending = {c: [rounds[a].pending_logs[c][b] for a, b in mine] for c in first.pending_logs}
    inputs = [dict(rounds[a].inputs[b]) for a, b in mine]  # type: ignore[index]
    trainer.dataflex_batch.current_pass = p = Pass("replay", generated=generated, rewards=rewards, pending_logs=pending,
                                 old_entropy=trainer._dfx_old_entropy())
    try:
        # TRL's old/reference passes run in chunks of one micro-batch, as on a batch of only these rows.
        with micro_batch_rows(trainer.args, layout.per_rank // spg), groups_of_one(trainer, ragged):
            out = trainer._dfx_trl_generation(inputs)
    finally:
        trainer.dataflex_batch.current_pass = None
    if p.entropies is not None:
        out["_dfx_entropy"] = p.entropies
    if ragged:
        out["advantages"] = ragged_advantages(trainer, rewards.detach().cpu(), kept)[lo:hi].to(rewards.device)
    adv = out["advantages"]  # TRL's slice of the kept rows: this process's real rows
    if adv.size(0) < layout.per_rank:
        out["advantages"] = torch.cat([adv, adv.new_zeros(layout.per_rank - adv.size(0), *adv.shape[1:])])
    if layout.padded:
        processes.mark_padding(out, hi - lo, layout)
        unlog_padding(trainer._logs, layout)
    return out, layout


@contextlib.contextmanager
def groups_of_one(trainer: DataflexGRPOTrainer, on: bool) -> Iterator[None]:
    """TRL's ``num_generations`` set to 1 while inside (when ``on``): its advantages then reshape a batch of
    any size (``rewards.view(-1, 1)``); the host replaces them with the ragged groups' own
    (:func:`ragged_advantages`)."""
    old = trainer.num_generations
    trainer.num_generations = 1 if on else old
    try:
        yield
    finally:
        trainer.num_generations = old


def ragged_advantages(trainer: DataflexGRPOTrainer, rewards: Tensor, kept: Kept) -> Tensor:
    """TRL's advantages of the kept rows over their groups, whatever their sizes
    (:func:`~dataflex_bus.trl.advantages.trl_advantages`), every process's (``[K]``); what TRL logged of
    them in the pass (computed over groups of one) is corrected."""
    _, groups = torch.unique(kept.groups, return_inverse=True)
    advantages, std_is_zero = trl_advantages(rewards, groups, int(groups.max()) + 1 if len(kept) else 0,
                                             trainer.reward_weights.detach().cpu(),
                                             scale_rewards=str(trainer.scale_rewards),
                                             aggregation=str(trainer.multi_objective_aggregation))
    trainer._metrics["train"]["frac_reward_zero_std"][-1] = std_is_zero.float().mean().item()
    logged: Any = trainer._logs["advantages"]  # (a deque of at most generation_batch_size entries)
    for _ in range(min(len(kept), len(logged))):
        logged.pop()
    logged.extend(advantages.tolist())
    return advantages


@contextlib.contextmanager
def micro_batch_rows(args: Any, rows: int) -> Iterator[None]:
    """TRL's ``per_device_train_batch_size`` set to ``rows`` (its no-grad passes' chunk) while inside."""
    old = args.per_device_train_batch_size
    args.per_device_train_batch_size = max(rows, 1)
    try:
        yield
    finally:
        args.per_device_train_batch_size = old


def rewarded(trainer: DataflexGRPOTrainer, p: Pass, inputs: list[dict[str, Any]], rewards: Tensor) -> None:
    """A round's rewards are known (inside TRL's ``_calculate_rewards``): its rows from every process, its
    on_rollout batch handed to the step's generation; a collected round ends here (:class:`Collected`)."""
    p.round = data = round_data(trainer, p, inputs, rewards, full=p.kind == "collect")
    gen = trainer.dataflex_batch.gen
    assert gen is not None
    # TRL's prompt ids are unpadded: each row's prompt, once per rollout.
    prompt = sum(len(ids) for ids in data.prompt_ids)
    if p.extends:
        gen.extend(data.batch, prompt_tokens=prompt)
    else:
        gen.add(data.batch, prompt_tokens=prompt)
    if p.kind == "collect":
        raise Collected


def round_data(trainer: DataflexGRPOTrainer, p: Pass, inputs: list[dict[str, Any]], rewards: Tensor, *,
               full: bool) -> RoundData:
    """The round's rows from every process and its on_rollout batch (``full``: everything a replay needs)."""
    assert p.generated is not None
    prompt_ids, completion_ids, tool_mask, completions, logprobs, extra, _, tool_images = p.generated
    key = trainer.dataflex.domain_key
    local: dict[str, list[Any]] = {"prompt_ids": prompt_ids, "completion_ids": completion_ids}
    if tool_mask is not None:
        local["tool_mask"] = tool_mask
    if trainer.dataflex_settings.labels is not None:
        local["labels"] = [str(x.get(key)) for x in inputs]
    if full:
        local.update(completions=completions, inputs=inputs)
        if logprobs is not None:
            local["logprobs"] = logprobs
        if tool_images:
            local["tool_images"] = tool_images
        for name, values in extra.items():
            if isinstance(values, list):
                local[f"extra:{name}"] = values
        # What reward functions logged per row (log_extra): flushed by the replay, for its rows.
        pending: Any = trainer._pending_extra_logs
        for column, values in pending.items():
            local[f"logs:{column}"] = values
        pending.clear()
    glob = trainer.dataflex_settings.processes.gather_lists(local)
    rewards = rewards.detach().cpu()
    if p.fillers:  # the last process's filler rows: in no batch, no count, no update
        glob = {k: v[:-p.fillers] for k, v in glob.items()}
        rewards = rewards[:-p.fillers]
    uid = p.uid if p.uid is not None else torch.arange(len(rewards)) // trainer.dataflex_settings.batches.group_size
    batch, loss_tokens = trainer.dataflex_settings.batches.rollout(glob["prompt_ids"], glob["completion_ids"],
                                                      glob.get("tool_mask"), rewards, glob.get("labels"), p.rows,
                                                      uid)
    data = RoundData(prompt_ids=glob["prompt_ids"], completion_ids=glob["completion_ids"],
                     tool_mask=glob.get("tool_mask"), rewards=rewards, labels=glob.get("labels"), batch=batch,
                     loss_tokens=loss_tokens, rows=p.rows, uid=uid)
    if full:
        data.completions, data.inputs, data.logprobs = glob["completions"], glob["inputs"], glob.get("logprobs")
        data.tool_images = glob.get("tool_images")
        data.extra = {n: glob[f"extra:{n}"] if isinstance(v, list) else v for n, v in extra.items()}
        data.pending_logs = {k[5:]: v for k, v in glob.items() if k.startswith("logs:")}
    return data
