"""The TRL host's overhead per step against plain TRL, on the same batch, at 135M (SmolLM2-135M-Instruct).

Both trainers get identical generation batches (a scripted ``rollout_func`` returns the same completions of
``--tokens`` tokens for the same prompts), so each step does the same forward, backward and optimizer work;
what differs is the host: the kit's events and counters, and for a block dropping rows at on_rollout the
rounds stopped at their rewards and TRL's method replayed on the kept rows. The blocks keep every row, so the
update is the same one. Prints, per host configuration, the median step time and its ratio to plain TRL
(goal: <= 1.05x): each host run is paired with a plain run just before it, and the ratio is the median
over the pairs (a shared machine's load drifts over minutes).

    python benchmarks/bench_trl_overhead.py [--steps 6] [--repeats 2] [--prompts 2] [--generations 8] [--profile]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "trl"))

KEEP_ALL = {"mechanism": "select", "scorer": {"name": "group_solve_rate"},
            "actuator": {"name": "threshold_band", "params": {"low": 0.0, "high": 1.0}}}
OBSERVE = {"mechanism": "mix", "scorer": {"name": "advantage_magnitude"},
           "actuator": {"name": "static", "params": {"proportions": {"carry": 1.0, "no_carry": 1.0}}}}
CONFIGS: dict[str, dict[str, Any] | None] = {"no block": None, "keep-all selection (rounds + replay)": KEEP_ALL,
                                             "static mix (on_step_end, the prompt stream)": OBSERVE}


def scripted(tok: Any, tokens: int) -> Any:
    """The same completion for the same (prompt, sample): the answer, right for even samples, padded to length."""

    def rollout_func(prompts: list[str], trainer: Any) -> dict[str, Any]:
        seen: dict[str, int] = {}
        prompt_ids, completion_ids = [], []
        for p in prompts:
            j = seen.get(p, 0)
            seen[p] = j + 1
            a, b = (int(x) for x in p.rsplit("\n", 1)[1].rstrip(" =").split(" + "))
            text = f" {a + b if j % 2 == 0 else a + b + 1}\n{a} + {b} = {a + b}\n"
            ids = tok(text, add_special_tokens=False)["input_ids"]
            prompt_ids.append(tok(p, add_special_tokens=False)["input_ids"])
            completion_ids.append((ids * tokens)[:tokens])
        return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": None}

    return rollout_func


def step_times(block: dict[str, Any] | None, plain: bool, args: argparse.Namespace, profile: Any = None) -> list[float]:
    from arithmetic import addition_reward, problems
    from datasets import Dataset
    from smollm2 import load
    from transformers import TrainerCallback
    from transformers.trainer_callback import PrinterCallback
    from trl import GRPOConfig, GRPOTrainer

    from dataflex_bus.trl import DataflexGRPOTrainer

    class Clock(TrainerCallback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.start = 0.0

        def on_step_begin(self, *a: Any, **k: Any) -> None:
            self.start = time.perf_counter()

        def on_step_end(self, *a: Any, **k: Any) -> None:
            self.times.append(time.perf_counter() - self.start)

    model, tok = load()
    train, _ = problems()
    clock = Clock()
    with tempfile.TemporaryDirectory() as out:
        config = GRPOConfig(output_dir=out, per_device_train_batch_size=args.prompts * args.generations,
                            num_generations=args.generations, max_completion_length=args.tokens,
                            max_steps=args.steps + 1, learning_rate=1e-6, seed=0, use_cpu=True, bf16=False,
                            report_to=[], logging_steps=1, save_strategy="no", disable_tqdm=True)
        kwargs: dict[str, Any] = dict(model=model, reward_funcs=[addition_reward], args=config,
                                      train_dataset=Dataset.from_list(train), processing_class=tok,
                                      rollout_func=scripted(tok, args.tokens), callbacks=[clock])
        trainer = GRPOTrainer(**kwargs) if plain else DataflexGRPOTrainer(**kwargs, dataflex=block)
        trainer.remove_callback(PrinterCallback)
        if profile is None:
            trainer.train()
        else:
            profile.runcall(trainer.train)
    return clock.times[1:]  # the first step warms up (allocations, first-call caches)


#: The framework a host's time is not: a call from dataflex_bus into these leaves the host's time (the optimizer
#: too: the host wraps its step, to skip an empty generation batch's update).
FRAMEWORK = tuple(f"{os.sep}site-packages{os.sep}{name}{os.sep}"
                  for name in ("trl", "transformers", "accelerate", f"torch{os.sep}optim"))


GRPO_TRAINER = os.path.join("trl", "trainer", "grpo_trainer.py")


def profiled(block: dict[str, Any] | None, plain: bool, args: argparse.Namespace) -> dict[str, float]:
    """One run's ``train()`` under cProfile: ``own`` the seconds with dataflex_bus's code in charge (every call
    into dataflex_bus from outside it, less its calls back into TRL, transformers, accelerate or the optimizer;
    its torch operations count as its own), ``batch`` the seconds in TRL's ``_generate_and_score_completions``
    (every call: the host runs it once per round and once more on the kept rows), ``total`` all of it.
    cProfile slows Python more than torch's kernels, so ``own`` is an upper bound; unlike paired wall times
    these do not drift with the machine's load."""
    import cProfile
    import pstats

    def ours(file: str) -> bool:
        return f"{os.sep}dataflex_bus{os.sep}" in file

    profile = cProfile.Profile()
    step_times(block, plain, args, profile)
    stats: Any = pstats.Stats(profile).stats
    out = {"own": 0.0, "batch": 0.0, "total": sum(tt for (_, _, tt, _, _) in stats.values())}
    for (file, _, function), (_, _, _, _, callers) in stats.items():
        for (caller, _, _), (_, _, _, cumulative) in callers.items():
            if ours(file) and not ours(caller):
                out["own"] += cumulative
            elif ours(caller) and any(part in file for part in FRAMEWORK):
                out["own"] -= cumulative
            if function == "_generate_and_score_completions" and file.endswith(GRPO_TRAINER):
                out["batch"] += cumulative
    return out


