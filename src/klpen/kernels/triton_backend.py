# mypy: disable-error-code="untyped-decorator"
"""The Triton backend: log-probs, entropy and the exact full KL as one-read row kernels.

Each program of a kernel owns one row of the ``(..., V)`` logits and walks its vocabulary in
blocks of ``BLOCK`` entries, keeping a handful of running statistics per row:

- log-probs and entropy: the running max ``m`` of the raw logits (``k (z - m)`` is formed
  from the exact difference ``z - m``, so a common offset of the logits costs no digits),
  ``s = Σ exp(k (z - m))`` and ``t = Σ e y`` with ``y = k (z - m)`` (the entropy is
  ``log s - t / s``, two non-negative terms); the token's logit is one load.
- full KL: the per-row sums of the centred form of :func:`~klpen.kernels.torch_kl.centred_kl`,
  ``S = Σ e``, ``A = Σ e v`` and ``F = Σ e (expm1(v) - v)`` with ``e = exp(k (z - m))`` and
  ``v = ((w - z) - c) k``, formed from the exact difference ``w - z`` (a two-sum: ``v`` is off
  by about ``eps |v|`` whatever the offset between the two logits). ``m`` is the running max
  of ``z`` and ``c`` the mean of ``w - z`` over that max's block weighted by ``e``: when a
  block brings a new max (rarely), the per-lane sums are rescaled and moved to the new centre
  by the exact update of a centred sum (moving a group's centre by ``δ`` maps ``F`` to
  ``e^{-δ} F + expm1(-δ) A + (expm1(-δ) + δ) S``), so that the centre follows the tokens
  that carry the policy's mass;
  otherwise each element costs its terms alone, summed per lane and reduced once per row.
  The KL, ``E_p[v]`` and the error estimate then come from ``centred_kl``; the rows it
  cannot promise, the rows whose sums are not finite (NaN or infinite logits, overflowing
  log-ratios) are redone in float64 from the logits (:func:`_exact_row`) inside the kernels,
  forward and backward, chosen by an ``(N,)`` bool mask: no gather, no ``(rows, V)``
  temporary and no read on the host, with value checks on or off.
- hidden-state tiles (the ``linear_*_tile`` methods): one ``(r, c)`` tile of logits, a matrix
  product's output in a scratch buffer, reduced to its per-row sums (or turned in place into
  its gradient) in one read; the hidden-state path accumulates them over the vocabulary tiles
  and chooses the rows it redoes.

Half-precision logits are computed in fp32, fp32 and fp64 in their own dtype. Backward passes
read the logits once more and write the gradient once. With ``TRITON_INTERPRET=1`` the
kernels run on CPU tensors (for tests).
"""

from __future__ import annotations

import os

import torch
import triton  # type: ignore[import-untyped]
import triton.language as tl  # type: ignore[import-untyped]
from torch import Tensor

from .triton_launch import GPU_BLOCK, block_size, launch, num_warps
from .triton_rows import (
    _compute_dtype,
    _expm1_minus,
    _expm1_minus_series,
    _layout,
    _pair_layout,
    _row_start,
    _tl_dtype,
    _to_bf16,
)

__all__ = ["TritonBackend", "is_available"]


# The oldest Triton these kernels are tested with (older interpreters refuse some of their
# constructs, e.g. Triton 3.0's tl.arange of a non-constexpr bound).
MIN_TRITON = (3, 9)


