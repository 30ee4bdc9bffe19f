"""Predictors: a component kind that estimates a prompt's success rate ``p`` before it is generated.

A :class:`Predictor` observes every rolled-out group (``on_rollout``: the prompt, its rollouts, its successes)
and predicts ``p`` for candidate prompts (``on_prompts``), prompts never seen included (from what it has seen
of the others). The block names one (``dataflex.predictor: {name: ..., params: {...}}``); every method of the
block reads the same prediction from the candidates batch: :data:`P_FIELD` (``predicted_p``) and, for a
predictor that says more (DPS's state probabilities), ``predicted_<column>`` per :attr:`Predictor.columns`.
A component reading them declares ``uses_predictor = True``.

:class:`PredictorRun` is what the runtime holds: it checks what the predictor returns (NaN, ``p`` outside
[0, 1], the wrong shape and a raise are errors naming the predictor and the field), logs the calibration of
every step (Spearman correlation and Brier score between the predicted ``p`` of each rolled-out group and its
observed success rate: ``dataflex/predictor/spearman`` and ``dataflex/predictor/brier``) and saves the
predictor's state (its per-prompt tensors and any model and optimizer it owns) in the run's checkpoint.

The prediction a group is scored against is made from the predictor's state before that group is observed,
which is the state the ``on_prompts`` prediction of the same step read: the calibration covers every group a
host rolls out, on hosts whose prompts were chosen before generation and on those whose were not.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from .components import Component
from .errors import BatchFieldError, ConfigIssue, PluginRuntimeError

if TYPE_CHECKING:
    from torch import Tensor

    from .batch import Batch
    from .block import ComponentRef
    from .registry import Registry

KIND = "predictor"
#: The candidates-batch field holding the predicted success rate.
P_FIELD = "predicted_p"
#: Rollouts with a reward above this count as successes (the history's rule, visits.SUCCESS_THRESHOLD).
SUCCESS_THRESHOLD = 0.5
#: Metric names (under ``dataflex/``).
SPEARMAN, BRIER = "predictor/spearman", "predictor/brier"


@dataclass(frozen=True)
class Observation:
    """Rolled-out groups handed to :meth:`Predictor.observe`, distinct prompts per call: ``prompt`` (long
    ``[V]``, dense indices into the prompt table), ``size`` (rollouts, long ``[V]``), ``successes`` (long
    ``[V]``, reward above :data:`SUCCESS_THRESHOLD`) and the step."""

    prompt: Tensor
    size: Tensor
    successes: Tensor
    step: int

    @property
    def rate(self) -> Tensor:
        """Observed success rate per group (float64)."""
        import torch

        return self.successes.to(torch.float64) / self.size.clamp_min(1).to(torch.float64)


@dataclass
class Prediction:
    """What :meth:`Predictor.predict` returns: ``p`` (float ``[N]`` in [0, 1]) and, per name of
    :attr:`Predictor.columns`, a float ``[N]`` column (finite)."""

    p: Tensor
    columns: dict[str, Tensor] = field(default_factory=dict)


class Predictor(Component):
    """Base of every predictor. Subclasses implement :meth:`bind`, :meth:`observe` and :meth:`predict` on whole
    tensors (never a loop over prompts) and keep their state in tensors :meth:`state_dict` returns.

    A predictor may own a small trainable model: set ``self.model`` (a ``torch.nn.Module``) and
    ``self.optimizer`` in :meth:`bind`; the default :meth:`state_dict` saves both beside :meth:`tensors`.
    """

    kind: ClassVar[str] = KIND
    #: Extra columns :meth:`predict` returns (``predicted_<name>`` in the candidates batch).
    columns: ClassVar[tuple[str, ...]] = ()

    model: Any = None
    optimizer: Any = None

    def bind(self, prompts: int) -> None:
        """Allocate the per-prompt state of a table of ``prompts`` prompts (called once, before any use)."""

    def observe(self, seen: Observation) -> None:
        """Update from rolled-out groups (distinct prompts; a prompt rolled out twice in a step comes in two
        calls, in order)."""
        raise NotImplementedError(f"{type(self).__name__}.observe")

    def end_step(self, step: int) -> None:
        """The step's rollouts are all observed (a predictor whose state moves with time moves it here)."""

    def predict(self, prompt: Tensor, step: int) -> Prediction | Tensor:
        """``p`` for the prompts ``prompt`` (long ``[N]``, dense indices; may repeat), before generation."""
        raise NotImplementedError(f"{type(self).__name__}.predict")

    def tensors(self) -> dict[str, Tensor]:
        """The predictor's own state tensors (per-prompt and global), for :meth:`state_dict`."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"tensors": {k: v.clone() for k, v in self.tensors().items()}}
        if self.model is not None:
            out["model"] = self.model.state_dict()
        if self.optimizer is not None:
            out["optimizer"] = self.optimizer.state_dict()
        return out

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        own = self.tensors()
        saved = dict(state.get("tensors") or {})
        if set(saved) != set(own):
            raise ValueError(f"{self.who}: saved state holds {sorted(saved)}, this predictor keeps {sorted(own)}")
        for key, value in saved.items():
            if tuple(value.shape) != tuple(own[key].shape):
                raise ValueError(f"{self.who}: saved {key!r} has shape {tuple(value.shape)}, expected "
                                 f"{tuple(own[key].shape)} (another prompt table?)")
            own[key].copy_(value)
        if self.model is not None:
            self.model.load_state_dict(state["model"])
        if self.optimizer is not None:
            self.optimizer.load_state_dict(state["optimizer"])


# ---------------------------------------------------------------------------- calibration
def spearman(x: Tensor, y: Tensor) -> float:
    """Spearman's rank correlation of ``x`` and ``y`` (average ranks for ties); NaN when either is constant
    or fewer than two values."""
    import torch

    if x.numel() < 2:
        return float("nan")
    rx, ry = average_ranks(x), average_ranks(y)
    rx, ry = rx - rx.mean(), ry - ry.mean()
    den = torch.sqrt((rx * rx).sum() * (ry * ry).sum())
    return float((rx * ry).sum() / den) if float(den) > 0 else float("nan")


def average_ranks(x: Tensor) -> Tensor:
    """Ranks 1..n of ``x``, ties given their average rank (as scipy's ``rankdata``)."""
    import torch

    values, inverse, counts = torch.unique(x.to(torch.float64), return_inverse=True, return_counts=True)
    ends = torch.cumsum(counts, 0).to(torch.float64)
    average = ends - (counts.to(torch.float64) - 1) / 2
    del values
    return average[inverse]



# ---------------------------------------------------------------------------- the runtime's side
class PredictorRun:
    """The block's predictor as the runtime runs it: guarded calls, checked outputs, calibration and state."""

    def __init__(self, predictor: Predictor, plugin: str) -> None:
        self.predictor = predictor
        self.plugin = plugin
        self.bound = 0
        #: The step the next prediction is for (one past the last step ended).
        self.next_step = 0
        #: This step's (predicted, observed) pairs, and the metrics already reported for it.
        self._step = -1
        self._pairs: list[tuple[Tensor, Tensor]] = []
        self._reported: dict[str, float] = {}

    @property
    def who(self) -> str:
        return f"predictor {self.predictor.name!r} (plugin {self.plugin!r})"

    def _call(self, hook: str, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except (PluginRuntimeError, BatchFieldError):
            raise
        except KeyboardInterrupt:
            raise
        except (Exception, SystemExit) as exc:
            raise PluginRuntimeError(self.plugin, f"{hook} ({self.predictor.who})", exc) from exc

    def bind(self, prompts: int) -> None:
        self._call("bind", self.predictor.bind, int(prompts))
        self.bound = int(prompts)

    # -------------------------------------------------------------- on_prompts
    def predict(self, prompt: Tensor, step: int) -> dict[str, Tensor]:
        """The checked prediction for ``prompt`` as candidates-batch fields (``predicted_p``, ...)."""
        import torch

        out = self._call("predict", self.predictor.predict, prompt, int(step))
        pred = out if isinstance(out, Prediction) else Prediction(out)
        n = prompt.numel()
        fields = {P_FIELD: self._checked(P_FIELD, pred.p, n, unit=True)}
        declared = tuple(type(self.predictor).columns)
        if set(pred.columns) != set(declared):
            raise BatchFieldError(self.who, "columns", f"predict() returned columns {sorted(pred.columns)}, the "
                                  f"predictor declares {sorted(declared)}")
        for name in declared:
            fields[f"predicted_{name}"] = self._checked(f"predicted_{name}", pred.columns[name], n, unit=False)
        return {k: v.to(torch.float64) for k, v in fields.items()}

    def _checked(self, name: str, values: Any, n: int, *, unit: bool) -> Tensor:
        import torch

        if not isinstance(values, torch.Tensor) or values.dtype == torch.bool or values.is_complex():
            got = values.dtype if isinstance(values, torch.Tensor) else type(values).__name__
            raise BatchFieldError(self.who, name, f"expected a real float tensor, got {got}")
        if tuple(values.shape) != (n,):
            raise BatchFieldError(self.who, name, f"expected shape ({n},) (one value per prompt), got "
                                  f"{tuple(values.shape)}")
        values = values.detach().to(torch.float64)
        bad = ~torch.isfinite(values)
        if bool(bad.any()):
            rows = torch.nonzero(bad).flatten()[:5].tolist()
            raise BatchFieldError(self.who, name, f"NaN/inf at rows {rows}")
        if unit and bool(((values < 0) | (values > 1)).any()):
            rows = torch.nonzero((values < 0) | (values > 1)).flatten()[:5].tolist()
            raise BatchFieldError(self.who, name, f"p must lie in [0, 1]; got {values[rows].tolist()} at rows {rows}")
        return values

    # -------------------------------------------------------------- on_rollout
    def record(self, batch: Batch, step: int) -> dict[str, float]:
        """Score the predictions of ``batch``'s groups against their outcomes, then let the predictor observe
        them. Returns the change of this step's calibration metrics (a host adds the metrics of a step's rounds
        up, so their sum is the step's calibration over all its groups); Spearman is left out while undefined."""
        import torch

        from .ops import segment_max, segment_min, segment_sum

        if not batch.has("prompt_index"):
            raise BatchFieldError(self.who, "prompt_index", "the host gave no prompt ids with the rollouts")
        gi, g = batch.group_index, batch.num_groups
        if g == 0:
            return {}
        pidx = batch["prompt_index"].to(torch.float64)
        lo, hi = segment_min(pidx, gi, g), segment_max(pidx, gi, g)
        if not bool(((lo == hi) & (lo >= 0) & (hi < self.bound)).all()):
            raise BatchFieldError(self.who, "prompt_index", f"every row of a group must carry the same "
                                  f"prompt_index, in 0..{self.bound - 1}")
        arrival = torch.argsort(segment_min(torch.arange(len(batch), dtype=torch.float64), gi, g))
        prompt = lo.to(torch.long)[arrival]
        size = batch.group_sizes[arrival].to(torch.long)
        successes = segment_sum((batch.rewards > SUCCESS_THRESHOLD).to(torch.long), gi, g)[arrival]
        if step != self._step:
            self._step, self._pairs, self._reported = step, [], {}
        from .ops import waves

        for at in waves(prompt):
            seen = Observation(prompt[at], size[at], successes[at], int(step))
            predicted = self.predict(seen.prompt, step)[P_FIELD]
            self._pairs.append((predicted, seen.rate))
            self._call("observe", self.predictor.observe, seen)
        pred = torch.cat([p for p, _ in self._pairs])
        obs = torch.cat([o for _, o in self._pairs])
        now = {BRIER: float(((pred - obs) ** 2).mean())}
        rho = spearman(pred, obs)
        if rho == rho:  # undefined (NaN) while the predictions or the outcomes are all equal: left out
            now[SPEARMAN] = rho
        delta = {k: v - self._reported.get(k, 0.0) for k, v in now.items()}
        self._reported = now
        return delta

    def end_step(self, step: int) -> None:
        self.next_step = int(step) + 1
        self._call("end_step", self.predictor.end_step, int(step))

    # -------------------------------------------------------------- checkpoint
    def state_dict(self) -> dict[str, Any]:
        return {"name": self.predictor.name, "prompts": self.bound, "next_step": self.next_step,
                "state": self._call("state_dict", self.predictor.state_dict)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("name") != self.predictor.name or int(state.get("prompts", -1)) != self.bound:
            raise ValueError(f"{self.who}: the checkpoint holds predictor {state.get('name')!r} over "
                             f"{state.get('prompts')} prompts; this run has {self.predictor.name!r} over {self.bound}")
        self._call("load_state_dict", self.predictor.load_state_dict, state["state"])
        self.next_step = int(state.get("next_step", 0))


# ---------------------------------------------------------------------------- config
def check_predictor(ref: ComponentRef | None, readers: list[str], registry: Registry,
                    key: str = "dataflex.predictor") -> list[ConfigIssue]:
    """Validation of the block's ``predictor``: the name resolves among the installed predictors (a
    suggestion list otherwise), the parameters check, and it is there exactly when a method reads it
    (``readers``: the config keys of the components declaring ``uses_predictor``)."""
    from .components import resolve_params
    from .errors import CollisionError, PluginLoadError, UnknownComponentError

    if ref is None:
        installed = ", ".join(registry.names(KIND)) or "none"
        return [ConfigIssue(r, "reads a predicted success rate, but the block names no predictor; add "
                            f"dataflex.predictor: {{name: ...}} (installed: {installed})") for r in readers]
    issues: list[ConfigIssue] = []
    try:
        cls = registry.resolve(KIND, ref.name, key=f"{key}.name").load()
    except (UnknownComponentError, CollisionError, PluginLoadError) as exc:
        return [ConfigIssue(f"{key}.name", str(exc))]
    _, problems = resolve_params(cls, ref.params, key=f"{key}.params")
    issues.extend(problems)
    if not readers:
        issues.append(ConfigIssue(key, f"predictor {ref.name!r} is named but no method of the block reads its "
                                  "prediction (a component with uses_predictor, e.g. the scorer 'predicted')"))
    return issues


def build_predictor(ref: ComponentRef, registry: Registry) -> PredictorRun:
    """The block's predictor, built from the registry."""
    spec = registry.resolve(KIND, ref.name, key="dataflex.predictor.name")
    predictor = spec.load()(**dict(ref.params))
    predictor.name = spec.name
    assert isinstance(predictor, Predictor)
    return PredictorRun(predictor, spec.provider)


def uses_predictor(component: type[Component] | Component) -> bool:
    return bool(getattr(component, "uses_predictor", False))


__all__ = ["BRIER", "KIND", "P_FIELD", "SPEARMAN", "Observation", "Prediction", "Predictor", "PredictorRun",
           "average_ranks", "build_predictor", "check_predictor", "spearman", "uses_predictor"]

