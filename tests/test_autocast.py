"""klpen under ``torch.autocast`` on the CPU (bf16), as a trainer's mixed-precision step runs it.

The logits come out of an autocast matmul in bf16; klpen computes in fp32 from them and returns
fp32, equal to a float64 reference on the same bf16 logits; the gradient reaches the fp32
parameters through autocast's cast, equal to the reference's gradient through the same graph.
"""

from __future__ import annotations

import pytest
import torch

import klpen

N, H, V = 12, 16, 50


def _setup(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=gen)
    weight = torch.randn(V, H, generator=gen).requires_grad_(True)
    ref_weight = torch.randn(V, H, generator=gen)
    tokens = torch.randint(V, (N,), generator=gen)
    return hidden, weight, ref_weight, tokens


def _reference_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.double(), -1).gather(-1, tokens[:, None])[:, 0]


@pytest.mark.parametrize("seed", [0, 1])
def test_logprobs_and_entropy_from_autocast_logits(seed: int) -> None:
    hidden, weight, _, tokens = _setup(seed)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = hidden @ weight.T
        assert logits.dtype == torch.bfloat16
        logp = klpen.get_logprobs_for_tokens(logits, tokens)
        entropy = klpen.token_entropy(logits)
    assert logp.dtype == torch.float32 and entropy.dtype == torch.float32
    expected = _reference_logprobs(logits.detach(), tokens)
    torch.testing.assert_close(logp.double(), expected, rtol=1e-6, atol=1e-6)
    log_p = torch.log_softmax(logits.detach().double(), -1)
    torch.testing.assert_close(
        entropy.double(), -(log_p.exp() * log_p).sum(-1), rtol=1e-6, atol=1e-6
    )
    (grad,) = torch.autograd.grad(logp.sum(), weight)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        again = hidden @ weight.T
    (expected_grad,) = torch.autograd.grad(
        torch.log_softmax(again.float(), -1).gather(-1, tokens[:, None]).sum(), weight
    )
    assert grad.dtype == torch.float32 and torch.isfinite(grad).all()
    torch.testing.assert_close(grad, expected_grad, rtol=1e-2, atol=1e-2)


def test_full_kl_and_k3_from_autocast_logits() -> None:
    hidden, weight, ref_weight, tokens = _setup(2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = hidden @ weight.T
        ref_logits = hidden @ ref_weight.T
        kl = klpen.full_kl(logits, ref_logits)
        k3 = klpen.estimate_kl(
            klpen.get_logprobs_for_tokens(logits, tokens),
            klpen.get_logprobs_for_tokens(ref_logits, tokens),
            "k3",
        )
    assert kl.dtype == torch.float32 and k3.dtype == torch.float32
    lp = torch.log_softmax(logits.detach().double(), -1)
    lq = torch.log_softmax(ref_logits.detach().double(), -1)
    torch.testing.assert_close(kl.double(), (lp.exp() * (lp - lq)).sum(-1), rtol=1e-5, atol=1e-6)
    r = lp.gather(-1, tokens[:, None])[:, 0] - lq.gather(-1, tokens[:, None])[:, 0]
    torch.testing.assert_close(k3.double(), torch.expm1(-r) + r, rtol=1e-5, atol=1e-6)
    kl.sum().backward()
    assert weight.grad is not None and torch.isfinite(weight.grad).all()
