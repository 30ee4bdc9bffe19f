"""TRL 1.16's ``GRPOTrainer`` as a host: what :class:`~dataflex_bus.trl.DataflexGRPOTrainer` provides at each
event and carries out, read from a ``GRPOConfig``.

Import-light (no TRL import): ``dataflex doctor --host trl`` checks a block against a ``GRPOConfig``-like
object or a plain mapping of its fields. The rules here are TRL's settings under which a method would not do
what it says: a loss type whose normaliser a removed row was not proven to leave exact, or a generation batch
that does not span whole optimizer steps (an empty one could not skip its update, a mixer's probabilities
would apply in the middle of an optimizer step). Each is refused naming the ``GRPOConfig`` field and what to
set instead. Given the training dataset and whether environments are used (as the trainer gives them), the
description lacks what the host cannot carry out on them (``prompt_ids`` over an ``IterableDataset``,
``regenerates_kept_rows`` under ``environment_factory``): validation refuses the plan entries needing them
in the one capability loop. What a block asks of the host's modes is the run's
:class:`~dataflex_bus.plan.Plan`, the one the trainer runs by; its checks here refuse a selection round
larger than the dataset and image columns.
"""

from __future__ import annotations

import logging
import math
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ..kit import CAPABILITIES, EVENT_FIELDS, ConfigIssue, HostDescription, Plan
from . import vllm
from .arguments import field_of

if TYPE_CHECKING:
    from ..kit import DataflexConfig

log = logging.getLogger("dataflex_bus")

NAME = "trl"
#: ``loss_type`` values under which removing a row leaves the update exactly as if it had never been generated
#: and a weight ``w >= 0`` multiplied into the advantages multiplies the policy-gradient term by ``w``
#: (tests/trl_tier/test_trl_exact.py and test_trl_loss_types.py compare each against plain TRL). Why each holds:
#: the normalisers are per-row means (grpo, sapo, luspo), micro-batch token sums (bnpo), rows x
#: max_completion_length (dr_grpo) or ``num_items_in_batch`` (dapo, cispo, vespo), which the host recomputes for
#: the kept rows; every per-token loss is linear in the advantage once its sign is fixed (sapo's temperature and
#: vespo's gamma shape read only the sign, which a positive weight keeps; a zero weight zeroes the term).
SUPPORTED_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
KEY = "GRPOConfig"

ON_ROLLOUT = frozenset({"prompts", "responses", "response_mask", "loss_mask", "attention_mask", "input_ids",
                        "rm_scores", "uid", "data_source"})
#: ``rollout_log_probs``: the behaviour log-probs, on transformers' generation the old log-probs (the policy
#: that sampled the rows computes them, nothing moves between), with vLLM vLLM's sampling log-probs
#: (:mod:`~dataflex_bus.trl.vllm`), a replayed row's stored ones.
ON_ADVANTAGE = ON_ROLLOUT | {"old_log_probs", "advantages", "entropy", "rollout_log_probs"}
_MISSING = {
    "rollout_is_weights": "TRL applies vLLM's importance-sampling ratio inside its loss; dataflex weights multiply "
                          "the advantages instead",
    "returns": "TRL trains GRPO without returns (the advantages are the only target)",
    "values": "TRL's GRPOTrainer has no critic",
    "token_level_rewards": "TRL's reward is one scalar per completion (rm_scores on its last token)",
}
#: What the TRL host does not carry out, and why (said in the refusal): nothing, on transformers' generation.
LACKS: dict[str, str] = {}
#: Why ``prompt_ids`` is lacking over an ``IterableDataset``.
ITERABLE_DATASET = "train_dataset is an IterableDataset, whose rows cannot be drawn by index; use a datasets.Dataset"
#: Why ``regenerates_kept_rows`` is lacking under ``environment_factory``.
ENVIRONMENTS = ("environment_factory is given, and environments keep per-rollout state that cannot be replayed "
                "(TRL would reset() every environment again); use rollout_func")
CAPABILITIES_TRL = frozenset(CAPABILITIES) - set(LACKS)
#: Top-level keys of TRL's config form (``dataflex doctor --host trl --config``, the trainer's ``dataflex=`` file).
SECTIONS = frozenset({"dataflex", "grpo", "model", "prompt_tokens"})
#: Those only TRL's form has: a shim run config has a ``model`` section too, never ``grpo`` or ``prompt_tokens``.
ONLY_SECTIONS = frozenset({"grpo", "prompt_tokens"})
#: Top-level keys of a bare block (a ``dataflex=`` file may hold the block itself).
BLOCK_KEYS = frozenset({"mechanism", "methods"})


def claims(config: Mapping[str, Any]) -> str | None:
    """Why a config file is TRL's (``dataflex:`` alone, or with ``grpo:``/``prompt_tokens:`` and ``model:``; or a
    bare block: the forms TRL's ``dataflex=`` file and doctor take), ``None`` when it is not."""
    keys = set(config)
    if BLOCK_KEYS & keys:
        return "a bare dataflex block, the form TRL's dataflex= file takes"
    if keys and keys <= SECTIONS and (keys <= {"dataflex"} or keys & ONLY_SECTIONS):
        return "only " + " and ".join(f"`{k}:`" for k in sorted(keys)) + ", TRL's config form"
    return None


