#!/usr/bin/env python
"""GPU check for the ``dataflex_sync`` trainer mode: verl's real ``main_ppo`` with vLLM, checks that can fail.

    python scripts/gpu_check.py --install --out /tmp/dataflex_gpu_check   # venv + verl[vllm]==0.9.1, then the check
    python scripts/gpu_check.py --dry-run                                 # the commands and the time plan only
    python scripts/gpu_check.py --cpu                                     # the same checks on CPU (rollout cpu_hf)

On one GPU it trains a tiny *randomly initialised* Llama (written locally with a word-level tokenizer: no
download) on a three-domain parquet with a local reward rule. A preflight (at most :data:`PREFLIGHT_S` seconds)
names what is missing (CUDA, vLLM, the registered ``dataflex_sync`` mode) before any run starts. Then one
``main_ppo`` at a time (two vLLM engines on one GPU trip vLLM's memory profiling when the other sleeps or wakes):

* ``off``: ``dataflex_sync`` without a block, 2 steps, fp32 FSDP, checkpoint at step 2. It records its step-1
  rollouts with verl's rollout caching (``skip.rollout_tq``, action ``cache``), so ``control`` and ``reweight``
  train on **identical rollouts** (vLLM with async scheduling is not bit-reproducible). Checks: vLLM's and FSDP's
  log-probs of the same tokens agree at every step (verl's ``training/rollout_probs_diff_*``: a weight sync that
  failed leaves vLLM on its dummy initial weights), and ``dataflex_state.pt`` sits beside verl's checkpoint.
* ``control``: the seed's select block at ``warmup_step=1``, 1 step on the cached rollouts. The method is warming
  up at step 1, so step 1 must equal ``off`` on every training metric: the control, whose ``pg_loss`` difference
  is the noise floor.
* ``reweight`` (``token_prob`` + ``advantage_reweight``), 1 step on the cached rollouts: the weights vary and
  ``actor/pg_loss`` moves from ``off`` by more than 10x the control's noise.
* ``speed`` (SPEED, ``group_solve_rate`` + ``speed``), 2 steps in **bf16** (FSDP and vLLM), fresh rollouts:
  the rollouts generated each step equal the plan (screening ``batch x n`` + ``n_continue`` x the continued
  groups, failed groups excluded), the largest group is ``n + n_continue`` and the trained rows are the continued
  groups' rows.

verl 0.9.1 asks for ``flash_attention_2`` and ``use_remove_padding=True`` by default
(``verl/workers/config/model.py``, ``trainer/config/model/hf_model.yaml``); ``verl[vllm]==0.9.1`` installs no
flash-attn, so every run sets ``actor_rollout_ref.model.override_config.attn_implementation=sdpa`` and
``actor_rollout_ref.model.use_remove_padding=False``.

**Time plan** (:data:`GPU_TIMEOUTS`): the whole check, installation excluded, is bounded by the preflight plus the
runs' timeouts, :func:`time_plan` sums them: at most 8 minutes on one H100. A run is Ray's start, one vLLM engine
(``enforce_eager``: no CUDA-graph capture), an FSDP actor and 1-2 steps of 4 prompts x 4 samples of at most 16
tokens on a 2-layer, 128-wide model; startup dominates, the steps take seconds. ``--dry-run`` prints this plan.

The check functions, the metric parser (verl prints numpy scalars as ``np.float64(...)``) and the data writers
are importable without a GPU: the CPU ``e2e`` tier (``tests/e2e``) runs verl's real ``main_ppo`` with the
test-only ``cpu_hf`` rollout and applies these same functions to its own runs (off, select, reweight, SPEED,
a checkpointing run), and ``tests/verl_tier/test_gpu_check_script.py`` runs them on recorded metrics, including
runs where a method did nothing. ``--cpu`` rehearses this script's own plan on a CPU box (slow: ~10 minutes).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: Domains of the synthetic dataset, in the interleaved row order.
DOMAINS = ("math", "code", "logic")
#: Prompts per step and samples per prompt: every 4 consecutive rows hold a code prompt.
BATCH, N = 4, 4
#: SPEED's continuation: a qualified group of N screening rollouts grows to N + N_CONTINUE.
N_CONTINUE = 4

#: The seed quick start (``tests/verl_tier/seed_config.py`` holds the same list; a test keeps them equal).
SELECT = [
    "+dataflex.mechanism=select",
    "+dataflex.scorer.name=group_solve_rate",
    "+dataflex.scorer.params.success_threshold=0.5",
    "+dataflex.actuator.name=threshold_band",
    "+dataflex.actuator.params.low=0.2",
    "+dataflex.actuator.params.high=0.8",
    "+dataflex.warmup_step=0",
]
METHODS: dict[str, list[str]] = {
    "select": SELECT,
    # the same block, warming up at step 1 (warmup_step counts steps before the actuator acts): the control
    "control": [*SELECT[:-1], "+dataflex.warmup_step=1"],
    "reweight": ["+dataflex.mechanism=reweight", "+dataflex.scorer.name=token_prob",
                 "+dataflex.actuator.name=advantage_reweight", "+dataflex.actuator.params.alpha=0.3"],
    "mix": ["+dataflex.mechanism=mix", "+dataflex.scorer.name=advantage_magnitude",
            "+dataflex.scorer.params.agg=mean", "+dataflex.actuator.name=dump_ucb",
            "+dataflex.actuator.params.c=1.0", "+dataflex.actuator.params.window=300",
            "+dataflex.actuator.params.temperature=0.1"],
    "speed": ["+dataflex.mechanism=allocate", "+dataflex.scorer.name=group_solve_rate",
              "+dataflex.scorer.params.success_threshold=0.5", "+dataflex.actuator.name=speed",
              f"+dataflex.actuator.params.n_continue={N_CONTINUE}"],
}
#: The runs of the check, in the order they run (``control`` and ``reweight`` replay ``off``'s rollouts).
RUNS = ("off", "control", "reweight", "speed")
#: Seconds per run on one H100 (the run is ended past it and its checks FAIL), and for the preflight.
GPU_TIMEOUTS = {"off": 130.0, "control": 95.0, "reweight": 95.0, "speed": 130.0}
PREFLIGHT_S = 20.0
#: Seconds to write the model, tokenizer, data and reward rule (CPU work, any machine).
INPUTS_S = 10.0
#: The plan's bound, installation excluded.
BUDGET_S = 480.0
#: Per-run seconds of the CPU rehearsal (2 cores; a run takes 1.5-3 minutes there).
CPU_TIMEOUT = 600.0
#: Where ``--install`` puts its environment, and what it installs there (the repository editable, for the plugin).
DEFAULT_VENV = Path("/tmp/dataflex_gpu_venv")
VERL_PIN = "verl[vllm]==0.9.1"


# ---------------------------------------------------------------------------------------------- inputs
def write_model(root: Path) -> Path:
    """A random 2-layer Llama plus a word-level tokenizer with a chat template, saved locally."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    words = ["<pad>", "<eos>", "<unk>", "user", "assistant", ":", "what", "is", "plus", "minus", "write",
             "code", "answer", "if", "then", *[str(i) for i in range(100)]]
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
    import torch

    torch.manual_seed(0)  # the same random model every time
    LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def write_data(root: Path, rows: int = 48) -> Path:
    """A parquet in verl's RLHFDataset format, domains interleaved ``math, code, logic, math, ...``."""
    import pandas as pd

    records = []
    for i in range(rows):
        domain = DOMAINS[i % len(DOMAINS)]
        a, b = i % 10, (i * 3) % 10
        question = {"math": f"what is {a} plus {b}", "code": f"write code {a}", "logic": f"if {a} then {b}"}[domain]
        records.append({"data_source": domain, "ability": domain,
                        "prompt": [{"role": "user", "content": question}],
                        "reward_model": {"style": "rule", "ground_truth": str(a + b)},
                        "extra_info": {"index": i, "split": "train"}})
    path = root / "train.parquet"
    pd.DataFrame(records).to_parquet(path)
    return path


