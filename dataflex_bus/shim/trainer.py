"""An in-process GRPO trainer that emits the dataflex bus events in verl v1's ``_step_once`` order.

One step: draw prompts (by the mixer's domain probabilities when a method mixes; through ``on_prompts``
when a method selects prompts before generation, drawing more candidates until enough are kept) -> roll out
``group_size`` responses per prompt -> binary exact-match reward (``rm_scores`` on the last valid token)
-> ``on_rollout`` (whole groups may be removed before any further compute) -> old log-probs -> reference
log-probs (when ``kl_coef > 0``) -> GRPO advantages -> ``on_advantage`` (weights multiplied into
``rollout_is_weights``, rows dropped, advantages replaced) -> PPO update (clipped loss x
``rollout_is_weights``, token-mean over ``loss_mask``) -> ``on_step_end`` (mixers update) -> metrics. The
decisions are carried out by :mod:`dataflex_bus.decision`, exactly as the verl adapter does, and the
batch carries verl's field names, so a plugin sees the same data here as inside verl. With
``dataflex.refill`` the draw -> generate -> ``on_rollout`` part repeats in rounds until the selection has
kept a full batch of groups (dynamic sampling, :class:`~dataflex_bus.decision.GroupFill`); every round's
rollouts are counted.

Everything random comes from generators this module owns, so a run is a function of its config and
seed, and a resumed run continues bit for bit.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from ..kit import (
    AdvantageAction,
    Batch,
    Candidates,
    Chosen,
    ConfigError,
    DataflexError,
    ReplayPart,
    Runtime,
    Step,
    StepKit,
    concat_rounds,
    group_labels,
    grpo_outcome_advantage,
    prepare_prompts,
)
from ..kit import differences as diff
from . import warmstart
from .config import fingerprint
from .files import CheckpointError
from .losses import low_var_kl, policy_loss, token_mean
from .policy import TinyPolicy, generate, token_log_probs, token_log_probs_and_entropy
from .pool import TrainingSampler
from .prompt_ids import prompt_table
from .split import Split
from .tasks import PAD, Prompts, exact_match, vocab_size

FORMAT = "dataflex-shim-checkpoint/1"
_GENERATORS = ("init", "data", "rollout", "update", "pretrain")
#: Generators of the base policy, seeded by ``model.seed``; the others by ``trainer.seed``.
_BASE_GENERATORS = ("init", "pretrain")
def _generator(seed: int, which: str) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 64 + _GENERATORS.index(which) + 1)


def _prompt_tokens(batch: Batch) -> int:
    """The prompt tokens of a rollout batch's rows: each row's prompt without its left padding."""
    return int(batch["prompts"].ne(PAD).sum())


def apply_advantage(batch: Batch, action: AdvantageAction) -> tuple[Batch, bool]:
    """The shim's side of an ``on_advantage`` decision: the fields written (as verl writes them to
    TransferQueue), dropped rows removed (already fully masked; removal keeps mini-batches dense)."""
    if action.fields:
        batch = batch.with_fields(**action.fields)
    if action.keep is not None:
        batch = batch.select(action.keep)
    return batch, action.skip_update


class ShimTrainer:
    """State of one run: policy, optimizer, generators, sampler position, counters and the runtime."""

    def __init__(self, resolved: Mapping[str, Any], runtime: Runtime, *, warm_start: bool = True,
                 progress: bool = False) -> None:
        self.config = resolved
        self.runtime = runtime
        t, m = resolved["trainer"], resolved["model"]
        self.t = t
        self.domains: list[str] = list(resolved["data"]["domains"])
        seed = t["seed"]
        self.gens = {name: _generator(m["seed"] if name in _BASE_GENERATORS else seed, name)
                     for name in _GENERATORS}
        # Built even without evaluation: a run trains on the same prompts whether or not it evaluates.
        self.split = Split(self.domains, resolved["data"]["seed"], resolved["data"]["heldout"])
        self.sampler = TrainingSampler(self.split, resolved["data"])
        vocab = vocab_size(len(self.domains))
        self.policy = TinyPolicy(vocab, m["hidden"], m["layers"], self.gens["init"])
        if warm_start and m["pretrain_steps"]:
            # From this process's memory, the disk cache, or pretraining (then cached): see warmstart.py.
            warmstart.warm_start(self.policy, self.gens["pretrain"], self.split, resolved, self.domains,
                                 progress=progress)
        self.reference: TinyPolicy | None = None
        if t["kl_coef"] > 0:
            self.reference = TinyPolicy(vocab, m["hidden"], m["layers"], _generator(m["seed"], "init"))
            self.reference.load_state_dict(self.policy.state_dict())
            self.reference.requires_grad_(False)
        self.optimizer = torch.optim.Adam(self.policy.parameters(), lr=t["lr"])
        self.step = 0
        self.next_uid = 0
        self.kit = StepKit(runtime)
        prepare_prompts(runtime, lambda: prompt_table(self.split), domains=self.domains)

    # ------------------------------------------------------------------ sampling
    def _candidates(self, probs: Tensor, n: int) -> Candidates[Prompts]:
        """``n`` prompts drawn by the domain probabilities, with their prompt ids when a method needs them."""
        domains = torch.multinomial(probs, n, replacement=True, generator=self.gens["data"])
        prompts = self.sampler.draw(domains, self.gens["data"])
        if not self.runtime.plan.needs_prompt_ids:
            return Candidates(prompts)
        return Candidates(prompts, prompts.domains, self.split.train_rows(prompts))

    @staticmethod
    def _join(chosen: Chosen[Prompts]) -> Prompts:
        """The chosen candidates of a step's draws, in draw order."""
        return chosen.only or Prompts.cat(chosen.draws).take(chosen.index)

    @staticmethod
    def _take(prompts: Prompts, index: Tensor) -> Prompts:
        """The prompts at ``index`` of a step's chosen prompts (a continuation's)."""
        return prompts.take(index)

    # ------------------------------------------------------------------ one step
    def _rollout(self, prompts: Prompts, counts: Tensor | None = None, uid: Tensor | None = None) -> Batch:
        """Generate ``group_size`` responses per prompt (``counts``: that many of each, an allocation's) and score
        them: the on_rollout batch. ``uid``: the groups' ids (a continuation's), else new ones."""
        t = self.t
        n = torch.full((len(prompts.domains),), t["group_size"]) if counts is None else counts
        if uid is None:
            uid = torch.arange(self.next_uid, self.next_uid + len(prompts.domains))
            self.next_uid += len(prompts.domains)
        rows = prompts.repeat(n)
        extra = {}
        if self.runtime.plan.needs_prompt_ids:
            # One lookup per prompt, repeated like its rows (a group is contiguous).
            extra["prompt_index"] = self.runtime.prompt_index(prompts.domains,
                                                              self.split.train_rows(prompts)).repeat_interleave(n)
        self.policy.eval()
        responses, response_mask, rollout_lp = generate(self.policy, rows.tokens, t["temperature"],
                                                        self.gens["rollout"])
        reward = exact_match(responses, response_mask, rows.targets)
        lengths = response_mask.sum(-1)
        # rm_scores: the outcome reward on the last valid token, as verl writes it
        rm_scores = torch.zeros(response_mask.shape, dtype=torch.float32)
        rm_scores.scatter_(1, (lengths - 1).clamp_min(0)[:, None], reward[:, None])
        return Batch.from_tensors(uid=uid.repeat_interleave(n), domains=rows.domains, domain_names=self.domains,
                                  is_padding=torch.zeros(len(rows.tokens), dtype=torch.bool),
                                  prompts=rows.tokens, responses=responses, response_mask=response_mask,
                                  loss_mask=response_mask.clone(), rm_scores=rm_scores,
                                  rollout_log_probs=rollout_lp, **extra)

    def _generate_step(self, step: Step, probs: Tensor) -> tuple[Batch, Batch, bool]:
        """The step's generation through the host kit: every row generated, the rows to go on with, and
        whether to skip the update. With ``dataflex.refill``, rounds until the on_rollout selection kept a
        full batch."""
        # A replay method may fill part of the step from its buffer (DOTS's fresh share): fewer prompts generated.
        replay = ReplayPart.of(step)
        target = self.t["prompts_per_step"]
        gen = step.generation(replay.fresh_prompts(target) if replay is not None else target)
        rounds: list[Batch] = []
        while (n := gen.request()) > 0:
            chosen = step.prompts(n, lambda k: self._candidates(probs, k))
            prompts = self._join(chosen)
            batch = self._rollout(prompts, chosen.counts)
            gen.add(batch, prompt_tokens=_prompt_tokens(batch))
            while (more := gen.continuation()) is not None:  # more rollouts for some groups (SPEED)
                # The host's batch holds each prompt's rows in a block: a first row names its prompt and uid.
                sizes = chosen.counts if chosen.counts is not None else torch.full((len(chosen.index),),
                                                                                    self.t["group_size"])
                prompt = torch.searchsorted(torch.cumsum(sizes, 0), more.rows, right=True)
                uid = group_labels(batch)
                assert isinstance(uid, Tensor)
                extra = self._rollout(self._take(prompts, prompt), more.counts, uid[more.rows])
                gen.extend(extra, prompt_tokens=_prompt_tokens(extra))
        outcome = gen.finish()
        # Shim uids grow with every prompt, so group order is arrival order across the rounds.
        rounds = gen.batches
        generated = concat_rounds(rounds)
        keep = outcome.keep([len(b) for b in rounds])
        return generated, (generated if keep is None else generated.select(keep)), outcome.skip_update

    def _advantages(self, batch: Batch) -> Batch:
        """Old (and reference) log-probs, the old policy's entropy when asked for, and GRPO advantages: the
        on_advantage batch."""
        t = self.t
        wanted = self.runtime.fields("on_advantage") | self.runtime.fields("on_step_end")
        with torch.no_grad():
            extra = {}
            if "entropy" in wanted:
                old_lp, extra["entropy"] = token_log_probs_and_entropy(self.policy, batch["prompts"],
                                                                       batch["responses"], t["temperature"])
            else:
                old_lp = token_log_probs(self.policy, batch["prompts"], batch["responses"], t["temperature"])
            if self.reference is not None:
                extra["ref_log_prob"] = token_log_probs(self.reference, batch["prompts"], batch["responses"],
                                                        t["temperature"])
        mask = batch["response_mask"].to(torch.float32)
        adv = grpo_outcome_advantage(batch.rewards, batch.group_index, batch.num_groups)[:, None] * mask
        return batch.with_fields(old_log_probs=old_lp, advantages=adv, returns=adv,
                                 rollout_is_weights=torch.ones_like(mask), **extra)

    def _learnable_reward(self, batch: Batch, metrics: dict[str, float]) -> None:
        """The testbed's own reading of the rollouts: mean reward on the learnable domains."""
        learn = self.split.learnable[batch.domain_index]
        if bool(learn.any()):
            metrics["reward/learnable"] = float(batch.rewards[learn].double().mean())

    def train_step(self) -> dict[str, float]:
        """Run one GRPO step and return its metrics (deterministic given the trainer state, except the
        ``time/*`` wall times)."""
        index = self.step
        started = time.perf_counter()
        metrics: dict[str, float] = {"step": float(index)}
        every = self.t["eval_every"]
        if every and index == 0:
            metrics.update(self.evaluate())  # the base policy, before any update
        step = self.kit.begin(index)
        probs = step.domain_probabilities(self.domains)

        generated, batch, skip = self._generate_step(step, probs)
        metrics["time/generate_s"] = time.perf_counter() - started
        self._learnable_reward(generated, metrics)
        if not skip:
            # Stored rows of past steps join before the old log-probs, which are computed for them too.
            replay = ReplayPart.of(step)
            replayed = replay.replay(batch) if replay is not None else None
            if replayed is not None:
                batch = replayed.append_to(batch)

        tick = time.perf_counter()
        batch = self._advantages(batch)
        metrics["time/logprob_s"] = time.perf_counter() - tick

        action = step.advantage(batch)
        if (replay := ReplayPart.of(step)) is not None:
            replay.store()  # the rows the replay method marked (their fields are all in this batch)
        generated = batch if action.keep is None else batch.select(action.keep)
        batch, skipped = apply_advantage(batch, action)
        skip = skip or skipped or len(batch) == 0
        tick = time.perf_counter()
        if skip:
            step.skipped()
        else:
            metrics.update(self._update(batch))
            step.trained_batch(batch, generated=generated)
        metrics["time/update_s"] = time.perf_counter() - tick

        metrics.update(step.end(batch))
        self.step += 1
        # ... and at the last step, so a run shorter than eval_every (or not a multiple of it) ends evaluated.
        if every and index > 0 and (self.step % every == 0 or self.step == self.t["steps"]):
            metrics.update(self.evaluate())
        metrics.update(self.compute_metrics())
        metrics.update(self.sampler.metrics())
        metrics["time/step_s"] = time.perf_counter() - started
        return metrics

    def compute_metrics(self) -> dict[str, float]:
        """The modelled cost of the run so far (generation weighted as in LLM RL), from the kit's counters: the
        response tokens generated (decoding; the prompt's prefill is not modelled) and every token each of the
        ``ppo_epochs`` passes trains on."""
        counters = self.kit.counters
        return {"compute/modelled_cost": (self.t["generation_cost"] * counters["generated_response_tokens"]
                                          + self.t["ppo_epochs"] * counters["trained_tokens"])}

    def _update(self, batch: Batch) -> dict[str, float]:
        t = self.t
        self.policy.train()
        prompts, responses = batch["prompts"], batch["responses"]
        old_lp, adv, weights = batch["old_log_probs"], batch["advantages"], batch["rollout_is_weights"]
        response_mask, loss_mask = batch["response_mask"], batch["loss_mask"]
        ref = batch.get("ref_log_prob")
        rows = len(batch)
        sums = {"pg_loss": 0.0, "kl_loss": 0.0, "clip_frac": 0.0, "ppo_kl": 0.0, "grad_norm": 0.0}
        updates = 0
        for _ in range(t["ppo_epochs"]):
            order = (torch.randperm(rows, generator=self.gens["update"]) if t["mini_batches"] > 1
                     else torch.arange(rows))
            for idx in torch.tensor_split(order, min(t["mini_batches"], rows)):
                num_tokens = loss_mask[idx].sum()
                if int(num_tokens) == 0:
                    continue
                logp = token_log_probs(self.policy, prompts[idx], responses[idx], t["temperature"])
                loss, info = policy_loss(logp, old_lp[idx], adv[idx], response_mask[idx],
                                         clip_ratio=t["clip_ratio"], clip_ratio_c=t["clip_ratio_c"],
                                         rollout_is_weights=weights[idx], num_tokens=num_tokens)
                sums["pg_loss"] += float(loss.detach())
                if ref is not None:
                    kl = token_mean(low_var_kl(logp, ref[idx]), response_mask[idx].to(torch.bool), num_tokens)
                    loss = loss + t["kl_coef"] * kl
                    sums["kl_loss"] += float(kl.detach())
                self.optimizer.zero_grad(set_to_none=True)
                loss.backward()
                norm = torch.nn.utils.clip_grad_norm_(self.policy.parameters(), t["max_grad_norm"])
                if not bool(torch.isfinite(norm)):
                    raise DataflexError(f"non-finite gradient at step {self.step}: check the advantages "
                                        "and rollout_is_weights the method produced")
                self.optimizer.step()
                sums["grad_norm"] += float(norm)
                sums["clip_frac"] += info["clip_frac"]
                sums["ppo_kl"] += info["ppo_kl"]
                updates += 1
        out = {f"train/{k}": v / max(updates, 1) for k, v in sums.items()}
        if ref is None:
            del out["train/kl_loss"]
        out["train/optimizer_steps"] = float(updates)
        return out

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Exact greedy accuracy on every held-out prompt (``eval/heldout/...``)."""
        return self.split.evaluate(self.policy)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "fingerprint": fingerprint(self.config),
            "step": self.step,
            "policy": self.policy.state_dict(),
            "reference": None if self.reference is None else self.reference.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "rng": {name: g.get_state() for name, g in self.gens.items()},
            "sampler": {"next_uid": self.next_uid, **({"pool": pool} if (pool := self.sampler.state_dict()) else {})},
            "counters": self.kit.state_dict(),
            "runtime": self.runtime.state_dict(),
        }

    def load_state_dict(self, state: Mapping[str, Any], source: str = "checkpoint") -> None:
        if not isinstance(state, Mapping) or state.get("format") != FORMAT:
            found = state.get("format") if isinstance(state, Mapping) else type(state).__name__
            raise CheckpointError(f"{source}: not a dataflex shim checkpoint (format {found!r}, "
                                  f"expected {FORMAT!r})")
        # The entries first: a missing fingerprint is damage, not a config that differs in every key.
        for entry, kind in _ENTRIES.items():
            value = state.get(entry)
            if not isinstance(value, kind) or isinstance(value, bool):
                raise CheckpointError(f"{source}: entry {entry!r} holds {type(value).__name__} {_short(value)}, not "
                                      f"{_KIND_NAMES[kind]}; the checkpoint is damaged, start a fresh run (--force)")
        if state["step"] < 0:
            raise CheckpointError(f"{source}: entry 'step' holds {state['step']}, not a step count (0 or more); the "
                                  "checkpoint is damaged, start a fresh run (--force)")
        mismatch = diff(state["fingerprint"], fingerprint(self.config))
        if mismatch:
            raise CheckpointError(f"{source} was written by a different config; refusing to resume:\n"
                                  + "\n".join(f"  - {m}" for m in mismatch)
                                  + "\nstart a fresh run (--force) or resume with the original config")
        try:
            self.policy.load_state_dict(state["policy"])
            if self.reference is not None:
                self.reference.load_state_dict(state["reference"])
            self.optimizer.load_state_dict(state["optimizer"])
            for name, g in self.gens.items():
                g.set_state(state["rng"][name])
            self.next_uid = int(state["sampler"]["next_uid"])
            if self.sampler.pool:
                self.sampler.load_state_dict(state["sampler"]["pool"])
            self.kit.load_state_dict(state["counters"])
            self.step = int(state["step"])
        except (KeyError, TypeError, RuntimeError, ValueError, AttributeError, IndexError) as exc:
            raise CheckpointError(f"{source} is damaged ({type(exc).__name__}: {exc}); start a fresh "
                                  "run (--force)") from exc
        try:
            self.runtime.load_state_dict(state["runtime"])
        except ConfigError as exc:
            raise CheckpointError(f"{source}: the dataflex state does not fit this config: {exc}") from exc
        except Exception as exc:  # a plugin's load_state_dict meeting a state it cannot take
            raise CheckpointError(f"{source}: entry 'runtime': cannot restore the plugins' state "
                                  f"({type(exc).__name__}: {exc})") from exc


#: Entries of a checkpoint and their types, checked before anything is restored (so a damaged one is
#: named, not met as an AttributeError deep in a plugin).
_ENTRIES: dict[str, type] = {"fingerprint": Mapping, "step": int, "policy": Mapping, "optimizer": Mapping,
                             "rng": Mapping, "sampler": Mapping, "counters": Mapping, "runtime": Mapping}
_KIND_NAMES = {int: "an integer", Mapping: "a mapping"}


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
