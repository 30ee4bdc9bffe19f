"""TRL 1.16's ``GRPOTrainer`` with the dataflex event bus wired into its generation batch.

:class:`DataflexGRPOTrainer` is TRL's host adapter: it moves rows between TRL's generation batch and
:class:`~dataflex_bus.Batch` and calls the host kit's step drivers (:mod:`dataflex_bus.steps`); one kit step
is one TRL generation batch (``steps_per_generation x num_iterations`` micro-steps, whole optimizer steps).
This module holds the set-up and TRL's methods the host overrides; each job lives in its own module:

* :mod:`~dataflex_bus.trl.passes`: ``_generate_and_score_completions`` runs the step's generation:
  ``Step.prompts`` (TRL's own prompts, or candidates drawn from the host's
  :class:`~dataflex_bus.trl.prompts.PromptStream` when a method selects prompts, mixes domains or refills),
  ``Generation`` rounds (each one call of TRL's own method on the round's prompts) with **on_rollout** at
  ``_calculate_rewards`` (TRL has gathered every process's rewards, so every process sees, and decides, the
  same), and TRL's method once more on the kept rows when a method may drop rows or refill.
* :mod:`~dataflex_bus.trl.batches`: the bus's batches built from TRL's rows.
* :mod:`~dataflex_bus.trl.update`: **on_advantage** (``Step.advantage``) carried out on TRL's batch.
* :mod:`~dataflex_bus.trl.loss`: weights and padding rows in ``_compute_loss``; no optimizer step for a
  generation batch left with nothing to train.
* **on_step_end** (``Step.end``): after the last optimizer step of the generation batch, before TRL logs and
  saves; a mixer's probabilities apply from the next generation batch on.
* :mod:`~dataflex_bus.trl.state`: ``checkpoint-N/dataflex_state.pt``, restored by ``resume_from_checkpoint``.

What the host cannot carry a block out on (TRL settings, the training dataset, environments) is refused by
the TRL host's description (:func:`~dataflex_bus.trl.host.describe`), at construction as in
``dataflex doctor --host trl``.
"""

from __future__ import annotations

import logging
import os
from collections import deque
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor
from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from trl import GRPOTrainer

from ..kit import ReplayRun, Runtime, StepKit, domain_labels, prepare_prompts
from . import loss, passes, replays, state
from .adapter import BatchState, RunSettings
from .arguments import argument, check_processing_class
from .batches import BatchMaker
from .block import load_block
from .host import describe, generation_span, round_unit
from .processes import Processes
from .prompts import PromptStream, prompt_table
from .records import Kept, Pass, RoundData
from .rows import Layout
from .sizes import longest_prompt, model_config, model_shape
from .skips import SkippedUpdates

log = logging.getLogger("dataflex_bus")

#: File written into every ``checkpoint-N`` folder (:mod:`~dataflex_bus.trl.state`).
STATE_FILE = state.STATE_FILE


class _StepEnd(TrainerCallback):
    """Ends the host kit's step after the last optimizer step of a generation batch (before TRL logs and
    saves, which run after every callback's ``on_step_end``), or after the last optimizer step of the run when
    training stops inside a generation batch (``max_steps``, a callback stopping it): that batch was generated
    and trained on, so its counts, history and metrics are kept and logged."""

    def __init__(self, trainer: DataflexGRPOTrainer) -> None:
        self.trainer = trainer

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        last = control.should_training_stop or (state.max_steps > 0 and state.global_step >= state.max_steps)
        self.trainer._dfx_maybe_end(last=bool(last))

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # A stop decided after this callback's on_step_end (TRL has logged that step): still counted and recorded.
        if self.trainer.dataflex_batch.step is not None:
            self.trainer._dfx_end()


