# mypy: disable-error-code="untyped-decorator"
r"""The generalized Jensen-Shannon divergence of :mod:`klpen.distill` as Triton programs.

Inputs: student logits ``z`` and teacher logits ``w``, both ``(..., V)`` with any strides
(the teacher's row layout may differ; mixed dtypes are promoted), an inverse temperature
``k = scale`` and ``β = beta`` in ``[0, 1]``. Per row, ``p = softmax(k z)``,
``q = softmax(k w)``, ``d = log q - log p`` (so ``q = p e^d``), ``m = β q + (1 - β) p`` and
``m̃ = m / p = 1 - β + β e^d``. The divergence is a sum of non-negative terms
``J_β = Σ_v p_v G(d_v)`` with

.. math::

    G(d) = \beta\, d\, e^d - \tilde m \log \tilde m
         = (1 - \beta)\, \varphi(\beta\, \mathrm{expm1}\, d)
           + \beta\, e^d\, \varphi\big((1 - \beta)\, \mathrm{expm1}(-d)\big),
    \qquad \varphi(t) = t - \log(1 + t),

between (``β KL(q ‖ m) + (1 - β) KL(p ‖ m)``), ``G(d) = e^d - 1 - d`` at ``β = 1``
(``KL(p ‖ q)``) and ``G(d) = 1 + (d - 1) e^d`` at ``β = 0`` (``KL(q ‖ p)``), the convention
of :mod:`klpen.kernels.torch_jsd` (whose loops compute the same sums). ``G(0) = G'(0) = 0``
and ``G`` is analytic in the disc ``|d| < π`` (the zeros of ``m̃`` lie at
``Re d = log((1 - β) / β)``, ``Im d = ±π``), so:

- where ``|d| < SMALL`` (``1/2`` in float32, ``1/8`` in float64), ``p G(d) = p d² Σ g_n d^(n-2)``
  (``n = 2 … 10``, the coefficients of :func:`coefficients`, computed on the host in float64
  for the given ``β``: truncation below ``2e-9`` and ``5e-15`` of the term); no cancellation;
- elsewhere the direct form: ``q - p - p d`` (``β = 1``), ``p - q + q d`` (``β = 0``), and
  between ``β q B - (1 - β) p L`` with ``L = log m̃`` and ``B = d - L = log(q / m)``, each
  from one logarithm:

  - ``MODE`` 2, ``1/16 <= β <= 15/16`` (:func:`_mixture_logs_middle`): with ``s = e^{-|d|}``,
    ``L = log(β s + 1 - β)`` at ``d <= 0`` and ``d + log((1 - β) s + β)`` at ``d > 0``, both
    to a few units of rounding of 1 (and of ``|d|``), in float32 from the special-function
    unit's ``log2`` (:func:`_lg2_sfu`: one instruction, within ``2^-22`` of the argument's
    ``log2``, which ``s`` itself from ``exp2`` is off by already); the two products cancel
    at most by a factor ``2 m̃ / (β (1 - β) d²)`` of those (about ``8 / (β (1 - β))`` at
    ``|d| = 1/2``);
  - ``MODE`` 3, nearer an end, where that factor grows as ``1 / min(β, 1 - β)``
    (:func:`_mixture_logs_near_end`): ``L`` and ``B`` each relative to itself, the smaller
    from one ``log1p`` (``log`` as :func:`_log_unit`, to a unit of rounding) and the other
    as ``d`` less it; the products then cancel by a factor of a few. ``1 - β`` comes as its
    own float64 argument (``cbeta``), so that
    ``β = 1 - 1e-12`` is not rounded to 1 in float32, and the coefficients above ``β = 0.9``
    by the divergence's symmetry (:func:`coefficients`).

One program owns one row and walks its vocabulary in blocks of ``BLOCK`` entries, the full
blocks without a mask and the rest in one masked block (:func:`_pair`):

- **forward, pass 1** (:func:`_jsd_fwd_kernel`): per group of ``GROUP`` entries (those one
  thread holds), the running max and ``Σ exp(k (x - max))`` of ``x = z`` and ``x = w`` (one
  ``exp2`` per entry, :func:`_group_lse`), reduced once per row to the maxes ``c_z``,
  ``c_w`` and the log-sums ``log s_z``, ``log s_w``; a NaN or ``+inf`` logit, or a row of
  ``-inf``, shows in these.
- **forward, pass 2** (:func:`_terms_pass`), at
  ``d0 = ((w - z) - (c_w - c_z)) k - (log s_w - log s_z)``: both differences of logits are
  exact (Knuth's two-sum, :func:`_elements`), so that ``d0`` is off by a few units of
  rounding of ``|d0| + |log s_w - log s_z|`` whatever the offset between the two models
  (teacher logits ``1e4`` above the student's cost no digits); ``log p = k (z - c_z) - log s_z``,
  ``log q = k (w - c_w) - log s_w``, and ``p``, ``q`` from one ``exp2`` of the larger and its
  product with ``s = e^{-|d0|}``. Per-lane sums, reduced once: ``T = Σ p G(d0)``, ``P = Σ p``,
  ``Q = Σ q`` and the means the backward centres on, ``M_p = Σ p a`` and ``M_q = Σ q b`` with
  ``a = -L``, ``b = B`` (``a = -d``, ``b = 0`` at ``β = 1``; ``a = 0``, ``b = d`` at ``β = 0``).
- **the offset's rounding**: the rounded log-sums shift every ``d0`` alike, ``d = d0 - Δ``
  with ``Δ = log(Q / P)`` (``Σ p e^d = Σ p``), a few units of rounding of
  ``|log s_w| + |log s_z|``. The value is corrected to second order,
  ``J(d) = J(d0) - Δ J'(d0) + Δ²/2 J''(d0)`` (``J' = Q - P``, ``Σ q d0`` and ``β M_q`` at
  ``β = 1``, ``0`` and between; ``J'' = Q``, ``Σ q (d0 + 1)`` and
  ``β (M_q + (1 - β) R)``), the means to first order (``Σ p a' = -β R``,
  ``Σ (q b)' = M_q + (1 - β) R``), with ``R = Σ q p / m`` taken as ``Q`` (exact where
  ``p = q``): ``(1 - β) R`` lies in ``[0, Q]``, so the value moves by at most ``Δ² β Q / 2``
  and the gradients below by at most ``|Δ| p_j k |g|`` and ``|Δ| q_j k |g|``, the size of
  their own rounding. The remainder, ``O(Δ³)``, is below the rounding of ``d0`` itself.
- **backward** (:func:`_jsd_bwd_kernel`), one pass at ``d = d0 - Δ`` (the offset saved with
  ``Δ``): ``d/dz = k g (1 - β) p (a - E_p[a])`` and ``d/dw = k g β q (b - E_q[b])`` (at
  ``β = 1``: ``k g p (-d - E_p[-d])`` and ``k g (q - p)``; at ``β = 0``: ``k g (p - q)`` and
  ``k g q (d - E_q[d])``; ``q - p`` as ``p expm1(d)`` by its polynomial for ``|d| < SMALL``,
  relative to itself also where ``p ≈ q ≈ 1``), each side only where ``needs`` asks for it,
  written in its input's dtype. ``a`` and ``b`` come from the one ``log`` also where ``d`` is
  small: they and the means are exact to a few units of rounding of 1, so each gradient entry
  to the rounding of terms of size ``k |g| p_j`` (``q_j``), relative to itself where it is
  larger.

``-inf`` logits are tokens of probability 0: ``d = +inf`` where the student's alone is
``-inf``, ``-inf`` where the teacher's is, kept infinite where the divergence is (``β = 0``
and ``β = 1``: ``J = +inf``, which the shift leaves as it is; a probability beside it that
underflowed to 0, a finite logit far below its row's top, adds 0, not ``0 · inf``) and else
held at ``±BIG``
(``1e30``, ``1e300`` in float64; also where both are ``-inf``), so that every product
with the zero probability is 0 and the mixture's terms keep their exact limits
(``-β q log β`` where ``p = 0``, ``-(1 - β) p log(1 - β)`` where ``q = 0``). Rows with NaN or
``+inf`` logits, or all ``-inf``, give NaN values and NaN gradients; identical rows give
exactly 0 (``d0 = 0`` and ``P = Q`` bit for bit, so ``Δ = 0``, ``p G(0) = 0`` and every mean
is 0).

Dtypes: computed in float32 for bf16/fp16/fp32 logits, in float64 for fp64 (``scale``,
``beta``, ``cbeta = 1 - β`` and the coefficients are float64 kernel arguments, rounded once
to the compute dtype in the kernel; float64 blocks hold at most 1,024 entries); values
``(...)`` in the compute dtype; the saved statistics ``(8, N)`` in it too (:data:`STATS`);
gradients in the inputs' dtypes. No step reads a tensor on the
host, in either validation mode. With ``TRITON_INTERPRET=1`` the kernels run on CPU tensors
(for tests).
"""

