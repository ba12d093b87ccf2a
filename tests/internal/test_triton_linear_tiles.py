"""The Triton backend's hidden-state tile reducers against float64 formulas.

Runs under ``TRITON_INTERPRET=1`` on CPU tensors (small tiles: the interpreter is slow), or on
CUDA. Each of ``linear_logprob_tile``, ``linear_logprob_tile_grad``, ``linear_kl_tile`` and
``linear_kl_tile_grad`` on ``(r, c)`` tiles that are views of a wider scratch buffer, in fp32
and fp64: random logits, logits shifted by ±1e3 (with a matching shift), ``-inf``, ``+inf``
and NaN entries, tokens inside, outside and before the tile, ``c`` not a multiple of the
block, ``c = 1`` and ``r = 0``; the in-place methods write their tile only and return it; no
method reads a tensor on the host.
"""

from __future__ import annotations

import decimal
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
    from klpen.kernels.triton_backend import TritonBackend
else:  # pragma: no cover
    TritonBackend = None  # type: ignore[assignment,misc]

DEVICE = (
    "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
)
DTYPES = [torch.float32, torch.float64]
CASES = ["random", "up", "down", "special"]
SENTINEL = 7.25  # the scratch buffer outside the tile, which no method may write
R, C = 5, 300  # C not a multiple of the interpreter's block (128)


def _backend() -> TritonBackend:
    return TritonBackend()


def _rtol(dtype: torch.dtype) -> float:
    """Relative to the terms' magnitudes. On CUDA an fp32 ``tl.exp`` is ``ex2.approx`` of the
    rounded ``x log2(e)``, a relative error up to about ``|x| · 6e-8`` (logits to about -25
    here); NumPy's ``exp`` under the interpreter is correctly rounded or nearly."""
    if dtype == torch.float64:
        return 1e-12
    return 4e-6 if DEVICE == "cuda" else 1e-6


def _view(x: torch.Tensor) -> torch.Tensor:
    """``x`` ``(r, c)`` copied into a wider scratch buffer and returned as its ``[:r, :c]``."""
    r, c = x.shape
    buf = torch.full((r + 2, c + 37), SENTINEL, dtype=x.dtype, device=DEVICE)
    buf[:r, :c] = x
    view = buf[:r, :c]
    assert view.stride() == (c + 37, 1)
    return view


def _untouched(view: torch.Tensor) -> bool:
    """Whether the scratch buffer around the tile ``view`` still holds the sentinel."""
    r, c = view.shape
    buf = view.as_strided((r + 2, c + 37), view.stride())
    return bool((buf[:, c:] == SENTINEL).all()) and bool((buf[r:] == SENTINEL).all())


def _cols(r: int, c: int) -> torch.Tensor:
    """Token columns: the last, one inside, one past the tile, one before it, one far past."""
    return torch.tensor([c - 1, min(7, c - 1), c, -1, c + 50][:r], dtype=torch.long, device=DEVICE)


def _logits(case: str, dtype: torch.dtype, r: int = R, c: int = C, seed: int = 0) -> torch.Tensor:
    """``(r, c)`` logits of ``case``: ``"random"``, ``"up"`` / ``"down"`` (±1e3) or
    ``"special"``: row 0 ``-inf`` past column 100, row 1 ``-inf`` at its token's column 7,
    row 2 ``-inf`` only, row 3 ``+inf`` at column 5, row 4 NaN at column 11."""
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(r, c, generator=gen, dtype=torch.float64) * 3
    if case == "up":
        z += 1e3
    elif case == "down":
        z -= 1e3
    elif case == "special":
        z[0, 100:] = -math.inf
        z[1, 7] = -math.inf
        z[2] = -math.inf
        z[3, 5] = math.inf
        z[4, 11] = math.nan
    return z.to(dtype).to(DEVICE)


