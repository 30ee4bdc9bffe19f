"""The quantile form at scope batch agrees with TRL's own ``GRPOTrainer.get_high_entropy_mask`` (trl 1.16.0,
``top_entropy_quantile``): the same tokens, on random entropies and masks, padding and ties included.

TRL is not a dependency (the TRL host brings it): the test skips without it, and is its own tier (``-m trl``):
importing TRL's GRPO trainer pulls in transformers and accelerate (seconds)."""

from __future__ import annotations

import pytest
import torch
from dataflex_plugins.methods.tokens import select_flat

pytestmark = pytest.mark.trl


class _OneProcess:
    """The accelerator TRL gathers through, for one process: padding and gathering are the identity."""

    @staticmethod
    def pad_across_processes(tensor, dim=0, pad_index=0):
        return tensor

    @staticmethod
    def gather(tensor):
        return tensor


@pytest.fixture(scope="module")
def trl_mask():
    pytest.importorskip("trl")
    grpo = pytest.importorskip("trl.trainer.grpo_trainer")

    class Host:
        accelerator = _OneProcess()

    def mask(entropy: torch.Tensor, valid: torch.Tensor, rho: float) -> torch.Tensor:
        # TRL keeps the tokens at or above the (1 - top_entropy_quantile) quantile
        return grpo.GRPOTrainer.get_high_entropy_mask(Host(), entropy, valid.long(), 1.0 - rho)

    return mask


@pytest.mark.parametrize("seed", range(12))
def test_the_quantile_form_keeps_the_tokens_trl_keeps(trl_mask, seed):
    g = torch.Generator().manual_seed(seed)
    rows, width = int(torch.randint(1, 40, (1,), generator=g)), int(torch.randint(1, 30, (1,), generator=g))
    entropy = torch.rand(rows, width, generator=g) * 4
    if seed % 3 == 0:  # ties: a coarse grid of entropies, as bf16 gives
        entropy = (entropy * 4).round() / 4
    valid = torch.rand(rows, width, generator=g) < 0.7
    for rho in (0.2, 0.05, 0.37, 0.5, 0.8, 1.0):
        ours, _ = select_flat(entropy, valid, rho, "quantile")
        assert torch.equal(ours, trl_mask(entropy, valid, rho)), (seed, rho)


def test_nothing_valid_keeps_nothing_in_both(trl_mask):
    entropy, valid = torch.rand(3, 4), torch.zeros(3, 4, dtype=torch.bool)
    assert not bool(trl_mask(entropy, valid, 0.2).any())
    assert not bool(select_flat(entropy, valid, 0.2, "quantile")[0].any())
