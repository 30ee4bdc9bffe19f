"""TSCL, Teacher-Student Curriculum Learning (Matiisen et al., arXiv 1707.00183), window variant.

The teacher favours the domains where the student's score is changing fastest: rising (it is learning
there) or falling (it is forgetting there). Per domain ``d`` it keeps a FIFO of the last ``window``
(``K``) points ``(step, score)``, where the score of a step is the mean of the scorer's values over that
step's real rows of the domain (a domain-level scorer gives it directly; a domain absent from a step adds
no point). Its learning progress ``Q_d`` is the least-squares slope of score against step index over
those points::

    Q_d = sum_j (x_j - xbar)(y_j - ybar) / sum_j (x_j - xbar)^2

and ``Q_d = optimistic_q`` (1, as in the paper) while fewer than two points exist, so every domain is
tried early. Sampling probabilities come from ``|Q|``:

* ``boltzmann``: ``p = softmax(|Q| / temperature)``;
* ``epsilon_greedy``: ``p_d = epsilon / D + (1 - epsilon) * [d in argmax |Q|] / #argmax`` (exact ties
  share the greedy mass, so the distribution is deterministic and does not favour the first domain).

There is no random state: the host's sampler draws from :meth:`TSCL.probabilities`. The ring buffers and
the per-domain point counts are the whole state (:meth:`TSCL.state_dict`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor

from dataflex_bus import Mixer, Param, Score
from dataflex_bus.ops import segment_count, segment_sum

POLICIES = ("boltzmann", "epsilon_greedy")


def window_slopes(x: Tensor, y: Tensor, filled: Tensor, optimistic: float) -> Tensor:
    """Least-squares slope per row of ``x``/``y`` ``[D, K]`` over the first ``filled[d]`` entries.

    Rows with fewer than two points get ``optimistic``; a degenerate window (all points at one step)
    gets slope 0.
    """
    K = x.shape[1]
    mask = (torch.arange(K)[None, :] < filled[:, None]).double()
    n = mask.sum(1).clamp_min(1)
    xbar = (x * mask).sum(1) / n
    ybar = (y * mask).sum(1) / n
    dx = (x - xbar[:, None]) * mask
    dy = (y - ybar[:, None]) * mask
    sxx = (dx * dx).sum(1)
    sxy = (dx * dy).sum(1)
    slope = torch.where(sxx > 0, sxy / sxx.clamp_min(1e-300), torch.zeros_like(sxx))
    return torch.where(filled >= 2, slope, torch.full_like(slope, optimistic))


class TSCL(Mixer):
    """Domain probabilities from the |slope| of each domain's recent score curve (TSCL window)."""

    params: ClassVar[Mapping[str, Param]] = {
        "window": Param(int, default=10, low=2, doc="points K per domain in the regression"),
        "policy": Param(str, default="boltzmann", choices=POLICIES),
        "temperature": Param(float, default=0.1, low=0.0, low_open=True, doc="Boltzmann temperature"),
        "epsilon": Param(float, default=0.1, low=0.0, high=1.0, doc="exploration mass (epsilon_greedy)"),
        "optimistic_q": Param(float, default=1.0, low=0.0,
                              doc="Q of a domain with fewer than two points (1 in the paper)"),
    }

    window: int
    policy: str
    temperature: float
    epsilon: float
    optimistic_q: float

    def __init__(self, **params: Any) -> None:
        super().__init__(**params)
        self.set_domains([])

    def set_domains(self, domains: Sequence[str]) -> None:
        """Start over with empty windows for ``domains``."""
        super().set_domains(domains)
        D = len(self.domains)
        self._x = torch.zeros(D, self.window, dtype=torch.float64)
        self._y = torch.zeros(D, self.window, dtype=torch.float64)
        self._count = torch.zeros(D, dtype=torch.long)

    # ------------------------------------------------------------------ statistics
    def domain_scores(self, batch: Any, score: Score) -> tuple[Tensor, Tensor]:
        """This step's score per domain ``[D]`` and which domains have one (bool ``[D]``)."""
        D = len(self.domains)
        count = segment_count(batch.domain_index, D)
        present = count > 0
        values = score.values.double()
        if score.granularity == "domain":
            if values.shape != (D,):
                raise ValueError(f"tscl: a domain-level score must have {D} values (one per domain), "
                                 f"got shape {tuple(values.shape)}")
            present = present & torch.isfinite(values)
            return torch.where(present, values, torch.zeros_like(values)), present
        if values.dim() != 1:
            raise ValueError(f"tscl: expected one score per row, got shape {tuple(values.shape)}")
        total = segment_sum(values, batch.domain_index, D)
        return total / count.clamp_min(1).double(), present

    def slopes(self) -> Tensor:
        """Current learning progress ``Q`` per domain (float64 ``[D]``)."""
        filled = self._count.clamp(max=self.window)
        return window_slopes(self._x, self._y, filled, self.optimistic_q)

    def update(self, batch: Any, score: Score, step_id: int) -> dict[str, float]:
        if len(self.domains) == 0:
            raise ValueError("tscl: set_domains() was not called (no domains to mix)")
        means, present = self.domain_scores(batch, score)
        rows = torch.nonzero(present).flatten()
        slot = self._count[rows] % self.window
        self._x[rows, slot] = float(step_id)
        self._y[rows, slot] = means[rows]
        self._count[rows] += 1
        q = self.slopes()
        metrics: dict[str, float] = {}
        for d, name in enumerate(self.domains):
            metrics[f"tscl/q/{name}"] = float(q[d])
            if bool(present[d]):
                metrics[f"tscl/score/{name}"] = float(means[d])
        metrics["tscl/domains_updated"] = float(rows.numel())
        return metrics

    def probabilities(self) -> Tensor:
        D = len(self.domains)
        if D == 0:
            raise ValueError("tscl: set_domains() was not called (no domains to mix)")
        a = self.slopes().abs()
        if self.policy == "boltzmann":
            return torch.softmax(a / self.temperature, dim=0)
        best = (a == a.max()).double()
        return self.epsilon / D + (1.0 - self.epsilon) * best / best.sum()

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        return {
            "domains": list(self.domains),
            "window": self.window,
            "steps": self._x.tolist(),
            "scores": self._y.tolist(),
            "counts": self._count.tolist(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if list(state.get("domains", [])) != list(self.domains):
            raise ValueError(f"tscl: checkpoint domains {state.get('domains')} differ from {self.domains}")
        if int(state.get("window", -1)) != self.window:
            raise ValueError(f"tscl: checkpoint window {state.get('window')} differs from window={self.window}")
        D = len(self.domains)
        x = torch.tensor(state["steps"], dtype=torch.float64).reshape(D, self.window)
        y = torch.tensor(state["scores"], dtype=torch.float64).reshape(D, self.window)
        count = torch.tensor(state["counts"], dtype=torch.long).reshape(D)
        self._x, self._y, self._count = x, y, count
