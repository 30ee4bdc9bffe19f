"""Mechanism ``replay``: rollouts, once generated, train more than one update.

A replayer's method acts at ``on_advantage``, where it decides which of the step's fresh rows enter the run's
buffer and with what priority (its scorer's value); the host kit keeps the buffer
(:mod:`dataflex_bus.replay`: bounded, tensor-backed, checkpointed) and, at a later step, adds the rows the
replayer picks to the batch *before* the old log-probs are computed, corrected for being off-policy
(:class:`ReplaySettings`). A block holds at most one replayer (one buffer), a host
must be able to append rows before its old-log-prob pass (capability ``replay``), and dynamic sampling with
refill is refused beside it: both decide how many prompts a step generates.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

from ..components import Actuator, Scorer
from ..decision import ReplayDecision
from ..errors import BatchFieldError, ConfigIssue
from .base import Mechanism, MethodRun, MethodSettings, Need

if TYPE_CHECKING:
    from torch import Tensor

    from ..batch import Batch
    from ..components import Score
    from ..decision import Decision
    from ..host import HostDescription

#: The field the host kit adds to the ``on_advantage`` batch: the step each row was generated at (fresh
#: rows: the current step).
VERSION_FIELD = "replay_version"


#: How a replayer's rows enter a step (:class:`ReplaySettings`): the values each setting may take.
REPLAY_UNITS = ("group", "prompt")
REPLAY_ADVANTAGES = ("own_group", "split", "mixed")
REPLAY_CORRECTIONS = ("decoupled", "behaviour")


@dataclass(frozen=True)
class ReplaySettings:
    """What the host kit does with a replayer's buffer (read once, when the run starts).

    ``unit``: ``group`` replays whole stored groups in the step's place of fresh ones (DOTS: the step
    generates ``fresh_fraction`` of its prompts and fills the rest from the buffer); ``prompt`` replays, for
    each prompt the step generates, up to ``replays`` of its stored rows once ``min_to_replay`` are stored
    (RePO; the step's fresh prompts are all generated). ``advantage``: the groups replayed rows are normalised
    in by the host's GRPO pass: ``own_group`` (the rows they were generated with), ``split`` (the replayed rows
    of one prompt together, apart from its fresh rows), ``mixed`` (with the fresh rows of their prompt).
    ``correction``: ``decoupled`` weights every row by ``min(pi_old / mu, is_cap)`` (decoupled PPO with
    truncation, DOTS), ``behaviour`` clips the ratio against the stored behaviour log-probs ``mu`` instead of
    ``pi_old`` (``old_log_probs <- mu`` on replayed rows, RePO). ``capacity``: rows stored at most (the oldest
    groups leave first); ``per_prompt``: rows per prompt at most (0: no bound); ``max_age_steps``: a record
    older than this many steps is evicted (0: never); ``dedup``: keep only each prompt's newest group;
    ``off_policy_coef``: a factor on the loss of replayed rows (RePO's ``c_off``).
    """

    unit: str = "group"
    advantage: str = "own_group"
    correction: str = "decoupled"
    capacity: int = 4096
    per_prompt: int = 0
    min_to_replay: int = 1
    replays: int = 8
    max_age_steps: int = 0
    fresh_fraction: float = 1.0
    dedup: bool = False
    is_cap: float = 2.0
    off_policy_coef: float = 1.0


@dataclass
class ReplayPool:
    """The stored rows a replayer may pick from at one step, grouped in ``num_segments`` segments.

    Unit ``prompt``: a segment is one prompt the step generates (in the order of its fresh groups), holding
    that prompt's stored rows, oldest first; ``want[s]`` rows are to be picked from segment ``s``. Unit
    ``group``: a segment is one stored group (oldest first), ``groups`` of them are to be picked, whole.
    Per row: ``reward`` (stored, never re-scored), ``priority`` (the scorer's value when the row was stored),
    ``seq`` (insertion order, larger is newer) and ``age`` (steps since it was generated).
    """

    segment: Tensor
    num_segments: int
    want: Tensor
    groups: int
    reward: Tensor
    priority: Tensor
    seq: Tensor
    age: Tensor


@dataclass
class ReplayPick:
    """A replayer's choice: ``rows`` (long, indices into the pool, in training order) and optional per-row
    importance ``weights`` (non-uniform sampling: PER's ``(N P(i))^-beta / max``), multiplied into the loss."""

    rows: Tensor
    weights: Tensor | None = None
    metrics: dict[str, float] = field(default_factory=dict)


class Replayer(Actuator):
    """Mechanism ``replay``: which fresh rows enter the run's buffer (at ``on_advantage``, with their score as
    priority) and which stored rows a later step trains on again (picked before its old log-probs).

    The host kit keeps the buffer (:mod:`dataflex_bus.replay`); a replayer says how (:meth:`settings`), what to
    store (:meth:`store`, default every fresh row) and what to replay (:meth:`pick`).
    """

    kind: ClassVar[str] = "replayer"
    min_timing: ClassVar[str] = "post_reward"
    accepts: ClassVar[Sequence[str]] = ("prompt", "response")
    #: The behaviour log-probs (mu) and the advantages of what it stores.
    requires: ClassVar[Sequence[str]] = ("rollout_log_probs", "old_log_probs", "advantages", "uid")
    needs_groups: ClassVar[bool] = True

    def settings(self) -> ReplaySettings:
        return ReplaySettings()

    def check_host(self, host: HostDescription) -> list[tuple[str, str]]:
        """The buffer fits this machine at the host's longest rows (its columns preallocated, each row's packed
        fields at the host's estimate) and holds at least one group, else nothing it stores could ever be
        replayed."""
        from ..memory import beyond_memory, format_bytes, machine_memory, stored_row
        from ..replay_store import preallocated_bytes

        s = self.settings()
        issues = super().check_host(host)
        row, basis = stored_row(host)
        per_row = preallocated_bytes(1) + row
        total = s.capacity * per_row
        fits = max(1, (host.memory_limit or machine_memory()) // per_row)
        refusal = beyond_memory(total, f"capacity={s.capacity:,} stored rows at {format_bytes(per_row)} a row "
                                f"({basis})",
                                f"lower capacity (at most about {fits:,} rows fit) or the host's maximum prompt "
                                "and response lengths", host.memory_limit)
        if refusal:
            return [*issues, ("capacity", refusal)]
        n = host.group_size
        if n is not None and s.capacity < n:
            issues.append(("capacity", f"capacity={s.capacity} rows holds less than one group of {n} rollouts "
                           f"(host {host.name!r}), so no group is ever stored whole and nothing is replayed; set "
                           f"capacity >= {n}"))
        return issues

    def host_warnings(self, host: HostDescription) -> list[tuple[str, str]]:
        """Under unit ``group``, a buffer holding fewer rows than one step replays: a step replays at most what it
        holds and generates the rest fresh, so ``fresh_fraction`` is never reached."""
        s = self.settings()
        n, prompts = host.group_size, host.prompts_per_step
        if n is None or prompts is None or s.unit != "group" or s.capacity < n:
            return []
        groups = self.replay_groups(int(prompts), int(prompts), 0)
        if s.capacity >= groups * n:
            return []
        return [("capacity", f"capacity={s.capacity} rows holds {s.capacity // n} of the {groups} groups of {n} "
                 f"one step replays (unit group, fresh_fraction={s.fresh_fraction} of {prompts} prompts on host "
                 f"{host.name!r}), so a step generates the rest fresh; set capacity >= {groups * n} for the whole "
                 "share")]

    def store(self, batch: Batch, score: Score, step: int) -> Tensor:
        """Bool ``[B]``: the rows to store (the kit stores only fresh real rows whatever this says)."""
        return batch.valid_rows

    def replay_groups(self, target: int, available: int, step: int) -> int:
        """Unit ``group``: how many stored groups replace fresh ones in a step of ``target`` groups, given
        ``available`` eligible stored groups (default: ``(1 - fresh_fraction)`` of the step, as many as there are)."""
        s = self.settings()
        wanted = int((1.0 - s.fresh_fraction) * target + 0.5)
        return max(0, min(wanted, available, target - 1))

    def pick(self, pool: ReplayPool, step: int) -> ReplayPick:
        raise NotImplementedError(f"{type(self).__name__}.pick")


class Replay(Mechanism):
    name: ClassVar[str] = "replay"
    kind: ClassVar[str] = "replayer"
    base: ClassVar[type[Actuator]] = Replayer
    summary: ClassVar[str] = "past rollouts trained again, off-policy corrected (a buffer the bus keeps)"
    per_block: ClassVar[int | None] = 1
    per_block_reason: ClassVar[str] = "one replayer (the bus keeps one buffer of past rollouts per run)"
    refill_compatible: ClassVar[bool] = False
    step_part: ClassVar[str] = "dataflex_bus.replay:ReplayPart"
    run_part: ClassVar[str] = "dataflex_bus.replay:ReplayRun"

    def event(self, scorer: type[Scorer], actuator: type[Actuator]) -> str:
        return "on_advantage"

    def events(self, actuator: type[Actuator]) -> dict[str, str]:
        return {"on_advantage": "stores the step's fresh rows; stored rows join a later step before its old "
                                "log-probs"}

    def needs(self, method: MethodSettings, scorer: type[Scorer], actuator: type[Actuator]) -> dict[str, Need]:
        return {"replay": Need(f"mechanism {self.name!r} adds stored rows to a step before its old log-probs")}

    def check(self, method: MethodSettings, scorer: type[Scorer], actuator: type[Actuator], host: HostDescription,
              key: str) -> list[ConfigIssue]:
        issues = []
        if scorer.timing == "post_update":
            issues.append(ConfigIssue(f"{key}.scorer.name", f"scorer {method.scorer.name!r} runs post_update, after "
                                      "the step's rows are stored (on_advantage)"))
        if scorer.granularity not in ("prompt", "response"):
            issues.append(ConfigIssue(f"{key}.scorer.name", f"a replay priority is one value per stored row; scorer "
                                      f"{method.scorer.name!r} gives {scorer.granularity}-level scores",
                                      ["prompt", "response"]))
        return issues

    def apply(self, run: MethodRun, batch: Batch, step: int, decision: Decision) -> None:
        import torch

        view, score, dropped = run.score(batch, step, decision.metrics)
        replayer = run.actuator
        assert isinstance(replayer, Replayer)
        store = run.call("actuator", replayer.store, view, score, step)
        if not isinstance(store, torch.Tensor) or tuple(store.shape) != (len(view),):
            raise BatchFieldError(replayer.who, "store", f"expected a bool tensor of shape ({len(view)},)")
        if not view.has(VERSION_FIELD):
            raise BatchFieldError("dataflex replay", VERSION_FIELD, "the host kit adds it to the on_advantage "
                                  "batch (Step.advantage); a batch without it never went through the kit")
        # Only rows generated this step are stored: a replayed row is in the buffer already.
        fresh = view[VERSION_FIELD] == step
        store = store.to(torch.bool) & view.valid_rows & fresh
        if dropped is not None:
            # A row whose priority is NaN/inf is neither stored nor trained (as under every mechanism).
            decision.drop(dropped, on_empty=run.config.on_empty, nonfinite=True)
        priority = score.values.to(torch.float32)
        decision.replay = ReplayDecision(store=store, priority=torch.where(store, priority, 0.0))
        decision.metrics[f"{run.prefix}replay/marked_rows"] = float(store.sum())
