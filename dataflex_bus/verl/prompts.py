"""Prompt ids for verl's training dataset: ``(data_source, extra_info.index)``, checked once when the
dataloader is built, and the ids of fetched prompts."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..kit import BatchFieldError, ConfigError, ConfigIssue, PromptTable, domain_labels
from .tqbatch import labels_of

#: The dataset attribute dataflex reads the training prompts' table from: verl's ``RLHFDataset.dataframe``, a
#: ``datasets.Dataset`` of every training row (columns ``data_source``, ``extra_info``, ``prompt``).
FRAME = "dataframe"
#: The plan's parts (:data:`~dataflex_bus.plan.WHY`) that read that table: stable prompt ids (a selection before
#: generation, the per-prompt history, a replay buffer) and a mixer's domain labels of every row. Refill alone
#: draws through verl's own dataloader.
ROW_TABLE_PARTS = ("before_generation", "reads_history", "replays", "samples_domains")


def training_frame(dataset: Any, needs: Mapping[str, str], custom_cls: Any = None) -> Any:
    """The table of ``dataset``'s training rows when the block ``needs`` it (config key -> why: the plan's
    :meth:`~dataflex_bus.plan.Plan.draws_by_row` parts that read the dataset by row), ``None`` when nothing does.

    Any dataset verl accepts (``data.custom_cls``) runs when nothing needs its rows by id; a block that does is
    refused, one issue per config key asking, naming ``data.custom_cls`` and what the class lacks."""
    if not needs:
        return None
    frame = getattr(dataset, FRAME, None)
    if frame is not None and hasattr(frame, "column_names") and hasattr(frame, "__getitem__"):
        return frame
    custom = custom_cls is not None and custom_cls.get("path", None) is not None
    name = type(dataset).__qualname__
    where = f"data.custom_cls ({name} from {custom_cls.get('path')})" if custom else f"the training dataset ({name})"
    lacks = (f"has no `{FRAME}` attribute" if frame is None
             else f"has a `{FRAME}` of type {type(frame).__name__}, not a table with column_names")
    key = "data.custom_cls" if custom else "data.train_files"
    raise ConfigError([ConfigIssue(key, f"{mkey} {why}, so dataflex reads the training prompts' table (data source, "
                                   f"extra_info.index and prompt of every row) from the dataset's `{FRAME}`, as "
                                   f"verl's RLHFDataset keeps it (a datasets.Dataset); {where} {lacks}. Keep the "
                                   f"rows in `self.{FRAME}` (subclass RLHFDataset) or drop {mkey}")
                       for mkey, why in needs.items()])


def dataset_prompt_table(frame: Any, domain_key: str, prompt_key: str = "prompt") -> PromptTable:
    """The training dataset's prompt ids ``(domain_key column, extra_info.index)``, checked once.

    verl's ``RLHFDataset`` gives a row without ``extra_info.index`` the index 0 and each fetch a fresh
    ``uid``, so neither identifies a prompt across steps: every row must carry its own index. Rows
    sharing an id are accepted only when their prompts are identical (a repeated prompt is one prompt).
    """
    columns = list(frame.column_names)
    labels = domain_labels(frame, domain_key, required=True, why="prompt ids are (data source, extra_info.index)")
    assert labels is not None
    n = len(frame)
    infos = frame["extra_info"] if "extra_info" in columns else [None] * n
    missing = [i for i, info in enumerate(infos) if not isinstance(info, Mapping) or info.get("index") is None]
    if missing:
        raise ConfigError(ConfigIssue(
            "extra_info.index", f"{len(missing)} of {n} training rows (the first: row {missing[0]}) have no "
            "extra_info.index; verl gives them all index 0, so their per-prompt histories would merge. Set a "
            "unique extra_info.index per prompt of a data source"))
    indices = [info["index"] for info in infos if isinstance(info, Mapping)]
    try:
        rows = torch.tensor([int(i) for i in indices], dtype=torch.long)
    except (TypeError, ValueError) as exc:
        raise ConfigError(ConfigIssue("extra_info.index", f"must be an integer in every training row ({exc})")) \
            from None
    names = sorted(set(labels))
    position = {name: i for i, name in enumerate(names)}
    ids = torch.tensor([position[x] for x in labels], dtype=torch.long)
    keys = ids * (rows.max() + 1) + rows
    uniq, inverse, counts = torch.unique(keys, return_inverse=True, return_counts=True)
    if bool((counts > 1).any()):
        repeated = torch.nonzero(counts[inverse] > 1).flatten().tolist()
        prompts = frame[prompt_key] if prompt_key in columns else [None] * n
        first: dict[int, Any] = {}
        for i in repeated:  # only rows whose id repeats: compare their prompts
            key = int(keys[i])
            if key in first and first[key] != prompts[i]:
                raise ConfigError(ConfigIssue(
                    "extra_info.index", f"rows with data source {labels[i]!r} and extra_info.index={int(rows[i])} "
                    "hold different prompts; set a unique extra_info.index per prompt of a data source"))
            first.setdefault(key, prompts[i])
        firsts = torch.full((uniq.numel(),), n, dtype=torch.long).scatter_reduce(0, inverse, torch.arange(n), "amin")
        ids, rows = ids[firsts], rows[firsts]
    return PromptTable(names, ids, rows, column="extra_info.index")


def candidate_ids(table: PromptTable, chunk: Any, domain_key: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Domain ids (into the prompt table's domains) and ``extra_info.index`` of fetched prompts."""
    position = {name: i for i, name in enumerate(table.domains)}
    labels = [str(x) for x in labels_of(chunk[domain_key])]
    unknown = sorted(set(labels) - set(position))
    if unknown:
        raise BatchFieldError("dataflex prompt ids", domain_key,
                              f"domain {unknown[0]!r} is not in the training dataset's prompt table")
    ids = torch.tensor([position[label] for label in labels], dtype=torch.long)
    rows = torch.tensor([int(x) for x in labels_of(chunk["index"])], dtype=torch.long)
    return ids, rows
