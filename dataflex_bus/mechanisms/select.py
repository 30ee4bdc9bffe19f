"""Mechanism ``select``: which rows enter the update (at ``on_prompts``: which candidate prompts are generated).

A selector keeps rows. Fed a ``pre_rollout`` score it acts at ``on_prompts``, before anything is generated;
a selection that keeps or drops whole groups acts at ``on_rollout``, before any further compute is spent on
the groups it drops; any other selection acts at ``on_advantage``, where a dropped row is masked out of the
loss after its group's advantage (dropping part of a group earlier would change the GRPO baseline of the
rest). Subset selectors (PODS) also return advantages recomputed over the rows they keep. A token selector
(``Selector.selects_tokens``, fed token-level scores) keeps response tokens instead: it acts at
``on_advantage``, and the host kit carries its mask out through the loss weights (see
:func:`~dataflex_bus.carry.carry_out_advantage`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

from ..components import Actuator, Scorer
from ..errors import BatchFieldError, ConfigIssue
from .base import Mechanism, MethodRun, MethodSettings, Need, latest_event, timing_after

if TYPE_CHECKING:
    from torch import Tensor

    from ..batch import Batch
    from ..components import Score
    from ..decision import Decision
    from ..host import HostDescription


@dataclass
class Selection:
    """A selector's output: ``keep`` is bool ``[B]`` (padding rows are never kept).

    Subset selectors that keep part of a group also return the recomputed ``advantages`` ``[B, T]``. A token
    selector (:attr:`Selector.selects_tokens`) returns ``tokens``, bool ``[B, T]``: the response tokens whose
    policy-gradient term trains, with ``keep`` the rows left with a kept token; ``token_weights`` (float
    ``[B, T]``, ``None``: 1) multiply the kept tokens' loss (its normalisation, e.g. ``N / K``); ``mask_kl``
    asks for the tokens left out to leave the KL and entropy terms too.
    """

    keep: Tensor
    advantages: Tensor | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    tokens: Tensor | None = None
    token_weights: Tensor | None = None
    mask_kl: bool = False


class Selector(Actuator):
    """Mechanism ``select``: which rows enter the update (at ``on_prompts``: which candidate prompts are
    generated)."""

    kind: ClassVar[str] = "selector"
    #: A selection only needs its score: fed a ``pre_rollout`` score it acts before generation.
    min_timing: ClassVar[str] = "pre_rollout"
    #: Returns recomputed ``advantages`` over the rows it keeps (a subset selector such as PODS).
    rewrites_advantages: ClassVar[bool] = False
    #: Drops exactly the zero-variance groups (what verl's own ``algorithm.filter_groups`` evicts).
    filters_zero_variance: ClassVar[bool] = False
    #: Selects response tokens, not rows (fed token-level scores; acts at ``on_advantage``): its
    #: :class:`Selection` holds ``tokens``.
    selects_tokens: ClassVar[bool] = False

    def candidates_per_prompt(self) -> float:
        """Candidates this selection wants to compare per prompt it keeps, in one draw (a top-B selector over a
        pool of ``ratio x B``); the host kit draws that many at once (bounded by ``dataflex.max_oversample``)."""
        return 1.0

    @classmethod
    def keeps_whole_groups(cls, granularity: str) -> bool:
        """True if, fed scores of ``granularity``, this selector always keeps or drops whole groups.

        Only such a selection may run at ``on_rollout``: dropping single rows before the advantage is
        computed would change the GRPO baseline of the rows left in their group. Any other selection runs
        at ``on_advantage``, where a dropped row is masked out of the loss after its group's advantage.
        """
        return False

    def select(self, batch: Batch, score: Score, step: int) -> Selection:
        raise NotImplementedError(f"{type(self).__name__}.select")


class Select(Mechanism):
    name: ClassVar[str] = "select"
    kind: ClassVar[str] = "selector"
    base: ClassVar[type[Actuator]] = Selector
    summary: ClassVar[str] = "which rollouts enter the update (before generation: which prompts are generated)"
    before_generation: ClassVar[bool] = True
    drops_rows: ClassVar[bool] = True

    def event(self, scorer: type[Scorer], actuator: type[Actuator]) -> str:
        event = latest_event(scorer.timing, actuator.min_timing)
        if event == "on_rollout" and not (issubclass(actuator, Selector)
                                          and actuator.keeps_whole_groups(scorer.granularity)):
            # Row-level drops before the advantage would shift the GRPO baseline of the rows left.
            event = "on_advantage"
        if _selects_tokens(actuator) and event in ("on_prompts", "on_rollout"):
            # A token mask is carried out in the loss, which exists from on_advantage on.
            event = "on_advantage"
        return event

    def events(self, actuator: type[Actuator]) -> dict[str, str]:
        from ..host import EVENT_FIELDS

        def readable(event: str) -> bool:
            return set(actuator.requires) <= EVENT_FIELDS[event]

        out = {}
        if actuator.min_timing == "pre_rollout" and readable("on_prompts"):
            out["on_prompts"] = "fed a pre_rollout score (before generation)"
        if actuator.min_timing in ("pre_rollout", "post_reward") and readable("on_rollout") and issubclass(
                actuator, Selector):
            whole = [g for g in actuator.accepts if actuator.keeps_whole_groups(g)]
            if whole:
                out["on_rollout"] = f"fed {' or '.join(whole)}-level scores from a post_reward scorer"
        if readable("on_advantage"):
            out["on_advantage"] = ""
        return out

    def needs(self, method: MethodSettings, scorer: type[Scorer], actuator: type[Actuator]) -> dict[str, Need]:
        out: dict[str, Need] = {}
        if scorer.timing == "pre_rollout" and self.event(scorer, actuator) == "on_prompts":
            out["prompt_selection"] = Need("selects prompts before generation (on_prompts)", at="scorer.name",
                                           instead="select after the rollouts instead")
        if _selects_tokens(actuator):
            out["loss_weights"] = Need(f"{actuator.kind} {method.actuator.name!r} selects tokens through per-token "
                                       "loss weights", at="actuator.name")
        return out

    def check(self, method: MethodSettings, scorer: type[Scorer], actuator: type[Actuator], host: HostDescription,
              key: str) -> list[ConfigIssue]:
        issues = []
        sname, aname = method.scorer.name, method.actuator.name
        if scorer.timing == "pre_rollout":
            if scorer.needs_groups:
                issues.append(ConfigIssue(f"{key}.scorer.name", f"scorer {sname!r} runs pre_rollout but needs groups "
                                          "of rollouts, which do not exist before generation"))
            event = self.event(scorer, actuator)
            if event != "on_prompts":
                issues.append(ConfigIssue(
                    f"{key}.actuator.name",
                    f"scorer {sname!r} runs pre_rollout, but {actuator.kind} {aname!r} can act no earlier than "
                    f"{actuator.min_timing} ({event}); pair a pre_rollout scorer with a selector that acts on its "
                    "score alone"))
        elif actuator.uses_history and any(f.startswith("history_") for f in actuator.requires):
            issues.append(ConfigIssue(f"{key}.scorer.name", f"{actuator.kind} {aname!r} selects prompts before "
                                      f"generation from their history; scorer {sname!r} runs {scorer.timing}: pair it "
                                      "with a pre_rollout scorer (such as zero_variance_streak)"))
        if timing_after(scorer.timing, "post_advantage"):
            issues.append(ConfigIssue(f"{key}.scorer.name",
                                      f"scorer {sname!r} runs {scorer.timing}, after the update it would select for"))
        issues.extend(_token_issues(scorer, actuator, key, sname, aname))
        return issues

    def check_stack(self, entries: Sequence[tuple[str, type[Actuator]]]) -> list[ConfigIssue]:
        issues = []
        rewriters = [k for k, cls in entries if getattr(cls, "rewrites_advantages", False)]
        if len(rewriters) > 1:
            issues.append(ConfigIssue(rewriters[1], f"{rewriters[0]} already recomputes advantages over the rows "
                                      "it keeps; two subset selectors would overwrite each other's advantages"))
        tokens = [k for k, cls in entries if _selects_tokens(cls)]
        if len(tokens) > 1:
            issues.append(ConfigIssue(tokens[1], f"{tokens[0]} already selects tokens; a stack may hold one token "
                                      "selection (each normalises the loss over the tokens it keeps)"))
        return issues

    def apply(self, run: MethodRun, batch: Batch, step: int, decision: Decision) -> None:
        import torch

        view, score, dropped = run.score(batch, step, decision.metrics)
        actuator = run.actuator
        assert isinstance(actuator, Selector)
        sel = run.call("actuator", actuator.select, view, score, step)
        if actuator.selects_tokens:
            _apply_tokens(run, batch, view, sel, step, decision, dropped)
            return
        keep = sel.keep.to(torch.bool)
        if keep.shape != (len(view),):
            raise BatchFieldError(actuator.who, "keep", f"expected shape ({len(view)},), got {tuple(keep.shape)}")
        keep = keep & view.valid_rows
        metrics = decision.metrics
        p = run.prefix
        real = int(view.valid_rows.sum())
        kept = int(keep.sum())
        metrics[f"{p}kept_fraction"] = kept / real if real else 0.0
        metrics[f"{p}kept_rows"] = float(kept)
        metrics[f"{p}kept_tokens"] = float(view.lengths[keep].sum()) if "response_mask" in view.fields else 0.0
        metrics[f"{p}kept_groups"] = float(torch.unique(view.group_index[keep]).numel())
        for k, v in sel.metrics.items():
            metrics[f"{p}{k}"] = float(v)
        if run.event == "on_prompts" or run.refill:
            # Skipping every candidate of one draw (or every group of one refill round) is not an empty
            # selection: the host draws more; on_empty (max_oversample spent) or on_exhaust (rounds spent)
            # decides later (the host kit's PromptFill and GroupFill).
            if dropped is not None:
                decision.drop(dropped)
            if run.refill:
                _check_whole_groups(actuator, view, keep)
            decision.restrict(keep)
            return
        if run.empty(batch, keep, step, decision, dropped):
            return
        if run.event == "on_rollout":
            _check_whole_groups(actuator, view, keep)
        decision.restrict(keep, on_empty=run.config.on_empty)
        if sel.advantages is not None:
            view.check_finite(actuator.who, "advantages", sel.advantages)
            decision.advantages = sel.advantages


def _selects_tokens(actuator: type[Actuator]) -> bool:
    return issubclass(actuator, Selector) and actuator.selects_tokens


def _token_issues(scorer: type[Scorer], actuator: type[Actuator], key: str, sname: str,
                  aname: str) -> list[ConfigIssue]:
    """Token scores feed token selectors only (a token selection needs the host's ``loss_weights``: see
    :meth:`Select.needs`)."""
    # (A selector not accepting token scores at all is refused by the granularity check already.)
    if scorer.granularity == "token" and "token" in actuator.accepts and not _selects_tokens(actuator):
        return [ConfigIssue(f"{key}.actuator.name", f"scorer {sname!r} gives token-level scores, but "
                            f"{actuator.kind} {aname!r} keeps rows; feed it a row score, or use a token "
                            "selector (such as top_entropy)")]
    return []


def _apply_tokens(run: MethodRun, batch: Batch, view: Batch, sel: Selection, step: int, decision: Decision,
                  dropped: Tensor | None) -> None:
    """A token selection into ``decision``: its mask and normalisation weights. Only a method keeping no token
    at all is an empty selection (``on_empty``); under ``mask_kl`` a row left without a kept token has nothing
    left in the loss and is dropped like any row."""
    import torch

    from .weights import expand_weights

    who = run.actuator.who
    if sel.tokens is None:
        raise BatchFieldError(who, "tokens", "a token selector (selects_tokens) must return Selection.tokens")
    real = view.token_mask
    if tuple(sel.tokens.shape) != tuple(real.shape):
        raise BatchFieldError(who, "tokens", f"expected shape {tuple(real.shape)}, got {tuple(sel.tokens.shape)}")
    tokens = sel.tokens.to(torch.bool) & real
    rows = tokens.any(dim=1)
    metrics, p = decision.metrics, run.prefix
    # count_nonzero: a bool sum over [B, T] costs 20x more
    n_real, n_rows, n_tokens, n_kept = (int(x) for x in torch.stack(
        [view.valid_rows.sum(), rows.sum(), view.lengths.sum(), torch.count_nonzero(tokens)]).tolist())
    metrics[f"{p}kept_fraction"] = n_rows / n_real if n_real else 0.0
    metrics[f"{p}kept_rows"] = float(n_rows)
    metrics[f"{p}kept_tokens"] = float(n_kept)
    metrics[f"{p}kept_token_fraction"] = n_kept / n_tokens if n_tokens else 0.0
    metrics[f"{p}kept_groups"] = float(torch.unique(view.group_index[rows]).numel())
    for k, v in sel.metrics.items():
        metrics[f"{p}{k}"] = float(v)
    if run.empty(batch, rows, step, decision, dropped):
        return
    policy = run.config.on_empty
    decision.keep_tokens(tokens, mask_kl=sel.mask_kl, on_empty=policy)
    if sel.mask_kl:
        decision.restrict(rows, on_empty=policy)
    if sel.token_weights is not None:
        weights, _ = expand_weights(sel.token_weights, view, who)
        decision.scale(weights)


def _check_whole_groups(actuator: Actuator, batch: Batch, keep: Tensor) -> None:
    """At ``on_rollout`` a selector must keep or drop whole groups (it promised to)."""
    import torch

    from ..ops import segment_max, segment_min

    k = keep.to(torch.float32)
    gi, n = batch.group_index, batch.num_groups
    split = segment_max(k, gi, n) != segment_min(k, gi, n)
    if bool(split.any()):
        raise BatchFieldError(actuator.who, "keep",
                              f"split {int(split.sum())} group(s) at on_rollout although it declares "
                              "keeps_whole_groups; dropping part of a group before the advantage would "
                              "change the GRPO baseline of the rest")
