"""Mixers: DUMP UCB (ring-buffer FIFO, counts), reward gap with floor, static proportions, resume."""

from __future__ import annotations

import io
import math

import pytest
import torch

from dataflex_bus.errors import BatchFieldError, ConfigError

from .helpers import batch_of, component, pipe, row_score

NAMES = ["a", "b", "c"]


def _step(domains, values, padding=None):
    b = batch_of([0.0] * len(values), [f"u{i}" for i in range(len(values))], domains=domains,
                 domain_names=NAMES, padding=padding)
    return b, row_score(values)


def _ucb(mu, n, c=1.0):
    total = max(1, sum(n))
    return [m + c * math.sqrt(2 * math.log(total + 1) / (k + 1)) for m, k in zip(mu, n)]


def _softmax(x, t):
    e = [math.exp((v - max(x)) / t) for v in x]
    return [v / sum(e) for v in e]


def test_dump_ucb_starts_uniform_and_follows_the_formula():
    mixer = component("actuator", "dump_ucb", c=1.0, window=3, temperature=0.1)
    mixer.set_domains(NAMES)
    assert torch.allclose(mixer.probabilities(), torch.full((3,), 1 / 3, dtype=torch.float64))
    # |value| is used; the padding row (domain a, value 100) never counts
    b, s = _step(["a", "b", "a", "a"], [-0.5, 2.0, 1.0, 100.0], padding=[False, False, False, True])
    m = mixer.update(b, s, 0)
    mu, n = [0.75, 2.0, 0.0], [2, 1, 0]
    assert m["domain/a/mu"] == pytest.approx(0.75) and m["domain/a/n"] == 2.0 and m["domain/c/n"] == 0.0
    assert m["domain/b/ucb"] == pytest.approx(_ucb(mu, n)[1])
    assert mixer.probabilities().tolist() == pytest.approx(_softmax(_ucb(mu, n), 0.1))
    # overflow within one step: a sees 0.5, 1.0, then 1, 2, 3, 4 -> FIFO keeps [2, 3, 4]
    b, s = _step(["a", "c", "a", "a", "a"], [1.0, -3.0, 2.0, 3.0, 4.0])
    mixer.update(b, s, 1)
    mu, n = [3.0, 2.0, 3.0], [6, 1, 1]
    assert mixer.probabilities().tolist() == pytest.approx(_softmax(_ucb(mu, n), 0.1))


def test_dump_ucb_fifo_wraps_across_steps_in_row_order():
    mixer = component("actuator", "dump_ucb", window=4)
    mixer.set_domains(NAMES)
    seen: list[float] = []
    g = torch.Generator().manual_seed(3)
    for step in range(7):
        k = int(torch.randint(0, 6, (1,), generator=g))
        vals = torch.rand(k, generator=g).tolist()
        doms = ["b" if i % 2 else "a" for i in range(k)]
        if k:
            b, s = _step(doms, vals)
            mixer.update(b, s, step)
        seen += [v for v, d in zip(vals, doms) if d == "a"]
    mu_a = sum(seen[-4:]) / len(seen[-4:])
    assert float(mixer._ucb()[0][0]) == pytest.approx(mu_a)
    assert int(mixer.counts[0]) == len(seen)


def test_dump_ucb_state_round_trip_gives_identical_future_outputs():
    def run(mixer, steps):
        out = []
        for step, (doms, vals) in steps:
            b, s = _step(doms, vals)
            mixer.update(b, s, step)
            out.append(mixer.probabilities())
        return out

    g = torch.Generator().manual_seed(0)
    steps = []
    for step in range(10):
        k = int(torch.randint(1, 9, (1,), generator=g))
        doms = [NAMES[int(i)] for i in torch.randint(0, 3, (k,), generator=g)]
        steps.append((step, (doms, torch.randn(k, generator=g).tolist())))
    a = component("actuator", "dump_ucb", window=5)
    a.set_domains(NAMES)
    run(a, steps[:5])
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    buf.seek(0)
    b = component("actuator", "dump_ucb", window=5)
    b.set_domains(NAMES)
    b.load_state_dict(torch.load(buf))
    for pa, pb in zip(run(a, steps[5:]), run(b, steps[5:])):
        assert torch.equal(pa, pb)
    # lists work too (e.g. a JSON checkpoint)
    c = component("actuator", "dump_ucb", window=5)
    c.set_domains(NAMES)
    c.load_state_dict({k: v.tolist() if isinstance(v, torch.Tensor) else v for k, v in a.state_dict().items()})
    assert torch.equal(c.probabilities(), a.probabilities())


def test_mixer_state_for_other_domains_is_refused():
    a = component("actuator", "dump_ucb")
    a.set_domains(NAMES)
    b = component("actuator", "dump_ucb")
    b.set_domains(["x", "y", "z"])
    with pytest.raises(ValueError, match="domains"):
        b.load_state_dict(a.state_dict())


