"""Replay of past rollouts (mechanism ``replay``): the buffer the host kit keeps and what a step replays.

A rollout, once generated, can train more than one update. Two pieces make that the same on every host:

* :class:`~dataflex_bus.replay_store.ReplayStore` (:mod:`dataflex_bus.replay_store`, importable from here
  too): the bounded, tensor-backed store of past rows, saved with the runtime's state together with the
  prompt table's fingerprint, so a resume on another dataset is refused (as the prompt history is) and a
  resumed run replays exactly what the uninterrupted one would; a restored state is checked as new rows are.
* :class:`Replay`: one run's replay (the replayer of the block's replay method, its store, the host): per step
  it evicts stale and duplicate records, plans how many stored groups replace fresh ones (:meth:`Replay.plan`),
  picks the rows a step replays (:meth:`Replay.retrieve`, before the old log-probs; the returned
  :class:`Replayed` says which group each row trains in, per the advantage mode), stores what the method
  marked at ``on_advantage`` (:meth:`Replay.insert`) and computes the off-policy correction of the replayed
  rows (:meth:`Replay.correct`).

Replay plugs into the host kit through its parts (:mod:`dataflex_bus.step_parts`): :class:`ReplayRun` holds the
run's :class:`Replay` (saved under ``replay``), :class:`ReplayPart` one step's: the host asks
``ReplayPart.of(step)`` how many prompts to generate (:meth:`ReplayPart.fresh_prompts`), for the stored rows the
step trains again (:meth:`ReplayPart.replay`) and hands it the rows marked at ``on_advantage``
(:meth:`ReplayPart.store`); the step's ``on_advantage`` batch gets each row's version and the replayed rows their
correction through the part's hooks. A host only moves tensors.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, cast

import torch
from torch import Tensor

from .batch import Batch
from .errors import BatchFieldError, ConfigError, ConfigIssue, DataflexError
from .mechanisms.replay import VERSION_FIELD, ReplayPick, ReplayPool, ReplaySettings
from .ops import segment_count, segment_max, segment_min
from .packed import rows_of
from .replay_store import Record, ReplayStore, pad_to, preallocated_bytes, take_rows
from .step_parts import RunPart, StepPart

if TYPE_CHECKING:
    from .carry import AdvantageAction
    from .decision import Decision, ReplayDecision
    from .history import PromptTable
    from .host import HostDescription
    from .mechanisms.replay import Replayer
    from .method import Method
    from .runtime import Runtime
    from .steps import Step

#: Bound on ``|log pi_old - log mu|`` before exponentiating (verl's ``SAFETY_BOUND`` in rollout correction).
LOG_RATIO_BOUND = 20.0


# ---------------------------------------------------------------------------- a step's replay
@dataclass
class Replayed:
    """The stored rows a step trains on again, in training order: their ``record`` and the group each trains
    in: ``join[i]`` is the fresh group (index into the fresh batch's groups) row ``i`` joins (``mixed``), else
    -1 and ``block[i]`` (0, 1, ...) numbers the new groups the other replayed rows form. ``weights``: per-row
    importance weights of a non-uniform pick (``None``: none)."""

    record: Record
    join: Tensor
    block: Tensor
    weights: Tensor | None = None

    def __len__(self) -> int:
        return len(self.record)

    @property
    def num_blocks(self) -> int:
        return int(self.block.max()) + 1 if bool((self.block >= 0).any()) else 0

    def group_ids(self, fresh_groups: int) -> Tensor:
        """Long ``[m]``: each replayed row's group among a batch whose first ``fresh_groups`` groups are the fresh
        ones (joined rows take their fresh group, the new groups follow)."""
        return torch.where(self.join >= 0, self.join, fresh_groups + self.block)

    def append_to(self, fresh: Batch) -> Batch:
        """``fresh`` with the replayed rows appended (a host whose batch holds the payload fields, the shim):
        groups per :meth:`group_ids`, ``rollout_log_probs`` the stored ``mu``, ``prompt_index``, domains, and
        ``replay_row`` (the row's index in this replay, -1 on fresh rows) on every row."""
        rec = self.record
        m, n = len(rec), len(fresh)
        fields = {}
        for name in fresh.fields:
            value = fresh[name]  # a jagged field's dense view
            if name == "rollout_log_probs":
                fields[name] = torch.cat([value, pad_to(rec.mu, value.shape[1])[:, :value.shape[1]].to(value.dtype)])
            elif name == "prompt_index":
                fields[name] = torch.cat([value, rec.prompt.to(value.dtype)])
            elif name in rec.payload:
                stored = rec.payload[name]
                if stored.shape[1:] != value.shape[1:]:
                    raise BatchFieldError("dataflex replay", name, f"stored rows are {tuple(stored.shape[1:])} wide, "
                                          f"this step's {tuple(value.shape[1:])}: the host must keep the field's width")
                fields[name] = torch.cat([value, stored.to(value.dtype)])
            else:
                raise BatchFieldError("dataflex replay", name, "this step's rows hold a field the stored rows lack")
        fields["replay_row"] = torch.cat([torch.full((n,), -1, dtype=torch.long), torch.arange(m)])
        groups = torch.cat([fresh.group_index, self.group_ids(fresh.num_groups)])
        domains = None
        if fresh.domain_ids is not None:
            domains = torch.cat([fresh.domain_index.clamp_min(0), rec.domain.clamp_min(0)])
        return Batch.from_tensors(uid=groups, domains=domains, domain_names=fresh.domain_names or None,
                                  is_padding=torch.cat([fresh.is_padding, torch.zeros(m, dtype=torch.bool)]),
                                  **fields).with_reward_span(fresh.reward_span)


class Replay:
    """One run's replay: the block's replay method (its replayer's :class:`ReplaySettings`), the store over
    the host's prompt table and what the host itself corrects (see the module doc)."""

    def __init__(self, method: Any, table: PromptTable, host: HostDescription) -> None:
        self.method = method
        replayer: Replayer = method.actuator
        self.replayer = replayer
        self.settings: ReplaySettings = replayer.settings()
        s = self.settings
        self.store = ReplayStore(table, s.capacity, per_prompt=s.per_prompt)
        #: The host weights every row by min(pi_old / rollout_log_probs, threshold) itself (verl's
        #: rollout_correction.rollout_is=token, checked to be is_cap by the host's rules).
        self.host_weights = getattr(host, "rollout_is", None) == "token"
        self.payload_fields: tuple[str, ...] | None = None
        self._maintained = -1
        self.warned_nonfinite = 0

    # ------------------------------------------------------------------ before generation
    def maintain(self, step: int) -> dict[str, float]:
        """Once per step, before anything is planned or picked: stale records and older copies of a prompt
        (``dedup``) leave the store."""
        if self._maintained == step:
            return {}
        self._maintained = step
        s = self.settings
        out = {"dataflex/replay/evicted_stale": float(self.store.evict_stale(step, s.max_age_steps))}
        if s.dedup:
            out["dataflex/replay/evicted_duplicates"] = float(self.store.dedup())
        return out

    def plan(self, step: int, target: int) -> int:
        """Unit ``group``: the stored groups that replace fresh ones in a step of ``target`` groups (0 for unit
        ``prompt``, whose replayed rows are added to the step's own prompts)."""
        if self.settings.unit != "group":
            return 0
        available = self.store.num_groups
        planned = int(self.replayer.replay_groups(target, available, step))
        if not 0 <= planned <= min(available, target):
            raise BatchFieldError(self.replayer.who, "replay_groups", f"planned {planned} groups of {available} stored "
                                  f"for a step of {target}")
        return planned

    # ------------------------------------------------------------------ before the old log-probs
    def retrieve(self, step: int, fresh: Batch, planned: int) -> tuple[Replayed | None, dict[str, float]]:
        """The stored rows the step ``step`` trains on again, given its ``fresh`` rows (after the on_rollout
        carry-out, with ``prompt_index``) and the groups :meth:`plan` planned."""
        self.payload_fields = tuple(n for n in fresh.fields if n not in ("rollout_log_probs", "prompt_index"))
        metrics = {"dataflex/replay/stored_rows": float(len(self.store))}
        pool, slots, request = self._pool(step, fresh, planned)
        picked = None
        if pool is not None:
            pick = self.method.call("actuator", self.replayer.pick, pool, step)
            picked = self._checked(pick, pool)
            metrics.update({f"dataflex/replay/{k}": float(v) for k, v in pick.metrics.items()})
        if picked is None or picked[0].numel() == 0:
            metrics.update({"dataflex/replay/rows": 0.0, "dataflex/replay/groups": 0.0, "dataflex/replay/empty": 1.0})
            return None, metrics
        rows, weights = picked
        record = self.store.gather(slots[rows])
        join, block = self._groups(record, fresh, request[rows] if request is not None else None)
        singleton = self._singletons(join, block)
        if bool(singleton.any()):
            # A new group of one row has advantage 0 under GRPO (RePO: R = 1 gives A_off = 0): it would train
            # nothing and only add its tokens to token-mean denominators, so it is not replayed.
            metrics["dataflex/replay/singletons"] = float(singleton.sum())
            keep = torch.nonzero(~singleton).flatten()
            record = take_rows(record, keep)
            join, weights = join[keep], None if weights is None else weights[keep]
            block = torch.unique(block[keep], return_inverse=True)[1] if keep.numel() else block[keep]
            block = torch.where(join >= 0, -1, block)
        if len(record) == 0:
            metrics.update({"dataflex/replay/rows": 0.0, "dataflex/replay/groups": 0.0, "dataflex/replay/empty": 1.0})
            return None, metrics
        out = Replayed(record, join, block, weights)
        age = (step - record.version).to(torch.float64)
        metrics.update({"dataflex/replay/rows": float(len(record)), "dataflex/replay/empty": 0.0,
                        "dataflex/replay/groups": float(out.num_blocks + int(torch.unique(join[join >= 0]).numel())),
                        "dataflex/replay/age_mean": float(age.mean()), "dataflex/replay/age_max": float(age.max())})
        if out.num_blocks:
            # New groups whose stored rewards are all equal: GRPO gives them advantage 0 (no gradient, only
            # tokens in the token-mean denominators).
            k = out.num_blocks
            r = record.reward.to(torch.float64)
            flat = segment_min(r, block, k) == segment_max(r, block, k)
            metrics["dataflex/replay/zero_signal_groups"] = float(flat.sum()) / k
        return out, metrics

    def _pool(self, step: int, fresh: Batch, planned: int) -> tuple[ReplayPool | None, Tensor, Tensor | None]:
        """The pool a replayer picks from, the store slot of each pool row and (unit ``prompt``) each pool row's
        requesting fresh group."""
        s, store = self.settings, self.store
        occ = torch.nonzero(store.occupied).flatten()
        if occ.numel() == 0:
            return None, occ, None
        col = store.columns
        if s.unit == "group":
            if planned <= 0:
                return None, occ, None
            # Segments: stored groups, oldest first; rows within a group in insertion order.
            slots = occ[torch.argsort(col["seq"][occ])]
            segment = torch.unique(col["group"][slots], return_inverse=True)[1]
            num = int(segment.max()) + 1
            want = torch.ones(num, dtype=torch.long)
            request = None
            groups = planned
        else:
            if not fresh.has("prompt_index"):
                raise BatchFieldError("dataflex replay", "prompt_index", "the host gave no prompt ids with the fresh "
                                      "rows; per-prompt replay cannot find their stored rows")
            requested = _group_prompts(fresh)  # [G]: each fresh group's prompt (-1 for a repeat in the step)
            position = torch.full((len(store.table),), -1, dtype=torch.long)
            asked = requested >= 0
            position[requested[asked]] = torch.nonzero(asked).flatten()
            where = position[col["prompt"][occ]]
            slots = occ[where >= 0]
            if slots.numel() == 0:
                return None, slots, None
            fresh_group = position[col["prompt"][slots]]
            # Segments in the order of the fresh groups asking; rows of a prompt oldest first.
            order = torch.argsort(col["seq"][slots])
            order = order[torch.sort(fresh_group[order], stable=True).indices]
            slots, fresh_group = slots[order], fresh_group[order]
            segment = torch.unique_consecutive(fresh_group, return_inverse=True)[1]
            num = int(segment.max()) + 1
            counts = segment_count(segment, num)
            want = torch.where(counts >= s.min_to_replay, torch.clamp(counts, max=s.replays), 0)
            if not bool((want > 0).any()):
                return None, slots, None
            request = fresh_group
            groups = 0
        pool = ReplayPool(segment=segment, num_segments=num, want=want, groups=groups,
                          reward=col["reward"][slots].clone(), priority=col["priority"][slots].clone(),
                          seq=col["seq"][slots].clone(), age=(step - col["version"][slots]).clone())
        return pool, slots, request

    def _checked(self, pick: ReplayPick, pool: ReplayPool) -> tuple[Tensor, Tensor | None]:
        who = self.replayer.who
        rows = pick.rows
        if not isinstance(rows, torch.Tensor) or rows.dim() != 1 or rows.dtype.is_floating_point:
            raise BatchFieldError(who, "pick.rows", "expected a 1-D integer tensor of pool rows")
        rows = rows.to(torch.long)
        n = pool.segment.numel()
        if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= n):
            raise BatchFieldError(who, "pick.rows", f"indices must lie in [0, {n})")
        if torch.unique(rows).numel() != rows.numel():
            raise BatchFieldError(who, "pick.rows", "picked a stored row twice")
        got = segment_count(pool.segment[rows], pool.num_segments)
        if self.settings.unit == "prompt":
            if bool((got > pool.want).any()):
                raise BatchFieldError(who, "pick.rows", "picked more rows of a prompt than ReplayPool.want allows")
        else:
            sizes = segment_count(pool.segment, pool.num_segments)
            if bool(((got != 0) & (got != sizes)).any()) or int((got > 0).sum()) > pool.groups:
                raise BatchFieldError(who, "pick.rows", f"must pick whole stored groups, {pool.groups} at most")
        weights = pick.weights
        if weights is not None:
            if tuple(weights.shape) != (rows.numel(),) or not bool(torch.isfinite(weights).all()) or bool(
                    (weights < 0).any()):
                raise BatchFieldError(who, "pick.weights", "expected one finite non-negative weight per picked row")
            weights = weights.to(torch.float32)
        return rows, weights

    def _groups(self, record: Record, fresh: Batch, requested_by: Tensor | None) -> tuple[Tensor, Tensor]:
        """Per the advantage mode: the fresh group each replayed row joins (-1: none) and the new group the
        others form (-1 for joined rows), numbered in order of first appearance."""
        mode = self.settings.advantage
        m = len(record)
        join = torch.full((m,), -1, dtype=torch.long)
        if mode == "mixed":
            if requested_by is not None:
                join = requested_by.clone()
            else:
                first = torch.full((len(self.store.table),), -1, dtype=torch.long)
                prompts = _group_prompts(fresh)
                seen = prompts >= 0
                first[prompts[seen]] = torch.nonzero(seen).flatten()
                join = first[record.prompt]
        key = record.group if mode == "own_group" else record.prompt
        key = torch.where(join >= 0, torch.full_like(key, -1), key)
        block = torch.full((m,), -1, dtype=torch.long)
        rest = join < 0
        if bool(rest.any()):
            uniq, inverse = torch.unique(key[rest], return_inverse=True)
            # Number the new groups in order of first appearance (training order), not by key.
            first_pos = torch.full((uniq.numel(),), m, dtype=torch.long).scatter_reduce(
                0, inverse, torch.arange(int(rest.sum())), "amin")
            rank = torch.empty_like(first_pos)
            rank[torch.argsort(first_pos)] = torch.arange(uniq.numel())
            block[rest] = rank[inverse]
        return join, block

    @staticmethod
    def _singletons(join: Tensor, block: Tensor) -> Tensor:
        """Bool ``[m]``: rows alone in their new group."""
        rest = block >= 0
        if not bool(rest.any()):
            return torch.zeros_like(rest)
        sizes = segment_count(torch.where(rest, block, -1), int(block.max()) + 1)
        return rest & (sizes[block.clamp_min(0)] == 1)

    # ------------------------------------------------------------------ at on_advantage
    def insert(self, batch: Batch, decision: ReplayDecision, step: int, payload: Mapping[str, Tensor],
               lengths: Mapping[str, Tensor] | None = None,
               objects: Sequence[Any] | None = None) -> dict[str, float]:
        """Store the rows ``decision.store`` marks in ``batch`` (the on_advantage batch), with the host's
        ``payload`` for exactly those rows, in batch order. Rows whose behaviour log-probs are not finite on
        their response tokens are not stored (counted)."""
        rows = torch.nonzero(decision.store & batch.valid_rows).flatten()
        mu_all = batch["rollout_log_probs"] if batch.has("rollout_log_probs") else batch["old_log_probs"]
        n = int(rows.numel())
        for name, value in payload.items():
            if value.shape[0] != n:
                raise BatchFieldError("dataflex replay", name, f"the host stored {value.shape[0]} rows, the method "
                                      f"marked {n}")
        if objects is not None and len(objects) != n:
            raise BatchFieldError("dataflex replay", "objects", f"{len(objects)} for {n} rows")
        mask = batch.token_mask[rows]
        mu = torch.where(mask, mu_all[rows].to(torch.float32), 0.0)
        finite = torch.isfinite(mu).all(dim=1)
        out = {"dataflex/replay/nonfinite_rows": float((~finite).sum())}
        if not bool(finite.all()):
            self.warned_nonfinite += 1
            k = self.warned_nonfinite
            if k & (k - 1) == 0:
                import logging

                logging.getLogger("dataflex_bus").warning(
                    "dataflex replay: %d row(s) at step %d have non-finite behaviour log-probs (%s) on response "
                    "tokens; they are trained fresh but not stored (counted in dataflex/replay/nonfinite_rows)",
                    int((~finite).sum()), step, "rollout_log_probs" if batch.has("rollout_log_probs") else
                    "old_log_probs")
        keep = torch.nonzero(finite).flatten()
        r = rows[keep]
        adv = batch["advantages"][r].to(torch.float32)
        tokens = mask[keep]
        advantage = torch.where(tokens, adv, 0.0).sum(1) / tokens.sum(1).clamp_min(1)
        record = Record(prompt=batch["prompt_index"][r].to(torch.long), group=batch.group_index[r],
                        version=torch.full((r.numel(),), step, dtype=torch.long), reward=batch.rewards[r],
                        priority=decision.priority[r], advantage=advantage, domain=batch.domain_index[r],
                        length=batch.lengths[r], mu=mu[keep],
                        payload={k: rows_of(v, keep) for k, v in payload.items()},
                        lengths={k: v[keep] for k, v in (lengths or {}).items()},
                        objects=None if objects is None else [objects[i] for i in keep.tolist()])
        counts = self.store.insert(record)
        out.update({f"dataflex/replay/{k}_rows": float(v) for k, v in counts.items()})
        out["dataflex/replay/stored_rows"] = float(len(self.store))
        return out

    def correct(self, batch: Batch, weights: Tensor | None, step: int) -> dict[str, Tensor]:
        """The fields that correct the replayed rows of ``batch`` (the on_advantage batch, ``replay_version``
        on every row) for being off-policy, composed with ``weights`` (what the decision wrote so far, else the
        batch's own ``rollout_is_weights``): ``decoupled`` multiplies every real row's weights by ``min(exp(
        old_log_probs - rollout_log_probs), is_cap)`` unless the host does it itself; ``behaviour`` sets the
        replayed rows' ``old_log_probs`` to their stored ``rollout_log_probs``; ``off_policy_coef`` and a
        pick's importance weights scale the replayed rows."""
        s = self.settings
        replayed = batch.valid_rows & (batch[VERSION_FIELD] < step)
        out: dict[str, Tensor] = {}
        factor = torch.ones(batch["response_mask"].shape, dtype=torch.float32)
        changed = False
        if s.correction == "decoupled" and not self.host_weights:
            log_ratio = (batch["old_log_probs"].to(torch.float32) - batch["rollout_log_probs"].to(torch.float32))
            ratio = torch.exp(log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)).clamp(max=s.is_cap)
            factor = torch.where(batch.token_mask, ratio, factor)
            changed = True
        if s.correction == "behaviour" and bool(replayed.any()):
            old = batch["old_log_probs"]
            out["old_log_probs"] = torch.where(replayed[:, None], batch["rollout_log_probs"].to(old.dtype), old)
        row = torch.ones(len(batch), dtype=torch.float32)
        if s.off_policy_coef != 1.0:
            row = torch.where(replayed, s.off_policy_coef, row)
        if batch.has("replay_weight"):
            row = row * batch["replay_weight"].to(torch.float32)
        if bool((row != 1).any()):
            factor = factor * row[:, None]
            changed = True
        if changed:
            base = weights if weights is not None else batch.get("rollout_is_weights")
            out["rollout_is_weights"] = factor if base is None else base.to(torch.float32) * factor
        return out

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        return {"store": self.store.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.store.load_state_dict(state["store"])


def _group_prompts(batch: Batch) -> Tensor:
    """Long ``[G]``: each group's prompt (its first row's ``prompt_index``), -1 for a group whose prompt an
    earlier group of the batch has already."""
    g = batch.num_groups
    gi = batch.group_index
    first = torch.full((g,), len(batch), dtype=torch.long).scatter_reduce(
        0, gi.clamp_min(0)[batch.valid_rows], torch.nonzero(batch.valid_rows).flatten(), "amin")
    prompts = batch["prompt_index"].to(torch.long)[first.clamp_max(len(batch) - 1)]
    # A prompt drawn twice in one step (the shim samples with replacement) asks once, by its first group.
    order = torch.sort(prompts, stable=True).indices
    repeat = torch.zeros(g, dtype=torch.bool)
    repeat[order[1:]] = prompts[order[1:]] == prompts[order[:-1]]
    return torch.where(repeat, -1, prompts)


class ReplayRun(RunPart):
    """Replay's state for the run: :attr:`buffer`, the block's :class:`Replay`, once the host gave its prompt
    table; saved under ``replay``."""

    key: ClassVar[str] = "replay"
    kept: ClassVar[str] = "a replay buffer"

    def __init__(self, runtime: Runtime, method: Method) -> None:
        super().__init__(runtime, method)
        self.buffer: Replay | None = None

    @property
    def settings(self) -> ReplaySettings:
        """What the replay method asks of the host, known before the prompt table (a host sizes its prompt
        fetches by ``fresh_fraction``)."""
        return cast("Replayer", self.method.actuator).settings()

    def set_prompts(self, table: PromptTable) -> None:
        self.buffer = Replay(self.method, table, self.runtime.host)

    def state_dict(self) -> Any:
        return None if self.buffer is None else self.buffer.state_dict()

    def load_state_dict(self, state: Any) -> None:
        if self.buffer is None:
            raise ConfigError(ConfigIssue("dataflex", "the host restores a replay buffer before giving the runtime its "
                                          "prompt table (Runtime.set_prompts)"))
        if state is None:
            raise ConfigError(ConfigIssue("dataflex", "checkpoint and config disagree on whether a replay buffer is "
                                          "kept"))
        self.buffer.load_state_dict(state)


class ReplayPart(StepPart):
    """Replay's part of one step: what it replays (:attr:`replayed`) and what waits to be stored."""

    def __init__(self, step: Step) -> None:
        super().__init__(step)
        run = ReplayRun.of(step.runtime)
        self.buffer = None if run is None else run.buffer
        self.replayed: Replayed | None = None
        #: Each on_advantage row's index in :attr:`replayed` (-1: fresh), set by a host before
        #: ``Step.advantage`` (``None``: the batch's own ``replay_row`` field, else every row fresh).
        self.rows: Tensor | None = None
        self._plan: tuple[int, int] | None = None
        self._asked = False
        self._to_store: tuple[Batch, ReplayDecision] | None = None

    def fresh_prompts(self, target: int) -> int:
        """How many of the step's ``target`` prompts to generate: all of them, less the stored groups the
        replay method puts in their place (unit ``group``, DOTS's fresh share; planned once per step)."""
        replay, step = self.buffer, self.step
        if replay is None:
            return target
        if self._plan is None:
            step.metrics.update(replay.maintain(step.index))
            self._plan = (target, replay.plan(step.index, target))
        elif self._plan[0] != target:
            raise ValueError(f"ReplayPart.fresh_prompts: step {step.index} was planned for {self._plan[0]} prompts, "
                             f"now asked for {target}")
        fresh = target - self._plan[1]
        step.metrics["dataflex/replay/fresh_prompts"] = float(fresh)
        return fresh

    def replay(self, fresh: Batch) -> Replayed | None:
        """The stored rows this step trains on again (``None``: none; the step trains fresh rows only, counted in
        ``dataflex/replay/empty``), given the ``fresh`` rows it goes on with after the on_rollout carry-out (with
        ``prompt_index``). Call it before the old log-probs: the host appends the rows (the shim:
        :meth:`Replayed.append_to`; verl writes them to TransferQueue) so its old-log-prob, reference and
        advantage passes see them."""
        replay, step = self.buffer, self.step
        if replay is None:
            return None
        step.metrics.update(replay.maintain(step.index))
        planned = 0 if self._plan is None else self._plan[1]
        self._asked = True
        self.replayed, metrics = replay.retrieve(step.index, fresh, planned)
        step.metrics.update(metrics)
        return self.replayed

    def store(self, payload: Mapping[str, Tensor] | None = None, *, lengths: Mapping[str, Tensor] | None = None,
              objects: Sequence[Any] | None = None) -> None:
        """Store the rows the replay method marked at ``on_advantage`` (:attr:`AdvantageAction.store`): the
        host's fields of exactly those rows, in batch order (``payload``: dense ``[n, w]``; ``lengths``: each row's
        length per field, where the host needs it back; ``objects``: per-row values the host keeps beside). Without
        ``payload`` they are read from the on_advantage batch (a host whose batch holds them, the shim)."""
        replay, pending = self.buffer, self._to_store
        if replay is None or pending is None:
            return
        batch, decision = pending
        self._to_store = None
        if payload is None:
            rows = decision.store & batch.valid_rows
            names = replay.payload_fields if replay.payload_fields is not None else ()
            payload = {name: batch[name][rows] for name in names}
        self.step.metrics.update(replay.insert(batch, decision, self.step.index, payload, lengths, objects))

    def advantage_batch(self, batch: Batch) -> Batch:
        """``batch`` with ``replay_version`` (the step each row was generated at) and, for a weighted pick,
        ``replay_weight`` on every row, each row placed by :attr:`rows`."""
        if self.buffer is None:
            return batch
        replay_rows = self.rows if self.rows is not None else batch.get("replay_row")
        rows = torch.full((len(batch),), -1, dtype=torch.long) if replay_rows is None else replay_rows.to(torch.long)
        rows = torch.where(batch.valid_rows, rows, -1)
        version = torch.full((len(batch),), self.step.index, dtype=torch.long)
        fields: dict[str, Tensor] = {}
        rep = self.replayed
        if bool((rows >= 0).any()):
            if rep is None or int(rows.max()) >= len(rep):
                raise DataflexError(f"dataflex replay: the on_advantage batch of step {self.step.index} names "
                                    "replayed rows this step never replayed (ReplayPart.replay)")
            mine = rows >= 0
            version[mine] = rep.record.version[rows[mine]]
            if rep.weights is not None:
                weight = torch.ones(len(batch), dtype=torch.float32)
                weight[mine] = rep.weights[rows[mine]]
                fields["replay_weight"] = weight
        fields[VERSION_FIELD] = version
        return batch.with_fields(**fields)

    def after_advantage(self, batch: Batch, decision: Decision, action: AdvantageAction) -> None:
        """The replayed rows corrected for being off-policy (:meth:`Replay.correct`); :attr:`AdvantageAction.store`
        marks the rows to hand to :meth:`store`."""
        replay = self.buffer
        if replay is None:
            return
        if not action.skip_update:
            action.fields.update(replay.correct(batch, action.fields.get("rollout_is_weights"), self.step.index))
        # A step that never reached replay() (its update skipped at on_rollout) stores nothing: the kit learns
        # there which of the host's fields a row is stored with.
        if self._asked and decision.replay is not None and bool(decision.replay.store.any()):
            action.store = decision.replay.store
            self._to_store = (batch, decision.replay)

    def end(self, out: dict[str, float]) -> None:
        if self._to_store is not None:
            raise DataflexError(f"dataflex replay: step {self.step.index} marked rows to store at on_advantage, but "
                                "the host never handed them to ReplayPart.store")
        if self.buffer is not None:
            out["dataflex/replay/trained_rows"] = float(self.step.again_rows)


__all__ = ["Record", "Replay", "ReplayPart", "ReplayRun", "ReplayStore", "Replayed", "preallocated_bytes"]