from __future__ import annotations

import math
import os

import torch
import triton  # type: ignore[import-untyped]
import triton.language as tl  # type: ignore[import-untyped]
from torch import Tensor

from .torch_jsd import near_end
from .triton_launch import GPU_BLOCK, GPU_BLOCKS, block_size, launch, num_warps
from .triton_rows import (
    _compute_dtype,
    _pair_layout,
    _row_start,
    _tl_dtype,
    _to_bf16,
)

__all__ = ["STATS", "jsd_backward", "jsd_forward", "jsd_saved_like"]

LOG2E = tl.constexpr(1.4426950408889634)  # log2(e): exp(x) = exp2(x log2(e))
LN2 = tl.constexpr(0.6931471805599453)  # log(2): log(x) = log2(x) log(2)
# How the mixture's float32 logarithm is taken (:func:`_lg2_sfu`), fixed as the kernels are
# defined: 1 compiled for an NVIDIA GPU (inline PTX), 2 under Triton's interpreter (the PTX
# instruction's error bound applied to an exact log2), 0 for another vendor's GPU.
# (Triton's own flag: ``triton.jit`` reads it when it wraps a kernel; the module is also
# imported, never launched, beside Triton releases older than 3.9, which have no ``knobs``.)
_INTERPRETED = (
    triton.knobs.runtime.interpret
    if hasattr(triton, "knobs")
    else os.environ.get("TRITON_INTERPRET") == "1"
)
SFU = tl.constexpr(2 if _INTERPRETED else 1 if torch.version.hip is None else 0)

# The per-row statistics the forward saves, rows of an (8, N) tensor in the compute dtype:
# the student's max and log-sum, the teacher's (the log-sum shifted by Δ), the offset
# log s_w - log s_z + Δ of d = ((w - z) - (c_w - c_z)) k - offset, the row's kind (0 valid,
# 2 invalid: NaN/+inf/all -inf) and the two means.
STATS = ("c_z", "log_s_z", "c_w", "log_s_w", "offset", "kind", "mean_p", "mean_q")