def _check(got: torch.Tensor, want: torch.Tensor, mag: torch.Tensor, rtol: float) -> None:
    """``got`` against the float64 ``want``: the same NaNs and infinities, and the finite
    values within ``rtol`` times ``mag`` (the sum of the terms' magnitudes)."""
    got = got.double()
    assert got.shape == want.shape
    assert torch.equal(got.isnan(), want.isnan()), (got, want)
    inf = want.isinf()
    assert torch.equal(got[inf], want[inf]), (got, want)
    fin = torch.isfinite(want)
    assert torch.isfinite(got[fin]).all(), (got, want)
    err = (got - want).abs()[fin]
    bound = rtol * mag[fin]
    assert (err <= bound).all(), (err - bound).max()


def _expm1_minus(v: torch.Tensor) -> torch.Tensor:
    """``expm1(v) - v`` in float64: from 60-digit decimal arithmetic where ``|v| < 1``."""
    out = torch.expm1(v) - v
    flat = out.view(-1)
    with decimal.localcontext() as ctx:
        ctx.prec = 60
        for i, x in enumerate(v.reshape(-1).tolist()):
            if abs(x) < 1:
                d = decimal.Decimal(x)
                flat[i] = float(d.exp() - 1 - d)
    return out


# -- linear_logprob_tile ------------------------------------------------------------------


