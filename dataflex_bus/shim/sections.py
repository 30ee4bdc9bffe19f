"""The shim's own config sections, ``trainer``, ``model`` and ``data``: every key declared with a
:class:`~dataflex_bus.schema.Param` (checked by :mod:`dataflex_bus.shim.config`)."""

from __future__ import annotations

from ..kit import Param
from .tasks import TASKS

TRAINER: dict[str, Param] = {
    "steps": Param(int, 200, low=1, doc="training steps"),
    "seed": Param(int, 0, low=0, doc="seed of the RL run: domain and prompt draws, rollouts, mini-batch order"),
    "group_size": Param(int, 8, low=1, doc="responses per prompt (verl's rollout.n)"),
    "prompts_per_step": Param(int, 64, low=1, doc="prompts drawn per step (verl's train_batch_size)"),
    "lr": Param(float, 0.0005, low=0.0, low_open=True, doc="Adam learning rate"),
    "clip_ratio": Param(float, 0.2, low=0.0, low_open=True, doc="PPO clip range"),
    "clip_ratio_c": Param(float, 3.0, low=1.0, low_open=True, doc="dual-clip bound for negative advantages"),
    "kl_coef": Param(float, 0.0, low=0.0, doc="KL-loss coefficient to the initial policy (k3); 0 = no ref"),
    "ppo_epochs": Param(int, 1, low=1, doc="passes over each step's batch: each fresh batch trained k times, "
                        "ppo_epochs x mini_batches optimizer steps (verl's ppo_epochs, TRL's num_iterations); the "
                        "modelled cost counts every pass's tokens"),
    "mini_batches": Param(int, 2, low=1, doc="optimizer steps per epoch (rows split evenly)"),
    "temperature": Param(float, 1.0, low=0.0, low_open=True, doc="sampling temperature"),
    "max_grad_norm": Param(float, 1.0, low=0.0, low_open=True, doc="gradient clipping"),
    "save_every": Param(int, 50, low=0, doc="checkpoint every N steps (0: only at the end)"),
    "eval_every": Param(int, 25, low=0, doc="exact greedy accuracy on every held-out prompt at step 0, every "
                        "N steps and at the last step (0: never)"),
    "threads": Param(int, 1, low=1, doc="torch CPU threads during the run"),
    "generation_cost": Param(float, 4.0, low=0.0,
                             doc="cost of generating one token relative to training on one token, for "
                                 "compute/modelled_cost (LLM RL: generation dominates; the shim's own wall "
                                 "times do not)"),
}
MODEL: dict[str, Param] = {
    "seed": Param(int, 0, low=0, doc="seed of the base policy (initialisation and warm start), which stays "
                  "fixed when trainer.seed changes, as a pretrained checkpoint does"),
    "hidden": Param(int, 64, low=1, doc="GRU width"),
    "layers": Param(int, 1, low=1, doc="GRU layers"),
    "pretrain_steps": Param(int, 500, low=0, doc="supervised warm start on noisy answers (0: cold start)"),
    "pretrain_batch": Param(int, 128, low=1, doc="prompts per warm-start step"),
}
DEFAULT_DOMAINS = ["copy", "sort", "reverse", "random"]
DATA: dict[str, Param] = {
    "domains": Param(list, DEFAULT_DOMAINS, item=str, choices=tuple(sorted(TASKS)), unique=True, nonempty=True,
                     doc="task names to train on, in the sampler's order"),
    "seed": Param(int, 0, low=0, doc="seed of the train/held-out split"),
    "heldout": Param(int, 600, low=1, doc="held-out prompts per domain (spread over its levels), never trained on"),
    "train_pool": Param(int, 0, low=0, doc="a fixed pool of N training prompts per domain, drawn once per data.seed "
                        "and cycled in epochs (a fresh permutation each), data/epoch in the metrics; 0: every "
                        "prompt drawn afresh from the whole training split"),
    "level_weights": Param(dict, {}, doc="each named domain's level mix for training prompts, one weight per level "
                           "(e.g. {reverse: [1, 3]}); a domain not named draws its levels uniformly. The warm "
                           "start and the held-out prompts keep the uniform mix"),
}
SECTIONS = ("trainer", "model", "data", "dataflex")
