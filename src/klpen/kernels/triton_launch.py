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
one of :data:`GPU_BLOCKS`; on CPU tensors under Triton's interpreter it is at most
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

__all__ = [
    "FP_FUSION",
    "GPU_BLOCK",
    "GPU_BLOCKS",
    "Launch",
    "block_size",
    "launch",
    "num_warps",
    "recording",
]

# The vocabulary blocks on a GPU (4, 8 and 16 warps: 2, 4 and 8 entries per thread), and the
# largest of them.
GPU_BLOCKS = (256, 1024, 4096)
GPU_BLOCK = GPU_BLOCKS[-1]

# Whether a multiply and an add may be contracted into one fused multiply-add on the GPU:
# pinned, since Triton's default changes (on in 3.9, with a warning; off from 3.10). On: the
# contracted forms round once instead of twice, and the loops issue fewer instructions.
FP_FUSION = True


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
_RUN: contextvars.ContextVar[bool] = contextvars.ContextVar("klpen_triton_run", default=False)


@contextlib.contextmanager
def recording(run: bool = False) -> Iterator[list[Launch]]:
    """Inside the ``with`` block, :func:`launch` records its launches instead of running them
    (with ``run``, records and runs them).

    Yields the list they are appended to, in call order. Without ``run``, the outputs of the
    recorded kernels are left as the caller allocated them (uninitialised or zero). Block sizes
    are chosen as on a GPU (:func:`block_size`), also where the kernels run on CPU tensors.

    Example:
        >>> with recording() as launches:
        ...     launch("kernel", (3,), 1, BLOCK=16)
        >>> launches[0].grid, launches[0].kwargs
        ((3,), {'enable_fp_fusion': True, 'BLOCK': 16})
    """
    token, run_token = _RECORD.set([]), _RUN.set(run)
    try:
        record = _RECORD.get()
        assert record is not None
        yield record
    finally:
        _RECORD.reset(token)
        _RUN.reset(run_token)


def launch(kernel: Any, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> None:
    """Run ``kernel[grid](*args, **kwargs)``, or record it inside :func:`recording`.

    ``kernel``: a ``triton.jit`` function; ``grid``: the launch grid (a tuple of ints);
    ``args``, ``kwargs``: its arguments, constexprs and launch options (``num_warps``) by
    keyword. ``enable_fp_fusion`` is :data:`FP_FUSION` unless given. On CPU tensors (Triton's
    interpreter, which ignores that option), NumPy's warnings on masked lanes' ``-inf``
    arithmetic are silenced: those lanes are discarded by ``tl.where``, as on the GPU.

    Example:
        >>> with recording() as launches:
        ...     launch("kernel", (1,), BLOCK=32, num_warps=4)
        >>> launches[0].kwargs["num_warps"]
        4
    """
    kwargs = {"enable_fp_fusion": FP_FUSION, **kwargs}
    record = _RECORD.get()
    if record is not None:
        record.append(Launch(kernel, tuple(grid), tuple(args), dict(kwargs)))
        if not _RUN.get():
            return
    on_cpu = any(isinstance(a, torch.Tensor) and a.device.type == "cpu" for a in args)
    if not on_cpu:
        kernel[grid](*args, **kwargs)
        return
    import numpy as np

    with np.errstate(all="ignore"):
        kernel[grid](*args, **kwargs)


def block_size(n: int, device: torch.device, cap: int = GPU_BLOCK) -> int:
    """Entries per block for a loop over ``n``.

    On a GPU (and inside :func:`recording`): the first of :data:`GPU_BLOCKS` that holds ``n``,
    else the largest, at most ``cap``: three sizes, so that every variant a backend launches
    is compiled by the compile test, and few of them. On CPU tensors (the interpreter): the
    next power of two of ``n``, between 16 and ``KLPEN_TRITON_BLOCK`` (default 128).

    Example:
        >>> block_size(203, torch.device("cuda")), block_size(10**6, torch.device("cuda"))
        (256, 4096)
        >>> block_size(1, torch.device("cuda")), block_size(1500, torch.device("cuda"))
        (256, 4096)
        >>> block_size(203, torch.device("cpu")), block_size(20, torch.device("cpu"))
        (128, 32)
    """
    if device.type == "cuda" or _RECORD.get() is not None:
        sizes = [b for b in GPU_BLOCKS if b <= cap] or [min(GPU_BLOCKS)]
        return next((b for b in sizes if b >= n), sizes[-1])
    cpu_cap = min(cap, int(os.environ.get("KLPEN_TRITON_BLOCK", "128")))
    size = 1 << max(0, n - 1).bit_length()
    return max(16, min(cpu_cap, size))


def num_warps(block: int) -> int:
    """Warps for a row program walking blocks of ``block`` entries: 16 from 4,096 entries, 8
    from 1,024, else 4 (at most 8 entries per thread, 4 at 1,024, which the float64 redo
    needs so as not to spill).

    Example:
        >>> num_warps(4096), num_warps(1024), num_warps(256)
        (16, 8, 4)
    """
    return 16 if block >= 4096 else 8 if block >= 1024 else 4
