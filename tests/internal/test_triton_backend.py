"""The Triton backend against float64 references and klpen's torch functions.

Runs under ``TRITON_INTERPRET=1`` on CPU tensors (small shapes: the interpreter is slow), or on
CUDA. Values and gradients of log-probs, entropy and the full KL, at common shifts to ±1e4,
with -inf entries, NaN/+inf rows, tiny KLs, identical rows, temperatures, all float dtypes,
strided views, V not a multiple of the block and V = 1. The sync-free full KL (value checks
off, forced on the CPU by ``sync_free_on_cpu``) against the data-dependent path and the torch
backend on rows that are redone in float64, with a count of host synchronisations.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
from probes import CountSyncs

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


def _redo_inputs(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(2, 4, 150)`` strided policy and reference logits whose rows the forward redoes in
    float64, or that are invalid: row by row (flattened) a tiny KL (reference = policy +
    noise, 1e-12 in fp64), identical rows (KL 0),
    ``-inf`` policy logits, a ``-inf`` reference logit where the policy has mass (KL inf),
    a ``+1e4`` shift with ``-inf`` in both, a ``-1e4`` shift, a policy row of ``-inf`` only
    and a NaN (KL NaN)."""
    gen = torch.Generator().manual_seed(11)
    z = torch.randn(8, 150, generator=gen, dtype=torch.float64) * 2
    noise = 1e-12 if dtype == torch.float64 else 1e-4  # KLs too small for the centred sums
    w = z + noise * torch.randn(8, 150, generator=gen, dtype=torch.float64)
    w[1] = z[1]
    z[2, :40] = -math.inf
    w[3, 7] = -math.inf
    z[4, 10:20] = w[4, 10:20] = -math.inf
    z[4] += 1e4
    w[4] += 1e4
    z[5] -= 1e4
    w[5] -= 1e4
    z[6] = -math.inf
    z[7, 3] = math.nan
    zf = torch.zeros(2, 5, 150, dtype=dtype)
    wf = torch.zeros(2, 5, 150, dtype=dtype)
    zf[:, :4] = z.view(2, 4, 150).to(dtype)
    wf[:, :4] = w.view(2, 4, 150).to(dtype)
    return zf[:, :4].to(DEVICE), wf[:, :4].to(DEVICE)  # strided views (two leading strides)


def _triton_kl(
    z: torch.Tensor, w: torch.Tensor, g: torch.Tensor, scale: float
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...], torch.Tensor]:
    kl, saved = _backend().full_kl_forward(z, w, scale)
    return kl, saved, _backend().full_kl_backward(z, w, saved, g, scale)


@pytest.mark.parametrize(
    "dtype", [torch.bfloat16, torch.float32, torch.float64], ids=["bf16", "fp32", "fp64"]
)
@pytest.mark.parametrize("scale", [1.0, 0.5])
def test_full_kl_sync_free_equals_data_dependent(dtype: torch.dtype, scale: float) -> None:
    """The redo inside the kernels, with value checks on and in the sync-free mode (one
    path: the same bits), against the torch backend and float64, values and gradients."""
    from klpen.kernels import get_backend
    from klpen.kernels.blocks import sync_free_on_cpu

    z, w = _redo_inputs(dtype)
    g = torch.rand(2, 4, device=DEVICE) + 0.5
    kl, saved, grad = _triton_kl(z, w, g, scale)
    with klpen.validation(False), sync_free_on_cpu():
        kl_f, saved_f, grad_f = _triton_kl(z, w, g, scale)
        torch_f = get_backend("torch").full_kl_forward(z, w, scale)
        torch_grad_f = get_backend("torch").full_kl_backward(z, w, torch_f[1], g, scale)
    mask = saved[-1].view(8)
    # the infinite KL and the rows with -inf logits take the redo path, the invalid rows too
    # (made NaN there), the identical rows never; the tiny KLs (1e-9 in fp32, shifted by -1e4
    # or not) stay in the one-read form, its exact differences and moving centre losing no
    # digits to them (in bf16 the noise rounds away: identical rows)
    assert mask[[2, 3, 4, 6, 7]].all() and not mask[[0, 1, 5]].any()
    assert torch.equal(saved_f[-1], saved[-1])
    # the float64 sums in another order: in fp64 the redone KLs are rounding-sized (about
    # 1e-16) and the saved log-sum-exps at 1e4 differ by a few of their ulps
    rtol, atol, atol_stats = (1e-12, 1e-15, 1e-11) if dtype == torch.float64 else (1e-6, 0, 0)
    torch.testing.assert_close(kl_f, kl, rtol=rtol, atol=atol, equal_nan=True)
    for got, want in zip(saved_f[:4], saved[:4], strict=True):
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol_stats, equal_nan=True)
    assert grad_f.dtype == dtype and grad_f.shape == z.shape
    torch.testing.assert_close(grad_f, grad, rtol=rtol, atol=atol, equal_nan=True)
    assert kl[0, 1] == 0 and kl[0, 3] == math.inf and torch.isnan(kl[1, 2:]).all()
    # the torch backend, default and sync-free paths: values, and gradients of the valid rows
    torch_kl, torch_saved = get_backend("torch").full_kl_forward(z, w, scale)
    torch_grad = get_backend("torch").full_kl_backward(z, w, torch_saved, g, scale)
    for want_kl, want_grad in ((torch_kl, torch_grad), (torch_f[0], torch_grad_f)):
        torch.testing.assert_close(kl_f, want_kl, rtol=max(rtol, 1e-6), atol=atol, equal_nan=True)
        torch.testing.assert_close(
            grad_f.view(8, 150)[:6], want_grad.view(8, 150)[:6], equal_nan=True
        )
    # against float64 log_softmax, the finite valid rows
    want = _ref_kl(z, w, scale).view(8)
    rows = [0, 1, 2, 4, 5]
    torch.testing.assert_close(kl_f.view(8)[rows].double(), want[rows], rtol=1e-5, atol=1e-12)


