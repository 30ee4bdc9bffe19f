"""The replay store keeps rows packed by their tokens (dataflex_bus/packed.py, replay_chunks.py): what goes in
comes back exactly (ragged lengths, empty rows, scalars, masks and positions derived, ``mu`` shared with
``rollout_log_probs``), through evictions, chunk rewrites and merges, and a store saved and restored mid-run
goes on as the uninterrupted one does."""

from __future__ import annotations

import pytest
import torch

from dataflex_bus import replay_store
from dataflex_bus.history import PromptTable
from dataflex_bus.packed import cat, pack, take, to_dense
from dataflex_bus.replay import Record, ReplayStore

PROMPTS = 40


def rows(n: int, seed: int, *, width: int = 12, twin: bool = True) -> Record:
    """``n`` verl-like rows of ragged lengths (some empty), ``mu`` equal to ``rollout_log_probs`` when ``twin``."""
    g = torch.Generator().manual_seed(seed)
    length = torch.randint(0, width + 1, (n,), generator=g)
    length[0] = 0
    mask = torch.arange(width)[None, :] < length[:, None]
    ids = torch.randint(0, 151936, (n, width), generator=g) * mask
    mu = -torch.rand(n, width, generator=g) * mask
    payload = {"responses": ids, "response_mask": mask.to(torch.long), "attention_mask": mask.clone(),
               "position_ids": torch.arange(width).expand(n, -1) * mask,
               "rollout_log_probs": mu.clone() if twin else (mu * 2),
               "rm_scores": torch.rand(n, width, generator=g) * mask,
               "score": torch.randint(-3, 3, (n,), generator=g)}
    lengths = {k: length for k in ("responses", "response_mask", "attention_mask", "rollout_log_probs", "rm_scores")}
    groups = torch.arange(n) // 2
    return Record(prompt=torch.randint(0, PROMPTS, (n,), generator=g), group=groups,
                  version=torch.full((n,), seed), reward=torch.rand(n, generator=g),
                  priority=torch.rand(n, generator=g),
                  advantage=torch.zeros(n), domain=torch.zeros(n, dtype=torch.long), length=length, mu=mu,
                  payload=payload, lengths=lengths, objects=[{"seed": seed, "row": i} for i in range(n)])


def fresh(capacity: int = 48, per_prompt: int = 0) -> ReplayStore:
    return ReplayStore(PromptTable.full(["d"], [PROMPTS], column="row"), capacity, per_prompt=per_prompt)


def test_pack_round_trips_ragged_rows_and_derives_masks_and_positions():
    r = rows(9, 1)
    for name, dense in r.payload.items():
        if dense.dim() < 2:
            continue
        p = pack(dense, r.lengths.get(name))
        assert torch.equal(to_dense(p), dense), name
        if name in ("response_mask", "attention_mask"):
            assert p.derived == "ones" and p.values is None
        if name == "position_ids":
            assert p.derived == "positions" and p.values is None
        picked = torch.tensor([4, 0, 4, 2])
        assert torch.equal(to_dense(take(p, picked)), dense[picked]), name
    assert pack(r.payload["responses"]).values.dtype == torch.int32  # ids under 2**31: 4 bytes, not 8
    a, b = pack(r.payload["responses"][:3]), pack(torch.zeros(2, 0, dtype=torch.long))
    assert torch.equal(to_dense(cat([a, b]), 12), torch.cat([r.payload["responses"][:3], torch.zeros(2, 12,
                                                                                                         dtype=torch.long)]))


def assert_same(back: Record, put: Record, order: torch.Tensor) -> None:
    for name, value in put.payload.items():
        got = back.payload[name]
        assert got.dtype == value.dtype, name
        want = value[order]
        if want.dim() == 2:
            want = torch.cat([want, want.new_zeros(want.shape[0], got.shape[1] - want.shape[1])], 1)
        assert torch.equal(got, want), name
    for name, value in put.lengths.items():
        assert torch.equal(back.lengths[name], value[order]), name
    mu = put.mu[order]
    assert torch.equal(back.mu, torch.cat([mu, mu.new_zeros(mu.shape[0], back.mu.shape[1] - mu.shape[1])], 1))
    assert back.objects == [put.objects[i] for i in order.tolist()]


@pytest.mark.parametrize("twin", [True, False], ids=["mu-is-rollout_log_probs", "mu-apart"])
def test_the_store_hands_back_exactly_what_was_put_in(twin):
    store = fresh()
    put = rows(10, 3, twin=twin)
    store.insert(put)
    (chunk,) = store.chunks.values()
    assert (chunk.mu is None) == twin and chunk.mu_alias == ("rollout_log_probs" if twin else "")
    slots = torch.nonzero(store.occupied).flatten()
    back = store.gather(slots.flip(0))
    assert_same(back, put, torch.arange(10).flip(0))
    empty = store.gather(torch.zeros(0, dtype=torch.long))
    assert len(empty) == 0 and empty.payload["responses"].shape[0] == 0


