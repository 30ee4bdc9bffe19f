"""Every mechanism on TRL with ``use_vllm=True`` (colocate), on vLLM's CPU build: the same plugin code as without
vLLM, TRL's own vLLM calls. Exact where a reference exists (vLLM's sampling is seeded: plain TRL with vLLM on the
same seed generates the same completions): a block that keeps everything, and an allocation of num_generations to
every prompt, train plain TRL bit for bit; a selection trains exactly the kept groups' rows vLLM generated; DOTS's
weights are the truncated ratio of the old policy's to vLLM's log-probs; RePO's replayed rows carry vLLM's
log-probs as mu."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

pytestmark = pytest.mark.vllm

pytest.importorskip("vllm", reason="vllm is not importable here: the vllm tier runs in its own environment "
                    "(scripts/vllm_venv.sh; .ci/run makes it and runs the tier)")
torch = pytest.importorskip("torch")
pytest.importorskip("trl")

import vllm_cpu_support as S  # noqa: E402
import vllm_tiny as V  # noqa: E402
from trl_methods import (  # noqa: E402  (the TRL tier's blocks and checks: vllm_tiny puts tests/trl_tier on the path)
    DAPO,
    DOTS,
    DOTS_CAP,
    KEEP_ALL,
    REPO,
    TWICE,
    Once,
    Twice,
    assert_twice_the_gradient,
    by_position,
    dots_weights,
    even_tokens,
)

from dataflex_bus.trl import DataflexGRPOTrainer  # noqa: E402
from dataflex_bus.trl.rows import BEHAVIOUR, WEIGHTS  # noqa: E402


@pytest.fixture(autouse=True)
def cpu_backend():
    """vLLM's CPU backend settings and weight sync (test support, vllm_cpu_support.py)."""
    with S.cpu_backend():
        yield


#: Plain TRL with vLLM on its arguments, trained once per module.
plain = Once(V.train)


def dataflex(block: dict[str, Any], **kw: Any) -> dict[str, Any]:
    return V.train(DataflexGRPOTrainer, trainer_kwargs={"dataflex": block}, **kw)


