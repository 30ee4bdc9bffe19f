#!/usr/bin/env python
"""GPU smoke test for the ``dataflex_sync`` trainer mode (not part of CI; nothing depends on it).

Runs verl's real ``main_ppo`` twice for 2 steps on a GPU machine with a tiny *randomly initialised*
Llama (written locally with a word-level tokenizer: no download), a synthetic two-domain dataset and
the given rollout backend, at a fixed seed:

* ``off``: ``trainer.v1.trainer_mode=dataflex_sync`` without a ``dataflex`` block (plain GRPO);
* ``on``: the same plus a reweight method (softmax over reward), or ``--method select`` for the seed's
  difficulty band.

The reward is a local rule (``REWARD_SOURCE``, passed as ``reward.custom_reward_function``): the share of
response words that are numbers below 50. A random model thus gets varied rewards inside every group,
so advantages, weights and selections are not trivially zero. verl's built-in scorers would not do:
``openai/gsm8k`` gives a random model 0 everywhere (GRPO advantages 0, so ``pg_loss`` is 0 with or
without the method), and any other ``data_source`` (here ``code``) raises ``NotImplementedError`` in
the reward worker.

It prints each run's ``actor/pg_loss`` (and the ``dataflex/*`` metrics) per step and whether the method
changed the loss. Needs verl's rollout extra (``vllm`` by default) and a CUDA device.

    python scripts/gpu_smoke.py --out /tmp/dataflex_smoke [--method reweight|select] [--rollout vllm]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

METHODS = {
    "reweight": ["+dataflex.mechanism=reweight", "+dataflex.scorer.name=reward_difficulty",
                 "+dataflex.actuator.name=softmax", "+dataflex.actuator.params.temperature=0.5"],
    "select": ["+dataflex.mechanism=select", "+dataflex.scorer.name=group_solve_rate",
               "+dataflex.scorer.params.success_threshold=0.5", "+dataflex.actuator.name=threshold_band",
               "+dataflex.actuator.params.low=0.2", "+dataflex.actuator.params.high=0.8",
               "+dataflex.warmup_step=0"],
}


def write_model(root: Path) -> Path:
    """A random 2-layer Llama plus a word-level tokenizer with a chat template, saved locally."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    words = ["<pad>", "<eos>", "<unk>", "user", "assistant", ":", "what", "is", "plus", "minus", "write",
             "code", "answer", *[str(i) for i in range(100)]]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    fast.chat_template = ("{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}"
                          "{% if add_generation_prompt %}assistant : {% endif %}")
    path = root / "tiny-llama"
    fast.save_pretrained(path)
    # head_dim 64: vLLM's attention kernels do not accept every small head size.
    cfg = LlamaConfig(vocab_size=len(words), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=512,
                      pad_token_id=0, eos_token_id=1, bos_token_id=1, tie_word_embeddings=True)
    LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def write_data(root: Path) -> Path:
    import pandas as pd

    rows = []
    for i in range(64):
        a, b = i % 10, (i * 3) % 10
        domain = "math" if i % 2 else "code"
        question = f"what is {a} plus {b}" if domain == "math" else f"write code {a}"
        rows.append({"data_source": "openai/gsm8k" if domain == "math" else "code", "ability": domain,
                     "prompt": [{"role": "user", "content": question}],
                     "reward_model": {"style": "rule", "ground_truth": str(a + b)},
                     "extra_info": {"index": i, "split": "train"}})
    path = root / "train.parquet"
    pd.DataFrame(rows).to_parquet(path)
    return path


#: The reward rule, written next to the data and loaded by path in verl's reward workers.
REWARD_SOURCE = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    """Share of the response's words that are numbers below 50 (0 for an empty response)."""
    words = solution_str.split()
    return sum(w.isdigit() and int(w) < 50 for w in words) / len(words) if words else 0.0
