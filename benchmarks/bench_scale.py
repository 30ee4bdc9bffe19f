"""The bus on the verl driver at scale: memory and time of a method's events against verl's own driver pass, and
how the cost grows (a script, not a test).

verl's driver (the TaskRunner actor) holds no GPU and may run torch on one thread. Its batch comes out of
TransferQueue as jagged nested tensors; here ``--rows`` rows (default 16,384) with response lengths
log-uniform in [16, ``--tokens``] (default 8,192). Per method (the seed's band selection at on_rollout;
``max_variance``, which rewrites the advantages, ``advantage_reweight`` and ``top_entropy`` at on_advantage), in a
fresh process each, torch on one thread:

* ``driver_peak_memory_fields``: the peak resident memory the bus adds over the inputs (the adapter's
  :func:`~dataflex_bus.verl.tqbatch.to_batch` of the fields the method asks for, then the event), in units of
  one dense float32 ``[B, T]`` field (goal 1);
* ``driver_time_vs_verl``: its wall time over verl's own driver pass on the same jagged batch (the fields it
  reads padded, ``compute_advantage`` for GRPO and ``compute_data_metrics``; goal 1.0).

Then the cost curves (``curve_...`` JSON lines): driver time per row from 1k to 16k rows and from 512 to 8k
tokens (band selection at on_rollout), the prompt history's (and its table's) bytes per prompt at 1M prompts,
the prompt table's build time at 10M rows, and the shim's step time per row from 64 to 4,096 prompts per step
(group size 4, advantage_reweight; a run of 3 steps less a run of 1, so the set-up is not counted).

Run: ``python benchmarks/bench_scale.py [--rows 16384 --tokens 8192]`` (a few minutes; ``--quick`` for a look;
``--part driver`` or ``--part curves`` runs one half, for a machine where the whole run must be split).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from typing import Any

import torch

GROUP = 8
METHODS: dict[str, dict[str, Any]] = {
    "band@on_rollout": {"mechanism": "select", "scorer": {"name": "group_solve_rate"},
                        "actuator": {"name": "threshold_band", "params": {"low": 0.2, "high": 0.8}}},
    "max_variance@on_advantage": {"mechanism": "select", "scorer": {"name": "reward_difficulty"},
                                "actuator": {"name": "max_variance", "params": {"keep_fraction": 0.5}}},
    "advantage_reweight@on_advantage": {"mechanism": "reweight", "scorer": {"name": "token_prob"},
                                        "actuator": {"name": "advantage_reweight", "params": {"alpha": 0.5}}},
    "top_entropy@on_advantage": {"mechanism": "select", "scorer": {"name": "token_entropy"},
                                 "actuator": {"name": "top_entropy", "params": {"rho": 0.2, "form": "topk",
                                                                               "scope": "batch"}}},
}


def emit(measure: str, value: float, goal: float | None, unit: str, **extra: Any) -> None:
    print(json.dumps({"measure": measure, "value": round(value, 4), "goal": goal, "unit": unit, **extra}),
          flush=True)


# ---------------------------------------------------------------------------- verl-shaped inputs
def jagged(values: torch.Tensor, offsets: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    return torch.nested.nested_tensor_from_jagged(values, offsets=offsets, max_seqlen=int(lengths.max()),
                                                  min_seqlen=int(lengths.min()))


def verl_batch(rows: int, tokens: int, seed: int = 0, prompt: int = 256) -> tuple[Any, list[dict[str, Any]]]:
    """A GRPO batch as ``kv_batch_get`` returns it on the driver: per-token fields jagged, ``uid`` and
    ``data_source`` as lists, tags with ``is_padding``; the widest row is ``tokens`` long."""
    from tensordict import TensorDict
    from tensordict.tensorclass import NonTensorStack

    g = torch.Generator().manual_seed(seed)
    length = torch.exp(torch.empty(rows).uniform_(math.log(16), math.log(tokens + 1), generator=g)).long()
    length = length.clamp(16, tokens)
    length[0] = tokens
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(length, 0)])
    total = int(offsets[-1])
    solve = torch.rand(rows // GROUP + 1, generator=g).repeat_interleave(GROUP)[:rows]
    success = (torch.rand(rows, generator=g) < solve).float()
    rm = torch.zeros(total)
    rm[offsets[1:] - 1] = success
    adv = torch.repeat_interleave(success - 0.5, length)
    fields = {"response_mask": jagged(torch.ones(total, dtype=torch.long), offsets, length),
              "rm_scores": jagged(rm, offsets, length),
              "old_log_probs": jagged(-torch.rand(total, generator=g), offsets, length),
              "rollout_log_probs": jagged(-torch.rand(total, generator=g), offsets, length),
              "entropy": jagged(torch.rand(total, generator=g) * 3, offsets, length),
              "advantages": jagged(adv, offsets, length),
              "prompts": torch.randint(0, 151936, (rows, prompt), generator=g)}
    uids = [f"g{i // GROUP}" for i in range(rows)]
    sources = [("math", "code")[(i // GROUP) % 2] for i in range(rows)]
    td = TensorDict({**fields, "uid": NonTensorStack(*uids), "data_source": NonTensorStack(*sources)},
                    batch_size=rows)
    return td, [{"is_padding": False} for _ in range(rows)]


# ---------------------------------------------------------------------------- one measurement, in its own process
def rss() -> int:
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) * 1024 for line in fh if line.startswith("VmRSS:"))


def peak() -> int:
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) * 1024 for line in fh if line.startswith("VmHWM:"))


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")


def bus_pass(method: str, td: Any, tags: list[dict[str, Any]]) -> None:
    from dataflex_bus.host import ANY_HOST
    from dataflex_bus.runtime import Runtime
    from dataflex_bus.verl.tqbatch import to_batch

    rt = Runtime(METHODS[method], host=ANY_HOST.replace(name="verl", adv_estimator="grpo", group_size=GROUP))
    if not rt.listens(method.partition("@")[2]):
        raise SystemExit(f"bench_scale: {method} does not act at the event its name says")
    for event in ("on_rollout", "on_advantage"):
        if rt.listens(event):
            names = sorted(rt.fields(event) | {"uid", "data_source"})
            batch = to_batch(td.select(*[n for n in names if n in td.keys()]), tags)
            rt.emit(event, batch, 1)


def verl_pass(td: Any) -> None:
    """verl's driver work on the same batch: the fields its advantage and metrics read, padded as its
    DataProto holds them, GRPO's ``compute_advantage`` and ``compute_data_metrics``."""
    import numpy as np
    from tensordict import TensorDict
    from verl import DataProto
    from verl.trainer.ppo.core_algos import AdvantageEstimator
    from verl.trainer.ppo.metric_utils import compute_data_metrics
    from verl.trainer.ppo.ray_trainer import compute_advantage

    mask = td.get("response_mask").to_padded_tensor(0)
    scores = td.get("rm_scores").to_padded_tensor(0.0)
    prompts = td.get("prompts")
    rows = mask.shape[0]
    batch = TensorDict({"response_mask": mask, "token_level_scores": scores, "token_level_rewards": scores,
                        "responses": mask, "prompts": prompts,
                        "attention_mask": torch.cat([torch.ones_like(prompts), mask], dim=1)}, batch_size=rows)
    uid = np.array(td.get("uid").tolist(), dtype=object)
    data = DataProto(batch=batch, non_tensor_batch={"uid": uid})
    data = compute_advantage(data, AdvantageEstimator.GRPO)
    compute_data_metrics(data, use_critic=False)


