"""The train/held-out split (disjoint, deterministic, independent of the method and the mix) and the exact
held-out evaluation (equal to a brute-force, prompt-by-prompt score)."""

import json

import pytest
import torch

from dataflex_bus.errors import ConfigError
from dataflex_bus.runtime import Runtime
from dataflex_bus.shim import run_training
from dataflex_bus.shim.config import resolve_config
from dataflex_bus.shim.host import describe
from dataflex_bus.shim.policy import TinyPolicy, pretrain
from dataflex_bus.shim.split import Split
from dataflex_bus.shim.tasks import EOS, MAX_RESPONSE_LEN, RANDOM_ANSWERS, TASKS, vocab_size
from dataflex_bus.shim.trainer import ShimTrainer

from .conftest import tiny
from .test_tasks import RULES, prompt_string

NAMES = ["copy", "sort", "reverse", "random"]


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny tensors: one thread, as the trainer runs (several threads only contend on a shared machine)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def cell_sets(split):
    """Held-out numbers per cell, as Python sets."""
    out = {c: set() for c in range(len(split.sizes))}
    for c, i in zip(split.heldout_cells.tolist(), split.heldout_index.tolist()):
        out[c].add(i)
    return out


def test_every_training_rank_maps_to_a_distinct_prompt_outside_the_heldout_set():
    split = Split(NAMES, 0, 600)
    held = cell_sets(split)
    for c in range(len(split.sizes)):
        size, train = int(split.sizes[c]), int(split.train_sizes[c])
        ranks = torch.arange(train)
        index = split.train_index(torch.full_like(ranks, c), ranks).tolist()
        # a bijection from the ranks onto the complement of the held-out prompts: disjoint and complete
        assert sorted(index) == sorted(set(range(size)) - held[c])
        assert len(held[c]) == int(split.held[c]) and train + len(held[c]) == size


@pytest.mark.integration
def test_training_draws_never_hit_a_heldout_prompt():
    split = Split(NAMES, 1, 600)
    heldout = {(int(d), tuple(t)) for d, t in zip(split.heldout.domains, split.heldout.tokens.tolist())}
    g = torch.Generator().manual_seed(0)
    seen = set()
    for _ in range(10):
        p = split.draw(torch.randint(0, 3, (4000,), generator=g), g)
        seen |= {(int(d), tuple(t)) for d, t in zip(p.domains, p.tokens.tolist())}
    assert not seen & heldout
    assert len(seen) > 5000  # the draws cover much of the training prompts


def test_split_is_a_function_of_the_seed_and_the_domain_name():
    a, b, c = Split(NAMES, 3, 600), Split(NAMES, 3, 600), Split(NAMES, 4, 600)
    assert torch.equal(a.heldout.tokens, b.heldout.tokens) and torch.equal(a.heldout_index, b.heldout_index)
    assert not torch.equal(a.heldout_index, c.heldout_index)
    # reverse's held-out prompts do not depend on which other domains the run trains, nor their order
    alone = Split(["reverse", "copy"], 3, 600)
    in_full = a.heldout_index[a.heldout.domains == NAMES.index("reverse")]
    assert torch.equal(alone.heldout_index[alone.heldout.domains == 0], in_full)


def test_split_does_not_depend_on_the_method_or_the_mix(shim_components):
    mix = {"mechanism": "mix", "scorer": {"name": "t_reward"}, "actuator": {"name": "t_all_on_first"}}
    splits = []
    for block in (None, mix, {"mechanism": "select", "scorer": {"name": "t_reward"},
                              "actuator": {"name": "t_even_groups"}}):
        resolved = resolve_config(tiny(block))
        trainer = ShimTrainer(resolved, Runtime(resolved["dataflex"], host=describe(resolved)))
        splits.append(trainer.split)
    for other in splits[1:]:
        assert torch.equal(other.heldout.tokens, splits[0].heldout.tokens)
        assert torch.equal(other.heldout.targets, splits[0].heldout.targets)