'''


def write_reward(root: Path) -> Path:
    path = root / "smoke_reward.py"
    path.write_text(REWARD_SOURCE)
    return path


def overrides(model: Path, data: Path, out: Path, rollout: str, seed: int, reward: Path) -> list[str]:
    return [
        "trainer.v1.trainer_mode=dataflex_sync", "algorithm.adv_estimator=grpo",
        f"reward.custom_reward_function.path={reward}", "reward.custom_reward_function.name=compute_score",
        f"data.train_files={data}", f"data.val_files={data}", "data.train_batch_size=8",
        "data.max_prompt_length=32", "data.max_response_length=16", f"data.seed={seed}",
        f"actor_rollout_ref.model.path={model}", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8", "actor_rollout_ref.actor.use_kl_loss=False",
        "actor_rollout_ref.actor.shuffle=False", f"actor_rollout_ref.actor.data_loader_seed={seed}",
        "actor_rollout_ref.rollout.n=4", f"actor_rollout_ref.rollout.name={rollout}",
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.3",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8", f"actor_rollout_ref.rollout.seed={seed}",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8", "actor_rollout_ref.rollout.enforce_eager=True",
        "trainer.n_gpus_per_node=1", "trainer.nnodes=1", "trainer.total_training_steps=2",
        "trainer.save_freq=-1", "trainer.test_freq=-1", "trainer.val_before_train=False",
        "trainer.logger=[console]", f"trainer.default_local_dir={out}/ckpt", "trainer.resume_mode=disable",
        "transfer_queue.backend.SimpleStorage.num_data_storage_units=1",
    ]


STEP_LINE = re.compile(r"step:(\d+) - (.*)")


def parse_metrics(text: str) -> dict[int, dict[str, float]]:
    """verl's console logger prints ``step:N - key:value - key:value ...``."""
    steps: dict[int, dict[str, float]] = {}
    for line in text.splitlines():
        m = STEP_LINE.search(line)
        if not m:
            continue
        values = {}
        for item in m.group(2).split(" - "):
            key, _, value = item.rpartition(":")
            try:
                values[key.strip()] = float(value)
            except ValueError:
                continue
        steps[int(m.group(1))] = values
    return steps


def run(name: str, args: list[str], out: Path, timeout: int) -> dict[int, dict[str, float]]:
    log = out / f"{name}.log"
    cmd = [sys.executable, "-m", "verl.trainer.main_ppo", *args]
    print(f"[{name}] {' '.join(cmd)}", flush=True)
    env = {**os.environ, "VERL_USE_EXTERNAL_PLUGINS": os.environ.get("VERL_USE_EXTERNAL_PLUGINS", "auto")}
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                          timeout=timeout, check=False)
    log.write_text(proc.stdout)
    metrics = parse_metrics(proc.stdout)
    print(f"[{name}] exit {proc.returncode}, {len(metrics)} step(s) logged, log: {log}", flush=True)
    if proc.returncode != 0:
        print("\n".join(proc.stdout.splitlines()[-40:]))
    return metrics


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="/tmp/dataflex_gpu_smoke")
    parser.add_argument("--method", choices=sorted(METHODS), default="reweight")
    parser.add_argument("--rollout", default="vllm")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--timeout", type=int, default=900, help="seconds per run")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model, data, reward = write_model(out), write_data(out), write_reward(out)
    base = overrides(model, data, out, args.rollout, args.seed, reward)
    off = run("off", base, out, args.timeout)
    on = run("on", base + METHODS[args.method], out, args.timeout)
    report = {}
    for step in sorted(set(off) | set(on)):
        report[step] = {"pg_loss_off": off.get(step, {}).get("actor/pg_loss"),
                        "pg_loss_on": on.get(step, {}).get("actor/pg_loss"),
                        "dataflex": {k: v for k, v in on.get(step, {}).items() if k.startswith("dataflex/")}}
    print(json.dumps(report, indent=2))
    losses = [(r["pg_loss_off"], r["pg_loss_on"]) for r in report.values()]
    if not losses or any(a is None or b is None for a, b in losses):
        print("RESULT: incomplete (a run failed or logged no actor/pg_loss)")
        return 1
    changed = any(abs(a - b) > 1e-9 for a, b in losses)
    print(f"RESULT: method {args.method} {'changed' if changed else 'did NOT change'} actor/pg_loss")
    return 0 if changed else 1


if __name__ == "__main__":
    sys.exit(main())
