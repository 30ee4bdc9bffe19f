"""How much memory a shim run needs, estimated from its config before anything is allocated.

The check exists for absurd sizes (``trainer.group_size=100000000000``): without it the run warms the
policy up and then dies in the allocator with a traceback. The estimate counts every tensor of a step as
alive at once, so it lies above what a run takes (measured on Linux, 1 step: 16k rollout rows of a
256-wide 2-layer GRU grew the process by 1.2 GiB against an estimate of 2.0 GiB; 32k rows of the default
64-wide GRU by 0.5 GiB against 0.65 GiB). A run is refused when the estimate exceeds the machine's
physical memory, naming the key that makes it too large.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..kit import FALLBACK_MEMORY, GIB, ConfigIssue, format_bytes, machine_memory
from .sections import MODEL, TRAINER
from .tasks import MAX_RESPONSE_LEN, NUM_OUTPUTS, PROMPT_LEN, vocab_size

#: One metrics dict kept in memory per step (about 40 + 3 per domain float entries), with its JSON line.
METRICS_ROW_BYTES = 8 * 1024


@dataclass(frozen=True)
class Term:
    """One part of the estimate: the config key that sets it, what it is, and its bytes."""

    key: str
    what: str
    bytes: int


def row_bytes(hidden: int, layers: int) -> int:
    """Bytes one rollout row holds during a step: its batch fields (about 16 ``[T]`` tensors, several
    copies) and the activations of a teacher-forced pass with gradients (embedding, GRU gates per layer,
    logits and log-softmax) over prompt + response tokens."""
    tokens = PROMPT_LEN + MAX_RESPONSE_LEN
    activations = 4 * tokens * (hidden * (4 + 8 * layers) + 4 * NUM_OUTPUTS)
    return activations + 3 * 16 * MAX_RESPONSE_LEN * 8


def estimate(resolved: Mapping[str, Any]) -> list[Term]:
    """The memory terms of a resolved shim config (``trainer``/``model``/``data`` checked and filled)."""
    t, m, d = resolved["trainer"], resolved["model"], resolved["data"]
    hidden, layers = int(m["hidden"]), int(m["layers"])
    domains = len(resolved["data"]["domains"])
    vocab = vocab_size(domains)
    row = row_bytes(hidden, layers)
    rows = int(t["prompts_per_step"]) * int(t["group_size"])
    wide = "trainer.group_size" if t["group_size"] >= t["prompts_per_step"] else "trainer.prompts_per_step"
    params = vocab * hidden + layers * 3 * (2 * hidden * hidden + 2 * hidden) + hidden * NUM_OUTPUTS
    # policy, gradients, two Adam moments, the reference copy and the warm start's own Adam moments
    copies = 7
    model_key = "model.layers" if layers > hidden else "model.hidden"
    return [
        Term(wide, f"{rows:,} rollouts per step (trainer.prompts_per_step {t['prompts_per_step']} x "
             f"trainer.group_size {t['group_size']})", rows * row),
        Term(model_key, f"a {layers}-layer GRU {hidden} wide ({params:,} parameters, {copies} copies)",
             params * 4 * copies),
        # data.heldout is bounded by the levels' sizes (config refuses more), so it never decides alone.
        Term("data.heldout", f"{int(d['heldout']) * domains:,} held-out prompts decoded at once "
             f"(data.heldout {d['heldout']} x {domains} domains)",
             int(d["heldout"]) * domains * row if t["eval_every"] else 0),
        Term("trainer.steps", f"the metrics of {t['steps']:,} steps", int(t["steps"]) * METRICS_ROW_BYTES),
        # Each warm-start prompt is two rows: its right answer and its habit's.
        Term("model.pretrain_batch", f"the warm start's batch of {2 * int(m['pretrain_batch']):,} rows "
             f"(model.pretrain_batch {m['pretrain_batch']}, right answer and habit)",
             2 * int(m["pretrain_batch"]) * row if m["pretrain_steps"] else 0),
    ]


#: The keys that set a run's size, each tried at its default to find the one that makes a run too large.
SIZE_KEYS = ("trainer.group_size", "trainer.prompts_per_step", "model.hidden", "model.layers",
             "model.pretrain_batch", "trainer.steps")


def _total(resolved: Mapping[str, Any]) -> int:
    return sum(term.bytes for term in estimate(resolved))


def check_memory(resolved: Mapping[str, Any], limit: int | None = None) -> ConfigIssue | None:
    """An issue when the estimate exceeds ``limit`` (the machine's physical memory by default), keyed by
    the size key whose default value shrinks the estimate most; ``None`` when the run fits."""
    limit = machine_memory() if limit is None else limit
    total = _total(resolved)
    if total <= limit:
        return None
    defaults = {f"trainer.{k}": p.default for k, p in TRAINER.items()} | {f"model.{k}": p.default
                                                                          for k, p in MODEL.items()}

    def at_default(dotted: str) -> int:
        section, key = dotted.split(".")
        trial = {**resolved, section: {**resolved[section], key: defaults[dotted]}}
        return _total(trial)

    culprit = min(SIZE_KEYS, key=at_default)
    section, key = culprit.split(".")
    largest = max(estimate(resolved), key=lambda term: term.bytes)
    return ConfigIssue(culprit, f"{resolved[section][key]} makes the run need about {_size(total)} of memory "
                       f"(mostly for {largest.what}), but this machine has {_size(limit)}; reduce {culprit}")


_size = format_bytes
__all__ = ["FALLBACK_MEMORY", "GIB", "Term", "check_memory", "estimate", "machine_memory", "row_bytes"]
