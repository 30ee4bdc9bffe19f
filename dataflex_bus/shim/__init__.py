"""The CPU shim: a minimal in-process GRPO trainer that runs dataflex methods on a laptop in a minute.

It follows verl v1's step order and data contract (field names, reward on the last token, groups by
``uid``, domains by ``data_source``) and emits the same bus events through :class:`dataflex_bus.Runtime`,
so a plugin tried here runs unchanged inside verl. verl itself is never imported.

Public API: :func:`run_training` -> :class:`RunResult`.
"""

from __future__ import annotations

from .files import CheckpointError, RunDirError
from .run import RunResult, run_training

__all__ = ["CheckpointError", "RunDirError", "RunResult", "run_training"]