def _mode(beta: float) -> int:
    """0 at ``β = 0`` (KL(q ‖ p)), 1 at ``β = 1`` (KL(p ‖ q)), 2 for the mixture, 3 for the
    mixture near an end (:func:`~klpen.kernels.torch_jsd.near_end`: ``min(β, 1 - β)`` below
    1/16, :func:`_mixture_logs_near_end`)."""
    if beta == 0.0 or beta == 1.0:
        return int(beta)
    return 3 if near_end(beta) else 2


# Taylor coefficients of G the forward takes (g_2 … g_10)
N_TERMS = 9


def _coefficients_from(beta: float) -> list[float]:
    """``(g_2 … g_10)`` of ``G`` for ``0 < β <= 0.9`` (see :func:`coefficients`), in float64:
    from the series of ``m̃ = 1 - β + β e^d`` (``m_0 = 1``, ``m_n = β / n!``) and of
    ``L = log m̃`` (``n L_n = n m_n - Σ_(0<j<n) j L_j m_(n-j)``),
    ``g_n = β / (n - 1)! - Σ_(0<j≤n) L_j m_(n-j)``; every term is of the size of ``β``,
    the result of ``β (1 - β)``."""
    n = N_TERMS
    fact = [float(math.factorial(j)) for j in range(n + 2)]
    m = [1.0] + [beta / fact[j] for j in range(1, n + 2)]
    log_m = [0.0] * (n + 2)
    for j in range(1, n + 2):
        log_m[j] = (j * m[j] - sum(i * log_m[i] * m[j - i] for i in range(1, j))) / j
    return [
        beta / fact[j - 1] - sum(log_m[i] * m[j - i] for i in range(1, j + 1))
        for j in range(2, n + 2)
    ]


def coefficients(beta: float) -> tuple[float, ...]:
    """``(g_2 … g_10)``: the Taylor coefficients about ``d = 0`` of ``G`` (module docstring)
    for ``β``, in float64, each to a few units of rounding. At ``β = 1``
    ``G = e^d - 1 - d`` (``g_n = 1 / n!``), at ``β = 0`` ``G = 1 + (d - 1) e^d``
    (``g_n = (n - 1) / n!``); between, up to ``β = 0.9`` from the series of ``m̃`` and
    ``log m̃`` (:func:`_coefficients_from`), and above it by the symmetry of the divergence
    (``p`` and ``q`` swapped with ``β`` and ``1 - β``): ``G_β(d) = e^d G_(1-β)(-d)``, the
    series of ``G_(1-β)`` (``1 - β`` exact) times that of ``e^d``, so that ``1 - β`` as
    small as ``1e-12`` costs no digits (the direct series would cancel to ``1e-16 / (1 - β)``).

    Example:
        >>> [round(c, 6) for c in coefficients(0.5)[:3]]
        [0.125, 0.0625, 0.015625]
    """
    n = N_TERMS
    fact = [float(math.factorial(j)) for j in range(n + 2)]
    if beta == 1.0:
        return tuple(1.0 / fact[j] for j in range(2, n + 2))
    if beta == 0.0:
        return tuple((j - 1) / fact[j] for j in range(2, n + 2))
    if beta <= 0.9:
        return tuple(_coefficients_from(beta))
    mirror = _coefficients_from(1.0 - beta)  # of G_(1-β)(d); at -d the odd ones change sign
    return tuple(
        sum((-1) ** i * mirror[i - 2] / fact[j - i] for i in range(2, j + 1))
        for j in range(2, n + 2)
    )


@triton.jit
def _log1p(t):  # type: ignore[no-untyped-def]
    """``log1p(t)`` for ``t >= -1``: ``log(u) - ((u - 1) - t) / u`` with ``u = 1 + t`` (the
    rounding of ``u`` corrected to first order), ``inf`` at ``inf``."""
    u = 1.0 + t
    corr = ((u - 1.0) - t) / tl.where((u > 0) & (u < float("inf")), u, 1.0)
    return tl.log(u) - tl.where(u < float("inf"), corr, 0.0)


@triton.jit
def _horner(x, c0, c1, c2, c3, c4, c5, c6, c7, c8):  # type: ignore[no-untyped-def]
    """``Σ_(i<9) c_i x^i`` by Horner's rule (multiply-adds)."""
    s = c8 * x + c7
    s = s * x + c6
    s = s * x + c5
    s = s * x + c4
    s = s * x + c3
    s = s * x + c2
    s = s * x + c1
    return s * x + c0


