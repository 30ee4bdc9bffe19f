"""Synthetic, verifiable tasks for the CPU shim, generated in code from a seed.

A prompt is ``[PAD.., <domain>, d_1, ..., d_n]``: a domain token and a string of ``n`` digits, left-padded
to :data:`PROMPT_LEN` (verl left-pads prompts too). The answer is a digit string closed by ``EOS``; the
reward is binary exact match of the whole response, EOS included. Responses have variable lengths, so
token-mean matters.

Every domain has graded difficulty: its *levels* are string lengths; a prompt draws its level uniformly,
then its digits uniformly. A (domain, level) pair is a finite *cell* of ``10**n`` prompts, which
:mod:`~dataflex_bus.shim.split` splits into a training part and a held-out part.

RL starts from a pretrained model, so the policy first fits pretraining data (:func:`pretraining_targets`)
that give the right answer only part of the time and a domain-specific *habit* otherwise: a plausible
wrong rule (swapping the last two digits of a copy, ...), more often on longer strings. The base policy
knows both rules; where it prefers the habit, greedy decoding is wrong although sampling often finds
the right answer. GRPO groups then hold mixed outcomes from the first step, and RL has real work to do:
making the right answer the policy's first choice, on prompts it has never trained on too.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ..kit import segment_max, segment_min

#: Token ids: digits are their own ids, then EOS and PAD, then one token per domain.
DIGITS = 10
EOS = 10
PAD = 11
FIRST_DOMAIN_TOKEN = 12
#: Tokens the policy can emit (digits and EOS).
NUM_OUTPUTS = 11
#: Answers of the unlearnable domain: uniform over this inclusive range, drawn per prompt instance.
RANDOM_ANSWERS = (10, 99)

#: A rule maps prompt digits ``[N, W]`` (left-aligned, 0 past each string's end) and lengths ``[N]`` to
#: answer digits ``[N, W]`` of the same lengths.
Rule = Callable[[Tensor, Tensor], Tensor]


@dataclass(frozen=True)
class Task:
    """One domain: string lengths per level (easiest first), its rule, the base policy's habit and the
    share of right answers per level in the pretraining data (the habit's answer otherwise).

    ``rule`` is ``None`` for the unlearnable domain, whose answer is a number drawn per prompt instance
    from :data:`RANDOM_ANSWERS`, independently of the prompt; no policy can beat chance there.
    """

    name: str
    lengths: tuple[int, ...]
    rule: Rule | None
    habit: Rule | None
    label_accuracy: tuple[float, ...]
    summary: str

    @property
    def learnable(self) -> bool:
        return self.rule is not None


def _positions(digits: Tensor) -> Tensor:
    return torch.arange(digits.shape[1])[None, :]


def _copy(digits: Tensor, lengths: Tensor) -> Tensor:
    return digits.clone()


def _reverse(digits: Tensor, lengths: Tensor) -> Tensor:
    src = (lengths[:, None] - 1 - _positions(digits)).clamp_min(0)
    return torch.where(_positions(digits) < lengths[:, None], digits.gather(1, src), 0)


def _sort(digits: Tensor, lengths: Tensor) -> Tensor:
    inside = _positions(digits) < lengths[:, None]
    keyed = torch.where(inside, digits, DIGITS)  # padding sorts last
    return torch.where(inside, keyed.sort(dim=1).values, 0)


def _swap_last_two(digits: Tensor, lengths: Tensor) -> Tensor:
    pos = _positions(digits)
    last = lengths[:, None] - 1
    src = torch.where(pos == last, last - 1, torch.where(pos == last - 1, last, pos))
    return digits.gather(1, src.clamp_min(0))


def _swap_first_two(digits: Tensor, lengths: Tensor) -> Tensor:
    pos = _positions(digits)
    src = torch.where(pos == 0, 1, torch.where(pos == 1, 0, pos))
    return digits.gather(1, src.expand_as(digits))


def _rotate_left(digits: Tensor, lengths: Tensor) -> Tensor:
    pos = _positions(digits)
    src = torch.where(pos < lengths[:, None], (pos + 1) % lengths[:, None].clamp_min(1), pos)
    return digits.gather(1, src)


# Each habit is a near miss of its own rule, and no two domains share one, so RL unlearns it domain by
# domain. The label accuracies set how far each domain starts from preferring the right answer: copy
# closest, reverse furthest.
TASKS: dict[str, Task] = {
    "copy": Task("copy", (3, 4), _copy, _swap_last_two, (0.6, 0.45),
                 "repeat the digits (habit: swaps the last two)"),
    "sort": Task("sort", (3, 4), _sort, lambda d, n: _rotate_left(_sort(d, n), n), (0.45, 0.35),
                 "the digits in ascending order (habit: puts the smallest last)"),
    "reverse": Task("reverse", (3, 4), _reverse, lambda d, n: _swap_first_two(_reverse(d, n), n), (0.35, 0.25),
                    "the digits in reverse order (habit: swaps the first two)"),
    "random": Task("random", (4,), None, None, (0.0,), "a random number per prompt instance (unlearnable)"),
}
#: Longest prompt string and longest answer (digits); a response is the answer and EOS.
MAX_DIGITS = max(max(t.lengths) for t in TASKS.values())
MAX_RESPONSE_LEN = max(MAX_DIGITS, len(str(RANDOM_ANSWERS[1]))) + 1
PROMPT_LEN = 1 + MAX_DIGITS


def vocab_size(num_domains: int) -> int:
    return FIRST_DOMAIN_TOKEN + num_domains


def encode_digits(digits: Tensor, lengths: Tensor, width: int = MAX_RESPONSE_LEN) -> Tensor:
    """Digit strings ``[N, W]`` with their lengths -> ``[N, width]`` target tokens: digits, EOS, PAD."""
    pos = torch.arange(width)[None, :]
    n = lengths[:, None]
    body = torch.zeros(digits.shape[0], width, dtype=torch.long)
    k = min(width, digits.shape[1])
    body[:, :k] = digits[:, :k]
    return torch.where(pos < n, body, torch.where(pos == n, EOS, PAD))


def encode_answer(values: Tensor, width: int = MAX_RESPONSE_LEN) -> Tensor:
    """Numbers -> ``[N, width]`` target tokens: decimal digits (most significant first), EOS, PAD."""
    n = (values[:, None] >= 10 ** torch.arange(1, width)[None, :]).sum(-1) + 1
    exponent = (n[:, None] - 1 - torch.arange(width)[None, :]).clamp_min(0)
    return encode_digits(values[:, None] // 10**exponent % 10, n, width)


def encode_prompts(domains: Tensor, digits: Tensor, lengths: Tensor) -> Tensor:
    """``[N, PROMPT_LEN]`` prompt tokens, right-aligned: PAD.., the domain token, the digits."""
    o = torch.arange(PROMPT_LEN - 1, -1, -1)[None, :]  # offset from the right end
    n = lengths[:, None]
    src = (n - 1 - o).clamp(0, digits.shape[1] - 1)
    tokens = torch.where(o < n, digits.gather(1, src), PAD)
    return torch.where(o == n, (domains + FIRST_DOMAIN_TOKEN)[:, None], tokens)


@dataclass
class Prompts:
    """A draw of prompts: tokens ``[N, PROMPT_LEN]``, domain ids ``[N]`` (into the run's domain list),
    levels ``[N]`` (into the domain's ``lengths``), the prompt digits ``[N, MAX_DIGITS]`` with their
    ``lengths`` ``[N]``, and target tokens ``[N, MAX_RESPONSE_LEN]``."""

    tokens: Tensor
    domains: Tensor
    levels: Tensor
    digits: Tensor
    lengths: Tensor
    targets: Tensor

    def _fields(self) -> tuple[Tensor, ...]:
        return self.tokens, self.domains, self.levels, self.digits, self.lengths, self.targets

    def repeat(self, n: int | Tensor) -> Prompts:
        """Each prompt ``n`` times in a row (a GRPO group is contiguous); ``n`` long ``[N]``: prompt ``i``
        ``n[i]`` times (ragged groups, an allocation's counts)."""
        if isinstance(n, Tensor) and n.dim() > 0 and n.numel() != len(self.domains):
            raise ValueError(f"shim: {n.numel()} rollout counts for {len(self.domains)} prompts (one count per "
                             "prompt expected)")
        return Prompts(*(x.repeat_interleave(n, 0) for x in self._fields()))

    def take(self, rows: Tensor) -> Prompts:
        """The prompts at ``rows`` (indices or a boolean mask), in that order."""
        return Prompts(*(x[rows] for x in self._fields()))

    @staticmethod
    def cat(parts: Sequence[Prompts]) -> Prompts:
        """Several draws as one, in order."""
        return Prompts(*(torch.cat(columns) for columns in zip(*(p._fields() for p in parts))))


def _apply(rules: list[Rule | None], domains: Tensor, digits: Tensor, lengths: Tensor, fallback: Tensor) -> Tensor:
    out = fallback
    for d, rule in enumerate(rules):  # a handful of domains: one vectorised pass each
        if rule is not None:
            out = torch.where((domains == d)[:, None], encode_digits(rule(digits, lengths), lengths), out)
    return out


def build_prompts(domains: Tensor, levels: Tensor, digits: Tensor, names: list[str],
                  gen: torch.Generator) -> Prompts:
    """Prompts and targets for given digit strings (``levels`` index each domain's lengths).

    The unlearnable domain's answers are drawn from ``gen`` for every row, whatever the domains, so
    ``gen`` is consumed the same way whatever the domain mix.
    """
    width = max(max(TASKS[n].lengths) for n in names)
    table = torch.zeros(len(names), width, dtype=torch.long)
    for d, name in enumerate(names):
        table[d, : len(TASKS[name].lengths)] = torch.tensor(TASKS[name].lengths)
    lengths = table[domains, levels]
    digits = torch.where(_positions(digits) < lengths[:, None], digits, 0)
    noise = torch.randint(RANDOM_ANSWERS[0], RANDOM_ANSWERS[1] + 1, domains.shape, generator=gen)
    targets = _apply([TASKS[n].rule for n in names], domains, digits, lengths, encode_answer(noise))
    return Prompts(encode_prompts(domains, digits, lengths), domains.clone(), levels.clone(), digits, lengths,
                   targets)


def pretraining_targets(prompts: Prompts, names: list[str]) -> tuple[Tensor, Tensor, Tensor]:
    """What the warm start fits: the right answers, the habit's answers and, per row, the share of
    right answers (the level's ``label_accuracy``; 1 for the unlearnable domain, which has no habit).

    The warm start weighs the two targets by that share rather than drawing one of them, which gives the
    same expected loss without label noise: base policies differ less from seed to seed. Fitted, they
    give a "base model" that knows the answer format and both rules and, where the share is below one
    half, prefers the habit: greedy decoding is wrong there although sampling often finds the right
    answer, as with an LLM whose pass@k is well above its pass@1.
    """
    width = max(len(TASKS[n].lengths) for n in names)
    table = torch.ones(len(names), width)
    for d, name in enumerate(names):
        if TASKS[name].learnable:
            table[d, : len(TASKS[name].lengths)] = torch.tensor(TASKS[name].label_accuracy)
    habit = _apply([TASKS[n].habit for n in names], prompts.domains, prompts.digits, prompts.lengths,
                   prompts.targets)
    return prompts.targets, habit, table[prompts.domains, prompts.levels]


def exact_match(responses: Tensor, response_mask: Tensor, targets: Tensor) -> Tensor:
    """Binary reward ``[N]``: the response, PAD after its last valid token, equals the target exactly."""
    shown = torch.where(response_mask.bool(), responses, torch.full_like(responses, PAD))
    return (shown == targets).all(-1).to(torch.float32)


def random_match_probability(responses: Tensor, response_mask: Tensor) -> Tensor:
    """Exact expected reward ``[N]`` of responses on the unlearnable domain: ``1 / |RANDOM_ANSWERS|`` for a
    response that writes one of its answers, else 0 (no sampling of answers, so no noise)."""
    values = torch.arange(RANDOM_ANSWERS[0], RANDOM_ANSWERS[1] + 1)
    shown = torch.where(response_mask.bool(), responses, torch.full_like(responses, PAD))
    hit = (shown[:, None, :] == encode_answer(values, responses.shape[1])[None]).all(-1).any(-1)
    return hit.to(torch.float32) / values.numel()


def zero_signal_fraction(rewards: Tensor, group_index: Tensor, num_groups: int) -> float:
    """Share of groups whose rewards are all equal (GRPO advantage 0 for every row: no learning signal)."""
    if num_groups == 0:
        return 0.0
    flat = segment_max(rewards, group_index, num_groups) == segment_min(rewards, group_index, num_groups)
    return float(flat.double().mean())
