"""Stable prompt ids and the per-prompt history the bus keeps for pre-rollout selection.

A method that decides *before generation* which prompts to roll out (GRESO) can only go by what happened
the last times a prompt was rolled out. Two pieces make that possible in every host:

* :class:`PromptTable`: the dataset's prompts, each a stable id ``(domain, row)`` (the shim: a domain's
  train-split row; verl: ``data_source`` and ``extra_info.index``), mapped to a dense index ``0..N-1``.
  Duplicate ids are refused when the table is built, unknown ids when a batch is looked up, both naming
  the column to fix.
* :class:`PromptHistory`: tensors keyed by that dense index (never a dict of Python objects), so memory is
  bounded by the dataset (about 60 bytes per prompt) and every update is one scatter. Per prompt it keeps
  the number of visits, the step of the last one, the class of the last visit (easy / hard / other, see
  :class:`VisitClasses`) with the length of the current run of visits of that class (the *streak*), and
  the last :data:`WINDOW` visits (step, mean reward, class, rollouts, successes) and the last
  :data:`REWARD_WINDOW` rollout rewards over its visits (Knapsack RL's pooled estimate), plus any per-prompt
  state a component owns (:class:`~dataflex_bus.visits.PromptState`: MoPPS's Beta posterior), updated by the
  component at every visit. Per step it counts the groups rolled out and how many were easy or hard, over
  every generation round of the step.

The history is written by the host for every rolled-out group, before any selection (a zero-variance
group a later method drops still counts as a visit), and read at ``on_prompts`` as the ``history_*``
fields of the candidates batch (:data:`dataflex_bus.visits.CANDIDATE_FIELDS`). It is saved with the
runtime's state together with a fingerprint of the prompt table, so a resume on another dataset is refused
and a resumed run continues exactly.
"""

from __future__ import annotations

import logging
import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from .batch import Batch, _index_labels
from .errors import BatchFieldError, ConfigError, ConfigIssue
from .ops import segment_count, segment_max, segment_min, segment_sum, waves
from .visits import (
    CLASS_NAMES,
    EASY,
    HARD,
    OTHER,
    REWARD_WINDOW,
    SUCCESS_THRESHOLD,
    WINDOW,
    PromptState,
    VisitClasses,
    Visits,
)

log = logging.getLogger("dataflex_bus")
#: What updates a component's per-prompt state: ``(old state [V, width], visits) -> new state``.
StateUpdate = Callable[[Tensor, Visits], Tensor]

#: A prompt id is ``domain << ID_SHIFT | row``: rows must lie in ``[0, 2**ID_SHIFT)``.
ID_SHIFT = 40

