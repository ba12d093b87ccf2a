# mypy: disable-error-code="untyped-decorator"
r"""The generalized Jensen-Shannon divergence of :mod:`klpen.distill` as Triton programs.

The math is that of :mod:`klpen.kernels.torch_jsd` (read its docstring): for student logits
``z``, teacher logits ``w`` and an inverse temperature ``k``, per row, ``p = softmax(k z)``,
``q = softmax(k w)``, ``d = log q - log p`` and, with ``φ(t) = t - log1p(t)``,

.. math::

    J_\beta = \sum_v (1 - \beta)\, p_v\, \varphi\big(\beta\, \mathrm{expm1}(d_v)\big)
        + \beta\, q_v\, \varphi\big((1 - \beta)\, \mathrm{expm1}(-d_v)\big)

(``KL(p ‖ q) = Σ p φ(expm1 d)`` at ``β = 1``, ``KL(q ‖ p) = Σ q φ(expm1(-d))`` at ``β = 0``),
a sum of non-negative terms. One program owns one row of the ``(..., V)`` logits (any
leading shape and strides) and walks its vocabulary in blocks of ``BLOCK`` entries:

- **forward, pass 1** (:func:`_jsd_fwd_kernel`): the running max and ``log Σ exp`` of ``k z``
  and of ``k w``, and the centred sums of the full KL kernel about the running centre
  ``c = E_p[D]``, ``D = k (w - z)``: ``S = Σ e``, ``A = Σ e (D - c)`` and
  ``F = Σ e (expm1(D - c) - (D - c))`` with ``e = exp(k (z - max))``, merged block by block
  (Chan's update, :func:`_merge`). Then ``u = E_p[expm1 v] = (A + F) / S`` with
  ``v = D - c``, and ``d = v - log1p(u) = D - C``, ``C = c + log1p(u)``: the centred form of
  the torch loops, exact for close logits at any common offset.
- **forward, pass 2**: per token ``p``, ``q`` and ``d``, the terms (``φ`` by its series for
  ``|t| < 1/20``, :func:`_phi_small`, else ``coef (q - p) - p log1p(t)``, as the torch
  loops' ``_weighted_phi``), and the means the backward centres on: ``E_p[a]`` and
  ``E_q[b]`` with ``a = -log1p(β expm1 d)``, ``b = -log1p((1 - β) expm1(-d))``
  (``E_p[-d]`` at ``β = 1``, ``E_q[d]`` at ``β = 0``). Each lane keeps its own running sums,
  reduced once per row.
- **backward** (:func:`_jsd_bwd_kernel`), one pass: ``k g (1 - β) p_j (a_j - E_p[a])`` and
  ``k g β q_j (b_j - E_q[b])`` (``k g p_j (-d_j - E_p[-d])`` and ``k g (q_j - p_j)`` at
  ``β = 1``, ``k g (p_j - q_j)`` and ``k g q_j (d_j - E_q[d])`` at ``β = 0``), each side only
  where ``needs`` asks for it, written in its input's dtype.

Rows the centred form cannot promise — a teacher logit ``-inf`` where the student has mass
(then ``u`` no longer counts only the teacher's mass), or ``log1p(u)`` not finite (a
log-ratio beyond the dtype's range) — take ``d = log q - log p`` from the two log-softmaxes
directly, per row, inside the same two passes: a flag, never a gather. ``-inf`` logits are
tokens of probability 0 (the mixture finite, the ends possibly ``+inf``); rows with NaN or
``+inf`` logits, or all ``-inf``, give NaN values and NaN gradients; identical rows give
exactly 0 (``D = 0``, so ``c = u = 0`` and every term is ``φ(0) = 0``).

Dtypes: computed in fp32 for bf16/fp16/fp32 logits, in fp64 for fp64; values ``(...)`` in
that compute dtype; the saved statistics ``(8, N)`` in it too (:data:`STATS`); gradients in
the inputs' dtypes. No step reads a tensor on the host, in either validation mode. With
``TRITON_INTERPRET=1`` the kernels run on CPU tensors (for tests).
"""

from __future__ import annotations

import torch
import triton  # type: ignore[import-untyped]
import triton.language as tl  # type: ignore[import-untyped]
from torch import Tensor

from .triton_backend import (
    _compute_dtype,
    _pair_layout,
    _row_start,
    _tl_dtype,
    _to_bf16,
)
from .triton_launch import block_size, launch, num_warps