def test_mixer_without_domain_labels_fails_loudly():
    mixer = component("actuator", "dump_ucb")
    mixer.set_domains(["g0", "g1"])
    b = batch_of([0.0, 1.0], ["u", "v"])  # no data_source at all
    with pytest.raises(BatchFieldError, match="data_source"):
        mixer.update(b, row_score([1.0, 2.0]), 0)


def test_reward_gap_formula_floor_and_unseen_domains():
    mixer = component("actuator", "reward_gap", temperature=0.5, floor=0.1)
    mixer.set_domains(NAMES)
    assert mixer.probabilities().tolist() == pytest.approx([1 / 3] * 3)
    b, s = _step(["a", "a", "b", "b", "a"], [1.0, 0.0, 1.0, 1.0, 9.0], padding=[False] * 4 + [True])
    mixer.update(b, s, 0)
    rbar = [0.5, 1.0, 0.5]  # c unseen: takes the lowest seen mean
    q = _softmax([max(rbar) - r for r in rbar], 0.5)
    expected = [0.1 + (1 - 0.3) * v for v in q]
    p = mixer.probabilities()
    assert p.tolist() == pytest.approx(expected)
    assert float(p.sum()) == pytest.approx(1.0) and bool((p >= 0.1 - 1e-12).all())


def test_reward_gap_momentum_and_round_trip():
    mixer = component("actuator", "reward_gap", momentum=0.5)
    mixer.set_domains(NAMES)
    mixer.update(*_step(["a", "b", "c"], [1.0, 0.0, 0.5]), 0)
    mixer.update(*_step(["a"], [0.0]), 1)
    assert mixer.rbar.tolist() == pytest.approx([0.5, 0.0, 0.5])  # b, c untouched in step 1
    other = component("actuator", "reward_gap", momentum=0.5)
    other.set_domains(NAMES)
    other.load_state_dict(mixer.state_dict())
    assert torch.equal(other.probabilities(), mixer.probabilities())


def test_reward_gap_floor_times_k_must_stay_below_one():
    mixer = component("actuator", "reward_gap", floor=0.4)
    with pytest.raises(ConfigError, match="floor"):
        mixer.set_domains(NAMES)
    component("actuator", "reward_gap", floor=0.3).set_domains(NAMES)


def test_static_proportions_dict_and_list():
    m = component("actuator", "static", proportions={"b": 2, "a": 1, "c": 1})
    m.set_domains(NAMES)
    assert m.probabilities().tolist() == pytest.approx([0.25, 0.5, 0.25])
    m = component("actuator", "static", proportions=[1, 0, 3])
    m.set_domains(NAMES)
    assert m.probabilities().tolist() == pytest.approx([0.25, 0.0, 0.75])


def test_static_errors_name_the_domain():
    m = component("actuator", "static", proportions={"a": 1, "b": 1})
    with pytest.raises(ConfigError, match=r"\['c'\]"):
        m.set_domains(NAMES)
    m = component("actuator", "static", proportions={"a": 1, "b": 1, "c": 1, "zz": 1})
    with pytest.raises(ConfigError, match="zz"):
        m.set_domains(NAMES)
    with pytest.raises(ConfigError, match="3 domains"):
        component("actuator", "static", proportions=[1, 2]).set_domains(NAMES)
    for bad in ({"a": -1}, {"a": 0}, [float("nan")], {"a": "x"}):
        with pytest.raises(ConfigError, match="proportions"):
            component("actuator", "static", proportions=bad)


def test_static_through_the_pipeline_with_config_domains():
    p = pipe("mix", "reward_difficulty", "static", actuator_params={"proportions": {"a": 3, "b": 1}},
             domains=["a", "b"])
    b = batch_of([1.0, 0.0], ["u", "v"], domains=["a", "b"])
    d = p.apply(b, 0)
    assert d.domain_probs == pytest.approx({"a": 0.75, "b": 0.25})
    with pytest.raises(ConfigError, match="c"):
        pipe("mix", "reward_difficulty", "static", actuator_params={"proportions": {"a": 1, "b": 1}},
             domains=["a", "b", "c"])


def test_dump_pipeline_step_round_trip():
    def make():
        p = pipe("mix", "advantage_magnitude", "dump_ucb", {"agg": "mean"},
                 {"c": 1.0, "window": 300, "temperature": 0.1})
        p.set_domains(NAMES)
        return p

    rewards = [1, 0, 1, 1, 0, 0, 1, 0]
    uid = ["p"] * 4 + ["q"] * 4
    doms = ["a"] * 4 + ["c"] * 4
    b = batch_of(rewards, uid, domains=doms, domain_names=NAMES)
    p1 = make()
    d0 = p1.apply(b, 0)
    # a: |A| of group p; c: |A| of group q (GRPO advantages constant over tokens)
    assert d0.metrics["dataflex/domain/a/mu"] == pytest.approx(float(b["advantages"][:4, 0].abs().mean()))
    state = p1.state_dict()
    p2 = make()
    p2.load_state_dict(state)
    assert p1.apply(b, 1).domain_probs == p2.apply(b, 1).domain_probs
