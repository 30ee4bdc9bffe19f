"""Synthetic, verifiable tasks for the CPU shim, generated in code from a seed.

Every prompt is three tokens ``[<domain>, a, b]`` with digits ``a, b``; the answer is a decimal number
written digit by digit and closed by ``EOS`` (so answers are 2 or 3 tokens long and responses have
variable lengths). The reward is binary exact match of the whole response, EOS included.

The policy starts from a weak "base model" (:func:`noisy_targets`, fitted for a fraction of a second), as
RL starts from a pretrained LLM: it knows the answer format and is right on part of the prompts, so
GRPO groups hold mixed outcomes from the first step. The built-in domains differ clearly in difficulty
(pass rate of the default base policy -> what GRPO reaches in 200 steps):

* ``copy``: answer ``a`` (10 facts to learn);
* ``add``: answer ``a + b`` (100 facts, one or two digits);
* ``muladd``: answer ``a * b + a + b`` (100 facts, mostly two digits, an irregular table);
* ``random``: a number in 10..99 drawn per prompt *instance*, independent of the prompt tokens, so no
  policy can beat chance (1/90). It is the unlearnable domain a data mixer should move away from.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

#: Token ids: digits are their own ids, then EOS and PAD, then one token per domain.
DIGITS = 10
EOS = 10
PAD = 11
FIRST_DOMAIN_TOKEN = 12
#: Tokens the policy can emit (digits and EOS).
NUM_OUTPUTS = 11
#: Longest answer: two digits and EOS.
MAX_RESPONSE_LEN = 3
PROMPT_LEN = 3


@dataclass(frozen=True)
class Task:
    """One domain: how its answer follows from the prompt digits, whether it can be learned, and the
    share of right answers in the pretraining data (with the table's size, this sets how often the
    base policy starts out right)."""

    name: str
    answer: Callable[[Tensor, Tensor, torch.Generator], Tensor]
    learnable: bool
    label_accuracy: float
    summary: str


def _random_answer(a: Tensor, b: Tensor, gen: torch.Generator) -> Tensor:
    return torch.randint(10, 100, a.shape, generator=gen)


TASKS: dict[str, Task] = {
    "copy": Task("copy", lambda a, b, g: a.clone(), True, 0.6, "repeat the first digit"),
    "add": Task("add", lambda a, b, g: a + b, True, 0.6, "a + b in decimal"),
    "muladd": Task("muladd", lambda a, b, g: a * b + a + b, True, 0.3, "a * b + a + b in decimal"),
    "random": Task("random", _random_answer, False, 0.0, "a random number per prompt instance (unlearnable)"),
}


def noisy_targets(prompts: Prompts, names: Sequence[str], gen: torch.Generator) -> Tensor:
    """Pretraining targets: the right answer with the domain's ``label_accuracy``, else a random number.

    Fitting these gives a weak "base model" that knows the answer format and part of each table, so
    GRPO groups hold mixed outcomes from the first step, as they do when RL starts from a pretrained
    LLM. The random alternatives are drawn in 0..99, the range every task's answers live in.
    """
    n = prompts.tokens.shape[0]
    acc = torch.tensor([TASKS[d].label_accuracy for d in names])[prompts.domains]
    right = torch.rand(n, generator=gen) < acc
    noise = encode_answer(torch.randint(0, 100, (n,), generator=gen))
    return torch.where(right[:, None], prompts.targets, noise)


def vocab_size(num_domains: int) -> int:
    return FIRST_DOMAIN_TOKEN + num_domains


def encode_answer(values: Tensor) -> Tensor:
    """Numbers in 0..99 -> ``[N, MAX_RESPONSE_LEN]`` target tokens: digits, EOS, then PAD."""
    two = values >= 10
    tens, ones = values // 10, values % 10
    n = values.shape[0]
    out = torch.full((n, MAX_RESPONSE_LEN), PAD, dtype=torch.long)
    out[:, 0] = torch.where(two, tens, ones)
    out[:, 1] = torch.where(two, ones, torch.full_like(ones, EOS))
    out[:, 2] = torch.where(two, torch.full_like(ones, EOS), torch.full_like(ones, PAD))
    return out


@dataclass
class Prompts:
    """A draw of prompts: tokens ``[N, 3]``, domain ids ``[N]`` (into the run's domain list), targets."""

    tokens: Tensor
    domains: Tensor
    targets: Tensor

    def repeat(self, n: int) -> Prompts:
        """Each prompt ``n`` times in a row (a GRPO group is contiguous)."""
        return Prompts(self.tokens.repeat_interleave(n, 0), self.domains.repeat_interleave(n, 0),
                       self.targets.repeat_interleave(n, 0))


def make_prompts(domains: Tensor, names: Sequence[str], gen: torch.Generator) -> Prompts:
    """Draw one prompt instance per entry of ``domains`` (ids into ``names``), all from ``gen``.

    Every domain's answer is computed for every row and the right one picked, so the generator is
    consumed the same way whatever the domain mix: a run's prompts depend only on the seed and the
    sequence of domain ids.
    """
    n = domains.shape[0]
    a = torch.randint(0, DIGITS, (n,), generator=gen)
    b = torch.randint(0, DIGITS, (n,), generator=gen)
    values = torch.zeros(n, dtype=torch.long)
    for d, name in enumerate(names):  # a handful of domains: one vectorised pass each
        values = torch.where(domains == d, TASKS[name].answer(a, b, gen), values)
    tokens = torch.stack([domains + FIRST_DOMAIN_TOKEN, a, b], dim=1)
    return Prompts(tokens, domains.clone(), encode_answer(values))


def exact_match(responses: Tensor, response_mask: Tensor, targets: Tensor) -> Tensor:
    """Binary reward ``[N]``: the response, PAD after its last valid token, equals the target exactly."""
    shown = torch.where(response_mask.bool(), responses, torch.full_like(responses, PAD))
    return (shown == targets).all(-1).to(torch.float32)
