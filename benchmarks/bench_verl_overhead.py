"""Per-step driver work of the verl adapter against TransferQueue's own get+put of the same fields.

Target (issue 15, item 7): with a real local TransferQueue at 4,096 rows x 4,096 tokens, the adapter's
work at the three events (fetch from TransferQueue, build the batch, run the method, carry the decision
out, write back) costs at most 1.5x the bare TransferQueue calls it makes: ``kv_batch_get`` of the same
fields and keys, ``kv_batch_put`` of the same written fields, ``kv_clear`` of the same removed keys.
The ratio is the price of everything the adapter adds on top of moving the data. Prints ratios; no
thresholds in tests.

The adapter runs as in verl (``DataflexSyncTrainer._on_rollout``, ``_on_advantage`` and the
``on_step_end`` emit), minus verl's own work around it (padding, log-probs, advantages). Between
repetitions the batch is written back as it was (untimed), so every repetition does the same work.

    python benchmarks/bench_verl_overhead.py                     # 4,096 x 4,096, three methods
    python benchmarks/bench_verl_overhead.py --rows 512 --tokens 512 --repeat 2   # a quick look
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

#: method -> its dataflex block (the seed's on_rollout band, a row selection and a token reweighting
#: at on_advantage).
METHODS: dict[str, dict[str, Any]] = {
    "select@on_rollout": {"mechanism": "select", "scorer": {"name": "group_solve_rate"},
                          "actuator": {"name": "threshold_band", "params": {"low": 0.2, "high": 0.8}}},
    "select@on_advantage": {"mechanism": "select", "scorer": {"name": "advantage_magnitude"},
                            "actuator": {"name": "topk_fraction", "params": {"fraction": 0.5}}},
    "reweight@on_advantage": {"mechanism": "reweight", "scorer": {"name": "token_prob"},
                              "actuator": {"name": "advantage_reweight", "params": {"alpha": 0.5}}},
}
PARTITION = "bench"


def make_rows(rows: int, tokens: int, n: int, seed: int = 0) -> tuple[list[str], list[dict[str, Any]]]:
    """Keys and per-row fields of a GRPO batch as verl holds it after the advantage step."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(tokens // 2, tokens + 1, (rows,), generator=g)
    lengths[0] = tokens  # the widest row sets the padded width
    solve = torch.rand(rows // n, generator=g)  # per-group success rate: some groups in the band, some not
    success = (torch.rand(rows, generator=g) < solve.repeat_interleave(n)).float()
    keys, fields = [], []
    for i, length in enumerate(lengths.tolist()):
        group, session = divmod(i, n)
        uid = f"g{group:05d}"
        rm = torch.zeros(length)
        rm[-1] = success[i]
        mask = torch.ones(length, dtype=torch.int64)
        keys.append(f"{uid}_{session}_0")
        fields.append({
            "uid": uid, "data_source": ("math", "code")[group % 2],
            "response_mask": mask, "loss_mask": mask.clone(), "rm_scores": rm,
            "advantages": torch.full((length,), float(success[i] - 0.5)),
            "old_log_probs": -torch.rand(length, generator=g),
        })
    return keys, fields


def write(tq: Any, keys: list[str], fields: list[dict[str, Any]], chunk: int = 512) -> None:
    from verl.utils.tensordict_utils import list_of_dict_to_tensordict

    for start in range(0, len(keys), chunk):
        part = slice(start, start + chunk)
        tags = [{"status": "success", "seq_len": int(f["response_mask"].numel()), "global_steps": 1}
                for f in fields[part]]
        tq.kv_batch_put(keys=keys[part], partition_id=PARTITION, fields=list_of_dict_to_tensordict(fields[part]),
                        tags=tags)


def trainer_for(block: dict[str, Any], n: int, mini: int) -> Any:
    """The adapter as verl runs it, without verl's GPU set-up (the attributes its hooks read)."""
    from omegaconf import OmegaConf

    from dataflex_bus.host import ANY_HOST
    from dataflex_bus.runtime import Runtime
    from dataflex_bus.steps import StepKit
    from dataflex_bus.verl.trainer import DataflexSyncTrainer

    t = object.__new__(DataflexSyncTrainer)
    t.config = OmegaConf.create({
        "actor_rollout_ref": {"actor": {"ppo_mini_batch_size": mini, "shuffle": False, "ppo_epochs": 1,
                                        "data_loader_seed": 42}, "rollout": {"n": n}},
        "trainer": {"critic_warmup": 0}})
    t.dataflex = Runtime(block, host=ANY_HOST.replace(name="verl", adv_estimator="grpo", group_size=n))
    t.kit, t._step = StepKit(t.dataflex), None
    t.domain_key = "data_source"
    t.global_steps, t._skip_update, t._empty_blocks_seen, t._rewards = 1, False, 0, {}
    t.use_critic = False
    t.actor_rollout_wg = type("WorkerGroup", (), {"_dispatch_info": {"actor": [0]}})()
    return t


def timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def bench_method(tq: Any, name: str, keys: list[str], fields: list[dict[str, Any]], n: int, mini: int,
                 repeat: int) -> dict[str, tuple[float, float]]:
    """{event: (adapter seconds, bare TransferQueue seconds)}, medians over ``repeat``."""
    from tensordict import TensorDict
    from transfer_queue import KVBatchMeta

    from dataflex_bus.verl import trainer as adapter

    t = trainer_for(METHODS[name], n, mini)
    tags = [{"status": "success", "seq_len": int(f["response_mask"].numel())} for f in fields]
    meta = KVBatchMeta(partition_id=PARTITION, keys=list(keys), tags=tags, fields=None, extra_info={})
    # What the adapter reads, writes and clears, recorded on one untimed run.
    calls: dict[str, list[tuple[str, Any]]] = {event: [] for event in ("on_rollout", "on_advantage", "on_step_end")}
    now = {"event": ""}
    real = (adapter.fetch, adapter.put, adapter.tq.kv_clear)

    def rec_fetch(m, f):
        calls[now["event"]].append(("get", (list(m.keys), sorted(set(f)))))
        return real[0](m, f)

    def rec_put(m, f):
        calls[now["event"]].append(("put", (list(m.keys), TensorDict(dict(f), batch_size=len(m.keys)))))
        return real[1](m, f)

    def rec_clear(keys, partition_id):
        calls[now["event"]].append(("clear", list(keys)))
        return real[2](keys=keys, partition_id=partition_id)

    steps = {
        "on_rollout": lambda: t._on_rollout(meta),
        "on_advantage": lambda: t._on_advantage(meta),
        "on_step_end": lambda: t._end_step(meta),
    }
    adapter.fetch, adapter.put = rec_fetch, rec_put
    adapter.tq.kv_clear = rec_clear
    try:
        for event, step in steps.items():
            now["event"] = event
            step()
            write(tq, keys, fields)
    finally:
        adapter.fetch, adapter.put = real[0], real[1]
        adapter.tq.kv_clear = real[2]

    def bare(event: str) -> Callable[[], None]:
        def run() -> None:
            for kind, arg in calls[event]:
                if kind == "get":
                    tq.kv_batch_get(keys=arg[0], partition_id=PARTITION, select_fields=arg[1])
                elif kind == "put":
                    tq.kv_batch_put(keys=arg[0], partition_id=PARTITION, fields=arg[1])
                else:
                    tq.kv_clear(keys=arg, partition_id=PARTITION)
        return run

    out = {}
    for event, step in steps.items():
        if not calls[event]:  # the adapter skips an event nobody listens to: nothing to compare
            continue
        ours, theirs = [], []
        for _ in range(repeat):
            ours.append(timed(step))
            write(tq, keys, fields)
            theirs.append(timed(bare(event)))
            write(tq, keys, fields)
        out[event] = (statistics.median(ours), statistics.median(theirs))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--tokens", type=int, default=4096, help="longest response (lengths in [tokens/2, tokens])")
    parser.add_argument("--n", type=int, default=8, help="responses per prompt")
    parser.add_argument("--mini", type=int, default=64, help="ppo_mini_batch_size (prompts)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--cpus", type=int, default=4, help="logical Ray CPUs (TQ needs one per unit + 1)")
    args = parser.parse_args()

    import logging

    import ray
    import transfer_queue as tq
    from omegaconf import OmegaConf

    logging.getLogger("transfer_queue").setLevel(logging.ERROR)  # per-call thread-count notices

    import dataflex_bus.verl.trainer  # noqa: F401  (imports verl, registers the modes)

    ray.init(num_cpus=args.cpus, include_dashboard=False, log_to_driver=False)
    tq.init(OmegaConf.create({"backend": {"SimpleStorage": {"num_data_storage_units": 1}}}))
    try:
        keys, fields = make_rows(args.rows, args.tokens, args.n)
        write(tq, keys, fields)
        print(f"{args.rows} rows x up to {args.tokens} tokens, n={args.n}, mini-batch {args.mini * args.n} rows, "
              f"torch threads {torch.get_num_threads()}, median of {args.repeat}")
        print(f"{'method':<24}{'event':<14}{'adapter (s)':>12}{'bare TQ (s)':>12}{'ratio':>8}")
        worst = 0.0
        for name in args.methods:
            results = bench_method(tq, name, keys, fields, args.n, args.mini, args.repeat)
            for event, (ours, theirs) in results.items():
                ratio = ours / theirs if theirs else float("inf")
                print(f"{name:<24}{event:<14}{ours:>12.3f}{theirs:>12.3f}{ratio:>8.2f}")
            ours = sum(r[0] for r in results.values())
            theirs = sum(r[1] for r in results.values())
            ratio = ours / theirs
            worst = max(worst, ratio)
            print(f"{name:<24}{'per step':<14}{ours:>12.3f}{theirs:>12.3f}{ratio:>8.2f}  "
                  f"{'PASS' if ratio <= 1.5 else 'FAIL'} (target <= 1.5x)")
        print(f"worst per-step ratio {worst:.2f} -> {'PASS' if worst <= 1.5 else 'FAIL'}")
    finally:
        tq.close()
        ray.shutdown()


if __name__ == "__main__":
    main()