# ---------------------------------------------------------------------------- prompt ids
class PromptTable:
    """The dataset's prompts: stable ids ``(domain, row)`` and their dense index.

    ``domains``: the domain names; ``domain_ids``/``rows``: one entry per prompt (ids into ``domains``,
    rows non-negative). ``column`` names what a user sets to give prompts ids (it is in every error).
    """

    def __init__(self, domains: Sequence[str], domain_ids: Tensor, rows: Tensor, *, column: str) -> None:
        self.domains = [str(d) for d in domains]
        self.column = column
        domain_ids, rows = domain_ids.to(torch.long), rows.to(torch.long)
        if domain_ids.shape != rows.shape or domain_ids.dim() != 1:
            raise ConfigError(ConfigIssue(column, f"expected one domain and one row per prompt, got shapes "
                                          f"{tuple(domain_ids.shape)} and {tuple(rows.shape)}"))
        if rows.numel() == 0:
            raise ConfigError(ConfigIssue(column, "the dataset has no prompts"))
        bad = (rows < 0) | (rows >= 2**ID_SHIFT)
        if bool(bad.any()):
            raise ConfigError(ConfigIssue(column, f"prompt ids must be integers in [0, 2**{ID_SHIFT}), got "
                                          f"{int(rows[bad][0])}"))
        if bool(((domain_ids < 0) | (domain_ids >= len(self.domains))).any()):
            raise ConfigError(ConfigIssue(column, f"domain ids outside 0..{len(self.domains) - 1}"))
        ids, order = torch.sort((domain_ids << ID_SHIFT) | rows, stable=True)
        dup = ids[1:] == ids[:-1]
        if bool(dup.any()):
            first = int(torch.nonzero(dup).flatten()[0])
            d, r = divmod(int(ids[first]), 2**ID_SHIFT)
            count = int((ids == ids[first]).sum())
            raise ConfigError(ConfigIssue(
                column, f"{int(dup.sum()) + 1} prompts share an id with another prompt (for example {count} "
                f"prompts of domain {self.domains[d]!r} have {column}={r}); set a unique {column} per prompt of "
                "a domain, so that each prompt's history is its own"))
        self.ids = ids
        #: Dense index of each input prompt, in input order (the sort is a bijection).
        self.input_index = torch.empty_like(order)
        self.input_index[order] = torch.arange(order.numel())

    @classmethod
    def full(cls, domains: Sequence[str], sizes: Sequence[int], *, column: str) -> PromptTable:
        """Every row ``0..sizes[d]-1`` of every domain ``d`` (a finite generated table, the shim)."""
        counts = torch.tensor([int(s) for s in sizes], dtype=torch.long)
        domain_ids = torch.repeat_interleave(torch.arange(len(counts)), counts)
        starts = torch.cumsum(counts, 0) - counts
        rows = torch.arange(int(counts.sum())) - starts[domain_ids]
        return cls(domains, domain_ids, rows, column=column)

    @classmethod
    def from_labels(cls, labels: Sequence[Any], rows: Sequence[int] | Tensor, *, column: str,
                    domains: Sequence[str] | None = None) -> PromptTable:
        """One entry per dataset row: its domain label and its row id (verl's ``extra_info.index``).
        Domains are ``domains`` or the sorted distinct labels."""
        names = list(domains) if domains is not None else sorted({str(x) for x in labels})
        position = {n: i for i, n in enumerate(names)}
        unknown = sorted({str(x) for x in labels} - set(position))
        if unknown:
            raise ConfigError(ConfigIssue(column, f"domain labels {unknown[:5]} are not among {names}"))
        ids = torch.tensor([position[str(x)] for x in labels], dtype=torch.long)
        return cls(names, ids, torch.as_tensor(rows, dtype=torch.long), column=column)

    def __len__(self) -> int:
        return int(self.ids.numel())

    def lookup(self, domain_ids: Tensor, rows: Tensor) -> Tensor:
        """Dense indices ``[n]`` of the prompts ``(domain_ids, rows)``; an id not in the table raises
        :class:`BatchFieldError` naming the column."""
        domain_ids, rows = domain_ids.to(torch.long), rows.to(torch.long)
        keys = (domain_ids << ID_SHIFT) | rows
        pos = torch.searchsorted(self.ids, keys).clamp_max(len(self) - 1)
        found = (self.ids[pos] == keys) & (rows >= 0) & (rows < 2**ID_SHIFT) & (domain_ids >= 0)
        if not bool(found.all()):
            i = int(torch.nonzero(~found).flatten()[0])
            d = int(domain_ids[i])
            name = self.domains[d] if 0 <= d < len(self.domains) else f"#{d}"
            raise BatchFieldError("dataflex prompt ids", self.column,
                                  f"prompt ({name!r}, {self.column}={int(rows[i])}) is not in the dataset's prompt "
                                  f"table ({len(self)} prompts); a prompt's id must be fixed when the run starts")
        return pos

    def lookup_labels(self, labels: Sequence[Any], rows: Tensor) -> Tensor:
        """:meth:`lookup` with domain labels (strings) instead of ids."""
        ids, found = _index_labels(labels, self.column)
        position = {n: i for i, n in enumerate(self.domains)}
        unknown = [str(n) for n in found if str(n) not in position]
        if unknown:
            raise BatchFieldError("dataflex prompt ids", self.column,
                                  f"domain {unknown[0]!r} is not a domain of the dataset's prompt table "
                                  f"{self.domains}")
        remap = torch.tensor([position[str(n)] for n in found] + [-1], dtype=torch.long)
        return self.lookup(remap[ids] if ids.numel() else ids, rows)

    def fingerprint(self) -> dict[str, Any]:
        """What a saved history must agree on with the dataset that resumes it."""
        return {"domains": list(self.domains), "prompts": len(self),
                "checksum": zlib.crc32(self.ids.numpy().tobytes())}

    def check_saved(self, saved: Any, what: str) -> None:
        """Refuse state keyed by this table's dense index (``what``: "the per-prompt history", ...) that a
        checkpoint saved with the fingerprint ``saved`` of another dataset's table."""
        now = self.fingerprint()
        if saved != now:
            raise ConfigError(ConfigIssue(
                self.column, f"{what} in the checkpoint was written for another dataset (saved: {_describe(saved)}; "
                f"now: {_describe(now)}); resume with the original dataset or start a fresh run"))


