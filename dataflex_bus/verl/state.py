"""verl's host state in verl's checkpoints: ``global_step_N/dataflex_state.pt`` (the runtime's plugins, the host
kit's counters, the domain sampler), written before verl's own files and restored after verl resumed, through
the kit's checked state file (:mod:`dataflex_bus.state_file`)."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from verl.utils.checkpoint.checkpoint_manager import find_latest_ckpt_path

from .. import __version__
from ..kit import ConfigError, ConfigIssue, Retention, check_format, read_state, restore, save_state, warn_no_state

if TYPE_CHECKING:
    from .trainer import DataflexTrainer

log = logging.getLogger("dataflex_bus")

#: File written into every ``global_step_N`` checkpoint folder.
STATE_FILE = "dataflex_state.pt"
#: 3: behind the kit's checksum header; 2, a plain ``torch.save``, is refused naming the file.
STATE_FORMAT = 3
FRESH = f"resume from another global_step_N, or remove {STATE_FILE} to start the dataflex method fresh"


def state_dict(trainer: DataflexTrainer) -> dict[str, Any]:
    sampler = trainer.domain_sampler
    return {"format": STATE_FORMAT, "dataflex_bus": __version__, "global_steps": trainer.global_steps,
            "runtime": trainer.dataflex.state_dict(), "kit": trainer.kit.state_dict(),
            "sampler": sampler.state_dict() if sampler is not None else None}


def load(trainer: DataflexTrainer, state: Mapping[str, Any], source: str = STATE_FILE) -> None:
    """Restore what :func:`state_dict` returned; each entry named when it is missing or unfit."""
    check_format(source, state, "verl", (STATE_FORMAT,), FRESH)

    def sampler(saved: Any) -> None:
        if (saved is None) != (trainer.domain_sampler is None):
            raise ConfigError(ConfigIssue("dataflex.mechanism", f"{source} and this run disagree on whether "
                                          "prompts are drawn by domain (mix): "
                                          f"{'the checkpoint' if saved is not None else 'this run'} does"))
        if saved is not None and trainer.domain_sampler is not None:
            trainer.domain_sampler.load_state_dict(saved)

    restore(source, state, {"runtime": trainer.dataflex.load_state_dict, "kit": trainer.kit.load_state_dict,
                            "sampler": sampler}, FRESH)


def retention(config: Any) -> int | None:
    """How many of its checkpoints verl keeps (``trainer.max_actor_ckpt_to_keep``; 1 under the deprecated
    ``remove_previous_ckpt_in_save``; ``None``: all), read as verl's ``_save_checkpoint`` reads it."""
    trainer = config.trainer
    if bool(trainer.get("remove_previous_ckpt_in_save", False)):
        return 1
    keep = trainer.get("max_actor_ckpt_to_keep", None)
    return keep if isinstance(keep, int) and not isinstance(keep, bool) and keep > 0 else None


def save(trainer: DataflexTrainer) -> None:
    """``global_step_N/dataflex_state.pt``, the files of older steps this process saved pruned as verl prunes
    its actor checkpoints (:func:`retention`)."""
    folder = os.path.join(trainer.config.trainer.default_local_dir, f"global_step_{trainer.global_steps}")
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, STATE_FILE)
    save_state(path, state_dict(trainer))
    kept = trainer.__dict__.setdefault("dataflex_retention", Retention(retention(trainer.config)))
    for old in kept.wrote(path):
        log.info("dataflex: removed %s (trainer.max_actor_ckpt_to_keep=%s)", old, kept.keep)


def resume_folder(config: Any) -> str | None:
    """The folder verl's ``_load_checkpoint`` resumed from (verl's resolution rules)."""
    trainer = config.trainer
    if trainer.resume_mode == "auto":
        root = trainer.default_local_dir
        return find_latest_ckpt_path(root if os.path.isabs(root) else os.path.join(os.getcwd(), root))
    if trainer.resume_mode == "resume_path":
        path = trainer.resume_from_path
        return path if os.path.isabs(path) else os.path.join(os.getcwd(), path)
    return None


def resume(trainer: DataflexTrainer) -> None:
    """After verl resumed at a step > 0: the dataflex state saved beside its checkpoint (none: the method
    starts fresh)."""
    folder = resume_folder(trainer.config)
    path = os.path.join(folder, STATE_FILE) if folder else None
    if path is None or not os.path.exists(path):
        warn_no_state("verl", trainer.global_steps, folder, STATE_FILE)
        return
    load(trainer, read_state(path, FRESH), path)
    log.info("dataflex: restored method state from %s", path)
