"""Stable prompt ids for the shim's tasks: ``(domain, row of the domain's training prompts)``.

The per-prompt history (:mod:`dataflex_bus.history`) needs every prompt the sampler can draw to have a
fixed id from a finite table. The shim's training prompts are the split's
(:class:`~dataflex_bus.shim.split.Split`): per domain, its levels in order and, within a level, the
training prompts in increasing number; a prompt's row is its position there. Held-out prompts have no id:
they are never drawn.
"""

from __future__ import annotations

from ..kit import PromptTable
from .split import Split

#: What a user would set to give prompts stable ids (named in errors about ids).
ID_COLUMN = "prompt row (domain, level, digits)"


def prompt_table(split: Split) -> PromptTable:
    """Every training prompt of the split's domains (ids into its names are the shim's domain ids)."""
    return PromptTable.full(split.names, split.domain_train_sizes(), column=ID_COLUMN)


__all__ = ["ID_COLUMN", "prompt_table"]
