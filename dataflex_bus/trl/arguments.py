"""``GRPOTrainer``'s own arguments as :class:`~dataflex_bus.trl.DataflexGRPOTrainer` checks them before TRL's
``__init__``: where TRL would fail deep inside another library, a refusal naming the argument.

Import-light (no TRL): the model is read through its ``config`` attribute only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..kit import ConfigError, ConfigIssue

#: ``GRPOTrainer.__init__``'s positional order (TRL 1.16), up to the arguments read here.
POSITIONAL = ("model", "reward_funcs", "args", "train_dataset", "eval_dataset", "processing_class")


def field_of(args: Any, name: str, default: Any = None) -> Any:
    """``args.name`` of a ``GRPOConfig`` (or a mapping of its fields); ``default`` when absent or ``None``."""
    value = args.get(name) if isinstance(args, Mapping) else getattr(args, name, None)
    return default if value is None else value


def argument(args: Sequence[Any], kwargs: Mapping[str, Any], name: str) -> Any:
    """The value of ``GRPOTrainer`` argument ``name``, given by keyword or by position (``None``: not given)."""
    if name in kwargs:
        return kwargs[name]
    index = POSITIONAL.index(name)
    return args[index] if len(args) > index else None


def check_processing_class(args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
    """A model built from a config (``LlamaForCausalLM(LlamaConfig(...))``) names no checkpoint, so without
    ``processing_class`` TRL asks the Hub for a tokenizer called ``''`` and fails there (``OSError: Repo id
    must use alphanumeric chars``): refused here, naming the argument to pass."""
    if argument(args, kwargs, "processing_class") is not None:
        return
    model = argument(args, kwargs, "model")
    if isinstance(model, str) or model is None:
        return  # a model id or folder: TRL loads its tokenizer from there
    name = getattr(getattr(model, "config", None), "_name_or_path", None)
    if name == "":
        raise ConfigError(ConfigIssue(
            "processing_class", "not given, and the model was built from a config, which names no checkpoint to "
            "load a tokenizer from (TRL would ask the Hub for a repository called '')",
            hint="pass processing_class=<your tokenizer> (docs/trl.md's quick start builds one in code)"))


__all__ = ["POSITIONAL", "argument", "check_processing_class", "field_of"]
