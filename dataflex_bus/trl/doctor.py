"""``dataflex doctor --host trl``: is the TRL integration healthy in this environment?

Checks, in order: TRL's version (and whether it is in the range whose private hook points the adapter
overrides), transformers, accelerate and datasets, whether :class:`~dataflex_bus.trl.DataflexGRPOTrainer`
imports, and the dataflex plugin set. Given a block (``--config FILE`` holding a ``dataflex:`` block and,
optionally, a ``grpo:`` mapping of ``GRPOConfig`` fields, and/or overrides ``dataflex.mechanism=select
grpo.loss_type=bnpo ...``) it also validates the block against the TRL host's description of those fields
(TRL's defaults for the rest), exactly as the trainer does at construction, and the fields against
what TRL's ``GRPOConfig`` refuses of a generation batch's shape. An optional ``model:`` (the model's id or folder,
or a mapping of its config's ``hidden_size``, ``intermediate_size``, ``num_attention_heads``,
``num_hidden_layers``, ``vocab_size``) and ``prompt_tokens:`` (the longest prompt, which the trainer reads from its
dataset) size a rollout row as the trainer does (without a model only the stored tensors are counted), so a budget
the machine cannot hold is refused here too. Exits 1 when anything is broken; a warning
about the block (a selection that keeps nothing of the probe batch, ...) is a WARN, and fails under
``--strict``.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from typing import Any

from ..kit import (
    FAIL,
    OK,
    WARN,
    Add,
    add_block,
    block_warnings,
    new_checks,
    plugin_checks,
    report,
    tested_version,
    version,
)
from . import TESTED_TRL

#: The GRPOConfig fields the TRL host's description reads, at TRL 1.16's defaults.
TRL_DEFAULTS = {"loss_type": "dapo", "num_generations": 8, "per_device_train_batch_size": 8,
                "gradient_accumulation_steps": 1, "num_iterations": 1, "beta": 0.0}


def _block_checks(config: Mapping[str, Any], add: Add) -> None:
    from ..kit import ConfigError, Runtime
    from .host import config_issues, describe
    from .sizes import MODEL_FIELDS, model_config, model_shape

    # The GRPOConfig fields the description reads, TRL's defaults for those not given (a GRPOConfig itself is
    # not built: its own checks depend on the machine, e.g. bf16 without a GPU, not on the block); what TRL
    # refuses of the batch's shape is checked as TRL does.
    args = {**TRL_DEFAULTS, **dict(config.get("grpo") or {})}
    shown = " ".join(f"{k}={args[k]}" for k in TRL_DEFAULTS) + " (TRL's defaults where not given)"
    refused = config_issues(args)
    add("GRPOConfig", FAIL if refused else OK, "; ".join(map(str, refused)) if refused else shown)
    block = config.get("dataflex")
    if not block:
        add("dataflex block", OK, "none: plain TRL (the kit's metrics are still logged)")
        return
    given = config.get("model")
    shape = model_shape(model_config(given) if isinstance(given, str) else given)
    if given is not None and shape is None:
        add("model", FAIL, f"{given!r}: its config (or the mapping given) lacks one of {', '.join(MODEL_FIELDS)}, "
            "which bound the rows' memory")
    try:
        with block_warnings() as warnings:
            prompt_tokens = int(config.get("prompt_tokens") or 0)
            runtime = Runtime(block, host=describe(args, model=shape, prompt_tokens=prompt_tokens))
    except ConfigError as exc:
        add("dataflex block", FAIL, str(exc))
        return
    add_block(add, "DataflexGRPOTrainer runs " + "; ".join(runtime.describe()), warnings)


def run_checks(config: Mapping[str, Any] | None = None) -> list[dict[str, Any]]:
    """Every check as ``{"check", "status", "detail"}`` (``config``: ``{"dataflex": block, "grpo": {...}}``)."""
    checks, add = new_checks()
    if not tested_version(add, "trl", TESTED_TRL, 'pip install "dataflex-bus[trl]"',
                          "the adapter overrides private GRPOTrainer methods"):
        return checks
    for dist in ("transformers", "accelerate", "datasets"):
        found = version(dist)
        add(dist, OK if found else FAIL, f"{dist} {found}" if found else f"{dist} is not installed (trl needs it)")
    try:
        from .trainer import DataflexGRPOTrainer
    except Exception as exc:
        add("DataflexGRPOTrainer", FAIL, f"the adapter failed to import: {type(exc).__name__}: {exc}")
        return checks
    add("DataflexGRPOTrainer", OK, f"{DataflexGRPOTrainer.__module__}.{DataflexGRPOTrainer.__qualname__}")
    if version("gguf") is None:
        add("gguf", WARN, "not installed: examples/trl cannot load the SmolLM2 weights (pip install gguf)")
    plugin_checks(add)
    if config:
        _block_checks(config, add)
    return checks


def cmd_doctor(args: argparse.Namespace) -> int:
    """Print the checks; exit status 1 if any failed (``--strict``: or warned)."""
    from ..kit import load_config

    overrides: Sequence[str] = getattr(args, "overrides", None) or ()
    path = getattr(args, "config", None)
    config = load_config(path, overrides) if path or overrides else None
    if config is not None and "dataflex" not in config and {"mechanism", "methods"} & set(config):
        config = {"dataflex": config}  # a bare block, as the trainer's dataflex= file may hold it
    return report(run_checks(config), as_json=getattr(args, "json", False), strict=getattr(args, "strict", False))
