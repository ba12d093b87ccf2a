"""The one base of klpen's autograd Functions: no second derivative, said clearly, always.

klpen's kernels compute their gradients block by block from the saved inputs, with in-place
arithmetic on scratch blocks: that backward pass is not itself differentiable. Asked for a
second derivative, autograd would fail deep inside torch (``sub(): functions with out=...
arguments don't support automatic differentiation``), or, worse, differentiate the part of
the backward that happens to be recorded and return a wrong Hessian silently.
:class:`KernelFunction` rules both out: its ``backward`` runs the subclass's ``gradients``
under ``torch.no_grad()`` and passes the result through :func:`guard_second_derivative`, so a
second derivative raises a ``RuntimeError`` that names the public function.

The kernels of a single process are torch custom operators (``torch.library.custom_op``), so
that ``torch.compile`` traces through them: :func:`differentiable_once` registers such an
operator's autograd through its backward operator, and gives the backward operator an
autograd rule that raises the same error (:func:`klpen._ops.kernel_op` sets up each pair of
operators from one spec and calls it). The vocab-parallel Functions of
:mod:`klpen.distributed`, whose passes hold collectives, are :class:`KernelFunction`
subclasses.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = ["KernelFunction", "differentiable_once", "guard_second_derivative", "owned"]


def _no_second_derivative(name: str) -> RuntimeError:
    return RuntimeError(
        f"klpen's {name} has no second derivative: its backward pass is computed block "
        "by block and is not differentiable; differentiate it once (create_graph=False)"
    )


class _NoSecondDerivative(torch.autograd.Function):
    """Identity on a gradient; differentiating through it raises, naming the function."""

    @staticmethod
    def forward(ctx: Any, name: str, grad: Tensor, *anchors: Tensor) -> Tensor:
        ctx.name = name
        return grad.view_as(grad)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[None, ...]:
        raise _no_second_derivative(ctx.name)


def guard_second_derivative(
    name: str, grads: tuple[Any, ...], anchors: tuple[Tensor, ...]
) -> tuple[Any, ...]:
    """The ``grads`` of a backward pass, with a clear error on any attempt to differentiate them.

    Called at the end of a ``backward`` that computed ``grads`` under ``torch.no_grad()``.
    When autograd records the backward pass (``create_graph=True``) and any of ``anchors``
    (the upstream gradient, the saved inputs) requires grad, each tensor gradient is passed
    through an identity whose own backward raises ``RuntimeError("klpen's <name> has no
    second derivative ...")``; otherwise the gradients are returned as they are. The forward
    values and first derivatives are unchanged in every case. Entries that are not tensors
    (``None`` for inputs without a gradient) pass through.

    Example:
        >>> g = torch.ones(2)
        >>> guard_second_derivative("full_kl", (g, None), (torch.zeros(2),))[0] is g
        True
    """
    live = tuple(a for a in anchors if a.requires_grad)
    if not torch.is_grad_enabled() or not live:
        return grads
    return tuple(
        _NoSecondDerivative.apply(name, g, *live) if isinstance(g, Tensor) else g  # type: ignore[no-untyped-call]
        for g in grads
    )


class KernelFunction(torch.autograd.Function):
    """Base of every klpen autograd Function: once differentiable, never twice, by name.

    A subclass defines ``forward(ctx, ...)``, which must set ``ctx.name`` (the public
    function, for the error message; :meth:`named` does it), and
    ``gradients(ctx, *grad_outputs)`` returning one entry per input of ``forward`` (``None``
    where there is no gradient). It must not define ``backward``: the base's runs
    ``gradients`` under ``torch.no_grad()`` and applies :func:`guard_second_derivative` with
    the saved tensors and the upstream gradients as anchors.

    Example:
        >>> class Square(KernelFunction):
        ...     @staticmethod
        ...     def forward(ctx, x):
        ...         KernelFunction.named(ctx, "square")
        ...         ctx.save_for_backward(x)
        ...         return x * x
        ...     @staticmethod
        ...     def gradients(ctx, g):
        ...         (x,) = ctx.saved_tensors
        ...         return (2 * x * g,)
        >>> x = torch.tensor(3.0, requires_grad=True)
        >>> (g,) = torch.autograd.grad(Square.apply(x), x, create_graph=True)
        >>> g
        tensor(6., grad_fn=<_NoSecondDerivativeBackward>)
    """

    @staticmethod
    def named(ctx: Any, name: str) -> None:
        """Record the public function's name for the second-derivative error."""
        ctx.name = name

    @staticmethod
    def gradients(ctx: Any, *grad_outputs: Any) -> tuple[Any, ...]:
        raise NotImplementedError  # pragma: no cover - every subclass defines it

    @staticmethod
    def backward(ctx: Any, *grad_outputs: Any) -> Any:
        with torch.no_grad():
            grads = ctx._forward_cls.gradients(ctx, *grad_outputs)
        anchors = tuple(t for t in (*ctx.saved_tensors, *grad_outputs) if isinstance(t, Tensor))
        return guard_second_derivative(getattr(ctx, "name", "function"), grads, anchors)


def differentiable_once(
    op: Any,
    backward_op: Any,
    *,
    setup_context: Callable[[Any, tuple[Any, ...], Any], None],
    backward: Callable[..., tuple[Any, ...]],
) -> None:
    """Make the custom operator ``op`` differentiable once, through ``backward_op``.

    ``setup_context`` and ``backward`` are ``op``'s autograd rule
    (``torch.library.register_autograd``); ``backward`` computes the gradients with
    ``backward_op``, a custom operator whose last argument is ``name``, the public function.
    ``backward_op`` gets an autograd rule of its own that raises ``RuntimeError("klpen's
    <name> has no second derivative ...")``: with ``create_graph=True`` the first derivative
    is recorded as usual and differentiating it again fails by name, never with a wrong
    Hessian.

    Example:
        >>> @torch.library.custom_op(
        ...     "klpen_doc::cube", mutates_args=(), schema="(Tensor x, str name) -> Tensor"
        ... )
        ... def cube(x, name):
        ...     return x**3
        >>> @torch.library.custom_op(
        ...     "klpen_doc::cube_grad",
        ...     mutates_args=(),
        ...     schema="(Tensor x, Tensor g, str name) -> Tensor",
        ... )
        ... def cube_grad(x, g, name):
        ...     return 3 * x**2 * g
        >>> def setup(ctx, inputs, output):
        ...     ctx.save_for_backward(inputs[0])
        ...     ctx.name = inputs[1]
        >>> def backward(ctx, g):
        ...     return cube_grad(ctx.saved_tensors[0], g, ctx.name), None
        >>> differentiable_once(cube, cube_grad, setup_context=setup, backward=backward)
        >>> x = torch.tensor(2.0, requires_grad=True)
        >>> (g,) = torch.autograd.grad(cube(x, "cube"), x, create_graph=True)
        >>> g
        tensor(12., grad_fn=<...>)
        >>> g.backward()
        Traceback (most recent call last):
        ...
        RuntimeError: klpen's cube has no second derivative: ...
    """
    op.register_autograd(backward, setup_context=setup_context)

    def named(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.name = inputs[-1]

    def refuse(ctx: Any, *grads: Any) -> Any:
        raise _no_second_derivative(ctx.name)

    backward_op.register_autograd(refuse, setup_context=named)


def owned(outputs: Sequence[Tensor], inputs: Sequence[Tensor | None]) -> list[Tensor]:
    """``outputs``, each copied where it shares memory with one of ``inputs`` or an earlier
    output: the outputs of a custom operator must own their memory (a kernel may return
    views of one statistics tensor, or one empty placeholder twice). The copies are of
    per-row statistics and placeholders, never of a ``(..., V)`` tensor.

    Example:
        >>> stats = torch.zeros(2, 3)
        >>> a, b = owned(stats.unbind(), [])
        >>> a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()
        True
    """
    seen = {x.untyped_storage().data_ptr() for x in inputs if x is not None and x.numel()}
    result = []
    for x in outputs:
        ptr = x.untyped_storage().data_ptr()
        if not x.numel() or ptr in seen:
            x = x.clone()
        seen.add(x.untyped_storage().data_ptr())
        result.append(x)
    return result
