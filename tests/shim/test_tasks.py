"""Tasks, rewards and the loss pieces: deterministic, exact, and verl's semantics."""

import pytest
import torch

from dataflex_bus.shim.losses import policy_loss, token_mean
from dataflex_bus.shim.split import Split
from dataflex_bus.shim.tasks import (
    EOS,
    PAD,
    PROMPT_LEN,
    RANDOM_ANSWERS,
    TASKS,
    encode_answer,
    exact_match,
    pretraining_targets,
    random_match_probability,
    zero_signal_fraction,
)

NAMES = ["copy", "sort", "reverse", "random"]
#: The rules and habits written out on Python strings, independently of the tensor code.
RULES = {"copy": lambda s: s, "sort": lambda s: "".join(sorted(s)), "reverse": lambda s: s[::-1]}
HABITS = {"copy": lambda s: s[:-2] + s[-1] + s[-2],
          "sort": lambda s: "".join(sorted(s))[1:] + "".join(sorted(s))[0],
          "reverse": lambda s: s[::-1][1] + s[::-1][0] + s[::-1][2:]}


def draw(seed, n=400, domains=None):
    split = Split(NAMES, 0, 600)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, len(NAMES), (n,), generator=g) if domains is None else domains
    return split.draw(ids, g)


def text(tokens):
    """A token row as the string it writes, up to its first EOS (None if it has no EOS)."""
    out = []
    for t in tokens.tolist():
        if t == EOS:
            return "".join(out)
        out.append(str(t))
    return None


def prompt_string(tokens):
    return "".join(str(t) for t in tokens.tolist() if t < 10)  # PAD and domain tokens are >= 10


def test_prompts_are_a_function_of_the_seed():
    a, b, c = draw(1), draw(1), draw(2)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.targets, b.targets)
    assert not torch.equal(a.tokens, c.tokens)


def test_prompts_depend_only_on_the_sequence_of_domain_ids():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 4, (300,), generator=g)
    other = torch.where(torch.arange(300) % 3 == 0, (ids + 1) % 4, ids)
    a, b = draw(5, domains=ids), draw(5, domains=other)
    same = ids == other
    assert torch.equal(a.tokens[same], b.tokens[same]) and torch.equal(a.targets[same], b.targets[same])


def test_prompt_layout_and_answers_follow_each_rule():
    p = draw(3, n=600)
    assert p.tokens.shape[1] == PROMPT_LEN
    for row in range(len(p.domains)):
        name = NAMES[int(p.domains[row])]
        tokens = p.tokens[row].tolist()
        n = int(p.lengths[row])
        assert n == TASKS[name].lengths[int(p.levels[row])]
        # left-padded: PAD.., the domain token, then n digits
        assert tokens[: PROMPT_LEN - n - 1] == [PAD] * (PROMPT_LEN - n - 1)
        assert tokens[PROMPT_LEN - n - 1] == 12 + int(p.domains[row])
        digits = "".join(str(t) for t in tokens[PROMPT_LEN - n:])
        assert len(digits) == n and digits.isdigit()
        answer = text(p.targets[row])
        if name in RULES:
            assert answer == RULES[name](digits), (name, digits, answer)
        else:
            assert RANDOM_ANSWERS[0] <= int(answer) <= RANDOM_ANSWERS[1]


def test_random_domain_answer_does_not_follow_the_prompt():
    split = Split(["random"], 0, 10)
    g = torch.Generator().manual_seed(0)
    answers = {}
    for _ in range(20):
        p = split.draw(torch.zeros(2000, dtype=torch.long), g)
        for tokens, target in zip(p.tokens.tolist(), p.targets.tolist()):
            answers.setdefault(tuple(tokens), set()).add(tuple(target))
    repeated = [a for a in answers.values() if len(a) > 1]
    assert repeated  # one prompt, several answers: unlearnable
    assert not TASKS["random"].learnable and all(TASKS[n].learnable for n in NAMES[:3])


