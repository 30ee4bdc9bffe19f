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

import json
import time
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from ..batch import Batch
from ..decision import (
    Decision,
    GroupFill,
    PromptCounts,
    PromptFill,
    carry_out_advantage,
    carry_out_prompts,
    carry_out_rollout,
    kept_groups,
    sampling_probabilities,
)
from ..errors import ConfigError, DataflexError
from ..ops import grpo_outcome_advantage
from ..runtime import Runtime
from .config import diff, fingerprint
from .files import CheckpointError
from .losses import low_var_kl, policy_loss, token_mean
from .policy import TinyPolicy, generate, pretrain, token_log_probs
from .prompt_ids import prompt_table
from .split import Split
from .tasks import Prompts, exact_match, vocab_size, zero_signal_fraction

FORMAT = "dataflex-shim-checkpoint/1"
_GENERATORS = ("init", "data", "rollout", "update", "pretrain")
#: Generators of the base policy, seeded by ``model.seed``; the others by ``trainer.seed``.
_BASE_GENERATORS = ("init", "pretrain")
#: Warm-started base policies of this process (policy state, pretrain generator state), by the sections
#: that determine them; a few at most (a compare of configs with different models).
_BASES: dict[str, tuple[dict[str, Tensor], Tensor]] = {}
_MAX_BASES = 4
#: Cumulative compute counters, saved with every checkpoint. ``generated_rollouts = trained_rows +
#: dropped_rows`` always; ``considered_prompts`` counts every candidate a prompt selection looked at.
COUNTERS = ("generated_rollouts", "generated_tokens", "trained_rows", "trained_tokens", "considered_prompts",
            "generated_groups", "trained_groups", "dropped_rows")


def _generator(seed: int, which: str) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 64 + _GENERATORS.index(which) + 1)


def _concat(batches: list[Batch], domains: list[str]) -> Batch:
    """The generation rounds of one step as one batch (the shim's rounds share every field's shape)."""
    if len(batches) == 1:
        return batches[0]
    fields = {name: torch.cat([b[name] for b in batches]) for name in batches[0].fields}
    # Dense group ids offset per round: rounds keep their groups apart and in arrival order (no padding).
    offsets = torch.cumsum(torch.tensor([0] + [b.num_groups for b in batches[:-1]]), 0).tolist()
    uid = torch.cat([b.group_index + off for b, off in zip(batches, offsets)])
    return Batch.from_tensors(uid=uid, domains=torch.cat([b.domain_index for b in batches]), domain_names=domains,
                              is_padding=torch.cat([b.is_padding for b in batches]), **fields)


def after_rollout(batch: Batch, decision: Decision) -> tuple[Batch, bool]:
    """The shim's side of an ``on_rollout`` decision: the rows to go on with, and whether to skip the
    update. Removal is physical, before any further compute, as the verl adapter's ``_balance_batch``."""
    action = carry_out_rollout(batch, decision)
    return (batch if action.keep is None else batch.select(action.keep)), action.skip_update


def after_advantage(batch: Batch, decision: Decision) -> tuple[Batch, bool]:
    """The shim's side of an ``on_advantage`` decision: the fields written (as verl writes them to
    TransferQueue), dropped rows removed (already fully masked; removal keeps mini-batches dense)."""
    action = carry_out_advantage(batch, decision)
    if action.fields:
        batch = batch.with_fields(**action.fields)
    if action.keep is not None:
        batch = batch.select(action.keep)
    return batch, action.skip_update


