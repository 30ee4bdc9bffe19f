"""The warm-started base policy, pretrained once per machine: kept in this process's memory and on disk.

The base policy is a function of the ``model`` and ``data`` sections (``trainer.seed`` and the method vary
only the RL run, as runs that start from one pretrained checkpoint share it), of the code that trains it
and of the numerical environment: torch's version, the number of torch threads, the CPU and the
instruction set its kernels use (another CPU gives other bits). The cache key hashes all of them, so a
hit is bit for bit what pretraining again would give, and any change is a miss.

Where: :func:`dataflex_bus.cache.cache_root` (``$DATAFLEX_CACHE_DIR``, set but empty: no disk cache, else
``$XDG_CACHE_HOME/dataflex``, else ``~/.cache/dataflex``); one file per base policy under ``warmstart/``.
An entry is written atomically (a uniquely named temporary file, then a rename), so two runs warm-starting
at once both write the same bytes and neither ever reads half a file; it is read with ``weights_only``
behind the checkpoint's checksum header, and a damaged or foreign entry is logged, ignored and rewritten. A
cache that cannot be written is logged and skipped: it never fails a run.
"""

from __future__ import annotations

import functools
import hashlib
import io
import json
import logging
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from .. import __version__
from ..kit import ENV_CACHE, DataflexError, cache_root
from .files import read_checked, write_checked
from .machine import cpu_capability, cpu_model
from .policy import TinyPolicy, pretrain
from .progress import Progress
from .split import Split

log = logging.getLogger("dataflex_bus")

FORMAT = "dataflex-warmstart/1"
#: The modules whose code decides the base policy's bits: the policy and its pretraining, the tasks and
#: their split, the trainer (it seeds the generators and builds the network) and this module.
CODE = ("policy", "tasks", "split", "trainer", "warmstart")
#: Base policies of this process by key (policy state, pretrain generator state): a compare of configs
#: with different models keeps a few; ``dataflex compare`` pays each warm start once.
_MEMORY: dict[str, tuple[dict[str, Tensor], Tensor]] = {}
_MAX_MEMORY = 4


@functools.cache
def _code_digest() -> str:
    digest = hashlib.sha256()
    package = Path(__file__).resolve().parent
    for name in CODE:
        digest.update(name.encode() + b"\0" + (package / f"{name}.py").read_bytes())
    return digest.hexdigest()


#: ``data`` keys the base policy does not depend on (see :mod:`~dataflex_bus.shim.pool`).
RL_ONLY = ("train_pool", "level_weights")


def cache_key(resolved: Mapping[str, Any], domains: list[str]) -> str:
    """Everything the base policy depends on, hashed (a file name)."""
    # The training regime keys shape only the RL run's draws, never the base policy.
    data = {k: v for k, v in resolved["data"].items() if k not in RL_ONLY}
    parts = {
        "format": FORMAT, "model": resolved["model"], "data": data, "domains": domains,
        "dataflex_bus": __version__, "code": _code_digest(), "torch": torch.__version__,
        "threads": torch.get_num_threads(), "cpu": cpu_model(), "cpu_capability": cpu_capability(),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:32]


def _entry(key: str) -> Path | None:
    root = cache_root()
    return None if root is None else root / "warmstart" / f"{key}.pt"


def _read(path: Path, key: str, policy: TinyPolicy) -> tuple[dict[str, Tensor], Tensor] | None:
    """The cached base policy, or ``None`` when absent or unusable (damaged, foreign, another shape)."""
    if not path.exists():
        return None
    try:
        payload = read_checked(path, "it is ignored and rebuilt")
        entry = torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
        if not isinstance(entry, dict) or entry.get("format") != FORMAT or entry.get("key") != key:
            raise ValueError("not a warm-start entry of this key")
        state, gen = entry["policy"], entry["generator"]
        expected = policy.state_dict()
        if (not isinstance(gen, Tensor) or not isinstance(state, dict) or set(state) != set(expected)
                or any(not isinstance(state[k], Tensor) or state[k].shape != v.shape or state[k].dtype != v.dtype
                       for k, v in expected.items())):
            raise ValueError("its tensors do not fit this policy")
    except (DataflexError, OSError, ValueError, RuntimeError, KeyError, TypeError, EOFError) as exc:
        log.warning("dataflex: warm start: the cached base policy %s is unusable (%s); it is ignored and rebuilt",
                    path, exc)
        return None
    return state, gen


def _write(path: Path, key: str, base: tuple[dict[str, Tensor], Tensor]) -> bool:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_checked(path, {"format": FORMAT, "key": key, "policy": base[0], "generator": base[1]})
    except (OSError, DataflexError) as exc:
        log.warning("dataflex: warm start: cannot cache the base policy in %s (%s); the next run pretrains it "
                    "again (set %s to a writable directory, or to nothing to stop trying)", path.parent, exc,
                    ENV_CACHE)
        return False
    return True


def warm_start(policy: TinyPolicy, gen: torch.Generator, split: Split, resolved: Mapping[str, Any],
               domains: list[str], *, progress: bool = False) -> str:
    """Make ``policy`` the base policy of ``resolved`` and leave ``gen`` (the pretraining generator) as the
    warm start leaves it, from memory, from the disk cache, or by pretraining (then cached). ``progress``
    shows a bar while pretraining. Returns where the base policy came from (``memory``, ``cache``,
    ``pretrained``)."""
    m = resolved["model"]
    key = cache_key(resolved, domains)
    path = _entry(key)
    source = "memory"
    base = _MEMORY.get(key)
    if base is None and path is not None:
        base = _read(path, key, policy)
        source = "cache"
        if base is not None:
            log.info("dataflex: warm start: base policy read from the cache %s", path)
    if base is None:
        source = "pretrained"
        log.info("dataflex: warm start: pretraining the base policy (%d steps of %d prompts)",
                 m["pretrain_steps"], m["pretrain_batch"])
        started = time.perf_counter()
        bar = Progress(m["pretrain_steps"], 0, label="warm start") if progress else None
        try:
            pretrain(policy, domains, split.draw, m["pretrain_steps"], gen, batch=m["pretrain_batch"],
                     on_step=None if bar is None else (lambda done: bar.update(done, {})))
        finally:
            if bar is not None:
                bar.close()
        base = ({k: v.clone() for k, v in policy.state_dict().items()}, gen.get_state())
        cached = path is not None and _write(path, key, base)
        log.info("dataflex: warm start: done in %.1f s%s", time.perf_counter() - started,
                 f"; cached in {path}" if cached else "")
    else:
        policy.load_state_dict(base[0])
        gen.set_state(base[1])  # as the warm start leaves it: checkpoints agree too
    _MEMORY[key] = base
    while len(_MEMORY) > _MAX_MEMORY:
        del _MEMORY[next(iter(_MEMORY))]
    return source
