"""Rollout allocation (mechanism ``allocate``): Knapsack RL and SPEED.

**Knapsack RL** (arXiv 2509.25849, code ``liziniu/KnapsackRL``): before generation each candidate prompt
gets a rollout count maximising ``sum_i Value(n_i, p_i)`` under ``sum_i n_i = T`` (plain GRPO's budget),
with ``Value(N, p) = (1 - p^N - (1 - p)^N) * p (1 - p)^2`` (the chance of a non-zero gradient times the
information gain); ``p`` is a pooled estimate over the prompt's last rewards (scorer ``knapsack_rate``).
Prompts never solved or always solved get a floor, new prompts the host's group size, and budget the
effective prompts cannot use goes to the never-solved ones (the fallback).

**SPEED** (arXiv 2506.09016, code ``Zanette-Labs/speed-rl``): screen every prompt with the host's group
size, then give the prompts with ``0 < p < 1`` more rollouts in a second generation round of the same
step (appended to their groups) and train on those groups only.

Spec: ``allocation.md`` sections 1 and 3; every deliberate difference from the official code is named in
docs/methods.md and at the line that makes it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch
from torch import Tensor

from dataflex_bus.batch import Batch
from dataflex_bus.components import ALLOCATION_PARAMS, Allocation, Allocator, Budget, Param, Score, Scorer
from dataflex_bus.errors import BatchFieldError
from dataflex_bus.visits import REWARD_WINDOW, SUCCESS_THRESHOLD

if TYPE_CHECKING:
    from dataflex_bus.host import HostDescription

OBJECTIVES = ("official", "exact")
SOLVERS = ("greedy", "dp")
COSTS = ("probability", "expectation")
#: DP cells (``effective prompts x (capacity + 1) x (max_n - min_n + 1)``) :func:`dp_extras` fills a second,
#: measured on a shared 2-core CPU: 43-123 million (64 x 4,096 x 127: 119M/s; 256 x 15,873 x 127: 66M/s;
#: 64 x 16,385 x 511: 43M/s, the tables out of cache); the low end, so an estimate errs long.
DP_CELLS_PER_SECOND = 40e6
#: Seconds per allocation above which ``solver: dp`` is warned about (the greedy takes milliseconds) ...
DP_WARN_SECONDS = 5.0
#: ... and refused: a DP this slow holds every step for ten minutes or more.
DP_REFUSE_SECONDS = 600.0


# ---------------------------------------------------------------------------- value and cost
def value(n: Tensor | float, p: Tensor | float) -> Tensor:
    """Knapsack RL's ``Value(N, p) = (1 - p^N - (1 - p)^N) * p * (1 - p)^2`` (float64)."""
    n, p = torch.as_tensor(n, dtype=torch.float64), torch.as_tensor(p, dtype=torch.float64)
    return (1 - p ** n - (1 - p) ** n) * p * (1 - p) ** 2


def marginal(n: Tensor, p: Tensor) -> Tensor:
    """``Value(N + 1, p) - Value(N, p) = p (1 - p)^2 (p^N (1 - p) + (1 - p)^N p)``, in closed form: no
    cancellation, so strictly positive and strictly decreasing in ``N`` for ``0 < p < 1`` (the greedy's order
    is the objective's, not float rounding's)."""
    return p * (1 - p) ** 2 * (p ** n * (1 - p) + (1 - p) ** n * p)


def cost(p: Tensor, how: str = "probability", alpha: float = 0.9) -> Tensor:
    """The rollouts a prompt of success rate ``0 < p < 1`` needs: ``ln(1 - alpha) / ln(max(p, 1 - p))`` for a
    non-zero gradient with probability ``alpha`` (``probability``), or ``1 / (p (1 - p)) - 1`` until both
    outcomes are seen (``expectation``)."""
    p = p.to(torch.float64)
    if how == "probability":
        return math.log(1 - alpha) / torch.log(torch.maximum(p, 1 - p))
    return 1 / (p * (1 - p)) - 1


