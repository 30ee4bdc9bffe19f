"""The public hook API of dataflex-bus.

Plugins implement these hooks with ``@dataflex_bus.hookimpl``. There are two families:

* **registration** (``dataflex_register``): called once per plugin when plugins are loaded; a plugin
  declares the scorers and actuators it provides. Listing plugins never imports the components, so
  register ``"module:Class"`` strings (or classes from an import-light module).
* **training events** (``on_prompts``, ``on_rollout``, ``on_advantage``, ``on_step_end``): emitted by the
  host loop (the CPU shim, verl's ``dataflex_*`` trainers or TRL's ``GRPOTrainer``) in this order within a
  training step (``on_prompts`` once per draw of candidate prompts, ``on_rollout`` once per generation
  round, the others once per step). The
  pipeline built from the config is the *participant* that acts on each event; any other plugin
  implementing an event hook is an *observer* (a logger, a metric sink): it sees the batch and the
  decision after the participants ran, and if it raises, the error is logged and training goes on.

Every event hook receives the same three arguments, so an implementation may accept any subset of them:
``batch`` (:class:`dataflex_bus.Batch`), ``step`` (the 0-based training step) and ``decision``
(:class:`dataflex_bus.Decision`, which participants fill in and observers read).

Every event's batch from ``on_rollout`` on holds at least ``response_mask``, ``rm_scores``, the row
labels ``uid`` and domain (``data_source`` by default) and the padding flags; each event's docstring lists
what it adds (``on_prompts`` comes before any response exists and says what it holds instead). A host may
keep other fields where they live (verl keeps them in TransferQueue): a participant gets the fields its
components declare in ``requires``, and an observer asks for more with :func:`dataflex_fields`.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from .batch import Batch
    from .decision import Decision
    from .registry import Register

PROJECT = "dataflex"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)

#: The training events in the order the host loop emits them within one step.
EVENTS: tuple[str, ...] = ("on_prompts", "on_rollout", "on_advantage", "on_step_end")


@hookspec
def dataflex_register(register: Register) -> None:
    """Declare the components this plugin provides.

    Call ``register(kind, name, target, summary="")`` once per component, where ``kind`` is ``scorer``
    or the actuator kind of one of the five mechanisms (``selector``, ``reweighter``, ``mixer``,
    ``replayer``, ``allocator``) and ``target`` is the component
    class or an import string ``"package.module:ClassName"`` (preferred: the module is imported only when
    the component is built, so ``dataflex plugins`` stays fast and never imports torch).
    """


@hookspec
def dataflex_fields(event: str) -> Sequence[str]:
    """Name the batch fields this plugin's hook for ``event`` reads beyond the guaranteed ones.

    Called once per event when a host builds its runtime; a host that keeps fields elsewhere (verl)
    fetches the union of what participants require and observers name here. Fields the host does not
    have at that event (see each event below) are left out.
    """


@hookspec
def on_prompts(batch: Batch, step: int, decision: Decision) -> None:
    """The host has drawn candidate prompts and not generated anything for them yet.

    One row per candidate (its own group), with ``prompt_index`` (the prompt's dense index in the
    dataset's prompt table), the domain label and, when a method keeps the per-prompt history, the
    ``history_*`` fields (:mod:`dataflex_bus.history`); nothing about responses exists. A ``select`` method
    with a ``pre_rollout`` scorer acts here: the host generates only the candidates kept and draws more
    (bounded by ``dataflex.max_oversample``) until it has the prompts it needs. An ``allocate`` method with a
    ``pre_rollout`` scorer gives each candidate its number of rollouts (0: not generated) under the step's
    budget (the ``budget_*`` fields), on one draw of the step's candidates. Emitted once per draw, so
    possibly several times per step.
    """


@hookspec
def on_rollout(batch: Batch, step: int, decision: Decision) -> None:
    """Rewards are known; old log-probs, reference log-probs and advantages are not computed yet.

    Available on request: ``prompts``, ``responses``, ``loss_mask``, ``attention_mask``, ``input_ids``,
    ``rollout_log_probs``. Emitted once per generation round (several per step when ``dataflex.refill``
    tops the batch up). A ``select`` method with a ``post_reward`` scorer whose selector keeps or
    drops whole groups (``Selector.keeps_whole_groups``) acts here: the groups it drops are removed before
    any further compute is spent on them. An ``allocate`` method with a ``post_reward`` scorer may give
    groups more rollouts: the host generates them (a continuation round) under the same ``uid`` and the
    round's groups, now larger, are emitted again.
    """


@hookspec
def on_advantage(batch: Batch, step: int, decision: Decision) -> None:
    """Advantages are computed; the policy update has not run.

    Adds ``loss_mask``, ``advantages`` and, when the host computed them, ``rollout_is_weights``; available
    on request: ``old_log_probs``, ``ref_log_prob``, ``returns``, ``entropy``, ``values``,
    ``token_level_rewards`` and, where the host's mini-batches are fixed before the update,
    ``minibatch_index`` (each row's optimizer step). ``reweight`` methods, ``select`` methods with a
    ``post_advantage`` scorer, subset selectors (which rewrite ``advantages`` over the rows they keep),
    token selectors (which keep response tokens) and ``replay`` methods (which pick the step's fresh rows
    to store; stored rows join a later step before its old log-probs) act here.
    """


@hookspec
def on_step_end(batch: Batch, step: int, decision: Decision) -> None:
    """The policy update of this step is done; emitted before the host saves a checkpoint.

    The batch holds the rows that went through the step (after any removal); the fields of
    ``on_advantage`` are available on request. ``mix`` methods update their per-domain statistics here
    and publish the domain probabilities that the sampler uses for the *next* prompts. Observers
    typically log ``decision.metrics`` here.
    """


def documented_hooks() -> dict[str, Any]:
    """Every hookspec in this module, by name (used by the docs test and by ``dataflex plugins``)."""
    return {
        name: obj
        for name, obj in globals().items()
        if callable(obj) and hasattr(obj, f"{PROJECT}_spec")
    }


def markdown() -> str:
    """The hook reference as Markdown, rendered from the docstrings above: ``docs/hooks.md`` embeds
    exactly this text, so the docstrings are the single source (a test compares them)."""
    parts = []
    for name, fn in documented_hooks().items():
        params = ", ".join(inspect.signature(fn).parameters)
        parts.append(f"#### `{name}({params})`\n\n{inspect.cleandoc(fn.__doc__ or '')}\n")
    return "\n".join(parts)
