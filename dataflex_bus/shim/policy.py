"""The shim's policy: a tiny GRU language model over the task vocabulary, trained from scratch.

It reads the prompt, then emits response tokens one at a time (digits or EOS). Parameters are
initialised from a generator the trainer owns, so a run never depends on torch's global RNG.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

from .tasks import EOS, MAX_RESPONSE_LEN, NUM_OUTPUTS, PAD, Prompts, pretraining_targets


class TinyPolicy(nn.Module):
    """Embedding -> GRU -> linear head over the :data:`~dataflex_bus.shim.tasks.NUM_OUTPUTS` tokens."""

    def __init__(self, vocab: int, hidden: int, layers: int, gen: torch.Generator) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.rnn = nn.GRU(hidden, hidden, num_layers=layers, batch_first=True)
        self.head = nn.Linear(hidden, NUM_OUTPUTS)
        bound = 1.0 / math.sqrt(hidden)
        with torch.no_grad():
            nn.init.normal_(self.embed.weight, 0.0, 1.0, generator=gen)
            for p in self.rnn.parameters():
                nn.init.uniform_(p, -bound, bound, generator=gen)
            nn.init.uniform_(self.head.weight, -bound, bound, generator=gen)
            self.head.bias.zero_()

    def forward(self, tokens: Tensor, state: Tensor | None = None) -> tuple[Tensor, Tensor]:
        out, state = self.rnn(self.embed(tokens), state)
        return self.head(out), state


def token_log_probs(policy: TinyPolicy, prompts: Tensor, responses: Tensor, temperature: float) -> Tensor:
    """Log-probabilities ``[N, T]`` of ``responses`` given ``prompts`` (teacher forcing, one pass).

    Positions after the response's end hold PAD; their values are meaningless and always masked.
    """
    return _log_probs(policy, prompts, responses, temperature, entropy=False)[0]


def token_log_probs_and_entropy(policy: TinyPolicy, prompts: Tensor, responses: Tensor,
                                temperature: float) -> tuple[Tensor, Tensor]:
    """:func:`token_log_probs` and the per-token entropy ``[N, T]`` (nats, over the whole output vocabulary,
    on temperature-scaled logits), from the same forward pass."""
    logp, entropy = _log_probs(policy, prompts, responses, temperature, entropy=True)
    assert entropy is not None
    return logp, entropy


def _log_probs(policy: TinyPolicy, prompts: Tensor, responses: Tensor, temperature: float, *,
               entropy: bool) -> tuple[Tensor, Tensor | None]:
    p = prompts.shape[1]
    inputs = torch.cat([prompts, responses[:, :-1].clamp_max(PAD)], dim=1)
    logits, _ = policy(inputs)
    logp = torch.log_softmax(logits[:, p - 1:] / temperature, dim=-1)
    index = torch.where(responses < NUM_OUTPUTS, responses, torch.zeros_like(responses))
    chosen = logp.gather(-1, index.unsqueeze(-1)).squeeze(-1)
    return chosen, (-(logp.exp() * logp).sum(-1) if entropy else None)


@torch.no_grad()
def generate(policy: TinyPolicy, prompts: Tensor, temperature: float,
             gen: torch.Generator | None) -> tuple[Tensor, Tensor, Tensor]:
    """Sample (or, with ``gen=None``, greedily decode) responses up to EOS or the length limit.

    Returns ``responses`` (PAD after the end), ``response_mask`` (int64, EOS included) and the
    sampler's log-probabilities (``rollout_log_probs``, 0 where masked).
    """
    n = prompts.shape[0]
    responses = torch.full((n, MAX_RESPONSE_LEN), PAD, dtype=torch.long)
    mask = torch.zeros((n, MAX_RESPONSE_LEN), dtype=torch.long)
    logps = torch.zeros((n, MAX_RESPONSE_LEN), dtype=torch.float32)
    alive = torch.ones(n, dtype=torch.bool)
    logits, state = policy(prompts)
    for t in range(MAX_RESPONSE_LEN):
        logp = torch.log_softmax(logits[:, -1] / temperature, dim=-1)
        if gen is None:
            token = logp.argmax(-1)
        else:
            token = torch.multinomial(logp.exp(), 1, generator=gen).squeeze(-1)
        responses[:, t] = torch.where(alive, token, torch.full_like(token, PAD))
        mask[:, t] = alive.long()
        logps[:, t] = torch.where(alive, logp.gather(-1, token[:, None]).squeeze(-1), torch.zeros(()))
        alive = alive & (token != EOS)
        if t + 1 < MAX_RESPONSE_LEN:
            logits, state = policy(token[:, None], state)
    return responses, mask, logps


def pretrain(policy: TinyPolicy, names: Sequence[str], draw: Callable[[Tensor, torch.Generator], Prompts],
             steps: int, gen: torch.Generator, *, batch: int = 128, lr: float = 0.01,
             on_step: Callable[[int], None] | None = None) -> float:
    """Supervised warm start (see :func:`~dataflex_bus.shim.tasks.pretraining_targets`) on prompts from
    ``draw``, the training split's sampler: held-out prompts are never seen.

    Each prompt's loss is the share-weighted mix of the negative log-likelihoods of its right answer and
    of its habit's answer, per token over both. Turns the random network into a base policy that knows
    the answer format and both rules. Uses its own optimizer, which is discarded. Returns the last loss.
    ``on_step(done)`` is called after each step (a progress bar).
    """
    optimizer = torch.optim.Adam(policy.parameters(), lr=lr)
    # Decaying to 0 settles the weights: the base policy varies less from seed to seed.
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: 1.0 - i / max(steps, 1))
    loss = torch.zeros(())
    for done in range(1, steps + 1):
        ids = torch.randint(0, len(names), (batch,), generator=gen)
        prompts = draw(ids, gen)
        right, habit, share = pretraining_targets(prompts, list(names))
        targets = torch.cat([right, habit])
        weight = torch.cat([share, 1.0 - share])[:, None] * (targets != PAD)
        logp = token_log_probs(policy, prompts.tokens.repeat(2, 1), targets, 1.0)
        loss = -(logp * weight).sum() / weight.sum()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
        if on_step is not None:
            on_step(done)
    return float(loss.detach())
