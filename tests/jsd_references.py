"""Float64 references of the generalized JSD that the kernels' tests share.

:func:`reference_terms` writes the mixture as a sum of non-negative terms, each relative to
itself, so that it stays exact where ``β`` or ``1 - β`` is tiny: there TRL's form
``β KL(q ‖ m) + (1 - β) KL(p ‖ m)``, with ``log m`` taken apart from ``log q`` and
``log p``, cancels to about ``1e-16 |log q| / min(β, 1 - β)`` of the value, even in float64.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def reference_terms(z: Tensor, w: Tensor, beta: float, scale: float = 1.0) -> Tensor:
    """``J_β`` per row of finite logits ``z`` (student) and ``w`` (teacher), ``0 < β < 1``,
    in float64 and differentiable:
    ``Σ (1 - β) p φ(β expm1 d) + β q φ((1 - β) expm1(-d))`` with ``d = log q - log p`` and
    ``φ(t) = t - log1p(t)``, by its series below ``|t| = 1e-3`` and else with
    ``log1p(β expm1 d) = log(m / p)`` taken as ``logaddexp(log(1 - β), log β + d)`` (and
    ``log(m / q)`` likewise), so that a ``1 - β`` of ``1e-12`` is not lost to the rounding of
    ``1 + β expm1 d``."""
    log_p = torch.log_softmax(z.double() * scale, -1)
    log_q = torch.log_softmax(w.double() * scale, -1)
    d = log_q - log_p

    def side(weight: Tensor, x: Tensor, coef: float, rest: float) -> Tensor:
        t = coef * torch.expm1(x)
        small = t.abs() < 1e-3
        ts = torch.where(small, t, 0.0)
        series = ts * ts * (1 / 2 - ts * (1 / 3 - ts * (1 / 4 - ts * (1 / 5 - ts / 6))))
        log_mix = torch.logaddexp(torch.full_like(x, math.log(rest)), x + math.log(coef))
        return weight * torch.where(small, series, t - log_mix)

    p_side = (1 - beta) * side(log_p.exp(), d, beta, 1 - beta)
    q_side = beta * side(log_q.exp(), -d, 1 - beta, beta)
    return (p_side + q_side).sum(-1)


def jsd_gradient_floor(g: Tensor, scale: float, beta: float) -> Tensor:
    """The per-row floor ``(..., 1)`` of a mixture gradient's error scale: each side's terms
    are at most of the size of ``ε (1 + |log ε|) k |g|``, ``ε = min(β, 1 - β)`` (the
    mixture's logarithms reach ``log ε``), and a row whose gradient is far below that is a
    difference of such terms, exact only to the dtype's rounding of them; ``3e-3`` of it
    (near ``β = 1/2``, the ``3e-3 k |g|`` of the other JSD tests)."""
    eps = min(beta, 1 - beta)
    return 3e-3 * scale * eps * (1 - math.log(eps)) * g.double().abs().cpu()[..., None]
