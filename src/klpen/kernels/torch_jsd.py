r"""The ``torch`` kernels of the generalized Jensen-Shannon divergence, exact, block by block.

For student logits ``z``, teacher logits ``w`` and an inverse temperature ``k``, per row,
with ``p = softmax(k z)`` (the student), ``q = softmax(k w)`` (the teacher) and
``m = β q + (1 - β) p``, the divergence of TRL's ``GKDTrainer.generalized_jsd_loss``:

.. math::

    J_\beta = \begin{cases}
        \mathrm{KL}(q \,\|\, p) & \beta = 0 \\
        \beta\,\mathrm{KL}(q \,\|\, m) + (1 - \beta)\,\mathrm{KL}(p \,\|\, m) & 0 < \beta < 1 \\
        \mathrm{KL}(p \,\|\, q) & \beta = 1
    \end{cases}

**A form without cancellation.** With ``d = log q - log p`` per token and
``φ(t) = t - log1p(t) >= 0``, the identity ``Σ m = Σ p = Σ q = 1`` turns every term into a
non-negative one:

.. math::

    J_\beta = \sum_v (1 - \beta)\, p_v\, \varphi\big(\beta\, \mathrm{expm1}(d_v)\big)
        + \beta\, q_v\, \varphi\big((1 - \beta)\, \mathrm{expm1}(-d_v)\big)

(``p φ(β expm1 d) = β (q - p) - p log(m / p)``: the linear parts cancel in the sum), and at
the ends ``KL(p ‖ q) = Σ p φ(expm1 d)``, ``KL(q ‖ p) = Σ q φ(expm1(-d))``. ``φ(t) ≈ t² / 2``
is evaluated by a series in ``y = t / (2 + t)`` for ``|t| < 1/20`` (:func:`phi`), so that a
divergence of ``1e-12`` keeps its digits; the sum over the vocabulary adds non-negative
terms only. ``d`` itself comes from a centred form: with ``D = k (w - z)`` (exact for close
logits at any common offset), ``c = E_p[D]`` and ``v = D - c``,
``d = v - log1p(E_p[expm1 v])``; rows where that sum overflows (a log-ratio beyond the
dtype's exponent range, a divergence far from 0), or where the teacher has mass on a token
of student probability 0, take ``d = log q - log p`` directly.

**Near an end.** ``log1p(β expm1 d) = log(m / p) = log(1 - β + β e^d)`` is taken by
:func:`log_mixture`: from positive terms where ``β expm1 d < -1/2`` (so that a
``1 - β`` of ``1e-12`` is not lost to the rounding of ``1 + β expm1 d``) and as
``d + log(β + (1 - β) e^{-d})`` where it exceeds 1 (no overflow of ``expm1``); likewise
``log(m / q)``. Mixtures with ``min(β, 1 - β) < 1/16`` (:func:`near_end`) skip the fast path
below, whose expectations lose digits there.

Gradients, ``a = log(p / m) = -log1p(β expm1 d)``, ``b = log(q / m)``:

.. math::

    \frac{\partial J}{\partial z_j} = k (1 - \beta)\, p_j \big(a_j - E_p[a]\big), \qquad
    \frac{\partial J}{\partial w_j} = k \beta\, q_j \big(b_j - E_q[b]\big)

for ``0 < β < 1``; ``k p_j (log(p_j / q_j) - KL)`` and ``k (q_j - p_j)`` at ``β = 1``,
``k (p_j - q_j)`` and ``k q_j (log(q_j / p_j) - KL)`` at ``β = 0``.

Every pass takes the rows a block at a time (:func:`jsd_block_rows`): no ``(N, V)``
temporary, a dozen block-sized ones (five, reused, on the fast path below, which saves
per-row statistics for the backward). ``-inf`` logits are tokens of probability 0; the
mixture divergence is then finite, the two ends may be ``+inf``. Rows with NaN or ``+inf``
logits, or with all logits ``-inf``, give NaN.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from .blocks import paired_row_blocks, sync_free

__all__ = [
    "JSD_BLOCK_ELEMENTS",
    "JSD_SAVED_COLUMNS",
    "JSD_WORK_BLOCKS",
    "BlockState",
    "block_state",
    "jsd_backward_saved",
    "jsd_block_rows",
    "jsd_forward",
    "jsd_forward_saved",
    "jsd_grads",
    "jsd_rows",
    "jsd_rows_grad",
    "jsd_saved_like",
    "jsd_work",
    "log_mixture",
    "near_end",
    "phi",
    "plain_span",
]

# Elements of one block: 2**18 fp32 (1 MiB); a pass holds about a dozen such temporaries.
JSD_BLOCK_ELEMENTS = 1 << 18
# |t| below this: the series of phi; above it, t - log1p(t) loses fewer than six bits.
SERIES_BOUND = 0.05
# Mixtures with min(β, 1 - β) below this are "near an end" (:func:`near_end`).
NEAR_END = 1.0 / 16.0


def near_end(beta: float) -> bool:
    """Whether ``0 < β < 1`` lies within :data:`NEAR_END` of 0 or 1. There one of the
    mixture's logarithms, ``log(m / p)`` or ``log(m / q)``, is a sum of ``1 - β`` (or ``β``)
    and a tiny term: the fast forms here take those sums term by term
    (:func:`log_mixture`), and the Triton kernels take their ``MODE`` 3.

    Example:
        >>> near_end(0.5), near_end(1e-3), near_end(1.0)
        (False, True, False)
    """
    return 0.0 < beta < 1.0 and min(beta, 1.0 - beta) < NEAR_END


def log_mixture(x: Tensor, coef: float, rest: float) -> Tensor:
    """``log(rest + coef e^x)`` with ``rest = 1 - coef`` given exactly (``log(m / p)`` at
    ``x = d``, ``coef = β``, ``rest = 1 - β``; ``log(m / q)`` at ``-d``, ``1 - β``, ``β``),
    relative to itself: ``log1p(coef expm1 x)`` where ``coef expm1 x`` lies in
    ``[-1/2, 1]``; below, ``log(rest + coef e^x)``, a sum of positive terms, so that
    ``rest = 1e-12`` is not lost to the rounding of ``1 + coef expm1 x``; above,
    ``x + log(coef + rest e^{-x})`` (no overflow). ``±inf`` at ``x = ±inf`` where
    ``rest = 0``, else finite for finite ``x`` or ``x = -inf``.

    Example:
        >>> x = torch.tensor([-30.0, 0.0, 40.0], dtype=torch.float64)
        >>> log_mixture(x, 1.0 - 1e-12, 1e-12)  # log(1e-12 + e^-30) at -30
        tensor([-27.5416,   0.0000,  40.0000], dtype=torch.float64)
    """
    t = torch.expm1(x).mul_(coef)
    below, above = t < -0.5, t > 1.0
    out = torch.log1p(torch.where(below | above, 0.0, t))
    low = torch.exp(torch.where(below, x, 0.0)).mul_(coef).add_(rest).log_()
    high = torch.exp(torch.where(above, -x, 0.0)).mul_(rest).add_(coef).log_()
    high.add_(torch.where(above, x, 0.0))
    return torch.where(below, low, torch.where(above, high, out))


def jsd_block_rows(vocab_size: int) -> int:
    """Rows per block for a vocabulary of ``vocab_size`` (at least 1).

    Example:
        >>> jsd_block_rows(32_000)
        8
    """
    return max(1, JSD_BLOCK_ELEMENTS // max(vocab_size, 1))


def phi(t: Tensor) -> Tensor:
    r"""``φ(t) = t - log1p(t)`` for ``t > -1``, without cancellation near 0.

    For ``|t| < 1/20``, with ``y = t / (2 + t)`` (so ``log1p(t) = 2 atanh(y)``):

    .. math:: \varphi(t) = \frac{2 y^2}{1 - y} - 2 y^3 \Big(\frac13 + \frac{y^2}{5}\Big)

    (truncation below ``2e-9`` relative, no cancellation: the second term is at most a
    fortieth of the first); elsewhere ``t - log1p(t)``, which there loses at most about
    40 units of rounding. ``φ(inf) = NaN``: callers handle infinite ``t`` themselves.

    Example:
        >>> phi(torch.tensor([0.0, 1e-4, 1.0], dtype=torch.float64))
        tensor([0.0000e+00, 4.9997e-09, 3.0685e-01], dtype=torch.float64)
    """
    small = t.abs() < SERIES_BOUND
    return torch.where(small, _phi_series(torch.where(small, t, 0.0)), t - torch.log1p(t))


def _phi_series(t: Tensor) -> Tensor:
    """The series of :func:`phi`, for ``|t| < SERIES_BOUND`` only."""
    y = t / (t + 2.0)
    y2 = y * y
    tail = (y2 * 0.2).add_(1.0 / 3.0).mul_(y2).mul_(y)
    return (1.0 - y).reciprocal_().mul_(y2).sub_(tail).mul_(2.0)


def _weighted_phi(p: Tensor, q: Tensor, x: Tensor, coef: float, rest: float) -> Tensor:
    """``p φ(coef · expm1(x))`` with ``x = log q - log p`` and ``rest = 1 - coef`` (exact),
    also where ``p = 0`` (then ``coef · q``, the limit) and where ``x`` is infinite or
    ``expm1 x`` overflows. ``log1p(coef expm1 x) = log(m / p)`` by :func:`log_mixture`; at
    ``coef = 1`` it is ``x`` as such (``expm1(-20)`` rounds to ``-1`` in fp32)."""
    t = torch.expm1(x).mul_(coef)
    small = t.abs() < SERIES_BOUND
    log_ratio = x if coef == 1.0 else log_mixture(x, coef, rest)
    # p (t - log1p t), t = coef (q / p - 1), where p > 0 and t is finite: the rounding of p
    # and q (a unit of |log p|) does not enter a difference q - p of nearby numbers; where
    # p = 0 the limit coef q (also where q underflowed to 0 and x = -inf)
    direct = torch.where(
        (p > 0) & torch.isfinite(t),
        p * (t - log_ratio),
        (q - p).mul_(coef).sub_(torch.where(p > 0, p * log_ratio, 0.0)),
    )
    return torch.where(small, p * _phi_series(torch.where(small, t, 0.0)), direct)


class BlockState(NamedTuple):
    """One block's per-token quantities: ``p``, ``q`` and ``d = log q - log p``, ``(r, V)``,
    and ``valid`` ``(r,)`` (rows whose logits are usable)."""

    p: Tensor
    q: Tensor
    d: Tensor
    valid: Tensor


def _centred_log_softmax(x: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """``(log_softmax(k x), valid)``, the max taken apart before scaling (exact at any
    offset); ``valid`` ``(r,)``: rows without NaN or ``+inf`` and not all ``-inf``."""
    top = x.amax(dim=-1, keepdim=True)
    centred = (x - torch.where(torch.isfinite(top), top, 0.0)).mul_(scale)
    log_s = torch.logsumexp(centred, dim=-1, keepdim=True)
    valid = (torch.isfinite(top) & torch.isfinite(log_s)).squeeze(-1)
    return centred.sub_(log_s), valid


def block_state(z: Tensor, w: Tensor, scale: float, dtype: torch.dtype) -> BlockState:
    """:class:`BlockState` of the ``(r, V)`` blocks ``z`` (student) and ``w`` (teacher).

    Example:
        >>> s = block_state(torch.zeros(1, 2), torch.tensor([[0.0, 1.0]]), 1.0, torch.float32)
        >>> s.d
        tensor([[-0.6201,  0.3799]])
    """
    z, w = z.to(dtype), w.to(dtype)
    (log_p, valid_p), (log_q, valid_q) = (_centred_log_softmax(x, scale) for x in (z, w))
    p, q = log_p.exp(), log_q.exp()
    has_p = p > 0
    big_d = (w - z).mul_(scale)
    # any constant centre is exact; E_p[D] keeps v small (rows where it is not finite: 0)
    centre = torch.where(has_p, p * big_d, 0.0).sum(-1, keepdim=True)
    centre = torch.where(torch.isfinite(centre), centre, 0.0)
    v = big_d.sub_(centre)
    u = torch.where(has_p, p * torch.expm1(v), 0.0).sum(-1, keepdim=True)
    u.div_(p.sum(-1, keepdim=True))
    shift = torch.log1p(u)
    # Teacher mass where the student has none is outside E_p: such rows take log q - log p.
    outside = torch.where(has_p, 0.0, q).sum(-1, keepdim=True)
    centred = torch.isfinite(shift) & (outside == 0)
    d = torch.where(centred, v.sub_(shift), log_q - log_p)
    return BlockState(p, q, d, valid_p & valid_q)


def jsd_rows(z: Tensor, w: Tensor, scale: float, beta: float, dtype: torch.dtype) -> Tensor:
    """``J_β`` of each row of the ``(r, V)`` blocks (the module's formula), ``(r,)``.

    Example:
        >>> z = torch.tensor([[2.0, 0.0, 0.0]])
        >>> jsd_rows(z, z, 1.0, 0.5, torch.float32), jsd_rows(z, torch.zeros(1, 3), 1.0, 1.0,
        ...                                                   torch.float32)
        (tensor([0.]), tensor([0.4330]))
    """
    s = block_state(z, w, scale, dtype)
    if beta == 1.0:
        terms = _weighted_phi(s.p, s.q, s.d, 1.0, 0.0)
    elif beta == 0.0:
        terms = _weighted_phi(s.q, s.p, -s.d, 1.0, 0.0)
    else:
        terms = _weighted_phi(s.p, s.q, s.d, beta, 1.0 - beta).mul_(1.0 - beta)
        terms.add_(_weighted_phi(s.q, s.p, -s.d, 1.0 - beta, beta).mul_(beta))
    return torch.where(s.valid, terms.sum(-1), torch.nan)


def _centred_gradient(weight: Tensor, x: Tensor) -> Tensor:
    """``weight (x - E_weight[x])`` per row, 0 where ``weight`` is 0 (``x`` may be ±inf)."""
    has = weight > 0
    mean = torch.where(has, weight * x, 0.0).sum(-1, keepdim=True)
    return torch.where(has, weight * (x - mean), 0.0)


def jsd_rows_grad(
    z: Tensor,
    w: Tensor,
    grad: Tensor,
    scale: float,
    beta: float,
    dtype: torch.dtype,
    needs: tuple[bool, bool],
) -> tuple[Tensor | None, Tensor | None]:
    """``(d/dz, d/dw)`` of ``Σ grad · J_β`` for ``(r, V)`` blocks, ``grad (r,)``, in ``dtype``;
    ``None`` where ``needs`` leaves a side out.

    Example:
        >>> z, w = torch.zeros(1, 2), torch.tensor([[0.0, 1.0]])
        >>> jsd_rows_grad(z, w, torch.ones(1), 1.0, 0.0, torch.float32, (True, False))[0]
        tensor([[ 0.2311, -0.2311]])
    """
    s = block_state(z, w, scale, dtype)
    g = grad.to(dtype)[:, None] * scale
    grad_z = grad_w = None
    if beta == 1.0:  # KL(p || q)
        if needs[0]:
            grad_z = _centred_gradient(s.p, -s.d)
        if needs[1]:
            grad_w = s.q - s.p
    elif beta == 0.0:  # KL(q || p)
        if needs[0]:
            grad_z = s.p - s.q
        if needs[1]:
            grad_w = _centred_gradient(s.q, s.d)
    else:
        if needs[0]:
            a = log_mixture(s.d, beta, 1.0 - beta).neg_()
            grad_z = _centred_gradient(s.p, a).mul_(1.0 - beta)
        if needs[1]:
            b = log_mixture(-s.d, 1.0 - beta, beta).neg_()
            grad_w = _centred_gradient(s.q, b).mul_(beta)
    return (
        None if grad_z is None else grad_z.mul_(g),
        None if grad_w is None else grad_w.mul_(g),
    )


# --- the fast path: per-row statistics saved for the backward, no where, no new blocks ----
#
# A row is *plain* when both logits rows are finite and span less than ``plain_span`` (after
# scaling): every ``p`` and ``q`` is then a normal positive number, ``d`` is finite and no
# ``where`` guard of the formulas above can fire. Per plain row the forward computes
# ``m_z = max z``, ``l_z = log Σ exp(k (z - m_z))`` (likewise for ``w``), the row constant
# ``C = k (m_w - m_z) + l_w - l_z`` (``d = k (w - z) - C`` up to the rounding of ``C``,
# absorbed by the centring step: ``v = k (w - z) - C``, ``u = E_p[expm1 v]``,
# ``d = v - log1p u``, ``expm1 d = (expm1 v - u) / (1 + u)``), and the divergence as
# expectations: ``KL(p ‖ m) = E_p[-log1p(β expm1 d)]``, ``KL(q ‖ m) = E_q[d - log1p(β expm1
# d)]``, ``J_β = β KL(q ‖ m) + (1 - β) KL(p ‖ m)`` (``E_p[-d]`` at β = 1, ``E_q[d]`` at
# β = 0). Those sums of signed terms are exact to a few dozen units of rounding where each
# divergence is at least ``EXPECTATION_FLOOR``; other rows (near-identical distributions),
# and rows that are not plain (a ``-inf`` or non-finite logit, a span that lets a
# probability underflow, a centring sum that overflows), take :func:`jsd_rows`: the
# non-negative terms with the series. Saved per row (:data:`JSD_SAVED_COLUMNS` numbers):
# plain (1 or 0), ``m_z``, ``l_z``, ``C``, ``log1p u`` and ``E_p[a]``, so that the student's
# gradient makes no reduction: ``p = exp(k (z - m_z) - l_z)``, ``d`` as above, and
# ``∂J/∂z = k (1 - β) p (a - E_p[a])`` with ``a = -log1p(β expm1 d)`` (``k p (-d - E_p[-d])``
# at β = 1, ``-k p expm1 d`` at β = 0). The teacher's gradient, and rows that are not plain,
# take :func:`jsd_rows_grad`; so does everything on the sync-free path
# (:func:`~klpen.kernels.blocks.sync_free`), which reads no value to choose rows.

# Columns of the saved statistics: plain, max_z, lse_z, C, shift, mean_a.
JSD_SAVED_COLUMNS = 6
# Scratch blocks of the fast path (:func:`jsd_work`): five in the forward, three in the backward.
JSD_WORK_BLOCKS = 5


def jsd_saved_like(student: Tensor, teacher: Tensor) -> Tensor:
    """An empty ``(N, JSD_SAVED_COLUMNS)`` tensor of the statistics :func:`jsd_forward_saved`
    returns (``N`` rows of ``student (..., V)``), in the compute dtype.

    Example:
        >>> jsd_saved_like(torch.zeros(2, 3, 5), torch.zeros(2, 3, 5)).shape
        torch.Size([6, 6])
    """
    dtype = _compute(student, teacher)
    rows = student.numel() // student.shape[-1] if student.shape[-1] else 0
    return student.new_empty((rows, JSD_SAVED_COLUMNS), dtype=dtype)


def _compute(student: Tensor, teacher: Tensor) -> torch.dtype:
    return torch.promote_types(torch.promote_types(student.dtype, teacher.dtype), torch.float32)


def plain_span(dtype: torch.dtype, vocab: int) -> float:
    """The largest scaled span ``k (max - min)`` of a row's logits for which every
    probability ``exp(-span) / V`` of the row is a normal number of ``dtype``, less a margin.

    Example:
        >>> round(plain_span(torch.float32, 32_000), 2)
        75.96
    """
    return -math.log(torch.finfo(dtype).tiny) - math.log(max(vocab, 1)) - 1.0


def _work(
    count: int, rows: int, vocab: int, dtype: torch.dtype, device: torch.device
) -> tuple[Tensor, ...]:
    """The scratch of one call: ``count`` ``(rows, V)`` blocks in the compute dtype, reused
    by every block (fresh blocks would cost their page faults each time)."""
    return tuple(torch.empty(rows, vocab, dtype=dtype, device=device) for _ in range(count))


def _exp_sums_into(
    x: Tensor, out: Tensor, scale: float, span: float
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``out = exp(k (x - max))`` of a block of rows (unnormalised); per row
    ``(max, 1 / Σ out, log Σ out, plain)``."""
    top, low = x.amax(-1), x.amin(-1)
    torch.sub(x, top[:, None], out=out)
    if scale != 1.0:
        out.mul_(scale)
    total = out.exp_().sum(-1)
    plain = torch.isfinite(low) & torch.isfinite(top) & ((top - low) * scale < span)
    return top, total.reciprocal(), total.log_(), plain


def _fast_rows(
    z: Tensor, w: Tensor, scale: float, beta: float, work: tuple[Tensor, ...]
) -> tuple[Tensor, Tensor, Tensor]:
    """``(J_β per row, saved statistics, accurate)`` of ``(r, V)`` blocks by the fast path.
    ``accurate`` marks the rows whose value this path guarantees (plain, and a divergence
    large enough for the expectation form, see :func:`_expectation_safe`); the caller
    redoes the others. The statistics of plain rows are exact either way."""
    r, vocab = z.shape
    pz, qw, d, t, e = (x[:r] for x in work)
    dtype = pz.dtype
    span = plain_span(dtype, vocab)
    top_z, inv_z, lse_z, plain_z = _exp_sums_into(z, pz, scale, span)
    top_w, inv_w, lse_w, plain_w = _exp_sums_into(w, qw, scale, span)
    const = (top_w - top_z).mul_(scale).add_(lse_w).sub_(lse_z)
    torch.sub(w, z, out=d)
    if scale != 1.0:
        d.mul_(scale)
    d.sub_(const[:, None])  # v = d + (log1p u), u = E_p[expm1 v]
    torch.expm1(d, out=t)
    u = _row_dot(pz, t, inv_z, e)
    shift = torch.log1p(u)
    plain = plain_z & plain_w & torch.isfinite(shift)
    d.sub_(shift[:, None])
    inv_u = (1.0 + u).reciprocal_()
    if beta == 1.0:  # KL(p || q) = E_p[-d]
        mean_a = _row_dot(pz, d, inv_z, e).neg_()
        values = mean_a.clone()
        spread = values
    elif beta == 0.0:  # KL(q || p) = E_q[d]
        mean_a = torch.zeros_like(u)
        values = _row_dot(qw, d, inv_w, e)
        spread = values
    else:
        # t = β expm1 d = β (expm1 v - u) / (1 + u), then log(m / p) = log1p(t)
        t.sub_(u[:, None]).mul_((inv_u * beta)[:, None]).log1p_()
        mean_a = _row_dot(pz, t, inv_z, e).neg_()  # KL(p || m) = E_p[-log(m / p)]
        kl_q = _row_dot(qw, d.sub_(t), inv_w, e)  # KL(q || m) = E_q[d - log(m / p)]
        values = kl_q.mul(beta).add_(mean_a, alpha=1.0 - beta)
        spread = torch.minimum(kl_q, mean_a)
    accurate = plain & _expectation_safe(spread)
    saved = torch.stack((plain.to(dtype), top_z, lse_z, const, shift, mean_a), dim=-1)
    return values, saved, accurate


def _row_dot(x: Tensor, y: Tensor, scale: Tensor, scratch: Tensor) -> Tensor:
    """``scale · Σ_v x y`` per row of ``(r, V)`` blocks (``scratch``: a block to overwrite)."""
    return torch.mul(x, y, out=scratch).sum(-1).mul_(scale)


# A row's divergences computed as expectations of signed terms (``E_p[-log(m / p)]``) carry
# an absolute error of about ``eps · E|term|``, and ``E_p|log(p / m)| <= KL + 2 TV <= KL +
# sqrt(2 KL)`` (Pinsker): for ``KL >= EXPECTATION_FLOOR`` that is within a few dozen units of
# rounding of the value. Rows with a smaller divergence (near-identical distributions) are
# summed term by term with the series (:func:`jsd_rows`).
EXPECTATION_FLOOR = 1e-2


def _expectation_safe(kl: Tensor) -> Tensor:
    """Rows whose smaller divergence is at least :data:`EXPECTATION_FLOOR` (not NaN)."""
    return kl >= EXPECTATION_FLOOR


def jsd_work(vocab: int, dtype: torch.dtype, device: torch.device, rows: int) -> tuple[Tensor, ...]:
    """The scratch blocks that :func:`jsd_forward_saved` and :func:`jsd_backward_saved` take as
    ``work``: enough for inputs of up to ``rows`` rows of ``vocab`` logits in ``dtype``, to be
    reused by several calls (a caller that loops over chunks of rows pays their page faults
    once).

    Example:
        >>> [tuple(x.shape) for x in jsd_work(32_000, torch.float32, torch.device("cpu"), 3)]
        [(3, 32000), (3, 32000), (3, 32000), (3, 32000), (3, 32000)]
    """
    return _work(JSD_WORK_BLOCKS, min(jsd_block_rows(vocab), rows), vocab, dtype, device)


def jsd_forward_saved(
    student: Tensor,
    teacher: Tensor,
    scale: float,
    beta: float,
    *,
    out: tuple[Tensor, Tensor] | None = None,
    work: tuple[Tensor, ...] | None = None,
) -> tuple[Tensor, Tensor]:
    """``(J_β per row (...), saved (N, JSD_SAVED_COLUMNS))`` of ``student``, ``teacher``
    ``(..., V)``, in the compute dtype; the saved statistics are what
    :func:`jsd_backward_saved` reads (``O(N)``).

    ``out``: optional ``(values (...), saved (N, JSD_SAVED_COLUMNS))`` tensors to write and
    return; ``work``: optional scratch from :func:`jsd_work` (allocated per call otherwise).

    Example:
        >>> z = torch.tensor([[2.0, 0.0, 0.0]])
        >>> jsd_forward_saved(z, torch.zeros(1, 3), 1.0, 0.5)[0]
        tensor([0.1087])
    """
    dtype = _compute(student, teacher)
    vocab = student.shape[-1]
    if out is None:
        out = (
            torch.empty(student.shape[:-1], dtype=dtype, device=student.device),
            jsd_saved_like(student, teacher),
        )
    values_out, saved = out
    flat = values_out.view(-1)
    rows = jsd_block_rows(vocab)
    # near an end, the fast form's log1p(β expm1 d) would lose 1 - β (or β) to rounding
    fast = not sync_free(student) and not near_end(beta)
    if fast and work is None:
        work = jsd_work(vocab, dtype, student.device, flat.numel())
    for start, z, w in paired_row_blocks(student, teacher, rows):
        stop = start + z.shape[0]
        if not fast or work is None:
            flat[start:stop] = jsd_rows(z, w, scale, beta, dtype)
            saved[start:stop].zero_()  # no row plain: the backward recomputes
            continue
        values, stats, accurate = _fast_rows(z.to(dtype), w.to(dtype), scale, beta, work)
        other = (~accurate).nonzero().squeeze(-1)
        if other.numel():
            values[other] = jsd_rows(z[other], w[other], scale, beta, dtype)
        flat[start:stop] = values
        saved[start:stop] = stats
    return values_out, saved


def jsd_backward_saved(
    student: Tensor,
    teacher: Tensor,
    saved: Tensor,
    grad: Tensor,
    scale: float,
    beta: float,
    needs: tuple[bool, bool],
    *,
    out: tuple[Tensor | None, Tensor | None] | None = None,
    work: tuple[Tensor, ...] | None = None,
) -> tuple[Tensor | None, Tensor | None]:
    """``(d/dstudent, d/dteacher)`` of ``Σ grad · J_β`` from the statistics of
    :func:`jsd_forward_saved`, in the inputs' shapes and dtypes; ``None`` where ``needs``
    leaves a side out. The student's gradient of plain rows reads the logits once, without
    a reduction; the teacher's gradient, and rows that are not plain, take
    :func:`jsd_rows_grad`.

    ``out``: optional tensors of the inputs' shapes (and layouts) to write the gradients
    into, one per side that ``needs`` asks for; each may be the input itself (a block's
    gradients are written once its logits are read); ``work``: optional scratch from
    :func:`jsd_work`.

    Example:
        >>> z, w = torch.zeros(1, 2), torch.tensor([[0.0, 1.0]])
        >>> _, saved = jsd_forward_saved(z, w, 1.0, 0.0)
        >>> jsd_backward_saved(z, w, saved, torch.ones(1), 1.0, 0.0, (True, False))[0]
        tensor([[ 0.2311, -0.2311]])
    """
    dtype = _compute(student, teacher)
    vocab = student.shape[-1]
    outs = (
        list(out)
        if out is not None
        else [
            torch.empty(x.shape, dtype=x.dtype, device=x.device) if need else None
            for x, need in zip((student, teacher), needs, strict=True)
        ]
    )
    flats = [None if o is None else o.view(-1, vocab) for o in outs]
    g = grad.reshape(-1)
    rows = jsd_block_rows(vocab)
    fast = needs == (True, False) and not sync_free(student) and not near_end(beta)
    n = g.numel()
    if fast and n and work is None:
        work = jsd_work(vocab, dtype, student.device, n)
    for start, z, w in paired_row_blocks(student, teacher, rows):
        stop = start + z.shape[0]
        if not fast or work is None:
            blocks = jsd_rows_grad(z, w, g[start:stop], scale, beta, dtype, needs)
            for flat, block in zip(flats, blocks, strict=True):
                if flat is not None and block is not None:
                    flat[start:stop] = block
            continue
        stats = saved[start:stop]
        gz = _fast_grad(z.to(dtype), w.to(dtype), stats, g[start:stop], scale, beta, work)
        other = (stats[:, 0] == 0).nonzero().squeeze(-1)
        if other.numel():
            redo, _ = jsd_rows_grad(
                z[other], w[other], g[start:stop][other], scale, beta, dtype, needs
            )
            gz[other] = redo  # type: ignore[assignment]
        flats[0][start:stop] = gz  # type: ignore[index]
    return outs[0], outs[1]


def _fast_grad(
    z: Tensor,
    w: Tensor,
    stats: Tensor,
    grad: Tensor,
    scale: float,
    beta: float,
    work: tuple[Tensor, ...],
) -> Tensor:
    """``d/dz`` of ``Σ grad · J_β`` for ``(r, V)`` blocks of plain rows (others: garbage),
    in a scratch block."""
    r = z.shape[0]
    p, d, e = (x[:r] for x in work[:3])
    _, top, lse, const, shift, mean_a = stats.unbind(-1)
    torch.sub(z, top[:, None], out=p)
    if scale != 1.0:
        p.mul_(scale)
    p.sub_(lse[:, None]).exp_()
    torch.sub(w, z, out=d)
    if scale != 1.0:
        d.mul_(scale)
    d.sub_(const[:, None]).sub_(shift[:, None])
    coef = grad.to(p.dtype) * scale
    if beta == 0.0:  # k (p - q) = -k p expm1 d
        return torch.expm1(d, out=e).mul_(p).mul_(coef.neg_()[:, None])
    if beta == 1.0:  # k p (-d - E_p[-d])
        return d.add_(mean_a[:, None]).mul_(p).mul_(coef.neg_()[:, None])
    torch.expm1(d, out=e).mul_(beta).log1p_()  # log(m / p) = -a
    return e.add_(mean_a[:, None]).mul_(p).mul_(coef.mul_(beta - 1.0)[:, None])


def jsd_forward(student: Tensor, teacher: Tensor, scale: float, beta: float) -> Tensor:
    """``J_β`` per row of ``student``, ``teacher`` ``(..., V)``, ``(...)`` in the compute dtype
    (:func:`jsd_forward_saved` without the statistics).

    Example:
        >>> z = torch.tensor([[2.0, 0.0, 0.0]])
        >>> jsd_forward(z, torch.zeros(1, 3), 1.0, 0.5)
        tensor([0.1087])
    """
    return jsd_forward_saved(student, teacher, scale, beta)[0]


def jsd_grads(
    student: Tensor,
    teacher: Tensor,
    grad: Tensor,
    scale: float,
    beta: float,
    needs: tuple[bool, bool],
) -> tuple[Tensor | None, Tensor | None]:
    """``(d/dstudent, d/dteacher)`` of ``Σ grad · J_β``, in the inputs' shapes and dtypes
    (the statistics of :func:`jsd_forward_saved` recomputed, then
    :func:`jsd_backward_saved`).

    Example:
        >>> z, w = torch.zeros(1, 2), torch.tensor([[0.0, 1.0]])
        >>> jsd_grads(z, w, torch.ones(1), 1.0, 1.0, (False, True))[1]
        tensor([[-0.2311,  0.2311]])
    """
    saved = jsd_saved_like(student, teacher).zero_()
    if needs == (True, False):
        saved = jsd_forward_saved(student, teacher, scale, beta)[1]
    return jsd_backward_saved(student, teacher, saved, grad, scale, beta, needs)
