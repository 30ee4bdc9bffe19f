"""TRL 1.16's ``GRPOTrainer`` with the dataflex event bus wired into its generation batch.

:class:`DataflexGRPOTrainer` is TRL's host adapter: it moves rows between TRL's generation batch and
:class:`~dataflex_bus.Batch` and calls the host kit's step drivers (:mod:`dataflex_bus.steps`); one kit step
is one TRL generation batch (``steps_per_generation x num_iterations`` micro-steps, whole optimizer steps):

* ``_generate_and_score_completions`` runs the step's generation: ``Step.prompts`` (TRL's own prompts, or
  candidates drawn from the host's :class:`~dataflex_bus.trl.prompts.PromptStream` when a method selects
  prompts, mixes domains or refills), ``Generation`` (one round, or refill rounds: each round is one call of
  TRL's own method on the round's prompts), then ``Step.advantage`` and ``Step.trained`` on what TRL returns.
* ``_calculate_rewards`` is **on_rollout** (``Generation.add``): TRL has gathered every process's rewards, so
  the batch of the round is the same on every process, and so is every decision.
* When a method may drop rows at on_rollout (or refill runs), a round stops right after its rewards (its
  old/reference log-prob passes are skipped: nothing is spent on rows that may be dropped), and once the
  rounds are done TRL's method runs once more on the kept rows, its generation and rewards replayed from
  the rounds: TRL itself pads them, computes the old/reference log-probs, advantages (group or batch
  statistics), ``num_items_in_batch`` and its metrics, on a batch that never held the dropped groups.
  Otherwise TRL's method runs once, untouched.
* after it, **on_advantage** (``Step.advantage``): weights ride in the batch and multiply the advantages in
  ``_compute_loss``, recomputed advantages replace TRL's, dropped rows leave the batch (and the rows are
  laid out over the processes again, :class:`~dataflex_bus.trl.rows.Layout`).
* **on_step_end** (``Step.end``): after the last optimizer step of the generation batch, before TRL logs and
  saves; a mixer's probabilities apply from the next generation batch on.

Plugin state is saved as ``checkpoint-N/dataflex_state.pt`` and restored by ``resume_from_checkpoint``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from accelerate.utils import gather_object
from torch import Tensor
from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from trl import GRPOTrainer
from trl.models.utils import disable_gradient_checkpointing

from .. import __version__
from ..batch import Batch
from ..carry import AdvantageAction
from ..errors import ConfigError, ConfigIssue, DataflexError
from ..fingerprint import fingerprint
from ..runtime import Runtime
from ..steps import Candidates, Generation, RolloutOutcome, Step, StepKit
from .arguments import check_processing_class
from .block import load_block
from .host import describe, generation_span
from .prompts import PromptStream, domain_labels, prompt_table
from .rows import MULTIMODAL, REAL, WEIGHTS, Layout, cat_rows, pad_left, pad_right, row_fields, trim
from .skips import SkippedUpdates

log = logging.getLogger("dataflex_bus")

#: File written into every ``checkpoint-N`` folder.
STATE_FILE = "dataflex_state.pt"
STATE_FORMAT = 1


class _Collected(Exception):
    """Raised from ``_calculate_rewards`` to end a generation round once its rewards are known."""


@dataclass
class RoundData:
    """One generation round, every process's rows in TRL's global order (rank-major): what TRL's
    ``_generate`` returned, the rewards (``[R, F]``, one column per reward function), the dataset rows drawn
    (``None``: TRL's dataloader chose them), the domain labels and the on_rollout batch."""

    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    tool_mask: list[list[int]] | None
    rewards: Tensor
    labels: list[str] | None
    batch: Batch
    loss_tokens: Tensor
    rows: Tensor | None = None
    completions: list[Any] | None = None
    logprobs: list[Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    tool_images: list[Any] | None = None
    inputs: list[dict[str, Any]] | None = None
    pending_logs: dict[str, list[Any]] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.completion_ids)


@dataclass
class _Pass:
    """One call of TRL's ``_generate_and_score_completions`` made by the host: ``native`` (TRL runs it whole),
    ``collect`` (a round, ended after its rewards) or ``replay`` (the kept rows, generation and rewards given)."""

    kind: str
    rows: Tensor | None = None
    generated: tuple[Any, ...] | None = None
    rewards: Tensor | None = None
    round: RoundData | None = None
    old_entropy: bool = False
    entropies: Tensor | None = None
    no_grad_calls: int = 0
    pending_logs: dict[str, list[Any]] = field(default_factory=dict)


@dataclass
class Kept:
    """The real rows a generation batch goes on with, in global order: per row its group (unique over the
    rounds), domain label, reward, response length and loss-mask tokens; ``refs`` are ``(round, row)``."""

    refs: list[tuple[int, int]]
    groups: Tensor
    labels: list[str] | None
    rewards: Tensor
    lengths: Tensor
    loss_tokens: Tensor

    @classmethod
    def of(cls, rounds: Sequence[RoundData], refs: list[tuple[int, int]]) -> Kept:
        offsets = [0]
        for r in rounds:
            offsets.append(offsets[-1] + r.batch.num_groups)
        ri = torch.tensor([a for a, _ in refs], dtype=torch.long)
        ii = torch.tensor([b for _, b in refs], dtype=torch.long)

        def pick(values: Sequence[Tensor]) -> Tensor:
            flat = torch.cat(list(values))
            starts = torch.tensor([0] + [len(r) for r in rounds]).cumsum(0)
            return flat[starts[ri] + ii] if refs else flat[:0]

        groups = pick([r.batch.group_index + off for r, off in zip(rounds, offsets)])
        labels = None if rounds[0].labels is None else [rounds[a].labels[b] for a, b in refs]  # type: ignore[index]
        return cls(refs, groups, labels, pick([r.batch.rewards for r in rounds]),
                   pick([r.batch.lengths for r in rounds]), pick([r.loss_tokens for r in rounds]))

    def select(self, index: Tensor) -> Kept:
        idx = index.tolist()
        return Kept([self.refs[i] for i in idx], self.groups[index], None if self.labels is None else
                    [self.labels[i] for i in idx], self.rewards[index], self.lengths[index], self.loss_tokens[index])

    def __len__(self) -> int:
        return len(self.refs)


class _StepEnd(TrainerCallback):
    """Ends the host kit's step after the last optimizer step of a generation batch (before TRL logs and
    saves, which run after every callback's ``on_step_end``)."""

    def __init__(self, trainer: DataflexGRPOTrainer) -> None:
        self.trainer = trainer

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.trainer._dfx_maybe_end()


class DataflexGRPOTrainer(SkippedUpdates, GRPOTrainer):
    """TRL's ``GRPOTrainer`` running a ``dataflex`` block (see the module doc). ``dataflex``: a block
    (mapping), a YAML file holding one, or ``None`` (plain TRL; the kit's metrics are still logged). Every
    other argument is ``GRPOTrainer``'s. The block is validated against the TRL host's description of
    ``args`` before the model is prepared; TRL settings it cannot run under are refused naming the field."""

    def __init__(self, *args: Any, dataflex: Mapping[str, Any] | str | os.PathLike[str] | None = None,
                 **kwargs: Any) -> None:
        block = load_block(dataflex)
        check_processing_class(args, kwargs)
        config = kwargs.get("args", args[2] if len(args) > 2 else None)
        # Validate first when the config is given: errors before the model is wrapped and moved.
        runtime = Runtime(block, host=describe(config)) if config is not None else None
        super().__init__(*args, **kwargs)
        self.dataflex = runtime if runtime is not None else Runtime(block, host=describe(self.args))
        self.dataflex_kit = StepKit(self.dataflex)
        #: The kit's metrics of the last 10,000 finished generation batches (what is also logged).
        self.dataflex_metrics: deque[dict[str, float]] = deque(maxlen=10_000)
        self._dfx_setup()

    # ------------------------------------------------------------------ set-up
    def _dfx_setup(self) -> None:
        runtime = self.dataflex
        args: Any = self.args  # a GRPOConfig (typed as TrainingArguments by transformers)
        G, P = int(args.num_generations), self.accelerator.num_processes
        self._dfx_G, self._dfx_spg = G, int(args.steps_per_generation)
        span, accumulation = generation_span(args)
        if runtime.pipeline is not None and span % accumulation:  # refused by the host check; belt and braces
            raise ConfigError(ConfigIssue("GRPOConfig.gradient_accumulation_steps", "must divide "
                                          "steps_per_generation x num_iterations"))
        #: Optimizer steps and micro-steps per generation batch.
        self._dfx_span, self._dfx_micro = max(span // accumulation, 1), span
        self._dfx_target = args.generation_batch_size // G
        self._dfx_unit = P // math.gcd(G, P)  # prompts a round is rounded to, so every process gets whole rows
        self._dfx_replays = runtime.drops_rows_at("on_rollout") or runtime.refill is not None
        self._dfx_old_needed = args.gradient_accumulation_steps % span != 0 or bool(
            self.use_vllm and self.vllm_importance_sampling_correction)
        self._dfx_pass: _Pass | None = None
        self._dfx_gen: Generation | None = None
        self._dfx_step: Step | None = None
        self._dfx_end_batch: Batch | None = None
        self._dfx_skip = False
        self._dfx_generations = 0
        self._dfx_row_domain: Tensor | None = None
        self._dfx_stream: PromptStream | None = None
        dataset: Any = self.train_dataset
        uses_stream = runtime.selects_prompts or runtime.mixes or runtime.refill is not None or runtime.needs_prompt_ids
        if runtime.pipeline is not None:
            self._dfx_refuse(dataset)
        labels = domain_labels(dataset, runtime.domain_key, required=runtime.mixes) if hasattr(
            dataset, "column_names") else None
        sampler = None
        if runtime.mixes:
            from ..sampler import DomainSampler

            sampler = DomainSampler(labels or [], domains=runtime.configured_domains, seed=int(args.seed))
            runtime.set_domains(sampler.domains)
        names = sampler.domains if sampler is not None else (
            runtime.configured_domains or (sorted(set(labels)) if labels is not None else None))
        self._dfx_labels, self._dfx_domains = labels, names
        if runtime.needs_prompt_ids:
            table = prompt_table(labels, len(dataset))
            runtime.set_prompts(table)
            position = {d: i for i, d in enumerate(table.domains)}
            self._dfx_row_domain = torch.tensor([position[x] for x in (labels or ["default"] * len(dataset))])
        if uses_stream:
            self._dfx_stream = PromptStream(len(dataset), shuffle=bool(self.shuffle_dataset), seed=int(args.seed),
                                            sampler=sampler)
        self.add_callback(_StepEnd(self))

    def _dfx_refuse(self, dataset: Any) -> None:
        """What the host cannot carry a block out on, refused at construction naming what to change."""
        from torch.utils.data import IterableDataset

        runtime = self.dataflex
        if isinstance(dataset, IterableDataset) and (runtime.selects_prompts or runtime.mixes or runtime.refill
                                                     or runtime.needs_prompt_ids):
            raise ConfigError(ConfigIssue("train_dataset", "an IterableDataset cannot be indexed, and this block "
                                          "draws its own prompts (prompt selection, mix, refill or the prompt "
                                          "history)", ["a datasets.Dataset"]))
        columns = set(getattr(dataset, "column_names", None) or [])
        if columns & {"image", "images"}:
            raise ConfigError(ConfigIssue("train_dataset", "multimodal rows (an image column) are not supported by "
                                          "the dataflex TRL host", ["text prompts"]))
        if self.environment_factories is not None and self._dfx_replays:
            raise ConfigError(ConfigIssue("environment_factory", "a dataflex block that drops rows at on_rollout or "
                                          "refills replays TRL's generation on the kept rows, and environments keep "
                                          "per-rollout state that cannot be replayed", ["rollout_func"]))

    # ------------------------------------------------------------------ the generation batch
    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        if not getattr(self.model, "training", False):
            return super()._generate_and_score_completions(inputs)
        if self._dfx_step is not None:  # a generation batch training stopped inside (max_steps, resume)
            self._dfx_end()
        step = self.dataflex_kit.begin(self._dfx_generations)
        self._dfx_generations += 1
        probs = step.domain_probabilities(self._dfx_domains or []) if self.dataflex.mixes else None
        gen = self._dfx_gen = step.generation(self._dfx_target)
        rounds: list[RoundData] = []
        out: dict[str, Any] | None = None
        try:
            while (n := gen.request()) > 0:
                local, rows = self._dfx_round_inputs(step, n, inputs, probs)
                if self._dfx_replays:
                    rounds.append(self._dfx_collect(local, rows))
                else:
                    out, data = self._dfx_native(local, rows)
                    rounds.append(data)
            outcome = gen.finish()
        finally:
            self._dfx_gen = None
        self._dfx_agree("on_rollout", *(k for k in outcome.keeps if k is not None),
                        torch.tensor([outcome.skip_update]))
        if self._dfx_replays:
            kept = Kept.of(rounds, self._dfx_kept_refs(rounds, outcome))
            out, layout = self._dfx_replay(rounds, kept)
        else:
            if any(k is not None for k in outcome.keeps) or outcome.skip_update:
                raise DataflexError("dataflex TRL host: an on_rollout decision to drop rows reached a generation "
                                    "batch that was not collected for it (a bug: please report it)")
            assert out is not None
            kept = Kept.of(rounds, [(0, i) for i in range(len(rounds[0]))])
            layout = Layout(len(kept), self.accelerator.num_processes, 1)
        return self._dfx_after_generation(step, out, rounds, kept, layout, outcome)

    def _dfx_round_inputs(self, step: Step, n: int, inputs: list[dict[str, Any]],
                          probs: Tensor | None) -> tuple[list[dict[str, Any]], Tensor | None]:
        """This process's rows of a round of ``n`` prompts: TRL's own (the dataloader's generation batch) or,
        with a stream, ``n`` prompts (rounded up to whole rows per process) chosen by ``Step.prompts``."""
        stream = self._dfx_stream
        if stream is None:
            step.prompts(n, lambda k: Candidates(inputs))
            return inputs, None
        n = -(-n // self._dfx_unit) * self._dfx_unit
        table_ids = self._dfx_row_domain

        def draw(k: int) -> Candidates[Tensor]:
            rows, _ = stream.draw(k, probs)
            if table_ids is None:
                return Candidates(rows)
            return Candidates(rows, table_ids[rows], rows.clone())

        chosen = step.prompts(n, draw)
        rows = torch.cat(chosen.draws)[chosen.index].repeat_interleave(self._dfx_G)
        per = rows.numel() // self.accelerator.num_processes
        rank = self.accelerator.process_index
        dataset: Any = self.train_dataset
        read: dict[int, dict[str, Any]] = {}  # each prompt's row read once, copied per rollout (TRL adds to them)
        mine = [int(i) for i in rows[rank * per:(rank + 1) * per]]
        return [dict(read[i] if i in read else read.setdefault(i, dict(dataset[i]))) for i in mine], rows

    def _dfx_native(self, local: list[dict[str, Any]], rows: Tensor | None) -> tuple[dict[str, Any], RoundData]:
        """TRL's generation batch, untouched; on_rollout is emitted from inside it (``_calculate_rewards``)."""
        self._dfx_pass = p = _Pass("native", rows=rows, old_entropy=self._dfx_wants_entropy() and self._dfx_old_needed)
        try:
            out = super()._generate_and_score_completions(local)
        finally:
            self._dfx_pass = None
        assert p.round is not None
        if p.entropies is not None:
            out["_dfx_entropy"] = p.entropies
        return out, p.round

    def _dfx_collect(self, local: list[dict[str, Any]], rows: Tensor | None) -> RoundData:
        """One generation round: TRL's method up to its rewards (and on_rollout), then stopped."""
        self._dfx_pass = p = _Pass("collect", rows=rows)
        try:
            super()._generate_and_score_completions(local)
        except _Collected:
            pass
        else:
            raise DataflexError("dataflex TRL host: TRL's generation batch never computed its rewards")
        finally:
            self._dfx_pass = None
        assert p.round is not None
        return p.round

    def _dfx_kept_refs(self, rounds: Sequence[RoundData], outcome: RolloutOutcome) -> list[tuple[int, int]]:
        refs = []
        for r, keep in enumerate(outcome.keeps):
            index = range(len(rounds[r])) if keep is None else torch.nonzero(keep).flatten().tolist()
            refs += [(r, int(i)) for i in index]
        return refs

    def _dfx_replay(self, rounds: Sequence[RoundData], kept: Kept) -> tuple[dict[str, Any], Layout]:
        """TRL's method on the kept rows alone, laid out over the processes as TRL lays out a batch of that
        many rows, generation and rewards replayed from the rounds."""
        P, rank, spg = self.accelerator.num_processes, self.accelerator.process_index, self._dfx_spg
        layout = Layout(len(kept), P, spg)
        lo, hi = layout.span(rank)
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
        rewards = torch.stack([rounds[a].rewards[b] for a, b in kept.refs]).to(self.accelerator.device)
        pending = {c: [rounds[a].pending_logs[c][b] for a, b in mine] for c in first.pending_logs}
        inputs = [dict(rounds[a].inputs[b]) for a, b in mine]  # type: ignore[index]
        self._dfx_pass = _Pass("replay", generated=generated, rewards=rewards, pending_logs=pending,
                               old_entropy=self._dfx_wants_entropy() and self._dfx_old_needed)
        p = self._dfx_pass
        try:
            # TRL's old/reference passes run in chunks of one micro-batch, as on a batch of only these rows.
            with self._dfx_chunks(layout.per_rank // spg):
                out = super()._generate_and_score_completions(inputs)
        finally:
            self._dfx_pass = None
        if p.entropies is not None:
            out["_dfx_entropy"] = p.entropies
        n = hi - lo
        adv = out["advantages"]  # TRL's slice of the kept rows: this process's real rows
        if adv.size(0) < layout.per_rank:
            out["advantages"] = torch.cat([adv, adv.new_zeros(layout.per_rank - adv.size(0), *adv.shape[1:])])
        if layout.padded:
            self._dfx_mark_padding(out, n, layout)
            self._dfx_unlog_padding(layout)
        return out, layout

    def _dfx_mark_padding(self, out: dict[str, Any], n: int, layout: Layout) -> None:
        """Rows ``n:`` of this process are padding: nothing to train, marked on every process (TRL's
        per-row metric gathers in the loss must then match everywhere)."""
        real = torch.zeros(layout.per_rank, dtype=torch.bool, device=out["completion_mask"].device)
        real[:n] = True
        out[REAL] = real
        out["completion_mask"] = out["completion_mask"] * real[:, None].to(out["completion_mask"].dtype)
        out["advantages"] = out["advantages"] * real.view(-1, *([1] * (out["advantages"].dim() - 1)))
        self._dfx_num_items(out)

    def _dfx_unlog_padding(self, layout: Layout) -> None:
        """TRL logged every process's rows' prompt and completion but only the real rows' rewards: drop the
        padding rows' entries so its completion table stays aligned."""
        real = [i < layout.span(r)[1] - layout.span(r)[0] for r in range(layout.processes)
                for i in range(layout.per_rank)]
        logs: Any = self._logs
        for dq in [logs["prompt"], logs["completion"], *logs["extra"].values()]:
            if len(dq) >= len(real):
                tail = [dq.pop() for _ in range(len(real))][::-1]
                dq.extend(x for x, keep in zip(tail, real) if keep)

    @contextlib.contextmanager
    def _dfx_chunks(self, rows: int) -> Iterator[None]:
        old = self.args.per_device_train_batch_size
        self.args.per_device_train_batch_size = max(rows, 1)
        try:
            yield
        finally:
            self.args.per_device_train_batch_size = old

    # ------------------------------------------------------------------ TRL's hook points inside a pass
    def _generate(self, prompts: list[Any]) -> Any:
        p = self._dfx_pass
        if p is None:
            return super()._generate(prompts)
        if p.kind == "replay":
            assert p.generated is not None
            return p.generated
        p.generated = super()._generate(prompts)
        return p.generated

    def _get_per_token_logps_and_entropies(self, model: Any, input_ids: Tensor, attention_mask: Tensor,
                                           logits_to_keep: int, *args: Any, **kwargs: Any) -> Any:
        p = self._dfx_pass
        if p is not None and not torch.is_grad_enabled():
            if p.kind == "collect":  # the round may be dropped: its old/reference passes wait for the replay
                zeros = torch.zeros(input_ids.size(0), logits_to_keep, device=input_ids.device)
                return zeros, zeros if kwargs.get("compute_entropy") else None, None
            p.no_grad_calls += 1
            if p.old_entropy and p.no_grad_calls == 1:
                # TRL's first no-grad pass is the old policy's: its fused head computes the entropy anyway.
                logps, entropies, aux = super()._get_per_token_logps_and_entropies(
                    model, input_ids, attention_mask, logits_to_keep, *args, **{**kwargs, "compute_entropy": True})
                p.entropies = entropies
                return logps, None, aux
        return super()._get_per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep,
                                                          *args, **kwargs)

    def _calculate_rewards(self, inputs: list[dict[str, Any]], prompts: list[Any], completions: list[Any],
                           completion_ids_list: list[list[int]]) -> Tensor:
        p = self._dfx_pass
        if p is None:
            return super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        if p.kind == "replay":
            assert p.rewards is not None
            self._pending_extra_logs.clear()
            self._pending_extra_logs.update(p.pending_logs)
            return p.rewards
        rewards = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        p.round = data = self._dfx_round(p, inputs, rewards, full=p.kind == "collect")
        assert self._dfx_gen is not None
        self._dfx_gen.add(data.batch)
        if p.kind == "collect":
            raise _Collected
        return rewards

    # ------------------------------------------------------------------ the round's batch (on_rollout)
    def _dfx_gather(self, local: dict[str, list[Any]]) -> dict[str, list[Any]]:
        """Per-row lists of every process, concatenated in rank order (TRL's global order)."""
        if self.accelerator.num_processes == 1:
            return local
        parts = gather_object([local])
        # A column one process lacks (a reward function logging only on some rows) is None on its rows.
        keys = sorted({k for part in parts for k in part})
        return {k: [x for part in parts for x in part.get(k, [None] * len(part["completion_ids"]))] for k in keys}

    def _dfx_round(self, p: _Pass, inputs: list[dict[str, Any]], rewards: Tensor, *, full: bool) -> RoundData:
        """The round's rows from every process and its on_rollout batch (``full``: everything a replay needs)."""
        assert p.generated is not None
        prompt_ids, completion_ids, tool_mask, completions, logprobs, extra, _, tool_images = p.generated
        key = self.dataflex.domain_key
        local: dict[str, list[Any]] = {"prompt_ids": prompt_ids, "completion_ids": completion_ids}
        if tool_mask is not None:
            local["tool_mask"] = tool_mask
        if self._dfx_labels is not None:
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
            for column, values in self._pending_extra_logs.items():
                local[f"logs:{column}"] = values
            self._pending_extra_logs.clear()
        glob = self._dfx_gather(local)
        rewards = rewards.detach().cpu()
        batch, loss_tokens = self._dfx_rollout_batch(glob["prompt_ids"], glob["completion_ids"], glob.get("tool_mask"),
                                                     rewards, glob.get("labels"), p.rows)
        data = RoundData(prompt_ids=glob["prompt_ids"], completion_ids=glob["completion_ids"],
                         tool_mask=glob.get("tool_mask"), rewards=rewards, labels=glob.get("labels"), batch=batch,
                         loss_tokens=loss_tokens, rows=p.rows)
        if full:
            data.completions, data.inputs, data.logprobs = glob["completions"], glob["inputs"], glob.get("logprobs")
            data.tool_images = glob.get("tool_images")
            data.extra = {n: glob[f"extra:{n}"] if isinstance(v, list) else v for n, v in extra.items()}
            data.pending_logs = {k[5:]: v for k, v in glob.items() if k.startswith("logs:")}
        return data

    def _dfx_masks(self, completion_ids: Sequence[Sequence[int]], tool_mask: Sequence[Sequence[int]] | None,
                   width: int) -> tuple[Tensor, Tensor, Tensor]:
        """Lengths ``[R]``, the response mask and TRL's loss mask (``completion_mask x tool_mask``, truncated
        completions zeroed under ``mask_truncated_completions``), ``[R, width]``."""
        lengths = torch.tensor([len(c) for c in completion_ids], dtype=torch.long)
        response = (torch.arange(width)[None, :] < lengths[:, None]).to(torch.long)
        loss = response.clone()
        if tool_mask is not None:
            loss = loss * pad_right(tool_mask, 1, torch.long, width)
        if self.mask_truncated_completions:
            stops = {*self.eos_token_ids, self._tokenizer.pad_token_id}
            finished = torch.tensor([bool(c) and c[-1] in stops for c in completion_ids])
            loss = loss * finished[:, None].to(torch.long)
        return lengths, response, loss

    def _dfx_rollout_batch(self, prompt_ids: list[list[int]], completion_ids: list[list[int]],
                           tool_mask: list[list[int]] | None, rewards: Tensor, labels: list[str] | None,
                           rows: Tensor | None) -> tuple[Batch, Tensor]:
        """A round's on_rollout batch (every process's rows) and each row's loss-mask tokens: groups of
        ``num_generations`` rows, the reward TRL logs (reward functions weighted and summed; every function
        ``None``: NaN) on the last response token."""
        R = len(completion_ids)
        width = max(1, max(len(c) for c in completion_ids))
        lengths, response, loss = self._dfx_masks(completion_ids, tool_mask, width)
        weights = self.reward_weights.detach().cpu().to(rewards.dtype)
        reward = (rewards * weights[None, :]).nansum(dim=1)
        reward[torch.isnan(rewards).all(dim=1)] = float("nan")
        rm = torch.zeros(R, width)
        rm[torch.arange(R), (lengths - 1).clamp_min(0)] = reward.to(torch.float32)
        fields: dict[str, Tensor] = {"response_mask": response, "rm_scores": rm, "loss_mask": loss}
        fields.update(self._dfx_token_fields(prompt_ids, completion_ids, response, self.dataflex.fields("on_rollout")))
        if self.dataflex.keeps_history:
            assert rows is not None and self._dfx_row_domain is not None
            fields["prompt_index"] = self.dataflex.prompt_index(self._dfx_row_domain[rows], rows)
        batch = Batch.from_tensors(uid=torch.arange(R) // self._dfx_G, domains=labels,
                                   domain_names=self._dfx_domains if labels is not None else None, **fields)
        return batch, loss.sum(dim=1)

    def _dfx_token_fields(self, prompt_ids: Sequence[Sequence[int]], completion_ids: Sequence[Sequence[int]],
                          response: Tensor, wanted: frozenset[str]) -> dict[str, Tensor]:
        """``prompts``/``responses``/``input_ids``/``attention_mask`` (verl's names) when a method asks."""
        out: dict[str, Tensor] = {}
        if not wanted & {"prompts", "responses", "input_ids", "attention_mask"}:
            return out
        pad = self._tokenizer.pad_token_id
        prompts = pad_left(prompt_ids, pad, torch.long)
        responses = pad_right(completion_ids, pad, torch.long, response.size(1))
        out.update(prompts=prompts, responses=responses, input_ids=torch.cat([prompts, responses], dim=1),
                   attention_mask=torch.cat([pad_left([[1] * len(p) for p in prompt_ids], 0, torch.long), response],
                                            dim=1))
        return {k: v for k, v in out.items() if k in wanted}

    # ------------------------------------------------------------------ on_advantage and the update
    def _dfx_wants_entropy(self) -> bool:
        return "entropy" in (self.dataflex.fields("on_advantage") | self.dataflex.fields("on_step_end"))

    def _dfx_after_generation(self, step: Step, out: dict[str, Any], rounds: Sequence[RoundData], kept: Kept,
                              layout: Layout, outcome: RolloutOutcome) -> dict[str, Any]:
        """on_advantage carried out on TRL's generation batch; ``step.trained``; what on_step_end will read."""
        bad = [k for k in MULTIMODAL if k in out]
        if bad:
            raise DataflexError(f"dataflex TRL host: multimodal fields {bad} are not supported")
        runtime = self.dataflex
        skip = outcome.skip_update
        wanted = runtime.fields("on_advantage") | runtime.fields("on_step_end")
        batch = None
        if runtime.listens("on_advantage") or runtime.listens("on_step_end"):
            self._dfx_old_pass(out, layout, wanted)
            batch = self._dfx_global_batch(out, rounds, kept, layout, wanted)
        out.pop("_dfx_entropy", None)
        out.pop("_dfx_old_logps", None)
        action = step.advantage(batch) if batch is not None and runtime.listens("on_advantage") else AdvantageAction()
        keep = action.keep
        self._dfx_agree("on_advantage", *(t for t in (keep, *action.fields.values()) if t is not None),
                        torch.tensor([action.skip_update]))
        skip = skip or action.skip_update
        lo, hi = layout.span(self.accelerator.process_index)
        width = out["completion_ids"].size(1)
        masked = "loss_mask" in action.fields and not action.skip_update
        if not action.skip_update:
            if "advantages" in action.fields:
                out["advantages"] = self._dfx_local(action.fields["advantages"], lo, hi, layout, width, 0.0)
            if "rollout_is_weights" in action.fields:
                out[WEIGHTS] = self._dfx_local(action.fields["rollout_is_weights"], lo, hi, layout, width, 1.0)
            if masked:
                # A token mask taking tokens out of every loss term (or dropped rows, removed below): TRL's
                # tool_mask is multiplied into the loss mask only, where completion_mask would also cut the
                # attention. Kept rows' tool_mask x completion_mask is what TRL's loss mask was, minus the masked
                # tokens, so the loss, its normaliser and the trained-token counts follow the mask.
                loss_mask = action.fields["loss_mask"].ne(0)
                out["tool_mask"] = self._dfx_local(loss_mask, lo, hi, layout, width, 1.0).to(
                    out["completion_mask"].dtype)
                kept = dataclasses.replace(kept, loss_tokens=loss_mask.sum(dim=1).to(kept.loss_tokens.dtype))
        end = batch if runtime.listens("on_step_end") else None
        if end is not None and action.fields:
            end = end.with_fields(**action.fields)
        if keep is not None and not action.skip_update:
            index = torch.nonzero(keep).flatten()
            if end is not None:
                end = end.select(keep)
            if index.numel() == 0:  # nothing left to train (the shim's batch is empty too)
                skip = True
            elif index.numel() < len(kept):  # (counts num_items_in_batch of the rows left)
                out, kept, layout = self._dfx_relayout(out, kept, layout, index)
                masked = False
        if masked:  # the same rows, fewer tokens in the loss mask: TRL's normaliser counts them again
            self._dfx_num_items(out)
        if skip:
            step.skipped()
        self._dfx_skip = skip
        trained = (kept.loss_tokens > 0) & (not skip)
        step.trained(trained, kept.loss_tokens, kept.rewards, kept.lengths, kept.groups)
        self._dfx_step, self._dfx_end_batch = step, end
        return out

    def _dfx_local(self, values: Tensor, lo: int, hi: int, layout: Layout, width: int, pad: float) -> Tensor:
        """This process's rows ``[lo, hi)`` of a global ``[K, T]`` field, as ``[per_rank, width]`` (padding rows
        and columns ``pad``)."""
        part = values[lo:hi, :width].to(torch.float32)
        if part.size(1) < width:
            part = torch.cat([part, part.new_full((part.size(0), width - part.size(1)), pad)], dim=1)
        if part.size(0) < layout.per_rank:
            part = torch.cat([part, part.new_full((layout.per_rank - part.size(0), width), pad)])
        return part.to(self.accelerator.device)

    def _dfx_old_pass(self, out: dict[str, Any], layout: Layout, wanted: frozenset[str]) -> None:
        """The old policy's log-probs and entropy when a method asks and TRL did not compute them: one no-grad
        pass over this process's rows (the policy has not moved since generation). Never fed to the loss."""
        need_logps = "old_log_probs" in wanted and "old_per_token_logps" not in out
        need_entropy = "entropy" in wanted and "_dfx_entropy" not in out
        if not (need_logps or need_entropy):
            return
        ids = torch.cat([out["prompt_ids"], out["completion_ids"]], dim=1)
        mask = torch.cat([out["prompt_mask"], out["completion_mask"]], dim=1)
        chunk = max(layout.per_rank // self._dfx_spg, 1)
        model: Any = self.model
        checkpointing: Any = self.args.gradient_checkpointing_kwargs
        with torch.no_grad(), disable_gradient_checkpointing(model, checkpointing):
            logps, entropies, _ = super()._get_per_token_logps_and_entropies(
                model, ids, mask, out["completion_ids"].size(1), batch_size=chunk, compute_entropy=need_entropy)
        if need_logps:
            out["_dfx_old_logps"] = logps
        if need_entropy:
            out["_dfx_entropy"] = entropies

    def _dfx_gather_rows(self, t: Tensor, layout: Layout, *, left: bool = False) -> Tensor:
        """A per-row tensor of every process's real rows, in global order, widths padded to the widest."""
        if layout.processes == 1:
            return t[:layout.total].detach().cpu()
        acc = self.accelerator
        if t.dim() >= 2:
            t = acc.pad_across_processes(t.contiguous(), dim=1, pad_index=0, pad_first=left)
        everything = acc.gather(t.contiguous()).detach().cpu()
        real = torch.cat([torch.arange(layout.per_rank) < (layout.span(r)[1] - layout.span(r)[0])
                          for r in range(layout.processes)])
        return everything[real]

    def _dfx_global_batch(self, out: dict[str, Any], rounds: Sequence[RoundData], kept: Kept, layout: Layout,
                          wanted: frozenset[str]) -> Batch:
        """The on_advantage batch: the kept rows of every process, in global order (every process builds the
        same one, so every process decides the same)."""
        completion_ids = [rounds[a].completion_ids[b] for a, b in kept.refs]
        width = max(1, max(len(c) for c in completion_ids))
        tool = None if rounds[0].tool_mask is None else [rounds[a].tool_mask[b] for a, b in kept.refs]  # type: ignore[index]
        _, response, loss = self._dfx_masks(completion_ids, tool, width)
        rm = torch.zeros(len(kept), width)
        rm[torch.arange(len(kept)), (kept.lengths - 1).clamp_min(0)] = kept.rewards.to(torch.float32)
        adv = self._dfx_gather_rows(out["advantages"].detach(), layout).to(torch.float32)
        # TRL's advantages are one per row (or per token, from an earlier write): verl's [K, T] layout.
        adv = adv[:, None].expand(-1, width) if adv.dim() == 1 else fit(adv, width)
        fields: dict[str, Tensor] = {"response_mask": response, "rm_scores": rm, "loss_mask": loss,
                                     "advantages": adv * response}
        fields.update(self._dfx_token_fields([rounds[a].prompt_ids[b] for a, b in kept.refs], completion_ids,
                                             response, wanted))
        per_token = {"old_log_probs": out.get("old_per_token_logps", out.get("_dfx_old_logps")),
                     "ref_log_prob": out.get("ref_per_token_logps"), "entropy": out.get("_dfx_entropy")}
        for name, value in per_token.items():
            if name in wanted and value is not None:
                fields[name] = fit(self._dfx_gather_rows(value.detach().float(), layout), width)
        if self.dataflex.keeps_history:
            rows = torch.stack([rounds[a].rows[b] for a, b in kept.refs])  # type: ignore[index]
            assert self._dfx_row_domain is not None
            fields["prompt_index"] = self.dataflex.prompt_index(self._dfx_row_domain[rows], rows)
        return Batch.from_tensors(uid=kept.groups, domains=kept.labels,
                                  domain_names=self._dfx_domains if kept.labels is not None else None, **fields)

    def _dfx_relayout(self, out: dict[str, Any], kept: Kept, layout: Layout,
                      index: Tensor) -> tuple[dict[str, Any], Kept, Layout]:
        """Rows removed at on_advantage: the rows left (``index`` into the kept rows) laid out over the
        processes again, as TRL lays out a batch of that many rows."""
        P, rank = self.accelerator.num_processes, self.accelerator.process_index
        lo, hi = layout.span(rank)
        local = {k: v[:hi - lo].detach().cpu() for k, v in row_fields(out).items() if k != REAL}
        pad_id = self._tokenizer.pad_token_id
        glob = local if P == 1 else cat_rows(gather_object([local]), pad_id)
        glob = {k: v[index] for k, v in glob.items()}
        kept = kept.select(index)
        new = Layout(len(kept), P, self._dfx_spg)
        lo, hi = new.span(rank)
        mine = [*range(lo, hi)]
        source = mine[-1] if mine else 0
        rows = {k: v[mine + [source] * (new.per_rank - len(mine))] for k, v in glob.items()}
        lengths = kept.lengths[lo:hi] if hi > lo else kept.lengths[:1]
        prompt_width = int(rows["prompt_mask"].sum(dim=1).max())
        completion_width = max(int(lengths.max()), 1)
        multiple: Any = self.pad_to_multiple_of
        if multiple:
            prompt_width = -(-prompt_width // multiple) * multiple
            completion_width = -(-completion_width // multiple) * multiple
        rows = trim(rows, min(prompt_width, rows["prompt_ids"].size(1)), completion_width)
        device = self.accelerator.device
        # TRL's key order: its shuffle sizes the batch by the first field (a 0-d value there would fail).
        result = {k: rows[k].to(device) if k in rows else v for k, v in out.items() if k != REAL}
        if new.padded:
            self._dfx_mark_padding(result, hi - lo, new)
        else:
            self._dfx_num_items(result)
        return result, kept, new

    def _dfx_num_items(self, out: dict[str, Any]) -> None:
        """``num_items_in_batch`` of the rows now in the batch: TRL's own formula (grpo_trainer.py: the valid
        tokens of the whole generation batch, every process)."""
        mask = out["completion_mask"] if "tool_mask" not in out else out["completion_mask"] * out["tool_mask"]
        out["num_items_in_batch"] = self.accelerator.gather(mask.sum()).sum()

    def _dfx_agree(self, event: str, *tensors: Tensor) -> None:
        """Every process decided the same (each builds the same global batch; a method reading something of its
        own process, or an unseeded random source, would make them diverge): one small gather per event."""
        if self.accelerator.num_processes == 1:
            return
        value = 0
        for t in tensors:
            value = (value * 1000003 + fingerprint(t.detach().cpu().contiguous())) % (2**61 - 1)
        seen = self.accelerator.gather(torch.tensor([value], device=self.accelerator.device)).tolist()
        if len(set(seen)) > 1:
            raise DataflexError(f"dataflex: the processes decided differently at {event} (fingerprints {seen}): a "
                                "method must decide from the batch alone, with seeded randomness")

    def _compute_loss(self, model: Any, inputs: dict[str, Any]) -> Tensor:
        real, weights = inputs.get(REAL), inputs.get(WEIGHTS)
        if real is None and weights is None:
            return super()._compute_loss(model, inputs)
        inputs = {k: v for k, v in inputs.items() if k not in (REAL, WEIGHTS)}
        if weights is not None:
            # -min(r A w, clip(r) A w) = w * -min(r A, clip(r) A) for w >= 0: the policy-gradient term weighted
            # per token exactly; TRL's normalisers never read the advantages.
            adv = inputs["advantages"]
            inputs["advantages"] = (adv.unsqueeze(1) if adv.dim() == 1 else adv) * weights
        if real is None:
            return super()._compute_loss(model, inputs)
        rows = real.numel()
        idx = torch.nonzero(real).flatten()
        if idx.numel() == 0:  # one padding row: a zero loss still connected to the graph
            idx = torch.zeros(1, dtype=torch.long, device=real.device)
        inputs = {k: v[idx] if isinstance(v, Tensor) and v.dim() > 0 and v.size(0) == rows else v
                  for k, v in inputs.items()}
        if self.accelerator.num_processes == 1:
            return super()._compute_loss(model, inputs)
        # Processes now hold different row counts; TRL gathers per-row clip statistics, which needs equal
        # shapes: pad those with NaN (TRL reduces them with nanmin/nanmax).
        acc = self.accelerator
        plain = acc.gather

        def gather(t: Any) -> Any:
            if isinstance(t, Tensor) and t.dim() == 1 and t.is_floating_point():
                t = acc.pad_across_processes(t, dim=0, pad_index=float("nan"))
            return plain(t)

        acc.gather = gather
        try:
            return super()._compute_loss(model, inputs)
        finally:
            del acc.gather

    def create_optimizer(self, *args: Any, **kwargs: Any) -> Any:
        optimizer = super().create_optimizer(*args, **kwargs)
        if not getattr(optimizer, "_dataflex_wrapped", False):
            inner = optimizer.step

            def step(*a: Any, **k: Any) -> Any:
                # A generation batch left with nothing to train: no optimizer step (AdamW would still move the
                # weights through its moments on a zero gradient); the LR schedule and global_step advance.
                if self._dfx_skip:
                    return None
                return inner(*a, **k)

            optimizer.step = step  # type: ignore[method-assign]
            optimizer._dataflex_wrapped = True  # type: ignore[attr-defined]
        return optimizer

    # ------------------------------------------------------------------ step end
    def _dfx_maybe_end(self) -> None:
        if self._dfx_step is not None and self._step % self._dfx_micro == 0:
            self._dfx_end()

    def _dfx_end(self) -> None:
        step, batch = self._dfx_step, self._dfx_end_batch
        self._dfx_step = self._dfx_end_batch = None
        assert step is not None
        metrics = step.end(batch)
        # Cumulative counters are logged as they stand, the step's figures averaged over the logging window.
        cumulative = set(self.dataflex_kit.counters.metrics())
        for name, value in metrics.items():
            if name in cumulative:
                self._metrics["train"][name] = [value]
            else:
                self._metrics["train"][name].append(value)
        self.dataflex_metrics.append(metrics)

    # ------------------------------------------------------------------ checkpoints
    def dataflex_state_dict(self) -> dict[str, Any]:
        return {"format": STATE_FORMAT, "dataflex_bus": __version__, "global_step": self.state.global_step,
                "generation_batches": self._dfx_generations, "runtime": self.dataflex.state_dict(),
                "kit": self.dataflex_kit.state_dict(),
                "stream": self._dfx_stream.state_dict() if self._dfx_stream is not None else None}

    def load_dataflex_state(self, state: Mapping[str, Any], source: str = STATE_FILE) -> None:
        if not isinstance(state, Mapping) or state.get("format") != STATE_FORMAT:
            raise ConfigError(ConfigIssue("resume_from_checkpoint", f"{source} is not a dataflex TRL state (format "
                                          f"{state.get('format') if isinstance(state, Mapping) else None!r})"))
        self.dataflex.load_state_dict(state["runtime"])
        self.dataflex_kit.load_state_dict(state["kit"])
        if (state.get("stream") is None) != (self._dfx_stream is None):
            raise ConfigError(ConfigIssue("dataflex", "the checkpoint and this run disagree on whether the host draws "
                                          "its own prompts (prompt selection, mix, refill, history)"))
        if self._dfx_stream is not None:
            self._dfx_stream.load_state_dict(state["stream"])
        self._dfx_generations = int(state["generation_batches"])

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        # Before TRL's own files: a checkpoint whose trainer_state.json exists holds our state too.
        if self.args.should_save:
            name = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
            folder = os.path.join(self._get_output_dir(trial=trial), name)
            os.makedirs(folder, exist_ok=True)
            torch.save(self.dataflex_state_dict(), os.path.join(folder, STATE_FILE))
        super()._save_checkpoint(model, trial)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None:
            return
        path = os.path.join(checkpoint, STATE_FILE)
        if not os.path.exists(path):
            log.warning("dataflex: resumed TRL from %s, which holds no %s; the dataflex method starts fresh",
                        checkpoint, STATE_FILE)
            self._dfx_generations = self.state.global_step // self._dfx_span
            return
        self.load_dataflex_state(torch.load(path, weights_only=False), path)
        if self.state.global_step % self._dfx_span:
            log.warning("dataflex: resumed at step %d, inside a generation batch (%d optimizer steps each): TRL "
                        "generates that batch again, so the run is not the uninterrupted one (plain TRL's too)",
                        self.state.global_step, self._dfx_span)


def fit(t: Tensor, width: int) -> Tensor:
    """``t`` (``[K, W]``) cut or zero-padded to ``[K, width]``."""
    if t.size(1) >= width:
        return t[:, :width]
    return torch.cat([t, t.new_zeros(t.size(0), width - t.size(1))], dim=1)