def content(store: ReplayStore) -> dict[int, tuple]:
    """Every stored row by its insertion number: its columns, payload, lengths, mu, object (widths trimmed)."""
    occ = torch.nonzero(store.occupied).flatten()
    back = store.gather(occ)
    out = {}
    for i, seq in enumerate(back.seq.tolist()):
        n = int(back.length[i])
        out[seq] = (int(back.prompt[i]), int(back.group[i]), float(back.reward[i]),
                    {k: (v[i, :n].tolist() if v.dim() == 2 else int(v[i])) for k, v in back.payload.items()},
                    {k: int(v[i]) for k, v in back.lengths.items()}, back.mu[i, :n].tolist(), back.objects[i])
    return out


def run(store: ReplayStore, steps: range) -> list[dict]:
    seen = []
    for step in steps:
        store.insert(rows(6 + step % 5, step, width=4 + 3 * (step % 4), twin=step % 3 != 0))
        if step % 4 == 1:
            store.evict_stale(step, 3)
        if step % 5 == 2:
            store.dedup()
        seen.append(content(store))
    return seen


def reference(steps: range) -> dict[int, tuple]:
    """What every row put in by ``steps`` is, by insertion number (no store involved)."""
    out, seq = {}, 0
    for step in steps:
        r = rows(6 + step % 5, step, width=4 + 3 * (step % 4), twin=step % 3 != 0)
        for i in range(len(r)):
            n = int(r.length[i])
            out[seq] = ({k: (v[i, :n].tolist() if v.dim() == 2 else int(v[i])) for k, v in r.payload.items()},
                        {k: int(v[i]) for k, v in r.lengths.items()}, r.mu[i, :n].tolist(), r.objects[i])
            seq += 1
    return out


def test_rows_survive_evictions_chunk_rewrites_and_merges(monkeypatch):
    monkeypatch.setattr(replay_store, "MAX_CHUNKS", 3)
    store = fresh(capacity=40, per_prompt=3)
    seen = run(store, range(30))
    want = reference(range(30))
    for held in seen:
        for seq, (_, _, _, payload, lengths, mu, obj) in held.items():
            assert (payload, lengths, mu, obj) == want[seq]
    assert len(store.chunks) <= 3 + 1
    # Sized by the tokens held: the packed rows take at most 1.25x the bytes of their own values as given.
    occ = torch.nonzero(store.occupied).flatten()
    back = store.gather(occ)
    # (their own bytes: each per-token field over the row's tokens, as given: int64 ids, mask and positions,
    # bool mask, float32 log-probs, scores and mu)
    given = int(back.lengths["responses"].sum()) * (8 + 8 + 1 + 8 + 4 + 4 + 4)
    packed = sum(c.nbytes() for c in store.chunks.values())
    assert packed <= 1.25 * given


def test_a_store_restored_mid_run_goes_on_as_the_uninterrupted_one():
    a = fresh(capacity=40, per_prompt=3)
    run(a, range(12))
    state = a.state_dict()
    b = fresh(capacity=40, per_prompt=3)
    b.load_state_dict(state)
    assert content(a) == content(b)
    assert run(a, range(12, 24)) == run(b, range(12, 24))


def test_a_store_saved_with_dense_columns_restores_packed():
    store = fresh()
    put = rows(8, 5)
    store.insert(put)
    state = store.state_dict()
    occ = state["slots"]
    back = store.gather(occ)
    dense = {**{k: v for k, v in state.items() if k not in ("chunks", "chunk_of", "row_of")},
             "mu": back.mu, "payload": {k: v[:, None] if v.dim() == 1 else v for k, v in back.payload.items()},
             "lengths": {k: v.to(torch.int32) for k, v in back.lengths.items()}}
    again = fresh()
    again.load_state_dict(dense)
    assert content(again) == content(store)


@pytest.mark.parametrize(("damage", "message"), [
    (lambda s: s["chunks"][0]["fields"]["responses"].update(values=torch.zeros(3, dtype=torch.int32)),
     "field 'responses' 'values' has (3,)"),
    (lambda s: s["chunks"][0]["fields"]["responses"]["extent"].__setitem__(1, 99), "outside [0, 12]"),
    (lambda s: s["row_of"].__setitem__(0, 50), "row_of holds rows outside their chunk"),
    (lambda s: s["chunk_of"].__setitem__(0, 7), "chunk_of holds chunks outside"),
    (lambda s: s["chunks"][0]["fields"]["rollout_log_probs"]["values"].__setitem__(2, float("inf")),
     "column 'mu' holds non-finite"),
], ids=["short-values", "extent", "row", "chunk", "mu-twin"])
def test_damaged_chunks_are_refused_at_restore(damage, message):
    store = fresh()
    store.insert(rows(8, 6))
    state = store.state_dict()
    damage(state)
    again = fresh()
    with pytest.raises(Exception, match="replay buffer in the checkpoint is damaged") as err:
        again.load_state_dict(state)
    assert message in str(err.value) and len(again) == 0