def print_profiles(args: argparse.Namespace) -> None:
    plain = profiled(None, True, args)
    print(f"{'plain TRL':<44} TRL's generation batch {plain['batch']:5.2f} s of train() {plain['total']:6.1f} s")
    for name, block in CONFIGS.items():
        run = profiled(block, False, args)
        added = run["own"] + max(run["batch"] - plain["batch"], 0.0)
        print(f"{name:<44} TRL's generation batch {run['batch']:5.2f} s of train() {run['total']:6.1f} s, "
              f"dataflex_bus's own code {run['own']:5.2f} s: the host adds at most {added / run['total']:.2%}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6, help="timed steps per run (after one warm-up step)")
    parser.add_argument("--repeats", type=int, default=2, help="interleaved runs per configuration")
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=16, help="completion tokens per row")
    parser.add_argument("--profile", action="store_true",
                        help="instead: under cProfile, what the host adds to a run (its own code, TRL's batch method "
                             "run again on the kept rows)")
    args = parser.parse_args()
    import torch

    if args.profile:
        print_profiles(args)
        return

    print(f"SmolLM2-135M-Instruct, {args.prompts} prompts x {args.generations} completions x {args.tokens} tokens, "
          f"{torch.get_num_threads()} threads, {args.steps} timed steps x {args.repeats} runs each")
    # Each host run is paired with the plain run just before it: a shared machine's load drifts over minutes.
    ratios: dict[str, list[float]] = {name: [] for name in CONFIGS}
    medians: dict[str, list[float]] = {"plain TRL": [], **{name: [] for name in CONFIGS}}
    for _ in range(args.repeats):
        for name, block in CONFIGS.items():
            plain = statistics.median(step_times(None, True, args))
            host = statistics.median(step_times(block, False, args))
            medians["plain TRL"].append(plain)
            medians[name].append(host)
            ratios[name].append(host / plain)
    print(f"{'plain TRL':<44} median step {statistics.median(medians['plain TRL']):6.2f} s")
    for name, values in ratios.items():
        pairs = " ".join(f"{r:.3f}" for r in values)
        print(f"{name:<44} median step {statistics.median(medians[name]):6.2f} s   "
              f"ratio {statistics.median(values):.3f}x   (pairs: {pairs})")


if __name__ == "__main__":
    main()