def even_split(amount: int, rows: Tensor, size: int) -> Tensor:
    """Long ``[size]``: ``amount`` spread over ``rows`` (indices, in row order): ``amount // len`` each and one
    more for the first ``amount % len`` (the official even split)."""
    out = torch.zeros(size, dtype=torch.long)
    if rows.numel() == 0 or amount <= 0:
        return out
    base, rest = divmod(int(amount), int(rows.numel()))
    out[rows] = base + (torch.arange(rows.numel()) < rest).to(torch.long)
    return out


def greedy_extras(p: Tensor, capacity: int, *, min_n: int, extra: int, objective: str) -> Tensor:
    """Long ``[E]``: extra rollouts (each ``0..extra``) of the effective prompts of rates ``p`` summing to
    ``capacity`` (at most ``E x extra``) that maximise the objective, on whole tensors.

    Each prompt's value is concave in its extra rollouts (its marginal gains decrease; under the official
    objective the first gain is ``Value(min_n + 1)``, the rest the same decreasing increments), so the
    ``capacity`` largest marginal gains over all prompts are an optimum: one stable sort of the ``[E, extra]``
    gains. Exact ties go to the earlier prompt, then its fewer rollouts."""
    e = p.numel()
    k = min(extra, capacity)
    if e == 0 or k <= 0:
        return torch.zeros(e, dtype=torch.long)
    p = p.to(torch.float64)[:, None]
    n = torch.arange(min_n, min_n + k, dtype=torch.float64)[None, :]  # gain of the (j+1)-th extra: N = min_n + j
    gains = marginal(n, p)
    if objective == "official":  # an extra of 0 is worth 0 there (the DP's k=0 branch), so the first is V(min_n+1)
        gains[:, 0] = value(min_n + 1, p[:, 0])
    order = torch.sort(gains.flatten(), descending=True, stable=True).indices[:capacity]
    return torch.bincount(order // k, minlength=e)


def official_gains(rate: float, min_n: int, extra: int) -> np.ndarray:
    """Float32 ``[extra]``: the official DP's gain of ``k = 1..extra`` extra rollouts at success rate ``rate``,
    ``(1 - r^(k + min_n) - (1 - r)^(k + min_n)) r (1 - r)^2`` evaluated as ``exploration_utils.py:383-386``
    does under NumPy 2: one float32 scalar operation at a time (the rate from its float32 array; NumPy 2 keeps
    a float32 scalar with a Python int in float32). Scalar on purpose: NumPy's SIMD array ``power`` rounds
    differently from its scalar one, so no vectorised form gives the same bits. Every operand is a float32
    scalar, so NumPy 1's promotion rules (float64) do not apply here."""
    one, r = np.float32(1), np.float32(rate)
    q = one - r
    q2 = q ** np.float32(2)
    return np.array([(one - r ** np.float32(k) - q ** np.float32(k)) * r * q2  # the official's order of operations
                     for k in range(min_n + 1, min_n + extra + 1)], dtype=np.float32)


def dp_extras(p: Tensor, capacity: int, *, min_n: int, extra: int, objective: str) -> tuple[Tensor, int]:
    """The official dynamic programme (``exploration_utils.py:345-414``, its pure-Python path as NumPy 2 runs
    it) bit for bit: gains in float32 (:func:`official_gains`), summed in float64, ties to the first option found
    (``k = 0``, then increasing ``k``), the largest reachable budget backtracked. Returns the extras and the
    budget it could not place (spread by the caller). A loop over the prompts, each a ``[capacity + 1, extra +
    1]`` maximum: ``O(E * capacity * extra)``, for reproduction only."""
    e = p.numel()
    dp = torch.full((capacity + 1,), float("-inf"), dtype=torch.float64)
    dp[0] = 0.0
    if e == 0 or capacity <= 0:
        return torch.zeros(e, dtype=torch.long), max(capacity, 0)
    choice = torch.zeros((e, capacity + 1), dtype=torch.int32)  # dp_size counts these tables' bytes
    rates = p.to(torch.float32).tolist()
    gains: dict[float, Tensor] = {}  # per distinct rate (rates are often k / 16): the scalar loop runs once each
    for j in range(e):  # inherent to the DP: each prompt's table row depends on the previous one's
        r = rates[j]
        if r not in gains:
            base = 0.0 if objective == "official" else float(official_gains(r, min_n - 1, 1)[0])  # Value(min_n)
            gains[r] = torch.cat([torch.tensor([base], dtype=torch.float64),
                                  torch.from_numpy(official_gains(r, min_n, extra).astype(np.float64))])
        padded = torch.cat([torch.full((extra,), float("-inf"), dtype=torch.float64), dp])
        cand = padded.unfold(0, extra + 1, 1).flip(1) + gains[r]  # cand[w, k] = dp[w - k] + gain[k]
        choice[j] = torch.argmax(cand, dim=1).to(torch.int32)  # the first maximum: the official strict '>'
        dp = cand.max(dim=1).values
    reachable = torch.nonzero(dp > float("-inf")).flatten()
    w = int(reachable.max())
    out = torch.zeros(e, dtype=torch.long)
    for j in range(e - 1, -1, -1):  # backtracking, one step per prompt
        k = int(choice[j, w])
        out[j] = k
        w -= k
    return out, capacity - int(out.sum())


def dp_size(prompts: int, capacity: int, extra: int) -> tuple[int, int]:
    """``(bytes, cells)`` of :func:`dp_extras` on ``prompts`` effective prompts sharing ``capacity`` extras of at
    most ``extra`` each: its int32 ``[E, capacity + 1]`` choices and, per prompt, the float64 ``[capacity + 1,
    extra + 1]`` candidates twice (the flipped window and its sum with the gains, alive together); the cells are
    its work per allocation."""
    width = (capacity + 1) * (extra + 1)
    return prompts * (capacity + 1) * 4 + 2 * width * 8, prompts * width


# ---------------------------------------------------------------------------- the estimate
class KnapsackRate(Scorer):
    """Knapsack RL's per-prompt success-rate estimate ``p`` from the prompt history (``rl_dataset.py``): the
    mean of the last visit's rewards if it had at least ``reward_buffer_length`` of them, else (robust
    epoch estimation) of the last ``reward_buffer_length`` rewards over the visits, most recent first; a
    reward counts as a success above 0.5 (Knapsack's -1/0/1 rewards: only 1). ``-1`` for a prompt whose
    estimate is not valid yet (fewer than ``min_buffer_length`` rewards seen; never seen included)."""

    requires: ClassVar = ("history_rewards", "history_reward_count", "history_sizes", "history_successes")
    timing: ClassVar = "pre_rollout"
    granularity: ClassVar = "prompt"
    uses_history: ClassVar = True
    params: ClassVar = {
        "reward_buffer_length": Param(int, 16, low=1, high=REWARD_WINDOW,
                                      doc="rewards the pooled estimate uses (the history keeps 16)"),
        "min_buffer_length": Param(int, 8, low=0, doc="rewards seen before the estimate is valid"),
        "epoch_estimation": Param(bool, True, doc="estimate from the last visit (false: always the pooled window)"),
        "robust_epoch_estimation": Param(bool, True,
                                         doc="a last visit of fewer rewards than the window pools older ones"),
    }
    reward_buffer_length: int
    min_buffer_length: int
    epoch_estimation: bool
    robust_epoch_estimation: bool

    def score(self, batch: Batch, step: int, **ctx: Any) -> Score:
        window = self.reward_buffer_length
        rewards = batch["history_rewards"][:, :window]
        count = batch["history_reward_count"].to(torch.long)
        pooled_n = count.clamp(max=window)
        ok = torch.arange(rewards.shape[1])[None, :] < pooled_n[:, None]
        pooled = ((rewards > SUCCESS_THRESHOLD) & ok).sum(-1).to(torch.float64) / pooled_n.clamp_min(1)
        size = batch["history_sizes"][:, 0].to(torch.long)
        last = batch["history_successes"][:, 0].to(torch.float64) / size.clamp_min(1)
        if not self.epoch_estimation:
            p = pooled
        elif self.robust_epoch_estimation:
            p = torch.where(size >= window, last, pooled)
        else:
            p = last
        p = torch.where(count > 0, p, 0.0)  # never seen: the official default state's 0.0
        valid = count >= self.min_buffer_length
        p = torch.where(valid & batch.valid_rows, p, -1.0)
        real = max(int(batch.valid_rows.sum()), 1)
        metrics = {"knapsack/valid": float((p >= 0).sum()) / real}
        return Score(values=p, granularity="prompt", metrics=metrics)


# ---------------------------------------------------------------------------- the allocation
class Knapsack(Allocator):
    """Knapsack RL's allocation (``exploration_utils.py:sampling_budget_by_knapsack``), see the module doc.

    With ``n`` the host's group size and ``p`` from ``knapsack_rate`` (``-1``: not valid): floors ``n`` (not
    valid), ``min_n`` (``0 < p < 1``, the effective prompts), ``negative_n`` (``p = 0``), ``positive_n``
    (``p = 1``); the rest of the budget ``R`` goes to the effective prompts by the value objective, unless
    their summed cost ``C`` (each capped at ``max_n``) is below ``R``: then ``R - C`` goes to the prompts of rate
    0 (new ones included when ``fallback_includes_new``) first (the fallback). Deliberate differences from the
    official code: a budget below the floors is refused (the official asserts later); the fallback with no
    prompt to take it hands the budget to the effective prompts (the official divides by zero, K5); budget
    beyond ``max_n`` per effective prompt goes to the others, never past ``max_n`` (the official spreads it past
    ``max_n``); no effective prompt and no prompt of rate 0 spreads the budget evenly (the official resets
    every prompt to ``n``, the same when the budget is plain GRPO's); ``solver: greedy`` (default) finds the
    objective's optimum on whole tensors, ties to the earlier prompt (``solver: dp`` is the official pure-Python
    DP as NumPy 2 runs it, its float32 gains and tie order, ``O(E * R * max_n)``; under NumPy 1, which the
    authors pin, or its Numba path, the official breaks some ties between equal rates otherwise).
    """

    requires: ClassVar = ()
    accepts: ClassVar = ("prompt",)
    uses_history: ClassVar = False
    intended_scorers: ClassVar = ("knapsack_rate",)
    params: ClassVar = {
        **ALLOCATION_PARAMS,
        "negative_n": Param((int, type(None)), None, low=0, doc="rollouts of a never-solved prompt (default min_n)"),
        "positive_n": Param((int, type(None)), None, low=0, doc="rollouts of an always-solved prompt (default min_n)"),
        "alpha": Param(float, 0.9, low=0.0, high=1.0, low_open=True, high_open=True,
                       doc="confidence of the probability cost estimate"),
        "cost_estimation": Param(str, "probability", choices=COSTS,
                                 doc="cost of an effective prompt (the fallback test)"),
        "allow_fallback": Param(bool, True, doc="budget the effective prompts cannot use goes to never-solved ones"),
        "fallback_includes_new": Param(bool, True,
                                       doc="new prompts count as never solved in the fallback (as the official code)"),
        "objective": Param(str, "official", choices=OBJECTIVES,
                           doc="official: an extra of 0 rollouts scores 0 (the DP's quirk); exact: Value(min_n)"),
        "solver": Param(str, "greedy", choices=SOLVERS,
                        doc="greedy: the optimum on whole tensors; dp: the official Python DP under NumPy 2 (slow)"),
    }
    negative_n: int | None
    positive_n: int | None
    alpha: float
    cost_estimation: str
    allow_fallback: bool
    fallback_includes_new: bool
    objective: str
    solver: str

    @classmethod
    def check_params(cls, values: Mapping[str, Any]) -> list[tuple[str, str]]:
        issues = super().check_params(values)
        for name in ("negative_n", "positive_n"):
            v = values[name]
            if v is not None and 0 < v < 2 and not values["singletons"]:
                issues.append((name, f"{name}={v} gives groups of one rollout; use 0, 2 or more, or singletons: true"))
            if v is not None and v > values["max_n"]:
                issues.append((name, f"{name}={v} exceeds max_n={values['max_n']}"))
        return issues

    def check_host(self, host: HostDescription) -> list[tuple[str, str]]:
        """What step 0 would refuse, known at validation from the host: every prompt is new then and gets the
        group size ``n``, which must lie in ``[min_n, max_n]``, and the budget must cover ``n`` per prompt."""
        issues = super().check_host(host)
        n, prompts = host.group_size, host.prompts_per_step
        if n is None:
            return issues
        if not self.min_n <= n <= self.max_n:
            bound, side = ("max_n", "more") if n > self.max_n else ("min_n", "less")
            issues.append((bound, f"new prompts get the group size {n} of host {host.name!r}, outside [min_n="
                           f"{self.min_n}, max_n={self.max_n}]; set {bound} to {n} or {side}"))
        if prompts is not None and self.budget is not None and self.budget < n * prompts:
            issues.append(("budget", f"the budget of {self.budget} rollouts is below the floors' {n * prompts} of a "
                           f"step of new prompts ({prompts} prompts x the group size {n} on host {host.name!r}), as "
                           f"every prompt is at step 0; raise budget to {n * prompts} or more"))
        return issues + self._dp_issues(host, warn=False)

    def host_warnings(self, host: HostDescription) -> list[tuple[str, str]]:
        return self._dp_issues(host, warn=True)

    def _dp_bound(self, host: HostDescription) -> tuple[str, int, int] | None:
        """``solver: dp``'s worst step on ``host``: ``(what, table bytes, cells)``, every prompt of the step
        effective (at most ``prompts_per_step``, else ``budget // min_n``) and the whole budget theirs; ``None``
        for the greedy or where the host does not say the step's size."""
        n, prompts = host.group_size, host.prompts_per_step
        budget = self.budget if self.budget is not None else (None if n is None or prompts is None else n * prompts)
        if self.solver != "dp" or budget is None:
            return None
        effective = prompts if prompts is not None else budget // self.min_n
        extra = self.max_n - self.min_n
        capacity = min(budget, effective * extra)
        nbytes, cells = dp_size(effective, capacity, extra)
        what = (f"solver: dp's tables (budget={budget:,} and max_n={self.max_n:,} over up to {effective:,} effective "
                f"prompts a step on host {host.name!r}: {effective:,} x {capacity + 1:,} x {extra + 1:,} DP cells)")
        return what, nbytes, cells

    def _dp_issues(self, host: HostDescription, *, warn: bool) -> list[tuple[str, str]]:
        """The DP's table beyond memory, or its time beyond :data:`DP_REFUSE_SECONDS`, refused (``warn=False``);
        its time beyond :data:`DP_WARN_SECONDS` warned about (``warn=True``)."""
        from dataflex_bus.memory import beyond_memory

        bound = self._dp_bound(host)
        if bound is None:
            return []
        what, nbytes, cells = bound
        fix = ("use solver: greedy (the same optimum on whole tensors, milliseconds), or a smaller budget or "
               "max_n")
        seconds = cells / DP_CELLS_PER_SECOND
        cost = (f"{what}, about {seconds:,.0f} s per allocation (at {DP_CELLS_PER_SECOND / 1e6:.0f} million cells "
                "a second, measured on a CPU core)")
        if warn:
            slow = DP_WARN_SECONDS < seconds <= DP_REFUSE_SECONDS and beyond_memory(
                nbytes, "", "", host.memory_limit) is None
            return [("solver", f"{cost}, every step; {fix}")] if slow else []
        refusal = beyond_memory(nbytes, what, fix, host.memory_limit)
        if refusal:
            return [("solver", refusal)]
        if seconds > DP_REFUSE_SECONDS:
            return [("solver", f"{cost}, beyond the {DP_REFUSE_SECONDS:,.0f} s a step may wait for it; {fix}")]
        return []

    def allocate(self, batch: Batch, score: Score, step: int, budget: Budget) -> Allocation:
        p = score.values.to(torch.float64)
        real = batch.valid_rows
        size = len(batch)
        n = budget.group_size
        neg_n = self.min_n if self.negative_n is None else self.negative_n
        pos_n = self.min_n if self.positive_n is None else self.positive_n
        valid = real & (p >= 0)
        new = real & ~valid
        effective = valid & (p > 0) & (p < 1)
        never = valid & (p == 0)
        solved = valid & (p == 1)
        if bool(new.any()) and n < 1:
            raise BatchFieldError(self.who, "budget_group_size", "new prompts get the host's group size, which this "
                                  "host does not give")
        if bool(new.any()) and not self.min_n <= n <= self.max_n:
            raise BatchFieldError(self.who, "budget_group_size", f"new prompts get the host's group size {n}, outside "
                                  f"[min_n={self.min_n}, max_n={self.max_n}]")
        floors = (torch.where(new, n, 0) + torch.where(effective, self.min_n, 0) + torch.where(never, neg_n, 0)
                  + torch.where(solved, pos_n, 0)).to(torch.long)
        total = budget.rollouts
        left = total - int(floors.sum())
        if left < 0:
            raise BatchFieldError(self.who, "budget", f"the budget of {total} rollouts is below the floors' "
                                  f"{int(floors.sum())}: {int(effective.sum())} effective prompts x "
                                  f"min_n={self.min_n}, "
                                  f"{int(new.sum())} new x the group size {n}, {int(never.sum())} never solved x "
                                  f"negative_n={neg_n}, {int(solved.sum())} always solved x positive_n={pos_n}; "
                                  "raise budget or lower those")
        rate0 = never | (new if self.fallback_includes_new else torch.zeros_like(new))
        extras = torch.zeros(size, dtype=torch.long)
        fallback, ratio = False, 1.0
        eff = torch.nonzero(effective).flatten()
        if left > 0 and eff.numel() == 0:
            zero = torch.nonzero(rate0).flatten()
            # no prompt of rate 0 either: the official resets every prompt to n, which equals an even split of
            # the budget when it is plain GRPO's; the even split also spends any other budget exactly.
            extras += even_split(left, zero if zero.numel() else torch.nonzero(real).flatten(), size)
            left = 0
        elif left > 0:
            c = cost(p[eff], self.cost_estimation, self.alpha)
            # the official stores costs in float32 and truncates: int(min(max_n, cost))
            capped = torch.clamp(c.to(torch.float32), max=float(self.max_n)).to(torch.float64).trunc()
            estimated = int(capped.sum())
            if estimated < left and self.allow_fallback:
                takers = torch.nonzero(rate0).flatten()
                if takers.numel() == 0:
                    takers = torch.nonzero(real & ~effective).flatten()
                if takers.numel():  # none at all: the whole budget stays with the effective prompts (official: 1/0)
                    fallback, ratio = True, estimated / left
                    extras += even_split(left - estimated, takers, size)
                    left = estimated
            k = self.max_n - self.min_n
            capacity = min(left, eff.numel() * k)
            if self.solver == "dp":
                got, unplaced = dp_extras(p[eff], capacity, min_n=self.min_n, extra=k, objective=self.objective)
                got += even_split(unplaced, torch.arange(eff.numel()), eff.numel())
            else:
                got = greedy_extras(p[eff], capacity, min_n=self.min_n, extra=k, objective=self.objective)
            extras[eff] += got
            left -= capacity
        counts = floors + extras
        if left > 0:
            counts = _spread_capped(counts, left, real & ~effective, self.max_n, self.who)
        metrics = {"knapsack/fallback": float(fallback), "knapsack/fallback_ratio": ratio,
                   "knapsack/effective": float(effective.sum()), "knapsack/new": float(new.sum()),
                   "knapsack/never_solved": float(never.sum()), "knapsack/always_solved": float(solved.sum())}
        return Allocation(counts=torch.where(real, counts, 0), metrics=metrics)


def _spread_capped(counts: Tensor, left: int, takers: Tensor, max_n: int, who: str) -> Tensor:
    """Budget the effective prompts cannot take within ``max_n`` spread over the other prompts (``takers``, bool)
    evenly in row order, none past ``max_n``: rounds of even splits over the prompts with room left (at most
    one round per prompt). The official spreads it over the effective prompts past ``max_n``."""
    counts = counts.clone()
    while left > 0:
        room = torch.nonzero(takers & (counts < max_n)).flatten()
        if room.numel() == 0:
            raise BatchFieldError(who, "budget", f"{left} rollouts of the budget are left with every prompt at max_n="
                                  f"{max_n}; lower the budget or raise max_n")
        add = torch.minimum(even_split(left, room, counts.numel()), max_n - counts)
        counts += add
        left -= int(add.sum())
    return counts


class Speed(Allocator):
    """SPEED (``data_controller.py``): after the screening round (the host's group size for every prompt) a
    prompt qualifies iff ``0 < k < G`` of its rollouts are right; each qualified group gets ``n_continue`` more
    rollouts in a second round of the same step, appended to it (``N_init + N_cont`` rows, the screening
    rows reused), and only qualified groups go on. Fed ``group_solve_rate`` (integer counts). At most the
    groups the step still needs are continued, in arrival order (under ``dataflex.refill`` the rest of a
    round's qualified groups are dropped: the official code carries them to later steps, which needs a
    host-side prompt buffer). No ``N_cont % N_init`` rule: the host generates ``n_continue`` rollouts of the
    prompt in one request, where the official code repeats the prompt ``N_cont / N_init`` times."""

    accepts: ClassVar = ("prompt",)
    needs_groups: ClassVar = True
    min_timing: ClassVar = "post_reward"
    rounds: ClassVar = 2
    per_group_rule: ClassVar = True  # a group qualifies, commits or exits on its own counts
    intended_scorers: ClassVar = ("group_solve_rate",)
    params: ClassVar = {
        **ALLOCATION_PARAMS,
        "n_continue": Param(int, 16, low=1, doc="rollouts a qualified prompt gets in the continuation round"),
    }
    n_continue: int

    def continuation_cap(self) -> str:
        return "dispatch"  # the groups still needed, first in arrival (dispatch) order

    def allocate(self, batch: Batch, score: Score, step: int, budget: Budget) -> Allocation:
        if score.counts is None or score.totals is None:
            raise BatchFieldError(self.who, "score.counts", "needs the integer right/total counts of each group "
                                  "(scorer group_solve_rate)")
        real = batch.valid_rows
        k, g = score.counts.to(torch.long), score.totals.to(torch.long)
        qualified = real & (k > 0) & (k < g)
        counts = torch.zeros(len(batch), dtype=torch.long)
        metrics = {"speed/qualified_groups": float(_groups(batch, qualified))}
        if budget.round == 0:
            # the groups still needed, first in arrival order (a group's rank by its first row)
            gi = batch.group_index
            first = torch.full((batch.num_groups,), len(batch), dtype=torch.long).scatter_reduce(
                0, gi.clamp_min(0)[real], torch.arange(len(batch))[real], "amin")
            q_group = torch.zeros(batch.num_groups, dtype=torch.bool)
            q_group[gi[qualified]] = True
            order = torch.argsort(torch.where(q_group, first, len(batch) + 1), stable=True)
            chosen = torch.zeros(batch.num_groups, dtype=torch.bool)
            chosen[order[: min(budget.prompts, int(q_group.sum()))]] = True
            go_on = qualified & chosen[gi.clamp_min(0)]
            counts = torch.where(go_on, self.n_continue, 0)
            metrics["speed/continued_groups"] = float(chosen.sum())
            metrics["speed/unused_qualified_groups"] = float(int(q_group.sum()) - int(chosen.sum()))
            return Allocation(counts=counts, keep=go_on, metrics=metrics)
        return Allocation(counts=counts, keep=qualified, metrics=metrics)


def _groups(batch: Batch, rows: Tensor) -> int:
    return int(torch.unique(batch.group_index[rows]).numel())
