"""verl 0.9.1's ``dataflex_*`` trainers as a host: what they provide at each event and carry out, read from
the verl config.

Import-light (no verl import): ``dataflex validate`` checks a verl config file with it, ``dataflex doctor``
and the trainer check the composed config. :func:`describe` works on a ``DictConfig`` or a plain mapping.
The rules here are verl's settings that would make a method act otherwise than it says (a loss that
ignores weights, an aggregation under which a masked row still counts, a mode without old log-probs):
each is refused, naming the verl key and what to set.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ..kit import CAPABILITIES, EVENT_FIELDS, MINIBATCH_INDEX, ConfigIssue, HostDescription

if TYPE_CHECKING:
    from ..kit import DataflexConfig

log = logging.getLogger("dataflex_bus")

NAME = "verl"
#: verl policy losses that ignore ``rollout_is_weights`` entirely (core_algos.py, bypass_mode).
WEIGHT_IGNORING_LOSSES = frozenset({"bypass_mode"})
#: verl policy losses that collapse per-token weights to a per-sequence geometric mean.
WEIGHT_COLLAPSING_LOSSES = frozenset({"geo_mean"})
WEIGHT_LOSSES = ["vanilla", "gspo", "dppo_tv", "dppo_kl", "sapo", "gpg", "clip_cov", "kl_cov", "dro", "cispo"]
ROLLOUT_CORRECTION = "algorithm.rollout_correction"
#: Top-level keys only a verl config has: such a file is verl's (``dataflex validate`` checks its dataflex
#: block against verl's context, ``dataflex doctor --config`` runs verl's checks).
SECTIONS = frozenset({"actor_rollout_ref", "algorithm", "critic", "reward_model", "reward",
                      "custom_reward_function", "ray_kwargs", "transfer_queue", "global_profiler"})


def claims(config: Mapping[str, Any]) -> str | None:
    """Why a config file is verl's (it has verl's sections), ``None`` when it is not."""
    found = SECTIONS & set(config)
    return "it has verl's sections " + ", ".join(sorted(found)) if found else None


def check_config(config: Any) -> Any:
    """A verl config's ``dataflex`` block against verl's description of that config, every problem at once
    (the validated block, ``None`` when there is none); raises :class:`~dataflex_bus.errors.ConfigError`."""
    from ..kit import ConfigError, validate

    issues: list[Any] = context_issues(config)
    block, cfg = config.get("dataflex"), None
    if block:
        try:
            cfg = validate(block, host=describe(config))
        except ConfigError as exc:
            issues.extend(exc.issues)
    if issues:
        raise ConfigError(issues)
    return cfg


def select(config: Any, path: str, default: Any = None) -> Any:
    """``config.a.b.c`` for ``path="a.b.c"`` on a DictConfig or nested mappings; ``default`` when any part is
    missing or ``None``."""
    node = config
    for part in path.split("."):
        if node is None or not hasattr(node, "get"):
            return default
        try:
            node = node.get(part, None)
        except Exception:  # a struct-mode DictConfig without the key
            return default
    return default if node is None else node


def context_issues(config: Any) -> list[ConfigIssue]:
    """Values of the keys :func:`describe` reads that are not of their type (a verl config file's
    ``rollout.n=abc``), each an issue naming its key, not a traceback."""
    issues = []
    for path, what in (("algorithm", "a mapping"), ("actor_rollout_ref", "a mapping"),
                       ("actor_rollout_ref.rollout", "a mapping")):
        node = select(config, path)
        if node is not None and not hasattr(node, "get"):
            issues.append(ConfigIssue(path, f"expected {what}, got {type(node).__name__} {node!r}"))
    estimator = select(config, "algorithm.adv_estimator")
    if estimator is not None and not (isinstance(estimator, str) and estimator):
        issues.append(ConfigIssue("algorithm.adv_estimator", f"expected an estimator name (a string), got "
                                  f"{type(estimator).__name__} {estimator!r}"))
    n = select(config, "actor_rollout_ref.rollout.n")
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        issues.append(ConfigIssue("actor_rollout_ref.rollout.n", f"expected an integer >= 1 (responses per "
                                  f"prompt), got {type(n).__name__} {n!r}"))
    return issues


def describe(config: Any) -> HostDescription:
    """The host description of the verl run ``config`` describes. A composed config (the trainer, ``dataflex
    doctor``) holds every key; a config file checked by ``dataflex validate`` may hold a few: the estimator and
    the group size are then unknown (and bad values too: see :func:`context_issues`), the rest takes verl's
    defaults."""
    estimator = select(config, "algorithm.adv_estimator")
    estimator = estimator if isinstance(estimator, str) else None
    n = select(config, "actor_rollout_ref.rollout.n")
    n = n if isinstance(n, int) and not isinstance(n, bool) and n >= 1 else None
    rollout, advantage = set(EVENT_FIELDS["on_rollout"]), set(EVENT_FIELDS["on_advantage"])
    missing: dict[str, str] = {}

    def lacks(name: str, why: str, *where: set[str]) -> None:
        for fields in where:
            fields.discard(name)
        missing[name] = why

    if not bool(select(config, "actor_rollout_ref.rollout.calculate_log_probs", True)):
        lacks("rollout_log_probs", "actor_rollout_ref.rollout.calculate_log_probs=false", rollout, advantage)
    if bool(select(config, "algorithm.rollout_correction.bypass_mode", False)):
        lacks("entropy", "algorithm.rollout_correction.bypass_mode=true skips the old-log-prob pass that computes "
              "it; set it to false", advantage)
    if select(config, "algorithm.rollout_correction.rollout_is") is None:
        lacks("rollout_is_weights", "verl writes them only with algorithm.rollout_correction.rollout_is set "
              "(token or sequence)", advantage)
    if not (bool(select(config, "algorithm.use_kl_in_reward", False))
            or bool(select(config, "actor_rollout_ref.actor.use_kl_loss", False))):
        lacks("ref_log_prob", "no reference policy: set actor_rollout_ref.actor.use_kl_loss=true or "
              "algorithm.use_kl_in_reward=true", advantage)
    critic = select(config, "critic.enable")
    if not (bool(critic) if critic is not None else estimator == "gae"):
        lacks("values", "no critic (algorithm.adv_estimator is not gae and critic.enable is not true)", advantage)
    if not bool(select(config, "algorithm.use_kl_in_reward", False)):
        lacks("token_level_rewards", "verl writes them only with algorithm.use_kl_in_reward=true", advantage)
    capabilities = set(CAPABILITIES)
    loss_mode = str(select(config, "actor_rollout_ref.actor.policy_loss.loss_mode", "vanilla"))
    if loss_mode in WEIGHT_IGNORING_LOSSES:
        capabilities.discard("loss_weights")
        missing["loss_weights"] = (f"actor_rollout_ref.actor.policy_loss.loss_mode={loss_mode} ignores "
                                   f"rollout_is_weights; use one of {', '.join(WEIGHT_LOSSES)}")
    mode = str(select(config, "trainer.v1.trainer_mode", "dataflex_sync"))
    if mode != "dataflex_sync":
        capabilities.discard("refill")
        missing["refill"] = (f"refill runs through verl's synchronous replay buffer; trainer mode {mode!r} uses the "
                             "asynchronous one: set trainer.v1.trainer_mode=dataflex_sync")
        # Replayed rows are written into the step's batch between its sample and its old-log-prob pass, which
        # the asynchronous modes run on rollouts generated ahead under several policies.
        capabilities.discard("replay")
        missing["replay"] = (f"the adapter replays in the synchronous trainer only (trainer mode {mode!r}): set "
                             "trainer.v1.trainer_mode=dataflex_sync")
        capabilities.discard("ragged_groups")
        missing["ragged_groups"] = (f"per-prompt rollout counts (__rollout_n__) are set where the synchronous "
                                    f"trainer fetches a step's prompts; trainer mode {mode!r} fetches one prompt at "
                                    "a time ahead of the step: set trainer.v1.trainer_mode=dataflex_sync")
    rollout_is = select(config, f"{ROLLOUT_CORRECTION}.rollout_is")
    step_end = frozenset(advantage - {MINIBATCH_INDEX})
    actor = "actor_rollout_ref.actor"
    epochs = select(config, f"{actor}.ppo_epochs", 1)
    if bool(select(config, f"{actor}.shuffle", False)) and not (isinstance(epochs, int) and epochs <= 1):
        lacks(MINIBATCH_INDEX, f"{actor}.shuffle=true draws another mini-batch partition in every epoch "
              f"(ppo_epochs={epochs}); set {actor}.shuffle=false or ppo_epochs=1", advantage)
    fields = {"on_prompts": EVENT_FIELDS["on_prompts"], "on_rollout": frozenset(rollout),
              "on_advantage": frozenset(advantage), "on_step_end": step_end}
    row, basis = row_bytes(config)
    stored, stored_basis = stored_row_bytes(config)
    return HostDescription(NAME, fields=fields, capabilities=frozenset(capabilities), adv_estimator=estimator,
                           group_size=n, prompts_per_step=_positive(select(config, "data.train_batch_size")),
                           loss_agg=str(select(config, "actor_rollout_ref.actor.loss_agg_mode",
                                                             "token-mean")),
                           missing=missing, check=lambda cfg, key: block_issues(config, cfg, key),
                           rollout_is=None if rollout_is is None or bool(
                               select(config, f"{ROLLOUT_CORRECTION}.bypass_mode", False)) else str(rollout_is),
                           row_bytes=row, row_bytes_basis=basis, stored_row_bytes=stored,
                           stored_row_basis=stored_basis)


def row_bytes(config: Any) -> tuple[int, str]:
    """``(bytes, basis)`` of one rollout row in the driver's batch (its ``DataProto``, on the CPU: the model's
    passes run on micro-batches of fixed size on the workers, so the budget grows this): ``input_ids``,
    ``attention_mask``, ``position_ids`` over ``T = P + R`` tokens, ``prompts`` over ``P``, ``responses`` and
    ``response_mask`` over ``R`` (int64), and 9 float32 per response token (old, reference and rollout
    log-probs, advantages, returns, token-level scores and rewards, entropy, importance weights), with
    ``P = data.max_prompt_length`` and ``R = data.max_response_length`` (verl's defaults, 512 each, where unset)."""
    p = _positive(select(config, "data.max_prompt_length")) or 512
    r = _positive(select(config, "data.max_response_length")) or 512
    return (3 * (p + r) * 8 + p * 8 + 2 * r * 8 + 9 * r * 4,
            f"data.max_prompt_length {p} + data.max_response_length {r} tokens of ids, masks and per-token values")


def stored_row_bytes(config: Any) -> tuple[int, str]:
    """``(bytes, basis)`` of one trajectory in the replay store at the longest prompt ``P`` and response ``R``
    (``data.max_prompt_length``, ``data.max_response_length``): its fields as generated, packed
    (:mod:`dataflex_bus.packed`): token ids of ``prompts``, ``responses`` and ``input_ids`` as int32 (a
    vocabulary over 65,536 words), ``response_mask`` and ``attention_mask`` one byte a token and
    ``position_ids`` two (where they are not derived), ``rm_scores``, ``rollout_log_probs`` and the behaviour
    log-probs float32 (where they are not shared), the extents and 1 KiB of non-tensor columns. An upper bound:
    a row at the longest lengths, nothing derived."""
    p = _positive(select(config, "data.max_prompt_length")) or 512
    r = _positive(select(config, "data.max_response_length")) or 512
    t = p + r
    return (4 * (p + r + t) + (r + t) + 2 * t + 3 * 4 * r + 2 * 8 + 1024,
            f"data.max_prompt_length {p} + data.max_response_length {r} tokens, packed")


def _positive(value: Any) -> int | None:
    """``value`` when it is a positive int (a config value that may be unset or an interpolation), else ``None``."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else None


def block_issues(config: Any, cfg: DataflexConfig, key: str = "dataflex") -> list[ConfigIssue]:
    """verl settings under which the block's methods would not do what they say; logs a warning for settings
    that weaken, but do not disable, a method."""
    from ..kit import Allocate, Reweight, mechanism

    mechs = [mechanism(m.mechanism) for m in cfg.methods]
    issues: list[ConfigIssue] = []
    actor = "actor_rollout_ref.actor"
    loss_mode = str(select(config, f"{actor}.policy_loss.loss_mode", "vanilla"))
    if any(isinstance(m, Reweight) for m in mechs) and loss_mode in WEIGHT_COLLAPSING_LOSSES:
        log.warning("dataflex: policy_loss.loss_mode=%s turns rollout_is_weights into one geometric mean per "
                    "sequence: per-token reweighting degrades to per-sequence weights", loss_mode)
    if loss_mode in WEIGHT_COLLAPSING_LOSSES:
        # A token mask is 0 on the tokens left out: their geometric mean is ~0 for every sequence they are in.
        issues.extend(ConfigIssue(f"{actor}.policy_loss.loss_mode",
                                  f"{loss_mode} turns rollout_is_weights into one geometric mean per sequence, so the "
                                  f"token selection of {mkey} would zero every sequence with a token left out",
                                  hint=f"use one of {', '.join(WEIGHT_LOSSES)}")
                      for mkey in _token_selections(cfg, key))
    agg = str(select(config, f"{actor}.loss_agg_mode", "token-mean"))
    drops_at_advantage = any(
        (mechanism(m.mechanism).drops_rows or m.on_nonfinite == "drop")
        and m.resolved is not None and m.resolved.event == "on_advantage" for m in cfg.methods)
    if agg == "seq-mean-token-sum-norm" and select(config, f"{actor}.loss_scale_factor") is None and drops_at_advantage:
        width = select(config, "data.max_response_length", 0) or "<max_response_length>"
        issues.append(ConfigIssue(
            f"{actor}.loss_scale_factor",
            "is null, so loss_agg_mode=seq-mean-token-sum-norm divides by the padded response width of each "
            "micro-batch, which still counts the rows a dataflex method masks at on_advantage: such a drop "
            "would not equal removing the row", hint=f"set it to a constant, e.g. {actor}.loss_scale_factor={width}"))
    if any(m.drops_rows for m in mechs) and agg.startswith("seq-mean"):
        log.warning("dataflex: loss_agg_mode=%s divides by the fixed ppo_mini_batch_size*n, so every dropped "
                    "sample dilutes the remaining gradient (token-mean renormalises; see docs/verl.md)", agg)
    verl_dapo = bool(select(config, "algorithm.filter_groups.enable", False))
    refill = cfg.refill
    if refill is not None:
        if verl_dapo:
            issues.append(ConfigIssue(f"{key}.refill", "algorithm.filter_groups already refills zero-variance groups "
                                      "inside verl's replay buffer; use one of the two"))
        train = select(config, "data.train_batch_size")
        if refill.gen_batch_size is not None and isinstance(train, int) and refill.gen_batch_size < train:
            issues.append(ConfigIssue(f"{key}.refill.gen_batch_size", f"verl dispatches data.train_batch_size={train} "
                                      "prompts for a step's first round; the first round cannot be smaller",
                                      hint=f"leave it unset or set it to {train} or more"))
    issues.extend(replay_issues(config, cfg, key))
    if verl_dapo and any(isinstance(m, Allocate) for m in mechs):
        issues.append(ConfigIssue("algorithm.filter_groups.enable", "an allocation runs the step's generation rounds "
                                  "in dataflex's replay buffer, where verl's own filter_groups would not act",
                                  hint="set it to false and stack a dataflex dapo selector (with dataflex.refill "
                                  "to refill what it drops)"))
    if verl_dapo and any(m.resolved is not None and getattr(m.resolved.actuator.load(), "filters_zero_variance", False)
                         for m in cfg.methods):
        log.warning("dataflex: algorithm.filter_groups already evicts zero-variance groups (and refills them); "
                    "a dataflex selector that drops zero-variance groups will find nothing to drop after it")
    return issues




def replay_issues(config: Any, cfg: DataflexConfig, key: str = "dataflex") -> list[ConfigIssue]:
    """verl's rollout-correction settings against a replay method's correction (methods.md P6.4): ``decoupled``
    (DOTS) is verl's own token-level truncated IS, ``min(pi_old / rollout_log_probs, rollout_is_threshold)``, so it
    needs ``rollout_is=token`` with the method's ``is_cap`` as threshold; ``behaviour`` (RePO) takes the PPO ratio
    against the stored behaviour log-probs instead and would be weighted twice under any ``rollout_is``. Either way
    the batch must reach verl's old-log-prob pass unchanged (no bypass mode, no rejection sampling, no batch
    normalisation of the weights, no DAPO evicting groups the buffer needs)."""
    from ..kit import Replayer, method_keys

    issues: list[ConfigIssue] = []
    rc = ROLLOUT_CORRECTION
    for method, mkey in zip(cfg.methods, method_keys(cfg, key)):
        if method.resolved is None or not issubclass(method.resolved.actuator.load(), Replayer):
            continue
        replayer = method.resolved.actuator.load()(**method.resolved.actuator_params)
        assert isinstance(replayer, Replayer)
        settings = replayer.settings()
        where = f"{mkey}.actuator.params.correction={settings.correction}"
        rollout_is = select(config, f"{rc}.rollout_is")
        threshold = select(config, f"{rc}.rollout_is_threshold", 2.0)
        if bool(select(config, f"{rc}.bypass_mode", False)):
            issues.append(ConfigIssue(f"{rc}.bypass_mode", "true sets old_log_probs to the rollout log-probs and "
                                      f"skips verl's old-log-prob pass, which {mkey} needs for its replayed rows",
                                      hint=f"set {rc}.bypass_mode=false"))
        if select(config, f"{rc}.rollout_rs") is not None:
            issues.append(ConfigIssue(f"{rc}.rollout_rs", f"rejection sampling would mask replayed rows {mkey} "
                                      "corrects by importance weights", hint=f"set {rc}.rollout_rs=null"))
        if bool(select(config, f"{rc}.rollout_is_batch_normalize", False)):
            issues.append(ConfigIssue(f"{rc}.rollout_is_batch_normalize", f"true rescales the importance weights "
                                      f"{where} defines", hint=f"set {rc}.rollout_is_batch_normalize=false"))
        if bool(select(config, "algorithm.filter_groups.enable", False)):
            issues.append(ConfigIssue("algorithm.filter_groups.enable", "verl's DAPO refills inside its replay "
                                      f"buffer, which {mkey} bypasses to add its stored rows; use one of the two"))
        if settings.correction == "decoupled":
            if rollout_is != "token":
                issues.append(ConfigIssue(f"{rc}.rollout_is", f"is {rollout_is!r}; {where} weights every row by "
                                          "min(pi_old / mu, is_cap) per token, which verl computes with "
                                          "rollout_is=token from the replayed rows' stored rollout_log_probs",
                                          hint=f"set {rc}.rollout_is=token"))
            elif not _same_threshold(threshold, settings.is_cap):
                issues.append(ConfigIssue(f"{rc}.rollout_is_threshold", f"is {threshold!r}, but {mkey} truncates "
                                          f"pi_old / mu at is_cap={settings.is_cap}",
                                          hint=f"set {rc}.rollout_is_threshold={settings.is_cap} or "
                                               f"{mkey}.actuator.params.is_cap={threshold}"))
        elif rollout_is is not None:
            issues.append(ConfigIssue(f"{rc}.rollout_is", f"is {rollout_is!r}; {where} clips the replayed rows' ratio "
                                      "against their stored behaviour log-probs, and verl's importance weights would "
                                      "correct them a second time", hint=f"set {rc}.rollout_is=null"))
    return issues


def _same_threshold(threshold: Any, cap: float) -> bool:
    """verl's ``rollout_is_threshold`` is a float (TIS) or a ``"lower_upper"`` string (IcePop, which zeroes
    weights outside the band instead of truncating): only a single value equal to ``cap`` is the method's."""
    try:
        return abs(float(threshold) - cap) <= 1e-9 * max(1.0, cap)
    except (TypeError, ValueError):
        return False


def _token_selections(cfg: DataflexConfig, key: str) -> list[str]:
    """The config keys of the block's methods that select tokens."""
    from ..kit import method_keys

    return [mkey for m, mkey in zip(cfg.methods, method_keys(cfg, key))
            if m.resolved is not None and getattr(m.resolved.actuator.load(), "selects_tokens", False)]
