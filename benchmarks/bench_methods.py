"""Speed of the built-in methods at a realistic GRPO batch size (a script printing ratios, not a test).

Shape: 16,384 rows (1,024 groups x 16 rollouts) x 2,048 response tokens on CPU, verl dtypes
(``response_mask`` int64, everything else float32). Three comparisons per method:

* ``decision``: our scorer-group part + actuator, starting from the per-row values the decision is
  made on (rewards ``r_i`` or scores ``s_i``, computed once beforehand), against a per-group Python
  loop of the same formula on the same per-row values. Two loops are timed: the *straightforward* one
  (for each group id, find its rows with ``uid == g``, as a first implementation does; the issue's
  target, >= 100x) and a *lean* one (rows of every group collected in one pass beforehand; reported
  for information, it is what a careful loop can reach);
* ``full``: the whole ``Pipeline.apply`` on a fresh batch (every derived value recomputed, generic
  pipeline checks included) against one streaming pass over the token tensor the method reads
  (a masked row-sum; target <= 3x, ``<= 2x`` against one ``exp`` pass for token_prob+advantage_reweight);
* components alone (scorer + actuator without the pipeline's generic checks) where that differs.

The 2026 rules (#47) follow, each at the same 16,384 rows (the warm batch's groups) or 16,384 prompts
(predictors, pre-rollout selections, allocations), timed against the nearest existing method doing the same job
(ratio = ours / theirs, information): ``--only-2026`` runs just them.

Run: ``python benchmarks/bench_methods.py [--rows 16384 --group 16 --tokens 2048 --repeats 5] [--only-2026]``.
Keep it to a couple of minutes on 2 cores: the reference loops run fewer repeats.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from dataflex_plugins.methods.select import max_variance_keep, subset_advantages

from dataflex_bus.batch import Batch
from dataflex_bus.mechanisms.weights import expand_weights
from dataflex_bus.pipeline import build_pipeline
from dataflex_bus.predictor import Predictor


def timeit(fn: Callable[[], object], repeats: int) -> float:
    """Median wall time of ``repeats`` calls (after one warm-up call)."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


