#!/usr/bin/env python
"""GPU proof for the ``dataflex_sync`` trainer mode: verl's real ``main_ppo`` with vLLM, checks that can fail.

    python scripts/gpu_smoke.py --out /tmp/dataflex_gpu_smoke

On one GPU it trains a tiny *randomly initialised* Llama (written locally with a word-level tokenizer:
no download) on a three-domain parquet with a local reward rule, 3 steps at most per run, and prints one
``PASS``/``FAIL`` line per check (exit status 1 if any check fails):

* ``off``: ``dataflex_sync`` without a ``dataflex`` block, 3 steps, ``save_freq=1``; it records its
  rollouts with verl's rollout caching (``skip.rollout_tq``, action ``cache``), so every later run that
  loads the cache trains on **identical rollouts** (vLLM with async scheduling is not bit-reproducible).
* ``off2``: verl's stock ``sync`` mode on the cached rollouts: the off/off control. It must agree with
  ``off`` (the adapter without a method changes nothing) and its difference is the noise floor.
* ``select`` (the seed quick start: ``group_solve_rate`` + ``threshold_band`` at on_rollout): rows are
  removed and fewer tokens are trained than by ``off`` on the same rollouts.
* ``reweight`` (``token_prob`` + ``advantage_reweight``): the weights vary (std > 0) and ``actor/pg_loss``
  moves further from ``off`` than ``off2`` does.
* ``subset`` (``reward_difficulty`` + ``max_variance``, a subset selector at on_advantage): rows are
  dropped and ``actor/pg_loss`` moves further from ``off`` than ``off2`` does.
* ``mix`` (DUMP: ``advantage_magnitude`` + ``dump_ucb``, fresh rollouts): the step-2 prompt draws follow
  the domain probabilities published at step 1 better than uniform draws would.
* ``resume``: ``off`` resumed from its step-2 checkpoint runs step 3 and matches ``off``'s step 3.

Runs go two at a time (``--jobs``): ``off`` and ``mix`` first, the replaying runs once ``off`` is done, and
a run starts only when the others' rollout servers are up (a starting vLLM engine sizes its KV cache from
the GPU memory it sees free).

The reward (``REWARD_SOURCE``) is the share of response words that are numbers (below 50 for ``math``,
50 or above for ``logic``); ``code`` always scores 0. A random model thus gets varied rewards inside every
math/logic group (non-zero advantages, weights that matter) and zero-variance code groups (that the
difficulty band must drop). Every training batch holds a code prompt (the data is interleaved and read in
order). One PPO mini-batch per step: the loss does not depend on the order in which rollouts finished.

The check logic, the metric parser (verl prints numpy scalars as ``np.float64(...)``) and the data
writers are importable without a GPU; the CPU test suite runs them on a recorded log
(``tests/verl_tier/test_gpu_smoke_script.py``) and the CPU ``e2e`` tier shares them. ``--cpu`` rehearses the
whole flow on a CPU box with the test-only backend of ``tests/e2e`` (slow: ~10 minutes).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

#: Domains of the synthetic dataset, in the interleaved row order.
DOMAINS = ("math", "code", "logic")
#: Prompts per step and samples per prompt: every 4 consecutive rows hold a code prompt.
BATCH, N = 4, 4

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
    "reweight": ["+dataflex.mechanism=reweight", "+dataflex.scorer.name=token_prob",
                 "+dataflex.actuator.name=advantage_reweight", "+dataflex.actuator.params.alpha=0.3"],
    "subset": ["+dataflex.mechanism=select", "+dataflex.scorer.name=reward_difficulty",
               "+dataflex.actuator.name=max_variance", "+dataflex.actuator.params.keep_fraction=0.5"],
    "mix": ["+dataflex.mechanism=mix", "+dataflex.scorer.name=advantage_magnitude",
            "+dataflex.scorer.params.agg=mean", "+dataflex.actuator.name=dump_ucb",
            "+dataflex.actuator.params.c=1.0", "+dataflex.actuator.params.window=300",
            "+dataflex.actuator.params.temperature=0.1"],
}
CHECKS = ("off_off", "select", "reweight", "subset", "mix", "resume")


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
def base_overrides(inputs: Inputs, *, seed: int = 1, steps: int = 3, rollout: str = "vllm",
                   mode: str = "dataflex_sync") -> list[str]:
    """verl keys shared by every run: tiny GRPO, one mini-batch per step, data read in order."""
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
        # fp32 compute (a tiny model): under bf16 a float-order difference of 1e-7 in the weights flips
        # roundings and moves the next step's losses by ~0.4% (measured on CPU), drowning what we compare.
        "+actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=fp32",
        f"actor_rollout_ref.actor.data_loader_seed={seed}",
        f"actor_rollout_ref.rollout.n={N}", f"actor_rollout_ref.rollout.name={rollout}",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={BATCH * N}",
        f"actor_rollout_ref.rollout.seed={seed}",
        f"actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu={BATCH * N}",
        "trainer.n_gpus_per_node=1", "trainer.nnodes=1", f"trainer.total_training_steps={steps}",
        "trainer.test_freq=-1", "trainer.val_before_train=False", "trainer.logger=[console,file]",
        "transfer_queue.backend.SimpleStorage.num_data_storage_units=1",
    ]


#: vLLM settings for a tiny model sharing the GPU with its FSDP actor.
VLLM_KEYS = ["actor_rollout_ref.rollout.gpu_memory_utilization=0.3", "actor_rollout_ref.rollout.enforce_eager=True"]


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


def check_subset(off: Metrics, on: Metrics, step: int, noise: float) -> Check:
    """A subset selector at on_advantage drops rows and changes the loss beyond the off/off noise."""
    kept = on.get(step, {}).get("dataflex/kept_fraction", 1.0)
    moved, detail = check_loss_moved(off, on, step, noise, "subset")
    return Check("subset: on_advantage selection reaches the loss", kept < 1.0 and moved,
                 f"step {step}: kept fraction {kept:.3g}, {detail}")


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


def evaluate(runs: Mapping[str, Metrics], wanted: Sequence[str] = CHECKS) -> list[Check]:
    """Every check whose runs are present; a check whose run failed or logged nothing is a FAIL."""
    out: list[Check] = []

    def guarded(name: str, fn) -> None:
        try:
            out.extend(fn())
        except KeyError as exc:
            out.append(Check(name, False, str(exc.args[0])))

    off, off2 = runs.get("off", {}), runs.get("off2", {})
    if "off_off" in wanted:
        guarded("off/off control", lambda: [check_off_off(off, off2, [1, 2])])
    noise = lambda s: pg_loss_noise(off, off2, s)  # noqa: E731
    if "select" in wanted:
        on = runs.get("select", {})
        guarded("select", lambda: [check_same_rollouts(off, on, 1, "select"), check_select(off, on, 1)])
    if "reweight" in wanted:
        on = runs.get("reweight", {})
        guarded("reweight", lambda: [check_same_rollouts(off, on, 1, "reweight"), check_reweight(off, on, 1, noise(1))])
    if "subset" in wanted:
        on = runs.get("subset", {})
        guarded("subset", lambda: [check_same_rollouts(off, on, 1, "subset"), check_subset(off, on, 1, noise(1))])
    if "mix" in wanted:
        guarded("mix", lambda: [check_mix(runs.get("mix", {}))])
    if "resume" in wanted:
        guarded("resume", lambda: [check_resume(off, runs.get("resume", {}), 3)])
    return out


# ---------------------------------------------------------------------------------------------- runs
@dataclass(frozen=True)
class Run:
    name: str
    overrides: list[str]
    #: the run whose rollout cache or checkpoint this one reads (it starts once that one has finished)
    after: str | None = None


def plan(inputs: Inputs, out: Path, *, wanted: Sequence[str], seed: int, rollout: str,
         extra: Sequence[str]) -> list[Run]:
    """The runs the wanted checks need, in dependency order (``off`` records the rollouts the others replay)."""
    cache = cache_overrides(out / "rollout_cache", [1, 2, 3])

    def base(steps: int, mode: str = "dataflex_sync") -> list[str]:
        return [*base_overrides(inputs, seed=seed, steps=steps, rollout=rollout, mode=mode), *extra]

    runs = []
    if set(wanted) - {"mix"}:
        runs.append(Run("off", [*base(3), *cache, *checkpoint_overrides(out / "ckpt_off", save=True)]))
    if "mix" in wanted:  # fresh rollouts: the draws decide which prompts are generated
        runs.append(Run("mix", [*base(2), *checkpoint_overrides(out / "ckpt_mix", save=False), *METHODS["mix"]]))
    if "off_off" in wanted or {"reweight", "subset"} & set(wanted):
        runs.append(Run("off2", [*base(2, mode="sync"), *cache, *checkpoint_overrides(out / "ckpt_off2", save=False)],
                        after="off"))
    for name in ("select", "reweight", "subset"):
        if name in wanted:
            runs.append(Run(name, [*base(1), *cache, *checkpoint_overrides(out / f"ckpt_{name}", save=False),
                                   *METHODS[name]], after="off"))
    if "resume" in wanted:
        runs.append(Run("resume", [*base(3), *cache, *checkpoint_overrides(
            out / "ckpt_resume", save=False, resume_from=out / "ckpt_off" / "global_step_2")], after="off"))
    return runs


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


def run_all(runs: Sequence[Run], out: Path, env: Mapping[str, str], timeout: float, jobs: int,
            command: Sequence[str] = MAIN_PPO) -> dict[str, RunResult]:
    """Every run, at most ``jobs`` at once; a run starts when its ``after`` run has finished and no running
    job is still bringing its rollout servers up (vLLM sizes its cache from the free GPU memory it sees)."""
    pending, running, done = list(runs), [], {}
    while pending or running:
        for job in [j for j in running if j.finished()]:
            running.remove(job)
            done[job.run.name] = job.result()
        ready = [r for r in pending if r.after is None or r.after in done]
        if ready and len(running) < jobs and all(j.started() for j in running):
            pending.remove(ready[0])
            running.append(Job(ready[0], out, env, timeout, command))
            continue
        time.sleep(1.0)
    return done


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="gpu_smoke.py", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("/tmp/dataflex_gpu_smoke"), help="work directory")
    parser.add_argument("--checks", default=",".join(CHECKS),
                        help=f"comma-separated subset of {','.join(CHECKS)} (default: all)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds per main_ppo run")
    parser.add_argument("--jobs", type=int, default=None,
                        help="main_ppo runs at once, each started once the others' rollout servers are up "
                             "(default 2; 1 with --cpu)")
    parser.add_argument("--rollout", default="vllm", help="actor_rollout_ref.rollout.name (default vllm)")
    parser.add_argument("--cpu", action="store_true",
                        help="rehearse on CPU with the test-only backend of tests/e2e (rollout cpu_hf)")
    args = parser.parse_args(argv)
    checks = [c.strip() for c in args.checks.split(",") if c.strip()]
    unknown = [c for c in checks if c not in CHECKS]
    if unknown or not checks:
        parser.error(f"--checks: unknown {unknown or 'empty list'}; allowed: {', '.join(CHECKS)}")
    args.checks = checks
    if args.timeout <= 0:
        parser.error("--timeout must be > 0 seconds")
    if args.jobs is None:
        args.jobs = 1 if args.cpu else 2  # a CPU box: parallel runs only slow each other down
    if args.jobs < 1:
        parser.error("--jobs must be >= 1")
    return args


def run_environment(cpu: bool) -> tuple[dict[str, str], list[str], str | None]:
    """(env, extra overrides, rollout name override) for a GPU run or a CPU rehearsal."""
    env = {**os.environ, "PYTHONHASHSEED": "0", "RAY_DEDUP_LOGS": "0"}
    if not cpu:
        return env, list(VLLM_KEYS), None
    harness_dir = Path(__file__).resolve().parents[1] / "tests" / "e2e"
    sys.path.insert(0, str(harness_dir))
    import harness  # the test-only CPU backend's keys and environment

    return harness.cpu_env(env), harness.CPU_KEYS, harness.ROLLOUT_NAME


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    env, extra, rollout = run_environment(args.cpu)
    # A cache or checkpoint left by an earlier invocation would be replayed instead of recorded.
    for stale in [out / "rollout_cache", *out.glob("ckpt_*")]:
        shutil.rmtree(stale, ignore_errors=True)
    inputs = write_inputs(out)
    runs = plan(inputs, out, wanted=args.checks, seed=args.seed, rollout=rollout or args.rollout, extra=extra)
    results = {name: r.metrics for name, r in run_all(runs, out, env, args.timeout, args.jobs).items()}
    (out / "metrics.json").write_text(json.dumps({k: {str(s): v for s, v in m.items()} for k, m in results.items()},
                                                 indent=1))
    checks = evaluate(results, args.checks)
    for check in checks:
        print(check.line(), flush=True)
    failed = sum(not c.ok for c in checks)
    print(f"{len(checks) - failed} passed, {failed} failed", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