def generation_span(args: Any) -> tuple[int, int]:
    """``(micro-steps per generation batch, gradient_accumulation_steps)``: TRL generates once every
    ``steps_per_generation * num_iterations`` micro-steps (its ``steps_per_generation`` defaults to the
    accumulation steps)."""
    accumulation = int(field_of(args, "gradient_accumulation_steps", 1))
    spg = int(field_of(args, "steps_per_generation", accumulation))
    return spg * int(field_of(args, "num_iterations", 1)), accumulation


def round_unit(generations: int, processes: int) -> int:
    """Prompts a round is rounded up to, so that every process gets whole rows (TRL gathers every process's
    rewards: each generates as many rows)."""
    return processes // math.gcd(generations, processes)


def generation_prompts(args: Any, processes: int = 1) -> int:
    """Prompts (groups) of one TRL generation batch: ``generation_batch_size / num_generations``
    (``GRPOConfig`` derives the batch from ``per_device_train_batch_size x processes x steps_per_generation``
    when it is unset)."""
    size = field_of(args, "generation_batch_size")
    if size is None:
        accumulation = field_of(args, "gradient_accumulation_steps", 1)
        size = int(field_of(args, "per_device_train_batch_size", 8)) * processes * int(
            field_of(args, "steps_per_generation", accumulation))
    return int(size) // int(field_of(args, "num_generations", 8))


#: Dataset columns of images (TRL's vision-language path), which the host does not carry.
IMAGE_COLUMNS = frozenset({"image", "images"})


def iterable(dataset: Any) -> bool:
    """Whether ``dataset`` is an ``IterableDataset`` (torch's, which ``datasets``' subclasses): rows cannot be
    drawn by index. Read without importing torch (a torch dataset means torch is loaded)."""
    data = sys.modules.get("torch.utils.data")
    return data is not None and isinstance(dataset, data.IterableDataset)


def describe(args: Any, *, processes: int | None = None, dataset: Any = None, environments: bool = False,
             model: Mapping[str, int] | None = None, prompt_tokens: int = 0) -> HostDescription:
    """The host description of a TRL run configured by ``args`` (a ``GRPOConfig`` or a mapping of its fields) on
    ``processes`` processes (default: ``args.world_size`` when it has one, else 1), training on ``dataset``
    (``None``: not known) with ``environments`` (``GRPOTrainer``'s ``environment_factory`` given), a model of
    ``model``'s shape (:func:`~dataflex_bus.trl.sizes.model_shape`; ``None``: not known) and prompts of up to
    ``prompt_tokens`` tokens: its rows' bytes (:func:`~dataflex_bus.trl.sizes.row_bytes`)."""
    from .sizes import row_bytes, stored_row_bytes

    advantage = set(ON_ADVANTAGE)
    missing = {**_MISSING, **LACKS}
    capabilities = set(CAPABILITIES_TRL)
    rollout_is = vllm.adjust(args, capabilities, missing) if vllm.uses_vllm(args) else None
    if float(field_of(args, "beta", 0.0)) != 0.0:
        advantage.add("ref_log_prob")
    else:
        missing["ref_log_prob"] = "GRPOConfig.beta is 0, so TRL computes no reference log-probs; set beta > 0"
    if iterable(dataset):
        capabilities.discard("prompt_ids")
        missing["prompt_ids"] = ITERABLE_DATASET
    if environments:
        capabilities.discard("regenerates_kept_rows")
        missing["regenerates_kept_rows"] = ENVIRONMENTS
    if processes is None:
        processes = int(field_of(args, "world_size", 1)) if not isinstance(args, Mapping) else 1
    generations = field_of(args, "num_generations")
    row, basis = row_bytes(args, model, prompt_tokens)
    stored, stored_basis = stored_row_bytes(args, prompt_tokens)
    fields = {"on_prompts": EVENT_FIELDS["on_prompts"], "on_rollout": ON_ROLLOUT,
              "on_advantage": frozenset(advantage), "on_step_end": frozenset(advantage)}
    return HostDescription(NAME, fields=fields, capabilities=frozenset(capabilities), adv_estimator="grpo",
                           group_size=int(generations) if generations is not None else None,
                           loss_agg=str(field_of(args, "loss_type", "dapo")), processes=processes, missing=missing,
                           check=lambda cfg, key: block_issues(args, cfg, key, dataset=dataset, processes=processes),
                           group_size_name=f"{KEY}.num_generations", row_bytes=row, row_bytes_basis=basis,
                           stored_row_bytes=stored, stored_row_basis=stored_basis, rollout_is=rollout_is)


