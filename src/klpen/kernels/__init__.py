r"""klpen's kernels: per-row statistics over the vocabulary and their gradients, by backend.

The layers, from the bottom: the kernels here (no validation, no autograd), one autograd
Function per quantity in :mod:`klpen._autograd` and the modules that use it, and the public
functions, which validate their inputs and call the Function. A backend implements
:class:`Backend`; :func:`select_backend` is the one dispatch point that picks it.

Backends:

* ``"torch"`` (:class:`~klpen.kernels.torch_backend.TorchBackend`): the reference block loops
  of :mod:`klpen.kernels.torch_logprobs` and :mod:`klpen.kernels.torch_kl`, on any device:
  sequential loops over blocks of rows (:mod:`klpen.kernels._rows`) whose torch ops use
  torch's own intra-op threads. The oracle of every other backend.
* ``"triton"`` (``klpen.kernels.triton_backend.TritonBackend``), where that module imports and
  its ``is_available()`` says so (``triton`` importable and a CUDA device present, or
  ``TRITON_INTERPRET=1`` set). Imported only when first asked for.

``"auto"`` (the default) uses ``"triton"`` for CUDA tensors where it is available and the
device's compute capability is one whose kernels CI compiles (:data:`TRITON_CAPABILITIES`),
and ``"torch"`` otherwise; :func:`use_backend` forces one.

The protocol (all tensors on one device; ``scale`` = ``1 / temperature``, already checked):

``logprobs_forward(logits, tokens, scale, entropy) -> (logp, ent, saved)``
    ``logits (..., V)`` floating, any strides; ``tokens (...)`` int64 or ``None``. ``logp`` and
    ``ent`` ``(...)`` in the compute dtype (fp32 for half input); an output not asked for is
    ``torch.empty(0)``; ``logp`` is NaN in rows with NaN/``+inf`` logits or all ``-inf``;
    ``saved`` is whatever this backend's backward needs (tensors only).
``logprobs_backward(logits, tokens, saved, grad_logp, grad_ent, scale) -> grad``
    ``d/dlogits`` of ``sum(g * logp + h * ent)``, ``(..., V)`` in the logits' dtype; either
    upstream gradient may be ``None``.
``full_kl_forward(policy, reference, scale) -> (kl, saved)``
    ``kl (...)`` in the compute dtype, exact per contract section 3, never negative, NaN in
    rows whose logits are invalid.
``full_kl_backward(policy, reference, saved, grad, scale) -> grad_policy``
    ``d/dpolicy`` of ``sum(grad * kl)``, ``(..., V)`` in the policy's dtype.

``logprobs_saved_like(logits, tokens, entropy)``, ``full_kl_saved_like(policy, reference)``
    Empty tensors of the shapes, dtypes and device of what the two forwards save, for the
    fake (shape-only) kernels that ``torch.compile`` traces with. Every saved shape follows
    from the inputs' shapes: a data-dependent set of rows (those redone) is saved as a
    ``(N,)`` bool mask (:func:`~klpen.kernels.blocks.row_mask`), never as a list of indices.

The kernels choose their sync-free paths by :func:`~klpen.kernels.blocks.sync_free`. The
outputs of the forwards and their ``saved`` tensors must not be views of the inputs.

A backend may also define ``full_kl_backward_both(policy, reference, saved, grad, scale,
needs) -> (grad_policy | None, grad_reference | None)``; where it does not, a gradient w.r.t.
the reference logits is taken from the ``torch`` backend's forward statistics.

For the hidden-state path (``linear_logprobs``, ``linear_full_kl``), whose logits exist only
one matrix product's tile at a time, a backend may define the per-tile reductions of
:class:`~klpen.kernels.torch_linear.TileOps` (``linear_logprob_tile``,
``linear_logprob_tile_grad``, ``linear_kl_tile``, ``linear_kl_tile_grad``); the passes of
:mod:`klpen.kernels.torch_linear` then call them on each tile, and its torch operations
(:class:`~klpen.kernels.torch_linear.TorchTiles`) otherwise. The Triton backend has them.

Example:
    >>> import torch
    >>> available_backends()[0]
    'torch'
    >>> with use_backend("torch"):
    ...     select_backend(torch.zeros(1)).name
    'torch'
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib
from collections.abc import Iterator
from typing import Protocol

import torch
from torch import Tensor

from .torch_backend import TorchBackend

__all__ = [
    "Backend",
    "available_backends",
    "backend_named",
    "get_backend",
    "select_backend",
    "use_backend",
]


class Backend(Protocol):
    """The per-quantity kernel interface (see the module docstring)."""

    name: str

    def logprobs_forward(
        self, logits: Tensor, tokens: Tensor | None, scale: float, entropy: bool
    ) -> tuple[Tensor, Tensor, tuple[Tensor, ...]]: ...

    def logprobs_backward(
        self,
        logits: Tensor,
        tokens: Tensor | None,
        saved: tuple[Tensor, ...],
        grad_logp: Tensor | None,
        grad_ent: Tensor | None,
        scale: float,
    ) -> Tensor: ...

    def full_kl_forward(
        self, policy: Tensor, reference: Tensor, scale: float
    ) -> tuple[Tensor, tuple[Tensor, ...]]: ...

    def full_kl_backward(
        self,
        policy: Tensor,
        reference: Tensor,
        saved: tuple[Tensor, ...],
        grad: Tensor,
        scale: float,
    ) -> Tensor: ...

    def logprobs_saved_like(
        self, logits: Tensor, tokens: Tensor | None, entropy: bool
    ) -> tuple[Tensor, ...]: ...

    def full_kl_saved_like(self, policy: Tensor, reference: Tensor) -> tuple[Tensor, ...]: ...

    def jsd_forward(
        self, student: Tensor, teacher: Tensor, scale: float, beta: float
    ) -> tuple[Tensor, tuple[Tensor, ...]]: ...

    def jsd_saved_like(self, student: Tensor, teacher: Tensor) -> tuple[Tensor, ...]: ...

    def jsd_backward(
        self,
        student: Tensor,
        teacher: Tensor,
        saved: tuple[Tensor, ...],
        grad: Tensor,
        scale: float,
        beta: float,
        needs: tuple[bool, bool],
    ) -> tuple[Tensor | None, Tensor | None]: ...


_TORCH = TorchBackend()
_LOADED: dict[str, Backend | None] = {"torch": _TORCH}
_FORCED: contextvars.ContextVar[str] = contextvars.ContextVar("klpen_backend", default="auto")


def _load_triton() -> Backend | None:
    try:
        module = importlib.import_module(".triton_backend", __name__)
        if not module.is_available():
            return None
        backend: Backend = module.TritonBackend()
    except ImportError:
        return None
    return backend


def get_backend(name: str) -> Backend | None:
    """The backend called ``name``, or ``None`` where it is not usable in this process.

    Example:
        >>> get_backend("torch").name, get_backend("no such backend")
        ('torch', None)
    """
    if name not in _LOADED:
        _LOADED[name] = _load_triton() if name == "triton" else None
    return _LOADED[name]


def backend_named(name: str) -> Backend:
    """The backend called ``name``, which :func:`select_backend` chose in this process (the
    kernel operators receive the name, not the object).

    Example:
        >>> backend_named("torch").name
        'torch'
    """
    backend = get_backend(name)
    if backend is None:
        raise ValueError(f"no kernel backend {name!r} in this process")
    return backend


def available_backends() -> tuple[str, ...]:
    """The kernel backends usable in this process: always ``"torch"``, then ``"triton"``
    where it is available (``triton`` imports and a CUDA device is present, or
    ``TRITON_INTERPRET=1`` is set).

    Example:
        >>> "torch" in available_backends()
        True
    """
    return tuple(n for n in ("torch", "triton") if get_backend(n) is not None)


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[None]:
    """Force the backend of klpen's kernels inside the ``with`` block (this thread/context).

    ``name``: ``"auto"`` (the default outside: ``"triton"`` for CUDA tensors where available,
    else ``"torch"``) or one of :func:`available_backends`. Covers the kernels behind
    ``get_logprobs_for_tokens``, ``logprobs_and_entropy``, ``token_entropy``,
    ``next_token_logprobs``, ``full_kl`` and what is built on them.

    Raises:
        ValueError: an unknown or unavailable ``name`` (the message lists the available ones).

    Example:
        >>> with use_backend("torch"):
        ...     pass
    """
    if not isinstance(name, str) or (name != "auto" and get_backend(name) is None):
        valid = ", ".join(repr(n) for n in ("auto", *available_backends()))
        raise ValueError(f"backend must be one of {valid} (the available ones); got {name!r}")
    token = _FORCED.set(name)
    try:
        yield
    finally:
        _FORCED.reset(token)


@torch.compiler.assume_constant_result  # type: ignore[untyped-decorator]
def _forced_while_compiling() -> str:
    # torch.compile cannot trace ContextVar.get: the name is read once, at compile time.
    return _FORCED.get()


# The CUDA compute capabilities whose Triton kernels klpen compiles in CI
# (tests/internal/test_gpu_compile.py: sm_80, the A100/A30, and sm_90, the H100/H200/GH200).
# "auto" picks the Triton backend only on these; other devices get the torch backend
# (use_backend("triton") still forces it).
TRITON_CAPABILITIES = frozenset({(8, 0), (9, 0)})


@torch.compiler.assume_constant_result  # type: ignore[untyped-decorator]
def _triton_proven(index: int | None) -> bool:
    """Whether CUDA device ``index`` has one of :data:`TRITON_CAPABILITIES` (read once per
    compiled graph inside ``torch.compile``)."""
    return torch.cuda.get_device_capability(index) in TRITON_CAPABILITIES


def select_backend(x: Tensor) -> Backend:
    """The one dispatch point: the backend for the kernels on ``x`` (the logits).

    The forced one (:func:`use_backend`), or under ``"auto"``: ``"triton"`` for CUDA tensors
    where it is available and the device's compute capability is one of
    :data:`TRITON_CAPABILITIES` (those whose kernels are compiled in CI: 8.0 and 9.0), else
    ``"torch"``. Inside ``torch.compile`` the forced name is the one in force when the
    function was compiled.

    Example:
        >>> import torch
        >>> select_backend(torch.zeros(2, 3)).name
        'torch'
    """
    name = _forced_while_compiling() if torch.compiler.is_compiling() else _FORCED.get()
    if name == "auto":
        if x.device.type == "cuda" and _triton_proven(x.device.index):
            triton = get_backend("triton")
            if triton is not None:
                return triton
        return _TORCH
    backend = get_backend(name)
    assert backend is not None  # use_backend refused it otherwise
    return backend
