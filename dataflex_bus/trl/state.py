"""The TRL host's state in TRL's checkpoints: ``checkpoint-N/dataflex_state.pt`` (the runtime's plugins, the
host kit's counters, the host's prompt stream), written before TRL's own files and restored by
``resume_from_checkpoint``, through the kit's checked state file (:mod:`dataflex_bus.state_file`)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from .. import __version__
from ..errors import ConfigError, ConfigIssue
from ..state_file import check_format, read_state, restore, save_state, warn_no_state
from . import dataset_id

if TYPE_CHECKING:
    from .trainer import DataflexGRPOTrainer

#: File written into every ``checkpoint-N`` folder.
STATE_FILE = "dataflex_state.pt"
#: 2: behind the kit's checksum header (1, a plain ``torch.save``, is refused naming the file).
STATE_FORMAT = 2
FRESH = f"resume from another checkpoint-N, or remove {STATE_FILE} to start the dataflex method fresh"
#: What to do about a checkpoint written for another training dataset (:mod:`~dataflex_bus.trl.dataset_id`).
SAME_DATASET = (f"resume with the training dataset the checkpoint was written for, or remove {STATE_FILE} to start "
                "the dataflex method fresh")


def dataset_identity(trainer: DataflexGRPOTrainer) -> dict[str, Any]:
    """The training dataset's identity, computed once per run (at the first save or at resume)."""
    return trainer.dataflex_settings.dataset_id


def state_dict(trainer: DataflexGRPOTrainer) -> dict[str, Any]:
    stream = trainer.dataflex_settings.stream
    return {"format": STATE_FORMAT, "dataflex_bus": __version__, "global_step": trainer.state.global_step,
            "generation_batches": trainer.dataflex_batch.generations, "runtime": trainer.dataflex.state_dict(),
            "kit": trainer.dataflex_kit.state_dict(), "stream": stream.state_dict() if stream is not None else None,
            "dataset": dataset_identity(trainer)}


def load(trainer: DataflexGRPOTrainer, state: dict[str, Any], source: str = STATE_FILE) -> None:
    """Restore what :func:`state_dict` returned; every entry checked, named when it is missing or unfit."""
    check_format(source, state, "TRL", (STATE_FORMAT,), FRESH)

    def stream(saved: Any) -> None:
        if (saved is None) != (trainer.dataflex_settings.stream is None):
            raise ConfigError(ConfigIssue("dataflex", f"{source} and this run disagree on whether the host draws "
                                          "its own prompts (prompt selection, mix, refill, history): "
                                          f"{'the checkpoint' if saved is not None else 'this run'} does"))
        if trainer.dataflex_settings.stream is not None:
            trainer.dataflex_settings.stream.load_state_dict(saved)

    def generations(saved: Any) -> None:
        if not isinstance(saved, int) or saved < 0:
            raise ValueError(f"{saved!r} is not a count of generation batches")
        trainer.dataflex_batch.generations = saved

    def dataset(saved: Any) -> None:
        # Only state keyed by prompt id (history, replay buffer, prompt selection) depends on which prompt sits at
        # a row; a checkpoint without the entry (an older dataflex-bus) is refused only then.
        if trainer.dataflex.plan.needs_prompt_ids:
            dataset_id.check(saved, dataset_identity(trainer), "its per-prompt state (history, replay buffer)",
                             SAME_DATASET)

    # The dataset first: its refusal says what differs, before the prompt table's (the size only) would.
    restore(source, {"dataset": state.get("dataset")}, {"dataset": dataset}, FRESH)
    restore(source, state, {"runtime": trainer.dataflex.load_state_dict, "kit": trainer.dataflex_kit.load_state_dict,
                            "stream": stream, "generation_batches": generations}, FRESH)


def save(trainer: DataflexGRPOTrainer, folder: str) -> None:
    os.makedirs(folder, exist_ok=True)
    save_state(os.path.join(folder, STATE_FILE), state_dict(trainer))


def resume(trainer: DataflexGRPOTrainer, checkpoint: str) -> None:
    """After TRL restored ``checkpoint``: the dataflex state saved beside it (none: the method starts fresh)."""
    path = os.path.join(checkpoint, STATE_FILE)
    if not os.path.exists(path):
        warn_no_state("TRL", trainer.state.global_step, checkpoint, STATE_FILE)
        trainer.dataflex_batch.generations = trainer.state.global_step // trainer.dataflex_settings.span
        return
    load(trainer, read_state(path, FRESH), path)
