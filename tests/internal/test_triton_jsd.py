"""The Triton kernels of the generalized JSD (klpen.kernels.triton_jsd) against the torch
backend and float64 references.

Runs under ``TRITON_INTERPRET=1`` on CPU tensors (small shapes: the interpreter is slow), or on
CUDA. Values and both gradients for β in {0, 0.1, 0.5, 0.9, 1}, temperatures 1 and 0.7, every
float dtype, on random, peaked, near-identical and offset rows; tiny divergences at common
offsets; -inf entries; NaN/+inf/all -inf rows; identical rows (exactly 0); strided, sliced
and mixed-dtype layouts; both validation modes (no host synchronisation); recorded launches.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
from jsd_references import jsd_gradient_floor, reference_terms
from probes import CountSyncs
from torch import Tensor

import klpen

pytestmark = pytest.mark.skipif(
    "triton" not in klpen.available_backends(),
    reason="the Triton backend needs Triton >= 3.9 and TRITON_INTERPRET=1 (CPU) or a CUDA device",
)

if "triton" in klpen.available_backends():
    from klpen.kernels import get_backend
else:  # pragma: no cover
    get_backend = None  # type: ignore[assignment]

DEVICE = (
    "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
)
BETAS = (0.0, 0.1, 0.5, 0.9, 1.0)
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
INF = math.inf
V = 203  # two blocks of 128 under the interpreter, the second partial


def _triton(
    z: Tensor, w: Tensor, g: Tensor, beta: float, scale: float, needs: tuple[bool, bool]
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    b = get_backend("triton")
    value, saved = b.jsd_forward(z, w, scale, beta)
    gz, gw = b.jsd_backward(z, w, saved, g, scale, beta, needs)
    return value, gz, gw


def _torch(
    z: Tensor, w: Tensor, g: Tensor, beta: float, scale: float, needs: tuple[bool, bool]
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    b = get_backend("torch")
    value, saved = b.jsd_forward(z, w, scale, beta)
    gz, gw = b.jsd_backward(z, w, saved, g, scale, beta, needs)
    return value, gz, gw


def reference(z: Tensor, w: Tensor, beta: float, scale: float) -> Tensor:
    """The definition in float64 (TRL's convention, 0 log 0 = 0), differentiable."""
    log_p = torch.log_softmax(z.double() * scale, -1)
    log_q = torch.log_softmax(w.double() * scale, -1)
    p, q = log_p.exp(), log_q.exp()

    def kl(a: Tensor, log_a: Tensor, log_b: Tensor) -> Tensor:
        return torch.where(a > 0, a * (log_a - log_b), 0.0).sum(-1)

    if beta == 0.0:
        return kl(q, log_q, log_p)
    if beta == 1.0:
        return kl(p, log_p, log_q)
    log_m = torch.log((beta * q + (1 - beta) * p).clamp(min=1e-300))
    return beta * kl(q, log_q, log_m) + (1 - beta) * kl(p, log_p, log_m)


def reference_grads(
    z: Tensor, w: Tensor, g: Tensor, beta: float, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    """``(value, d/dz, d/dw)`` of the float64 reference (``-inf`` logits as ``-800``, where
    ``exp`` underflows to 0 and autograd stays finite)."""
    zz = z.double().clamp(min=-800.0).requires_grad_()
    ww = w.double().clamp(min=-800.0).requires_grad_()
    value = reference(zz, ww, beta, scale)
    (value * g.double()).sum().backward()
    assert zz.grad is not None and ww.grad is not None
    return reference(z, w, beta, scale), zz.grad, ww.grad


def rows(dtype: torch.dtype, scale: float, seed: int = 0) -> tuple[Tensor, Tensor]:
    """Rows of each kind ``(6, V)``: random, peaked (a token far above the rest, the teacher
    near it), near-identical (a +3 offset between the models at temperature 1), a common
    offset of 1e3, a wide-apart pair, identical."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    z, w = randn(6, V) * 3, randn(6, V) * 3
    z[1] = randn(V)
    z[1, 7] += math.log(V) + 4.0
    w[1] = z[1] + 0.3 * randn(V)
    w[2] = z[2] + 1e-3 * randn(V) + (3.0 if scale == 1.0 else 0.0)
    z[3] = randn(V) * 2 + 1e3
    w[3] = z[3] + 0.1 * randn(V)
    z[4], w[4] = randn(V) * 8, randn(V) * 8 - 5
    w[5] = z[5]
    return z.to(dtype).to(DEVICE), w.to(dtype).to(DEVICE)


def _tol(dtype: torch.dtype) -> float:
    """Relative error against the float64 reference (whose own rounding, on near-identical
    rows, is about 1e-9 of the divergence)."""
    return 1e-8 if dtype == torch.float64 else 1e-4


def _close_grad(
    got: Tensor, want: Tensor, dtype: torch.dtype, floor: Tensor | float, slack: float = 1.0
) -> None:
    """A gradient in ``dtype`` against a float64 one: to the compute dtype's tolerance plus the
    rounding of ``dtype``, relative to each row's largest entry or to ``floor`` (per row,
    ``(..., 1)``), whichever is larger. The floor is ``3e-3 k |g|``: a row whose gradient is
    far below ``k |g|`` (a peaked student, an identical pair) is a difference of terms of
    about that size, exact only to the dtype's rounding of them, in every backend. ``slack``
    widens the bound (against the torch backend, itself within the bound of float64)."""
    rel = slack * {torch.bfloat16: 8e-3, torch.float16: 2e-3}.get(dtype, _tol(dtype))
    atol = 2.0**-24 if dtype == torch.float16 else 0.0  # fp16's subnormal spacing
    scale = torch.maximum(want.abs().amax(-1, keepdim=True), torch.as_tensor(floor).double())
    err = ((got.double() - want).abs() - atol).clamp(min=0) / scale.clamp(min=1e-300)
    assert err.amax() <= rel, f"gradient error {err.amax():.3g} (relative to each row's scale)"


def _floor(g: Tensor, scale: float) -> Tensor:
    return 3e-3 * scale * g.double().abs().cpu()[..., None]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_values_and_gradients(dtype: torch.dtype, beta: float, temperature: float) -> None:
    scale = 1.0 / temperature
    z, w = rows(dtype, scale)
    g = torch.randn(6, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    value, gz, gw = _triton(z, w, g, beta, scale, (True, True))
    cdt = torch.promote_types(dtype, torch.float32)
    assert value.dtype == cdt and value.shape == (6,)
    assert gz is not None and gw is not None
    assert gz.dtype == gw.dtype == dtype and gz.shape == gw.shape == z.shape
    want, want_gz, want_gw = reference_grads(z.cpu(), w.cpu(), g.cpu(), beta, scale)
    assert value[5] == 0.0 and (gz[5] == 0).all() and (gw[5] == 0).all()
    torch.testing.assert_close(value.double().cpu(), want, rtol=_tol(dtype), atol=1e-12)
    floor = _floor(g, scale)
    _close_grad(gz.cpu(), want_gz, dtype, floor)
    _close_grad(gw.cpu(), want_gw, dtype, floor)
    # the torch backend: the same formulas in the same dtype
    t_value, t_gz, t_gw = _torch(z, w, g, beta, scale, (True, True))
    assert t_gz is not None and t_gw is not None
    torch.testing.assert_close(
        value, t_value, rtol=1e-9 if cdt == torch.float64 else 1e-4, atol=1e-12
    )
    _close_grad(gz.cpu(), t_gz.double().cpu(), dtype, floor, slack=10.0)
    _close_grad(gw.cpu(), t_gw.double().cpu(), dtype, floor, slack=10.0)


# mixtures within 1e-12 of an end (the kernels' MODE 3), with 1 - β exact as a float64
NEAR_END = (1e-6, 1e-3, 1 - 1e-3, 1 - 1e-6, 1 - 1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("beta", NEAR_END)
def test_mixtures_near_an_end(dtype: torch.dtype, beta: float) -> None:
    """``β`` or ``1 - β`` down to ``1e-12``: the divergence is then of the size of
    ``min(β, 1 - β)``, and values and both gradients keep the dtype's precision relative to
    that size (the mixture's logarithm nearer 0 from one ``log1p``, ``1 - β`` passed exact,
    the Taylor coefficients by the divergence's symmetry). The mixture's first form lost it:
    a relative error of 5e-2 at ``β = 1e-6`` and 1e-3 at ``1 - 1e-5`` in float32."""
    z, w = rows(dtype, 1.0, seed=5)
    g = torch.randn(6, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    value, gz, gw = _triton(z, w, g, beta, 1.0, (True, True))
    assert gz is not None and gw is not None
    zz = z.cpu().double().clone().requires_grad_()
    ww = w.cpu().double().clone().requires_grad_()
    want = reference_terms(zz, ww, beta, 1.0)
    (want * g.cpu().double()).sum().backward()
    assert zz.grad is not None and ww.grad is not None
    rtol = 1e-10 if dtype == torch.float64 else 3e-6
    torch.testing.assert_close(value.double().cpu(), want.detach(), rtol=rtol, atol=0.0)
    floor = jsd_gradient_floor(g, 1.0, beta)
    _close_grad(gz.cpu(), zz.grad, dtype, floor)
    _close_grad(gw.cpu(), ww.grad, dtype, floor)
    t_value, _, _ = _torch(z, w, g, beta, 1.0, (False, False))
    torch.testing.assert_close(value, t_value, rtol=10 * rtol, atol=0.0)


@pytest.mark.parametrize("beta", BETAS)
def test_each_side_alone(beta: float) -> None:
    z, w = rows(torch.float32, 1.0, seed=2)
    g = torch.rand(6, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    _, gz, gw = _triton(z, w, g, beta, 1.0, (True, True))
    _, gz_only, none_w = _triton(z, w, g, beta, 1.0, (True, False))
    _, none_z, gw_only = _triton(z, w, g, beta, 1.0, (False, True))
    assert none_w is None and none_z is None
    assert torch.equal(gz, gz_only) and torch.equal(gw, gw_only)
    assert _triton(z, w, g, beta, 1.0, (False, False))[1:] == (None, None)


@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("offset", [0.0, 3.0, 1e3, -1e4])
@pytest.mark.parametrize("spread", [1e-2, 1e-4, 1e-6])
def test_near_identical_rows_at_common_offsets(beta: float, offset: float, spread: float) -> None:
    """Tiny divergences keep their digits (the centred form), at any common offset and with
    a +3 offset between the two models."""
    gen = torch.Generator().manual_seed(4)
    base = torch.randn(3, V, generator=gen) * 2
    base[1, 11] += 12.0  # a peaked row
    z = base + offset
    w = base + torch.randn(3, V, generator=gen) * spread + offset
    w[2] += 3.0
    value, _, _ = _triton(
        z.to(DEVICE), w.to(DEVICE), torch.ones(3, device=DEVICE), beta, 1.0, (False, False)
    )
    want = reference(z, w, beta, 1.0)  # of the rounded fp32 logits (0 where they agree)
    # relative 1e-4, absolute 1e-10 for divergences below 1e-7 (the contract's full KL rule)
    atol = 1e-10 if spread <= 1e-4 else 0.0
    torch.testing.assert_close(value.double().cpu(), want, rtol=1e-4, atol=atol)
    t_value, _, _ = _torch(z, w, torch.ones(3), beta, 1.0, (False, False))
    torch.testing.assert_close(value.cpu(), t_value, rtol=1e-4, atol=2 * atol)


@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_minus_inf_entries(beta: float, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(5)
    z, w = torch.randn(4, 9, generator=gen) * 3, torch.randn(4, 9, generator=gen) * 3
    z[0, 1] = w[0, 2] = -INF  # each side has a token the other cannot emit
    z[1, 3] = w[1, 3] = -INF  # a token neither can emit
    z[2, :] = torch.tensor([0.0, 1.0, -INF, -INF, -INF, -INF, -INF, -INF, -INF])
    w[3, 4:] = -INF
    z, w = z.to(dtype).to(DEVICE), w.to(dtype).to(DEVICE)
    g = torch.ones(4, device=DEVICE)
    value, gz, gw = _triton(z, w, g, beta, 1.0, (True, True))
    assert gz is not None and gw is not None
    want = reference(z.cpu(), w.cpu(), beta, 1.0)
    torch.testing.assert_close(value.double().cpu(), want, rtol=_tol(dtype), atol=1e-12)
    t_value, t_gz, t_gw = _torch(z, w, g, beta, 1.0, (True, True))
    torch.testing.assert_close(value, t_value, rtol=_tol(dtype), atol=1e-12)
    if 0 < beta < 1:
        assert torch.isfinite(value).all()
        assert torch.isfinite(gz).all() and torch.isfinite(gw).all()
        _, want_gz, want_gw = reference_grads(z.cpu(), w.cpu(), g.cpu(), beta, 1.0)
        _close_grad(gz.cpu(), want_gz, dtype, _floor(g, 1.0))
        _close_grad(gw.cpu(), want_gw, dtype, _floor(g, 1.0))
    else:
        # the student (β = 0) or the teacher (β = 1) without mass where the other has it
        assert torch.isinf(value[0])
        finite = [1, 3] if beta == 0.0 else [1, 2]
        _, want_gz, want_gw = reference_grads(
            z[finite].cpu(), w[finite].cpu(), g[finite].cpu(), beta, 1.0
        )
        _close_grad(gz[finite].cpu(), want_gz, dtype, _floor(g[finite], 1.0))
        _close_grad(gw[finite].cpu(), want_gw, dtype, _floor(g[finite], 1.0))
    # where the torch loops give a number, the kernels give the same one
    for got, ref in ((gz, t_gz), (gw, t_gw)):
        assert ref is not None
        both = torch.isfinite(ref)
        assert torch.equal(torch.isfinite(got), both)
        torch.testing.assert_close(got[both], ref[both], rtol=_tol(dtype), atol=1e-7)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_invalid_rows_give_nan(beta: float) -> None:
    z, w = rows(torch.float32, 1.0, seed=6)
    z[0, 5] = math.nan
    w[1, 9] = INF
    z[2] = -INF
    w[3] = -INF
    g = torch.ones(6, device=DEVICE)
    value, gz, gw = _triton(z, w, g, beta, 1.0, (True, True))
    assert gz is not None and gw is not None
    assert value[:4].isnan().all() and gz[:4].isnan().all() and gw[:4].isnan().all()
    want = reference(z[4:].cpu(), w[4:].cpu(), beta, 1.0)
    torch.testing.assert_close(value[4:].double().cpu(), want, rtol=1e-4, atol=1e-12)
    assert torch.isfinite(gz[4:]).all() and torch.isfinite(gw[4:]).all()


def test_identical_rows_give_exactly_zero() -> None:
    for beta in BETAS:
        for offset in (0.0, 1e4, -3e4):
            z = torch.randn(3, V, generator=torch.Generator().manual_seed(7)) * 5 + offset
            z[0, :10] = -INF
            z = z.to(DEVICE)
            value, gz, gw = _triton(
                z, z.clone(), torch.ones(3, device=DEVICE), beta, 1.3, (True, True)
            )
            assert torch.equal(value, torch.zeros(3, device=DEVICE))
            assert gz is not None and gw is not None
            assert (gz == 0).all() and (gw == 0).all()


def test_strided_sliced_and_mixed_layouts() -> None:
    """Two leading strides (``logits[:, :-1]``), a vocabulary stride > 1, leading axes that
    cannot be merged, a teacher laid out unlike the student, a bf16 student with an fp32
    teacher, V = 1: the same as on contiguous copies (and gradients contiguous)."""
    gen = torch.Generator().manual_seed(8)
    full_z = torch.randn(2, 4, 150, generator=gen).to(DEVICE) * 3
    full_w = torch.randn(2, 4, 150, generator=gen).to(DEVICE) * 3
    g = torch.randn(2, 3, generator=gen).to(DEVICE)
    cases = [
        (full_z[:, :-1], full_w[:, 1:]),  # sliced views, two leading strides
        (full_z[:, :-1], full_w[:, 1:].contiguous()),  # different row layouts
        (full_z.transpose(0, 1)[:3].transpose(0, 1), full_w[:, :3]),  # unmergeable axes
        (full_z[:, :-1, ::2], full_w[:, :-1, 1::2]),  # vocabulary stride 2
        (full_z[:, :-1].bfloat16(), full_w[:, :-1]),  # mixed dtypes
        (full_z[:, :-1, :1], full_w[:, :-1, :1]),  # V = 1: every divergence 0
    ]
    for z, w in cases:
        for beta in (0.0, 0.4, 1.0):
            got = _triton(z, w, g, beta, 1.0, (True, True))
            want = _triton(z.contiguous(), w.contiguous(), g, beta, 1.0, (True, True))
            for a, b in zip(got, want, strict=True):
                assert a is not None and b is not None
                assert a.dtype == b.dtype and a.shape == b.shape and a.is_contiguous()
                torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
            ref = reference(z.cpu(), w.cpu(), beta, 1.0)
            torch.testing.assert_close(got[0].double().cpu(), ref, rtol=1e-4, atol=1e-10)
            assert got[1] is not None and got[1].dtype == z.dtype
            assert got[2] is not None and got[2].dtype == w.dtype


@pytest.mark.parametrize("checks", [True, False])
def test_both_validation_modes_without_host_sync(checks: bool) -> None:
    from klpen.kernels.blocks import sync_free_on_cpu

    z, w = rows(torch.float32, 1.0, seed=9)
    z[4, :3] = -INF
    w[4, 2:6] = -INF  # a row of the direct form
    g = torch.ones(6, device=DEVICE)
    want = _triton(z, w, g, 0.5, 1.0, (True, True))
    with klpen.validation(checks), sync_free_on_cpu(), CountSyncs() as mode:
        got = _triton(z, w, g, 0.5, 1.0, (True, True))
    assert mode.count == {}
    for a, b in zip(got, want, strict=True):
        assert a is not None and b is not None
        assert torch.equal(a, b)


def test_recorded_launches_are_not_run() -> None:
    """Inside ``recording()`` the host code never reads the kernels' unrun outputs."""
    from klpen.kernels.triton_launch import recording

    z, w = rows(torch.bfloat16, 1.0)
    with recording() as launches:
        for beta in (0.0, 0.5, 1.0):
            _, saved = get_backend("triton").jsd_forward(z, w, 1.0, beta)
            get_backend("triton").jsd_backward(z, w, saved, torch.ones(6), 1.0, beta, (True, True))
    names = [
        launch.kernel.fn.__name__ if hasattr(launch.kernel, "fn") else "" for launch in launches
    ]
    assert names == ["_jsd_fwd_kernel", "_jsd_bwd_kernel"] * 3


def test_saved_like_matches_saved() -> None:
    z, w = rows(torch.bfloat16, 1.0)
    b = get_backend("triton")
    _, saved = b.jsd_forward(z, w, 1.0, 0.5)
    like = b.jsd_saved_like(z, w)
    assert [(s.shape, s.dtype) for s in saved] == [(s.shape, s.dtype) for s in like]


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_public_generalized_jsd_under_use_backend(beta: float) -> None:
    """``klpen.generalized_jsd`` with the Triton backend forced: the float64 reference's
    values and gradients (whichever kernels the public operator reaches)."""
    z, w = rows(torch.float32, 1 / 0.7, seed=10)
    zk, wk = z.clone().requires_grad_(), w.clone().requires_grad_()
    with klpen.use_backend("triton"):
        got = klpen.generalized_jsd(zk, wk, beta=beta, temperature=0.7)
        got.sum().backward()
    want, want_gz, want_gw = reference_grads(z.cpu(), w.cpu(), torch.ones(6), beta, 1 / 0.7)
    torch.testing.assert_close(got.detach().double().cpu(), want, rtol=1e-4, atol=1e-12)
    assert zk.grad is not None and wk.grad is not None
    floor = _floor(torch.ones(6), 1 / 0.7)
    _close_grad(zk.grad.cpu(), want_gz, torch.float32, floor)
    _close_grad(wk.grad.cpu(), want_gw, torch.float32, floor)


def offset_rows(offset: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Rows ``(4, V)`` whose teacher sits ``offset`` above the student (below where negative):
    an ordinary pair, a near-identical pair, a peaked pair and a near-identical one scaled up
    (logits of a few hundred), rounded to ``dtype``."""
    gen = torch.Generator().manual_seed(11)

    def randn(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    z = randn(4, V) * 3
    w = z + 0.5 * randn(4, V)
    w[1] = z[1] + 1e-3 * randn(V)
    z[2, 7] += math.log(V) + 4.0
    w[2] = z[2] + 0.3 * randn(V)
    z[3] = randn(V) * 300
    w[3] = z[3] + 1e-2 * randn(V)
    return z.to(dtype).to(DEVICE), (w + offset).to(dtype).to(DEVICE)


@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("offset", [0.0, 1e3, -1e3, 1e4, -1e4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_teacher_offset_from_student(beta: float, offset: float, dtype: torch.dtype) -> None:
    """A teacher whose logits sit 1e3 or 1e4 above or below the student's: the difference
    ``w - z`` and the offset are exact (a two-sum, the offset in logit units), so values and
    gradients keep the dtype's precision, as at offset 0."""
    z, w = offset_rows(offset, dtype)
    g = torch.randn(4, generator=torch.Generator().manual_seed(12)).to(DEVICE)
    value, gz, gw = _triton(z, w, g, beta, 1.0, (True, True))
    assert gz is not None and gw is not None
    # the teacher's softmax does not see the offset: the reference without it, exactly (in
    # float64, and above the reference's clamp of -inf logits at -800)
    want, want_gz, want_gw = reference_grads(z.cpu(), w.cpu().double() - offset, g.cpu(), beta, 1.0)
    torch.testing.assert_close(value.double().cpu(), want, rtol=1e-5, atol=1e-10)
    floor = _floor(g, 1.0)
    _close_grad(gz.cpu(), want_gz, dtype, floor)
    _close_grad(gw.cpu(), want_gw, dtype, floor)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_scalars_are_float64_arguments(dtype: torch.dtype) -> None:
    """``scale``, ``beta``, ``cbeta = 1 - β`` and the forward's Taylor coefficients reach the
    compiled kernels as float64 arguments (the inverse temperature ``1 / 0.7``, ``β = 0.1``
    and ``1 - β`` near an end are not rounded to float32 on the way), whatever the logits'
    dtype."""
    from klpen.kernels import triton_compile
    from klpen.kernels.triton_jsd import N_TERMS
    from klpen.kernels.triton_launch import recording

    if not hasattr(triton_compile, "spec_of"):  # pragma: no cover
        pytest.skip("no compile spec")
    z, w = rows(dtype, 1.0)
    with recording() as launches:
        for beta in (0.0, 1e-3, 0.1, 1.0):
            _, saved = get_backend("triton").jsd_forward(z, w, 1 / 0.7, beta)
            get_backend("triton").jsd_backward(
                z, w, saved, torch.ones(6), 1 / 0.7, beta, (True, True)
            )
    for launch in launches:
        signature = dict(triton_compile.spec_of(launch, 90).signature)
        assert signature["scale"] == signature["beta"] == signature["cbeta"] == "fp64"
        if launch.kernel.fn.__name__ == "_jsd_fwd_kernel":
            assert all(signature[f"g{n}"] == "fp64" for n in range(2, N_TERMS + 2))


@pytest.mark.skipif(DEVICE != "cpu", reason="the interpreter's model of the SFU's error")
@pytest.mark.parametrize("beta", [1 / 16, 0.5, 15 / 16])
@pytest.mark.parametrize("vocab", [256, 203])
def test_the_sfu_logarithm_moves_the_value_by_its_bound(beta: float, vocab: int) -> None:
    """Between ``β = 1/16`` and ``15/16`` the float32 kernels take the mixture's logarithm from
    the special-function unit (``lg2.approx``, within ``2^-22`` of ``log2`` on ``(1/2, 2)`` and
    ``2^-22`` relative elsewhere), which the interpreter models as that bound, every entry
    the same way. On rows whose tokens sit at ``|d|`` of 1/2 to 2, where the direct form's
    two products cancel most, the value moves by what that predicts,
    ``J - J_exact = log(2) Σ p m̃ ε(u)`` over the direct form's tokens (``m̃ = 1 - β + β e^d``,
    ``u`` the logarithm's argument), to a fifth of it and the float32 rounding: the error
    stays what the docstring bounds it by (``8 / (β (1 - β))`` units of it at most relative
    to the terms), and is the hardware's, not the interpreter's exact ``log2``. ``vocab``
    of 256 is two full blocks under the interpreter; 203 ends in a partial one."""
    gen = torch.Generator().manual_seed(21)
    z = torch.randn(3, vocab, generator=gen, dtype=torch.float64)
    sign = torch.where(torch.rand(3, vocab, generator=gen) < 0.5, -1.0, 1.0).double()
    w = z + sign * (1.1 + 0.4 * torch.rand(3, vocab, generator=gen, dtype=torch.float64))
    z32, w32 = z.float(), w.float()
    value, _ = get_backend("triton").jsd_forward(z32, w32, 1.0, beta)
    log_p = torch.log_softmax(z32.double(), -1)
    d = torch.log_softmax(w32.double(), -1) - log_p
    want = reference_terms(z32.double(), w32.double(), beta, 1.0)
    up = d > 0
    coef = torch.where(up, 1 - beta, beta)
    u = (coef * torch.exp(-d.abs()) + 1 - coef).float().double()
    eps = torch.where((u > 0.5) & (u < 2), 2.0**-22, 2.0**-22 * torch.log2(u).abs())
    direct = (d.abs() >= 0.5) & (u != 1)
    m_tilde = 1 - beta + beta * d.exp()
    predicted = math.log(2) * torch.where(direct, log_p.exp() * m_tilde * eps, 0.0).sum(-1)
    assert (direct.double().mean(-1) > 0.6).all()  # most tokens take the direct form
    moved = value.double() - want
    assert ((moved - predicted).abs() <= 0.2 * predicted + 4e-7 * want).all(), (
        moved / want,
        predicted / want,
    )
