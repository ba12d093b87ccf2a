"""``full_kl``'s gradient is at least as accurate as plain fp32 autograd's, where RLHF lives.

The reference logits are the policy's plus a common offset (0, +30, +1e3: two models' logits
need not share a normalisation) plus a perturbation that makes the per-token KL tiny (about
5e-7) or ordinary (about 0.1). Against the float64 gradient of the given fp32 logits, klpen's
fp32 gradient must be no worse than the one autograd gives through fp32 ``log_softmax``. The
rows the forward redoes in float64 are redone in the backward too (``kl_row_stats``' ``redo``),
and every other row's gradient is centred on its own numbers.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import Tensor

import klpen


def _naive_kl(z: Tensor, w: Tensor) -> Tensor:
    log_p, log_q = z.log_softmax(-1), w.log_softmax(-1)
    return (log_p.exp() * (log_p - log_q)).sum(-1)


def _grad(kl: Callable[[Tensor, Tensor], Tensor], z: Tensor, w: Tensor, g: Tensor) -> Tensor:
    leaf = z.detach().clone().requires_grad_()
    (kl(leaf, w) * g.to(leaf.dtype)).sum().backward()
    assert leaf.grad is not None
    return leaf.grad.double()


@pytest.mark.parametrize("offset", [0.0, 30.0, 1e3])
@pytest.mark.parametrize(("size", "delta"), [("tiny", 1e-3), ("ordinary", 0.5)])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_the_gradient_error_is_at_most_plain_fp32_autograd_s(
    offset: float, size: str, delta: float, temperature: float
) -> None:
    gen = torch.Generator().manual_seed(int(offset) + int(delta * 10))
    z = torch.randn(64, 1000, generator=gen) * 2
    noise = torch.randn(64, 1000, generator=gen, dtype=torch.float64) * delta
    w = (z.double() + offset + noise).float()
    g = torch.rand(64, generator=gen) + 0.5
    k = 1.0 / temperature

    def ours(a: Tensor, b: Tensor) -> Tensor:
        return klpen.full_kl(a, b, temperature=temperature)

    def plain(a: Tensor, b: Tensor) -> Tensor:
        return _naive_kl(a * k, b * k)

    truth = _grad(plain, z.double(), w.double(), g)
    error = (_grad(ours, z, w, g) - truth).abs().max().item()
    naive = (_grad(plain, z, w, g) - truth).abs().max().item()
    kl = _naive_kl(z.double() * k, w.double() * k).mean().item()
    assert (kl < 1e-5) == (size == "tiny")
    assert error <= naive, (error, naive)
