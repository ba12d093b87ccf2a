"""What klpen's autograd functions share: no second derivative, said clearly.

klpen's kernels compute their gradients block by block from the saved logits, with in-place
arithmetic on scratch blocks: that backward pass is not itself differentiable. Asked for a
second derivative, autograd would fail deep inside torch (``sub(): functions with out=...
arguments don't support automatic differentiation``, or an in-place error that blames the
caller). :func:`guard_second_derivative` makes it fail with a message that names the function.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = ["guard_second_derivative"]


class _NoSecondDerivative(torch.autograd.Function):
    """Identity on a gradient; differentiating through it raises, naming the function."""

    @staticmethod
    def forward(ctx: Any, name: str, grad: Tensor, *anchors: Tensor) -> Tensor:
        ctx.name = name
        return grad.view_as(grad)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[None, ...]:
        raise RuntimeError(
            f"klpen's {ctx.name} has no second derivative: its backward pass is computed block "
            "by block and is not differentiable; differentiate it once (create_graph=False)"
        )


def guard_second_derivative(
    name: str, grads: tuple[Tensor | None, ...], anchors: tuple[Tensor, ...]
) -> tuple[Tensor | None, ...]:
    """The ``grads`` of a backward pass, with a clear error on any attempt to differentiate them.

    Called at the end of a ``backward`` that computed ``grads`` under ``torch.no_grad()``.
    When autograd records the backward pass (``create_graph=True``) and any of ``anchors``
    (the upstream gradient, the saved inputs) requires grad, each gradient is passed through
    an identity whose own backward raises ``RuntimeError("klpen's <name> has no second
    derivative ...")``; otherwise the gradients are returned as they are. The forward values
    and first derivatives are unchanged in every case.

    Example:
        >>> g = torch.ones(2)
        >>> guard_second_derivative("full_kl", (g, None), (torch.zeros(2),))[0] is g
        True
    """
    live = tuple(a for a in anchors if a.requires_grad)
    if not torch.is_grad_enabled() or not live:
        return grads
    return tuple(
        None if g is None else _NoSecondDerivative.apply(name, g, *live)  # type: ignore[no-untyped-call]
        for g in grads
    )
