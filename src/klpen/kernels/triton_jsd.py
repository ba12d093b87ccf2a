"""The generalized Jensen-Shannon divergence of :mod:`klpen.distill` as Triton programs.

Placeholder until the kernels land: the torch block loops of :mod:`klpen.kernels.torch_jsd`.
"""

from __future__ import annotations

from torch import Tensor

from .torch_jsd import jsd_forward as _torch_forward
from .torch_jsd import jsd_grads as _torch_grads

__all__ = ["jsd_backward", "jsd_forward", "jsd_saved_like"]


def jsd_forward(
    student: Tensor, teacher: Tensor, scale: float, beta: float
) -> tuple[Tensor, tuple[Tensor, ...]]:
    """``(J_β per row, saved)``."""
    return _torch_forward(student, teacher, scale, beta), ()


def jsd_saved_like(student: Tensor, teacher: Tensor) -> tuple[Tensor, ...]:
    """What :func:`jsd_forward` saves."""
    return ()


def jsd_backward(
    student: Tensor,
    teacher: Tensor,
    saved: tuple[Tensor, ...],
    grad: Tensor,
    scale: float,
    beta: float,
    needs: tuple[bool, bool],
) -> tuple[Tensor | None, Tensor | None]:
    """``(d/dstudent, d/dteacher)`` of ``Σ grad · J_β``."""
    return _torch_grads(student, teacher, grad, scale, beta, needs)