class ShimTrainer:
    """State of one run: policy, optimizer, generators, sampler position, counters and the runtime."""

    def __init__(self, resolved: Mapping[str, Any], runtime: Runtime, *, warm_start: bool = True) -> None:
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
        vocab = vocab_size(len(self.domains))
        self.policy = TinyPolicy(vocab, m["hidden"], m["layers"], self.gens["init"])
        if warm_start and m["pretrain_steps"]:
            self._warm_start(resolved)
        self.reference: TinyPolicy | None = None
        if t["kl_coef"] > 0:
            self.reference = TinyPolicy(vocab, m["hidden"], m["layers"], _generator(m["seed"], "init"))
            self.reference.load_state_dict(self.policy.state_dict())
            self.reference.requires_grad_(False)
        self.optimizer = torch.optim.Adam(self.policy.parameters(), lr=t["lr"])
        self.step = 0
        self.next_uid = 0
        self.skipped_updates = 0
        self.compute = dict.fromkeys(COUNTERS, 0)
        if runtime.mixes:
            runtime.set_domains(self.domains)
        if runtime.needs_prompt_ids:
            runtime.set_prompts(prompt_table(self.split))

    def _warm_start(self, resolved: Mapping[str, Any]) -> None:
        """The supervised warm start, or the same base policy from an earlier run of this process: it is a
        function of the model and data sections alone (``trainer.seed`` and the method vary the RL run),
        as runs that start from one pretrained checkpoint share it. ``dataflex compare`` pays it once."""
        m = resolved["model"]
        key = json.dumps([m, resolved["data"], self.domains], sort_keys=True, default=str)
        base = _BASES.get(key)
        if base is None:
            pretrain(self.policy, self.domains, self.split.draw, m["pretrain_steps"], self.gens["pretrain"],
                     batch=m["pretrain_batch"])
            base = _BASES[key] = ({k: v.clone() for k, v in self.policy.state_dict().items()},
                                  self.gens["pretrain"].get_state())
            while len(_BASES) > _MAX_BASES:
                del _BASES[next(iter(_BASES))]
        else:
            self.policy.load_state_dict(base[0])
            self.gens["pretrain"].set_state(base[1])  # as the warm start leaves it: checkpoints agree too

    # ------------------------------------------------------------------ sampling
    def domain_probabilities(self) -> Tensor:
        """Sampling probabilities over ``self.domains`` for the next prompts (uniform unless mixing)."""
        return sampling_probabilities(self.runtime.domain_probs, self.domains)

    def _draw(self, probs: Tensor, n_prompts: int) -> Prompts:
        domains = torch.multinomial(probs, n_prompts, replacement=True, generator=self.gens["data"])
        return self.split.draw(domains, self.gens["data"])

    def _prompts(self, probs: Tensor, n_prompts: int, step: int, counts: PromptCounts,
                 metrics: dict[str, float]) -> Prompts:
        """``n_prompts`` prompts to generate: drawn, or, when a method selects prompts, drawn in rounds of
        candidates through ``on_prompts`` until ``n_prompts`` are kept (:class:`PromptFill`)."""
        runtime = self.runtime
        if not runtime.selects_prompts:
            prompts = self._draw(probs, n_prompts)
            counts.considered += n_prompts
            counts.generated += n_prompts
            return prompts
        fill = PromptFill(n_prompts, max_oversample=runtime.max_oversample, on_empty=runtime.prompt_policy,
                          who="dataflex prompt selection")
        drawn: list[Prompts] = []
        while (n := fill.request()) > 0:
            candidates = self._draw(probs, n)
            batch = runtime.prompt_candidates(candidates.domains, self.split.train_rows(candidates), self.domains)
            decision = runtime.emit("on_prompts", batch, step)
            metrics.update(decision.metrics)
            fill.add(carry_out_prompts(batch, decision), batch)
            drawn.append(candidates)
        chosen = fill.chosen()
        counts += fill.counts
        return Prompts.cat(drawn).take(chosen)

    # ------------------------------------------------------------------ one step
    def _reward_metrics(self, batch: Batch, metrics: dict[str, float]) -> None:
        rewards = batch.rewards
        rows, means = batch.per_domain(rewards)
        metrics["reward/mean"] = float(rewards.double().mean())
        for name, count, mean in zip(self.domains, rows.tolist(), means.tolist()):
            if count:
                metrics[f"reward/{name}"] = mean
        learn = self.split.learnable[batch.domain_index]
        if bool(learn.any()):
            metrics["reward/learnable"] = float(rewards[learn].double().mean())
        metrics["response/length_mean"] = float(batch.lengths.double().mean())

    def _rollout(self, prompts: Prompts) -> Batch:
        """Generate ``group_size`` responses per prompt and score them: the on_rollout batch."""
        t, n = self.t, self.t["group_size"]
        uid = torch.arange(self.next_uid, self.next_uid + len(prompts.domains))
        self.next_uid += len(prompts.domains)
        rows = prompts.repeat(n)
        extra = {}
        if self.runtime.needs_prompt_ids:
            # One lookup per prompt, repeated like its rows (a group is contiguous).
            extra["prompt_index"] = self.runtime.prompt_table.lookup(  # type: ignore[union-attr]
                prompts.domains, self.split.train_rows(prompts)).repeat_interleave(n)
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

    def _generate(self, probs: Tensor, n_prompts: int, step: int, counts: PromptCounts,
                  metrics: dict[str, float]) -> tuple[Batch, Decision]:
        """One generation round: prompts -> rollouts -> history -> ``on_rollout``."""
        batch = self._rollout(self._prompts(probs, n_prompts, step, counts, metrics))
        self.compute["generated_rollouts"] += len(batch)
        self.compute["generated_tokens"] += int(batch.lengths.sum())
        self.compute["generated_groups"] += batch.num_groups
        for key, value in self.runtime.record_rollouts(batch, step).items():
            metrics[key] = metrics.get(key, 0.0) + value
        decision = self.runtime.emit("on_rollout", batch, step)
        metrics.update(decision.metrics)
        return batch, decision

    def _generate_step(self, probs: Tensor, step: int, metrics: dict[str, float]) -> tuple[Batch, Batch, bool]:
        """The step's generation: every row generated, the rows to go on with, and whether to skip the
        update. With ``dataflex.refill``, rounds until the on_rollout selection kept a full batch."""
        target = self.t["prompts_per_step"]
        counts = PromptCounts()
        refill = self.runtime.refill
        if refill is None:
            batch, decision = self._generate(probs, target, step, counts, metrics)
            kept, skip = after_rollout(batch, decision)
        else:
            fill = GroupFill(target, refill)
            rounds: list[Batch] = []
            while (n := fill.request()) > 0:
                batch, decision = self._generate(probs, n, step, counts, metrics)
                fill.add(kept_groups(batch, decision))
                rounds.append(batch)
            train, refill_metrics = fill.train()
            metrics.update(refill_metrics)
            batch = _concat(rounds, self.domains)
            # Shim uids grow with every prompt, so group order is arrival order across the rounds.
            decision = Decision()
            decision.keep = train[batch.group_index.clamp_min(0)] & batch.valid_rows
            kept, skip = after_rollout(batch, decision)
        self.compute["considered_prompts"] += counts.considered
        if self.runtime.selects_prompts:
            metrics.update(counts.metrics())
        return batch, kept, skip

    def _advantages(self, batch: Batch) -> Batch:
        """Old (and reference) log-probs and GRPO advantages: the on_advantage batch."""
        t = self.t
        with torch.no_grad():
            old_lp = token_log_probs(self.policy, batch["prompts"], batch["responses"], t["temperature"])
            extra = {}
            if self.reference is not None:
                extra["ref_log_prob"] = token_log_probs(self.reference, batch["prompts"], batch["responses"],
                                                        t["temperature"])
        mask = batch["response_mask"].to(torch.float32)
        adv = grpo_outcome_advantage(batch.rewards, batch.group_index, batch.num_groups)[:, None] * mask
        return batch.with_fields(old_log_probs=old_lp, advantages=adv, returns=adv,
                                 rollout_is_weights=torch.ones_like(mask), **extra)

    def train_step(self) -> dict[str, float]:
        """Run one GRPO step and return its metrics (deterministic given the trainer state, except the
        ``time/*`` wall times)."""
        step = self.step
        started = time.perf_counter()
        metrics: dict[str, float] = {"step": float(step)}
        every = self.t["eval_every"]
        if every and step == 0:
            metrics.update(self.evaluate())  # the base policy, before any update
        probs = self.domain_probabilities()
        for name, p in zip(self.domains, probs.tolist()):
            metrics[f"data/prob/{name}"] = p

        generated, batch, skip = self._generate_step(probs, step, metrics)
        metrics["time/generate_s"] = time.perf_counter() - started
        self._reward_metrics(generated, metrics)
        metrics["data/zero_signal_groups"] = zero_signal_fraction(generated.rewards, generated.group_index,
                                                                  generated.num_groups)
        rolled = len(generated)

        tick = time.perf_counter()
        batch = self._advantages(batch)
        metrics["time/logprob_s"] = time.perf_counter() - tick

        decision = self.runtime.emit("on_advantage", batch, step)
        metrics.update(decision.metrics)
        batch, skipped = after_advantage(batch, decision)
        skip = skip or skipped

        trained = 0 if skip else len(batch)
        metrics["train/kept_fraction"] = trained / rolled if rolled else 0.0
        metrics["train/skipped_update"] = float(skip or trained == 0)
        tick = time.perf_counter()
        if skip or trained == 0:
            self.skipped_updates += 1
        else:
            metrics.update(self._update(batch))
            self.compute["trained_rows"] += trained
            self.compute["trained_tokens"] += int(batch["loss_mask"].sum())
            self.compute["trained_groups"] += batch.num_groups
        self.compute["dropped_rows"] += rolled - trained
        metrics["time/update_s"] = time.perf_counter() - tick
        metrics["train/skipped_updates"] = float(self.skipped_updates)

        decision = self.runtime.emit("on_step_end", batch, step)
        metrics.update(decision.metrics)
        self.step += 1
        if every and self.step % every == 0 and step > 0:
            metrics.update(self.evaluate())
        metrics.update(self.compute_metrics())
        metrics["time/step_s"] = time.perf_counter() - started
        return metrics

    def compute_metrics(self) -> dict[str, float]:
        """The cumulative counters and the modelled cost (generation weighted as in LLM RL)."""
        out = {f"compute/{k}": float(v) for k, v in self.compute.items()}
        out["compute/modelled_cost"] = (self.t["generation_cost"] * self.compute["generated_tokens"]
                                        + self.compute["trained_tokens"])
        return out

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
            "sampler": {"next_uid": self.next_uid},
            "counters": {"skipped_updates": self.skipped_updates, **self.compute},
            "runtime": self.runtime.state_dict(),
        }

    def load_state_dict(self, state: Mapping[str, Any], source: str = "checkpoint") -> None:
        if not isinstance(state, Mapping) or state.get("format") != FORMAT:
            found = state.get("format") if isinstance(state, Mapping) else type(state).__name__
            raise CheckpointError(f"{source}: not a dataflex shim checkpoint (format {found!r}, "
                                  f"expected {FORMAT!r})")
        mismatch = diff(state.get("fingerprint"), fingerprint(self.config))
        if mismatch:
            raise CheckpointError(f"{source} was written by a different config; refusing to resume:\n"
                                  + "\n".join(f"  - {m}" for m in mismatch)
                                  + "\nstart a fresh run (--force) or resume with the original config")
        for entry, kind in _ENTRIES.items():
            value = state.get(entry)
            if not isinstance(value, kind) or isinstance(value, bool):
                raise CheckpointError(f"{source}: entry {entry!r} holds {type(value).__name__} {_short(value)}, not "
                                      f"{_KIND_NAMES[kind]}; the checkpoint is damaged, start a fresh run (--force)")
        try:
            self.policy.load_state_dict(state["policy"])
            if self.reference is not None:
                self.reference.load_state_dict(state["reference"])
            self.optimizer.load_state_dict(state["optimizer"])
            for name, g in self.gens.items():
                g.set_state(state["rng"][name])
            self.next_uid = int(state["sampler"]["next_uid"])
            counters = state["counters"]
            self.skipped_updates = int(counters["skipped_updates"])
            self.compute = {k: int(counters[k]) for k in COUNTERS}
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
_ENTRIES: dict[str, type] = {"step": int, "policy": Mapping, "optimizer": Mapping, "rng": Mapping,
                             "sampler": Mapping, "counters": Mapping, "runtime": Mapping}
_KIND_NAMES = {int: "an integer", Mapping: "a mapping"}


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