def child(args: argparse.Namespace) -> int:
    torch.set_num_threads(1)
    td, tags = verl_batch(args.rows, args.tokens)
    import gc

    # warm imports and code paths once on a tiny batch, so the measurement holds the work, not the imports
    small, small_tags = verl_batch(64, 64, seed=1)
    bus_pass(args.one, small, small_tags) if args.one != "verl" else verl_pass(small)
    gc.collect()
    base = rss()
    reset_peak()
    start = time.perf_counter()
    bus_pass(args.one, td, tags) if args.one != "verl" else verl_pass(td)
    seconds = time.perf_counter() - start
    width = int(td.get("response_mask").offsets().diff().max())
    print(json.dumps({"seconds": seconds, "added": peak() - base, "field": args.rows * width * 4}))
    return 0


def run_child(one: str, rows: int, tokens: int) -> dict[str, float]:
    out = subprocess.run([sys.executable, __file__, "--one", one, "--rows", str(rows), "--tokens", str(tokens)],
                         capture_output=True, text=True, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return json.loads(out.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------- curves
def curves(quick: bool) -> None:
    rows_axis = [1024, 4096] if quick else [1024, 4096, 16384]
    for rows in rows_axis:
        r = run_child("band@on_rollout", rows, 2048)
        emit("curve_driver_us_per_row_by_rows", 1e6 * r["seconds"] / rows, None, "us/row", rows=rows, tokens=2048)
    for tokens in ([512, 2048] if quick else [512, 2048, 8192]):
        r = run_child("band@on_rollout", 4096, tokens)
        emit("curve_driver_us_per_row_by_tokens", 1e6 * r["seconds"] / 4096, None, "us/row", rows=4096,
             tokens=tokens)
    from dataflex_bus.history import PromptHistory, PromptTable

    n = 100_000 if quick else 1_000_000
    table = PromptTable.full(["math", "code"], [n // 2, n - n // 2], column="row")
    history = PromptHistory(table)
    held = sum(v.numel() * v.element_size() for v in (*vars(history).values(), *vars(table).values())
               if isinstance(v, torch.Tensor))
    emit("curve_history_bytes_per_prompt", held / n, None, "bytes/prompt", prompts=n)
    del history, table
    n = 1_000_000 if quick else 10_000_000
    start = time.perf_counter()
    PromptTable.full(["math", "code"], [n // 2, n - n // 2], column="row")
    emit("curve_prompt_table_build_s", time.perf_counter() - start, None, "s", rows=n)
    import tempfile

    from dataflex_bus.shim import run_training

    def shim_seconds(prompts: int, steps: int) -> float:
        cfg = {"trainer": {"steps": steps, "group_size": 4, "prompts_per_step": prompts},
               "model": {"pretrain_steps": 0}, "dataflex": METHODS["advantage_reweight@on_advantage"]}
        with tempfile.TemporaryDirectory() as out:
            start = time.perf_counter()
            run_training(cfg, out=os.path.join(out, "run"))
            return time.perf_counter() - start

    shim_seconds(64, 1)  # imports and first-call costs
    for prompts in ([64, 256] if quick else [64, 512, 4096]):
        # the difference of 3 steps and 1 step: the steps alone, without the run's set-up
        per_step = (shim_seconds(prompts, 3) - shim_seconds(prompts, 1)) / 2
        emit("curve_shim_ms_per_row", 1e3 * per_step / (prompts * 4), None, "ms/row", prompts_per_step=prompts)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=16384)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="smaller curves")
    parser.add_argument("--no-curves", action="store_true", help="the driver table only (same as --part driver)")
    parser.add_argument("--part", choices=("all", "driver", "curves"), default="all",
                        help="driver: the per-method table against verl; curves: the cost curves")
    args = parser.parse_args()
    if args.one:
        return child(args)
    if args.part == "curves":
        curves(args.quick)
        return 0
    verl = run_child("verl", args.rows, args.tokens)
    print(f"{args.rows:,} rows x up to {args.tokens:,} response tokens (log-uniform), torch on one thread; one "
          f"dense float32 [B, T] field = {verl['field'] / 2**20:,.0f} MiB")
    print(f"{'pass':<34}{'time s':>9}{'vs verl':>9}{'peak added MiB':>16}{'fields':>8}")
    print(f"{'verl compute_advantage+metrics':<34}{verl['seconds']:>9.2f}{1.0:>9.2f}{verl['added'] / 2**20:>16,.0f}"
          f"{verl['added'] / verl['field']:>8.2f}")
    for method in METHODS:
        r = run_child(method, args.rows, args.tokens)
        ratio, fields = r["seconds"] / verl["seconds"], r["added"] / r["field"]
        print(f"{method:<34}{r['seconds']:>9.2f}{ratio:>9.2f}{r['added'] / 2**20:>16,.0f}{fields:>8.2f}")
        emit("driver_peak_memory_fields", fields, 1.0, "dense float32 [B,T] fields", method=method)
        emit("driver_time_vs_verl", ratio, 1.0, "x", method=method)
    if not args.no_curves and args.part == "all":
        curves(args.quick)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