@triton.jit
def _elements(  # type: ignore[no-untyped-def]
    z,
    w,
    c_z,
    ls_z,
    c_w,
    ls_w,
    dc_hi,
    dc_lo,
    ls_d,
    k,
    MODE: tl.constexpr,
    DT: tl.constexpr,
):
    """``(p, q, d, s)`` of one block from the row's statistics, ``s = e^{-|d|}``.

    ``d = ((w - z) - (c_w - c_z)) k - ls_d`` from the exact differences ``w - z`` (Knuth's
    two-sum) and ``c_w - c_z = dc_hi + dc_lo``: off by a few units of rounding of
    ``|d| + |ls_d|`` whatever the offset between the two rows. A ``-inf`` logit gives
    ``d = +inf`` (the student's) or ``-inf`` (the teacher's), but ``±BIG`` (finite, so that
    its product with the zero probability is 0) where the mode's terms are finite there and
    where both are ``-inf``. ``p`` and ``q`` cost one ``exp2`` and a product: the larger is
    ``exp(max(log p, log q))``, the smaller that times ``s``, with
    ``log p = k (z - c_z) - ls_z`` and ``log q = k (w - c_w) - ls_w``."""
    k2 = k * LOG2E  # log p and log q in base 2 (row scalars, hoisted out of the loop)
    log2_p = (z - c_z) * k2 - ls_z * LOG2E
    hi = w - z
    back = hi - w
    lo = (w - (hi - back)) - (z + back)
    d = ((hi - dc_hi) + (lo - dc_lo)) * k - ls_d
    if DT == tl.float64:
        big = 1e300
    else:
        big = 1e30
    inf = float("inf")
    finite = tl.abs(hi) < inf
    if MODE == 0:  # KL(q || p): +inf where the student's logit alone is -inf
        d = tl.where(finite, d, tl.where(w == -inf, -big, inf))
    elif MODE == 1:  # KL(p || q): +inf where the teacher's logit alone is -inf
        d = tl.where(finite, d, tl.where(z == -inf, big, -inf))
    else:
        d = tl.where(finite, d, tl.where(z == -inf, big, -big))
    log2_q = (w - c_w) * k2 - ls_w * LOG2E
    top = tl.math.exp2(tl.maximum(log2_p, log2_q))
    s = tl.math.exp2(tl.abs(d) * -LOG2E)
    low = top * s
    up = d > 0
    return tl.where(up, low, top), tl.where(up, top, low), d, s


@triton.jit
def _log_unit(u, DT: tl.constexpr):  # type: ignore[no-untyped-def]
    """``log(u)`` for a finite ``u > 0``: in float32 the ``logf`` of CUDA's libdevice without its
    special cases (``u`` at least the smallest normal float, finite): ``u = 2^e (1 + f)``
    with ``1 + f`` in ``[2/3, 4/3)`` by its bits, ``log u = e log 2 + f + f² P(f)``
    (``P`` of degree 8, libdevice's coefficients); ``tl.log`` in float64."""
    if DT == tl.float64:
        return tl.log(u)
    else:
        bits = tl.maximum(u, 1.1754943508222875e-38).to(tl.int32, bitcast=True)
        top = (bits - 0x3F2AAAAB) & -8388608  # the exponent's bits, 1 + f in [2/3, 4/3)
        f = (bits - top).to(tl.float32, bitcast=True) - 1.0
        poly = -0.13018856942653656 * f + 0.1408461034297943
        poly = poly * f - 0.12148627638816833
        poly = poly * f + 0.1398061066865921
        poly = poly * f - 0.16684235632419586
        poly = poly * f + 0.20012299716472626
        poly = poly * f - 0.24999669194221497
        poly = poly * f + 0.333331823348999
        poly = poly * f - 0.5
        log1p_f = (f * poly) * f + f
        # e log 2 as (2^23 e) (2^-23 log 2), the constant exact
        return top.to(tl.float32) * 8.262958317573066e-08 + log1p_f


@triton.jit
def _lg2_sfu(u):  # type: ignore[no-untyped-def]
    """``log2(u)`` in float32 for ``u`` in ``[1/16, 1]`` by the special-function unit:
    ``lg2.approx.ftz.f32`` (one ``MUFU.LG2``), whose error the PTX ISA bounds by ``2^-22``
    absolute for ``u`` in ``(1/2, 2)`` and ``2^-22`` relative elsewhere; exactly 0 at ``u = 1``
    (a ``where``: identical rows' gradients rest on it). Triton's interpreter runs no PTX:
    there it is ``log2`` moved by that bound, every entry the same way (the value's worst
    case: the errors of a row's terms add), so that the tests see the hardware's error.
    A build for another vendor's GPU takes :func:`_log_unit`."""
    if SFU == 1:
        lg = tl.inline_asm_elementwise(
            "lg2.approx.ftz.f32 $0, $1;", "=f,f", [u], dtype=tl.float32, is_pure=True, pack=1
        )
    elif SFU == 2:
        exact = tl.log2(u)
        lg = exact - tl.where((u > 0.5) & (u < 2.0), 2.0**-22, 2.0**-22 * tl.abs(exact))
    else:
        lg = _log_unit(u, tl.float32) * LOG2E
    return tl.where(u == 1.0, 0.0, lg)


@triton.jit
def _mixture_logs_middle(d, s, beta, cbeta, DT: tl.constexpr):  # type: ignore[no-untyped-def]
    """``(L, B)``: ``L = log m̃`` and ``B = d - L``, from ``l = log(β s + 1 - β)`` at ``d <= 0``
    (``L = l``, ``B = d - l``) and ``l = log((1 - β) s + β)`` at ``d > 0`` (``L = d + l``,
    ``B = -l``): ``s = e^{-|d|}`` never overflows, ``B`` is finite where ``d = BIG`` and ``L``
    where ``d = -BIG``; off by a few units of rounding of 1 (and of ``|d|``). The argument of
    ``l`` lies in ``[1 - c, 1]`` for the ``c`` in ``[1/16, 15/16]`` of this ``MODE``: in
    float32 ``l`` is the special-function unit's (:func:`_lg2_sfu`), within
    ``2^-22 log 2 ≈ 1.7e-7`` where the argument exceeds 1/2."""
    up = d > 0
    coef = tl.where(up, cbeta, beta)
    u = coef * s + (1.0 - coef)
    if DT == tl.float64:
        lg = tl.log(u)
        return tl.where(up, d, 0.0) + lg, tl.where(up, 0.0, d) - lg
    else:
        lg2 = _lg2_sfu(u)
        return lg2 * LN2 + tl.where(up, d, 0.0), tl.where(up, 0.0, d) - lg2 * LN2