# ---------------------------------------------------------------------------- the history
class PromptHistory:
    """Per-prompt outcome history over a :class:`PromptTable` (see the module doc)."""

    def __init__(self, table: PromptTable, classes: VisitClasses | None = None, *, window: int = WINDOW,
                 rewards: int = REWARD_WINDOW) -> None:
        self.table = table
        self.classes = classes or VisitClasses()
        self.window = window
        self.reward_window = rewards
        n = len(table)
        self.visits = torch.zeros(n, dtype=torch.int32)
        self.last_step = torch.full((n,), -1, dtype=torch.int32)
        self.last_class = torch.zeros(n, dtype=torch.int8)
        self.streak = torch.zeros(n, dtype=torch.int32)
        self.ring_step = torch.full((n, window), -1, dtype=torch.int32)
        self.ring_mean = torch.full((n, window), float("nan"), dtype=torch.float32)
        self.ring_class = torch.full((n, window), -1, dtype=torch.int8)
        self.ring_size = torch.zeros((n, window), dtype=torch.int32)
        self.ring_success = torch.zeros((n, window), dtype=torch.int32)
        # The last `rewards` rollout rewards of each prompt in the order they were recorded (visit by visit,
        # row order within a visit): slot (count - 1) % rewards holds the newest.
        self.reward_ring = torch.full((n, rewards), float("nan"), dtype=torch.float32)
        self.reward_count = torch.zeros(n, dtype=torch.int64)
        #: Components' per-prompt state (float64 [N, width]) and who updates it, by PromptState name.
        self.states: dict[str, Tensor] = {}
        self.specs: dict[str, PromptState] = {}
        self._updates: dict[str, StateUpdate] = {}
        self.considered = 0
        # [step, groups, easy, hard] of the step being recorded and of the last completed one
        self.current = [-1, 0, 0, 0]
        self.completed = [-1, 0, 0, 0]
        #: The pass over the prompts the last completed step's last candidate belonged to (GRESO gates its
        #: adaptation on the epoch a step ends in); 0 before any.
        self.completed_epoch = 0

    def __len__(self) -> int:
        return len(self.table)

    @property
    def epoch(self) -> int:
        return self.considered // len(self.table)

    # ------------------------------------------------------------------ reading
    def fields(self, index: Tensor) -> dict[str, Tensor]:
        """The ``history_*`` fields of the prompts at dense ``index``
        (:data:`~dataflex_bus.visits.CANDIDATE_FIELDS`)."""
        visits = self.visits[index].to(torch.long)
        k = torch.arange(self.window)
        slots = (visits[:, None] - 1 - k) % self.window
        seen = k < visits[:, None]
        rows = index[:, None].expand(-1, self.window)
        steps = torch.where(seen, self.ring_step[rows, slots].to(torch.long), -1)
        means = torch.where(seen, self.ring_mean[rows, slots], float("nan"))
        classes = torch.where(seen, self.ring_class[rows, slots].to(torch.long), -1)
        sizes = torch.where(seen, self.ring_size[rows, slots].to(torch.long), 0)
        successes = torch.where(seen, self.ring_success[rows, slots].to(torch.long), 0)
        count = self.reward_count[index]
        r = torch.arange(self.reward_window)
        kept = r < count[:, None]
        cols = (count[:, None] - 1 - r) % self.reward_window
        rewards = torch.where(kept, self.reward_ring[index[:, None].expand(-1, self.reward_window), cols],
                              float("nan"))
        step, groups, easy, hard = self.completed
        scalar = {"history_epoch": self.epoch, "history_counts_step": step,
                  "history_counts_epoch": self.completed_epoch, "history_step_groups": groups,
                  "history_step_easy": easy, "history_step_hard": hard}
        return {"history_visits": visits, "history_last_step": self.last_step[index].to(torch.long),
                "history_class": self.last_class[index].to(torch.long),
                "history_streak": self.streak[index].to(torch.long),
                "history_steps": steps, "history_means": means, "history_classes": classes,
                "history_sizes": sizes, "history_successes": successes, "history_rewards": rewards,
                "history_reward_count": count.clone(),
                **{self.specs[name].field: state[index] for name, state in self.states.items()},
                **{k: torch.tensor(v, dtype=torch.long) for k, v in scalar.items()}}

    # ------------------------------------------------------------------ components' own state
    def own(self, spec: PromptState, update: StateUpdate) -> None:
        """Keep ``spec``'s per-prompt state for a component (``update`` is its update, called at every visit)."""
        if spec.name in self.states:
            raise ConfigError(ConfigIssue("dataflex", f"two components keep per-prompt state {spec.name!r}; the "
                                          "history holds one state per name"))
        init = torch.tensor(spec.init, dtype=torch.float64)
        self.states[spec.name] = init.expand(len(self.table), -1).clone()
        self.specs[spec.name] = spec
        self._updates[spec.name] = update

    def consider(self, count: int) -> None:
        """Count candidates considered (drawn), whether or not they are generated: the epoch counter."""
        self.considered += int(count)

    # ------------------------------------------------------------------ writing
    def record(self, batch: Batch, step: int) -> dict[str, float]:
        """Add one visit per real group of ``batch`` (which holds ``prompt_index`` on every row), in the
        groups' arrival order. Returns the metrics of the visits (counts per class)."""
        if not batch.has("prompt_index"):
            raise BatchFieldError("dataflex prompt history", "prompt_index",
                                  "the host gave no prompt ids with the rollouts; the history cannot be kept")
        gi, g = batch.group_index, batch.num_groups
        if g == 0:
            return {}
        # Per-group statistics by segment reductions (padding rows have gi = -1 and fall out); prompt ids
        # and row numbers stay exact in float64 (below 2**53).
        pidx = batch["prompt_index"].to(torch.float64)
        lo_p, hi_p = segment_min(pidx, gi, g), segment_max(pidx, gi, g)
        if not bool(((lo_p == hi_p) & (lo_p >= 0) & (hi_p < len(self))).all()):
            raise BatchFieldError("dataflex prompt history", "prompt_index",
                                  "every row of a group (uid) must carry the same prompt_index, in "
                                  f"0..{len(self) - 1}")
        arrival = torch.argsort(segment_min(torch.arange(len(batch), dtype=torch.float64), gi, g))
        r = batch.rewards.to(torch.float64)
        size = batch.group_sizes
        mean = segment_sum(r, gi, g) / size.clamp_min(1)
        low, high = segment_min(r, gi, g), segment_max(r, gi, g)
        cls = self.classes.classify(mean, low, high, size, batch.rewards.dtype)
        counted = self.classes.count_class(mean, low, high, size, batch.rewards.dtype)
        success = segment_sum((batch.rewards > SUCCESS_THRESHOLD).to(torch.long), gi, g)
        prompt = lo_p.to(torch.long)
        self._record_rewards(batch, prompt, arrival)
        self._visit(prompt[arrival], cls[arrival], mean[arrival], step, size[arrival], success[arrival])
        if self.states:
            # each state's own success rule (MoPPS: reward >= 1), else the history's
            rules = {name: success if spec.success_min is None else
                     segment_sum((batch.rewards >= spec.success_min).to(torch.long), gi, g)
                     for name, spec in self.specs.items()}
            self._update_states(prompt[arrival], size[arrival], {n: k[arrival] for n, k in rules.items()}, step)
        if self.current[0] != step:
            self.current = [step, 0, 0, 0]
        n_easy, n_hard = int((counted == EASY).sum()), int((counted == HARD).sum())
        self.current[1] += g
        self.current[2] += n_easy
        self.current[3] += n_hard
        per_class = segment_count(cls, len(CLASS_NAMES))
        return {f"history/visits_{name}": float(c) for name, c in zip(CLASS_NAMES, per_class.tolist())}

    def _record_rewards(self, batch: Batch, prompt: Tensor, arrival: Tensor) -> None:
        """Append every real row's reward to its prompt's reward ring: visits in arrival order, rows in row
        order within a visit (only the last ``reward_window`` of a prompt are written: no slot twice)."""
        gi = batch.group_index
        real = torch.nonzero(gi >= 0).flatten()
        if real.numel() == 0:
            return
        rank_of_group = torch.empty_like(arrival)
        rank_of_group[arrival] = torch.arange(arrival.numel())
        g = gi[real]
        # Stable sorts, last key first: by row, then by the visit's arrival, then by prompt.
        order = torch.sort(rank_of_group[g], stable=True).indices
        order = order[torch.sort(prompt[g][order], stable=True).indices]
        rows, p = real[order], prompt[g][order]
        uniq, counts = torch.unique_consecutive(p, return_counts=True)
        seg = torch.repeat_interleave(torch.arange(uniq.numel()), counts)
        rank = torch.arange(p.numel()) - (torch.cumsum(counts, 0) - counts)[seg]
        write = rank >= counts[seg] - self.reward_window
        before = self.reward_count[uniq]
        slot = (before[seg] + rank) % self.reward_window
        self.reward_ring[p[write], slot[write]] = batch.rewards[rows[write]].to(torch.float32)
        self.reward_count[uniq] = before + counts

    def _update_states(self, prompt: Tensor, size: Tensor, success: dict[str, Tensor], step: int) -> None:
        """Hand the visits (in arrival order; ``success`` by state name, each by its own rule) to the components
        owning per-prompt state. A component sees distinct prompts per call, so a prompt visited twice in one
        batch (two refill rounds drawing it) is updated twice, in order: one call per repeat, a loop as long as
        the most repeated prompt's visits."""
        for at in waves(prompt):
            for name, state in self.states.items():
                visits = Visits(prompt[at], size[at].to(torch.long), success[name][at].to(torch.long), step)
                new = self._updates[name](state[visits.prompt].clone(), visits)
                spec = self.specs[name]
                if not isinstance(new, Tensor) or tuple(new.shape) != (at.numel(), spec.width):
                    got = tuple(new.shape) if isinstance(new, Tensor) else type(new).__name__
                    raise BatchFieldError("dataflex prompt history", spec.field,
                                          f"update_prompt_state returned {got}, expected ({at.numel()}, {spec.width})")
                if not bool(torch.isfinite(new).all()):
                    raise BatchFieldError("dataflex prompt history", spec.field,
                                          "update_prompt_state returned NaN/inf")
                state[visits.prompt] = new.to(torch.float64)

    def _visit(self, prompt: Tensor, cls: Tensor, mean: Tensor, step: int, size: Tensor, success: Tensor) -> None:
        """Apply visits (in order) to the prompts: several visits of one prompt compose exactly."""
        order = torch.sort(prompt, stable=True).indices
        p, c, m = prompt[order], cls[order], mean[order]
        n_rows, n_ok = size[order], success[order]
        uniq, counts = torch.unique_consecutive(p, return_counts=True)
        u = uniq.numel()
        seg = torch.repeat_interleave(torch.arange(u), counts)
        starts = torch.cumsum(counts, 0) - counts
        rank = torch.arange(p.numel()) - starts[seg]
        # The last visit of each prompt decides its class; its streak is the trailing run of that class
        # in this batch, plus the old streak when the whole batch run continues the old one.
        final = c[starts + counts - 1]
        breaks = torch.where(c != final[seg], rank, -1)
        last_break = torch.full((u,), -1, dtype=torch.long).scatter_reduce(0, seg, breaks, "amax")
        trailing = counts - 1 - last_break
        old_class = self.last_class[uniq].to(torch.long)
        old_streak = self.streak[uniq].to(torch.long)
        continues = (last_break < 0) & (old_class == final)
        streak = torch.where(continues, old_streak + counts, trailing)
        streak = torch.where(final == OTHER, 0, streak)
        # Ring: visit j of this batch (rank j of its prompt) lands in slot (visits_before + j) % window;
        # only the last `window` visits of a prompt are written, so no two writes share a slot.
        before = self.visits[uniq].to(torch.long)
        write = rank >= (counts[seg] - self.window)
        slot = (before[seg] + rank) % self.window
        rows, cols = p[write], slot[write]
        self.ring_step[rows, cols] = step
        self.ring_mean[rows, cols] = m[write].to(torch.float32)
        self.ring_class[rows, cols] = c[write].to(torch.int8)
        self.ring_size[rows, cols] = n_rows[write].to(torch.int32)
        self.ring_success[rows, cols] = n_ok[write].to(torch.int32)
        self.visits[uniq] = (before + counts).to(torch.int32)
        self.last_step[uniq] = step
        self.last_class[uniq] = final.to(torch.int8)
        self.streak[uniq] = streak.to(torch.int32)

    def end_step(self, step: int) -> None:
        """The step is complete: its counts become the ones :meth:`fields` reports."""
        self.completed = [step, *self.current[1:]] if self.current[0] == step else [step, 0, 0, 0]
        self.completed_epoch = max(self.considered - 1, 0) // len(self.table)
        self.current = [-1, 0, 0, 0]

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        return {
            "table": self.table.fingerprint(), "classes": self.classes.to_dict(), "window": self.window,
            "visits": self.visits.clone(), "last_step": self.last_step.clone(),
            "last_class": self.last_class.clone(), "streak": self.streak.clone(),
            "ring_step": self.ring_step.clone(), "ring_mean": self.ring_mean.clone(),
            "ring_class": self.ring_class.clone(), "considered": self.considered,
            "current": list(self.current), "completed": list(self.completed),
            "completed_epoch": self.completed_epoch,
            "ring_size": self.ring_size.clone(), "ring_success": self.ring_success.clone(),
            "reward_ring": self.reward_ring.clone(), "reward_count": self.reward_count.clone(),
            "reward_window": self.reward_window,
            "states": {name: state.clone() for name, state in self.states.items()},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.table.check_saved(state.get("table"), "the per-prompt history")
        if state.get("classes") != self.classes.to_dict() or state.get("window") != self.window:
            raise ConfigError(ConfigIssue("dataflex", "the per-prompt history in the checkpoint classifies visits "
                                          f"differently ({state.get('classes')}, window {state.get('window')})"))
        names = ["visits", "last_step", "last_class", "streak", "ring_step", "ring_mean", "ring_class"]
        if "reward_ring" in state:
            if state.get("reward_window") != self.reward_window:
                raise ConfigError(ConfigIssue("dataflex", "the per-prompt history in the checkpoint keeps "
                                              f"{state.get('reward_window')} rewards per prompt, this run "
                                              f"{self.reward_window}"))
            names += ["ring_size", "ring_success", "reward_ring", "reward_count"]
        elif bool((torch.as_tensor(state["visits"]) > 0).any()):
            # A history saved before per-visit sizes and rewards were kept: they start empty.
            log.warning("dataflex: the per-prompt history in the checkpoint keeps no per-visit sizes or rewards "
                        "(an older dataflex-bus); they start empty")
        for name in names:
            value = state[name]
            mine = getattr(self, name)
            if tuple(value.shape) != tuple(mine.shape):
                raise ConfigError(ConfigIssue(self.table.column, f"history field {name!r} has shape "
                                              f"{tuple(value.shape)}, expected {tuple(mine.shape)}"))
            setattr(self, name, value.to(mine.dtype).clone())
        saved_states = state.get("states") or {}
        if set(saved_states) != set(self.states):
            raise ConfigError(ConfigIssue("dataflex", f"the checkpoint's per-prompt state is {sorted(saved_states)}, "
                                          f"this block keeps {sorted(self.states)}"))
        for name, value in saved_states.items():
            mine = self.states[name]
            if tuple(value.shape) != tuple(mine.shape):
                raise ConfigError(ConfigIssue(self.table.column, f"per-prompt state {name!r} has shape "
                                              f"{tuple(value.shape)}, expected {tuple(mine.shape)}"))
            mine.copy_(value.to(mine.dtype))
        self.considered = int(state["considered"])
        self.current = [int(x) for x in state["current"]]
        self.completed = [int(x) for x in state["completed"]]
        # saved between steps, where the last candidate considered is the completed step's (older checkpoints)
        self.completed_epoch = int(state.get("completed_epoch", max(self.considered - 1, 0) // len(self.table)))


def _describe(fp: Any) -> str:
    if not isinstance(fp, Mapping):
        return repr(fp)
    return f"{fp.get('prompts')} prompts of domains {fp.get('domains')}, checksum {fp.get('checksum')}"
