"""Speed of the 80/20 token selection (``token_entropy`` x ``top_entropy``) at verl scale: a script printing
ratios, not a test (no timing thresholds in tests).

Shape: 16,384 rows (1,024 groups x 16 rollouts) x 2,048 response tokens, response lengths uniform in
[512, 2,048] (about 62% of the tokens valid), verl dtypes; entropies as a chain-of-thought policy gives them
(half the tokens below 0.01 nats, the rest exponential), in float32 and rounded to bf16 (ties at the cut).

The reference is the call the authors' code makes: one ``torch.topk`` over the valid tokens' entropies,
already gathered (``k = ceil(0.2 N)``). Timed against it, alternately:

* ``decision``: the selector's rule from the ``[B, T]`` entropy and mask to the ``[B, T]`` keep mask
  (``select_flat``: the fill, one ``kthvalue``, the comparisons and the exact tie break; target <= 3x);
* ``method``: the whole ``Pipeline.apply`` of the block on a fresh batch (scorer with its metrics, selector,
  the mechanism's checks, metrics and normalisation weights) and then the host kit's carry-out
  (``carry_out_advantage``: the mask multiplied into ``rollout_is_weights``): everything the bus adds to a step;
* the other forms and scopes, for information.

Run: ``python benchmarks/bench_tokens.py [--rows 16384 --group 16 --tokens 2048 --repeats 3]``.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
from bench_methods import fresh_batch, make_data, timeit_pair
from dataflex_plugins.methods.tokens import select_flat, select_rows

from dataflex_bus.carry import carry_out_advantage
from dataflex_bus.pipeline import Pipeline, build_pipeline

NAMES = ["math", "code", "logic", "science"]


def entropies(mask: torch.Tensor, seed: int = 1) -> torch.Tensor:
    """Per-token entropies shaped like a reasoning policy's: half near 0, a long tail above."""
    g = torch.Generator().manual_seed(seed)
    low = torch.rand(mask.shape, generator=g) * 0.01
    tail = torch.empty(mask.shape).exponential_(1.5, generator=g)
    return torch.where(torch.rand(mask.shape, generator=g) < 0.5, low, tail) * mask


def block(**params: object) -> dict:
    return {"mechanism": "select", "scorer": {"name": "token_entropy"},
            "actuator": {"name": "top_entropy", "params": {"rho": 0.2, **params}}}


def row(name: str, ours: Callable[[], object], ref: Callable[[], object], repeats: int) -> None:
    a, b = timeit_pair(ours, ref, repeats)
    print(f"  {name:<58} {a * 1e3:9.0f} ms   vs topk {b * 1e3:7.0f} ms   ratio {a / b:5.2f}x")


def one_dtype(data: dict[str, torch.Tensor], dtype: torch.dtype, repeats: int) -> None:
    valid = data["response_mask"].bool()
    entropy = entropies(data["response_mask"]).to(dtype)
    data["entropy"] = entropy
    gathered = entropy[valid].float()
    k = max(1, int(gathered.numel() * 0.2 + 0.9999))
    print(f"entropy {str(dtype).removeprefix('torch.')}: {int(gathered.unique().numel()):,} distinct values; "
          f"reference torch.topk(valid entropies, k={k:,})")

    def reference() -> object:
        return torch.topk(gathered, k)

    def method(pipe: Pipeline) -> Callable[[], object]:
        def run() -> object:
            batch = fresh_batch(data, NAMES)
            return carry_out_advantage(batch, pipe.apply(batch, 0))

        return run

    row("decision, topk form (exactly k, ties by position)", lambda: select_flat(entropy, valid, 0.2, "topk"),
        reference, repeats)
    if dtype == torch.float32:
        row("decision, quantile form (torch.quantile's threshold)",
            lambda: select_flat(entropy, valid, 0.2, "quantile"), reference, repeats)
        row("decision, scope sequence (row-wise topk)", lambda: select_rows(entropy, valid, 0.2, "topk"),
            reference, repeats)
    row("method: Pipeline.apply + carry_out_advantage (all_tokens)", method(build_pipeline(block())), reference,
        repeats)
    if dtype == torch.float32:
        row("method, normalize selected_tokens (weights N/K)",
            method(build_pipeline(block(normalize="selected_tokens"))), reference, repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=16384)
    parser.add_argument("--group", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    data = make_data(args.rows, args.group, args.tokens, len(NAMES))
    valid = int(data["response_mask"].sum())
    print(f"{args.rows} rows x {args.tokens} tokens, {valid:,} valid; {torch.get_num_threads()} threads")
    for dtype in (torch.float32, torch.bfloat16):
        one_dtype(data, dtype, args.repeats)


if __name__ == "__main__":
    main()
