"""Memory and time of the replay buffer the host kit keeps (a script, not a test).

Fills a :class:`~dataflex_bus.replay.ReplayStore` to capacity with rows shaped like a host's, then prints the
bytes it holds per stored response token (``ReplayStore.nbytes()``: every column, the behaviour log-probs and
the host's payload, integer columns stored in the narrowest type that holds them) and the time of one step's
insertion and retrieval (a gather of a step's worth of rows).

Two shapes:

* ``shim``: the CPU shim's rows (6-token prompts, up to 6 response tokens, int64 ids and masks, float32
  ``rm_scores``), the DOTS example's buffer (512 rows) and RePO's (131,072 rows);
* ``verl``: an LLM batch as verl keeps it in TransferQueue (``--rows`` rows of ``--prompt`` prompt and up to
  ``--tokens`` response tokens: ``input_ids``, ``position_ids``, ``prompts``, ``responses``,
  ``response_mask``, ``loss_mask``, ``attention_mask``, ``rm_scores``, ``rollout_log_probs``; token ids drawn
  from a 151,936-word vocabulary, Qwen2.5's).

Run: ``python benchmarks/bench_replay.py [--rows 4096 --prompt 1024 --tokens 2048 --vocab 151936]``.
"""

from __future__ import annotations

import argparse
import time

import torch

from dataflex_bus.history import PromptTable
from dataflex_bus.replay import Record, ReplayStore


def record(rows: int, prompt: int, tokens: int, vocab: int, prompts: int, *, group: int = 8, step: int = 0,
           seed: int = 0, verl: bool) -> Record:
    g = torch.Generator().manual_seed(seed)
    length = torch.randint(max(tokens // 4, 1), tokens + 1, (rows,), generator=g)
    mask = (torch.arange(tokens)[None, :] < length[:, None]).to(torch.long)
    responses = torch.randint(0, vocab, (rows, tokens), generator=g) * mask
    prompt_ids = torch.randint(0, vocab, (rows, prompt), generator=g)
    rm = torch.zeros(rows, tokens)
    rm[torch.arange(rows), length - 1] = (torch.rand(rows, generator=g) < 0.5).float()
    mu = -torch.rand(rows, tokens, generator=g) * mask
    payload = {"prompts": prompt_ids, "responses": responses, "response_mask": mask, "loss_mask": mask.clone(),
               "rm_scores": rm}
    lengths = {}
    if verl:
        seq = torch.cat([prompt_ids, responses], dim=1)
        payload.update(input_ids=seq, position_ids=torch.arange(prompt + tokens).expand(rows, -1).clone(),
                       attention_mask=torch.cat([torch.ones(rows, prompt, dtype=torch.long), mask], dim=1),
                       rollout_log_probs=mu.clone())
        lengths = {name: (length if name in ("responses", "response_mask", "loss_mask", "rm_scores",
                                             "rollout_log_probs") else length + prompt)
                   for name in payload if name != "prompts"}
    groups = torch.arange(rows) // group
    return Record(prompt=(groups + step * (rows // group)) % prompts, group=groups,
                  version=torch.full((rows,), step), reward=rm.sum(1), priority=rm.sum(1),
                  advantage=torch.zeros(rows), domain=torch.zeros(rows, dtype=torch.long), length=length, mu=mu,
                  payload=payload, lengths=lengths)


def measure(name: str, capacity: int, step_rows: int, prompt: int, tokens: int, vocab: int) -> None:
    prompts = max(capacity // 8, 1) * 4
    store = ReplayStore(PromptTable.full(["d"], [prompts], column="row"), capacity)
    step = 0
    while len(store) < capacity:
        store.insert(record(min(step_rows, capacity - len(store)), prompt, tokens, vocab, prompts, step=step,
                            seed=step, verl=name.startswith("verl")))
        step += 1
    occupied = store.occupied
    stored_tokens = int(store["length"][occupied].sum())
    batch = record(step_rows, prompt, tokens, vocab, prompts, step=step, seed=step, verl=name.startswith("verl"))
    start = time.perf_counter()
    store.insert(batch)
    insert_s = time.perf_counter() - start
    slots = torch.nonzero(store.occupied).flatten()[:step_rows]
    start = time.perf_counter()
    store.gather(slots)
    gather_s = time.perf_counter() - start
    total = store.nbytes()
    as_given = sum(v.numel() * v.element_size() for v in batch.payload.values()) + batch.mu.numel() * 4
    print(f"{name:>10}: {capacity:>7,} rows, {stored_tokens:>11,} response tokens stored: {total / 2**20:9.1f} MiB, "
          f"{total / stored_tokens:6.1f} bytes per stored token ({as_given / int(batch.length.sum()):6.1f} as the "
          f"host gives them); one step of {step_rows:,} rows: insert {insert_s * 1e3:7.1f} ms, "
          f"gather {gather_s * 1e3:7.1f} ms")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4096, help="verl: rows the buffer holds")
    parser.add_argument("--prompt", type=int, default=1024, help="verl: prompt tokens per row")
    parser.add_argument("--tokens", type=int, default=2048, help="verl: response tokens per row, at most")
    parser.add_argument("--vocab", type=int, default=151936, help="verl: vocabulary size (token id range)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    measure("shim DOTS", 512, 256, 5, 6, 17)
    measure("shim RePO", 131072, 512, 5, 6, 17)
    measure("verl", args.rows, max(args.rows // 4, 1), args.prompt, args.tokens, args.vocab)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