@triton.jit
def _mixture_logs_near_end(d, s, beta, cbeta, split, DT: tl.constexpr):  # type: ignore[no-untyped-def]
    """``(L, B)`` as :func:`_mixture_logs_middle`, each relative to itself, for ``β`` near 0 or 1
    (``MODE`` 3), where one of them is far smaller than ``d`` and the middle form has it
    only to a unit of rounding of ``d`` or of 1. The smaller in size is taken from one
    ``log1p``: ``L = log1p(β expm1 d)`` where ``d < split``, else
    ``B = -log1p((1 - β) expm1(-d))`` (``|L| = |B|`` at ``d = 0`` and at
    ``d = 2 log((1 - β) / β)``, which ``split`` is, clamped to ``±80``); the other is ``d``
    less it, off by a few units of rounding of itself. ``expm1(±d)`` is ``s - 1`` or
    ``e^{|d|} - 1``, the latter only where ``|d| < 80`` (no overflow); ``log1p(x)`` is
    ``log(1 + x)`` less the rounding of ``1 + x`` where ``-1/2 <= x <= 1``, and ``log`` of
    ``(1 - c) + c e`` (positive terms) below. Finite where ``d = ±BIG``: ``B = -log β`` and
    ``L = log(1 - β)`` there."""
    use_l = d < split
    c = tl.where(use_l, beta, cbeta)  # x = c expm1(v), v = d (L) or -d (B)
    pos = tl.where(use_l, d > 0, d < 0)  # v > 0
    e = tl.where(pos, tl.math.exp2(tl.abs(d) * LOG2E), s)  # e^v
    x = c * e - c
    low = x < -0.5
    u = tl.where(low, c * e + tl.where(use_l, cbeta, beta), 1.0 + x)
    rounding = tl.where(low | (x > 1.0), 0.0, (u - 1.0) - x)
    lg = _log_unit(u, DT) - rounding
    return tl.where(use_l, lg, d + lg), tl.where(use_l, d - lg, -lg)


@triton.jit
def _mixture_logs(d, s, beta, cbeta, split, MODE: tl.constexpr, DT: tl.constexpr):  # type: ignore[no-untyped-def]
    """``(L, B) = (log m̃, d - log m̃)`` of the mixture in ``MODE`` 2
    (:func:`_mixture_logs_middle`) or 3 (:func:`_mixture_logs_near_end`)."""
    if MODE == 2:
        return _mixture_logs_middle(d, s, beta, cbeta, DT)
    else:
        return _mixture_logs_near_end(d, s, beta, cbeta, split, DT)


@triton.jit
def _pair(z_base, w_base, zs_v, ws_v, idx, V, MASKED: tl.constexpr, DT: tl.constexpr):  # type: ignore[no-untyped-def]
    """Both rows' entries at ``idx``, in ``DT``: a full block without a mask (no lane to fill
    first), the last one (``MASKED``) with ``-inf`` from ``V`` on, tokens of probability 0
    in both rows, whose terms and gradients are 0."""
    if MASKED:
        mask = idx < V
        z = tl.load(z_base + idx.to(tl.int64) * zs_v, mask=mask, other=-float("inf"))
        w = tl.load(w_base + idx.to(tl.int64) * ws_v, mask=mask, other=-float("inf"))
    else:
        z = tl.load(z_base + idx.to(tl.int64) * zs_v)
        w = tl.load(w_base + idx.to(tl.int64) * ws_v)
    return z.to(DT), w.to(DT)


@triton.jit
def _add_terms(  # type: ignore[no-untyped-def]
    acc_t, acc_p, acc_q, acc_mp, acc_mq, z, w, row, g, SMALL, MODE: tl.constexpr, DT: tl.constexpr
):
    """One block's terms added to the per-lane sums of :func:`_terms_pass`; ``row`` holds the
    row's scalars ``(c_z, ls_z, c_w, ls_w, dc_hi, dc_lo, ls_d, k, β, 1 - β, split)``, ``g``
    the coefficients ``(g_2 … g_10)``."""
    c_z, ls_z, c_w, ls_w, dc_hi, dc_lo, ls_d, k, beta, cbeta, split = row
    p, q, d, s = _elements(z, w, c_z, ls_z, c_w, ls_w, dc_hi, dc_lo, ls_d, k, MODE, DT)
    small = tl.abs(d) < SMALL
    ds = tl.where(small, d, 0.0)
    if MODE == 1:  # g_n = 1 / n! as immediates (no registers held through the loop)
        poly = _horner(
            ds,
            0.5,
            0.16666666666666666,
            0.041666666666666664,
            0.008333333333333333,
            0.001388888888888889,
            0.0001984126984126984,
            2.48015873015873e-05,
            2.7557319223985893e-06,
            2.755731922398589e-07,
        )
    elif MODE == 0:  # g_n = (n - 1) / n!
        poly = _horner(
            ds,
            0.5,
            0.3333333333333333,
            0.125,
            0.03333333333333333,
            0.006944444444444444,
            0.0011904761904761906,
            0.00017361111111111112,
            2.2045855379188714e-05,
            2.48015873015873e-06,
        )
    else:
        g2, g3, g4, g5, g6, g7, g8, g9, g10 = g
        poly = _horner(ds, g2, g3, g4, g5, g6, g7, g8, g9, g10)
    series = p * (ds * ds) * poly
    acc_p += p
    acc_q += q
    if MODE == 1:  # p G = q - p - p d; p d = 0 where p underflowed beside d = -inf
        pd = tl.where(p > 0, p * d, 0.0)
        acc_t += tl.where(small, series, (q - p) - pd)
        acc_mp -= pd
    elif MODE == 0:  # p G = p - q + q d; q d = 0 where q underflowed beside d = +inf
        qd = tl.where(q > 0, q * d, 0.0)
        acc_t += tl.where(small, series, (p - q) + qd)
        acc_mq += qd
    else:  # p G = β q B - (1 - β) p L
        log_m, b = _mixture_logs(d, s, beta, cbeta, split, MODE, DT)
        acc_t += tl.where(small, series, beta * (q * b) - cbeta * (p * log_m))
        acc_mp -= p * log_m
        acc_mq += q * b
    return acc_t, acc_p, acc_q, acc_mp, acc_mq