__all__ = ["STATS", "jsd_backward", "jsd_forward", "jsd_saved_like"]

# The per-row statistics the forward saves, rows of an (8, N) tensor in the compute dtype:
# the student's centre and log-sum, the teacher's, the offset C of d = k (w - z) - C, the
# row's kind (0 centred, 1 direct d = log q - log p, 2 invalid) and the two means.
STATS = ("c_z", "log_s_z", "c_w", "log_s_w", "offset", "kind", "mean_p", "mean_q")


@triton.jit
def _expm1_minus(v, DT: tl.constexpr):  # type: ignore[no-untyped-def]
    """``expm1(v) - v`` without cancellation (a copy of the full KL kernels' helper): below
    ``|v| = 1/2`` its series ``v² Σ_(n≥2) v^(n-2) / n!`` by Horner's rule in multiply-adds
    (to ``n = 20`` in float64, ``n = 11`` in float32: truncation below the dtype's
    precision), else ``exp(v) - 1 - v``."""
    if DT == tl.float64:
        p = 4.110317623312165e-19  # 1/20!
        p = p * v + 8.22063524662433e-18  # 1/19!
        p = p * v + 1.5619206968586225e-16  # 1/18!
        p = p * v + 2.8114572543455206e-15  # 1/17!
        p = p * v + 4.779477332387385e-14  # 1/16!
        p = p * v + 7.647163731819816e-13  # 1/15!
        p = p * v + 1.1470745597729725e-11  # 1/14!
        p = p * v + 1.6059043836821613e-10  # 1/13!
        p = p * v + 2.08767569878681e-09  # 1/12!
        p = p * v + 2.505210838544172e-08  # 1/11!
        p = p * v + 2.755731922398589e-07  # 1/10!
        p = p * v + 2.7557319223985893e-06  # 1/9!
        p = p * v + 2.48015873015873e-05  # 1/8!
        p = p * v + 0.0001984126984126984  # 1/7!
        p = p * v + 0.001388888888888889  # 1/6!
        p = p * v + 0.008333333333333333  # 1/5!
        p = p * v + 0.041666666666666664  # 1/4!
        p = p * v + 0.16666666666666666  # 1/3!
        p = p * v + 0.5  # 1/2!
    else:
        p = 2.505210838544172e-08  # 1/11!
        p = p * v + 2.755731922398589e-07  # 1/10!
        p = p * v + 2.7557319223985893e-06  # 1/9!
        p = p * v + 2.48015873015873e-05  # 1/8!
        p = p * v + 0.0001984126984126984  # 1/7!
        p = p * v + 0.001388888888888889  # 1/6!
        p = p * v + 0.008333333333333333  # 1/5!
        p = p * v + 0.041666666666666664  # 1/4!
        p = p * v + 0.16666666666666666  # 1/3!
        p = p * v + 0.5  # 1/2!
    direct = tl.exp(v) - 1.0 - v
    return tl.where(tl.abs(v) < 0.5, p * v * v, direct)


def _mode(beta: float) -> int:
    """0 at ``β = 0`` (KL(q ‖ p)), 1 at ``β = 1`` (KL(p ‖ q)), else 2 (the mixture)."""
    return 0 if beta == 0.0 else 1 if beta == 1.0 else 2


@triton.jit
def _expm1(x, DT: tl.constexpr):  # type: ignore[no-untyped-def]
    """``expm1(x)``: ``x + (expm1(x) - x)`` by :func:`_expm1_minus`'s series below
    ``|x| = 1/2``, else ``exp(x) - 1`` (``-1`` at ``-inf``, ``inf`` at ``inf``)."""
    small = tl.abs(x) < 0.5
    xs = tl.where(small, x, 0.0)
    return tl.where(small, xs + _expm1_minus(xs, DT), tl.exp(x) - 1.0)


@triton.jit
def _expm1_neg(em, d):  # type: ignore[no-untyped-def]
    """``expm1(-d)`` from ``em = expm1(d)``: ``-em e^{-d}`` (within a few units of rounding;
    ``-1`` at ``d = inf``)."""
    return tl.where(d == float("inf"), -1.0, -em * tl.exp(-d))


