"""verl's ``dataflex_sync`` trainer as a host of the contract suite: the real trainer class, verl's ``fit``
and step, replay buffer, padding, advantage and TransferQueue, with the harness's agent loop writing the
world's rollouts and its actor worker recording exactly what the update receives (``verl_harness.py``)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
from world import DOMAINS, SOLVED, N, StepRecord, World, add_row, kit_metrics, row_record

# The driver builds on the verl tier's harness (verl_harness.py, verl_components.py).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "verl_tier"))

#: verl's other settings the refusal cases describe (what each lacks is read from its description).
CONFIGURATIONS = [["trainer.v1.trainer_mode=dataflex_colocate_async"],
                  ["actor_rollout_ref.actor.policy_loss.loss_mode=bypass_mode"]]


def before_case(request: Any) -> None:
    """An empty TransferQueue partition and the verl tier's in-process components, before each case."""
    request.getfixturevalue("clean_partition")
    import verl_components  # noqa: F401  (registers on import)


def hydra_value(value: Any) -> str:
    """``value`` in Hydra's override grammar (dicts and lists as literals)."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {hydra_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(hydra_value(v) for v in value) + "]"
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    return str(value)


def block_overrides(block: dict[str, Any] | None) -> list[str]:
    """The ``+dataflex...`` overrides of a block (the documented way: one override per top-level key)."""
    return [f"+dataflex.{k}={hydra_value(v)}" for k, v in (block or {}).items()]


def _harness():
    import verl_harness

    return verl_harness


def run(block: dict[str, Any] | None, world: World, *, batch: int, steps: int, tmp_path: Path,
        settings: Any = ()) -> list[StepRecord]:
    """``steps`` steps of ``block`` on the world (``settings``: verl overrides the case needs)."""
    H = _harness()
    data = H.write_dataset(tmp_path / "train.parquet", world.counts)
    overrides = H.base_overrides(data, tmp_path / "ckpt", steps=steps, batch=batch, mini=batch, n=N)
    # Prompts in dataset order, fetched one at a time, rows in arrival order: as the shim driver draws them.
    same_order = ["data.shuffle=False", "data.gen_batch_size=1", "trainer.balance_batch=False"]
    run = H.Run([*overrides, *same_order, "trainer.save_freq=-1", *settings, *block_overrides(block)]).setup()
    probs: list[dict[str, float] | None] = []
    runtime = run.trainer.dataflex
    step = run.trainer.step

    def recording_step(metrics: dict, timing_raw: dict):
        out = step(metrics, timing_raw)
        probs.append(runtime.domain_probs)
        return out

    run.trainer.step = recording_step
    run.fit(solved=SOLVED)
    agent, actor = run.agent_loop, run.trainer.actor_rollout_wg
    records = []
    updates = iter(actor.updates)
    for logged, published in zip(run.logged, probs):
        record = StepRecord(metrics=kit_metrics(logged), domain_probs=published)
        if logged.get("dataflex/skipped_update"):
            record.skipped = True
            records.append(record)
            continue
        update = next(updates)
        weights = update.get("rollout_is_weights")
        for i, (key, padding) in enumerate(zip(update["keys"], update["is_padding"])):
            if padding:
                continue
            # What the row was generated as (a replayed row is under a new key: a new uid, or a fresh group's
            # uid and the next session)
            domain, row, session = update["data_source"][i], int(update["index"][i]), int(update["session_id"][i])
            assert agent.prompts.get(key.split("_")[0], (domain, row)) == (domain, row), key
            mask = torch.clamp(update["loss_mask"][i], min=0)  # the recorder pads with -1
            if not bool(mask.any()):
                continue  # a row verl masked out of the loss: not trained (the shim removes it)
            old, mu = update.get("old_log_probs"), update.get("rollout_log_probs")
            add_row(record, domain, row, session,
                    row_record(update["advantages"][i], None if weights is None else weights[i], mask,
                               None if old is None else old[i], None if mu is None else mu[i]))
        records.append(record)
    return records


def description(overrides: list[str] | None = None) -> Any:
    from dataflex_bus.verl.host import describe

    H = _harness()
    return describe(H.compose(H.base_overrides(Path("/nonexistent/train.parquet"), Path("/tmp/ckpt"), n=N)
                              + list(overrides or [])))


__all__ = ["DOMAINS", "block_overrides", "description", "run"]
