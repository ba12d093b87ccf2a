"""Which path a kernel takes: the sync-free switch, and data-dependent row sets as masks.

Where value checks are off on an accelerator (:func:`sync_free`), the kernels take paths with
no data-dependent step, so that a call makes no host synchronisation; elsewhere they read
tensor values (which rows to redo) where that is faster. A set of rows that a custom operator
saves is a fixed-size bool mask (:func:`row_mask`), turned back into row numbers by
:func:`rows_of`.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch
from torch import Tensor

from .._validation import value_checks_enabled

__all__ = ["row_mask", "rows_of", "sync_free", "sync_free_on_cpu"]

_SYNC_FREE_ON_CPU: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "klpen_sync_free_on_cpu", default=False
)


def sync_free(x: Tensor) -> bool:
    """Whether the kernels on ``x`` take their sync-free paths: no step reads a tensor value.

    True when value checks are off (:func:`klpen.validation`, ``torch.compile``) and ``x``
    is on an accelerator, where every such read (``.item()``, ``nonzero``, ``bool()``)
    stalls the device's stream. On the CPU a read costs nothing and the data-dependent paths
    (the float64 redo of only the rows that need it) are the fast ones, so they stay, and a
    call with validation off is at least as fast as with it on; :func:`sync_free_on_cpu`
    forces the accelerator's paths there, so that CPU tests check them.

    Example:
        >>> from klpen import validation
        >>> with validation(False):
        ...     sync_free(torch.zeros(1)), sync_free(torch.zeros(1, device="meta"))
        (False, True)
        >>> with validation(False), sync_free_on_cpu():
        ...     sync_free(torch.zeros(1))
        True
    """
    if value_checks_enabled():
        return False
    return x.device.type != "cpu" or _SYNC_FREE_ON_CPU.get()


@contextlib.contextmanager
def sync_free_on_cpu() -> Iterator[None]:
    """Inside the ``with`` block (this thread/context), CPU tensors take the kernels'
    sync-free paths too (for tests of the accelerator's paths on a CPU); see
    :func:`sync_free`."""
    token = _SYNC_FREE_ON_CPU.set(True)
    try:
        yield
    finally:
        _SYNC_FREE_ON_CPU.reset(token)


def row_mask(index: Tensor, n: int) -> Tensor:
    """``(n,)`` bool, True at the rows that ``index`` (int64) lists: a data-dependent set of
    rows kept at a fixed size (what a custom operator saves must have a shape known before
    it runs).

    Example:
        >>> row_mask(torch.tensor([0, 2]), 4)
        tensor([ True, False,  True, False])
    """
    return torch.zeros(n, dtype=torch.bool, device=index.device).index_fill_(0, index, True)


def rows_of(mask: Tensor) -> Tensor:
    """The ``(M,)`` int64 rows where ``mask`` is True (one read of the mask on the host).

    Example:
        >>> rows_of(torch.tensor([True, False, True]))
        tensor([0, 2])
    """
    return mask.nonzero().squeeze(-1)
