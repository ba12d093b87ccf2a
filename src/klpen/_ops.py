"""klpen's kernels as torch custom operators, each set up from one :class:`KernelOp` spec.

A public function of klpen validates its inputs, then calls a custom operator
(``torch.library.custom_op``, so that ``torch.compile`` traces through it): the forward
kernel, a fake implementation (the shapes and dtypes of its outputs), a backward operator with
its own fake, and the autograd rule that joins them (:func:`~klpen._autograd.differentiable_once`:
once differentiable, never twice). :func:`kernel_op` builds the two operators from a spec.

The operators are internal. ``torch.ops.klpen.*`` exposes them, but their arguments are the
already validated, already converted inputs of the kernels (an inverse temperature, a backend
name, the value-check switch): call the public functions. Each operator still checks what it
can without reading a value (no host synchronisation): that every tensor argument is on one
device (a meta tensor among CPU ones is refused) and that the shapes agree as its fake
implementation promises (:func:`expect_shape`), so that a direct call with mismatched
arguments raises a ``ValueError`` naming the operator and the argument rather than returning
uninitialised memory.

Every ``float`` argument reaches an operator as a Python float (:func:`concrete_floats`), never as
the symbolic float (``torch.SymFloat``) that ``torch.compile`` traces for a Python float that
changed between calls: the compiled graph then holds the value itself, so that a later call with
another value cannot reuse a graph compiled for an earlier one. So does a bound that a torch
operation takes as an argument (a ``clamp`` bound: :func:`concrete`).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor
from torch.fx.experimental.symbolic_shapes import guard_scalar

from ._autograd import differentiable_once

__all__ = [
    "KernelOp",
    "concrete",
    "concrete_floats",
    "expect",
    "expect_ndim",
    "expect_shape",
    "kernel_op",
    "tensor_arguments",
]

_INTERNAL = (
    "Internal operator of klpen ({name}): not a public API, its arguments are "
    "the validated inputs of the kernels; call klpen's public functions instead.\n\n"
)


class KernelOp(NamedTuple):
    """The spec of one kernel as a pair of custom operators (``torch.ops.klpen.<name>`` and
    ``torch.ops.klpen.<name>_backward``).

    ``schema`` and ``backward_schema``: the operators' signatures, ``"(Tensor x, ...) -> ..."``,
    given explicitly (torch 2.4 cannot read postponed annotations); the backward operator's
    last argument is ``str name``, the public function. ``forward``/``backward`` compute,
    ``fake``/``backward_fake`` return empty outputs of the right shapes and dtypes.
    ``setup_context`` and ``gradients`` are the forward operator's autograd rule
    (``torch.library.register_autograd``); ``gradients`` calls the backward operator.
    ``check``/``backward_check`` (optional) take the operator's arguments and raise
    ``ValueError`` where their shapes disagree (:func:`expect_shape`); every operator also
    checks that its tensors share one device.
    """

    name: str
    schema: str
    forward: Callable[..., Any]
    fake: Callable[..., Any]
    backward_schema: str
    backward: Callable[..., Any]
    backward_fake: Callable[..., Any]
    setup_context: Callable[[Any, tuple[Any, ...], Any], None]
    gradients: Callable[..., tuple[Any, ...]]
    check: Callable[..., None] | None = None
    backward_check: Callable[..., None] | None = None


def tensor_arguments(schema: str) -> list[tuple[int, str]]:
    """``(position, name)`` of the tensor arguments (``Tensor``, ``Tensor?``, ``Tensor[]``) of
    an operator schema.

    Example:
        >>> tensor_arguments("(Tensor x, float s, Tensor? m, Tensor[] saved) -> Tensor")
        [(0, 'x'), (2, 'm'), (3, 'saved')]
    """
    arguments = schema[schema.index("(") + 1 : schema.index(")")]
    found = []
    for i, argument in enumerate(a.strip() for a in arguments.split(",")):
        kind, name = argument.rsplit(" ", 1)
        if re.fullmatch(r"Tensor(\?|\[\])?", kind):
            found.append((i, name))
    return found


def expect(op: str, ok: bool, what: str) -> None:
    """Raise ``ValueError`` naming the internal operator ``op`` unless ``ok``; ``what`` says
    what was expected and what was received.

    Example:
        >>> expect("full_kl", False, "reference must have shape (2, 3), got (3,)")
        Traceback (most recent call last):
        ...
        ValueError: klpen's internal operator full_kl: reference must have shape (2, 3), got (3,)
    """
    if not ok:
        raise ValueError(f"klpen's internal operator {op}: {what}")


def expect_shape(op: str, name: str, x: Tensor | None, shape: Sequence[int]) -> None:
    """Require the tensor argument ``name`` of ``op`` (skipped where ``None``) to have
    ``shape``: what the operator's fake implementation promises its outputs from.

    Example:
        >>> expect_shape("full_kl", "reference", torch.zeros(2, 3), (2, 3))
    """
    if x is not None:
        expect(
            op,
            tuple(x.shape) == tuple(shape),
            f"{name} must have shape {tuple(shape)}, got {tuple(x.shape)}",
        )


def expect_ndim(op: str, name: str, x: Tensor, ndim: int) -> None:
    """Require the tensor argument ``name`` of ``op`` to have at least ``ndim`` dimensions.

    Example:
        >>> expect_ndim("full_kl", "policy", torch.zeros(3), 1)
    """
    expect(
        op,
        x.dim() >= ndim,
        f"{name} must have at least {ndim} dimension(s), got shape {tuple(x.shape)}",
    )


def _same_device(op: str, positions: list[tuple[int, str]], args: tuple[Any, ...]) -> None:
    first: tuple[str, torch.device] | None = None
    for i, name in positions:
        value = args[i] if i < len(args) else None
        for x in value if isinstance(value, (list, tuple)) else (value,):
            if not isinstance(x, Tensor):
                continue
            if first is None:
                first = (name, x.device)
            expect(
                op,
                x.device == first[1],
                f"every tensor must be on one device, got {name} on {x.device} and {first[0]} "
                f"on {first[1]}",
            )


def _checked(
    op: str, schema: str, fn: Callable[..., Any], check: Callable[..., None] | None
) -> Callable[..., Any]:
    """``fn`` preceded by the agreement checks of the operator ``op`` (device, then ``check``)."""
    positions = tensor_arguments(schema)

    @functools.wraps(fn)
    def run(*args: Any) -> Any:
        _same_device(op, positions, args)
        if check is not None:
            check(*args)
        return fn(*args)

    return run


def concrete(value: float | torch.SymFloat) -> float:
    """``value``, specialised where it is a symbolic float (``torch.SymFloat``, inside
    ``torch.compile``): a constant of the compiled graph, guarded on (a new value recompiles).

    For a float that an operation takes as an argument rather than as an operand (a custom
    operator's ``float``, a ``clamp`` bound): torch specialises such a symbolic float while
    tracing with a guard only, and where the float is also an input of the graph the graph's
    cache key misses the value (see :func:`concrete_floats`). Floats in arithmetic with tensors
    (``kl_coef * kl``) stay symbolic: one graph for every value.

    Example:
        >>> concrete(0.5)
        0.5
    """
    # Not isinstance(value, torch.SymFloat): Dynamo answers False for a symbolic float (its type
    # is float there); guard_scalar returns a Python float unchanged.
    return float(guard_scalar(value))


def concrete_floats(op: Callable[..., Any]) -> Callable[..., Any]:
    """``op`` (a custom operator) called with each symbolic float argument replaced by its value.

    Inside ``torch.compile``, a Python float that changed between calls is traced as a symbolic
    float (``torch.SymFloat``), and so is what klpen computes from it (an inverse temperature
    ``1 / T``). Handed to an operator's ``float`` argument, torch specialises it while tracing
    (a guard on its value) but leaves the symbolic node in the graph that Dynamo passes on, so
    where the float is also an input of the graph (another tensor operation uses it), the graph
    is the same for every value: a recompilation for a new value then gets the compiled graph of
    an earlier value from torch's AOT/FX graph caches, and the operator computes with the old
    float, silently (pytorch/pytorch#197889). Specialised here instead (:func:`concrete`: the
    same guard), the value is a constant of the graph, part of its cache key. Outside a
    compiled region the arguments are Python floats already and pass unchanged.

    Example:
        >>> concrete_floats(max)(0.5, 2.0)
        2.0
    """

    def call(*args: Any) -> Any:
        return op(*(concrete(a) if isinstance(a, (float, torch.SymFloat)) else a for a in args))

    call.__doc__ = op.__doc__
    call.__name__ = call.__qualname__ = getattr(op, "__name__", "call")
    call.__wrapped__ = op  # type: ignore[attr-defined]
    return call


def kernel_op(spec: KernelOp, library: str = "klpen") -> tuple[Any, Any]:
    """The custom operators ``klpen::<name>`` and ``klpen::<name>_backward`` of ``spec``
    (``library``: the namespace, ``torch.ops.<library>``),
    differentiable once (:func:`~klpen._autograd.differentiable_once`), their real and fake
    implementations preceded by the agreement checks, each called through
    :func:`concrete_floats`. Returns ``(op, backward_op)``.

    Example:
        >>> def square(x, name):
        ...     return x * x
        >>> def square_grad(x, g, name):
        ...     return 2 * x * g
        >>> def setup(ctx, inputs, output):
        ...     ctx.save_for_backward(inputs[0])
        ...     ctx.name = inputs[1]
        >>> def gradients(ctx, g):
        ...     return square_backward(ctx.saved_tensors[0], g, ctx.name), None
        >>> op, square_backward = kernel_op(KernelOp(
        ...     "square", "(Tensor x, str name) -> Tensor", square, square,
        ...     "(Tensor x, Tensor g, str name) -> Tensor", square_grad, square_grad,
        ...     setup, gradients,
        ... ), library="klpen_doc")
        >>> x = torch.tensor(3.0, requires_grad=True)
        >>> torch.autograd.grad(op(x, "square"), x)
        (tensor(6.),)
        >>> square_backward(x.detach(), torch.ones((), device="meta"), "square")
        Traceback (most recent call last):
        ...
        ValueError: klpen's internal operator ...square_backward: every tensor must be on one...
    """
    ops = []
    for suffix, schema, fn, fake, check in (
        ("", spec.schema, spec.forward, spec.fake, spec.check),
        ("_backward", spec.backward_schema, spec.backward, spec.backward_fake, spec.backward_check),
    ):
        name = f"{library}::{spec.name}{suffix}"
        op = torch.library.custom_op(
            name, _checked(name, schema, fn, check), mutates_args=(), schema=schema
        )
        op.register_fake(_checked(name, schema, fake, check))
        op.__doc__ = _INTERNAL.format(name=name) + (fn.__doc__ or "")
        ops.append(op)
    op, backward_op = ops
    differentiable_once(op, backward_op, setup_context=spec.setup_context, backward=spec.gradients)
    return concrete_floats(op), concrete_floats(backward_op)