def _logprob_inputs(
    case: str, dtype: torch.dtype, r: int = R, c: int = C
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    z = _logits(case, dtype, r, c)
    shift = None
    if case == "up":
        shift = z.amax(1)  # a matching shift: y <= 0
    elif case == "down":
        shift = torch.full((r,), -1e3, dtype=dtype, device=DEVICE)
    elif case == "special":
        shift = torch.linspace(-0.5, 0.5, r, dtype=dtype, device=DEVICE)
    return _view(z), _cols(r, c), shift


def _want_logprob(
    z: torch.Tensor, col: torch.Tensor, shift: torch.Tensor | None, entropy: bool, exact: bool
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The rows ``s``, ``taken`` (, ``t``) in float64 and their terms' magnitudes, from
    ``y = z - shift`` rounded in ``z``'s dtype (as the kernel forms it)."""
    c = z.shape[1]
    y = (z if shift is None else z - shift[:, None]).double()
    e = y.exp()
    inside = (col >= 0) & (col < c)
    taken = torch.where(inside, y.gather(1, col.clamp(0, c - 1)[:, None])[:, 0], 0.0)
    want, mag = [e.sum(1), taken], [e.sum(1), taken.abs()]
    if entropy:
        terms = e * y
        if exact:
            terms = torch.where(e == 0, 0.0, terms)
        want.append(terms.sum(1))
        mag.append(terms.abs().sum(1))
    return want, mag


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp64"])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("mode", ["plain", "entropy", "exact"])
def test_logprob_tile(dtype: torch.dtype, case: str, mode: str) -> None:
    z, col, shift = _logprob_inputs(case, dtype)
    before = z.clone()
    entropy, exact = mode != "plain", mode == "exact"
    out = _backend().linear_logprob_tile(z, col, shift, entropy, exact)
    assert out.shape == (3 if entropy else 2, R) and out.dtype == dtype
    assert out.is_contiguous()
    assert torch.equal(z.nan_to_num(), before.nan_to_num()) and _untouched(z)
    want, mag = _want_logprob(z, col, shift, entropy, exact)
    # the token's logit is one subtraction in z's dtype: exact
    torch.testing.assert_close(out[1].double(), want[1], rtol=0, atol=0, equal_nan=True)
    for got, w, m in zip(out, want, mag, strict=True):
        _check(got, w, m, _rtol(dtype))
    if case == "special":
        s, taken = out[0], out[1]
        assert s[2] == 0 and s[3] == math.inf and s[4].isnan()
        assert taken[1] == -math.inf and taken[2] == 0 and taken[4] == 0
        if entropy:
            t = out[2]
            # -inf terms: 0 · -inf is 0 when exact, NaN (the row flagged) otherwise
            assert t[4].isnan() and t[3] == math.inf
            if exact:
                assert torch.isfinite(t[:3]).all() and t[2] == 0
            else:
                assert t[:3].isnan().all()
    else:
        assert torch.isfinite(out).all()


# -- linear_logprob_tile_grad -------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp64"])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("entropy", [False, True], ids=["logp", "entropy"])
def test_logprob_tile_grad(dtype: torch.dtype, case: str, entropy: bool) -> None:
    z = _view(_logits(case, dtype, seed=1))
    col = _cols(R, C)
    gen = torch.Generator().manual_seed(2)
    lse = torch.logsumexp(z.double(), 1).to(dtype)
    g = torch.randn(R, generator=gen, dtype=dtype).to(DEVICE)
    ent = (torch.rand(R, generator=gen, dtype=dtype) * 5).to(DEVICE) if entropy else None
    gh = torch.randn(R, generator=gen, dtype=dtype).to(DEVICE) if entropy else None
    log_p = (z - lse[:, None]).double()  # rounded in z's dtype, as the kernel forms it
    p = log_p.exp()
    g64 = g.double()[:, None]
    if ent is None or gh is None:
        want = -p * g64
        mag = p * g64.abs()
    else:
        ent64, gh64 = ent.double()[:, None], gh.double()[:, None]
        want = torch.where(p == 0, 0.0, -p * (g64 + gh64 * (log_p + ent64)))
        mag = torch.where(p == 0, 0.0, p * (g64.abs() + gh64.abs() * (log_p.abs() + ent64)))
    inside = (col >= 0) & (col < C)
    rows = torch.arange(R, device=DEVICE)[inside]
    want[rows, col[inside]] += g64[inside, 0]
    mag[rows, col[inside]] += g64[inside, 0].abs()
    got = _backend().linear_logprob_tile_grad(z, col, lse, g, ent, gh)
    assert got is z and got.data_ptr() == z.data_ptr() and _untouched(z)
    _check(got, want, mag, _rtol(dtype))
    if case == "special":
        # row 0's token is its last column, at -inf: p = 0 there, the gradient is g
        assert (got[0, 100:-1] == 0).all() and got[0, -1] == g[0]
        assert torch.isfinite(got[0]).all()
        assert got[1, 7] == g[1]  # a token at -inf: p = 0, the gradient is g
    else:
        # each row of the gradient of g log p sums to 0 where the token is in the tile
        sums = got.double().sum(1)
        if not entropy:
            want_sums = torch.where(inside, g.double(), 0.0) - g.double()
            torch.testing.assert_close(sums, want_sums, rtol=0, atol=C * _rtol(dtype) * 10)


# -- linear_kl_tile -----------------------------------------------------------------------


def _kl_inputs(
    case: str, dtype: torch.dtype, r: int = R, c: int = C
) -> tuple[torch.Tensor, torch.Tensor]:
    """Policy and reference tiles: ``w = z + offset + noise``, the noise's size per row from
    1e-4 to 3 (``|v|`` on both sides of the series' 1/2), ``offset`` ±1e3 for ``"up"`` /
    ``"down"``; ``"special"``: row 0 ``-inf`` policy logits past column 100, row 1 a ``-inf``
    reference logit, row 2 a NaN policy logit, row 3 a NaN reference logit."""
    gen = torch.Generator().manual_seed(3)
    z = torch.randn(r, c, generator=gen, dtype=torch.float64) * 2
    size = torch.tensor([1e-4, 0.3, 1.0, 3.0, 0.03][:r], dtype=torch.float64)[:, None]
    w = z + size * torch.randn(r, c, generator=gen, dtype=torch.float64)
    if case == "up":
        w += 1e3
    elif case == "down":
        w -= 1e3
    elif case == "special":
        z[0, 100:] = -math.inf
        w[1, 7] = -math.inf
        z[2, 11] = math.nan
        w[3, 12] = math.nan
    return _view(z.to(dtype).to(DEVICE)), _view(w.to(dtype).to(DEVICE))


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp64"])
@pytest.mark.parametrize("case", CASES)
def test_kl_tile(dtype: torch.dtype, case: str) -> None:
    z, w = _kl_inputs(case, dtype)
    centre = (w - z).nan_to_num(0.0, 0.0, 0.0).mean(1)
    before_z, before_w = z.clone(), w.clone()
    out = _backend().linear_kl_tile(z, w, centre)
    assert out.shape == (4, R) and out.dtype == dtype and out.is_contiguous()
    assert torch.equal(z.nan_to_num(), before_z.nan_to_num()) and _untouched(z)
    assert torch.equal(w.nan_to_num(), before_w.nan_to_num()) and _untouched(w)
    v = ((w - z) - centre[:, None]).double()  # rounded in the tiles' dtype, as the kernel does
    e = z.double().exp()
    f = _expm1_minus(v) * e
    want = [e.sum(1), (v * e).sum(1), f.sum(1), e.amax(1)]
    mag = [e.sum(1), (v * e).abs().sum(1), f.abs().sum(1), e.amax(1)]
    for got, want_row, m in zip(out, want, mag, strict=True):
        _check(got, want_row, m, _rtol(dtype))
    if case == "special":
        # -inf policy logits: 0 · inf in the sums over v, NaN; e = 0 adds nothing to S_z
        assert out[1:3, 0].isnan().all() and torch.isfinite(out[[0, 3], 0]).all()
        assert out[1, 1] == -math.inf and out[2, 1] == math.inf
        assert out[:, 2].isnan().all()  # a NaN policy logit: all four, the max too
        assert out[1:3, 3].isnan().all() and torch.isfinite(out[[0, 3], 3]).all()
    else:
        assert torch.isfinite(out).all() and (out[2] > 0).all()


# -- linear_kl_tile_grad ------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp64"])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("masked", [False, True], ids=["plain", "masked"])
def test_kl_tile_grad(dtype: torch.dtype, case: str, masked: bool) -> None:
    z, w = _kl_inputs(case, dtype)
    gen = torch.Generator().manual_seed(4)
    lse_z = torch.logsumexp(z.double(), 1).to(dtype)
    noise = 0.1 * torch.randn(R, generator=gen, dtype=dtype).to(DEVICE)
    shift = (z - w).nan_to_num(0.0, 0.0, 0.0).mean(1) + noise  # ±1e3 where w is offset
    g = torch.randn(R, generator=gen, dtype=dtype).to(DEVICE)
    before_w = w.clone()
    d = ((z - w) - shift[:, None]).double()  # rounded in the tiles' dtype, as the kernel does
    p = (z - lse_z[:, None]).double().exp()
    g64 = g.double()[:, None]
    want, mag = d * p * g64, (d * p * g64).abs()
    if masked:
        want = torch.where(p == 0, 0.0, want)
        mag = torch.where(p == 0, 0.0, mag)
    got = _backend().linear_kl_tile_grad(z, w, lse_z, shift, g, masked)
    assert got is z and got.data_ptr() == z.data_ptr() and _untouched(z)
    assert torch.equal(w.nan_to_num(), before_w.nan_to_num()) and _untouched(w)
    _check(got, want, mag, _rtol(dtype))
    if case == "special":
        # -inf policy logits: p = 0 and (z - w) = -inf, 0 when masked, NaN otherwise
        assert (got[0, 100:] == 0).all() if masked else got[0, 100:].isnan().all()
        assert got[1, 7].isinf() and got[2].isnan().all() and got[3, 12].isnan()
    else:
        assert torch.isfinite(got).all()


# -- shapes, arguments, host syncs --------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp64"])
@pytest.mark.parametrize("shape", [(3, 1), (0, 5), (2, 129)], ids=["c1", "r0", "c129"])
def test_shapes(dtype: torch.dtype, shape: tuple[int, int]) -> None:
    """``c = 1``, ``r = 0`` (no launch) and ``c`` one past a block, all four methods."""
    r, c = shape
    be, rtol = _backend(), _rtol(dtype)
    z, col, shift = _logprob_inputs("random", dtype, r, c)
    out = be.linear_logprob_tile(z, col, shift, True, True)
    assert out.shape == (3, r)
    want, mag = _want_logprob(z, col, shift, True, True)
    for got, want_row, m in zip(out, want, mag, strict=True):
        _check(got, want_row, m, rtol)
    lse = torch.logsumexp(z.double(), 1).to(dtype)
    g = torch.linspace(0.5, 2.0, r, dtype=dtype, device=DEVICE)
    p = (z - lse[:, None]).double().exp()
    g64 = g.double()[:, None]
    want_g, mag_g = -p * g64, p * g64.abs()
    inside = (col >= 0) & (col < c)
    rows = torch.arange(r, device=DEVICE)[inside]
    want_g[rows, col[inside]] += g64[inside, 0]
    mag_g[rows, col[inside]] += g64[inside, 0].abs()
    zg = _view(z.clone())
    got = be.linear_logprob_tile_grad(zg, col, lse, g, None, None)
    assert got is zg and _untouched(zg)
    _check(got, want_g, mag_g, rtol)
    if c == 1:
        # p = 1: rows 0 and 1 take the tile's one column, row 2's token is past it
        assert (got[:2] == 0).all() and got[2, 0] == -g[2]
    zk, wk = _kl_inputs("random", dtype, r, c)
    centre = (wk - zk).mean(1)
    kl = be.linear_kl_tile(zk, wk, centre)
    assert kl.shape == (4, r)
    v = ((wk - zk) - centre[:, None]).double()
    e = zk.double().exp()
    f = _expm1_minus(v) * e
    want = [e.sum(1), (v * e).sum(1), f.sum(1), e.amax(1)]
    mag = [e.sum(1), (v * e).abs().sum(1), f.sum(1), e.amax(1)]
    for got, want_row, m in zip(kl, want, mag, strict=True):
        _check(got, want_row, m, rtol)
    lse_z = torch.logsumexp(zk.double(), 1).to(dtype)
    shift_k = (zk - wk).mean(1)
    d = ((zk - wk) - shift_k[:, None]).double()
    want_k = d * (zk - lse_z[:, None]).double().exp() * g.double()[:, None]
    got_k = be.linear_kl_tile_grad(zk, wk, lse_z, shift_k, g, True)
    assert got_k is zk and _untouched(zk)
    _check(got_k, want_k, want_k.abs(), rtol)


def test_arguments() -> None:
    """Columns must be contiguous, ``ent`` and ``gh`` come together, tiles are fp32 or fp64."""
    be = _backend()
    z = torch.zeros(3, 8, device=DEVICE)
    col = torch.zeros(3, dtype=torch.long, device=DEVICE)
    ones = torch.ones(3, device=DEVICE)
    with pytest.raises(ValueError, match="contiguous"):
        be.linear_logprob_tile(torch.zeros(3, 16, device=DEVICE)[:, ::2], col, None, False, False)
    with pytest.raises(ValueError, match="together"):
        be.linear_logprob_tile_grad(z, col, ones, ones, ones, None)
    with pytest.raises(ValueError, match="fp32 or fp64"):
        be.linear_kl_tile(z.half(), z.half(), ones.half())
    with pytest.raises(ValueError, match="one shape"):
        be.linear_kl_tile(z, z[:2], ones)


def test_tiles_make_no_host_sync() -> None:
    """None of the four methods reads a tensor value on the host (on special logits, with
    every option on), and the count is not vacuous."""
    be = _backend()
    z, col, shift = _logprob_inputs("special", torch.float32)
    zk, wk = _kl_inputs("special", torch.float32)
    vec = torch.linspace(0.5, 1.5, R, device=DEVICE)
    zg = _view(z.clone())
    with CountSyncs() as mode:
        be.linear_logprob_tile(z, col, shift, True, True)
        be.linear_logprob_tile(z, col, None, True, False)
        be.linear_logprob_tile_grad(zg, col, vec, vec, vec, vec)
        be.linear_logprob_tile_grad(zg, col, vec, vec, None, None)
        be.linear_kl_tile(zk, wk, vec)
        be.linear_kl_tile_grad(zk, wk, vec, vec, vec, True)
        be.linear_kl_tile_grad(zk, wk, vec, vec, vec, False)
    assert mode.count == {}
    with CountSyncs() as mode:
        vec.sum().item()
    assert mode.count == {"aten._local_scalar_dense": 1}