def test_full_kl_sync_free_makes_no_host_sync() -> None:
    """No value read on the host in the forward and backward (with redo rows and invalid
    rows present), sync-free mode or not: the redone rows are finished inside the kernels."""
    from klpen.kernels.blocks import sync_free_on_cpu

    z, w = _redo_inputs(torch.float32)
    g = torch.ones(2, 4, device=DEVICE)
    with klpen.validation(False), sync_free_on_cpu(), CountSyncs() as mode:
        _triton_kl(z, w, g, 0.5)
    assert mode.count == {}
    with klpen.validation(False), CountSyncs() as mode:
        _triton_kl(z, w, g, 0.5)
    assert mode.count == {}


def test_public_full_kl_sync_free_under_use_backend() -> None:
    """``klpen.full_kl`` on the Triton backend, sync-free: no host sync through the custom
    operator and autograd, and the same values and gradients as the data-dependent path."""
    if not hasattr(klpen, "use_backend"):
        pytest.skip("klpen.use_backend is not in this build")
    from klpen.kernels.blocks import sync_free_on_cpu

    z, w = _redo_inputs(torch.float32)
    z = z.clone().requires_grad_()

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        z.grad = None
        kl = klpen.full_kl(z, w, temperature=2.0)
        kl.nan_to_num(0.0, 0.0, 0.0).sum().backward()
        assert z.grad is not None
        return kl.detach(), z.grad

    with klpen.validation(False), klpen.use_backend("triton"):
        want, want_grad = run()
        with sync_free_on_cpu(), CountSyncs() as mode:
            got, got_grad = run()
    assert mode.count == {}
    torch.testing.assert_close(got, want, rtol=0.0, atol=0.0, equal_nan=True)
    torch.testing.assert_close(got_grad, want_grad, rtol=0.0, atol=0.0, equal_nan=True)


def _wide(values: torch.Tensor) -> torch.Tensor:
    """``values`` ``(N, V)`` as a view whose vocabulary stride ``s`` has ``(V - 1) s ≥ 2^31``
    (the rows 1 apart): a transposed product's layout. Only its ``N V`` entries are written,
    each on its own page of a large, otherwise untouched storage."""
    n, vocab = values.shape
    stride = (1 << 31) // (vocab - 1) + 1
    storage = torch.empty((vocab - 1) * stride + n, dtype=values.dtype)
    wide = storage.as_strided((n, vocab), (1, stride))
    wide.copy_(values)
    assert (vocab - 1) * wide.stride(-1) >= 1 << 31
    return wide


def test_vocabulary_stride_past_2_31_through_the_public_api() -> None:
    """64-bit offsets: log-probs, entropy, full KL and their gradients on logits whose
    vocabulary offsets ``idx · stride`` pass 2^31, against torch on a contiguous copy."""
    torch.manual_seed(3)
    n, vocab = 2, 300
    z64 = torch.randn(n, vocab, dtype=torch.float64) * 3
    w64 = z64 + torch.randn(n, vocab, dtype=torch.float64)
    z = _wide(z64.to(torch.bfloat16)).requires_grad_()
    w = _wide(w64.to(torch.bfloat16))
    tok = torch.tensor([vocab - 1, vocab // 2])
    with klpen.use_backend("triton"):
        logp, ent = klpen.logprobs_and_entropy(z, tok)
        kl = klpen.full_kl(z, w)
        (gz,) = torch.autograd.grad(logp.sum() + ent.sum() + kl.sum(), z)
    zc = z.detach().double().contiguous().requires_grad_()
    rl, re = _ref_logp_ent(zc, tok, 1.0)
    rk = _ref_kl(zc, w.double(), 1.0)
    torch.testing.assert_close(logp.double(), rl, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent.double(), re, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kl.double(), rk, rtol=1e-4, atol=1e-7)
    (rg,) = torch.autograd.grad(rl.sum() + re.sum() + rk.sum(), zc)
    torch.testing.assert_close(gz.double(), rg, rtol=2e-2, atol=2e-3)  # bf16 gradient


@pytest.mark.parametrize(
    ("capability", "expected"),
    [
        ((8, 0), "triton"),
        ((9, 0), "triton"),
        ((8, 6), "torch"),
        ((8, 9), "torch"),
        ((10, 0), "torch"),
        ((7, 5), "torch"),
    ],
)
def test_auto_picks_triton_only_on_compiled_capabilities(
    monkeypatch: pytest.MonkeyPatch, capability: tuple[int, int], expected: str
) -> None:
    """``"auto"``: Triton on CUDA devices of the capabilities the compile test covers."""
    import types

    from klpen.kernels import TRITON_CAPABILITIES, select_backend
    from klpen.kernels.triton_compile import TARGETS

    assert {(t // 10, t % 10) for t in TARGETS} == TRITON_CAPABILITIES
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    on_cuda = types.SimpleNamespace(device=torch.device("cuda", 0))
    assert select_backend(on_cuda).name == expected  # type: ignore[arg-type]
    with klpen.use_backend("triton"):
        assert select_backend(on_cuda).name == "triton"
    assert select_backend(torch.zeros(1)).name == "torch"