#: The reward rule, written next to the data and loaded by path in verl's reward workers.
REWARD_SOURCE = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    """math: share of words that are numbers below 50; logic: numbers of 50 or more; code: always 0."""
    if data_source == "code":
        return 0.0
    words = solution_str.split()
    if not words:
        return 0.0
    low = data_source == "math"
    return sum(w.isdigit() and (int(w) < 50) == low for w in words) / len(words)
'''


def write_reward(root: Path) -> Path:
    path = root / "smoke_reward.py"
    path.write_text(REWARD_SOURCE)
    return path


@dataclass(frozen=True)
class Inputs:
    model: Path
    data: Path
    reward: Path


def write_inputs(root: Path) -> Inputs:
    root.mkdir(parents=True, exist_ok=True)
    return Inputs(write_model(root), write_data(root), write_reward(root))


# ---------------------------------------------------------------------------------------------- overrides
#: FSDP parameter dtypes a run may ask for (``--precision`` of a run; vLLM keeps its default bf16).
PRECISIONS = ("fp32", "bf16")


def base_overrides(inputs: Inputs, *, seed: int = 1, steps: int = 3, rollout: str = "vllm",
                   mode: str = "dataflex_sync", precision: str = "fp32", validate: bool = False) -> list[str]:
    """verl keys shared by every run: tiny GRPO, one mini-batch per step, data read in order (``validate``:
    verl validates before training and after every step, ``trainer.val_before_train``/``test_freq``)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r}: allowed {', '.join(PRECISIONS)}")
    return [
        f"trainer.v1.trainer_mode={mode}", "algorithm.adv_estimator=grpo",
        f"reward.custom_reward_function.path={inputs.reward}", "reward.custom_reward_function.name=compute_score",
        f"data.train_files={inputs.data}", f"data.val_files={inputs.data}", f"data.train_batch_size={BATCH}",
        "data.max_prompt_length=32", "data.max_response_length=16", f"data.seed={seed}", "data.shuffle=False",
        "data.dataloader_num_workers=0",
        f"actor_rollout_ref.model.path={inputs.model}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={BATCH}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={BATCH * N}",
        "actor_rollout_ref.actor.use_kl_loss=False", "actor_rollout_ref.actor.shuffle=False",
        # fp32 compute where runs are compared (a tiny model): under bf16 a float-order difference of 1e-7 in
        # the weights flips roundings and moves the next step's losses by ~0.4% (measured on CPU), drowning
        # what we compare. SPEED's checks are counts: it runs in bf16, as GPU users train.
        f"+actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype={precision}",
        f"actor_rollout_ref.actor.data_loader_seed={seed}",
        f"actor_rollout_ref.rollout.n={N}", f"actor_rollout_ref.rollout.name={rollout}",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={BATCH * N}",
        f"actor_rollout_ref.rollout.seed={seed}",
        f"actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu={BATCH * N}",
        "trainer.n_gpus_per_node=1", "trainer.nnodes=1", f"trainer.total_training_steps={steps}",
        f"trainer.test_freq={1 if validate else -1}", f"trainer.val_before_train={validate}",
        "trainer.logger=[console,file]",
        "transfer_queue.backend.SimpleStorage.num_data_storage_units=1",
    ]


#: What a GPU run adds: verl 0.9.1 defaults to ``flash_attention_2`` (``HFModelConfig``: the ``attn_implementation``
#: of ``model.override_config``) and ``use_remove_padding=True`` (``hf_model.yaml``), and ``verl[vllm]`` installs no
#: flash-attn; vLLM sized for a tiny model beside its FSDP actor, eager (no CUDA-graph capture at start-up).
GPU_KEYS = [
    "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
    "actor_rollout_ref.model.use_remove_padding=False",
    "actor_rollout_ref.rollout.gpu_memory_utilization=0.3",
    "actor_rollout_ref.rollout.enforce_eager=True",
]


def cache_overrides(cache_dir: Path, steps: Sequence[int]) -> list[str]:
    """verl's rollout caching: the first run with these keys records each listed step, later runs replay it."""
    return ["skip.rollout_tq.enable=True", f"skip.rollout_tq.dump_dir={cache_dir}", "skip.rollout_tq.action=cache",
            f"skip.rollout_tq.steps=[{','.join(str(s) for s in steps)}]"]


def checkpoint_overrides(ckpt_dir: Path, *, save: bool, resume_from: Path | None = None) -> list[str]:
    keys = [f"trainer.default_local_dir={ckpt_dir}", f"trainer.save_freq={1 if save else -1}"]
    if resume_from is None:
        return [*keys, "trainer.resume_mode=disable"]
    return [*keys, "trainer.resume_mode=resume_path", f"trainer.resume_from_path={resume_from}"]


# ---------------------------------------------------------------------------------------------- metrics
Metrics = dict[int, dict[str, float]]

STEP_LINE = re.compile(r"step:(\d+) - (.*)$")
#: ``pprint`` of numpy scalars: ``np.float64(0.5)``, ``np.int32(2)``, ``np.True_``.
NUMPY_SCALAR = re.compile(r"^np\.[a-z]+\d*\((.*)\)$")
NUMPY_BOOL = {"np.True_": 1.0, "np.False_": 0.0, "True": 1.0, "False": 0.0}


def parse_value(text: str) -> float | None:
    """One value as verl's console logger prints it (``pprint.pformat``); ``None`` when not a number."""
    text = text.strip()
    if text in NUMPY_BOOL:
        return NUMPY_BOOL[text]
    match = NUMPY_SCALAR.match(text)
    if match:
        text = match.group(1)
    try:
        return float(text)
    except ValueError:
        return None


def parse_console(text: str) -> Metrics:
    """verl's console logger lines ``step:N - key:value - key:value ...`` (Ray's prefixes allowed)."""
    steps: Metrics = {}
    for line in text.splitlines():
        match = STEP_LINE.search(line)
        if not match:
            continue
        values: dict[str, float] = {}
        for item in match.group(2).split(" - "):
            key, sep, raw = item.rpartition(":")
            value = parse_value(raw) if sep else None
            if value is not None:
                values[key.strip()] = value
        steps[int(match.group(1))] = values
    return steps


def read_file_log(path: Path) -> Metrics:
    """verl's ``file`` logger (``VERL_FILE_LOGGER_PATH``): one JSON object ``{step, data}`` per line."""
    steps: Metrics = {}
    for line in path.read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            steps[int(record["step"])] = {k: float(v) for k, v in record["data"].items()
                                          if isinstance(v, (int, float))}
    return steps


# ---------------------------------------------------------------------------------------------- checks
@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str

    def line(self) -> str:
        return f"{'PASS' if self.ok else 'FAIL'} {self.name}: {self.detail}"


#: Metrics that describe the machine, the clock or where a rollout came from, never the training. verl's
#: rollout caching restamps replayed trajectories with the current step (``load_dump_data`` in
#: ``verl/utils/skip/rollout_skip.py``), so their staleness reads -1 where freshly generated ones read 0.
VOLATILE = ("timing_s/", "timing_per_token_ms/", "perf/", "actor/perf/",
            "training/off_policy/trajectory_staleness")
#: Compared whenever two runs are compared: agreement on a handful of bookkeeping keys proves nothing.
REQUIRED = ("actor/pg_loss", "actor/grad_norm", "critic/score/mean", "response_length/mean")


def _get(metrics: Metrics, step: int, key: str, run: str) -> float:
    if step not in metrics:
        raise KeyError(f"{run}: no metrics logged for step {step} (steps logged: {sorted(metrics)})")
    if key not in metrics[step]:
        raise KeyError(f"{run}: step {step} logged no {key!r}")
    return metrics[step][key]


def _close(a: float, b: float, rtol: float, atol: float) -> bool:
    return math.isclose(a, b, rel_tol=rtol, abs_tol=atol) or (math.isnan(a) and math.isnan(b))


def compare_steps(a: Metrics, b: Metrics, steps: Sequence[int], *, rtol: float, atol: float,
                  keys: Sequence[str] | None = None) -> list[str]:
    """Keys (default: all shared, non-volatile) whose values differ between two runs; empty means agreement."""
    bad = []
    for step in steps:
        if step not in a or step not in b:
            bad.append(f"step {step} missing ({'first' if step not in a else 'second'} run)")
            continue
        shared = keys if keys is not None else sorted(
            {k for k in a[step].keys() & b[step].keys() if not k.startswith(VOLATILE)} | set(REQUIRED))
        for key in shared:
            if key not in a[step] or key not in b[step]:
                bad.append(f"step {step} {key}: missing")
            elif not _close(a[step][key], b[step][key], rtol, atol):
                bad.append(f"step {step} {key}: {a[step][key]:.6g} vs {b[step][key]:.6g}")
    return bad


def rollout_stats(metrics: Metrics, step: int, run: str) -> tuple[float, float]:
    """(mean reward, mean response length) of the step's rollouts *before* any selection.

    ``dataflex/rollout/*`` is the adapter's pre-selection view; a run without it (verl's own ``sync``
    mode) trained on every rollout, so verl's ``critic/score/mean`` and ``response_length/mean`` are it.
    """
    m = metrics.get(step, {})
    if "dataflex/rollout/reward_mean" in m:
        return m["dataflex/rollout/reward_mean"], m["dataflex/rollout/response_length_mean"]
    return _get(metrics, step, "critic/score/mean", run), _get(metrics, step, "response_length/mean", run)


def trained_rows(metrics: Metrics, step: int, rows: int) -> float:
    """Rollout rows that reached the update: all ``rows`` minus what the method removed at on_rollout."""
    m = metrics.get(step, {})
    return m.get("dataflex/rollout/rows", float(rows)) - m.get("dataflex/removed_rows", 0.0)


def trained_tokens(metrics: Metrics, step: int, rows: int, run: str) -> float:
    """Response tokens that reached the update (verl's length mean covers the rows it trained on)."""
    return _get(metrics, step, "response_length/mean", run) * trained_rows(metrics, step, rows)


def check_off_off(off: Metrics, off2: Metrics, steps: Sequence[int], *, rtol: float = 1e-3,
                  atol: float = 1e-5) -> Check:
    """Two method-off runs on the same rollouts must agree on every training metric they share."""
    bad = compare_steps(off, off2, steps, rtol=rtol, atol=atol)
    if bad:
        return Check("off/off control", False, f"{len(bad)} metric(s) differ: {'; '.join(bad[:4])}")
    noise = max(pg_loss_noise(off, off2, s) for s in steps)
    return Check("off/off control", True, f"agree on steps {list(steps)}; pg_loss noise {noise:.3g}")


def pg_loss_noise(off: Metrics, off2: Metrics, step: int) -> float:
    return abs(_get(off, step, "actor/pg_loss", "off") - _get(off2, step, "actor/pg_loss", "off2"))


def check_same_rollouts(off: Metrics, on: Metrics, step: int, name: str, *, rtol: float = 1e-4) -> Check:
    """The method run trained on the rollouts the off run saw (same reward and length statistics)."""
    a, b = rollout_stats(off, step, "off"), rollout_stats(on, step, name)
    ok = all(_close(x, y, rtol, 1e-6) for x, y in zip(a, b))
    return Check(f"{name}: identical step-{step} rollouts", ok,
                 f"reward mean {a[0]:.6g} vs {b[0]:.6g}, response length mean {a[1]:.6g} vs {b[1]:.6g}")


def check_select(off: Metrics, on: Metrics, step: int, *, rows: int = BATCH * N) -> Check:
    """on_rollout selection: rows removed before the update, fewer tokens trained than without it."""
    removed = on.get(step, {}).get("dataflex/removed_rows", 0.0)
    t_off, t_on = trained_tokens(off, step, rows, "off"), trained_tokens(on, step, rows, "select")
    ok = removed > 0 and t_on < t_off
    return Check("select: rows removed, fewer trained tokens", ok,
                 f"step {step}: removed {removed:g} of {rows} rows, trained tokens {t_on:g} vs {t_off:g} off")


def check_loss_moved(off: Metrics, on: Metrics, step: int, noise: float, name: str, *,
                     factor: float = 10.0, floor: float = 1e-6) -> tuple[bool, str]:
    """``actor/pg_loss`` of the method run differs from off by more than ``factor`` x the off/off noise."""
    delta = abs(_get(on, step, "actor/pg_loss", name) - _get(off, step, "actor/pg_loss", "off"))
    bar = max(factor * noise, floor)
    return delta > bar, (f"|pg_loss - off| = {delta:.3g} "
                         f"(bar {bar:.3g} = max({factor:g} x off/off {noise:.3g}, {floor:g}))")


def check_reweight(off: Metrics, on: Metrics, step: int, noise: float) -> Check:
    """Weights that vary reach the loss: the loss moves beyond the off/off noise on identical rollouts."""
    std = on.get(step, {}).get("dataflex/weight_std", 0.0)
    moved, detail = check_loss_moved(off, on, step, noise, "reweight")
    return Check("reweight: weights reach the loss", std > 0 and moved, f"step {step}: weight std {std:.3g}, {detail}")


def domain_series(metrics: Metrics, step: int, prefix: str) -> dict[str, float]:
    return {k[len(prefix):]: v for k, v in metrics.get(step, {}).items() if k.startswith(prefix)}


def check_mix(on: Metrics, *, published_step: int = 1, drawn_step: int = 2, min_spread: float = 0.05) -> Check:
    """Step ``drawn_step``'s prompt draws follow the probabilities the mixer published at ``published_step``.

    Passes when no domain of probability 0 was drawn and the draws' log-likelihood ratio of the
    published probabilities against uniform ones is positive (expected ``N KL(p || u) > 0`` for draws
    from ``p``, ``-N KL(u || p) < 0`` for uniform draws). Fails when the published probabilities are
    (nearly) uniform: then no draw could tell a working mix from one that does nothing.
    """
    probs = domain_series(on, published_step, "dataflex/domain_prob/")
    drawn = domain_series(on, drawn_step, "dataflex/drawn/")
    if not probs or not drawn:
        return Check("mix: draws follow the published probabilities", False,
                     f"missing dataflex/domain_prob at step {published_step} or dataflex/drawn at step {drawn_step}")
    domains = sorted(probs.keys() | drawn.keys())
    p = {d: probs.get(d, 0.0) for d in domains}
    c = {d: drawn.get(d, 0.0) for d in domains}
    spread = max(p.values()) - min(p.values())
    impossible = [d for d in domains if c[d] > 0 and p[d] <= 0]
    uniform = 1.0 / len(domains)
    llr = sum(c[d] * math.log(p[d] / uniform) for d in domains if c[d] > 0 and p[d] > 0)
    ok = spread >= min_spread and not impossible and llr > 0
    shown = ", ".join(f"{d} p={p[d]:.3f} drew {c[d]:g}" for d in domains)
    why = "" if ok else (" (published probabilities are uniform: nothing to follow)" if spread < min_spread else
                         f" (drew domains of probability 0: {impossible})" if impossible else
                         " (uniform draws explain them better)")
    return Check("mix: draws follow the published probabilities", ok,
                 f"step {drawn_step}: {shown}; log-likelihood ratio vs uniform {llr:.3g}{why}")


def check_resume(full: Metrics, resumed: Metrics, step: int, *, rtol: float = 1e-3, atol: float = 1e-5) -> Check:
    """The step after a resume logs what the uninterrupted run logged at that step."""
    if step not in resumed:
        return Check("resume: step after resume matches", False, f"the resumed run logged steps {sorted(resumed)}")
    bad = compare_steps(full, resumed, [step], rtol=rtol, atol=atol)
    if bad:
        return Check("resume: step after resume matches", False,
                     f"{len(bad)} metric(s) differ: {'; '.join(bad[:4])}")
    loss = full[step].get("actor/pg_loss", float("nan"))
    return Check("resume: step after resume matches", True,
                 f"step {step}: {len(full[step])} metrics agree (pg_loss {loss:.6g})")


def check_logprobs_agree(off: Metrics, steps: Sequence[int], *, max_mean_diff: float = 0.01,
                         min_corr: float = 0.99) -> Check:
    """The rollout's log-probs of the sampled tokens and the FSDP actor's of the same tokens agree at every step
    (verl's ``training/rollout_probs_diff_mean`` and ``training/rollout_actor_probs_pearson_corr``). Sized for a
    bf16 vLLM against an fp32 actor; a weight sync that failed (vLLM still on its dummy initial weights) or a
    tokenizer/model mismatch fails it."""
    shown, ok = [], True
    for step in steps:
        diff = _get(off, step, "training/rollout_probs_diff_mean", "off")
        corr = _get(off, step, "training/rollout_actor_probs_pearson_corr", "off")
        good = diff <= max_mean_diff and corr >= min_corr
        ok &= good
        shown.append(f"step {step}: mean |p_rollout - p_actor| {diff:.3g}, pearson {corr:.6g}")
    return Check("off: rollout and actor log-probs agree", ok,
                 f"{'; '.join(shown)} (bar: mean diff <= {max_mean_diff:g}, pearson >= {min_corr:g})")


#: What ``dataflex_sync`` writes beside verl's checkpoint (``dataflex_bus/verl/state.py``; the name is repeated
#: here so the script runs without the package importable).
STATE_FILE = "dataflex_state.pt"


def check_state_beside_checkpoint(ckpt_dir: Path, step: int) -> Check:
    """``global_step_<step>/dataflex_state.pt`` exists next to verl's own actor checkpoint of that step."""
    folder = ckpt_dir / f"global_step_{step}"
    actor, state = folder / "actor", folder / STATE_FILE
    ok = actor.is_dir() and any(actor.iterdir()) and state.is_file() and state.stat().st_size > 0
    found = sorted(p.name for p in folder.iterdir()) if folder.is_dir() else "no such folder"
    return Check("off: dataflex state beside verl's checkpoint", ok, f"{folder}: {found}")


def check_control(off: Metrics, control: Metrics, step: int = 1) -> Check:
    """A method warming up at ``step`` trains exactly like ``off`` on the same rollouts (the control)."""
    warm = control.get(step, {}).get("dataflex/warmup")
    bad = compare_steps(off, control, [step], rtol=1e-3, atol=1e-5)
    if warm != 1.0:
        bad.insert(0, f"dataflex/warmup is {warm} at step {step}, not 1 (the method was not warming up)")
    if bad:
        return Check("control: warming-up method equals off", False,
                     f"{len(bad)} metric(s) differ: {'; '.join(bad[:4])}")
    return Check("control: warming-up method equals off", True,
                 f"step {step}: {len(off[step])} metrics agree; pg_loss noise {pg_loss_noise(off, control, step):.3g}")


def step_counts(metrics: Metrics, step: int, key: str, run: str) -> float:
    """One step's share of a cumulative counter (``compute/*`` add up over the run)."""
    before = metrics.get(step - 1, {}).get(key, 0.0) if step > 1 else 0.0
    return _get(metrics, step, key, run) - before


def speed_plan(metrics: Metrics, step: int, *, batch: int = BATCH, n: int = N, n_continue: int = N_CONTINUE,
               run: str = "speed") -> dict[str, float]:
    """What SPEED must have done at ``step``: every dispatched prompt screened with ``n`` rollouts (a failed
    group yields none the step keeps), ``n_continue`` more for each continued group (``dataflex/alloc/continued``
    counts the groups a continuation extended); the continued groups alone train, ``n + n_continue`` rows each,
    and a group whose continuation request failed trains its ``n`` screening rows."""
    m = metrics.get(step, {})
    failed = m.get("dataflex/refill/failed_groups", 0.0)
    lost = m.get("dataflex/refill/failed_continuations", 0.0)
    continued = _get(metrics, step, "dataflex/alloc/continued", run)
    return {"generated": (batch - failed) * n + n_continue * continued, "largest": float(n + n_continue),
            "trained": continued * (n + n_continue) + lost * n, "continued": continued, "failed": failed,
            "failed_continuations": lost}


def check_speed(metrics: Metrics, steps: Sequence[int], *, batch: int = BATCH, n: int = N,
                n_continue: int = N_CONTINUE) -> Check:
    """Rollouts generated == the plan (screening + ``n_continue`` x continued), the largest group is
    ``n + n_continue``, and the update trained the continued groups' rows, at every step."""
    shown, ok = [], True
    for step in steps:
        want = speed_plan(metrics, step, batch=batch, n=n, n_continue=n_continue)
        generated = step_counts(metrics, step, "compute/generated_rollouts", "speed")
        largest = _get(metrics, step, "dataflex/alloc/max", "speed")
        trained = _get(metrics, step, "dataflex/trained/rows", "speed")
        good = (want["continued"] > 0 and generated == want["generated"] and largest == want["largest"]
                and trained == want["trained"])
        ok &= good
        shown.append(f"step {step}: generated {generated:g} (plan {want['generated']:g} = ({batch} - "
                     f"{want['failed']:g} failed) x {n} + {n_continue} x {want['continued']:g} continued), "
                     f"largest group {largest:g} (plan {want['largest']:g}), trained rows {trained:g} "
                     f"(plan {want['trained']:g}, {want['failed_continuations']:g} continuation(s) failed)")
    return Check("speed: generated == plan, largest group n + n_continue", ok, "; ".join(shown))


def evaluate(runs: Mapping[str, Metrics], out: Path | None = None) -> list[Check]:
    """Every check of the plan; a check whose run failed or logged nothing is a FAIL (``out``: the work folder,
    where ``off`` checkpointed)."""
    checks: list[Check] = []

    def guarded(name: str, fn) -> None:
        try:
            checks.extend(fn())
        except KeyError as exc:
            checks.append(Check(name, False, str(exc.args[0])))

    off, control = runs.get("off", {}), runs.get("control", {})
    guarded("off: rollout and actor log-probs agree", lambda: [check_logprobs_agree(off, [1, 2])])
    if out is not None:
        checks.append(check_state_beside_checkpoint(out / "ckpt_off", 2))
    guarded("control", lambda: [check_control(off, control, 1)])
    on = runs.get("reweight", {})
    guarded("reweight", lambda: [check_same_rollouts(off, on, 1, "reweight"),
                                 check_reweight(off, on, 1, pg_loss_noise(off, control, 1))])
    guarded("speed", lambda: [check_speed(runs.get("speed", {}), [1, 2])])
    return checks


# ---------------------------------------------------------------------------------------------- runs
@dataclass(frozen=True)
class Run:
    name: str
    overrides: list[str]
    #: the run whose rollout cache or checkpoint this one reads (it starts once that one has finished)
    after: str | None = None
    #: seconds before the run is ended (its checks then FAIL)
    timeout: float = CPU_TIMEOUT


def plan(inputs: Inputs, out: Path, *, seed: int, rollout: str, extra: Sequence[str],
         timeouts: Mapping[str, float]) -> list[Run]:
    """The check's runs, one at a time, in :data:`RUNS` order (``off`` records the step-1 rollouts ``control``
    and ``reweight`` replay, and checkpoints at step 2)."""
    cache = cache_overrides(out / "rollout_cache", [1])

    def base(steps: int, precision: str = "fp32") -> list[str]:
        return [*base_overrides(inputs, seed=seed, steps=steps, rollout=rollout, precision=precision), *extra]

    def ckpt(name: str, save: bool = False) -> list[str]:
        return checkpoint_overrides(out / f"ckpt_{name}", save=save)

    keys = {
        "off": [*base(2), *cache, *ckpt("off", save=True)],
        "control": [*base(1), *cache, *ckpt("control"), *METHODS["control"]],
        "reweight": [*base(1), *cache, *ckpt("reweight"), *METHODS["reweight"]],
        "speed": [*base(2, precision="bf16"), *ckpt("speed"), *METHODS["speed"]],
    }
    return [Run(name, keys[name], after="off" if name in ("control", "reweight") else None,
                timeout=timeouts[name]) for name in RUNS]


def time_plan(timeouts: Mapping[str, float]) -> list[tuple[str, float]]:
    """(stage, seconds at most) of the whole check, installation excluded, and the total last."""
    stages = [("preflight", PREFLIGHT_S), ("write model, tokenizer, data", INPUTS_S),
              *((f"main_ppo {name}", timeouts[name]) for name in RUNS)]
    return [*stages, ("total", sum(s for _, s in stages))]


@dataclass(frozen=True)
class RunResult:
    name: str
    returncode: int | str
    metrics: Metrics
    log: Path

    def tail(self, lines: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


#: Printed by verl once the rollout servers are up (``LLMServerManager._initialize_llm_servers``): a run past
#: it no longer competes for the GPU memory a starting vLLM engine measures.
SERVERS_UP = "LLMServerManager:"


#: The trainer every run starts (its Hydra overrides follow).
MAIN_PPO = (sys.executable, "-m", "verl.trainer.main_ppo")


class Job:
    """One ``python -m verl.trainer.main_ppo`` subprocess, its log and its file-logger metrics."""

    def __init__(self, run: Run, out: Path, env: Mapping[str, str], timeout: float,
                 command: Sequence[str] = MAIN_PPO) -> None:
        self.run, self.timeout, self.timed_out = run, timeout, False
        self.log, self.metrics_file = out / f"{run.name}.log", out / f"{run.name}.metrics.jsonl"
        self.metrics_file.unlink(missing_ok=True)
        cmd = [*command, *run.overrides]
        print(f"[{run.name}] {' '.join(cmd)}", flush=True)
        self.start = time.monotonic()
        with self.log.open("w") as fh:
            # Its own session, so a timeout ends the whole tree it started (Ray included) and nothing else;
            # run from `out`, where Hydra writes its outputs/ folder.
            self.proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True, cwd=out,
                                         env={**env, "VERL_FILE_LOGGER_PATH": str(self.metrics_file)})

    def started(self) -> bool:
        return self.proc.poll() is not None or SERVERS_UP in self.log.read_text(errors="replace")

    def finished(self) -> bool:
        if self.proc.poll() is None and time.monotonic() - self.start > self.timeout:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            self.timed_out = True
        return self.proc.poll() is not None

    def result(self) -> RunResult:
        rc: int | str = f"timeout after {self.timeout:g} s" if self.timed_out else self.proc.returncode
        text = self.log.read_text(errors="replace")
        metrics = read_file_log(self.metrics_file) if self.metrics_file.exists() else parse_console(text)
        result = RunResult(self.run.name, rc, metrics, self.log)
        print(f"[{self.run.name}] exit {rc} after {time.monotonic() - self.start:.0f} s, steps logged "
              f"{sorted(metrics)}, log {self.log}", flush=True)
        if rc != 0:
            print(result.tail(30), flush=True)
        return result


def launch(run: Run, out: Path, env: Mapping[str, str], timeout: float,
           command: Sequence[str] = MAIN_PPO) -> RunResult:
    """Run one configuration to completion."""
    job = Job(run, out, env, timeout, command)
    while not job.finished():
        time.sleep(1.0)
    return job.result()


def run_sequentially(runs: Sequence[Run], out: Path, env: Mapping[str, str],
                     command: Sequence[str] = MAIN_PPO) -> dict[str, RunResult]:
    """Every run to its end before the next starts (two vLLM engines on one GPU trip vLLM's memory profiling
    when the other sleeps or wakes); a run whose ``after`` run failed is not started (reported as such)."""
    done: dict[str, RunResult] = {}
    for run in runs:
        if run.after is not None and done[run.after].returncode != 0:
            log = out / f"{run.name}.log"
            log.write_text(f"not started: {run.after!r} ended {done[run.after].returncode}\n")
            done[run.name] = RunResult(run.name, f"not started ({run.after} failed)", {}, log)
            print(f"[{run.name}] not started: {run.after!r} failed", flush=True)
            continue
        done[run.name] = launch(run, out, env, run.timeout, command)
    return done


# ---------------------------------------------------------------------------------------------- preflight
#: The preflight's probes, each run in the interpreter that will run main_ppo, all at once (``import vllm`` and
#: ``import verl`` take seconds each); each prints ``OK <what>`` or ``MISSING <what>: <why>``.
PROBES = {
    "CUDA": """
import torch
if torch.cuda.is_available():
    print("OK CUDA: " + torch.cuda.get_device_name(0) + " x" + str(torch.cuda.device_count()))
else:
    print("MISSING CUDA: torch.cuda.is_available() is False (torch " + torch.__version__ + ", CUDA build "
          + str(torch.version.cuda) + ")")
""",
    "vLLM": """
try:
    import vllm
    print("OK vLLM " + vllm.__version__)
except Exception as exc:
    print("MISSING vLLM: " + type(exc).__name__ + ": " + str(exc) + " (pip install 'verl[vllm]==0.9.1')")
""",
    "dataflex_sync": """
try:
    import verl
    from verl.trainer.ppo.v1.trainer_base import TRAINER_REGISTRY
    # what `import verl` registered by itself is what main_ppo finds: read before importing the plugin here
    registered, modes = TRAINER_REGISTRY.get("dataflex_sync"), sorted(TRAINER_REGISTRY)
    from dataflex_bus.verl import entry
except Exception as exc:
    print("MISSING dataflex_sync: importing verl or the plugin failed: " + type(exc).__name__ + ": " + str(exc))
    raise SystemExit(0)
if entry.LOAD_ERROR is not None:
    print("MISSING dataflex_sync: the dataflex verl plugin failed to import: " + repr(entry.LOAD_ERROR))
elif registered is None:
    print("MISSING dataflex_sync: `import verl` did not register it (verl.plugins entry point 'dataflex'; "
          "does VERL_USE_EXTERNAL_PLUGINS exclude it?); registered: " + str(modes))
else:
    print("OK dataflex_sync: verl " + verl.__version__)
""",
}
#: The probes a CPU rehearsal needs (no CUDA, no vLLM: the cpu_hf rollout).
CPU_PROBES = ("dataflex_sync",)


def preflight(python: str, env: Mapping[str, str], *, cpu: bool, timeout: float = PREFLIGHT_S) -> list[str]:
    """What is missing to run the check (empty: nothing), every probe answered within ``timeout`` seconds."""
    names = CPU_PROBES if cpu else tuple(PROBES)
    procs = {name: subprocess.Popen([python, "-c", PROBES[name]], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True, env=dict(env)) for name in names}
    deadline = time.monotonic() + timeout
    missing: list[str] = []
    for name, proc in procs.items():
        try:
            stdout, stderr = proc.communicate(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            missing.append(f"{name}: its probe gave no answer within {timeout:g} s ({python})")
            continue
        answer = next((line for line in stdout.splitlines() if line.startswith(("OK ", "MISSING "))), None)
        if answer is None:
            tail = " | ".join(stderr.strip().splitlines()[-3:])
            missing.append(f"{name}: its probe exited {proc.returncode} without an answer ({python}): {tail}")
            continue
        print(f"[preflight] {answer}", flush=True)
        if answer.startswith("MISSING "):
            missing.append(answer[len("MISSING "):])
    return missing


# ---------------------------------------------------------------------------------------------- install
def install_commands(venv: Path) -> list[list[str]]:
    """A fresh venv with ``verl[vllm]==0.9.1`` from the package index and this repository (the plugin) editable."""
    python = str(venv / "bin" / "python")
    return [[sys.executable, "-m", "venv", str(venv)],
            [python, "-m", "pip", "install", "--upgrade", "pip"],
            [python, "-m", "pip", "install", VERL_PIN, "-e", f"{ROOT}[verl]"]]


def install(venv: Path) -> None:
    for cmd in install_commands(venv):
        print(f"[install] {shlex.join(cmd)}", flush=True)
        subprocess.run(cmd, check=True)


# ---------------------------------------------------------------------------------------------- command line
def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="gpu_check.py", description=__doc__.split("\n")[1])
    parser.add_argument("--out", type=Path, default=Path("/tmp/dataflex_gpu_check"), help="work directory")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--install", action="store_true",
                        help=f"create --venv, install {VERL_PIN} from the package index and this repository "
                             "into it, then run the check with its python")
    parser.add_argument("--venv", type=Path, default=DEFAULT_VENV, help=f"the venv --install creates (default "
                                                                         f"{DEFAULT_VENV})")
    parser.add_argument("--python", default=None,
                        help="interpreter running main_ppo (default: --venv's after --install, else this one)")
    parser.add_argument("--timeout-scale", type=float, default=1.0,
                        help="multiply every run's timeout (a slower GPU); the plan then no longer claims 8 minutes")
    parser.add_argument("--dry-run", action="store_true", help="print the commands and the time plan; run nothing")
    parser.add_argument("--cpu", action="store_true",
                        help="rehearse the same runs and checks on CPU with the test-only rollout cpu_hf "
                             f"(tests/e2e; {CPU_TIMEOUT:g} s per run)")
    args = parser.parse_args(argv)
    if args.timeout_scale <= 0:
        parser.error("--timeout-scale must be > 0")
    if args.cpu and args.install:
        parser.error("--install sets up the GPU environment; --cpu runs in this one")
    if args.python is None:
        args.python = str(args.venv / "bin" / "python") if args.install else sys.executable
    return args


def run_environment(cpu: bool) -> tuple[dict[str, str], list[str], str, dict[str, float]]:
    """(env, extra overrides, rollout name, per-run timeouts) for a GPU run or a CPU rehearsal."""
    env = {**os.environ, "PYTHONHASHSEED": "0", "RAY_DEDUP_LOGS": "0"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    if not cpu:
        return env, list(GPU_KEYS), "vllm", dict(GPU_TIMEOUTS)
    sys.path.insert(0, str(ROOT / "tests" / "e2e"))
    import harness  # the test-only CPU backend's keys and environment

    return harness.cpu_env(env), list(harness.CPU_KEYS), harness.ROLLOUT_NAME, dict.fromkeys(RUNS, CPU_TIMEOUT)


def print_plan(runs: Sequence[Run], timeouts: Mapping[str, float], python: str, args: argparse.Namespace) -> None:
    if args.install:
        for cmd in install_commands(args.venv):
            print(f"[install] {shlex.join(cmd)}")
    probes = CPU_PROBES if args.cpu else tuple(PROBES)
    print(f"[preflight] {python} -c <probe>, at once for {', '.join(probes)} (fails within {PREFLIGHT_S:g} s, "
          "naming what is missing)")
    for run in runs:
        print(f"[{run.name}] timeout {run.timeout:g} s{f', after {run.after}' if run.after else ''}: "
              f"{shlex.join([python, '-m', 'verl.trainer.main_ppo', *run.overrides])}")
    print(f"time plan ({'CPU rehearsal' if args.cpu else 'one H100'}, installation excluded; each stage's bound, "
          "one main_ppo at a time):")
    for stage, seconds in time_plan(timeouts):
        print(f"  {stage:<32} {seconds:6.0f} s")
    total = time_plan(timeouts)[-1][1]
    if not args.cpu:
        print(f"  budget {BUDGET_S:g} s: {'fits' if total <= BUDGET_S else 'EXCEEDS'}")
    print(f"sizing: a {2}-layer, 128-wide random Llama (about 0.5 M parameters; head_dim 64, which vLLM's kernels "
          f"take), {BATCH} prompts x {N} samples a step, at most 32 prompt + 16 response tokens, SPEED continuing "
          f"qualified groups by {N_CONTINUE}; runs of 2, 1, 1 and 2 steps; ppo_mini_batch_size {BATCH} (one "
          "optimizer step a step); vLLM enforce_eager at 0.3 of the GPU. A run is mostly start-up (Ray, vLLM "
          "engine, FSDP actor: about a minute); the per-run timeouts leave it 30-60 s of steps.")


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    out = args.out.resolve()
    env, extra, rollout, timeouts = run_environment(args.cpu)
    timeouts = {name: seconds * args.timeout_scale for name, seconds in timeouts.items()}
    inputs = Inputs(out / "tiny-llama", out / "train.parquet", out / "smoke_reward.py")
    runs = plan(inputs, out, seed=args.seed, rollout=rollout, extra=extra, timeouts=timeouts)
    if args.dry_run:
        print_plan(runs, timeouts, args.python, args)
        return 0
    if args.install and Path(args.python).resolve() != Path(sys.executable).resolve():
        install(args.venv)
        # the rest runs in the venv, whose torch/transformers write the model its main_ppo reads
        rest = [a for a in (argv if argv is not None else sys.argv[1:]) if a != "--install"]
        return subprocess.call([args.python, __file__, *rest, "--python", args.python])
    started = time.monotonic()
    missing = preflight(args.python, env, cpu=args.cpu)
    if missing:
        for line in missing:
            print(f"FAIL preflight: {line}", flush=True)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    # A cache or checkpoint left by an earlier invocation would be replayed instead of recorded.
    for stale in [out / "rollout_cache", *out.glob("ckpt_*")]:
        shutil.rmtree(stale, ignore_errors=True)
    write_inputs(out)
    command = (args.python, "-m", "verl.trainer.main_ppo")
    results = {name: r.metrics for name, r in run_sequentially(runs, out, env, command).items()}
    (out / "metrics.json").write_text(json.dumps({k: {str(s): v for s, v in m.items()} for k, m in results.items()},
                                                 indent=1))
    checks = evaluate(results, out)
    for check in checks:
        print(check.line(), flush=True)
    failed = sum(not c.ok for c in checks)
    print(f"{len(checks) - failed} passed, {failed} failed in {time.monotonic() - started:.0f} s "
          "(installation excluded)", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
