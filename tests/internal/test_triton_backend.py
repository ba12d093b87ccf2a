"""The Triton backend against float64 references and klpen's torch functions.

Runs under ``TRITON_INTERPRET=1`` on CPU tensors (small shapes: the interpreter is slow), or on
CUDA. Values and gradients of log-probs, entropy and the full KL, at common shifts to ±1e4,
with -inf entries, NaN/+inf rows, tiny KLs, identical rows, temperatures, all float dtypes,
strided views, V not a multiple of the block and V = 1.
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
    from klpen.kernels.triton_backend import TritonBackend, is_available
else:  # pragma: no cover
    TritonBackend = is_available = None  # type: ignore[assignment,misc]

DEVICE = (
    "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
)
DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64]


def _backend() -> TritonBackend:
    return TritonBackend()


def _ref_logp_ent(z: torch.Tensor, tok: torch.Tensor, scale: float) -> tuple[torch.Tensor, ...]:
    lsm = torch.log_softmax(z.double() * scale, -1)
    logp = lsm.gather(-1, tok[..., None])[..., 0]
    ent = -torch.where(lsm > -math.inf, lsm.exp() * lsm, 0.0).sum(-1)
    return logp, ent


def _ref_kl(z: torch.Tensor, w: torch.Tensor, scale: float) -> torch.Tensor:
    lp = torch.log_softmax(z.double() * scale, -1)
    lq = torch.log_softmax(w.double() * scale, -1)
    ratio = torch.where(lp > -math.inf, lp - lq, 0.0)  # 0 log 0 = 0, also in the gradient
    return torch.where(lp > -math.inf, lp.exp() * ratio, 0.0).sum(-1)


def _tol(dtype: torch.dtype) -> float:
    return 1e-12 if dtype == torch.float64 else 2e-5


def test_available() -> None:
    assert is_available() and TritonBackend.name == "triton"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scale", [1.0, 2.0, 0.5, 1e3])
def test_logprobs_entropy_values_and_grads(dtype: torch.dtype, scale: float) -> None:
    torch.manual_seed(1)
    full = (torch.randn(2, 6, 203, dtype=torch.float64) * 3).to(dtype).to(DEVICE)
    z = full[:, :-1]  # a strided view (two leading strides), V = 203 not a multiple of 128
    tok = torch.randint(0, 203, (2, 5), device=DEVICE)
    logp, ent, saved = _backend().logprobs_forward(z, tok, scale, True)
    cdt = torch.promote_types(dtype, torch.float32)
    assert logp.dtype == cdt and ent.dtype == cdt and logp.shape == (2, 5)
    rl, re = _ref_logp_ent(z, tok, scale)
    torch.testing.assert_close(logp.double(), rl, rtol=_tol(dtype), atol=_tol(dtype) * 10)
    torch.testing.assert_close(ent.double(), re, rtol=_tol(dtype), atol=_tol(dtype) * 10)
    g, h = torch.randn(2, 5, device=DEVICE), torch.randn(2, 5, device=DEVICE)
    grad = _backend().logprobs_backward(z, tok, saved, g, h, scale)
    assert grad.dtype == dtype and grad.shape == z.shape
    zz = z.double().requires_grad_()
    a, b = _ref_logp_ent(zz, tok, scale)
    (g.double() * a + h.double() * b).sum().backward()
    assert zz.grad is not None
    atol = 1e-2 if dtype in (torch.bfloat16, torch.float16) else _tol(dtype) * 10
    torch.testing.assert_close(grad.double(), zz.grad, rtol=1e-2, atol=atol * max(scale, 1.0))


@pytest.mark.parametrize("shift", [-1e4, -57.0, 0.0, 1e3, 1e4])
def test_logprobs_common_shift_costs_no_digits(shift: float) -> None:
    torch.manual_seed(2)
    z = torch.randn(4, 150, dtype=torch.float32, device=DEVICE) * 2
    tok = torch.randint(0, 150, (4,), device=DEVICE)
    logp, ent, _ = _backend().logprobs_forward(z + shift, tok, 1.0, True)
    rl, _ = _ref_logp_ent(z, tok, 1.0)  # the unshifted distribution
    # z + shift rounds each logit by up to eps * |shift|: compare with the rounded logits
    rl2, re2 = _ref_logp_ent(z + shift, tok, 1.0)
    torch.testing.assert_close(logp.double(), rl2, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent.double(), re2, rtol=1e-5, atol=1e-5)
    if shift == 0.0:
        torch.testing.assert_close(logp.double(), rl, rtol=1e-6, atol=1e-6)


def test_logprobs_inf_nan_masked() -> None:
    z = torch.randn(5, 140, device=DEVICE)
    z[0, 10:] = -math.inf  # masked vocabulary
    z[1, 3] = math.inf
    z[2, 7] = math.nan
    z[3] = -math.inf  # all -inf
    tok = torch.tensor([2, 0, 0, 0, 1], device=DEVICE)
    logp, ent, saved = _backend().logprobs_forward(z, tok, 1.0, True)
    rl, re = _ref_logp_ent(z[[0, 4]], tok[[0, 4]], 1.0)
    torch.testing.assert_close(logp[[0, 4]].double(), rl, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ent[[0, 4]].double(), re, rtol=1e-5, atol=1e-6)
    assert torch.isnan(logp[1:4]).all() and torch.isnan(ent[1:4]).all()
    g = torch.ones(5, device=DEVICE)
    grad = _backend().logprobs_backward(z, tok, saved, g, g, 1.0)
    assert torch.isfinite(grad[0]).all() and (grad[0, 10:] == 0).all()
    # a token at -inf has log-prob -inf
    lp, _, _ = _backend().logprobs_forward(z[:1], torch.tensor([50], device=DEVICE), 1.0, False)
    assert lp.item() == -math.inf


def test_logprobs_against_public_torch_functions() -> None:
    torch.manual_seed(3)
    z = torch.randn(3, 4, 129, device=DEVICE, requires_grad=True)
    tok = torch.randint(0, 129, (3, 4), device=DEVICE)
    want = klpen.get_logprobs_for_tokens(z, tok, temperature=0.7)
    (gz,) = torch.autograd.grad(want.sum(), z)
    logp, ent, saved = _backend().logprobs_forward(z.detach(), tok, 1 / 0.7, False)
    assert ent.numel() == 0
    torch.testing.assert_close(logp, want.detach(), rtol=1e-5, atol=1e-6)
    grad = _backend().logprobs_backward(
        z.detach(), tok, saved, torch.ones_like(logp), None, 1 / 0.7
    )
    torch.testing.assert_close(grad, gz, rtol=1e-5, atol=1e-6)
    want_h = klpen.token_entropy(z, temperature=2.0)
    (gh,) = torch.autograd.grad(want_h.sum(), z)
    logp, ent, saved = _backend().logprobs_forward(z.detach(), None, 0.5, True)
    assert logp.numel() == 0
    torch.testing.assert_close(ent, want_h.detach(), rtol=1e-5, atol=1e-6)
    grad = _backend().logprobs_backward(z.detach(), None, saved, None, torch.ones_like(ent), 0.5)
    torch.testing.assert_close(grad, gh, rtol=1e-4, atol=1e-6)


def test_vocab_one() -> None:
    z = torch.randn(3, 1, device=DEVICE)
    tok = torch.zeros(3, dtype=torch.long, device=DEVICE)
    logp, ent, saved = _backend().logprobs_forward(z, tok, 1.0, True)
    assert (logp == 0).all() and (ent == 0).all()
    grad = _backend().logprobs_backward(z, tok, saved, torch.ones(3), torch.ones(3), 1.0)
    assert (grad == 0).all()
    kl, _ = _backend().full_kl_forward(z, z + 3.0, 1.0)
    assert (kl == 0).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scale", [1.0, 0.5, 1e3])
def test_full_kl_values_and_grads(dtype: torch.dtype, scale: float) -> None:
    torch.manual_seed(4)
    zf = (torch.randn(2, 5, 270, dtype=torch.float64) * 2).to(dtype).to(DEVICE)
    wf = (torch.randn(2, 5, 270, dtype=torch.float64) * 2).to(dtype).to(DEVICE)
    z, w = zf[:, :-1], wf[:, 1:]
    kl, saved = _backend().full_kl_forward(z, w, scale)
    assert kl.dtype == torch.promote_types(dtype, torch.float32) and kl.shape == (2, 4)
    want = _ref_kl(z, w, scale)
    torch.testing.assert_close(
        kl.double(), want, rtol=1e-4 if dtype != torch.float64 else 1e-10, atol=1e-10
    )
    g = torch.rand(2, 4, device=DEVICE)
    grad = _backend().full_kl_backward(z, w, saved, g, scale)
    zz = z.double().requires_grad_()
    (g.double() * _ref_kl(zz, w, scale)).sum().backward()
    assert zz.grad is not None and grad.dtype == dtype
    atol = 1e-2 if dtype in (torch.bfloat16, torch.float16) else 1e-5
    torch.testing.assert_close(grad.double(), zz.grad, rtol=1e-2, atol=atol * max(scale, 1.0))


@pytest.mark.parametrize("shift", [-1e4, -57.0, 0.0, 1e4])
@pytest.mark.parametrize("size", [1e-9, 1e-7, 1e-5, 1e-3, 1e-1, 1.0])
def test_full_kl_exact_fp32(shift: float, size: float) -> None:
    torch.manual_seed(5)
    z = torch.randn(6, 150, dtype=torch.float32, device=DEVICE) * 2 + shift
    w = z + torch.randn_like(z) * math.sqrt(2 * size)
    z[5, 2:] = -math.inf  # a two-token row
    w[5, 2:] = -math.inf
    kl, saved = _backend().full_kl_forward(z, w, 1.0)
    want = _ref_kl(z, w, 1.0)  # of the rounded fp32 logits, in float64
    err = (kl.double() - want).abs()
    assert (err <= torch.maximum(1e-4 * want, torch.full_like(want, 1e-10))).all(), (err, want)
    assert (kl >= 0).all()
    grad = _backend().full_kl_backward(z, w, saved, torch.ones(6, device=DEVICE), 1.0)
    zz = z.double().requires_grad_()
    _ref_kl(zz, w, 1.0).sum().backward()
    assert zz.grad is not None
    torch.testing.assert_close(grad.double(), zz.grad, rtol=1e-3, atol=1e-6)


def test_full_kl_edges_and_public() -> None:
    torch.manual_seed(6)
    z = torch.randn(6, 133, device=DEVICE)
    w = torch.randn(6, 133, device=DEVICE)
    z[0, 5:] = -math.inf  # -inf policy logits contribute 0
    w[1, 0] = -math.inf  # where the policy has mass: +inf
    z[2, 1] = math.nan
    w[3, 1] = math.inf
    z[4] = -math.inf
    kl, saved = _backend().full_kl_forward(z, w, 1.0)
    torch.testing.assert_close(kl[0].double(), _ref_kl(z[0], w[0], 1.0), rtol=1e-5, atol=1e-8)
    assert kl[1].item() == math.inf
    assert torch.isnan(kl[2:5]).all()
    torch.testing.assert_close(kl[5].double(), _ref_kl(z[5], w[5], 1.0), rtol=1e-5, atol=1e-8)
    same, _ = _backend().full_kl_forward(z[[0, 5]], z[[0, 5]], 0.3)
    assert (same == 0).all()
    # against klpen.full_kl (the torch backend), values and gradients
    x = torch.randn(2, 3, 200, device=DEVICE, requires_grad=True)
    y = torch.randn(2, 3, 200, device=DEVICE) + 1e4
    want = klpen.full_kl(x, y, temperature=2.0)
    (gx,) = torch.autograd.grad(want.sum(), x)
    kl, saved = _backend().full_kl_forward(x.detach(), y, 0.5)
    torch.testing.assert_close(kl, want.detach(), rtol=1e-4, atol=1e-7)
    grad = _backend().full_kl_backward(x.detach(), y, saved, torch.ones_like(kl), 0.5)
    torch.testing.assert_close(grad, gx, rtol=1e-4, atol=1e-6)


def test_public_functions_under_use_backend() -> None:
    if not hasattr(klpen, "use_backend"):
        pytest.skip("klpen.use_backend is not in this build")
    z = torch.randn(3, 100, device=DEVICE, requires_grad=True)
    tok = torch.randint(0, 100, (3,), device=DEVICE)
    want = klpen.get_logprobs_for_tokens(z, tok)
    with klpen.use_backend("triton"):
        got = klpen.get_logprobs_for_tokens(z, tok)
    torch.testing.assert_close(got, want)
