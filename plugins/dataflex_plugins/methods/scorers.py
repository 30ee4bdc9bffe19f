"""Built-in scorers: what a method measures about each rollout, prompt or token.

Every scorer works on whole tensors of the batch (no loop over rows or groups) and never lets a
padding row contribute: padding rows score 0 (they are masked out by every actuator anyway).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor

from dataflex_bus import jagged
from dataflex_bus.batch import Batch
from dataflex_bus.components import Param, Score, Scorer
from dataflex_bus.ops import gather_segments, segment_sum

from ._checks import check_token_shape


def jagged_tokens(batch: Batch, name: str) -> tuple[Tensor, Tensor] | None:
    """Field ``name`` as held jagged (verl's driver) and bool flags of its real tokens (response mask, real rows),
    one per value; ``None`` when the batch holds it dense or its rows do not line up with the mask's."""
    held, mask = batch.jagged_field(name), batch.jagged_field("response_mask")
    if held is None or mask is None or held.values().dim() != 1 or not jagged.same_rows(held, mask):
        return None
    valid = mask.values().ne(0)
    if bool(batch.is_padding.any()):
        valid &= torch.repeat_interleave(batch.valid_rows, jagged.row_lengths(mask), output_size=valid.numel())
    return held, valid


class RewardDifficulty(Scorer):
    """``s_i = r_i``: the outcome reward of each rollout, as the host trains on it (``Batch.rewards``:
    ``sum_t rm_scores * response_mask`` on the shim and TRL, the whole row's sum on verl).

    The simplest difficulty signal; PODS (``max_variance``) and ``reward_gap`` are defined on it.
    """

    requires: ClassVar = ("rm_scores", "response_mask")
    timing: ClassVar = "post_reward"
    granularity: ClassVar = "response"
    params: ClassVar = {}

    def score(self, batch: Batch, step: int, **ctx: Any) -> Score:
        r = batch.rewards
        return Score(values=r, granularity="response")


class GroupSolveRate(Scorer):
    """``s_i = k_g / G_g`` with ``k_g = #{i in g : r_i > success_threshold}``, broadcast to the group.

    The integer counts ``k_g`` (``Score.counts``) and ``G_g`` (``Score.totals``) travel with the score,
    one int64 per row, so a band selector decides boundaries on integers (float32 ``7/10`` is below
    ``0.7``). A row whose reward is NaN/inf scores NaN, so the pipeline's ``on_nonfinite`` policy sees it
    instead of the row silently counting as unsolved.
    """

    requires: ClassVar = ("rm_scores", "response_mask", "uid")
    timing: ClassVar = "post_reward"
    granularity: ClassVar = "prompt"
    needs_groups: ClassVar = True
    params: ClassVar = {
        "success_threshold": Param(float, 0.5, doc="a rollout counts as solved when its reward exceeds this"),
    }
    success_threshold: float

    def score(self, batch: Batch, step: int, **ctx: Any) -> Score:
        r = batch.rewards
        gi, ng = batch.group_index, batch.num_groups
        solved = (r > self.success_threshold).to(torch.long)
        k = segment_sum(solved, gi, ng)
        g = batch.group_sizes
        counts = gather_segments(k, gi, fill=0)
        totals = gather_segments(g, gi, fill=0)
        values = (counts.double() / totals.clamp_min(1)).to(torch.float32)
        # A NaN reward would silently count as "not solved": mark its row non-finite instead, so the
        # pipeline's on_nonfinite policy sees it (error naming this scorer, or drop the row and rescore).
        finite = torch.isfinite(r)
        if not bool(finite.all()):
            values = torch.where(finite, values, torch.full((), float("nan")))
        metrics: dict[str, float] = {}
        if ng:
            mean, all_solved, none_solved = torch.stack(
                [(k / g).mean(), (k == g).sum() / ng, (k == 0).sum() / ng]).tolist()
            metrics = {"solve_rate/mean": mean, "solve_rate/all_solved": all_solved,
                       "solve_rate/none_solved": none_solved}
        return Score(values=values, granularity="prompt", counts=counts, totals=totals, metrics=metrics)


class AdvantageMagnitude(Scorer):
    """``s_i = agg_t |A[i, t]|`` over the rollout's valid tokens (``mean`` divides by ``max(L_i, 1)``).

    Under GRPO the advantage is constant over a rollout's tokens, so ``agg=mean`` is exactly the
    rollout's ``|A_i|`` (DUMP's statistic). Tokens outside the mask are ignored even if they hold NaN.
    """

    requires: ClassVar = ("advantages", "response_mask")
    timing: ClassVar = "post_advantage"
    granularity: ClassVar = "response"
    params: ClassVar = {"agg": Param(str, "mean", choices=("mean", "sum", "max"))}
    agg: str

    def score(self, batch: Batch, step: int, **ctx: Any) -> Score:
        tm = batch.token_mask
        adv = batch["advantages"]
        # where() rather than multiply: NaN * 0 would leak a masked-out NaN into the row score.
        mag = torch.where(tm, adv, 0.0).abs_()
        if self.agg == "max":
            values = mag.amax(-1)
        else:
            values = mag.sum(-1)
            if self.agg == "mean":
                values = values / batch.lengths.clamp_min(1).to(values.dtype)
        return Score(values=values.to(torch.float32), granularity="response")


class TokenProb(Scorer):
    """``s[i, t] = exp(old_log_probs[i, t])`` on valid tokens, 0 elsewhere (token granularity).

    ``old_log_probs`` exist only after the actor's recompute, which verl runs after the rollout, so the
    timing is ``post_advantage``.
    """

    requires: ClassVar = ("old_log_probs", "response_mask")
    timing: ClassVar = "post_advantage"
    granularity: ClassVar = "token"
    params: ClassVar = {}

    def score(self, batch: Batch, step: int, **ctx: Any) -> Score:
        tokens = jagged_tokens(batch, "old_log_probs")
        if tokens is not None:  # verl's driver: on the tokens alone, one dense score, the field never padded
            held, valid = tokens
            values = torch.where(valid, held.values(), float("-inf")).exp_()
            return Score(values=jagged.dense(jagged.like(held, values)), granularity="token")
        lp = batch["old_log_probs"]
        if tuple(lp.shape) != tuple(batch.token_mask.shape):
            from dataflex_bus.errors import BatchFieldError

            raise BatchFieldError(f"scorer {self.name!r}", "old_log_probs",
                                  f"expected shape {tuple(batch.token_mask.shape)}, got {tuple(lp.shape)}")
        # exp(-inf) = 0 off the mask; a NaN/inf on a valid token stays visible to the finiteness check.
        values = torch.where(batch.token_mask, lp, float("-inf")).exp_()
        return Score(values=values, granularity="token")


class TokenEntropy(Scorer):
    """``s[i, t] = entropy[i, t]`` on valid tokens, 0 elsewhere (token granularity): the host's per-token
    entropy of the policy, in nats over the whole vocabulary, on temperature-scaled logits (verl writes it with
    the old log-probs; the shim computes it with its old log-probs when asked).

    Metrics describe the distribution "Beyond the 80/20 Rule" reads (arXiv 2506.01939: for Qwen3-8B over half
    of the tokens have H < 0.01): ``entropy/mean`` and ``entropy/below_0.01``, the share of valid tokens below
    0.01 nats.
    """

    requires: ClassVar = ("entropy", "response_mask")
    timing: ClassVar = "post_advantage"
    granularity: ClassVar = "token"
    params: ClassVar = {}

    def score(self, batch: Batch, step: int, **ctx: Any) -> Score:
        tokens = jagged_tokens(batch, "entropy")
        if tokens is not None:
            return self._score_tokens(*tokens)
        entropy = batch["entropy"]
        check_token_shape(self.who, "entropy", entropy, batch)
        tm = batch.token_mask
        # where(), not a product: a NaN past a response's end must not reach the score (float32 holds bf16 exactly).
        values = torch.where(tm, entropy.to(torch.float32), 0.0)
        n = int(batch.lengths.sum())
        metrics = {}
        if n:
            total = float(values.sum(-1).double().sum())  # row-wise float32, combined in float64: no [B, T] copy
            below = int(torch.count_nonzero((values < 0.01) & tm))
            metrics = {"entropy/mean": total / n, "entropy/below_0.01": below / n}
        return Score(values=values, granularity="token", metrics=metrics)

    def _score_tokens(self, entropy: Tensor, valid: Tensor) -> Score:
        """:meth:`score` from jagged ``entropy`` and its real tokens ``valid`` (verl's driver): the masking and the
        metrics on the tokens alone (a sixth of ``[B, T]`` at log-uniform lengths), then one dense float32 score;
        neither field is padded."""
        values = torch.where(valid, entropy.values().to(torch.float32), 0.0)
        n = int(torch.count_nonzero(valid))
        metrics = {}
        if n:
            below = int(torch.count_nonzero((values < 0.01) & valid))
            metrics = {"entropy/mean": float(values.sum()) / n, "entropy/below_0.01": below / n}
        return Score(values=jagged.dense(jagged.like(entropy, values)), granularity="token", metrics=metrics)