def config_issues(args: Any, *, processes: int = 1) -> list[ConfigIssue]:
    """What TRL 1.16's ``GRPOConfig`` itself refuses of a generation batch's shape (its ``__post_init__``), for
    ``dataflex doctor --host trl``, which checks a mapping of fields without building a ``GRPOConfig`` (whose
    other checks depend on the machine: bf16 without a GPU, ...). ``args``: a mapping of fields (TRL's
    defaults for the rest)."""
    issues: list[ConfigIssue] = []
    generations = int(field_of(args, "num_generations", 8))
    per_device = int(field_of(args, "per_device_train_batch_size", 8))
    gbs, spg = field_of(args, "generation_batch_size"), field_of(args, "steps_per_generation")
    if generations < 2:
        issues.append(ConfigIssue(f"{KEY}.num_generations", f"{generations}: TRL's GRPO needs at least 2 completions "
                                  "per prompt (its advantages are group statistics); TRL refuses it"))
    if gbs is not None and spg is not None:
        issues.append(ConfigIssue(f"{KEY}.generation_batch_size", "is set together with steps_per_generation, "
                                  "which TRL refuses", hint="set one of the two"))
        return issues
    if gbs is not None and int(gbs) % (per_device * processes):
        issues.append(ConfigIssue(f"{KEY}.generation_batch_size", f"{gbs} is not a multiple of the global batch "
                                  f"per_device_train_batch_size x processes = {per_device * processes}, which TRL "
                                  "refuses"))
        return issues
    size = int(gbs) if gbs is not None else per_device * processes * int(
        spg if spg is not None else field_of(args, "gradient_accumulation_steps", 1))
    if generations >= 1 and size % generations:
        issues.append(ConfigIssue(
            f"{KEY}.num_generations", f"{generations} does not divide the generation batch of {size} completions "
            "(per_device_train_batch_size x processes x steps_per_generation), which TRL refuses: a batch holds "
            "whole groups", hint=f"a divisor of {size}, or a per_device_train_batch_size that is a multiple of "
            f"{generations}"))
    return issues


def block_issues(args: Any, cfg: DataflexConfig, key: str = "dataflex", *, dataset: Any = None,
                 processes: int = 1) -> list[ConfigIssue]:
    """TRL settings, and the training dataset when known, under which the block's methods would not do what
    they say (what the dataset and environments cannot give is the description's lacking capabilities)."""
    issues: list[ConfigIssue] = []
    plan = Plan.of(cfg, key)  # the trainer's own: what is refused here is what it would run
    if dataset is not None and not iterable(dataset) and hasattr(dataset, "__len__"):
        issues.extend(_round_issues(args, cfg, plan, len(dataset), key, processes))
    images = sorted(set(getattr(dataset, "column_names", None) or []) & IMAGE_COLUMNS)
    if images:
        issues.append(ConfigIssue("train_dataset", f"multimodal rows (column {images[0]!r}) are not supported by "
                                  "the dataflex TRL host", ["text prompts"]))
    loss_type = str(field_of(args, "loss_type", "dapo"))
    if loss_type not in SUPPORTED_LOSS_TYPES:
        issues.append(ConfigIssue(
            f"{KEY}.loss_type", f"{loss_type!r} is not a TRL 1.16 loss type: the TRL host removes dropped rows "
            f"from the update and is proven exact for {', '.join(SUPPORTED_LOSS_TYPES)}", list(SUPPORTED_LOSS_TYPES)))
    span, accumulation = generation_span(args)
    if span % accumulation:
        issues.append(ConfigIssue(
            f"{KEY}.gradient_accumulation_steps",
            f"{accumulation} does not divide steps_per_generation x num_iterations = {span}: an optimizer step would "
            "mix two generation batches, so an empty one could not skip its update and a mixer's probabilities "
            "would change in the middle of an optimizer step",
            hint=f"set gradient_accumulation_steps to a divisor of {span} (e.g. leave steps_per_generation unset: "
                 "it defaults to gradient_accumulation_steps)"))
    if vllm.uses_vllm(args):
        issues.extend(vllm.replay_issues(args, cfg, key))
        vllm.warn_server(args)
    return issues


def _round_issues(args: Any, cfg: DataflexConfig, plan: Plan, rows: int, key: str,
                  processes: int) -> list[ConfigIssue]:
    """A round drawn through a selection before generation chooses each prompt at most once
    (:class:`~dataflex_bus.fill.PromptFill`), so a round of more prompts than the dataset's rows cannot be
    filled. The largest round: ``dataflex.refill.gen_batch_size``, else the generation batch's prompts."""
    if not plan.fills_prompts:
        return []
    generations = int(field_of(args, "num_generations", 8))
    unit = round_unit(generations, processes)
    target = generation_prompts(args, processes)
    gen = cfg.refill.gen_batch_size if cfg.refill is not None else None
    wanted = -(-(gen or target) // unit) * unit
    if wanted <= rows:
        return []
    tail = (f"a round drawn through the selection before generation ({', '.join(plan.before_generation)}) takes "
            f"{wanted} distinct prompts, and train_dataset holds {rows} rows")
    if gen:
        return [ConfigIssue(f"{key}.refill.gen_batch_size", f"{gen}: {tail}",
                            hint=f"at most {rows // unit * unit}, or a larger train_dataset")]
    return [ConfigIssue(f"{KEY}.generation_batch_size", f"{target * generations} completions, {target} prompts of "
                        f"num_generations={generations}: {tail}",
                        hint="a smaller generation batch, or a larger train_dataset")]
