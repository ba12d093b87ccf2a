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

- **forward, pass 1** (:func:`_jsd_fwd_kernel`): per lane, the running max and
  ``Σ exp(k (x - max))`` of ``x = z`` and ``x = w`` (one ``exp`` per entry,
  :func:`_lane_lse`), reduced once per row: ``log s_z``, ``log s_w`` about the rows' maxes
  ``c_z``, ``c_w``, and the direct offset ``L0 = lse(k w) - lse(k z)``.
- **forward, pass 2** (:func:`_terms_pass`): per token, at ``d0 = D - L0`` with
  ``D = k (w - z)`` (the exact difference of the logits, so that a common offset costs no
  digits), ``p``, ``q0 = p e^{d0}`` and the terms (``φ`` by its series for ``|t| < 1/20``,
  :func:`_phi_small`, else ``coef (q - p) - p log1p(t)`` with ``q - p = p expm1(d0)``, as
  the torch loops' ``_weighted_phi``), with the sums that measure and undo the rounding of
  ``L0``: ``U = Σ p expm1(d0)`` gives the shift ``Δ = log1p(U / Σ p)`` (``d = d0 - Δ``
  exactly: ``Σ p e^{d0} = e^Δ``), to within rounding of the divergence itself, and, with
  ``|Δ|`` a few units of rounding of ``L0``, ``J(d) = J(d0) - Δ J'(d0) + Δ²/2 J''(d0)``
  (``J' = Σ (q - p)``, ``Σ q d`` and ``β Σ q b`` at ``β = 1, 0`` and between;
  ``J'' = Σ q``, ``Σ q (d + 1)`` and ``β Σ q (b + (1 - β) p / m)``) to far below the
  dtype's precision; the means the backward centres on, ``E_p[a]`` and ``E_q[b]`` with
  ``a = -log1p(β expm1 d)``, ``b = -log1p((1 - β) expm1(-d))`` (``E_p[-d]`` at ``β = 1``,
  ``E_q[d]`` at ``β = 0``), to first order in ``Δ``. This is the centred form of the torch
  loops (``d = v - log1p(E_p[expm1 v])`` about any centre) with the centre ``L0`` known
  before the pass. Each lane keeps its own running sums, reduced once per row. ``Δ`` is
  the rounding of ``L0``, at most a few units of ``k |c_w - c_z| + |log s_w| + |log s_z|``;
  the correction's remainder, ``O(Δ³)``, is below the rounding of ``D`` itself (a few
  units of ``k |w - z|``), which every form that computes ``D`` shares.
- **backward** (:func:`_jsd_bwd_kernel`), one pass at ``d = D - (L0 + Δ)``:
  ``k g (1 - β) p_j (a_j - E_p[a])`` and ``k g β q_j (b_j - E_q[b])``
  (``k g p_j (-d_j - E_p[-d])`` and ``k g (q_j - p_j)`` at ``β = 1``, ``k g (p_j - q_j)``
  and ``k g q_j (d_j - E_q[d])`` at ``β = 0``, ``q_j - p_j`` as ``p_j expm1(d_j)``), each
  side only where ``needs`` asks for it, written in its input's dtype.

``-inf`` logits are tokens of probability 0 (``d = ±inf`` there; the mixture finite, the
ends possibly ``+inf``, which the shift leaves as it is); rows with NaN or ``+inf`` logits,
or all ``-inf``, give NaN values and NaN gradients; identical rows give exactly 0 (``D = 0``
and ``L0 = 0``, computed alike for both, so ``U = Δ = 0`` and every term is ``φ(0) = 0``).

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

from .triton_launch import GPU_BLOCK, block_size, launch, num_warps
from .triton_rows import (
    _compute_dtype,
    _expm1_minus,
    _pair_layout,
    _row_start,
    _tl_dtype,
    _to_bf16,
)

__all__ = ["STATS", "jsd_backward", "jsd_forward", "jsd_saved_like"]

# The per-row statistics the forward saves, rows of an (8, N) tensor in the compute dtype:
# the student's centre and log-sum, the teacher's (shifted by Δ), the offset L0 + Δ of
# d = k (w - z) - L, the row's kind (0 valid, 2 invalid: NaN/+inf/all -inf) and the two
# means.
STATS = ("c_z", "log_s_z", "c_w", "log_s_w", "offset", "kind", "mean_p", "mean_q")


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
def _elements(z, w, c_z, ls_z, c_w, ls_w, offset, scale):  # type: ignore[no-untyped-def]
    """``(p, q, d)`` of one block from the row's statistics: ``log p = k (z - c_z) - log s_z``,
    ``d = k (w - z) - L`` (``L`` = ``offset``) and ``log q = log p + d``, or, where
    ``z = -inf``, ``k (w - c_w) - log s_w`` (``ls_w``, shifted with ``L``)."""
    log_p = (z - c_z) * scale - ls_z
    d = (w - z) * scale - offset
    log_q = tl.where(z == -float("inf"), (w - c_w) * scale - ls_w, log_p + d)
    return tl.exp(log_p), tl.exp(log_q), d