def test_trainer_seed_varies_the_rl_run_not_the_split_nor_the_base_policy():
    def build(**sections):
        resolved = resolve_config(tiny(**sections))
        return ShimTrainer(resolved, Runtime(None, host=describe(resolved)))

    base, other_run = build(), build(trainer={"seed": 5})
    assert torch.equal(base.split.heldout_index, other_run.split.heldout_index)
    assert all(torch.equal(a, b) for a, b in zip(base.policy.parameters(), other_run.policy.parameters()))
    assert base.train_step() != other_run.train_step()  # different prompts and rollouts
    assert not torch.equal(base.split.heldout_index, build(data={"seed": 5}).split.heldout_index)
    other_model = build(model={"seed": 5})
    assert torch.equal(base.split.heldout_index, other_model.split.heldout_index)
    assert not all(torch.equal(a, b) for a, b in zip(base.policy.parameters(), other_model.policy.parameters()))


def test_run_json_records_the_split_sizes(tmp_path):
    run_training(tiny(data={"heldout": 90}), steps=1, out=tmp_path)
    record = json.loads((tmp_path / "run.json").read_text())
    assert set(record["split"]) == set(NAMES)
    for name, info in record["split"].items():
        assert info["lengths"] == list(TASKS[name].lengths)
        assert sum(info["heldout"]) == 90
        assert [t + h for t, h in zip(info["train"], info["heldout"])] == [10**n for n in info["lengths"]]


@pytest.mark.parametrize(("heldout", "match"), [(0, r"data\.heldout: 0 is out of range"),
                                                (1, r"data\.heldout: 1 held-out prompts do not fit 'copy'"),
                                                (20000, r"data\.heldout: 20000 held-out prompts do not fit")])
def test_bad_heldout_size_is_refused_before_training(heldout, match):
    with pytest.raises(ConfigError, match=match):
        run_training(tiny(data={"heldout": heldout}), steps=1)


def greedy_text(policy, prompt):
    """Greedy decoding of one prompt, recomputing the whole sequence at each token (no recurrent state)."""
    tokens = list(prompt)
    out = []
    for _ in range(MAX_RESPONSE_LEN):
        logits, _ = policy(torch.tensor([tokens]))
        token = int(logits[0, -1].argmax())
        if token == EOS:
            return "".join(out)
        out.append(str(token))
        tokens.append(token)
    return None  # no EOS: never right


def brute_force_score(name, digits, written):
    if name in RULES:
        return float(written == RULES[name](digits))
    answers = [str(v) for v in range(RANDOM_ANSWERS[0], RANDOM_ANSWERS[1] + 1)]
    return sum(written == a for a in answers) / len(answers)  # expectation over the random answer


@pytest.mark.integration
def test_exact_evaluation_equals_a_brute_force_per_prompt_score():
    split = Split(NAMES, 2, 60)
    policy = TinyPolicy(vocab_size(len(NAMES)), 32, 1, torch.Generator().manual_seed(0))
    pretrain(policy, NAMES, split.draw, 120, torch.Generator().manual_seed(1), batch=128, lr=0.02)
    got = split.evaluate(policy)

    per_level: dict[tuple[str, int], list[float]] = {}
    with torch.no_grad():
        for tokens, d, level in zip(split.heldout.tokens.tolist(), split.heldout.domains.tolist(),
                                    split.heldout.levels.tolist()):
            name = NAMES[d]
            score = brute_force_score(name, prompt_string(torch.tensor(tokens)), greedy_text(policy, tokens))
            per_level.setdefault((name, level), []).append(score)
    expected = {}
    for name in NAMES:
        levels = [sum(v) / len(v) for (n, _), v in sorted(per_level.items()) if n == name]
        assert len(levels) == len(TASKS[name].lengths) and sum(map(len, (per_level[(name, lv)]
                                                                        for lv in range(len(levels))))) == 60
        expected[f"eval/heldout/{name}"] = sum(levels) / len(levels)
    expected["eval/heldout/learnable"] = sum(expected[f"eval/heldout/{n}"] for n in NAMES[:3]) / 3
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, abs=1e-9), key
    # not a trivial agreement: the policy is right on some prompts and wrong on others
    assert 0 < got["eval/heldout/learnable"] < 1
