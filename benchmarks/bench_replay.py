"""Memory and time of the replay buffer the host kit keeps, on a heavy-tailed length mix (a script, not a test).

Fills a :class:`~dataflex_bus.replay.ReplayStore` to capacity with rows shaped as verl keeps them in
TransferQueue (jagged per-token fields: ``prompts``, ``responses``, ``response_mask``, ``input_ids``,
``attention_mask``, ``position_ids``, ``rm_scores``, ``rollout_log_probs``; token ids from a 151,936-word
vocabulary, Qwen2.5's), response lengths log-uniform in [16, ``--tokens``] and prompt lengths log-uniform in
[16, ``--prompt``], then prints, per stored response token:

1. the bytes a store kept as dense columns at the widest row would hold (the layout before the packed store:
   each field ``capacity`` x the widest row seen, integers in their narrowest type, ``mu`` a column of its
   own; computed, not allocated);
2. the bytes the packed store holds (``ReplayStore.nbytes()``: columns, slot map, packed chunks);

each against the tensors' own bytes (every field over each row's own length, in the dtype verl gives it), and
the time of one step's insertion and of a gather of a step's worth of rows. The last line is the JSON
``{"measure": "replay_bytes_per_token_ratio", ...}`` (packed bytes over the tensors' own; goal 1.25).

Run: ``python benchmarks/bench_replay.py [--rows 4096 --step-rows 1024 --prompt 2048 --tokens 8192]``.
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch

from dataflex_bus.history import PromptTable
from dataflex_bus.packed import narrowest
from dataflex_bus.replay import Record, ReplayStore

GOAL = 1.25


def log_uniform(n: int, lo: int, hi: int, g: torch.Generator) -> torch.Tensor:
    return torch.exp(torch.empty(n).uniform_(math.log(lo), math.log(hi + 1), generator=g)).long().clamp(lo, hi)


def jagged(values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(lengths, 0)])
    return torch.nested.nested_tensor_from_jagged(values, offsets=offsets, max_seqlen=int(lengths.max()),
                                                  min_seqlen=int(lengths.min()))


def positions(lengths: torch.Tensor) -> torch.Tensor:
    total = int(lengths.sum())
    return torch.arange(total) - torch.repeat_interleave(torch.cumsum(lengths, 0) - lengths, lengths)


def verl_rows(rows: int, prompt: int, tokens: int, vocab: int, prompts: int, step: int, group: int = 8) -> Record:
    """``rows`` trajectories as verl's TransferQueue holds them (jagged), with ``mu`` as the kit builds it
    (dense ``[rows, widest]``, the behaviour log-probs on response tokens)."""
    g = torch.Generator().manual_seed(step)
    r_len, p_len = log_uniform(rows, 16, tokens, g), log_uniform(rows, 16, prompt, g)
    seq_len = r_len + p_len
    r_tot, p_tot = int(r_len.sum()), int(p_len.sum())
    response_ids = torch.randint(0, vocab, (r_tot,), generator=g)
    prompt_ids = torch.randint(0, vocab, (p_tot,), generator=g)
    # input_ids: each row's prompt then its response
    row_of_p = torch.repeat_interleave(torch.arange(rows), p_len)
    row_of_r = torch.repeat_interleave(torch.arange(rows), r_len)
    seq_row = torch.cat([row_of_p, row_of_r])
    seq_pos = torch.cat([positions(p_len), positions(r_len) + p_len[row_of_r]])
    order = torch.argsort(seq_row * (prompt + tokens) + seq_pos)
    input_ids = torch.cat([prompt_ids, response_ids])[order]
    log_probs = -torch.rand(r_tot, generator=g) * 3
    last = torch.cumsum(r_len, 0) - 1
    rm = torch.zeros(r_tot)
    rm[last] = (torch.rand(rows, generator=g) < 0.5).float()
    payload = {"prompts": jagged(prompt_ids, p_len), "responses": jagged(response_ids, r_len),
               "response_mask": jagged(torch.ones(r_tot, dtype=torch.long), r_len),
               "input_ids": jagged(input_ids, seq_len),
               "attention_mask": jagged(torch.ones(int(seq_len.sum()), dtype=torch.long), seq_len),
               "position_ids": jagged(positions(seq_len), seq_len), "rm_scores": jagged(rm, r_len),
               "rollout_log_probs": jagged(log_probs, r_len)}
    mu = payload["rollout_log_probs"].to_padded_tensor(0.0)
    groups = torch.arange(rows) // group
    reward = rm[last]
    return Record(prompt=(groups + step * (rows // group)) % prompts, group=groups,
                  version=torch.full((rows,), step), reward=reward, priority=reward, advantage=torch.zeros(rows),
                  domain=torch.zeros(rows, dtype=torch.long), length=r_len, mu=mu, payload=payload)


def own_bytes(record: Record) -> torch.Tensor:
    """Long ``[n]``: each row's bytes in the tensors as verl gives them (every field over the row's length)."""
    out = torch.zeros(len(record), dtype=torch.long)
    for value in record.payload.values():
        out += value.offsets().diff() * value.element_size()  # type: ignore[attr-defined]
    return out


class DenseAtWidest:
    """What the store kept as dense columns at the widest row would hold: per field the widest row seen and the
    narrowest integer type of every value, ``mu`` its own float32 column, an int32 length column per field."""

    def __init__(self, capacity: int) -> None:
        self.capacity, self.width, self.dtype, self.mu_width = capacity, {}, {}, 0

    def add(self, record: Record) -> None:
        for name, value in record.payload.items():
            self.width[name] = max(self.width.get(name, 0), int(value.offsets().diff().max()))  # type: ignore[attr-defined]
            narrow = narrowest(value.values())
            old = self.dtype.get(name, narrow)
            self.dtype[name] = max(old, narrow, key=lambda d: torch.empty((), dtype=d).element_size())
        self.mu_width = max(self.mu_width, record.mu.shape[1])

    def nbytes(self, columns: int) -> int:
        per_row = sum(w * torch.empty((), dtype=self.dtype[k]).element_size() for k, w in self.width.items())
        return self.capacity * (per_row + 4 * self.mu_width + 4 * len(self.width)) + columns


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4096, help="rows the buffer holds (its capacity)")
    parser.add_argument("--step-rows", type=int, default=1024, help="rows stored per step")
    parser.add_argument("--prompt", type=int, default=2048, help="prompt tokens per row, at most")
    parser.add_argument("--tokens", type=int, default=8192, help="response tokens per row, at most")
    parser.add_argument("--vocab", type=int, default=151936, help="vocabulary size (token id range)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    capacity = args.rows
    prompts = max(capacity // 8, 1) * 4
    store = ReplayStore(PromptTable.full(["d"], [prompts], column="row"), capacity)
    dense = DenseAtWidest(capacity)
    own: dict[int, int] = {}
    step, seq = 0, 0
    insert_s = []
    while step < 2 or len(store) < capacity:
        record = verl_rows(args.step_rows, args.prompt, args.tokens, args.vocab, prompts, step)
        dense.add(record)
        own.update(zip(range(seq, seq + len(record)), own_bytes(record).tolist()))
        seq += len(record)
        start = time.perf_counter()
        store.insert(record)
        insert_s.append(time.perf_counter() - start)
        step += 1
    occ = torch.nonzero(store.occupied).flatten()
    tokens = int(store["length"][occ].sum())
    held_own = sum(own[s] for s in store["seq"][occ].tolist())
    columns = sum(t.numel() * t.element_size() for t in store.columns.values())
    start = time.perf_counter()
    back = store.gather(occ[: args.step_rows])
    gather_s = time.perf_counter() - start
    assert len(back) == min(args.step_rows, len(occ))
    before, after = dense.nbytes(columns), store.nbytes()
    print(f"replay store: {capacity:,} rows, {tokens:,} response tokens held (lengths log-uniform in "
          f"[16, {args.tokens}], prompts in [16, {args.prompt}]); the tensors' own bytes "
          f"{held_own / 2**20:,.1f} MiB ({held_own / tokens:.1f} per response token)")
    print(f"{'layout':<22}{'MiB':>12}{'bytes/token':>14}{'vs own':>9}")
    print(f"{'dense at the widest':<22}{before / 2**20:>12,.1f}{before / tokens:>14.1f}{before / held_own:>8.2f}x")
    print(f"{'packed (this store)':<22}{after / 2**20:>12,.1f}{after / tokens:>14.1f}{after / held_own:>8.2f}x")
    print(f"one step of {args.step_rows:,} rows: insert {1e3 * sum(insert_s) / len(insert_s):.1f} ms (mean), "
          f"gather {1e3 * gather_s:.1f} ms")
    print(json.dumps({"measure": "replay_bytes_per_token_ratio_dense", "value": round(before / held_own, 3),
                      "goal": GOAL, "unit": "x"}))
    print(json.dumps({"measure": "replay_bytes_per_token_ratio", "value": round(after / held_own, 3), "goal": GOAL,
                      "unit": "x"}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