@triton.jit
def _log1p(t):  # type: ignore[no-untyped-def]
    """``log1p(t)`` for ``t >= -1``: ``log(u) - ((u - 1) - t) / u`` with ``u = 1 + t`` (the
    rounding of ``u`` corrected to first order), ``inf`` at ``inf``."""
    u = 1.0 + t
    corr = ((u - 1.0) - t) / tl.where((u > 0) & (u < float("inf")), u, 1.0)
    return tl.log(u) - tl.where(u < float("inf"), corr, 0.0)


@triton.jit
def _phi_small(t, DT: tl.constexpr):  # type: ignore[no-untyped-def]
    """``φ(t) = t - log1p(t) = Σ_(n≥2) (-1)^n t^n / n`` for ``|t| < 1/20``, by Horner's rule
    (to ``n = 8`` in fp32, ``n = 14`` in fp64: truncation below the dtype's precision; an
    alternating series of shrinking terms, no cancellation)."""
    if DT == tl.float64:
        s = 1.0 / 14.0
        s = s * t - 1.0 / 13.0
        s = s * t + 1.0 / 12.0
        s = s * t - 1.0 / 11.0
        s = s * t + 1.0 / 10.0
        s = s * t - 1.0 / 9.0
        s = s * t + 1.0 / 8.0
    else:
        s = 1.0 / 8.0 + tl.zeros_like(t)
    s = s * t - 1.0 / 7.0
    s = s * t + 1.0 / 6.0
    s = s * t - 1.0 / 5.0
    s = s * t + 1.0 / 4.0
    s = s * t - 1.0 / 3.0
    s = s * t + 0.5
    return s * t * t


@triton.jit
def _weighted_phi(p, q, t, log_ratio, coef, DT: tl.constexpr):  # type: ignore[no-untyped-def]
    """``p φ(t)`` for ``t = coef · expm1(x)``, ``x = log q - log p``, ``log_ratio = log1p(t)``:
    the series where ``|t| < 1/20``, else ``coef (q - p) - p log_ratio`` (``coef · q`` where
    ``p = 0``), as the torch loops' ``_weighted_phi``."""
    small = tl.abs(t) < 0.05  # the torch loops' SERIES_BOUND
    series = p * _phi_small(tl.where(small, t, 0.0), DT)
    direct = coef * (q - p) - tl.where(p > 0, p * log_ratio, 0.0)
    return tl.where(small, series, direct)


@triton.jit
def _elements(z, w, c_z, ls_z, c_w, ls_w, offset, direct, scale):  # type: ignore[no-untyped-def]
    """``(p, q, d)`` of one block from the row's statistics: ``log p = k (z - c_z) - log s_z``,
    ``log q`` likewise, ``d = k (w - z) - C`` (centred rows) or ``log q - log p``."""
    log_p = (z - c_z) * scale - ls_z
    log_q = (w - c_w) * scale - ls_w
    d = tl.where(direct, log_q - log_p, (w - z) * scale - offset)
    return tl.exp(log_p), tl.exp(log_q), d


@triton.jit
def _times(x, factor):  # type: ignore[no-untyped-def]
    """``x * factor`` with ``0 * inf = 0``."""
    return tl.where(x == 0, 0.0, x * factor)


@triton.jit
def _merge(S, A, F, c, Sb, Ab, Fb, cb):  # type: ignore[no-untyped-def]
    """Merge two groups' centred sums ``(S, A, F)`` about centres ``c``, ``cb``: moving a
    group's centre by ``δ`` maps ``F`` to ``e^{-δ} F + expm1(-δ) A + (expm1(-δ) + δ) S``."""
    total = S + Sb
    diff = cb - c
    safe = tl.where(total > 0, total, 1.0)
    d1 = tl.where(S > 0, diff * (Sb / safe), diff)  # new centre - c
    d2 = d1 - diff  # new centre - cb
    q1 = _expm1_minus(-d1, S.dtype)
    q2 = _expm1_minus(-d2, S.dtype)
    em1 = q1 - d1
    em2 = q2 - d2
    F1 = _times(F, em1 + 1.0) + tl.where(S > 0, em1 * A + q1 * S, 0.0)
    F2 = _times(Fb, em2 + 1.0) + tl.where(Sb > 0, em2 * Ab + q2 * Sb, 0.0)
    A_new = tl.where(S > 0, A - d1 * S, 0.0) + tl.where(Sb > 0, Ab - d2 * Sb, 0.0)
    return total, A_new, F1 + F2, c + d1