@pytest.mark.parametrize("spg,ga", [(1, 1), (2, 1)], ids=["one-pass", "trl-old-pass"])
def test_a_block_keeping_everything_is_plain_trl_with_vllm_bit_for_bit(spg, ga):
    """Rounds stopped at their rewards, TRL's method once more on the kept rows (vLLM's completions and sampling
    log-probs replayed, not generated again): the same vLLM calls, gradients, weights and losses as plain TRL."""
    kw = dict(spg=spg, ga=ga, steps=2 * spg // ga)
    a, b = dataflex(KEEP_ALL, **kw), plain(**kw)
    assert len(a["generations"]) == len(b["generations"]) == 2
    assert a["generations"] == b["generations"]
    assert [m["dataflex/removed_rows"] for m in a["trainer"].dataflex_metrics] == [0.0, 0.0]
    assert V.compare(a, b) == 0.0 and a["losses"] == b["losses"]
    # TRL's own vLLM importance-sampling correction ran on both
    assert all("importance_sampling_ratio" in u for u in a["updates"])


def test_no_block_is_plain_trl_with_vllm_bit_for_bit():
    a, b = V.train(DataflexGRPOTrainer), plain()
    assert a["generations"] == b["generations"] and V.compare(a, b) == 0.0


def test_a_selection_trains_exactly_the_kept_groups_vllm_generated():
    """DAPO's filter: the groups whose rewards are flat leave; the rows trained are exactly the kept groups' rows
    (TRL shuffles a generation batch before splitting it: compared as multisets), each with vLLM's completion and
    sampling log-probs."""
    a = dataflex(DAPO, steps=2, reward_funcs=[V.length])
    trainer = a["trainer"]
    for step, (gen, update) in enumerate(zip(a["generations"], a["updates"])):
        ids = gen["completion_ids"]
        # the length reward, as TRL computes it from the decoded completion
        rewards = torch.tensor([0.1 * len(trainer.processing_class.decode(c, skip_special_tokens=True))
                                for c in ids])
        groups = rewards.view(-1, V.G)
        keep = (groups.max(dim=1).values > groups.min(dim=1).values).repeat_interleave(V.G).tolist()
        kept = sorted((tuple(c), tuple(float(x) for x in lp)) for c, lp, k in zip(ids, gen["logprobs"], keep) if k)
        mask = update["completion_mask"].bool()
        trained = sorted(zip((tuple(int(t) for t in r) for r in _masked(update["completion_ids"], mask)),
                             (tuple(r) for r in _masked(update["sampling_per_token_logps"], mask))))
        assert trained == kept, step
        assert trainer.dataflex_metrics[step]["dataflex/removed_rows"] == float(len(keep) - sum(keep))
    assert any(m["dataflex/removed_rows"] > 0 for m in trainer.dataflex_metrics)


def test_weights_multiply_the_policy_gradient_under_vllm(register):
    register("reweighter", "test_twice", Twice)
    a, b = dataflex(TWICE, steps=1), plain(steps=1)
    assert a["generations"] == b["generations"]
    assert_twice_the_gradient(a, b)


def test_a_mixer_s_domains_are_what_vllm_generates():
    """A mixer publishes domain probabilities; the host draws the next prompts by them and vLLM generates
    exactly those rows (TRL's own call on the drawn prompts)."""
    block = {"mechanism": "mix", "scorer": {"name": "advantage_magnitude"},
             "actuator": {"name": "dump_ucb", "params": {"c": 1.0, "window": 50, "temperature": 0.1}},
             "domain_key": "domain"}
    data = V.rows(32)
    a = dataflex(block, data=data, steps=3)
    trainer = a["trainer"]
    assert len(a["generations"]) == 3 and all(len(g["completion_ids"]) == 16 for g in a["generations"])
    tok = trainer.processing_class
    prompts = {tok(r["prompt"], add_special_tokens=False)["input_ids"].__repr__(): r["domain"] for r in data}
    for gen in a["generations"]:
        for p in gen["prompt_ids"]:
            assert repr(p) in prompts
    assert trainer.dataflex.domain_probs is not None
    assert set(trainer.dataflex.domain_probs) == {"even", "odd"}


def test_refill_generates_more_vllm_rounds_until_the_batch_is_full():
    """DAPO with refill: each round one call of TRL's vLLM generation on the round's prompts; the kept groups'
    rows train."""
    block = {**DAPO, "refill": {"gen_batch_size": 4, "max_rounds": 6, "on_exhaust": "train_short"}}
    a = dataflex(block, steps=2, data=V.rows(64))
    metrics = a["trainer"].dataflex_metrics
    assert len(a["generations"]) == sum(int(m["dataflex/refill/rounds"]) for m in metrics)
    assert len(a["generations"]) > 2
    for update, m in zip(a["updates"], metrics):
        assert float(update["completion_mask"].any(dim=1).sum()) >= m["dataflex/trained/rows"]
        assert m["dataflex/refill/trained_groups"] * V.G == m["dataflex/trained/rows"]


def test_a_token_selection_enters_trl_s_loss_mask_under_vllm(register):
    a, b = dataflex(even_tokens(register), steps=1), plain(steps=1)
    assert a["generations"] == b["generations"]
    (update,) = a["updates"]
    width = update["completion_ids"].size(1)
    even = (torch.arange(width) % 2 == 0).to(update["tool_mask"].dtype)
    assert torch.equal(update["tool_mask"] * update["completion_mask"], even * update["completion_mask"])
    assert V.compare(a, b) > 0


def test_num_generations_for_every_prompt_is_plain_trl_with_vllm_bit_for_bit(register):
    a, b = dataflex(by_position(register, [V.G]), steps=2), plain(steps=2)
    assert [m["dataflex/alloc/rollouts"] for m in a["trainer"].dataflex_metrics] == [16.0, 16.0]
    assert a["generations"] == b["generations"]
    assert V.compare(a, b) == 0.0 and a["losses"] == b["losses"]


def test_per_prompt_counts_are_what_colocated_vllm_generates(register):
    """Counts 2, 6, 4, 4 by position: one vLLM request per row, each prompt asked as often as allocated."""
    a = dataflex(by_position(register, [2, 6, 4, 4]), steps=2)
    for gen in a["generations"]:
        runs = [1]
        for prev, cur in zip(gen["prompt_ids"], gen["prompt_ids"][1:]):
            if cur == prev:
                runs[-1] += 1
            else:
                runs.append(1)
        assert runs == [2, 6, 4, 4]
    assert [m["dataflex/alloc/rollouts"] for m in a["trainer"].dataflex_metrics] == [16.0, 16.0]


def test_continuation_rounds_are_more_vllm_calls_on_the_same_prompts():
    """SPEED: a screening round of num_generations, then continuation rounds for the prompts it keeps, each one
    more call of TRL's vLLM generation on prompts the step already rolled out."""
    block = {"mechanism": "allocate", "scorer": {"name": "group_solve_rate", "params": {"success_threshold": 0.5}},
             "actuator": {"name": "speed", "params": {"n_continue": 4, "max_n": 8}}}
    a = dataflex(block, steps=2, data=V.rows(64), reward_funcs=[V.length])
    metrics = list(a["trainer"].dataflex_metrics)
    calls = a["generations"]
    assert len(calls) > 2
    continued = [later for earlier, later in itertools.pairwise(calls)
                 if all(p in earlier["prompt_ids"] for p in later["prompt_ids"])]
    assert continued
    assert metrics[-1]["compute/generated_rollouts"] == sum(len(g["completion_ids"]) for g in calls)


def _masked(rows: torch.Tensor, mask: torch.Tensor) -> list[list[float]]:
    return [[float(x) for x, m in zip(r.tolist(), k.tolist()) if m] for r, k in zip(rows, mask)]


@pytest.mark.parametrize("trl_correction", ["off", "token_truncate"])
def test_dots_weights_are_the_truncated_ratio_of_old_to_vllm_log_probs(trl_correction):
    """Every row (fresh and replayed) weighted by min(pi_old / mu_vLLM, 2) per token: by the kit with TRL's
    correction off, by TRL's own token_truncate ratio at clip_max=2 otherwise (never both)."""
    cfg: dict[str, Any] = ({"vllm_importance_sampling_correction": False} if trl_correction == "off" else
                           {"vllm_importance_sampling_mode": "token_truncate",
                            "vllm_importance_sampling_clip_max": DOTS_CAP})
    a = dataflex(DOTS, data=V.rows(4), steps=3, **cfg)
    metrics = list(a["trainer"].dataflex_metrics)
    assert [m["dataflex/replay/rows"] for m in metrics[1:]] == [8.0, 8.0]
    update = a["updates"][-1]
    mask = update["completion_mask"].bool()
    old, mu = update["old_per_token_logps"], update[BEHAVIOUR]
    # mu: vLLM's sampling log-probs (a replayed row's stored ones), never the old policy's
    sampled = update["sampling_per_token_logps"]
    assert torch.equal(mu[mask], sampled[mask].to(mu.dtype))
    expected = dots_weights(old, mu)
    if trl_correction == "off":
        weights = update[WEIGHTS]
        assert "importance_sampling_ratio" not in update
    else:
        weights = update["importance_sampling_ratio"]
        assert WEIGHTS not in update or bool((update[WEIGHTS] == 1).all())
    assert torch.allclose(weights[mask], expected[mask], rtol=1e-5, atol=1e-6)
    assert bool((weights[mask] != 1).any())


def test_repo_replayed_rows_carry_vllm_log_probs_as_mu():
    """correction=behaviour: a replayed row's PPO ratio is taken against the log-probs vLLM sampled it with
    (recorded at its generation, steps before), and TRL's vLLM ratio stands down on it (exactly 1)."""
    a = dataflex(REPO, data=V.rows(4), steps=3)
    *earlier, last = a["generations"]
    fresh = {tuple(c) for c in last["completion_ids"]}
    sampled = {tuple(c): [float(x) for x in lp] for g in earlier for c, lp in zip(g["completion_ids"], g["logprobs"])}
    assert [m["dataflex/replay/rows"] for m in a["trainer"].dataflex_metrics] == [0.0, 8.0, 8.0]
    update = a["updates"][-1]
    mask = update["completion_mask"].bool()
    ids = [tuple(int(t) for t in r) for r in _masked(update["completion_ids"], mask)]
    old = _masked(update["old_per_token_logps"], mask)
    replayed = [i for i, key in enumerate(ids) if key not in fresh]
    assert len(replayed) == 8 and len(ids) == len(fresh) + 8
    ratio = update["importance_sampling_ratio"]
    for row in replayed:
        assert old[row] == sampled[ids[row]]  # vLLM's log-probs, bit for bit, as mu
        assert bool((ratio[row] == 1).all())