@triton.jit
def _lane_lse(x, m, s, scale):  # type: ignore[no-untyped-def]
    """One block into per-lane running ``(max m, Σ exp(k (x - m)))``, one ``exp`` per entry:
    the larger of ``x`` and ``m`` is the new max, the other enters as ``exp(-k |x - m|)``;
    ``-inf`` entries add 0, NaN ones make ``s`` NaN."""
    up = x > m
    e = tl.exp(-tl.abs(x - m) * scale)
    e = tl.where(x == -float("inf"), 0.0, e)
    return tl.where(up, x, m), tl.where(up, s * e + 1.0, s + e)


@triton.jit
def _lane_total(m, s, scale):  # type: ignore[no-untyped-def]
    """``(max, centre, Σ)`` of the per-lane ``(m, s)``: the row's max, the finite centre
    ``c`` (the max, 0 where it is infinite) and ``Σ_lanes s exp(k (m - c))``."""
    top = tl.max(m, 0)
    centre = tl.where(tl.abs(top) == float("inf"), 0.0, top)
    total = tl.sum(tl.where(m == -float("inf"), 0.0, s * tl.exp((m - centre) * scale)), 0)
    return top, centre, total


@triton.jit
def _terms_pass(  # type: ignore[no-untyped-def]
    z_base,
    w_base,
    zs_v,
    ws_v,
    V,
    c_z,
    ls_z,
    c_w,
    ls_w,
    offset,
    scale,
    beta,
    MODE: tl.constexpr,
    BLOCK: tl.constexpr,
    DT: tl.constexpr,
):
    """The terms pass at ``d0 = k (w - z) - L`` (``L = offset``), per-lane sums reduced once:
    ``(T, U, P, Q, M_p, M_q, R)`` with ``T = Σ`` terms, ``U = Σ p expm1(d0)`` (``q`` where
    ``p = 0``), ``P = Σ p``, ``Q = Σ q``, ``M_p = Σ p a`` (``Σ p (-d0)`` at ``β = 1``),
    ``M_q = Σ q b`` (``Σ q d0`` at ``β = 0``) and ``R = Σ q p / m`` (the mixture only)."""
    cols = tl.arange(0, BLOCK)
    acc_t = tl.zeros((BLOCK,), DT)
    acc_u = tl.zeros((BLOCK,), DT)
    acc_p = tl.zeros((BLOCK,), DT)
    acc_q = tl.zeros((BLOCK,), DT)
    acc_mp = tl.zeros((BLOCK,), DT)
    acc_mq = tl.zeros((BLOCK,), DT)
    acc_r = tl.zeros((BLOCK,), DT)
    for start in range(0, V, BLOCK):
        idx = start + cols
        mask = idx < V
        z = tl.load(z_base + idx.to(tl.int64) * zs_v, mask=mask, other=-float("inf")).to(DT)
        w = tl.load(w_base + idx.to(tl.int64) * ws_v, mask=mask, other=-float("inf")).to(DT)
        p, q, d = _elements(z, w, c_z, ls_z, c_w, ls_w, offset, scale)
        has_p = p > 0
        has_q = q > 0
        em = _expm1(d, DT)
        acc_u += tl.where(has_p, p * em, q)
        acc_p += p
        acc_q += q
        if MODE == 1:  # KL(p || q): p φ(expm1 d) = p (expm1(d) - d)
            small = tl.abs(em) < 0.05
            series = p * _phi_small(tl.where(small, em, 0.0), DT)
            acc_t += tl.where(small, series, tl.where(has_p, p * (em - d), q))
            acc_mp += tl.where(has_p, -p * d, 0.0)
        elif MODE == 0:  # KL(q || p): q φ(expm1(-d)) = q (expm1(-d) + d)
            t = _expm1_neg(em, d)
            small = tl.abs(t) < 0.05
            series = q * _phi_small(tl.where(small, t, 0.0), DT)
            acc_t += tl.where(small, series, tl.where(has_q, q * (t + d), p))
            acc_mq += tl.where(has_q, q * d, 0.0)
        else:
            t1 = beta * em
            t2 = (1.0 - beta) * _expm1_neg(em, d)
            s1 = tl.abs(t1) < 0.05
            s2 = tl.abs(t2) < 0.05
            f1 = _phi_small(tl.where(s1, t1, 0.0), DT)
            f2 = _phi_small(tl.where(s2, t2, 0.0), DT)
            # log1p by its series t - φ(t) where |t| < 1/20, else log(1 + t) corrected
            l1 = tl.where(s1, t1 - f1, _log1p(t1))
            l2 = tl.where(s2, t2 - f2, _log1p(t2))
            side1 = tl.where(s1, p * f1, tl.where(has_p, p * (t1 - l1), beta * q))
            side2 = tl.where(s2, q * f2, tl.where(has_q, q * (t2 - l2), (1.0 - beta) * p))
            acc_t += (1.0 - beta) * side1 + beta * side2
            acc_mp += tl.where(has_p, -p * l1, 0.0)
            acc_mq += tl.where(has_q, -q * l2, 0.0)
            acc_r += tl.where(has_q & has_p, q * tl.exp(-l1), 0.0)
    return (
        tl.sum(acc_t, 0),
        tl.sum(acc_u, 0),
        tl.sum(acc_p, 0),
        tl.sum(acc_q, 0),
        tl.sum(acc_mp, 0),
        tl.sum(acc_mq, 0),
        tl.sum(acc_r, 0),
    )


