"""Contract checks every component of a kind must pass, and a one-call way to apply a method.

Each ``check_*`` function runs the component on a realistic batch (mixed group sizes, padding rows,
two domains) and asserts what the bus relies on: declared attributes are valid, outputs have the right
shape, padding rows never influence or receive anything, results are finite and deterministic. They
raise ``AssertionError`` with a message naming the component and the broken rule, so they read well in
a pack's own tests::

    def test_contract():
        check_scorer(MyScorer())
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from ..components import GRANULARITIES, TIMINGS, Component, Score, Scorer
from ..mechanisms.mix import Mixer
from ..mechanisms.reweight import Reweighter
from ..mechanisms.select import Selector
from .factories import make_batch, make_prompt_batch

if TYPE_CHECKING:
    from ..batch import Batch
    from ..decision import Decision
    from ..host import HostDescription
    from ..registry import Registry


def _default_batch() -> Batch:
    return make_batch(groups=6, group_size=4, mixed_group_sizes=True, padding_rows=2, domains=2, seed=7)


C = TypeVar("C", bound=Component)


def _instance(component: C | type[C]) -> C:
    return component() if isinstance(component, type) else component


def _label(component: Component) -> str:
    return f"{component.kind or 'component'} {component.name or type(component).__name__!r}"


def apply_method(block: Mapping[str, Any], batch: Batch, *, step: int = 0, registry: Registry | None = None,
                 host: HostDescription | None = None) -> Decision:
    """Build the ``dataflex`` block (by component names) and apply it to ``batch`` at ``step``.

    Names resolve through the installed plugins plus in-process registrations (pass ``registry`` to use
    another one); the block is checked against ``host`` (default: any host). A mix block gets the batch's
    domain names unless it lists ``domains``.
    """
    from ..pipeline import build_pipeline

    pipeline = build_pipeline(block, registry, host=host)
    if isinstance(pipeline.actuator, Mixer) and not pipeline.config.domains:
        pipeline.set_domains(batch.domain_names)
    return pipeline.apply(batch, step)


def check_scorer(scorer: Scorer | type[Scorer], batch: Batch | None = None, *, step: int = 0) -> Score:
    """Assert the scorer contract on ``batch`` (a mixed, padded default when omitted); returns the score."""
    scorer = _instance(scorer)
    who = _label(scorer)
    assert scorer.timing in TIMINGS, f"{who}: timing {scorer.timing!r} is not one of {list(TIMINGS)}"
    assert scorer.granularity in GRANULARITIES, (
        f"{who}: granularity {scorer.granularity!r} is not one of {list(GRANULARITIES)}")
    assert all(isinstance(f, str) for f in scorer.requires), f"{who}: requires must list field names"
    if batch is None:
        batch = make_prompt_batch() if scorer.timing == "pre_rollout" else _default_batch()
    batch.require(who, scorer.requires)
    score = _wrap(scorer, scorer.score(batch, step))
    assert score.granularity == scorer.granularity, (
        f"{who}: declared granularity {scorer.granularity!r} but returned {score.granularity!r}")
    values = score.values
    B = len(batch)
    T = batch.token_mask.shape[1] if score.granularity == "token" else 0
    expected = {"prompt": (B,), "response": (B,), "token": (B, T), "domain": (len(batch.domain_names),)}
    assert tuple(values.shape) == expected[score.granularity], (
        f"{who}: {score.granularity}-level values must have shape {expected[score.granularity]}, "
        f"got {tuple(values.shape)}")
    if score.granularity in ("prompt", "response", "token"):
        real = values[batch.valid_rows]
        if score.granularity == "token":
            real = values[batch.token_mask]
        assert bool(torch.isfinite(real.double()).all()), f"{who}: non-finite values on real rows/tokens"
    if score.granularity == "prompt":
        gi = batch.group_index
        valid = gi >= 0
        first = torch.full((batch.num_groups,), float("nan"), dtype=torch.float64)
        first.scatter_reduce_(0, gi[valid], values[valid].double(), reduce="amax", include_self=False)
        low = torch.full_like(first, float("nan"))
        low.scatter_reduce_(0, gi[valid], values[valid].double(), reduce="amin", include_self=False)
        assert torch.equal(first, low), f"{who}: prompt-level values differ within a group"
    for name in ("counts", "totals"):
        extra = getattr(score, name)
        if extra is not None:
            assert extra.shape[0] == B, f"{who}: Score.{name} must have one entry per row"
    again = _wrap(scorer, scorer.score(batch, step))
    assert torch.equal(torch.nan_to_num(again.values.double()), torch.nan_to_num(values.double())), (
        f"{who}: two calls on the same batch disagree (scores must be deterministic)")
    if bool(batch.is_padding.any()) and score.granularity != "domain":
        bare = batch.select(batch.valid_rows)
        trimmed = _wrap(scorer, scorer.score(bare, step)).values
        ours = values[batch.valid_rows]
        assert torch.allclose(trimmed.double(), ours.double(), equal_nan=True), (
            f"{who}: padding rows changed the scores of real rows (padding must be excluded)")
    return score


def _wrap(scorer: Scorer, result: Any) -> Score:
    """A plain tensor is a valid return value (values at the declared granularity); the checks that
    follow assert its shape."""
    who = _label(scorer)
    assert isinstance(result, (Score, torch.Tensor)), (
        f"{who}: score() must return a Score or a tensor, got {type(result).__name__}")
    return result if isinstance(result, Score) else Score(result, scorer.granularity)


def _score_for(scorer: Scorer | Score | None, batch: Batch, step: int) -> Score:
    if isinstance(scorer, Score):
        return scorer
    if scorer is None:
        return Score(batch.rewards, "response")
    scorer = _instance(scorer)
    return _wrap(scorer, scorer.score(batch, step))


def check_selector(selector: Selector | type[Selector], batch: Batch | None = None,
                   scorer: Scorer | Score | None = None, *, step: int = 0) -> Any:
    """Assert the selector contract; returns the :class:`~dataflex_bus.mechanisms.select.Selection`.

    ``scorer`` may be a scorer, a ready :class:`Score`, or omitted (the outcome reward per row).
    """
    selector = _instance(selector)
    who = _label(selector)
    assert selector.min_timing in TIMINGS, f"{who}: min_timing {selector.min_timing!r} is not a timing"
    batch = batch if batch is not None else _default_batch()
    batch.require(who, selector.requires)
    score = _score_for(scorer, batch, step)
    sel = selector.select(batch, score, step)
    keep = sel.keep
    assert keep.dtype == torch.bool and tuple(keep.shape) == (len(batch),), (
        f"{who}: keep must be bool of shape ({len(batch)},), got {keep.dtype} {tuple(keep.shape)}")
    assert not bool((keep & batch.is_padding).any()), f"{who}: padding rows were selected"
    if sel.advantages is not None:
        adv = sel.advantages
        assert tuple(adv.shape) == tuple(batch.token_mask.shape), (
            f"{who}: advantages must have shape {tuple(batch.token_mask.shape)}, got {tuple(adv.shape)}")
        assert bool(torch.isfinite(adv[batch.token_mask]).all()), f"{who}: non-finite recomputed advantages"
        assert bool((adv[batch.is_padding] == 0).all()), f"{who}: padding rows got non-zero advantages"
    again = selector.select(batch, score, step)
    assert torch.equal(again.keep, keep), f"{who}: two calls on the same batch keep different rows"
    return sel


def check_reweighter(reweighter: Reweighter | type[Reweighter], batch: Batch | None = None,
                     scorer: Scorer | Score | None = None, *, step: int = 0) -> Any:
    """Assert the reweighter contract; returns the :class:`~dataflex_bus.mechanisms.reweight.Reweighting`."""
    reweighter = _instance(reweighter)
    who = _label(reweighter)
    batch = batch if batch is not None else _default_batch()
    batch.require(who, reweighter.requires)
    score = _score_for(scorer, batch, step)
    out = reweighter.reweight(batch, score, step)
    w = out.weights
    tm = batch.token_mask
    assert tuple(w.shape) in ((len(batch),), tuple(tm.shape)), (
        f"{who}: weights must have shape ({len(batch)},) or {tuple(tm.shape)}, got {tuple(w.shape)}")
    real = w[batch.valid_rows] if w.dim() == 1 else w[tm]
    assert bool(torch.isfinite(real).all()), f"{who}: non-finite weights on real rows"
    assert bool((real >= 0).all()), f"{who}: negative weights on real rows"
    return out


def check_mixer(mixer: Mixer | type[Mixer], batches: Sequence[Batch] | None = None,
                scorer: Scorer | None = None, *, domains: Sequence[str] | None = None) -> list[torch.Tensor]:
    """Assert the mixer contract over a sequence of steps; returns the probabilities after each step.

    Checks: probabilities are a distribution over the domains at every step (uniform or not), the
    state dict restores a twin that produces the same probabilities and keeps agreeing on the next
    updates, and ``update`` never reads padding rows' domains.
    """
    mixer = _instance(mixer)
    who = _label(mixer)
    if batches is None:
        batches = [make_batch(groups=6, group_size=3, domains=3, padding_rows=1, seed=s) for s in range(6)]
    names = list(domains) if domains is not None else list(batches[0].domain_names)
    mixer.set_domains(names)
    history = []
    half = len(batches) // 2
    twin = None
    for step, batch in enumerate(batches):
        batch = batch.with_domain_names(names)
        score = _score_for(scorer, batch, step)
        metrics = mixer.update(batch, score, step)
        assert isinstance(metrics, Mapping), f"{who}: update() must return a metrics mapping"
        probs = mixer.probabilities()
        assert tuple(probs.shape) == (len(names),), (
            f"{who}: probabilities must have shape ({len(names)},), got {tuple(probs.shape)}")
        assert bool(torch.isfinite(probs).all()) and bool((probs >= 0).all()), f"{who}: invalid probabilities"
        total = float(probs.double().sum())
        assert abs(total - 1.0) < 1e-5, f"{who}: probabilities sum to {total}"
        history.append(probs.clone())
        if twin is not None:
            twin.update(batch, score, step)
            assert torch.allclose(twin.probabilities(), probs), (
                f"{who}: a twin restored from state_dict() diverged at step {step}")
        if step + 1 == half:
            twin = type(mixer)(**mixer.config)
            twin.set_domains(names)
            twin.load_state_dict(copy.deepcopy(mixer.state_dict()))
            assert torch.allclose(twin.probabilities(), probs), (
                f"{who}: a twin restored from state_dict() gives different probabilities")
    return history


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
                and torch.equal(a, b))
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def assert_state_roundtrip(component: Component, twin: Component | None = None) -> Component:
    """Restore ``component.state_dict()`` into ``twin`` (a fresh instance with the same params by
    default) and assert the twin reports the identical state; returns the twin."""
    state = component.state_dict()
    if twin is None:
        twin = type(component)(**component.config)
        if isinstance(component, Mixer) and isinstance(twin, Mixer) and getattr(component, "domains", None) is not None:
            twin.set_domains(component.domains)
    twin.load_state_dict(copy.deepcopy(state))
    assert _same(twin.state_dict(), state), (
        f"{_label(component)}: state_dict() -> load_state_dict() does not round-trip")
    return twin
