"""The host kit's front door: everything a host adapter imports of the core, and nothing else.

A host is one folder (``dataflex_bus/<host>/`` or a package of its own) plus one registration
(:class:`HostEntry`, :mod:`dataflex_bus.hosts`). Its modules import the core only from here and from the
package's public face (``dataflex_bus``); ``tests/foundation/test_kit_front_door.py`` keeps it so, and keeps
this list to what the adapters use. Names load on first use (no torch at import), so an import-light module
(a host description, a doctor) stays light.

* the step kit: one run's runtime and plan, one step's drivers, what they carry out: ``Runtime``, ``Plan``,
  ``Candidates``, ``Chosen``, ``Step``, ``StepKit``, ``concat_rounds``, ``concat_rows``, ``Generation``,
  ``group_labels``, ``RolloutOutcome``, ``AdvantageAction``, ``skipped_summary``, ``domain_labels``,
  ``DomainSampler``, ``prepare_prompts``, ``PromptTable``, ``Record``, ``Replayed``, ``ObjectCheck``, ``pad_to``
* the data-flow mechanisms' parts of a step and a run (:mod:`dataflex_bus.step_parts`): ``ReplayPart``,
  ``ReplayRun``, ``allocator``
* batches and their tensor helpers: ``Batch``, ``grpo_outcome_advantage``, ``segment_count``, ``segment_max``,
  ``segment_min``, ``segment_slots``, ``segment_sum``, ``jagged`` (per-row work on jagged per-token fields)
* the block, its validation and the host description: ``BLOCK_KEYS``, ``DataflexConfig``, ``METHOD_KEYS``,
  ``method_keys``, ``installed_registry``, ``validate``, ``CAPABILITIES``, ``EVENT_FIELDS``, ``HostDescription``,
  ``MINIBATCH_INDEX``, ``mechanism``, ``Allocate``, ``Replayer``, ``Reweight``, ``article``, ``check_section``,
  ``Param``, ``unknown_key``, ``differences``
* config files, checkpoint state files (the envelope, entries restored by name), caches: ``apply_overrides``,
  ``load_config``, ``load_yaml``, ``missing_file_hint``, ``check_format``, ``CheckpointError``, ``discard``,
  ``read_checked``, ``read_state``, ``restore``, ``Retention``, ``save_state``, ``state_file``, ``TEMPORARY``,
  ``warn_no_state``, ``cache_root``, ``ENV_CACHE``, ``fingerprint``, ``FALLBACK_MEMORY``, ``format_bytes``, ``GIB``,
  ``machine_memory``
* errors: ``add_note``, ``BatchFieldError``, ``clip_text``, ``ConfigError``, ``ConfigIssue``, ``DataflexError``,
  ``format_traceback``, ``PluginRuntimeError``, ``SignalInterrupt``
* the host registry and doctor helpers: ``Contract``, ``HostEntry``, ``Add``, ``add_block``, ``block_warnings``,
  ``FAIL``, ``new_checks``, ``OK``, ``plugin_checks``, ``report``, ``tested_version``, ``version``, ``WARN``,
  ``validation_report``
* lazy re-exports (a host package whose import stays light): ``lazy_exports``
"""

from __future__ import annotations

import sys
from importlib import import_module
from typing import TYPE_CHECKING, Any

#: name -> the core module it comes from.
_EXPORTS = {
    # the step kit: one run's runtime and plan, one step's drivers, what they carry out
    "Runtime": "runtime",
    "Plan": "plan",
    "Candidates": "steps",
    "Chosen": "steps",
    "Step": "steps",
    "StepKit": "steps",
    "concat_rounds": "generation",
    "concat_rows": "generation",
    "Generation": "generation",
    "group_labels": "generation",
    "RolloutOutcome": "generation",
    "AdvantageAction": "carry",
    "skipped_summary": "step_metrics",
    "domain_labels": "sampler",
    "DomainSampler": "sampler",
    "prepare_prompts": "sampler",
    "PromptTable": "history",
    "Record": "replay",
    "Replayed": "replay",
    "ReplayPart": "replay",
    "ReplayRun": "replay",
    "allocator": "allocation",
    "ObjectCheck": "replay_store",
    "pad_to": "replay_store",
    # batches and their tensor helpers
    "Batch": "batch",
    "jagged": "jagged",
    "grpo_outcome_advantage": "ops",
    "segment_count": "ops",
    "segment_max": "ops",
    "segment_min": "ops",
    "segment_slots": "ops",
    "segment_sum": "ops",
    # the block, its validation and the host description
    "BLOCK_KEYS": "block",
    "DataflexConfig": "block",
    "METHOD_KEYS": "block",
    "method_keys": "block",
    "installed_registry": "validation",
    "validate": "validation",
    "CAPABILITIES": "host",
    "EVENT_FIELDS": "host",
    "HostDescription": "host",
    "MINIBATCH_INDEX": "host",
    "mechanism": "mechanisms",
    "Allocate": "mechanisms.allocate",
    "Replayer": "mechanisms.replay",
    "Reweight": "mechanisms.reweight",
    "article": "registry",
    "check_section": "schema",
    "Param": "schema",
    "unknown_key": "schema",
    "differences": "confdiff",
    # config files, checkpoint state files (the envelope, entries restored by name), caches
    "apply_overrides": "config",
    "load_config": "config",
    "load_yaml": "config",
    "missing_file_hint": "config",
    "check_format": "state_file",
    "CheckpointError": "state_file",
    "discard": "state_file",
    "read_checked": "state_file",
    "read_state": "state_file",
    "restore": "state_file",
    "Retention": "state_file",
    "save_state": "state_file",
    "state_file": "state_file",
    "TEMPORARY": "state_file",
    "warn_no_state": "state_file",
    "cache_root": "cache",
    "ENV_CACHE": "cache",
    "fingerprint": "fingerprint",
    "FALLBACK_MEMORY": "memory",
    "format_bytes": "memory",
    "GIB": "memory",
    "machine_memory": "memory",
    # errors
    "add_note": "errors",
    "BatchFieldError": "errors",
    "clip_text": "errors",
    "ConfigError": "errors",
    "ConfigIssue": "errors",
    "DataflexError": "errors",
    "format_traceback": "errors",
    "PluginRuntimeError": "errors",
    "SignalInterrupt": "errors",
    # the host registry and doctor helpers
    "Contract": "hosts",
    "HostEntry": "hosts",
    "Add": "doctor",
    "add_block": "doctor",
    "block_warnings": "doctor",
    "FAIL": "doctor",
    "new_checks": "doctor",
    "OK": "doctor",
    "plugin_checks": "doctor",
    "report": "doctor",
    "tested_version": "doctor",
    "version": "doctor",
    "WARN": "doctor",
    "validation_report": "checkconfig",
    # lazy re-exports (a host package whose import stays light)
    "lazy_exports": "_lazy",
}

#: Names that are a core module itself (``kit.state_file.write``), not one of its attributes.
_MODULES = frozenset({"jagged", "state_file"})

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}: a host adapter imports the core "
                             "from dataflex_bus.kit, which exports what the adapters use (add it there)")
    loaded = import_module(f".{module}", "dataflex_bus")
    value = loaded if name in _MODULES else getattr(loaded, name)
    sys.modules[__name__].__dict__[name] = value
    return value


if TYPE_CHECKING:
    from . import jagged as jagged
    from . import state_file as state_file