@contextmanager
def single_thread() -> Iterator[None]:
    """Time millisecond-sized [B] work on one intra-op thread (both sides alike).

    On a shared 2-core machine a parallel region of a tiny op waits for a descheduled worker thread,
    turning 3 ms into 100+ ms at random; one thread measures the work itself.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def timeit_pair(ours: Callable[[], object], ref: Callable[[], object], repeats: int) -> tuple[float, float]:
    """Medians of ``ours`` and ``ref`` timed alternately, so drifting machine load hits both alike."""
    ours(), ref()
    a, b = [], []
    for _ in range(repeats):
        for fn, out in ((ours, a), (ref, b)):
            start = time.perf_counter()
            fn()
            out.append(time.perf_counter() - start)
    return statistics.median(a), statistics.median(b)


def make_data(rows: int, group: int, tokens: int, domains: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    groups = rows // group
    lengths = torch.randint(tokens // 4, tokens + 1, (rows,), generator=g)
    mask = (torch.arange(tokens)[None, :] < lengths[:, None]).to(torch.long)
    p_solve = torch.rand(groups, generator=g).repeat_interleave(group)
    reward = (torch.rand(rows, generator=g) < p_solve).to(torch.float32)
    rm = torch.zeros(rows, tokens)
    rm[torch.arange(rows), lengths - 1] = reward
    uid = torch.arange(groups).repeat_interleave(group)
    r = reward.view(groups, group)
    adv_row = ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-6)).flatten()
    advantages = adv_row[:, None] * mask
    old_log_probs = -2.0 * torch.rand(rows, tokens, generator=g) * mask
    dom = torch.randint(0, domains, (groups,), generator=g).repeat_interleave(group)
    return {"uid": uid, "domains": dom, "rm_scores": rm, "response_mask": mask,
            "advantages": advantages, "old_log_probs": old_log_probs}


def fresh_batch(data: dict[str, torch.Tensor], names: list[str]) -> Batch:
    fields = {k: v for k, v in data.items() if k not in ("uid", "domains")}
    return Batch.from_tensors(uid=data["uid"], domains=data["domains"], domain_names=names, **fields)


# ------------------------------------------------------------------ per-group loop references
def lean_groups(uid: torch.Tensor) -> list[list[int]]:
    """Rows of every group, collected in one pass (the careful loop)."""
    rows: dict[int, list[int]] = defaultdict(list)
    for i, u in enumerate(uid.tolist()):
        rows[u].append(i)
    return list(rows.values())


def scanned_groups(uid: torch.Tensor) -> Iterator[torch.Tensor]:
    """Rows of each group found by comparing every uid with the group id (the straightforward loop)."""
    for g in torch.unique(uid).tolist():
        yield torch.nonzero(uid == g).flatten()


def ref_band(rewards: torch.Tensor, groups, low: float = 0.2, high: float = 0.8) -> torch.Tensor:
    keep = torch.zeros(rewards.shape[0], dtype=torch.bool)
    for idx in groups:
        r = rewards[idx]
        k, n = int((r > 0.5).sum().item()), len(idx)
        if low * n - 1e-9 * n <= k <= high * n + 1e-9 * n:
            keep[idx] = True
    return keep


def ref_dapo(rewards: torch.Tensor, groups) -> torch.Tensor:
    keep = torch.zeros(rewards.shape[0], dtype=torch.bool)
    for idx in groups:
        r = rewards[idx]
        if len(idx) == 1 or r.min().item() != r.max().item():
            keep[idx] = True
    return keep


def ref_max_variance(rewards: torch.Tensor, groups, frac: float = 0.5,
                     eps: float = 1e-4) -> tuple[torch.Tensor, torch.Tensor]:
    """Per group: scan a = 0, m..1 with strict improvement, then subset GRPO advantages (per row)."""
    keep = torch.zeros(rewards.shape[0], dtype=torch.bool)
    adv = torch.zeros(rewards.shape[0], dtype=torch.float32)
    for idx in groups:
        idx_t = torch.as_tensor(idx)
        r = rewards[idx_t].double()
        order = torch.sort(r, stable=True).indices
        n = len(idx)
        m = min(max(math.floor(frac * n + 0.5), 1), n)
        best, best_sel = -1.0, None
        for a in [0, *range(m, 0, -1)]:
            sel = torch.cat([order[:a], order[n - (m - a):]])
            var = r[sel].var().item() if m > 1 else 0.0
            if var > best:
                best, best_sel = var, sel
        rows = idx_t[best_sel]
        rs = rewards[rows].double()
        mean, std = (rs.mean(), rs.std()) if m > 1 else (0.0, 1.0)
        keep[rows] = True
        adv[rows] = ((rs - mean) / (std + eps)).float()
    return keep, adv


def ref_topk(scores: torch.Tensor, frac: float = 0.5) -> torch.Tensor:
    s = scores.tolist()
    n = len(s)
    order = sorted(range(n), key=lambda i: (-s[i], i))
    k = min(max(math.floor(frac * n + 0.5), 1), n)
    keep = torch.zeros(n, dtype=torch.bool)
    keep[order[:k]] = True
    return keep


def straightforward_weights(w: torch.Tensor, batch: Batch) -> tuple[torch.Tensor, tuple[float, ...]]:
    """Check, summarise and expand token weights the obvious way: through ``w[token_mask]``."""
    tm = batch.token_mask
    real = w[tm]
    if not bool(torch.isfinite(real).all()) or bool((real < 0).any()):
        raise ValueError("bad weights")
    r = real.double()
    return torch.where(tm, w, 1.0), (float(r.sum()), float((r * r).sum()), float(r.max()), float(r.min()))


def bench_2026(warm: Batch, n: int, repeats: int) -> list[tuple[str, str, float, float, float, str]]:
    """The 2026 rules (#47) at ``n`` rows (the warm batch's groups) or ``n`` prompts (predictors, pre-rollout
    selections and allocations), each against the nearest existing method doing the same job (information)."""
    from dataflex_plugins.methods.allocate import Knapsack
    from dataflex_plugins.methods.mopps import Mopps, TopB
    from dataflex_plugins.methods.pilot_commit import ExcludeSolved
    from dataflex_plugins.methods.predictors import Cures, Dps, Vip
    from dataflex_plugins.methods.rules2026 import (
        Learnability,
        NoPositiveResampling,
        RewardVariance,
        Sec,
        SnrFilter,
        VarianceSplit,
    )

    from dataflex_bus.components import Budget, Score
    from dataflex_bus.predictor import Observation
    from dataflex_bus.visits import Visits

    out: list[tuple[str, str, float, float, float, str]] = []

    def pair(method: str, what: str, ours: Callable[[], object], ref: Callable[[], object]) -> None:
        with single_thread():
            a, b = timeit(ours, repeats), timeit(ref, repeats)
        out.append((method, what, a, b, a / b, "info"))

    # after generation, on the warm batch's groups
    dapo = build_pipeline({"mechanism": "select", "scorer": {"name": "reward_difficulty"},
                           "actuator": {"name": "dapo"}})
    snr, variance = SnrFilter(rho=0.9), RewardVariance()
    pair("reward_variance+snr_filter", "score+select / dapo's", lambda: snr.select(warm, variance.score(warm, 0), 0),
         lambda: dapo.actuator.select(warm, dapo.scorer.score(warm, 0), 0))
    band = build_pipeline({"mechanism": "select", "scorer": {"name": "group_solve_rate"},
                           "actuator": {"name": "threshold_band", "params": {"low": 0.2, "high": 0.8}}})
    learn = Learnability(fraction=0.5)
    pair("group_solve_rate+learnability", "score+select / threshold_band's",
         lambda: learn.select(warm, band.scorer.score(warm, 0), 0),
         lambda: band.actuator.select(warm, band.scorer.score(warm, 0), 0))
    domains = list(warm.domain_names)
    adv = build_pipeline({"mechanism": "mix", "scorer": {"name": "advantage_magnitude"},
                          "actuator": {"name": "dump_ucb"}})
    adv.set_domains(domains)
    sec = Sec()
    sec.set_domains(domains)
    mix_score = adv.scorer.score(warm, 0)
    pair("advantage_magnitude+sec", "update+probabilities / dump_ucb's",
         lambda: (sec.update(warm, mix_score, 0), sec.probabilities()),
         lambda: (adv.actuator.update(warm, mix_score, 0), adv.actuator.probabilities()))

    # before generation: n candidates
    g = torch.Generator().manual_seed(3)
    cand = Batch.from_tensors(uid=torch.arange(n), is_padding=torch.zeros(n, dtype=torch.bool),
                              prompt_index=torch.arange(n), budget_prompts=torch.tensor(n // 4))
    rate = Score(torch.rand(n, generator=g, dtype=torch.float64), "prompt")
    npr, excl, top_b = NoPositiveResampling(), ExcludeSolved(exclude_threshold=0.9), TopB()
    pair("max_solve_rate+no_positive_resampling", "select / exclude_solved's", lambda: npr.select(cand, rate, 0),
         lambda: excl.select(cand, rate, 0))
    pair("predicted+learnability (pre-rollout)", "select / top_b's", lambda: learn.select(cand, rate, 0),
         lambda: top_b.select(cand, rate, 0))
    budget = Budget(rollouts=8 * n, prompts=n, group_size=8)
    split, knap = VarianceSplit(min_n=2, max_n=32), Knapsack(min_n=2, max_n=32)
    pair("predicted+variance_split", "allocate / knapsack's greedy", lambda: split.allocate(cand, rate, 0, budget),
         lambda: knap.allocate(cand, rate, 0, budget))

    # predictors: observe n groups, end the step, predict n prompts; against MoPPS's posterior update + draw
    prompt, size = torch.arange(n), torch.full((n,), 8)
    successes = torch.randint(0, 9, (n,), generator=g)
    mopps, state = Mopps(), torch.ones(n, 2, dtype=torch.float64)

    def mopps_step() -> None:
        new = mopps.update_prompt_state(state, Visits(prompt, size, successes, 0))
        mopps.draw(new[:, 0], new[:, 1])

    for cls in (Dps, Cures, Vip):
        predictor = cls()
        predictor.bind(n)

        def step(predictor: Predictor = predictor) -> None:
            predictor.observe(Observation(prompt, size, successes, 0))
            predictor.end_step(0)
            predictor.predict(prompt, 1)

        pair(f"predictor {cls.__name__.lower()}", "observe+end_step+predict / mopps update+draw", step, mopps_step)
    return out


# ------------------------------------------------------------------ benchmark
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=16384)
    parser.add_argument("--group", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--domains", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--ref-repeats", type=int, default=1)
    parser.add_argument("--only-2026", action="store_true", help="only the 2026 rules (#47) against their nearest")
    args = parser.parse_args()
    torch.manual_seed(0)
    names = [f"d{i}" for i in range(args.domains)]
    data = make_data(args.rows, args.group, args.tokens, args.domains)
    rep, ref_rep = args.repeats, args.ref_repeats
    print(f"rows={args.rows} groups={args.rows // args.group} tokens={args.tokens} threads={torch.get_num_threads()}"
          f" repeats={rep} (reference loops: {ref_rep})")

    rm, mask, adv, lp = data["rm_scores"], data["response_mask"], data["advantages"], data["old_log_probs"]
    rows: list[tuple[str, str, float, float, float, str]] = []

    def record(method: str, what: str, ours: float, ref: float, target: float, higher_is_better: bool) -> None:
        ratio = ref / ours if higher_is_better else ours / ref
        ok = ratio >= target if higher_is_better else ratio <= target
        sign = ">=" if higher_is_better else "<="
        rows.append((method, what, ours, ref, ratio, f"{'PASS' if ok else 'FAIL'} ({sign}{target:g}x)"))

    warm = fresh_batch(data, names)
    _ = warm.rewards, warm.token_mask, warm.lengths, warm.group_sizes, warm.domain_index
    rewards, gi, ng = warm.rewards, warm.group_index, warm.num_groups
    drep = max(rep, 15)  # decision parts are milliseconds: more repeats, same wall time
    if args.only_2026:
        return report(bench_2026(warm, args.rows, drep))

    def ours_max_variance() -> tuple[torch.Tensor, torch.Tensor]:
        keep = max_variance_keep(rewards, gi, ng, 0.5)
        return keep, subset_advantages(rewards, gi, ng, keep, 1e-4)

    selects = [
        ("group_solve_rate+threshold_band", {"name": "group_solve_rate", "params": {"success_threshold": 0.5}},
         {"name": "threshold_band", "params": {"low": 0.2, "high": 0.8}},
         lambda groups: ref_band(rewards, groups), None),
        ("reward_difficulty+dapo", {"name": "reward_difficulty"}, {"name": "dapo"},
         lambda groups: ref_dapo(rewards, groups), None),
        ("reward_difficulty+max_variance", {"name": "reward_difficulty"},
         {"name": "max_variance", "params": {"keep_fraction": 0.5}},
         lambda groups: ref_max_variance(rewards, groups), ours_max_variance),
        ("advantage_magnitude+topk_fraction", {"name": "advantage_magnitude", "params": {"agg": "mean"}},
         {"name": "topk_fraction", "params": {"fraction": 0.5}}, None, None),
    ]
    for label, scorer, actuator, reference, decision in selects:
        pipe = build_pipeline({"mechanism": "select", "scorer": scorer, "actuator": actuator})
        score = pipe.scorer.score(warm, 0)
        if reference is None:
            # Top-k ranks all rows at once (no groups): one sort against Python's sort, for information.
            scores = score.values
            decision = lambda pipe=pipe, score=score: pipe.actuator.select(warm, score, 0)  # noqa: E731
            with single_thread():
                ours = timeit(decision, drep)
                ref = timeit(lambda scores=scores: ref_topk(scores), 3 * ref_rep)
            agree = bool(torch.equal(decision().keep, ref_topk(scores)))
            rows.append((label + ("" if agree else " [DISAGREES]"), "decision vs Python sort (not group-level)",
                         ours, ref, ref / ours, "info"))
            stream_fn = lambda: (adv * mask).sum(-1)  # noqa: E731
        else:
            decision = decision or (lambda pipe=pipe: pipe.actuator.select(warm, pipe.scorer.score(warm, 0), 0))
            stream_fn = lambda: (rm * mask).sum(-1)  # noqa: E731
            lean = lean_groups(data["uid"])
            # The max_variance loops take seconds: one repeat; the others are cheap enough for three.
            ref_n = ref_rep if "max_variance" in label else 3 * ref_rep
            with single_thread():
                ours = timeit(decision, drep)
                straight = timeit(lambda reference=reference: reference(scanned_groups(data["uid"])), ref_n)
                careful = timeit(lambda reference=reference, lean=lean: reference(lean), ref_n)
            # Same decision as the reference (a sanity check, not timing).
            out = reference(lean)
            ref_keep = out[0] if isinstance(out, tuple) else out
            agree = bool(torch.equal(pipe.actuator.select(warm, score, 0).keep, ref_keep))
            label_checked = label + ("" if agree else " [DISAGREES]")
            record(label_checked, "decision vs straightforward loop", ours, straight, 100, True)
            rows.append((label_checked, "decision vs lean loop (information)", ours, careful, careful / ours,
                         "info"))
        full, stream = timeit_pair(lambda pipe=pipe: pipe.apply(fresh_batch(data, names), 0), stream_fn, rep)
        record(label, "full pipeline vs 1 masked row-sum", full, stream, 3, False)

    # token_prob + advantage_reweight
    pipe = build_pipeline({"mechanism": "reweight", "scorer": {"name": "token_prob"},
                           "actuator": {"name": "advantage_reweight", "params": {"alpha": 0.3}}})

    def components() -> None:
        b = fresh_batch(data, names)
        pipe.actuator.reweight(b, pipe.scorer.score(b, 0), 0)

    full, exp_pass = timeit_pair(lambda: pipe.apply(fresh_batch(data, names), 0), lambda: lp.exp(), rep)
    record("token_prob+advantage_reweight", "full pipeline vs 1 exp pass", full, exp_pass, 2, False)
    alone, exp_pass = timeit_pair(components, lambda: lp.exp(), rep)
    record("token_prob+advantage_reweight", "components alone vs 1 exp pass", alone, exp_pass, 2, False)
    # Why weights.expand_weights fills non-real tokens instead of indexing w[token_mask]: the one-pass form
    # against the straightforward check-and-summarise on a boolean-indexed copy (same outputs).
    wb = fresh_batch(data, names)
    w_tok = torch.rand(wb.token_mask.shape, generator=torch.Generator().manual_seed(1))
    ours_w, straight_w = timeit_pair(lambda: expand_weights(w_tok, wb, "bench"),
                                     lambda: straightforward_weights(w_tok, wb), rep)
    rows.append(("weights.expand_weights [B, T]", "one pass vs boolean-indexed copy", ours_w, straight_w,
                 straight_w / ours_w, "info"))

    # dump_ucb: one update (+ probabilities) from the per-row scores, and the whole step.
    pipe = build_pipeline({"mechanism": "mix", "scorer": {"name": "advantage_magnitude", "params": {"agg": "mean"}},
                           "actuator": {"name": "dump_ucb", "params": {"c": 1.0, "window": 300,
                                                                       "temperature": 0.1}}})
    pipe.set_domains(names)
    score = pipe.scorer.score(warm, 0)
    mixer = pipe.actuator

    def update() -> None:
        mixer.update(warm, score, 0)
        mixer.probabilities()

    with single_thread():
        upd = timeit(update, drep)
    rows.append(("advantage_magnitude+dump_ucb", "update+probabilities alone", upd, float("nan"), float("nan"),
                 "info"))
    full, stream = timeit_pair(lambda: pipe.apply(fresh_batch(data, names), 0), lambda: (adv * mask).sum(-1), rep)
    record("advantage_magnitude+dump_ucb", "full pipeline vs 1 masked row-sum", full, stream, 3, False)

    rows.extend(bench_2026(warm, args.rows, drep))
    return report(rows)


def report(rows: list[tuple[str, str, float, float, float, str]]) -> int:
    """Print the table of ``rows``."""
    print()
    header = f"{'method':42s} {'comparison':36s} {'ours ms':>9s} {'ref ms':>10s} {'ratio':>8s}  verdict"
    print(header)
    print("-" * len(header))
    for method, what, ours, ref, ratio, verdict in rows:
        print(f"{method:42s} {what:36s} {ours * 1e3:9.2f} {ref * 1e3:10.2f} {ratio:8.2f}  {verdict}")
    failed = sum(1 for r in rows if r[5].startswith("FAIL"))
    print(f"\n{failed} target(s) missed" if failed else "\nall targets met")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