@triton.jit
def _block(z, w, c_z, scale, DT: tl.constexpr):  # type: ignore[no-untyped-def]
    """One block's ``(S_b, A_b, F_b, c_b, hard)`` about its own mean ``c_b = E_p[D]``.

    ``F_b = Σ (e e^v - e - e v)``: where ``e = exp(k (z - c_z))`` underflows or ``z = -inf``,
    the teacher's mass ``e e^v = exp(k (w - c_z) - c_b)`` still counts (so that
    ``S + A + F`` is the teacher's sum); elsewhere ``e (expm1(v) - v)``, by its series for
    small ``v``. ``hard``: tokens with student mass and a ``-inf`` teacher logit.
    """
    y = (z - c_z) * scale
    e = tl.exp(y)
    has = e > 0
    hard = tl.sum((has & (w == -float("inf"))).to(tl.int32), 0)
    ok = has & (w > -float("inf"))
    finite_z = z > -float("inf")
    finite_w = w > -float("inf")
    d = tl.where(finite_z & finite_w, (w - z) * scale, 0.0)
    Sb = tl.sum(e, 0)
    cb = tl.where(Sb > 0, tl.sum(tl.where(ok, e * d, 0.0), 0) / tl.where(Sb > 0, Sb, 1.0), 0.0)
    v_all = d - cb
    v = tl.where(ok, v_all, 0.0)
    Ab = tl.sum(e * v, 0)
    arg = tl.where(finite_z, y + v_all, (w - c_z) * scale - cb)
    mass = tl.where(finite_w, tl.exp(arg), 0.0)
    near = e * _expm1_minus(v, DT)
    far = mass - e - e * v
    term = tl.where(ok & (tl.abs(v) < 0.5), near, tl.where(finite_w, far, 0.0))
    Fb = tl.sum(term, 0)
    return Sb, Ab, Fb, cb, hard


