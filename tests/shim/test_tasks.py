"""Tasks, rewards and the loss pieces: deterministic, exact, and verl's semantics."""

import torch

from dataflex_bus.shim.losses import policy_loss, token_mean
from dataflex_bus.shim.tasks import EOS, PAD, TASKS, encode_answer, exact_match, make_prompts, noisy_targets

NAMES = ["copy", "add", "muladd", "random"]


def draw(seed, n=64):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, len(NAMES), (n,), generator=g)
    return make_prompts(ids, NAMES, g)


def test_prompts_are_a_function_of_the_seed():
    a, b, c = draw(1), draw(1), draw(2)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.targets, b.targets)
    assert not torch.equal(a.tokens, c.tokens)


def test_answers_follow_each_task():
    p = draw(3, n=400)
    a, b = p.tokens[:, 1], p.tokens[:, 2]
    expected = {"copy": a, "add": a + b, "muladd": a * b + a + b}
    for d, name in enumerate(NAMES[:3]):
        rows = p.domains == d
        assert torch.equal(p.targets[rows], encode_answer(expected[name][rows]))


def test_random_domain_answer_does_not_follow_the_prompt():
    g = torch.Generator().manual_seed(0)
    ids = torch.full((2000,), 3)
    p = make_prompts(ids, NAMES, g)
    same = (p.tokens[:, 1] == 4) & (p.tokens[:, 2] == 7)
    values = p.targets[same]
    assert len({tuple(v.tolist()) for v in values}) > 3  # one prompt, many answers: unlearnable
    assert not TASKS["random"].learnable and all(TASKS[n].learnable for n in NAMES[:3])


def test_encode_answer_variable_length():
    out = encode_answer(torch.tensor([0, 7, 10, 99]))
    assert out.tolist() == [[0, EOS, PAD], [7, EOS, PAD], [1, 0, EOS], [9, 9, EOS]]


def test_exact_match_needs_eos_and_ignores_masked_tokens():
    target = encode_answer(torch.tensor([7, 7, 7, 7, 12]))
    responses = torch.tensor([[7, EOS, 3], [7, 3, EOS], [7, 1, 1], [8, EOS, PAD], [1, 2, EOS]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 1, 1], [1, 1, 0], [1, 1, 1]])
    assert exact_match(responses, mask, target).tolist() == [1.0, 0.0, 0.0, 0.0, 1.0]


def test_noisy_targets_keep_the_format():
    p = draw(4, n=500)
    noisy = noisy_targets(p, NAMES, torch.Generator().manual_seed(0))
    ends = (noisy == EOS).sum(-1)
    assert torch.all(ends == 1)
    right = (noisy == p.targets).all(-1).float()
    copy_rows = p.domains == 0
    assert 0.4 < float(right[copy_rows].mean()) < 0.8  # label accuracy 0.6 (+ lucky noise)


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