@triton.jit
def _terms_pass(  # type: ignore[no-untyped-def]
    z_base,
    w_base,
    zs_v,
    ws_v,
    V,
    row,
    g,
    SMALL,
    MODE: tl.constexpr,
    BLOCK: tl.constexpr,
    DT: tl.constexpr,
):
    """The terms pass at ``d0`` (``ls_d = log s_w - log s_z``), per-lane sums reduced once:
    ``(T, P, Q, M_p, M_q)`` with ``T = Σ p G(d0)``, ``P = Σ p``, ``Q = Σ q``,
    ``M_p = Σ p a`` (``Σ p (-d0)`` at ``β = 1``) and ``M_q = Σ q b`` (``Σ q d0`` at
    ``β = 0``); the full blocks, then the rest (:func:`_add_terms`)."""
    cols = tl.arange(0, BLOCK)
    acc_t = tl.zeros((BLOCK,), DT)
    acc_p = tl.zeros((BLOCK,), DT)
    acc_q = tl.zeros((BLOCK,), DT)
    acc_mp = tl.zeros((BLOCK,), DT)
    acc_mq = tl.zeros((BLOCK,), DT)
    full = V - V % BLOCK
    for start in range(0, full, BLOCK):
        z, w = _pair(z_base, w_base, zs_v, ws_v, start + cols, V, False, DT)
        acc_t, acc_p, acc_q, acc_mp, acc_mq = _add_terms(
            acc_t, acc_p, acc_q, acc_mp, acc_mq, z, w, row, g, SMALL, MODE, DT
        )
    if full < V:
        z, w = _pair(z_base, w_base, zs_v, ws_v, full + cols, V, True, DT)
        acc_t, acc_p, acc_q, acc_mp, acc_mq = _add_terms(
            acc_t, acc_p, acc_q, acc_mp, acc_mq, z, w, row, g, SMALL, MODE, DT
        )
    return (
        tl.sum(acc_t, 0),
        tl.sum(acc_p, 0),
        tl.sum(acc_q, 0),
        tl.sum(acc_mp, 0),
        tl.sum(acc_mq, 0),
    )


@triton.jit
def _group_lse(x, m, s, k2):  # type: ignore[no-untyped-def]
    """One block ``(BLOCK / GROUP, GROUP)`` into per-group running ``(max m, Σ exp(k (x - m)))``
    (``k2 = k log2(e)``): the group's new max ``c`` (0 while it is infinite), the old sum
    rescaled by ``exp(k (m - c))`` and the block's entries added as ``exp(k (x - c))``, one
    ``exp2`` per entry; a group is one thread's contiguous entries, so the max costs no
    exchange between threads. ``-inf`` entries add 0; a NaN entry makes ``s`` NaN, a
    ``+inf`` one makes ``m`` infinite: either marks the row invalid."""
    new = tl.maximum(m, tl.max(x, 1))
    c = tl.where(tl.abs(new) == float("inf"), 0.0, new)
    e = tl.math.exp2((x - c[:, None]) * k2)
    return new, s * tl.math.exp2((m - c) * k2) + tl.sum(e, 1)


@triton.jit
def _group_total(m, s, scale):  # type: ignore[no-untyped-def]
    """``(max, centre, Σ)`` of the per-group ``(m, s)``: the row's max, the finite centre
    ``c`` (the max, 0 where it is infinite) and ``Σ_groups s exp(k (m - c))`` (NaN where a
    group's ``s`` is, also in a group of ``m = -inf``)."""
    top = tl.max(m, 0)
    centre = tl.where(tl.abs(top) == float("inf"), 0.0, top)
    total = tl.sum(s * tl.exp((m - centre) * scale), 0)
    return top, centre, total


@triton.jit
def _shifted(x, slope, delta):  # type: ignore[no-untyped-def]
    """``x - Δ slope``, or ``x`` where ``x`` is infinite."""
    return tl.where(tl.abs(x) == float("inf"), x, x - delta * slope)


@triton.jit
def _two_diff(a, b):  # type: ignore[no-untyped-def]
    """``(hi, lo)`` with ``hi + lo = a - b`` exactly (Knuth's two-sum), ``(0, 0)`` where
    either is infinite."""
    hi = a - b
    back = hi - a
    lo = (a - (hi - back)) - (b + back)
    finite = tl.abs(hi) < float("inf")
    return tl.where(finite, hi, 0.0), tl.where(finite, lo, 0.0)


