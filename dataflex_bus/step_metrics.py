"""The metrics the host kit publishes, with the same names and values on every host.

* ``dataflex/rollout/*``: every row generated in the step, before any selection (every generation round):
  ``rows``, ``groups``, ``reward_mean``, ``reward_std``, ``reward_min``, ``reward_max``,
  ``response_length_mean``, ``zero_signal_groups`` (share of groups whose rewards are all equal),
  ``rows/<domain>`` and ``reward_mean/<domain>`` (for the domains the step's prompts came from).
* ``dataflex/trained/*``: the rows the update trains on (after every drop): ``rows``, ``groups``,
  ``tokens``, ``reward_*``, ``response_length_mean``.
* ``dataflex/kept_fraction`` (rows trained / rows generated in the step), ``dataflex/skipped_update``
  and the cumulative ``dataflex/skipped_updates``; ``dataflex/sample_prob/<domain>`` when the host draws
  by domain.
* ``compute/*``: cumulative counters, saved with every checkpoint: ``generated_rollouts``,
  ``generated_tokens`` (prompt + response tokens of every generated rollout; a replayed row is not generated
  again), ``generated_response_tokens`` (their response tokens alone), ``generated_groups``, ``trained_rows``,
  ``trained_tokens``, ``trained_groups``,
  ``dropped_rows`` (``generated_rollouts = trained_rows - replayed_rows + dropped_rows``), ``considered_prompts``
  (every candidate a prompt selection looked at) and ``replayed_rows`` (stored rows trained again: trained,
  never generated, so a reading at equal generated rollouts credits reuse).
* the methods' own metrics (``dataflex/...``, ``dataflex/<method>/...`` in a stack), ``dataflex/prompts_*``
  (:class:`~dataflex_bus.fill.PromptCounts`), ``dataflex/refill/*`` and ``dataflex/history/*``.

A host adds its own metrics beside these (the shim's ``train/*`` losses and ``eval/*``, verl's ``actor/*``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from .ops import segment_count, segment_max, segment_min, segment_sum

if TYPE_CHECKING:
    from torch import Tensor

    from .batch import Batch
    from .runtime import Runtime

#: The cumulative counters, in the order they are reported.
COUNTERS = ("generated_rollouts", "generated_tokens", "trained_rows", "trained_tokens", "considered_prompts",
            "generated_groups", "trained_groups", "dropped_rows", "replayed_rows", "generated_response_tokens")
#: Counters a checkpoint written before they existed lacks (read as 0).
_LATER_COUNTERS = ("replayed_rows",)
#: A checkpoint without ``generated_response_tokens`` was written when ``generated_tokens`` counted response
#: tokens only: that count is its response tokens (the prompt tokens of its steps are not known).
_RESPONSE_ONLY = "generated_response_tokens"


def row_metrics(prefix: str, rows: Tensor, rewards: Tensor, lengths: Tensor, groups: Tensor) -> dict[str, float]:
    """Rows, groups, reward and response-length statistics over ``rows`` (bool ``[B]``), from per-row
    ``rewards``, response ``lengths`` and group index ``groups``."""
    n = int(rows.sum())
    count = int(torch.unique(groups[rows]).numel()) if n else 0
    out: dict[str, float] = {f"{prefix}rows": float(n), f"{prefix}groups": float(count)}
    if n == 0:
        return out
    r = rewards[rows].double()
    out.update({
        f"{prefix}reward_mean": float(r.mean()),
        f"{prefix}reward_std": float(r.std()) if n > 1 else 0.0,
        f"{prefix}reward_min": float(r.min()),
        f"{prefix}reward_max": float(r.max()),
        f"{prefix}response_length_mean": float(lengths[rows].double().mean()),
    })
    return out


def trained_metrics(trained: Tensor, tokens: Tensor, rewards: Tensor, lengths: Tensor,
                    groups: Tensor) -> dict[str, float]:
    """``dataflex/trained/*``: the rows and tokens the update really trains on (``trained``: bool ``[B]``;
    ``tokens``: each row's loss-mask tokens as the update receives them)."""
    out = row_metrics("dataflex/trained/", trained, rewards, lengths, groups)
    out["dataflex/trained/tokens"] = float(tokens[trained].sum())
    return out


def count_prompt_tokens(batch: Batch) -> int | None:
    """The prompt tokens of a batch's real rows, read from its ``attention_mask`` over the ``prompts`` columns
    (verl's layout: ``attention_mask`` ``[B, P + R]``, its first ``P`` columns the left-padded prompt);
    ``None`` when the batch carries neither (the host then gives the count itself)."""
    if "prompts" not in batch.fields or "attention_mask" not in batch.fields:
        return None
    width = batch["prompts"].shape[-1]
    mask = batch["attention_mask"][:, :width].ne(0)
    return int(mask[batch.valid_rows].sum())


class RolloutStats:
    """``dataflex/rollout/*`` accumulated over the generation rounds of one step (sums in float64, so a
    step of several rounds reads as one batch of all their rows)."""

    def __init__(self) -> None:
        self.rows = 0
        self.groups = 0
        self.zero_signal = 0
        self.total = 0.0
        self.squares = 0.0
        self.low = float("inf")
        self.high = float("-inf")
        self.length = 0.0
        self.domains: dict[str, list[float]] = {}

    def add(self, batch: Batch) -> None:
        """One generation round (padding rows never count)."""
        valid = batch.valid_rows
        n = int(valid.sum())
        g = batch.num_groups
        if n == 0:
            return
        r = batch.rewards.double()
        gi = batch.group_index
        # A group whose rewards are all equal (a singleton too) has GRPO advantage 0 on every row.
        lo, hi = segment_min(r, gi, g), segment_max(r, gi, g)
        rv = r[valid]
        self.rows += n
        self.groups += g
        self.zero_signal += int((lo == hi).sum())
        self.total += float(rv.sum())
        self.squares += float((rv * rv).sum())
        self.low = min(self.low, float(rv.min()))
        self.high = max(self.high, float(rv.max()))
        self.length += float(batch.lengths[valid].double().sum())
        if batch.domain_ids is not None and batch.domain_names:
            d = len(batch.domain_names)
            counts = segment_count(batch.domain_index, d).tolist()
            sums = segment_sum(r, batch.domain_index, d).tolist()
            for name, c, s in zip(batch.domain_names, counts, sums):
                mine = self.domains.setdefault(name, [0, 0.0])
                mine[0] += c
                mine[1] += s

    def metrics(self) -> dict[str, float]:
        p = "dataflex/rollout/"
        out: dict[str, float] = {f"{p}rows": float(self.rows), f"{p}groups": float(self.groups)}
        if not self.rows:
            return out
        n, mean = self.rows, self.total / self.rows
        var = max(self.squares - n * mean * mean, 0.0) / (n - 1) if n > 1 else 0.0
        out.update({f"{p}reward_mean": mean, f"{p}reward_std": var ** 0.5, f"{p}reward_min": self.low,
                    f"{p}reward_max": self.high, f"{p}response_length_mean": self.length / n,
                    f"{p}zero_signal_groups": self.zero_signal / self.groups if self.groups else 0.0})
        for name, (count, total) in self.domains.items():
            if count:  # a domain no prompt of the step came from is absent, on every host
                out[f"{p}rows/{name}"] = float(count)
                out[f"{p}reward_mean/{name}"] = total / count
        return out


class Counters:
    """The cumulative compute counters (``compute/*``) and skipped updates of a run, checkpointed."""

    def __init__(self) -> None:
        self.values = dict.fromkeys(COUNTERS, 0)
        self.skipped_updates = 0

    def add(self, **counts: int) -> None:
        for name, value in counts.items():
            self.values[name] += int(value)

    def __getitem__(self, name: str) -> int:
        return self.values[name]

    def metrics(self) -> dict[str, float]:
        out = {f"compute/{k}": float(v) for k, v in self.values.items()}
        out["dataflex/skipped_updates"] = float(self.skipped_updates)
        return out

    def state_dict(self) -> dict[str, int]:
        return {"skipped_updates": self.skipped_updates, **self.values}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.skipped_updates = int(state["skipped_updates"])
        old = dict(state)
        if _RESPONSE_ONLY not in old:
            old[_RESPONSE_ONLY] = old["generated_tokens"]
        self.values = {k: int(old[k] if k not in _LATER_COUNTERS else old.get(k, 0)) for k in COUNTERS}


def skipped_summary(runtime: Runtime, metrics: Sequence[Mapping[str, float]]) -> str | None:
    """The end-of-training line of a run most of whose updates were skipped (``metrics``: each step's kit
    metrics), naming each selection and the share of the rows it kept (its ``kept_fraction``, averaged over
    the steps); ``None`` when at most half were skipped. A run that trains nothing otherwise ends like one
    that trained (exit 0, the host's usual logs)."""
    from .mechanisms.select import Selector

    steps = len(metrics)
    skipped = sum(1 for m in metrics if m.get("dataflex/skipped_update", 0.0) > 0)
    if not steps or 2 * skipped <= steps or runtime.pipeline is None:
        return None
    parts = []
    for method in runtime.pipeline.methods:
        if not isinstance(method.actuator, Selector):
            continue
        kept = [m[f"{method.prefix}kept_fraction"] for m in metrics if f"{method.prefix}kept_fraction" in m]
        rate = f"kept {100 * sum(kept) / len(kept):.1f}% of the rows it saw" if kept else "kept nothing it saw"
        parts.append(f"{method.name} ({method.scorer.name}+{method.actuator.name} @ {method.event}) {rate}")
    who = "; ".join(parts) or "no selection (an allocation or an emptied mini-batch)"
    return (f"dataflex: {skipped} of {steps} updates were skipped (nothing left to train): {who}; check the "
            "parameters (`dataflex doctor --config FILE` runs the selection on a probe batch)")
