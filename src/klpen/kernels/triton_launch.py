# mypy: disable-error-code="untyped-decorator"
"""The one place klpen launches a Triton kernel, and a recorder of those launches.

Every Triton kernel of klpen is launched as ``launch(kernel, grid, *args, **kwargs)``, which
means ``kernel[grid](*args, **kwargs)``. Inside :func:`recording`, nothing is launched: each
call is appended, with its arguments, to the list the context manager yields. The compile
test (``tests/internal/test_gpu_compile.py``) drives the backends' methods inside it and
compiles every recorded launch for the GPU targets, so that what it compiles is exactly what
the backends would launch, not a list kept by hand.

Launch sizes: :func:`block_size` and :func:`num_warps` choose a kernel's vocabulary block and
warp count. On a CUDA tensor, or inside :func:`recording` (which stands for a GPU), a block is
at most :data:`GPU_BLOCK` entries; on CPU tensors under Triton's interpreter it is at most
``KLPEN_TRITON_BLOCK`` (default 128), since the interpreter is slow on large blocks.

Example:
    >>> with recording() as launches:
    ...     pass
    >>> launches
    []
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["GPU_BLOCK", "Launch", "block_size", "launch", "num_warps", "recording"]

# The largest vocabulary block on a GPU: 4,096 entries, 16 warps (16 fp32 per thread).
GPU_BLOCK = 4096


@dataclass(frozen=True)
class Launch:
    """One recorded launch: ``kernel[grid](*args, **kwargs)``."""

    kernel: Any
    grid: tuple[int, ...]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


_RECORD: contextvars.ContextVar[list[Launch] | None] = contextvars.ContextVar(
    "klpen_triton_record", default=None
)


@contextlib.contextmanager
def recording() -> Iterator[list[Launch]]:
    """Inside the ``with`` block, :func:`launch` records its launches instead of running them.

    Yields the list they are appended to, in call order. The outputs of the recorded kernels
    are left as the caller allocated them (uninitialised or zero). Block sizes are chosen as
    on a GPU (:func:`block_size`).

    Example:
        >>> with recording() as launches:
        ...     launch("kernel", (3,), 1, BLOCK=16)
        >>> launches[0].grid, launches[0].kwargs
        ((3,), {'BLOCK': 16})
    """
    token = _RECORD.set([])
    try:
        record = _RECORD.get()
        assert record is not None
        yield record
    finally:
        _RECORD.reset(token)


def launch(kernel: Any, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> None:
    """Run ``kernel[grid](*args, **kwargs)``, or record it inside :func:`recording`.

    ``kernel``: a ``triton.jit`` function; ``grid``: the launch grid (a tuple of ints);
    ``args``, ``kwargs``: its arguments, constexprs and launch options (``num_warps``) by
    keyword. On CPU tensors (Triton's interpreter), NumPy's warnings on masked lanes' ``-inf``
    arithmetic are silenced: those lanes are discarded by ``tl.where``, as on the GPU.

    Example:
        >>> with recording() as launches:
        ...     launch("kernel", (1,), BLOCK=32, num_warps=4)
        >>> launches[0].kwargs["num_warps"]
        4
    """
    record = _RECORD.get()
    if record is not None:
        record.append(Launch(kernel, tuple(grid), tuple(args), dict(kwargs)))
        return
    on_cpu = any(isinstance(a, torch.Tensor) and a.device.type == "cpu" for a in args)
    if not on_cpu:
        kernel[grid](*args, **kwargs)
        return
    import numpy as np

    with np.errstate(all="ignore"):
        kernel[grid](*args, **kwargs)


def block_size(n: int, device: torch.device, cap: int = GPU_BLOCK) -> int:
    """Entries per block for a loop over ``n``: the next power of two of ``n``, between 16
    and ``cap`` on a GPU (and inside :func:`recording`), and at most ``KLPEN_TRITON_BLOCK``
    (default 128) on CPU tensors.

    Example:
        >>> block_size(203, torch.device("cuda")), block_size(10**6, torch.device("cuda"))
        (256, 4096)
        >>> block_size(1, torch.device("cuda"))
        16
    """
    if device.type != "cuda" and _RECORD.get() is None:
        cap = min(cap, int(os.environ.get("KLPEN_TRITON_BLOCK", "128")))
    size = 1 << max(0, n - 1).bit_length()
    return max(16, min(cap, size))


def num_warps(block: int) -> int:
    """Warps for a row program walking blocks of ``block`` entries: 16 from 4,096 entries, 8
    from 2,048, else 4.

    Example:
        >>> num_warps(4096), num_warps(2048), num_warps(256)
        (16, 8, 4)
    """
    return 16 if block >= 4096 else 8 if block >= 2048 else 4
