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

Gradients, ``a = log(p / m) = -log1p(β expm1 d)``, ``b = log(q / m)``:

.. math::

    \frac{\partial J}{\partial z_j} = k (1 - \beta)\, p_j \big(a_j - E_p[a]\big), \qquad
    \frac{\partial J}{\partial w_j} = k \beta\, q_j \big(b_j - E_q[b]\big)

for ``0 < β < 1``; ``k p_j (log(p_j / q_j) - KL)`` and ``k (q_j - p_j)`` at ``β = 1``,
``k (p_j - q_j)`` and ``k q_j (log(q_j / p_j) - KL)`` at ``β = 0``.

Every pass takes the rows a block at a time (:func:`jsd_block_rows`): no ``(N, V)``
temporary, a dozen block-sized ones. ``-inf`` logits are tokens of probability 0; the
mixture divergence is then finite, the two ends may be ``+inf``. Rows with NaN or ``+inf``
logits, or with all logits ``-inf``, give NaN.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from .blocks import paired_row_blocks

__all__ = [
    "JSD_BLOCK_ELEMENTS",
    "BlockState",
    "block_state",
    "jsd_block_rows",
    "jsd_forward",
    "jsd_grads",
    "jsd_rows",
    "jsd_rows_grad",
    "phi",
]

# Elements of one block: 2**18 fp32 (1 MiB); a pass holds about a dozen such temporaries.
JSD_BLOCK_ELEMENTS = 1 << 18
# |t| below this: the series of phi; above it, t - log1p(t) loses fewer than six bits.
SERIES_BOUND = 0.05


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


def _weighted_phi(p: Tensor, q: Tensor, x: Tensor, coef: float) -> Tensor:
    """``p φ(coef · expm1(x))`` with ``x = log q - log p``, also where ``p = 0`` (then
    ``coef · q``, the limit) and where ``x`` is infinite. At ``coef = 1``,
    ``log1p(expm1 x) = x`` is used as such (``expm1(-20)`` rounds to ``-1`` in fp32)."""
    t = torch.expm1(x).mul_(coef)
    small = t.abs() < SERIES_BOUND
    log_ratio = x if coef == 1.0 else torch.log1p(t)
    direct = (q - p).mul_(coef).sub_(torch.where(p > 0, p * log_ratio, 0.0))
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
        terms = _weighted_phi(s.p, s.q, s.d, 1.0)
    elif beta == 0.0:
        terms = _weighted_phi(s.q, s.p, -s.d, 1.0)
    else:
        terms = _weighted_phi(s.p, s.q, s.d, beta).mul_(1.0 - beta)
        terms.add_(_weighted_phi(s.q, s.p, -s.d, 1.0 - beta).mul_(beta))
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
            a = torch.log1p(torch.expm1(s.d).mul_(beta)).neg_()
            grad_z = _centred_gradient(s.p, a).mul_(1.0 - beta)
        if needs[1]:
            b = torch.log1p(torch.expm1(-s.d).mul_(1.0 - beta)).neg_()
            grad_w = _centred_gradient(s.q, b).mul_(beta)
    return (
        None if grad_z is None else grad_z.mul_(g),
        None if grad_w is None else grad_w.mul_(g),
    )


def jsd_forward(student: Tensor, teacher: Tensor, scale: float, beta: float) -> Tensor:
    """``J_β`` per row of ``student``, ``teacher`` ``(..., V)``, ``(...)`` in the compute dtype.

    Example:
        >>> z = torch.tensor([[2.0, 0.0, 0.0]])
        >>> jsd_forward(z, torch.zeros(1, 3), 1.0, 0.5)
        tensor([0.1087])
    """
    dtype = torch.promote_types(torch.promote_types(student.dtype, teacher.dtype), torch.float32)
    vocab = student.shape[-1]
    out = torch.empty(student.shape[:-1], dtype=dtype, device=student.device)
    flat = out.view(-1)
    for start, z, w in paired_row_blocks(student, teacher, jsd_block_rows(vocab)):
        flat[start : start + z.shape[0]] = jsd_rows(z, w, scale, beta, dtype)
    return out


def jsd_grads(
    student: Tensor,
    teacher: Tensor,
    grad: Tensor,
    scale: float,
    beta: float,
    needs: tuple[bool, bool],
) -> tuple[Tensor | None, Tensor | None]:
    """``(d/dstudent, d/dteacher)`` of ``Σ grad · J_β``, in the inputs' shapes and dtypes.

    Example:
        >>> z, w = torch.zeros(1, 2), torch.tensor([[0.0, 1.0]])
        >>> jsd_grads(z, w, torch.ones(1), 1.0, 1.0, (False, True))[1]
        tensor([[-0.2311,  0.2311]])
    """
    dtype = torch.promote_types(torch.promote_types(student.dtype, teacher.dtype), torch.float32)
    vocab = student.shape[-1]
    outs = [
        torch.empty(x.shape, dtype=x.dtype, device=x.device) if need else None
        for x, need in zip((student, teacher), needs, strict=True)
    ]
    flats = [None if o is None else o.view(-1, vocab) for o in outs]
    g = grad.reshape(-1)
    for start, z, w in paired_row_blocks(student, teacher, jsd_block_rows(vocab)):
        stop = start + z.shape[0]
        blocks = jsd_rows_grad(z, w, g[start:stop], scale, beta, dtype, needs)
        for flat, block in zip(flats, blocks, strict=True):
            if flat is not None and block is not None:
                flat[start:stop] = block
    return outs[0], outs[1]