@triton.jit
def _shifted(x, slope, delta):  # type: ignore[no-untyped-def]
    """``x - Δ slope``, or ``x`` where ``x`` is infinite."""
    return tl.where(tl.abs(x) == float("inf"), x, x - delta * slope)


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
    ``β = 0``, 1 at ``β = 1``, 2 between."""
    row = tl.program_id(0).to(tl.int64)
    z_base = _row_start(z_ptr, row, n_inner, zs_outer, zs_inner)
    w_base = _row_start(w_ptr, row, n_inner, ws_outer, ws_inner)
    cols = tl.arange(0, BLOCK)
    # pass 1: per-lane log-sums of k z and k w, reduced once
    m_z = tl.full((BLOCK,), -float("inf"), DT)
    m_w = tl.full((BLOCK,), -float("inf"), DT)
    s_z = tl.zeros((BLOCK,), DT)
    s_w = tl.zeros((BLOCK,), DT)
    bad = tl.zeros((BLOCK,), tl.int32)
    for start in range(0, V, BLOCK):
        idx = start + cols
        mask = idx < V
        z = tl.load(z_base + idx.to(tl.int64) * zs_v, mask=mask, other=-float("inf")).to(DT)
        w = tl.load(w_base + idx.to(tl.int64) * ws_v, mask=mask, other=-float("inf")).to(DT)
        bad |= ((z != z) | (z == float("inf")) | (w != w) | (w == float("inf"))).to(tl.int32)
        m_z, s_z = _lane_lse(z, m_z, s_z, scale)
        m_w, s_w = _lane_lse(w, m_w, s_w, scale)
    top_z, c_z, sum_z = _lane_total(m_z, s_z, scale)
    top_w, c_w, sum_w = _lane_total(m_w, s_w, scale)
    invalid = (tl.max(bad, 0) > 0) | (top_z == -float("inf")) | (top_w == -float("inf"))
    ls_z = tl.log(sum_z)
    ls_w = tl.log(sum_w)
    # pass 2 at the direct offset L0 = lse(k w) - lse(k z); its rounding Δ is measured
    offset = (c_w - c_z) * scale + (ls_w - ls_z)
    T, U, P, Q, Mp, Mq, R = _terms_pass(
        z_base, w_base, zs_v, ws_v, V, c_z, ls_z, c_w, ls_w, offset, scale, beta, MODE, BLOCK, DT
    )
    delta = _log1p(U / tl.where(P > 0, P, 1.0))
    # J(d0 - Δ) = J(d0) - Δ J'(d0) + Δ²/2 J''(d0); the means likewise to first order (an
    # infinite sum, a divergence +inf, is left as it is)
    half = 0.5 * delta
    if MODE == 1:
        value = _shifted(T, U - half * Q, delta)
        mean_p = _shifted(Mp, -P, delta)
        mean_q = Mq
    elif MODE == 0:
        value = _shifted(T, Mq - half * (Mq + Q), delta)
        mean_p = Mp
        mean_q = _shifted(Mq, Mq + Q, delta)
    else:
        value = _shifted(T, beta * (Mq - half * (Mq + (1.0 - beta) * R)), delta)
        mean_p = _shifted(Mp, -beta * R, delta)
        mean_q = _shifted(Mq, Mq + (1.0 - beta) * R, delta)
    value = tl.where(invalid, float("nan"), value)
    tl.store(out_ptr + row, value)
    tl.store(stats_ptr + row, c_z)
    tl.store(stats_ptr + n_rows + row, ls_z)
    tl.store(stats_ptr + 2 * n_rows + row, c_w)
    tl.store(stats_ptr + 3 * n_rows + row, ls_w + delta)
    tl.store(stats_ptr + 4 * n_rows + row, offset + delta)
    tl.store(stats_ptr + 5 * n_rows + row, tl.where(invalid, 2.0, 0.0).to(DT))
    tl.store(stats_ptr + 6 * n_rows + row, mean_p)
    tl.store(stats_ptr + 7 * n_rows + row, mean_q)


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
    cols = tl.arange(0, BLOCK)
    for start in range(0, V, BLOCK):
        idx = start + cols
        mask = idx < V
        z = tl.load(z_base + idx.to(tl.int64) * zs_v, mask=mask, other=-float("inf")).to(DT)
        w = tl.load(w_base + idx.to(tl.int64) * ws_v, mask=mask, other=-float("inf")).to(DT)
        p, q, d = _elements(z, w, c_z, ls_z, c_w, ls_w, offset, scale)
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
    # both gradients of the mixture hold the most per entry: blocks of at most 1,024 (4
    # entries per thread), so that they fit the registers without spilling
    both_mixture = _mode(beta) == 2 and gz is not None and gw is not None
    block = block_size(vocab, student.device, cap=1024 if both_mixture else GPU_BLOCK)
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
