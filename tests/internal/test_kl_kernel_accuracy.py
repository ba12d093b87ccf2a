"""The Triton full KL's one-read form on the rows RLHF produces: peaked, near-identical.

A peaked policy row (one token near probability 1) and a reference equal to it up to a small
per-token noise and a common offset (+3, +30, +1e3), at T = 1 and 0.7, in bf16, fp16 and fp32,
against float64 on the same (rounded) logits: the contract's bound (§3: relative error
≤ 1e-4, absolute ≤ 1e-10 below a KL of 1e-7), for the rows the one-read form keeps as well as
for the whole result, values and gradients; and the share of such rows that the form hands to
the float64 redo is small. Runs under ``TRITON_INTERPRET=1`` on CPU tensors (a few thousand
entries per row, several blocks and a partial one), or on CUDA.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

import klpen

pytestmark = pytest.mark.skipif(
    "triton" not in klpen.available_backends(),
    reason="the Triton backend needs Triton >= 3.9 and TRITON_INTERPRET=1 (CPU) or a CUDA device",
)

if "triton" in klpen.available_backends():
    from klpen.kernels.torch_kl import exact_rows
    from klpen.kernels.triton_backend import TritonBackend

DEVICE = (
    "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
)
HALF = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _peaked(
    rows: int, vocab: int, offset: float, noise: float, seed: int
) -> tuple[torch.Tensor, ...]:
    """Policy logits with one token per row at ``log V + 2.7`` above standard normal ones, and
    a reference ``policy + offset + noise · N(0, 1)`` (float32)."""
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(rows, vocab, generator=gen)
    tok = torch.randint(0, vocab, (rows,), generator=gen)
    z[torch.arange(rows), tok] += math.log(vocab) + 2.7
    w = z + offset + noise * torch.randn(rows, vocab, generator=gen)
    return z, w


def _within_contract(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    err = (got.double() - want).abs()
    return torch.where(want > 1e-7, err <= 1e-4 * want, err <= 1e-10)


@pytest.mark.parametrize("dtype", list(HALF), ids=list(HALF))
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("offset", [0.0, 3.0, 30.0, 1e3])
def test_peaked_near_identical_rows(dtype: str, temperature: float, offset: float) -> None:
    """Every row within the contract, the rows kept by the one-read form included; the
    gradient against float64's ``k p (log p/q - KL)``."""
    scale = 1.0 / temperature
    for seed, noise in enumerate((1e-1, 1e-2, 1e-3)):
        z, w = _peaked(12, 1500, offset, noise, seed)
        z, w = z.to(HALF[dtype]).to(DEVICE), w.to(HALF[dtype]).to(DEVICE)
        kl, saved = TritonBackend().full_kl_forward(z, w, scale)
        _, _, want, _, p, log_ratio = exact_rows(z.cpu(), w.cpu(), scale)
        ok = _within_contract(kl.cpu(), want)
        assert ok.all(), (noise, kl[~ok], want[~ok], saved[-1][~ok])
        g = torch.rand(12, device=DEVICE) + 0.5
        grad = TritonBackend().full_kl_backward(z, w, saved, g, scale)
        want_grad = scale * g.cpu().double()[:, None] * (p * log_ratio - p * want[:, None])
        # the gradient in the logits' dtype (its rounding, fp16's subnormal steps), within 1e-4
        # of its row's largest entry or 1e-9 absolute: at a KL far below 1e-7 the top token's
        # entry is the difference of two fp32 numbers that agree to a few units
        atol = 1e-4 * want_grad.abs().amax(-1, keepdim=True) + 1e-9
        if grad.dtype == torch.float16:
            atol = atol + torch.finfo(torch.float16).smallest_normal * 2.0**-10
        rtol = torch.finfo(grad.dtype).eps
        assert ((grad.cpu().double() - want_grad).abs() <= atol + rtol * want_grad.abs()).all()


def test_offsets_cost_no_digits() -> None:
    """A common offset between the two models' logits (up to ±1e4) leaves the one-read form
    exact: the rows are not redone, and their KL is within the contract."""
    z, w = _peaked(8, 1000, 0.0, 0.1, 7)
    for offset in (3.0, 30.0, 1e3, -1e4, 1e4):
        # fp32 logits near 1e4 are multiples of 2^-10: the offset applied to both sides
        ws = w + offset
        kl, saved = TritonBackend().full_kl_forward(z.to(DEVICE), ws.to(DEVICE), 1.0)
        want = exact_rows(z, ws, 1.0)[2]
        assert _within_contract(kl.cpu(), want).all(), offset
        if abs(offset) <= 1e3:
            assert not saved[-1].any(), offset


def test_redo_share_peaked_bf16() -> None:
    """On peaked, near-identical bf16 rows with a +3 offset (the rows of
    ``benchmarks/gpu_model.py``'s redo share, at a smaller vocabulary), few rows need the
    float64 redo."""
    z, w = _peaked(32, 8192, 3.0, 0.1, 0)
    _, saved = TritonBackend().full_kl_forward(
        z.bfloat16().to(DEVICE), w.bfloat16().to(DEVICE), 1.0
    )
    share = saved[-1].float().mean().item()
    assert share <= 0.1, share