def _version(text: str) -> tuple[int, ...]:
    parts = []
    for part in text.split(".")[:2]:
        digits = "".join(c for c in part if c.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def version_supported() -> bool:
    """Whether the installed Triton is at least :data:`MIN_TRITON`.

    Example:
        >>> isinstance(version_supported(), bool)
        True
    """
    return _version(triton.__version__) >= MIN_TRITON


def is_available() -> bool:
    """Whether the Triton kernels can run here: Triton ``>= MIN_TRITON`` and a CUDA device,
    or ``TRITON_INTERPRET=1`` (CPU tensors, through Triton's interpreter).

    Example:
        >>> isinstance(is_available(), bool), _version("3.9.0") >= MIN_TRITON > _version("3.0.0")
        (True, True)
    """
    if not version_supported():
        return False
    return torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _logprobs_fwd_kernel(  # type: ignore[no-untyped-def]
    x_ptr,
    tok_ptr,
    logp_ptr,
    ent_ptr,
    stats_ptr,
    n_rows,
    n_inner,
    stride_outer,
    stride_inner,
    stride_v,
    V,
    scale: tl.float64,
    HAS_TOK: tl.constexpr,
    ENTROPY: tl.constexpr,
    BLOCK: tl.constexpr,
    DT: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    # an fp64 argument rounded once to the compute dtype (``tl.full`` keeps it float64 under
    # the interpreter too, where ``tl.cast`` rounds it through fp32)
    scale = tl.full((), scale, DT)
    base = _row_start(x_ptr, row, n_inner, stride_outer, stride_inner)
    cols = tl.arange(0, BLOCK)
    m = tl.full((), -float("inf"), DT)  # running max of the raw logits
    c = tl.zeros((), DT)  # the finite centre: m, or 0 while m = -inf
    s = tl.zeros((BLOCK,), DT)  # per lane: Σ exp(k (z - c))
    t = tl.zeros((BLOCK,), DT)  # per lane: Σ e y, y = k (z - c)
    for start in range(0, V, BLOCK):
        idx = start + cols
        z = tl.load(base + idx.to(tl.int64) * stride_v, mask=idx < V, other=-float("inf")).to(DT)
        m_new = tl.maximum(m, tl.max(z, 0))
        if m_new > m:  # a new running max (rare): the lanes move to the new centre
            alpha = tl.where(m == -float("inf"), 0.0, tl.exp((c - m_new) * scale))
            if ENTROPY:
                # t relative to the new centre: alpha (t - delta s), delta = k (c_new - c)
                t = alpha * (t - (m_new - c) * scale * s)
            s = s * alpha
            m = m_new
            c = m_new
        y = (z - c) * scale
        e = tl.exp(y)
        s += e
        if ENTROPY:
            # e y = 0 where z = -inf (y clamped), NaN where z is (e is NaN)
            t += e * tl.maximum(y, -1e30)
    s = tl.sum(s, 0)
    t = tl.sum(t, 0)
    log_s = tl.log(s)
    # a NaN or +inf logit makes s NaN (exp(NaN), or inf - inf once it is the centre), and s
    # stays NaN: no per-element test is needed
    invalid = (s != s) | (m == -float("inf"))
    tl.store(stats_ptr + row, c)
    tl.store(stats_ptr + n_rows + row, log_s)
    if HAS_TOK:
        tok = tl.load(tok_ptr + row)
        z_tok = tl.load(base + tok * stride_v).to(DT)
        logp = (z_tok - c) * scale - log_s
        tl.store(logp_ptr + row, tl.where(invalid, float("nan"), logp))
    if ENTROPY:
        ent = log_s - t / s
        ent = tl.where(invalid, float("nan"), ent)
        tl.store(ent_ptr + row, ent)
        tl.store(stats_ptr + 2 * n_rows + row, ent)


@triton.jit
def _logprobs_bwd_kernel(  # type: ignore[no-untyped-def]
    x_ptr,
    tok_ptr,
    g_ptr,
    h_ptr,
    stats_ptr,
    out_ptr,
    n_rows,
    n_inner,
    stride_outer,
    stride_inner,
    stride_v,
    V,
    scale: tl.float64,
    HAS_G: tl.constexpr,
    HAS_H: tl.constexpr,
    BLOCK: tl.constexpr,
    DT: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    scale = tl.full((), scale, DT)
    base = _row_start(x_ptr, row, n_inner, stride_outer, stride_inner)
    out = out_ptr + row * V
    cols = tl.arange(0, BLOCK)
    c = tl.load(stats_ptr + row)
    log_s = tl.load(stats_ptr + n_rows + row)
    g = tl.zeros((), DT)
    tok = tl.full((), -1, tl.int64)
    if HAS_G:
        g = tl.load(g_ptr + row).to(DT)
        tok = tl.load(tok_ptr + row)
    for start in range(0, V, BLOCK):
        idx = start + cols
        mask = idx < V
        z = tl.load(base + idx.to(tl.int64) * stride_v, mask=mask, other=-float("inf")).to(DT)
        u = (z - c) * scale - log_s  # log p
        p = tl.exp(u)
        if HAS_H:
            h = tl.load(h_ptr + row).to(DT)
            ent = tl.load(stats_ptr + 2 * n_rows + row)
            coef = g + h * (u + ent)
        else:
            coef = g + tl.zeros_like(u)
        grad = tl.where(p > 0, -p * coef, 0.0)
        grad = (grad + tl.where(idx == tok, g, 0.0)) * scale
        tl.store(out + idx, grad.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _centred_v(z, w, c0, scale):  # type: ignore[no-untyped-def]
    """``v = ((w - z) - c0) k`` from the exact difference ``w - z = hi + lo`` (Knuth's
    two-sum: ``hi = fl(w - z)`` and its rounding error ``lo``): off by about ``eps |v|``
    alone, whatever the offset ``c0`` between the two logits."""
    hi = w - z
    back = hi - w
    lo = (w - (hi - back)) - (z + back)
    return ((hi - c0) + lo) * scale


@triton.jit
def _kl_terms(z, w, m0, c0, scale, DT: tl.constexpr):  # type: ignore[no-untyped-def]
    """One block's terms ``(e, e v, e (expm1(v) - v))`` of the centred KL sums.

    ``e = exp(k (z - m0))``; ``v = ((w - z) - c0) k`` (:func:`_centred_v`).
    ``e (expm1(v) - v)`` is ``e v² P(v)`` (:func:`_expm1_minus_series`) for
    ``|v| < 1/2``, else ``exp(k (z - m0) + v) - e - e v`` (the reference's mass
    ``exp(k (w - m0) - k c0)`` counted even where ``e`` underflows). A NaN or infinite logit
    (of either side) makes ``e`` or ``e v`` NaN or infinite.
    """
    y = (z - m0) * scale
    e = tl.exp(y)
    v = _centred_v(z, w, c0, scale)
    near = e * (_expm1_minus_series(v, DT, False) * (v * v))
    far = tl.exp(y + v) - e - e * v
    return e, e * v, tl.where(tl.abs(v) < 0.5, near, far)


@triton.jit
def _kl_step(  # type: ignore[no-untyped-def]
    z, w, mask, m, c, S, A, F, scale, DT: tl.constexpr, MASKED: tl.constexpr
):
    """One block into the per-lane sums ``S = Σ e``, ``A = Σ e v``, ``F = Σ e (expm1(v) -
    v)`` about the reference ``m`` and the centre ``c`` (``e = exp(k (z - m))``,
    ``v = ((w - z) - c) k``); returns the updated ``(m, c, S, A, F)``.

    Where the block's largest policy logit ``b`` passes ``m``, first: the sums are scaled by
    ``exp(k (m - b))`` and moved to the block's own centre ``c_b = Σ e_b (w - z) / Σ e_b``
    (``e_b = exp(k (z - b))``: near ``w - z`` at ``b`` in a peaked row, near ``E_p[w - z]`` in
    a flat one), ``δ = (c_b - c) k``, by the exact update of a centred sum,
    ``F ← e^{-δ} F + expm1(-δ) A + (expm1(-δ) + δ) S`` and ``A ← A - δ S`` (non-negative
    terms where ``A ≈ 0``; ``expm1(-δ) + δ`` by :func:`_expm1_minus`), so that the centre
    follows the tokens that carry the policy's mass (a peaked row's top token) and ``E_p[v]``
    stays small; the centre stays where ``|δ| ≥ 16``. Rare (a new running maximum), so the
    loop is one reduction (the block's max) and the per-element terms (:func:`_kl_terms`).
    """
    if MASKED:
        z = tl.where(mask, z, -float("inf"))
    b = tl.max(z, 0)
    if b > m:
        e = tl.exp((z - b) * scale)
        c_b = tl.sum(tl.where(e > 0, e * (w - z), 0.0), 0) / tl.sum(e, 0)
        first = m == -float("inf")
        alpha = tl.where(first, 0.0, tl.exp((m - b) * scale))
        delta = (c_b - c) * scale
        move = first | (tl.abs(delta) < 16.0)
        delta = tl.where(move & ~first, delta, 0.0)
        q = _expm1_minus(-delta, DT)
        em = q - delta
        S = S * alpha
        A = A * alpha
        F = F * alpha
        F = F * (em + 1.0) + em * A + q * S
        A = A - delta * S
        m = b
        c = tl.where(move, c_b, c)
    e, ev, t = _kl_terms(z, w, m, c, scale, DT)
    if MASKED:
        e = tl.where(mask, e, 0.0)
        ev = tl.where(mask, ev, 0.0)
        t = tl.where(mask, t, 0.0)
    return m, c, S + e, A + ev, F + t


@triton.jit
def _kl_fwd_kernel(  # type: ignore[no-untyped-def]
    z_ptr,
    w_ptr,
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
    BLOCK: tl.constexpr,
    DT: tl.constexpr,
):
    """Row ``r``'s centred KL sums in one read of both logits (:func:`_kl_step`): per-lane
    ``S``, ``A``, ``F``, reduced once. ``stats`` ``(7, N)``: the reference ``m`` (the largest
    policy logit), ``log S``, ``S``, ``A``, ``F``, the centre ``c`` (in logit units) and
    ``max e = 1``. A row with a NaN, an infinite logit or an overflowing term has a
    non-finite ``S``, ``A`` or ``F``; the caller redoes it (:func:`_kl_exact_fwd_kernel`).
    """
    row = tl.program_id(0).to(tl.int64)
    scale = tl.full((), scale, DT)
    z_base = _row_start(z_ptr, row, n_inner, zs_outer, zs_inner)
    w_base = _row_start(w_ptr, row, n_inner, ws_outer, ws_inner)
    cols = tl.arange(0, BLOCK)
    m = tl.full((), -float("inf"), DT)
    c = tl.zeros((), DT)
    S = tl.zeros((BLOCK,), DT)
    A = tl.zeros((BLOCK,), DT)
    F = tl.zeros((BLOCK,), DT)
    full = V - V % BLOCK
    for start in range(0, full, BLOCK):
        idx = (start + cols).to(tl.int64)
        z = tl.load(z_base + idx * zs_v).to(DT)
        w = tl.load(w_base + idx * ws_v).to(DT)
        m, c, S, A, F = _kl_step(z, w, cols < BLOCK, m, c, S, A, F, scale, DT, False)
    if full < V:
        idx = full + cols
        mask = idx < V
        z = tl.load(z_base + idx.to(tl.int64) * zs_v, mask=mask, other=-float("inf")).to(DT)
        w = tl.load(w_base + idx.to(tl.int64) * ws_v, mask=mask, other=0.0).to(DT)
        m, c, S, A, F = _kl_step(z, w, mask, m, c, S, A, F, scale, DT, True)
    S = tl.sum(S, 0)
    tl.store(stats_ptr + row, m)
    tl.store(stats_ptr + n_rows + row, tl.log(S))
    tl.store(stats_ptr + 2 * n_rows + row, S)
    tl.store(stats_ptr + 3 * n_rows + row, tl.sum(A, 0))
    tl.store(stats_ptr + 4 * n_rows + row, tl.sum(F, 0))
    tl.store(stats_ptr + 5 * n_rows + row, c)
    tl.store(stats_ptr + 6 * n_rows + row, tl.full((), 1.0, DT))


@triton.jit
def _kl_grad_fast(  # type: ignore[no-untyped-def]
    z_base,
    w_base,
    zs_v,
    ws_v,
    out,
    c_z,
    log_s,
    c0,
    mean_v,
    g,
    V,
    scale,
    BLOCK: tl.constexpr,
    DT: tl.constexpr,
):
    """One row of ``k g p_j (d_j - E_p[d]) = k g p_j (E_p[v] - v_j)`` from the forward's
    statistics, in ``DT``, with ``v`` formed as the forward forms it (:func:`_centred_v`), so
    that a common offset between the two logits costs no digits."""
    cols = tl.arange(0, BLOCK)
    for start in range(0, V, BLOCK):
        idx = start + cols
        mask = idx < V
        z = tl.load(z_base + idx.to(tl.int64) * zs_v, mask=mask, other=-float("inf")).to(DT)
        w = tl.load(w_base + idx.to(tl.int64) * ws_v, mask=mask, other=0.0).to(DT)
        p = tl.exp((z - c_z) * scale - log_s)
        grad = tl.where(p > 0, g * p * (mean_v - _centred_v(z, w, c0, scale)), 0.0)
        tl.store(out + idx, grad.to(out.dtype.element_ty), mask=mask)


@triton.jit
def _exact_row(  # type: ignore[no-untyped-def]
    z_base, w_base, zs_v, ws_v, V, scale, BLOCK: tl.constexpr
):
    """One row's ``(c_z, log s_z, c_w, log s_w, KL, lse(k z), lse(k w), bad)`` in float64.

    What :func:`~klpen.kernels.torch_kl.exact_rows` computes, element by element in the same
    order (only the sums' order differs): ``x = k z``, ``y = k w`` in float64, their maxes
    ``t_x``, ``t_y`` and centres ``c = t`` (0 where ``t`` is not finite), ``s = Σ exp(x - c)``,
    ``log p = (x - c_z) - log s_z``, ``log q = (y - c_w) - log s_w`` and
    ``KL = Σ_{p > 0} p (log p - log q)`` (``0 · log 0 = 0``; 0 where ``Σ p`` is not positive),
    ``lse = t + log s``; ``bad`` counts the NaN and ``+inf`` logits. Three reads of the row:
    the maxes, the sums, the KL.
    """
    cols = tl.arange(0, BLOCK)
    top_z = tl.full((), -float("inf"), tl.float64)
    top_w = tl.full((), -float("inf"), tl.float64)
    bad = tl.zeros((), tl.int32)
    for start in range(0, V, BLOCK):
        idx = start + cols
        mask = idx < V
        x = (
            tl.load(z_base + idx.to(tl.int64) * zs_v, mask=mask, other=-float("inf")).to(tl.float64)
            * scale
        )
        y = (
            tl.load(w_base + idx.to(tl.int64) * ws_v, mask=mask, other=-float("inf")).to(tl.float64)
            * scale
        )
        top_z = tl.maximum(top_z, tl.max(x, 0))
        top_w = tl.maximum(top_w, tl.max(y, 0))
        bad += tl.sum(
            ((x != x) | (x == float("inf")) | (y != y) | (y == float("inf"))).to(tl.int32), 0
        )
    c_z = tl.where((top_z > -float("inf")) & (top_z < float("inf")), top_z, 0.0)
    c_w = tl.where((top_w > -float("inf")) & (top_w < float("inf")), top_w, 0.0)
    s_z = tl.zeros((), tl.float64)
    s_w = tl.zeros((), tl.float64)
    for start in range(0, V, BLOCK):
        idx = start + cols
        mask = idx < V
        x = (
            tl.load(z_base + idx.to(tl.int64) * zs_v, mask=mask, other=-float("inf")).to(tl.float64)
            * scale
        )
        y = (
            tl.load(w_base + idx.to(tl.int64) * ws_v, mask=mask, other=-float("inf")).to(tl.float64)
            * scale
        )
        s_z += tl.sum(tl.exp(x - c_z), 0)
        s_w += tl.sum(tl.exp(y - c_w), 0)
    log_s_z = tl.log(s_z)
    log_s_w = tl.log(s_w)
    kl = tl.zeros((), tl.float64)
    mass = tl.zeros((), tl.float64)
    for start in range(0, V, BLOCK):
        idx = start + cols
        mask = idx < V
        x = (
            tl.load(z_base + idx.to(tl.int64) * zs_v, mask=mask, other=-float("inf")).to(tl.float64)
            * scale
        )
        y = (
            tl.load(w_base + idx.to(tl.int64) * ws_v, mask=mask, other=-float("inf")).to(tl.float64)
            * scale
        )
        log_p = (x - c_z) - log_s_z
        log_q = (y - c_w) - log_s_w
        p = tl.exp(log_p)
        kl += tl.sum(tl.where(p > 0, p * (log_p - log_q), 0.0), 0)
        mass += tl.sum(tl.where(mask, p, 0.0), 0)
    kl = tl.where(mass > 0, kl, 0.0)
    return c_z, log_s_z, c_w, log_s_w, kl, top_z + log_s_z, top_w + log_s_w, bad


@triton.jit
def _kl_exact_fwd_kernel(  # type: ignore[no-untyped-def]
    z_ptr,
    w_ptr,
    redo_ptr,
    out_ptr,
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
    BLOCK: tl.constexpr,
):
    """The float64 forward of the rows ``redo`` (``(N,)`` bool) marks; the others return at
    once. ``out`` ``(2, N)`` float64: the KL and ``lse(k z)`` (see :func:`_exact_row`), written
    only for those rows; the KL is NaN for an invalid row (a NaN or ``+inf`` logit, or no finite
    logit on one side). ``scale`` ``k`` is a float64 argument, used as it is."""
    row = tl.program_id(0).to(tl.int64)
    if tl.load(redo_ptr + row):
        z_base = _row_start(z_ptr, row, n_inner, zs_outer, zs_inner)
        w_base = _row_start(w_ptr, row, n_inner, ws_outer, ws_inner)
        k = tl.full((), scale, tl.float64)
        _, _, _, _, kl, lse_z, lse_w, bad = _exact_row(z_base, w_base, zs_v, ws_v, V, k, BLOCK)
        invalid = (bad > 0) | (lse_z == -float("inf")) | (lse_w == -float("inf"))
        tl.store(out_ptr + row, tl.where(invalid, float("nan"), kl))
        tl.store(out_ptr + n_rows + row, lse_z)


@triton.jit
def _kl_grad_exact(  # type: ignore[no-untyped-def]
    z_base, w_base, zs_v, ws_v, out, g, V, scale, BLOCK: tl.constexpr, MID: tl.constexpr
):
    """One row of ``k g (p_j log(p_j / q_j) - p_j KL)`` in float64 (``0 · log 0 = 0``), the
    gradient of the reference path, from :func:`_exact_row`'s statistics. Rounded to the
    output's dtype through ``MID`` (float32 below float64), as torch's casts from float64 do,
    and to bfloat16 to nearest (:func:`_to_bf16`).
    """
    c_z, log_s_z, c_w, log_s_w, kl, _, _, _ = _exact_row(
        z_base, w_base, zs_v, ws_v, V, scale, BLOCK
    )
    g64 = g.to(tl.float64) * scale
    cols = tl.arange(0, BLOCK)
    for start in range(0, V, BLOCK):
        idx = start + cols
        mask = idx < V
        x = (
            tl.load(z_base + idx.to(tl.int64) * zs_v, mask=mask, other=-float("inf")).to(tl.float64)
            * scale
        )
        y = (
            tl.load(w_base + idx.to(tl.int64) * ws_v, mask=mask, other=-float("inf")).to(tl.float64)
            * scale
        )
        log_p = (x - c_z) - log_s_z
        log_q = (y - c_w) - log_s_w
        p = tl.exp(log_p)
        terms = tl.where(p > 0, p * (log_p - log_q), 0.0) - p * kl
        grad = (terms * g64).to(MID)
        if out.dtype.element_ty == tl.bfloat16:
            tl.store(out + idx, _to_bf16(grad), mask=mask)
        else:
            tl.store(out + idx, grad.to(out.dtype.element_ty), mask=mask)


@triton.jit
def _kl_bwd_kernel(  # type: ignore[no-untyped-def]
    z_ptr,
    w_ptr,
    g_ptr,
    c_ptr,
    log_s_ptr,
    c0_ptr,
    mean_ptr,
    redo_ptr,
    out_ptr,
    n_inner,
    zs_outer,
    zs_inner,
    zs_v,
    ws_outer,
    ws_inner,
    ws_v,
    V,
    scale: tl.float64,
    BLOCK: tl.constexpr,
    DT: tl.constexpr,
    MID: tl.constexpr,
):
    """Row ``r`` of ``d/dz Σ g KL`` into ``out`` ``(N, V)``: from the forward's ``(N,)``
    statistics in ``DT`` (:func:`_kl_grad_fast`), or, where ``redo[r]`` (an ``(N,)`` bool),
    in float64 from the logits (:func:`_kl_grad_exact`)."""
    row = tl.program_id(0).to(tl.int64)
    z_base = _row_start(z_ptr, row, n_inner, zs_outer, zs_inner)
    w_base = _row_start(w_ptr, row, n_inner, ws_outer, ws_inner)
    out = out_ptr + row * V
    g = tl.load(g_ptr + row).to(DT)
    c_z = tl.load(c_ptr + row)
    log_s = tl.load(log_s_ptr + row)
    c0 = tl.load(c0_ptr + row)
    mean_v = tl.load(mean_ptr + row)
    k = tl.full((), scale, DT)
    if tl.load(redo_ptr + row):
        _kl_grad_exact(
            z_base, w_base, zs_v, ws_v, out, g, V, tl.full((), scale, tl.float64), BLOCK, MID
        )
    else:
        _kl_grad_fast(
            z_base,
            w_base,
            zs_v,
            ws_v,
            out,
            c_z,
            log_s,
            c0,
            mean_v,
            g * k,
            V,
            k,
            BLOCK,
            DT,
        )


@triton.jit
def _logprob_tile_kernel(  # type: ignore[no-untyped-def]
    z_ptr,
    col_ptr,
    shift_ptr,
    out_ptr,
    n_rows,
    C,
    stride_r,
    HAS_SHIFT: tl.constexpr,
    ENTROPY: tl.constexpr,
    EXACT: tl.constexpr,
    BLOCK: tl.constexpr,
    DT: tl.constexpr,
):
    """Row ``i`` of a logits tile ``(r, C)`` into ``out`` ``(k, r)``: ``s = Σ e^y``, ``y[col]``
    (0 where ``col`` is outside ``[0, C)``) and, with ``ENTROPY``, ``t = Σ e^y y``, with
    ``y = z - shift`` (``y = z`` without ``HAS_SHIFT``). ``EXACT``: terms ``e^y y`` with
    ``e^y = 0`` are 0; otherwise the plain product (a ``-inf`` logit makes ``t`` NaN)."""
    row = tl.program_id(0).to(tl.int64)
    base = z_ptr + row * stride_r
    cols = tl.arange(0, BLOCK)
    shift = tl.zeros((), DT)
    if HAS_SHIFT:
        shift = tl.load(shift_ptr + row)
    s = tl.zeros((), DT)
    t = tl.zeros((), DT)
    for start in range(0, C, BLOCK):
        idx = start + cols
        mask = idx < C
        y = tl.where(mask, tl.load(base + idx, mask=mask, other=0.0) - shift, -float("inf"))
        e = tl.exp(y)
        s += tl.sum(e, 0)
        if ENTROPY:
            if EXACT:
                t += tl.sum(tl.where(e == 0, 0.0, e * y), 0)
            else:
                t += tl.sum(tl.where(mask, e * y, 0.0), 0)
    col = tl.load(col_ptr + row)
    inside = (col >= 0) & (col < C)
    z_col = tl.load(base + col, mask=inside, other=0.0)
    tl.store(out_ptr + row, s)
    tl.store(out_ptr + n_rows + row, tl.where(inside, z_col - shift, 0.0))
    if ENTROPY:
        tl.store(out_ptr + 2 * n_rows + row, t)


@triton.jit
def _logprob_tile_grad_kernel(  # type: ignore[no-untyped-def]
    z_ptr,
    col_ptr,
    lse_ptr,
    g_ptr,
    ent_ptr,
    gh_ptr,
    C,
    stride_r,
    HAS_ENT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Row ``i`` of a logits tile ``(r, C)`` turned in place into ``G``: with ``ℓ = z - lse``
    and ``p = e^ℓ``, ``G = -p g`` (or, with ``HAS_ENT``, ``-p (g + h (ℓ + H))``, 0 where
    ``p = 0``), plus ``g`` at ``col``."""
    row = tl.program_id(0).to(tl.int64)
    base = z_ptr + row * stride_r
    cols = tl.arange(0, BLOCK)
    lse = tl.load(lse_ptr + row)
    g = tl.load(g_ptr + row)
    col = tl.load(col_ptr + row)
    if HAS_ENT:
        ent = tl.load(ent_ptr + row)
        gh = tl.load(gh_ptr + row)
    for start in range(0, C, BLOCK):
        idx = start + cols
        mask = idx < C
        log_p = tl.load(base + idx, mask=mask, other=0.0) - lse
        p = tl.exp(log_p)
        if HAS_ENT:
            grad = tl.where(p == 0, 0.0, -p * (g + gh * (log_p + ent)))
        else:
            grad = -p * g
        grad = tl.where(idx == col, grad + g, grad)
        tl.store(base + idx, grad, mask=mask)


@triton.jit
def _kl_tile_kernel(  # type: ignore[no-untyped-def]
    z_ptr,
    w_ptr,
    centre_ptr,
    out_ptr,
    n_rows,
    C,
    zs_r,
    ws_r,
    BLOCK: tl.constexpr,
    DT: tl.constexpr,
):
    """Row ``i`` of a policy and a reference logits tile ``(r, C)`` into ``out`` ``(4, r)``:
    with ``v = (w - z) - centre`` and ``e = e^z``, ``Σ e``, ``Σ v e``, ``Σ (expm1(v) - v) e``
    (:func:`_expm1_minus`) and ``max e`` (NaN where ``Σ e`` is: ``tl.max`` skips NaNs)."""
    row = tl.program_id(0).to(tl.int64)
    z_base = z_ptr + row * zs_r
    w_base = w_ptr + row * ws_r
    cols = tl.arange(0, BLOCK)
    centre = tl.load(centre_ptr + row)
    s = tl.zeros((), DT)
    a = tl.zeros((), DT)
    f = tl.zeros((), DT)
    top = tl.zeros((), DT)
    for start in range(0, C, BLOCK):
        idx = start + cols
        mask = idx < C
        z = tl.load(z_base + idx, mask=mask, other=-float("inf"))
        w = tl.load(w_base + idx, mask=mask, other=0.0)
        v = (w - z) - centre
        e = tl.exp(z)
        s += tl.sum(e, 0)
        a += tl.sum(tl.where(mask, v * e, 0.0), 0)
        f += tl.sum(tl.where(mask, _expm1_minus(v, DT) * e, 0.0), 0)
        top = tl.maximum(top, tl.max(e, 0))
    tl.store(out_ptr + row, s)
    tl.store(out_ptr + n_rows + row, a)
    tl.store(out_ptr + 2 * n_rows + row, f)
    tl.store(out_ptr + 3 * n_rows + row, tl.where(s == s, top, float("nan")))


@triton.jit
def _kl_tile_grad_kernel(  # type: ignore[no-untyped-def]
    z_ptr,
    w_ptr,
    lse_ptr,
    shift_ptr,
    g_ptr,
    C,
    zs_r,
    ws_r,
    MASKED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Row ``i`` of a policy logits tile ``(r, C)`` turned in place into
    ``G = ((z - w) - shift) p g``, ``p = e^{z - lse_z}`` (with ``MASKED``, 0 where ``p = 0``)."""
    row = tl.program_id(0).to(tl.int64)
    z_base = z_ptr + row * zs_r
    w_base = w_ptr + row * ws_r
    cols = tl.arange(0, BLOCK)
    lse = tl.load(lse_ptr + row)
    shift = tl.load(shift_ptr + row)
    g = tl.load(g_ptr + row)
    for start in range(0, C, BLOCK):
        idx = start + cols
        mask = idx < C
        z = tl.load(z_base + idx, mask=mask, other=0.0)
        w = tl.load(w_base + idx, mask=mask, other=0.0)
        p = tl.exp(z - lse)
        grad = ((z - w) - shift) * p * g
        if MASKED:
            grad = tl.where(p == 0, 0.0, grad)
        tl.store(z_base + idx, grad, mask=mask)


def _reference_rows(z: Tensor, w: Tensor, scale: float) -> tuple[Tensor, ...]:
    """The reference path for a few rows: klpen's float64 KL, ``(lse_z, lse_w, kl, E_p[d], p,
    log p/q)`` (see ``exact_rows``). The one place this module calls the torch kernels."""
    from .torch_kl import exact_rows

    return exact_rows(z, w, scale)


def _centred(
    s: Tensor, a: Tensor, f: Tensor, max_e: Tensor, c: Tensor, eps: float
) -> tuple[Tensor, ...]:
    """``(KL, E_p[d], unsure)`` from the kernel's sums, by klpen's own centred formula (the
    terms' ``v`` formed from the exact difference of the logits)."""
    from .torch_kl import centred_kl

    return centred_kl(s, a, f, max_e, c, eps, exact_difference=True)


def _flat_grad(g: Tensor | None, n: int, dtype: torch.dtype) -> Tensor | None:
    return None if g is None else g.reshape(n).to(dtype).contiguous()


def _tile_launch(z: Tensor, *more: Tensor) -> tuple[int, int, int]:
    """``(rows, columns, BLOCK)`` of a logits tile ``(r, c)`` (and of tiles of its shape):
    fp32 or fp64, unit column stride, any row stride (a view of a wider scratch buffer)."""
    r, c = z.shape
    for x in (z, *more):
        if x.dtype not in (torch.float32, torch.float64) or x.shape != z.shape:
            raise ValueError(f"tiles of one shape in fp32 or fp64, got {tuple(x.shape)} {x.dtype}")
        if c > 1 and x.stride(1) != 1:
            raise ValueError("a tile's columns must be contiguous (stride(1) == 1)")
    return r, c, block_size(c, z.device)


class TritonBackend:
    """klpen's kernels as Triton programs, one per row (see the module docstring).

    Example:
        >>> TritonBackend.name
        'triton'
    """

    name = "triton"
    # linear_logprob_tile reads its tile once and does not write it (see TileOps)
    leaves_exp = False

    def logprobs_forward(
        self, logits: Tensor, tokens: Tensor | None, scale: float, entropy: bool
    ) -> tuple[Tensor, Tensor, tuple[Tensor, ...]]:
        """Per row ``log softmax(k z)[token]`` and/or the entropy; ``saved`` = ``(stats,)``,
        ``(3, N)``: the centre, ``log s`` and the entropy."""
        dtype = _compute_dtype(logits.dtype)
        shape, vocab = logits.shape[:-1], logits.shape[-1]
        n = logits.numel() // vocab if vocab else 0
        x, n_inner, s_outer, s_inner, s_v = _layout(logits)
        empty = torch.empty(0, dtype=dtype, device=logits.device)
        logp = torch.empty(n, dtype=dtype, device=logits.device) if tokens is not None else empty
        ent = torch.empty(n, dtype=dtype, device=logits.device) if entropy else empty
        stats = torch.zeros(3, n, dtype=dtype, device=logits.device)
        tok = None if tokens is None else tokens.reshape(n).contiguous()
        if n:
            block = block_size(vocab, logits.device)
            launch(
                _logprobs_fwd_kernel,
                (n,),
                x,
                logp if tok is None else tok,
                logp,
                ent,
                stats,
                n,
                n_inner,
                s_outer,
                s_inner,
                s_v,
                vocab,
                float(scale),
                HAS_TOK=tok is not None,
                ENTROPY=entropy,
                BLOCK=block,
                DT=_tl_dtype(dtype),
                num_warps=num_warps(block),
            )
        if tokens is not None:
            logp = logp.view(shape)
        if entropy:
            ent = ent.view(shape)
        return logp, ent, (stats,)

    def logprobs_saved_like(
        self, logits: Tensor, tokens: Tensor | None, entropy: bool
    ) -> tuple[Tensor, ...]:
        """Empty tensors shaped as what :meth:`logprobs_forward` saves (for fake tensors)."""
        n = logits.numel() // logits.shape[-1]
        return (logits.new_empty((3, n), dtype=_compute_dtype(logits.dtype)),)

    def logprobs_backward(
        self,
        logits: Tensor,
        tokens: Tensor | None,
        saved: tuple[Tensor, ...],
        grad_logp: Tensor | None,
        grad_ent: Tensor | None,
        scale: float,
    ) -> Tensor:
        """``d/dz`` of ``Σ g log p(y) + h H`` in one more read of the logits."""
        (stats,) = saved
        dtype, vocab = stats.dtype, logits.shape[-1]
        n = stats.shape[1]
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        if tokens is None:
            grad_logp = None
        g = _flat_grad(grad_logp, n, dtype)
        h = _flat_grad(grad_ent, n, dtype)
        if g is None and h is None:
            return grad.zero_()
        if n:
            x, n_inner, s_outer, s_inner, s_v = _layout(logits)
            tok = tokens.reshape(n).contiguous() if tokens is not None else stats
            block = block_size(vocab, logits.device)
            launch(
                _logprobs_bwd_kernel,
                (n,),
                x,
                tok,
                stats if g is None else g,
                stats if h is None else h,
                stats,
                grad,
                n,
                n_inner,
                s_outer,
                s_inner,
                s_v,
                vocab,
                float(scale),
                HAS_G=g is not None,
                HAS_H=h is not None,
                BLOCK=block,
                DT=_tl_dtype(dtype),
                num_warps=num_warps(block),
            )
        return grad

    def full_kl_forward(
        self, policy: Tensor, reference: Tensor, scale: float
    ) -> tuple[Tensor, tuple[Tensor, ...]]:
        """``KL(softmax(k z) ‖ softmax(k w))`` per row; ``saved`` = ``(c_z, log S, c0, E_p[v],
        redo)``: the softmax's centre and log-sum, the centre ``c0`` of ``v = ((w - z) - c0)
        k`` and its mean, and ``redo`` the ``(N,)`` mask of the rows computed by the reference
        path.

        One read of both logits (:func:`_kl_fwd_kernel`) gives each row's centred sums; the
        KL, ``E_p[d]`` and the error estimate come from ``centred_kl`` (``exact_difference``:
        the kernel forms ``v`` from the exact ``w - z``). The rows it cannot promise and the
        rows whose sums are not finite (a NaN or infinite logit, an overflowing log-ratio) are
        redone in float64 from the logits inside a second kernel over all rows
        (:func:`_kl_exact_fwd_kernel`, the others return at once), with ``c_z = 0`` and
        ``log S = lse(k z)``, merged by ``torch.where``: no gather, no ``(rows, V)``
        temporary, no read of the mask on the host, in both validation modes. Invalid rows
        (a NaN or ``+inf`` logit, or no finite logit on one side) are NaN.
        """
        dtype = _compute_dtype(torch.promote_types(policy.dtype, reference.dtype))
        shape, vocab = policy.shape[:-1], policy.shape[-1]
        n = policy.numel() // vocab if vocab else 0
        stats = torch.zeros(7, n, dtype=dtype, device=policy.device)
        exact = torch.zeros(2, n, dtype=torch.float64, device=policy.device)
        c_z, log_s, s, a, f, c, max_e = stats.unbind()
        z, w, strides = _pair_layout(policy, reference)
        # float64 sums per lane: at most 4 entries per thread (no spill)
        block = block_size(vocab, policy.device, 1024 if dtype == torch.float64 else GPU_BLOCK)
        if n:
            launch(
                _kl_fwd_kernel,
                (n,),
                z,
                w,
                stats,
                n,
                *strides,
                vocab,
                float(scale),
                BLOCK=block,
                DT=_tl_dtype(dtype),
                num_warps=num_warps(block),
            )
        kl, _, unsure = _centred(s, a, f, max_e, c * scale, torch.finfo(dtype).eps)
        mask = unsure | ~(s.isfinite() & a.isfinite() & f.isfinite())
        if n:
            launch(
                _kl_exact_fwd_kernel,
                (n,),
                z,
                w,
                mask,
                exact,
                n,
                *strides,
                vocab,
                float(scale),
                BLOCK=block,
                num_warps=num_warps(block),
            )
        kl64, lse_z = exact.unbind()
        kl = torch.where(mask, kl64.to(dtype), kl)
        # the reference rows' softmax centre: c_z = 0, log S = lse(k z)
        c_z = torch.where(mask, 0.0, c_z)
        log_s = torch.where(mask, lse_z.to(dtype), log_s)
        mean_v = torch.where(mask, 0.0, a / s)
        c = torch.where(mask, 0.0, c)
        return kl.clamp(min=0.0).view(shape), (c_z, log_s, c, mean_v, mask)

    def full_kl_saved_like(self, policy: Tensor, reference: Tensor) -> tuple[Tensor, ...]:
        """Empty tensors shaped as what :meth:`full_kl_forward` saves (for fake tensors)."""
        dtype = _compute_dtype(torch.promote_types(policy.dtype, reference.dtype))
        n = policy.numel() // policy.shape[-1]
        rows = tuple(policy.new_empty(n, dtype=dtype) for _ in range(4))
        return (*rows, policy.new_empty(n, dtype=torch.bool))

    def full_kl_backward(
        self,
        policy: Tensor,
        reference: Tensor,
        saved: tuple[Tensor, ...],
        grad: Tensor,
        scale: float,
    ) -> Tensor:
        """``d/dz`` of ``Σ g KL``: ``k g p_j (d_j - E_p[d])``, reference rows in float64.

        The rows of the saved mask get the reference path's float64 gradient,
        ``k g (p_j log(p_j / q_j) - p_j KL)``: the kernel takes that branch per row, with no
        read of the mask on the host.
        """
        c_z, log_s, c0, mean_v, mask = saved
        dtype, vocab = c_z.dtype, policy.shape[-1]
        n = c_z.shape[0]
        out = torch.empty(policy.shape, dtype=policy.dtype, device=policy.device)
        if not n:
            return out
        g = grad.reshape(n).to(dtype).contiguous()
        z, w, strides = _pair_layout(policy, reference)
        block = block_size(vocab, policy.device)
        launch(
            _kl_bwd_kernel,
            (n,),
            z,
            w,
            g,
            c_z,
            log_s,
            c0,
            mean_v,
            mask,
            out,
            *strides,
            vocab,
            float(scale),
            BLOCK=block,
            DT=_tl_dtype(dtype),
            MID=_tl_dtype(_compute_dtype(policy.dtype)),
            num_warps=num_warps(block),
        )
        return out

    # Hidden-state tiles: the per-tile statistics of ``linear_logprobs`` / ``linear_full_kl``.
    # ``z``, ``w``: ``(r, c)`` logits tiles in the compute dtype (fp32 or fp64), unit column
    # stride, any row stride; the ``(r,)`` vectors contiguous in that dtype, ``col`` int64. One
    # tile each, no host synchronisation: the caller accumulates over the vocabulary tiles.

    def linear_logprob_tile(
        self, z: Tensor, col: Tensor, shift: Tensor | None, entropy: bool, exact: bool
    ) -> Tensor:
        r"""One tile's log-prob sums, ``(k, r)`` in ``z``'s dtype (``k = 3`` with ``entropy``,
        else 2), in one read of ``z`` (not written).

        With ``y = z - shift[:, None]`` (``y = z`` when ``shift`` is ``None``), per row:

        .. math:: s = \sum_j e^{y_j}, \qquad \mathrm{taken} = y_{\mathrm{col}}, \qquad
            t = \sum_j e^{y_j} y_j

        ``taken`` is 0 where ``col`` (``(r,)`` int64, relative to the tile's first column) is
        outside ``[0, c)``. ``exact``: terms of ``t`` with ``e^{y_j} = 0`` are 0 (``-inf``
        logits give 0); otherwise the plain product (a ``-inf`` logit makes ``t`` NaN, which
        flags the row). NaN logits make ``s`` and ``t`` NaN, ``+inf`` makes ``s`` infinite.
        """
        r, c, block = _tile_launch(z)
        out = torch.empty((3 if entropy else 2, r), dtype=z.dtype, device=z.device)
        if r:
            launch(
                _logprob_tile_kernel,
                (r,),
                z,
                col,
                z if shift is None else shift,
                out,
                r,
                c,
                z.stride(0),
                HAS_SHIFT=shift is not None,
                ENTROPY=entropy,
                EXACT=exact and entropy,
                BLOCK=block,
                DT=_tl_dtype(z.dtype),
                num_warps=num_warps(block),
            )
        return out

    def linear_logprob_tile_grad(
        self,
        z: Tensor,
        col: Tensor,
        lse: Tensor,
        g: Tensor,
        ent: Tensor | None,
        gh: Tensor | None,
    ) -> Tensor:
        r"""One tile's gradient of ``Σ_i g_i log p(col_i) + h_i H_i`` w.r.t. its logits,
        written into ``z`` (returned).

        With ``ℓ = z - lse[:, None]`` (``lse`` of the whole row) and ``p = e^ℓ``:

        .. math:: G_{ij} = g_i \mathbb{1}[j = \mathrm{col}_i]
            - p_{ij} \big(g_i + h_i (\ell_{ij} + H_i)\big)

        ``ent``, ``gh``: ``H`` and ``h`` ``(r,)``, both or neither (then ``G = -p g``, plus
        ``g`` at ``col``); with them, ``G = 0`` where ``p = 0`` before ``g`` is added at
        ``col``. ``col`` as in :meth:`linear_logprob_tile` (outside ``[0, c)``: no term).
        """
        if (ent is None) != (gh is None):
            raise ValueError("ent and gh are given together or not at all")
        r, c, block = _tile_launch(z)
        if r:
            launch(
                _logprob_tile_grad_kernel,
                (r,),
                z,
                col,
                lse,
                g,
                lse if ent is None else ent,
                lse if gh is None else gh,
                c,
                z.stride(0),
                HAS_ENT=ent is not None,
                BLOCK=block,
                num_warps=num_warps(block),
            )
        return z

    def linear_kl_tile(self, z: Tensor, w: Tensor, centre: Tensor) -> Tensor:
        r"""One tile's centred KL sums, ``(4, r)`` in ``z``'s dtype, in one read of the policy
        and reference logits ``z``, ``w`` (not written).

        With ``v = (w - z) - centre[:, None]`` and ``e = e^z`` (unshifted), per row:

        .. math:: S_z = \sum_j e_j, \quad \sum_j v_j e_j, \quad
            \sum_j (\operatorname{expm1}(v_j) - v_j)\, e_j, \quad \max_j e_j

        ``expm1(v) - v`` by its series below ``|v| = 1/2`` (:func:`_expm1_minus`). The plain
        products: a ``-inf`` policy logit (``0 · inf``) or a NaN makes the sums NaN; a NaN
        policy logit makes all four NaN.
        """
        r, c, block = _tile_launch(z, w)
        out = torch.empty((4, r), dtype=z.dtype, device=z.device)
        if r:
            launch(
                _kl_tile_kernel,
                (r,),
                z,
                w,
                centre,
                out,
                r,
                c,
                z.stride(0),
                w.stride(0),
                BLOCK=block,
                DT=_tl_dtype(z.dtype),
                num_warps=num_warps(block),
            )
        return out

    def linear_kl_tile_grad(
        self, z: Tensor, w: Tensor, lse_z: Tensor, shift: Tensor, g: Tensor, masked: bool
    ) -> Tensor:
        r"""One tile's gradient of ``Σ_i g_i KL_i`` w.r.t. the policy logits, written into
        ``z`` (returned); ``w`` is read only.

        .. math:: G_{ij} = \big((z_{ij} - w_{ij}) - \mathrm{shift}_i\big)\, p_{ij}\, g_i,
            \qquad p_{ij} = e^{z_{ij} - \mathrm{lse}_{z,i}}

        (``shift = lse_z - lse_w + KL`` makes this ``∂KL/∂z``). ``masked``: ``G = 0`` where
        ``p = 0`` (``-inf`` logits give 0, not NaN).
        """
        r, c, block = _tile_launch(z, w)
        if r:
            launch(
                _kl_tile_grad_kernel,
                (r,),
                z,
                w,
                lse_z,
                shift,
                g,
                c,
                z.stride(0),
                w.stride(0),
                MASKED=masked,
                BLOCK=block,
                num_warps=num_warps(block),
            )
        return z

    # The generalized JSD of klpen.distill: the kernels of klpen.kernels.triton_jsd.

    def jsd_forward(
        self, student: Tensor, teacher: Tensor, scale: float, beta: float
    ) -> tuple[Tensor, tuple[Tensor, ...]]:
        """``J_β`` per row and the statistics the backward reads
        (:func:`klpen.kernels.triton_jsd.jsd_forward`)."""
        from .triton_jsd import jsd_forward

        return jsd_forward(student, teacher, scale, beta)

    def jsd_saved_like(self, student: Tensor, teacher: Tensor) -> tuple[Tensor, ...]:
        """Empty tensors shaped as what :meth:`jsd_forward` saves (for fake tensors)."""
        from .triton_jsd import jsd_saved_like

        return jsd_saved_like(student, teacher)

    def jsd_backward(
        self,
        student: Tensor,
        teacher: Tensor,
        saved: tuple[Tensor, ...],
        grad: Tensor,
        scale: float,
        beta: float,
        needs: tuple[bool, bool],
    ) -> tuple[Tensor | None, Tensor | None]:
        """``(d/dstudent, d/dteacher)`` of ``Σ grad · J_β`` where ``needs`` says
        (:func:`klpen.kernels.triton_jsd.jsd_backward`)."""
        from .triton_jsd import jsd_backward

        return jsd_backward(student, teacher, saved, grad, scale, beta, needs)