class DataflexGRPOTrainer(SkippedUpdates, GRPOTrainer):
    """TRL's ``GRPOTrainer`` running a ``dataflex`` block (see the module doc). ``dataflex``: a block
    (mapping), a YAML file holding one, or ``None`` (plain TRL; the kit's metrics are still logged). Every
    other argument is ``GRPOTrainer``'s. The block is validated against the TRL host's description of
    ``args``, the training dataset and the environments before the model is prepared; what the host cannot
    run it under is refused naming the field."""

    def __init__(self, *args: Any, dataflex: Mapping[str, Any] | str | os.PathLike[str] | None = None,
                 **kwargs: Any) -> None:
        block = load_block(dataflex)
        check_processing_class(args, kwargs)
        config = argument(args, kwargs, "args")
        dataset = argument(args, kwargs, "train_dataset")
        environments = kwargs.get("environment_factory") is not None
        # What a rollout row holds (model shape, prompt length) bounds an allocator's budget at validation.
        shape = model_shape(model_config(argument(args, kwargs, "model")))
        prompt_tokens = longest_prompt(dataset, argument(args, kwargs, "processing_class"))

        def host(config: Any) -> Any:
            return describe(config, dataset=dataset, environments=environments, model=shape,
                            prompt_tokens=prompt_tokens)

        # Validate first when the config is given: errors before the model is wrapped and moved.
        runtime = Runtime(block, host=host(config)) if config is not None else None
        super().__init__(*args, **kwargs)
        self.dataflex = runtime if runtime is not None else Runtime(block, host=host(self.args))
        self.dataflex_kit = StepKit(self.dataflex)
        #: The kit's metrics of the last 10,000 finished generation batches (what is also logged).
        self.dataflex_metrics: deque[dict[str, float]] = deque(maxlen=10_000)
        self._dfx_setup()

    # ------------------------------------------------------------------ set-up
    def _dfx_setup(self) -> None:
        runtime = self.dataflex
        args: Any = self.args  # a GRPOConfig (typed as TrainingArguments by transformers)
        processes = Processes(self.accelerator)
        G = int(args.num_generations)
        span, accumulation = generation_span(args)
        dataset: Any = self.train_dataset
        labels = domain_labels(dataset, runtime.domain_key, required=bool(runtime.plan.samples_domains)) if hasattr(
            dataset, "column_names") else None
        sampler = prepare_prompts(runtime, lambda: prompt_table(labels, len(dataset)), labels=labels,
                                  seed=int(args.seed))
        replay = ReplayRun.of(runtime)
        if replay is not None and replay.buffer is not None:  # a restored row TRL could not train again is refused
            replay.buffer.store.object_check = replays.object_check(len(dataset), len(self.reward_funcs))
        domains = sampler.domains if sampler is not None else (
            runtime.configured_domains or (sorted(set(labels)) if labels is not None else None))
        row_domain = None
        if runtime.plan.needs_prompt_ids:
            assert runtime.prompt_table is not None
            position = {d: i for i, d in enumerate(runtime.prompt_table.domains)}
            row_domain = torch.tensor([position[x] for x in (labels or ["default"] * len(dataset))])
        stops = {*self.eos_token_ids, self._tokenizer.pad_token_id} if self.mask_truncated_completions else None
        stream = None
        if runtime.plan.draws_prompts:  # (what the host refuses over an IterableDataset)
            stream = PromptStream(len(dataset), shuffle=bool(self.shuffle_dataset), seed=int(args.seed),
                                  sampler=sampler)
        #: What is fixed for the run (adapter.py).
        self.dataflex_settings = RunSettings(
            processes=processes, group_size=G, steps_per_generation=int(args.steps_per_generation),
            span=max(span // accumulation, 1), micro=span, target=args.generation_batch_size // G,
            unit=round_unit(G, processes.count), ragged=bool(runtime.plan.allocates),
            collects=runtime.plan.regenerates,
            old_needed=args.gradient_accumulation_steps % span != 0 or bool(
                self.use_vllm and self.vllm_importance_sampling_correction),
            labels=labels, domains=domains,
            batches=BatchMaker(runtime, G, self._tokenizer.pad_token_id, None if stops is None else frozenset(stops),
                               self.reward_weights, row_domain, domains),
            stream=stream, dataset=dataset)
        #: Where the current generation batch stands (adapter.py).
        self.dataflex_batch = BatchState()
        self.add_callback(_StepEnd(self))

    # ------------------------------------------------------------------ the generation batch (passes.py)
    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        if not getattr(self.model, "training", False):
            return super()._generate_and_score_completions(inputs)
        if self.dataflex_batch.step is not None:  # a generation batch training stopped inside (max_steps, resume)
            self._dfx_end()
        return passes.generation_batch(self, inputs)

    def _dfx_trl_generation(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        """TRL's own ``_generate_and_score_completions`` (one pass)."""
        return super()._generate_and_score_completions(inputs)

    def _dfx_trl_logps(self, *args: Any, **kwargs: Any) -> Any:
        """TRL's own ``_get_per_token_logps_and_entropies``."""
        return super()._get_per_token_logps_and_entropies(*args, **kwargs)

    def _dfx_replay(self, rounds: list[RoundData], kept: Kept) -> tuple[dict[str, Any], Layout]:
        return passes.replay(self, rounds, kept)

    def _dfx_old_entropy(self) -> bool:
        """Whether TRL's old-policy pass should compute the entropy a method reads (it runs anyway)."""
        wanted = self.dataflex.fields("on_advantage") | self.dataflex.fields("on_step_end")
        return "entropy" in wanted and self.dataflex_settings.old_needed

    # ------------------------------------------------------------------ TRL's hook points inside a pass
    def _dfx_current_pass(self) -> Pass | None:
        """The pass TRL's method is running in; ``None`` outside one, and on a trainer made without ``__init__``
        (as TRL's own tests make one to call ``_generate``): plain TRL then."""
        state = self.__dict__.get("dataflex_batch")
        return None if state is None else state.current_pass

    def _generate(self, prompts: list[Any]) -> Any:
        p = self._dfx_current_pass()
        if p is None:
            return super()._generate(prompts)
        if p.kind == "replay":
            assert p.generated is not None
            return p.generated
        p.generated = super()._generate(prompts)
        return p.generated

    def _get_per_token_logps_and_entropies(self, model: Any, input_ids: Tensor, attention_mask: Tensor,
                                           logits_to_keep: int, *args: Any, **kwargs: Any) -> Any:
        p = self._dfx_current_pass()
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
        logps, entropies, aux = super()._get_per_token_logps_and_entropies(model, input_ids, attention_mask,
                                                                            logits_to_keep, *args, **kwargs)
        if entropies is not None and entropies.requires_grad and not getattr(self, "_entropy_bonus_enabled", True):
            # Without TRL's entropy bonus the entropies only feed metrics and the top-entropy mask, neither
            # differentiable: TRL 1.16's fused head still returns them attached, so their graph is let go here
            # (TRL's own test_entropy_bonus_flows_gradients asks for exactly this; gradients are unchanged).
            entropies = entropies.detach()
        return logps, entropies, aux

    def _calculate_rewards(self, inputs: list[dict[str, Any]], prompts: list[Any], completions: list[Any],
                           completion_ids_list: list[list[int]]) -> Tensor:
        p = self._dfx_current_pass()
        if p is None:
            return super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        if p.kind == "replay":
            assert p.rewards is not None
            self._pending_extra_logs.clear()
            self._pending_extra_logs.update(p.pending_logs)
            return p.rewards
        rewards = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        passes.rewarded(self, p, inputs, rewards)  # on_rollout (a collected round ends here)
        return rewards

    # ------------------------------------------------------------------ the update (loss.py)
    def _compute_loss(self, model: Any, inputs: dict[str, Any]) -> Tensor:
        return loss.compute_loss(super()._compute_loss, self.accelerator, model, inputs)

    def create_optimizer(self, *args: Any, **kwargs: Any) -> Any:
        return loss.skip_when(super().create_optimizer(*args, **kwargs), lambda: self.dataflex_batch.skip)

    # ------------------------------------------------------------------ step end
    def _dfx_maybe_end(self, last: bool = False) -> None:
        if self.dataflex_batch.step is not None and (last or self._step % self.dataflex_settings.micro == 0):
            self._dfx_end()

    def _dfx_end(self) -> None:
        step, batch = self.dataflex_batch.step, self.dataflex_batch.end_batch
        self.dataflex_batch.step = self.dataflex_batch.end_batch = None
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

    # ------------------------------------------------------------------ checkpoints (state.py)
    def dataflex_state_dict(self) -> dict[str, Any]:
        return state.state_dict(self)

    def load_dataflex_state(self, saved: dict[str, Any], source: str = STATE_FILE) -> None:
        state.load(self, saved, source)

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        # Before TRL's own files: a checkpoint whose trainer_state.json exists holds our state too.
        if self.args.should_save:
            name = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
            state.save(self, os.path.join(self._get_output_dir(trial=trial), name))
        super()._save_checkpoint(model, trial)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None:
            return
        state.resume(self, checkpoint)
        if self.state.global_step % self.dataflex_settings.span:
            log.warning("dataflex: resumed at step %d, inside a generation batch (%d optimizer steps each): TRL "
                        "generates that batch again, so the run is not the uninterrupted one (plain TRL's too)",
                        self.state.global_step, self.dataflex_settings.span)