@triton.jit
def _jsd_fwd_kernel(  # type: ignore[no-untyped-def]
    z_ptr,
    w_ptr,
    out_ptr,
    stats_ptr,
    n_rows,
    n_inner,
    zs_outer,
    zs_inner,
    zs_v,
    ws_outer,
    ws_inner,
    ws_v,
    V,
    scale,
    beta,
    MODE: tl.constexpr,
    BLOCK: tl.constexpr,
    DT: tl.constexpr,
):
    """Row ``r``: ``J_β`` into ``out`` ``(N,)`` and the row's :data:`STATS` into ``stats``
    ``(8, N)``, in two reads of both rows (see the module docstring). ``MODE``: 0 at
    ``β = 0``, 1 at ``β = 1``, 2 in between."""
    row = tl.program_id(0).to(tl.int64)
    z_base = _row_start(z_ptr, row, n_inner, zs_outer, zs_inner)
    w_base = _row_start(w_ptr, row, n_inner, ws_outer, ws_inner)
    cols = tl.arange(0, BLOCK)
    # pass 1: both log-sums and the centred sums of D = k (w - z)
    m = tl.full((), -float("inf"), DT)
    m_w = tl.full((), -float("inf"), DT)
    c_z = tl.zeros((), DT)
    c_w = tl.zeros((), DT)
    s_w = tl.zeros((), DT)
    S = tl.zeros((), DT)
    A = tl.zeros((), DT)
    F = tl.zeros((), DT)
    c = tl.zeros((), DT)
    bad = tl.zeros((), tl.int32)
    hard = tl.zeros((), tl.int32)
    for start in range(0, V, BLOCK):
        idx = start + cols
        mask = idx < V
        z = tl.load(z_base + idx.to(tl.int64) * zs_v, mask=mask, other=-float("inf")).to(DT)
        w = tl.load(w_base + idx.to(tl.int64) * ws_v, mask=mask, other=-float("inf")).to(DT)
        bad += tl.sum(
            ((z != z) | (z == float("inf")) | (w != w) | (w == float("inf"))).to(tl.int32), 0
        )
        mw_new = tl.maximum(m_w, tl.max(w, 0))
        cw_new = tl.where(mw_new == -float("inf"), 0.0, mw_new)
        s_w = _times(s_w, tl.exp((c_w - cw_new) * scale)) + tl.sum(tl.exp((w - cw_new) * scale), 0)
        m_w, c_w = mw_new, cw_new
        m_new = tl.maximum(m, tl.max(z, 0))
        c_new = tl.where(m_new == -float("inf"), 0.0, m_new)
        alpha = tl.exp((c_z - c_new) * scale)
        Sb, Ab, Fb, cb, hb = _block(z, w, c_new, scale, DT)
        hard += hb
        S, A, F, c = _merge(_times(S, alpha), _times(A, alpha), _times(F, alpha), c, Sb, Ab, Fb, cb)
        m, c_z = m_new, c_new
    invalid = (bad > 0) | (m == -float("inf")) | (m_w == -float("inf"))
    ls_z = tl.log(S)
    ls_w = tl.log(s_w)
    offset = c + _log1p((A + F) / tl.where(S > 0, S, 1.0))
    direct = (hard > 0) | (offset != offset) | (tl.abs(offset) == float("inf"))
    offset = tl.where(direct, 0.0, offset)
    # pass 2: the terms and the means of the backward, per lane, reduced once
    acc = tl.zeros((BLOCK,), DT)
    acc_p = tl.zeros((BLOCK,), DT)
    acc_q = tl.zeros((BLOCK,), DT)
    for start in range(0, V, BLOCK):
        idx = start + cols
        mask = idx < V
        z = tl.load(z_base + idx.to(tl.int64) * zs_v, mask=mask, other=-float("inf")).to(DT)
        w = tl.load(w_base + idx.to(tl.int64) * ws_v, mask=mask, other=-float("inf")).to(DT)
        p, q, d = _elements(z, w, c_z, ls_z, c_w, ls_w, offset, direct, scale)
        if MODE == 1:  # KL(p || q)
            t = _expm1(d, DT)
            term = _weighted_phi(p, q, t, d, 1.0, DT)
            acc_p += tl.where(p > 0, -p * d, 0.0)
        elif MODE == 0:  # KL(q || p)
            t = _expm1(-d, DT)
            term = _weighted_phi(q, p, t, -d, 1.0, DT)
            acc_q += tl.where(q > 0, q * d, 0.0)
        else:
            em = _expm1(d, DT)
            t1 = beta * em
            t2 = (1.0 - beta) * _expm1_neg(em, d)
            l1 = _log1p(t1)
            l2 = _log1p(t2)
            term = (1.0 - beta) * _weighted_phi(p, q, t1, l1, beta, DT)
            term += beta * _weighted_phi(q, p, t2, l2, 1.0 - beta, DT)
            acc_p += tl.where(p > 0, -p * l1, 0.0)
            acc_q += tl.where(q > 0, -q * l2, 0.0)
        acc += tl.where(mask, term, 0.0)
    value = tl.where(invalid, float("nan"), tl.sum(acc, 0))
    kind = tl.where(invalid, 2.0, tl.where(direct, 1.0, 0.0))
    tl.store(out_ptr + row, value)
    tl.store(stats_ptr + row, c_z)
    tl.store(stats_ptr + n_rows + row, ls_z)
    tl.store(stats_ptr + 2 * n_rows + row, c_w)
    tl.store(stats_ptr + 3 * n_rows + row, ls_w)
    tl.store(stats_ptr + 4 * n_rows + row, offset)
    tl.store(stats_ptr + 5 * n_rows + row, kind.to(DT))
    tl.store(stats_ptr + 6 * n_rows + row, tl.sum(acc_p, 0))
    tl.store(stats_ptr + 7 * n_rows + row, tl.sum(acc_q, 0))


@triton.jit
def _difference(p, q, d, DT: tl.constexpr):  # type: ignore[no-untyped-def]
    """``q - p`` as ``p expm1(d)``: relative to itself, also where ``p ≈ q ≈ 1`` (a peaked
    row), where the difference of the two rounded probabilities keeps only a few digits;
    ``q`` where ``p = 0``."""
    return tl.where(p > 0, p * _expm1(d, DT), q)


@triton.jit
def _store(out, idx, mask, grad, MID: tl.constexpr):  # type: ignore[no-untyped-def]
    """``grad`` stored in ``out``'s dtype, through ``MID`` (float32 below float64) and to
    bfloat16 to nearest (:func:`~klpen.kernels.triton_backend._to_bf16`)."""
    if out.dtype.element_ty == tl.bfloat16:
        tl.store(out + idx, _to_bf16(grad.to(MID)), mask=mask)
    else:
        tl.store(out + idx, grad.to(MID).to(out.dtype.element_ty), mask=mask)


