"""Stable prompt ids for the shim's tasks: ``(domain, row of the domain's train split)``.

The per-prompt history (:mod:`dataflex_bus.history`) needs every prompt the sampler can draw to have a
fixed id from a finite table. Today a prompt of the shim is ``[<domain>, a, b]`` with digits ``a, b``,
so each domain has 100 prompts and ``row = 10 * a + b`` is unique per ``(domain, operands)``; the id is
derived from the prompt tokens. When :mod:`dataflex_bus.shim.tasks` gives each domain a fixed train split
with its own row numbering, these two functions are the only place to change.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from ..history import PromptTable
from .tasks import DIGITS, Prompts

#: What a user would set to give prompts stable ids (named in errors about ids).
ID_COLUMN = "prompt row (domain, operands)"


def split_sizes(domains: Sequence[str]) -> list[int]:
    """Number of training prompts of each domain, in ``domains`` order."""
    return [DIGITS * DIGITS for _ in domains]


def prompt_rows(prompts: Prompts) -> Tensor:
    """Long ``[N]``: each prompt's row in its domain's training prompts."""
    return prompts.tokens[:, 1] * DIGITS + prompts.tokens[:, 2]


def prompt_table(domains: Sequence[str]) -> PromptTable:
    """Every training prompt of ``domains`` (ids into ``domains`` are the shim's domain ids)."""
    return PromptTable.full(domains, split_sizes(domains), column=ID_COLUMN)


__all__ = ["ID_COLUMN", "prompt_rows", "prompt_table", "split_sizes"]