@triton.jit
def _split(beta, cbeta, MODE: tl.constexpr):  # type: ignore[no-untyped-def]
    """The ``split`` of :func:`_mixture_logs_near_end` in ``MODE`` 3:
    ``2 log((1 - β) / β)`` clamped to ``±80`` (0 in the other modes)."""
    if MODE == 3:
        return tl.minimum(tl.maximum(2.0 * tl.log(cbeta / beta), -80.0), 80.0)
    else:
        return tl.zeros((), beta.dtype)


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
    scale: tl.float64,
    beta: tl.float64,
    cbeta: tl.float64,
    g2: tl.float64,
    g3: tl.float64,
    g4: tl.float64,
    g5: tl.float64,
    g6: tl.float64,
    g7: tl.float64,
    g8: tl.float64,
    g9: tl.float64,
    g10: tl.float64,
    MODE: tl.constexpr,
    BLOCK: tl.constexpr,
    GROUP: tl.constexpr,
    DT: tl.constexpr,
):
    """Row ``r``: ``J_β`` into ``out`` ``(N,)`` and the row's :data:`STATS` into ``stats``
    ``(8, N)``, in two reads of both rows (see the module docstring). ``MODE``: 0 at
    ``β = 0``, 1 at ``β = 1``, 2 between, 3 near an end (:func:`_mode`); ``cbeta``:
    ``1 - β``; ``g2`` … ``g10``: :func:`coefficients` (read between; the ends use their own
    as immediates)."""
    row = tl.program_id(0).to(tl.int64)
    z_base = _row_start(z_ptr, row, n_inner, zs_outer, zs_inner)
    w_base = _row_start(w_ptr, row, n_inner, ws_outer, ws_inner)
    k = tl.full((), scale, DT)
    bt = tl.full((), beta, DT)
    cb = tl.full((), cbeta, DT)
    # pass 1: per-group log-sums of k z and k w, reduced once
    cells = tl.arange(0, BLOCK // GROUP)[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    m_z = tl.full((BLOCK // GROUP,), -float("inf"), DT)
    m_w = tl.full((BLOCK // GROUP,), -float("inf"), DT)
    s_z = tl.zeros((BLOCK // GROUP,), DT)
    s_w = tl.zeros((BLOCK // GROUP,), DT)
    k2 = k * LOG2E
    full = V - V % BLOCK
    for start in range(0, full, BLOCK):
        z, w = _pair(z_base, w_base, zs_v, ws_v, start + cells, V, False, DT)
        m_z, s_z = _group_lse(z, m_z, s_z, k2)
        m_w, s_w = _group_lse(w, m_w, s_w, k2)
    if full < V:
        z, w = _pair(z_base, w_base, zs_v, ws_v, full + cells, V, True, DT)
        m_z, s_z = _group_lse(z, m_z, s_z, k2)
        m_w, s_w = _group_lse(w, m_w, s_w, k2)
    top_z, c_z, sum_z = _group_total(m_z, s_z, k)
    top_w, c_w, sum_w = _group_total(m_w, s_w, k)
    # NaN or +inf logits (a NaN sum or a +inf max), or a row of -inf (a -inf max)
    invalid = (
        (sum_z != sum_z)
        | (sum_w != sum_w)
        | (tl.abs(top_z) == float("inf"))
        | (tl.abs(top_w) == float("inf"))
    )
    ls_z = tl.log(sum_z)
    ls_w = tl.log(sum_w)
    # pass 2 at d0 = ((w - z) - (c_w - c_z)) k - (log s_w - log s_z); the rounding Δ of the
    # offset (of the log-sums alone) is measured
    dc_hi, dc_lo = _two_diff(c_w, c_z)
    ls_d = ls_w - ls_z
    if DT == tl.float64:
        small = 0.125
    else:
        small = 0.5
    row_scalars = (c_z, ls_z, c_w, ls_w, dc_hi, dc_lo, ls_d, k, bt, cb, _split(bt, cb, MODE))
    g = (
        tl.full((), g2, DT),
        tl.full((), g3, DT),
        tl.full((), g4, DT),
        tl.full((), g5, DT),
        tl.full((), g6, DT),
        tl.full((), g7, DT),
        tl.full((), g8, DT),
        tl.full((), g9, DT),
        tl.full((), g10, DT),
    )
    T, P, Q, Mp, Mq = _terms_pass(
        z_base, w_base, zs_v, ws_v, V, row_scalars, g, small, MODE, BLOCK, DT
    )
    # d = d0 - Δ with Σ p e^{d0} = e^Δ Σ p; J(d0 - Δ) = J(d0) - Δ J'(d0) + Δ²/2 J''(d0), the
    # means likewise to first order (an infinite sum, a divergence +inf, is left as it is)
    delta = _log1p((Q - P) / tl.where(P > 0, P, 1.0))
    half = 0.5 * delta
    if MODE == 1:
        value = _shifted(T, (Q - P) - half * Q, delta)
        mean_p = _shifted(Mp, -P, delta)
        mean_q = Mq
    elif MODE == 0:
        value = _shifted(T, Mq - half * (Mq + Q), delta)
        mean_p = Mp
        mean_q = _shifted(Mq, Mq + Q, delta)
    else:  # R = Σ q p / m as Q (exact where p = q; see the module docstring)
        value = _shifted(T, bt * (Mq - half * (Mq + cb * Q)), delta)
        mean_p = _shifted(Mp, -bt * Q, delta)
        mean_q = _shifted(Mq, Mq + cb * Q, delta)
    value = tl.where(invalid, float("nan"), value)
    tl.store(out_ptr + row, value)
    tl.store(stats_ptr + row, c_z)
    tl.store(stats_ptr + n_rows + row, ls_z)
    tl.store(stats_ptr + 2 * n_rows + row, c_w)
    tl.store(stats_ptr + 3 * n_rows + row, ls_w + delta)
    tl.store(stats_ptr + 4 * n_rows + row, ls_d + delta)
    tl.store(stats_ptr + 5 * n_rows + row, tl.where(invalid, 2.0, 0.0).to(DT))
    tl.store(stats_ptr + 6 * n_rows + row, mean_p)
    tl.store(stats_ptr + 7 * n_rows + row, mean_q)


@triton.jit
def _store(out, idx, mask, grad, MID: tl.constexpr):  # type: ignore[no-untyped-def]
    """``grad`` stored in ``out``'s dtype, through ``MID`` (float32 below float64) and to
    bfloat16 to nearest (:func:`~klpen.kernels.triton_rows._to_bf16`)."""
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
    scale: tl.float64,
    beta: tl.float64,
    cbeta: tl.float64,
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
    k = tl.full((), scale, DT)
    bt = tl.full((), beta, DT)
    cb = tl.full((), cbeta, DT)
    split = _split(bt, cb, MODE)
    if DT == tl.float64:
        small = 0.125
    else:
        small = 0.5
    c_z = tl.load(stats_ptr + row)
    ls_z = tl.load(stats_ptr + n_rows + row)
    c_w = tl.load(stats_ptr + 2 * n_rows + row)
    ls_w = tl.load(stats_ptr + 3 * n_rows + row)
    ls_d = tl.load(stats_ptr + 4 * n_rows + row)
    kind = tl.load(stats_ptr + 5 * n_rows + row)
    mean_p = tl.load(stats_ptr + 6 * n_rows + row)
    mean_q = tl.load(stats_ptr + 7 * n_rows + row)
    dc_hi, dc_lo = _two_diff(c_w, c_z)
    gk = tl.load(g_ptr + row) * k
    gk = tl.where(kind == 2.0, float("nan"), gk)
    cols = tl.arange(0, BLOCK)
    for start in range(0, V, BLOCK):
        idx = start + cols
        mask = idx < V
        z, w = _pair(z_base, w_base, zs_v, ws_v, idx, V, True, DT)
        p, q, d, s = _elements(z, w, c_z, ls_z, c_w, ls_w, dc_hi, dc_lo, ls_d, k, MODE, DT)
        if MODE >= 2:
            log_m, b = _mixture_logs(d, s, bt, cb, split, MODE, DT)
            if NEED_Z:
                gz = p * (-log_m - mean_p) * (cb * gk)
                _store(gz_ptr + row * V, idx, mask, gz, MID_Z)
            if NEED_W:
                gw = q * (b - mean_q) * (bt * gk)
                _store(gw_ptr + row * V, idx, mask, gw, MID_W)
        else:
            # q - p: p expm1(d) by its polynomial where |d| < SMALL (relative to itself also
            # where p ≈ q ≈ 1), else the difference of the two
            is_small = tl.abs(d) < small
            ds = tl.where(is_small, d, 0.0)
            series = ds * _horner(
                ds,
                1.0,
                0.5,
                0.16666666666666666,  # 1/3!
                0.041666666666666664,  # 1/4!
                0.008333333333333333,  # 1/5!
                0.001388888888888889,  # 1/6!
                0.0001984126984126984,  # 1/7!
                2.48015873015873e-05,  # 1/8!
                2.755731922398589e-06,  # 1/9!
            )
            diff = tl.where(is_small, p * series, q - p)
            if MODE == 1:  # KL(p || q)
                if NEED_Z:
                    gz = tl.where(p > 0, p * (-d - mean_p), 0.0)
                    _store(gz_ptr + row * V, idx, mask, gz * gk, MID_Z)
                if NEED_W:
                    _store(gw_ptr + row * V, idx, mask, diff * gk, MID_W)
            else:  # KL(q || p)
                if NEED_Z:
                    _store(gz_ptr + row * V, idx, mask, -diff * gk, MID_Z)
                if NEED_W:
                    gw = tl.where(q > 0, q * (d - mean_q), 0.0)
                    _store(gw_ptr + row * V, idx, mask, gw * gk, MID_W)


def _block(vocab: int, device: torch.device, dtype: torch.dtype) -> int:
    """The block size of both kernels: float64 holds twice the registers per entry, so its
    blocks hold at most 1,024 entries (4 per thread); larger ones spill (the forward's two
    passes, the backward near an end)."""
    return block_size(vocab, device, cap=1024 if dtype == torch.float64 else GPU_BLOCK)


def _group(block: int) -> int:
    """Entries per group of the forward's first pass: those one thread holds in a block on a
    GPU (2, 4 or 8), so that a group's max is a thread's own; 4 in the interpreter's smaller
    blocks (at most the block)."""
    if block in GPU_BLOCKS:
        return block // (32 * num_warps(block))
    return min(block, 4)


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
        block = _block(vocab, student.device, dtype)
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
            1.0 - float(beta),
            *coefficients(beta),
            MODE=_mode(beta),
            BLOCK=block,
            GROUP=_group(block),
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
    block = _block(vocab, student.device, dtype)
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
        1.0 - float(beta),
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