def test_pretraining_targets_are_the_right_answer_and_the_habit_weighted_by_level():
    p = draw(4, n=1500)
    right, habit, share = pretraining_targets(p, NAMES)
    assert torch.equal(right, p.targets)
    for row in range(len(p.domains)):
        name = NAMES[int(p.domains[row])]
        level = int(p.levels[row])
        if name in HABITS:
            digits = prompt_string(p.tokens[row])
            assert text(habit[row]) == HABITS[name](digits), (name, digits)
            assert float(share[row]) == pytest.approx(TASKS[name].label_accuracy[level])
        else:  # the unlearnable domain has no habit: its own (random) answer, fully weighted
            assert torch.equal(habit[row], right[row]) and float(share[row]) == 1.0
    # the habit is a real mistake on most prompts
    learnable = p.domains < 3
    assert float((habit[learnable] != right[learnable]).any(-1).double().mean()) > 0.8


def test_encode_answer_variable_length():
    out = encode_answer(torch.tensor([0, 7, 10, 99, 1234]), 5)
    assert out.tolist() == [[0, EOS, PAD, PAD, PAD], [7, EOS, PAD, PAD, PAD], [1, 0, EOS, PAD, PAD],
                            [9, 9, EOS, PAD, PAD], [1, 2, 3, 4, EOS]]


def test_exact_match_needs_eos_and_ignores_masked_tokens():
    target = encode_answer(torch.tensor([7, 7, 7, 7, 12]), 3)
    responses = torch.tensor([[7, EOS, 3], [7, 3, EOS], [7, 1, 1], [8, EOS, PAD], [1, 2, EOS]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 1, 1], [1, 1, 0], [1, 1, 1]])
    assert exact_match(responses, mask, target).tolist() == [1.0, 0.0, 0.0, 0.0, 1.0]


def test_random_match_probability_is_the_exact_expected_reward():
    responses = torch.tensor([[4, 2, EOS, 3], [9, 9, EOS, PAD], [1, 0, EOS, 5], [0, 9, EOS, PAD],
                              [7, EOS, PAD, PAD], [1, 0, 0, EOS], [4, 2, 1, 1]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 0], [1, 1, 1, 0], [1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1],
                         [1, 1, 1, 1]])
    got = random_match_probability(responses, mask)
    values = range(RANDOM_ANSWERS[0], RANDOM_ANSWERS[1] + 1)
    for row, prob in zip(responses, got.tolist()):
        written = text(row)
        expected = sum(written == str(v) for v in values) / len(values)  # the mean over every possible answer
        assert abs(prob - expected) < 1e-7, (row, prob, expected)
    assert got[0] > 0 and got[3] == 0  # "09" is not a number of the range, "42" is


def test_zero_signal_fraction_counts_groups_with_all_equal_rewards():
    rewards = torch.tensor([1, 1, 1, 0, 0, 0, 1, 0, 1, 1, 0, 1, 0.5, 0.5, 0.5], dtype=torch.float32)
    group = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3, 4, 4, 4])
    # by hand: group 0 all right, 1 all wrong, 4 all equal; 2 and 3 mixed
    assert zero_signal_fraction(rewards, group, 5) == 3 / 5
    assert zero_signal_fraction(rewards[:0], group[:0], 0) == 0.0


def test_token_mean_drop_is_not_zero_weight():
    """Dropping rows (masks zeroed) renormalises over kept tokens; zero weights dilute by kept/total."""
    g = torch.Generator().manual_seed(0)
    lp = torch.randn(4, 3, generator=g, requires_grad=True)
    old = lp.detach() - 0.05
    adv = torch.tensor([1.0, -1.0, 0.5, 2.0])[:, None].expand(4, 3)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 1]])
    keep = torch.tensor([True, True, False, False])
    dropped, _ = policy_loss(lp[keep], old[keep], adv[keep], mask[keep], clip_ratio=0.2)
    zeroed_mask = mask * keep[:, None]
    masked, _ = policy_loss(lp, old, adv, zeroed_mask, clip_ratio=0.2, num_tokens=zeroed_mask.sum())
    weighted, _ = policy_loss(lp, old, adv, mask, clip_ratio=0.2,
                              rollout_is_weights=keep[:, None].float().expand(4, 3), num_tokens=mask.sum())
    assert torch.allclose(dropped, masked)
    kept_tokens, all_tokens = float(mask[keep].sum()), float(mask.sum())
    assert torch.allclose(weighted, dropped * kept_tokens / all_tokens)
    assert torch.allclose(token_mean(torch.ones(2, 2), torch.tensor([[1, 0], [1, 1]])), torch.tensor(1.0))