@triton.jit
def _jsd_bwd_kernel(  # type: ignore[no-untyped-def]
    z_ptr,
    w_ptr,
    g_ptr,
    stats_ptr,
    gz_ptr,
    gw_ptr,
    n_rows,
    n_inner,
    zs_outer,
    zs_inner,
    zs_v,
    ws_outer,
    ws_inner,
    ws_v,
    V,
    scale,
    beta,
    MODE: tl.constexpr,
    NEED_Z: tl.constexpr,
    NEED_W: tl.constexpr,
    BLOCK: tl.constexpr,
    DT: tl.constexpr,
    MID_Z: tl.constexpr,
    MID_W: tl.constexpr,
):
    """Row ``r`` of ``d/dz`` (``NEED_Z``) and ``d/dw`` (``NEED_W``) of ``Σ g J_β`` into the
    contiguous ``(N, V)`` outputs, from the forward's ``stats`` ``(8, N)`` and ``g`` ``(N,)``
    in ``DT``: one read of both rows, one write of each gradient (module docstring); NaN on
    invalid rows."""
    row = tl.program_id(0).to(tl.int64)
    z_base = _row_start(z_ptr, row, n_inner, zs_outer, zs_inner)
    w_base = _row_start(w_ptr, row, n_inner, ws_outer, ws_inner)
    c_z = tl.load(stats_ptr + row)
    ls_z = tl.load(stats_ptr + n_rows + row)
    c_w = tl.load(stats_ptr + 2 * n_rows + row)
    ls_w = tl.load(stats_ptr + 3 * n_rows + row)
    offset = tl.load(stats_ptr + 4 * n_rows + row)
    kind = tl.load(stats_ptr + 5 * n_rows + row)
    mean_p = tl.load(stats_ptr + 6 * n_rows + row)
    mean_q = tl.load(stats_ptr + 7 * n_rows + row)
    gk = tl.load(g_ptr + row) * scale
    gk = tl.where(kind == 2.0, float("nan"), gk)
    direct = kind == 1.0
    cols = tl.arange(0, BLOCK)
    for start in range(0, V, BLOCK):
        idx = start + cols
        mask = idx < V
        z = tl.load(z_base + idx.to(tl.int64) * zs_v, mask=mask, other=-float("inf")).to(DT)
        w = tl.load(w_base + idx.to(tl.int64) * ws_v, mask=mask, other=-float("inf")).to(DT)
        p, q, d = _elements(z, w, c_z, ls_z, c_w, ls_w, offset, direct, scale)
        if MODE == 1:  # KL(p || q)
            if NEED_Z:
                gz = tl.where(p > 0, p * (-d - mean_p), 0.0)
                _store(gz_ptr + row * V, idx, mask, gz * gk, MID_Z)
            if NEED_W:
                _store(gw_ptr + row * V, idx, mask, _difference(p, q, d, DT) * gk, MID_W)
        elif MODE == 0:  # KL(q || p)
            if NEED_Z:
                _store(gz_ptr + row * V, idx, mask, -_difference(p, q, d, DT) * gk, MID_Z)
            if NEED_W:
                gw = tl.where(q > 0, q * (d - mean_q), 0.0)
                _store(gw_ptr + row * V, idx, mask, gw * gk, MID_W)
        else:
            em = _expm1(d, DT)
            if NEED_Z:
                a = -_log1p(beta * em)
                gz = tl.where(p > 0, p * (a - mean_p), 0.0) * (1.0 - beta)
                _store(gz_ptr + row * V, idx, mask, gz * gk, MID_Z)
            if NEED_W:
                b = -_log1p((1.0 - beta) * _expm1_neg(em, d))
                gw = tl.where(q > 0, q * (b - mean_q), 0.0) * beta
                _store(gw_ptr + row * V, idx, mask, gw * gk, MID_W)


def _launch_args(
    student: Tensor, teacher: Tensor
) -> tuple[Tensor, Tensor, tuple[int, ...], torch.dtype, int, int]:
    """``(z, w, strides, compute dtype, rows, vocabulary)`` of a pair of logits."""
    dtype = _compute_dtype(torch.promote_types(student.dtype, teacher.dtype))
    vocab = student.shape[-1]
    n = student.numel() // vocab if vocab else 0
    z, w, strides = _pair_layout(student, teacher)
    return z, w, strides, dtype, n, vocab


def jsd_forward(
    student: Tensor, teacher: Tensor, scale: float, beta: float
) -> tuple[Tensor, tuple[Tensor, ...]]:
    """``(J_β per row, saved)`` for logits ``(..., V)`` (any strides): values ``(...)`` in the
    compute dtype; ``saved = (stats,)``, ``(8, N)`` in that dtype (:data:`STATS`). One launch
    of :func:`_jsd_fwd_kernel`, no read of a tensor on the host.

    Example:
        >>> import os
        >>> if os.environ.get("TRITON_INTERPRET") == "1":
        ...     z = torch.tensor([[2.0, 0.0, 0.0]])
        ...     print(jsd_forward(z, torch.zeros(1, 3), 1.0, 0.5)[0])
        ... else:
        ...     print("tensor([0.1087])")
        tensor([0.1087])
    """
    z, w, strides, dtype, n, vocab = _launch_args(student, teacher)
    out = torch.empty(student.shape[:-1], dtype=dtype, device=student.device)
    stats = torch.zeros(len(STATS), n, dtype=dtype, device=student.device)
    if n:
        block = block_size(vocab, student.device)
        launch(
            _jsd_fwd_kernel,
            (n,),
            z,
            w,
            out,
            stats,
            n,
            *strides,
            vocab,
            float(scale),
            float(beta),
            MODE=_mode(beta),
            BLOCK=block,
            DT=_tl_dtype(dtype),
            num_warps=num_warps(block),
        )
    return out, (stats,)


def jsd_saved_like(student: Tensor, teacher: Tensor) -> tuple[Tensor, ...]:
    """Empty tensors shaped as what :func:`jsd_forward` saves: ``((8, N),)`` in the compute
    dtype (for fake tensors and ``torch.compile``)."""
    dtype = _compute_dtype(torch.promote_types(student.dtype, teacher.dtype))
    vocab = student.shape[-1]
    n = student.numel() // vocab if vocab else 0
    return (student.new_empty((len(STATS), n), dtype=dtype),)


def jsd_backward(
    student: Tensor,
    teacher: Tensor,
    saved: tuple[Tensor, ...],
    grad: Tensor,
    scale: float,
    beta: float,
    needs: tuple[bool, bool],
) -> tuple[Tensor | None, Tensor | None]:
    """``(d/dstudent, d/dteacher)`` of ``Σ grad · J_β`` (``grad`` shaped like the values), in
    the inputs' shapes and dtypes (contiguous), ``None`` where ``needs`` leaves a side out.
    One launch of :func:`_jsd_bwd_kernel` writing both gradients.

    Example:
        >>> import os
        >>> z, w = torch.zeros(1, 2), torch.tensor([[0.0, 1.0]])
        >>> if os.environ.get("TRITON_INTERPRET") == "1":
        ...     _, saved = jsd_forward(z, w, 1.0, 0.0)
        ...     print(jsd_backward(z, w, saved, torch.ones(1), 1.0, 0.0, (True, False))[0])
        ... else:
        ...     print("tensor([[ 0.2311, -0.2311]])")
        tensor([[ 0.2311, -0.2311]])
    """
    (stats,) = saved
    outs = [
        torch.empty(x.shape, dtype=x.dtype, device=x.device) if need else None
        for x, need in zip((student, teacher), needs, strict=True)
    ]
    gz, gw = outs
    n = stats.shape[1]
    if not n or (gz is None and gw is None):
        return gz, gw
    dtype, vocab = stats.dtype, student.shape[-1]
    z, w, strides = _pair_layout(student, teacher)
    g = grad.reshape(n).to(dtype).contiguous()
    block = block_size(vocab, student.device)
    launch(
        _jsd_bwd_kernel,
        (n,),
        z,
        w,
        g,
        stats,
        stats if gz is None else gz,
        stats if gw is None else gw,
        n,
        *strides,
        vocab,
        float(scale),
        float(beta),
        MODE=_mode(beta),
        NEED_Z=gz is not None,
        NEED_W=gw is not None,
        BLOCK=block,
        DT=_tl_dtype(dtype),
        MID_Z=_tl_dtype(_compute_dtype(student.dtype)),
        MID_W=_tl_dtype(_compute_dtype(teacher.dtype)),
        num_warps=num_warps(block),
    )
    return gz, gw
