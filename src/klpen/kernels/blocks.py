"""Row blocks: how the ``torch`` backend walks a ``(..., V)`` tensor without copying it.

Every exact quantity klpen computes over the vocabulary (log-sum-exp, a gathered log-prob, the
full KL and their gradients) is a per-row reduction. Walking the rows in blocks bounds the
extra memory to a block or two of scratch, however large the batch: the full ``(N, V)``
log-prob tensor of the naive code is never built, and the logits are read once, at memory
speed.

A log-sum-exp costs one ``exp`` and one ``sum`` per element (:func:`exp_sums`) instead of
``torch.logsumexp``'s four passes, because no max is subtracted: either nothing is (the sum is
exact wherever :func:`shift_free_ok` says so), or a value known to be in the row is (the chosen
token's logit: then the sum counts ``exp(0) = 1`` and is exact unless it overflows). The rare
rows where that fails (``-inf`` and extreme logits, NaN) are gathered with :func:`take_rows`
and redone with the max-shifted ``torch.logsumexp``.

Threads: on the CPU with more than one intra-op thread, the block loops
(:func:`for_each_block`) do not split each block's ops across OpenMP threads, whose barrier at
the end of every op waits for the slowest thread (on a busy machine, a descheduled thread
stalls every block for a scheduler time slice). Instead ``torch.get_num_threads()`` workers
(the calling thread and a small persistent pool of Python threads; torch ops release the GIL)
each take whole blocks from a shared counter and run their ops single-threaded, with their own
scratch: a descheduled worker just takes fewer blocks. Side effect: the calling thread runs
``torch.set_num_threads(1)`` for the duration of the loop and restores the previous count in a
``finally`` (also on error). The count is partly process-wide: a thread that first runs torch
ops meanwhile starts with one intra-op thread. The result is bitwise the same as the
sequential loop's, each row being computed by the same ops.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import mmap
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

import torch
from torch import Tensor
from torch.utils._python_dispatch import _get_current_dispatch_mode

from .._validation import value_checks_enabled

__all__ = [
    "ACCELERATOR_SCALE",
    "CHUNK_ELEMENTS",
    "EXP2_FASTER",
    "KEPT_FREE_MAPPINGS",
    "LOG2E",
    "WORKER_CHUNK_ELEMENTS",
    "block_buffer",
    "block_rows_for",
    "compute_dtype",
    "exp2_measured_faster",
    "exp_",
    "exp_in_unit",
    "exp_into",
    "exp_sums",
    "exp_unit",
    "for_each_block",
    "for_each_task",
    "full_size_empty",
    "index_blocks",
    "paired_row_blocks",
    "pooled",
    "release_outputs",
    "row_blocks",
    "row_logsumexp",
    "row_mask",
    "rows_of",
    "rows_per_chunk",
    "scaled_into",
    "shift_free_ok",
    "shifted_log_sums",
    "single_threaded",
    "sub_into",
    "sync_free",
    "sync_free_on_cpu",
    "take_rows",
]

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


# A kernel's full-size output (a (..., V) gradient) from this size on is mapped with huge
# pages advised, on a Linux CPU: see full_size_empty.
HUGE_PAGE_MIN_BYTES = 1 << 26
HUGE_PAGE_BYTES = 1 << 21


def full_size_empty(shape: tuple[int, ...] | torch.Size, like: Tensor) -> Tensor:
    """An uninitialised contiguous tensor of ``shape`` with ``like``'s dtype and device: a
    kernel's ``(..., V)`` output (the gradient w.r.t. the logits).

    Written once, block by block, such a tensor costs its page faults on first touch, which
    on a small VM take about as long as computing it (measured in benchmarks/RESULTS.md).
    On a Linux CPU an output of 64 MiB or more is therefore an anonymous mapping with
    transparent huge pages advised (``MADV_HUGEPAGE``, what torch's own allocator does under
    ``THP_MEM_ALLOC_ENABLE=1``), which faults in 2 MiB at a time, and a mapping that a freed
    output leaves is kept for the next call, whose output it becomes without faulting again
    (:func:`release_outputs` has the rule and lets them go). Elsewhere, and under a dispatch
    mode, a functorch transform or the profiler (which must see the allocation: the book's
    memory tables count it), it is ``torch.empty``.

    Example:
        >>> full_size_empty((2, 3), torch.zeros(1, dtype=torch.float64)).dtype
        torch.float64
    """
    numel = math.prod(shape)
    nbytes = numel * like.element_size()
    if (
        like.device.type != "cpu"
        or nbytes < HUGE_PAGE_MIN_BYTES
        or not hasattr(mmap, "MADV_HUGEPAGE")
        or _thread_local_modes()
        or torch.autograd.profiler._is_profiler_enabled
        or like.dtype not in (torch.float32, torch.float64, torch.float16, torch.bfloat16)
    ):
        return torch.empty(shape, dtype=like.dtype, device=like.device)
    with _MAPPINGS_LOCK:
        free = [mapping for mapping in _MAPPINGS if mapping.free()]
        fits = [mapping for mapping in free if mapping.nbytes >= nbytes]
        if fits:
            mapping = min(fits, key=lambda m: m.nbytes)
        else:
            # Those too small for this call are let go: the sizes asked for have grown.
            _MAPPINGS[:] = [kept for kept in _MAPPINGS if kept not in free]
            # A quarter more address space than asked: a later call a little larger (the next
            # packed batch) fits too. Pages are only backed once touched, so it costs nothing.
            mapping = _Mapping(_round_up(nbytes + nbytes // 4, HUGE_PAGE_BYTES))
            _MAPPINGS.append(mapping)
        out = mapping.lend(like.dtype, numel).view(shape)
        _keep_free(KEPT_FREE_MAPPINGS)
    return out


class _Mapping:
    """An anonymous mapping with huge pages advised, lent to one output at a time."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.region.madvise(mmap.MADV_HUGEPAGE)
        self._user: weakref.ref[memoryview] | None = None

    def free(self) -> bool:
        """Whether no tensor uses the mapping: the storage of the last output made from it
        (which its views share) holds the memoryview it was made from, until it is freed."""
        return self._user is None or self._user() is None

    def lend(self, dtype: torch.dtype, numel: int) -> Tensor:
        view = memoryview(self.region)
        self._user = weakref.ref(view)
        return torch.frombuffer(view, dtype=dtype, count=numel)


def _round_up(n: int, unit: int) -> int:
    return -(-n // unit) * unit


# The mappings of full_size_empty's outputs, in use or kept free for the next call.
_MAPPINGS: list[_Mapping] = []
_MAPPINGS_LOCK = threading.Lock()

# How many free mappings full_size_empty keeps: a training step's outputs in flight at once
# (the policy's gradient, and a second tensor's in a full KL with both sides trained).
KEPT_FREE_MAPPINGS = 2


def _keep_free(count: int) -> None:
    # Drops the free mappings beyond the first ``count``; a dropped mmap is unmapped.
    free = [mapping for mapping in _MAPPINGS if mapping.free()]
    _MAPPINGS[:] = [mapping for mapping in _MAPPINGS if mapping not in free[count:]]


def release_outputs() -> None:
    """Unmap the freed full-size CPU outputs that :func:`full_size_empty` keeps for reuse.

    A training step on the CPU allocates a gradient the size of the logits in every step
    (hundreds of MB at a batch's size); a fresh mapping costs its page faults and the
    kernel's zeroing of every page, a large part of the backward pass on the CPUs measured in
    ``benchmarks/RESULTS.md``. So, as a GPU's caching allocator does, klpen keeps the
    mappings of at most :data:`KEPT_FREE_MAPPINGS` freed outputs (64 MiB or more each) and
    hands one that is large enough to the next call; free ones too small for a call are
    unmapped then. Between steps a process therefore holds up to that many gradients' worth
    of memory, which it has already used at its peak. This function gives it back (mappings
    still in use are left alone); ``KEPT_FREE_MAPPINGS = 0`` turns the keeping off.

    Example:
        >>> release_outputs()
    """
    with _MAPPINGS_LOCK:
        _keep_free(0)


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


@contextlib.contextmanager
def sync_free_on_cpu() -> Iterator[None]:
    """Inside the ``with`` block, CPU tensors take the kernels' sync-free paths too (for
    tests of the accelerator's paths on a CPU); see :func:`sync_free`."""
    token = _SYNC_FREE_ON_CPU.set(True)
    try:
        yield
    finally:
        _SYNC_FREE_ON_CPU.reset(token)


# Elements in one working block: 16 MiB of fp32, 32 rows of a 128k vocabulary. The loops of
# :func:`for_each_block` cut these blocks further on the CPU (WORKER_CHUNK_ELEMENTS), where
# each worker thread runs its block's ops alone; the remaining loops that split each op across
# OpenMP threads (sampling, the rows redone after a pass) keep them whole, because there
# every torch op on a block is one OpenMP parallel region, whose closing barrier waits for the
# slowest thread: fewer, larger blocks are much more robust on a busy machine (the
# measurements are in benchmarks/RESULTS.md). The extra memory stays one or two blocks.
CHUNK_ELEMENTS = 1 << 22

# The block loops of :func:`for_each_block` on the CPU, where each block's ops run on one
# thread (no barrier per op): 2 MiB of fp32 scratch per worker, one block-sized buffer or
# two of half the rows (the entropy and the KL forward), which stays in L2 / L3.
WORKER_CHUNK_ELEMENTS = 1 << 19

# log2(e) = 1 / ln 2: exp(y) = exp2(y · LOG2E), the form :func:`exp_` computes where
# :data:`EXP2_FASTER`.
LOG2E = 1.0 / math.log(2.0)

# How much faster this CPU's fp32 ``exp2`` must run than its ``exp`` for :func:`exp_` to take
# it: ``exp`` is the more accurate (within 0.5 ulp, where ``exp2(y · log2 e)`` adds the
# rounding of its argument, up to 16 ulp at |y| ~ 40), so a near tie goes to ``exp``.
_EXP2_MARGIN = 1.25


def exp2_measured_faster() -> bool:
    """Whether ATen's fp32 ``exp2`` runs at least :data:`_EXP2_MARGIN` times faster than its
    ``exp`` on this CPU: the best of seven timings of each on 16k elements in cache, on the
    calling thread (below ATen's parallel grain), with any dispatch mode disabled.

    Which is faster depends on the CPU, not only on the instruction set torch dispatches to:
    with the same torch and the same AVX2 kernels, ``exp2`` took half the time of ``exp`` on
    one CPU and two to three times as long on another (``benchmarks/RESULTS.md``). Measured
    once, when this module is imported (:data:`EXP2_FASTER`), in a few milliseconds; the
    margin keeps the choice the same from run to run on a CPU where one of the two is
    clearly faster. ``KLPEN_CPU_EXP=exp`` (or ``exp2``) in the environment pins the choice
    instead, for results that are the same bits on every CPU with the same kernels.

    Example:
        >>> isinstance(exp2_measured_faster(), bool)
        True
    """
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes(), torch.no_grad():
        # fp32 on the CPU whatever the default dtype and device (the case that EXP2_FASTER decides)
        x = torch.linspace(-30.0, 10.0, 1 << 14, dtype=torch.float32, device="cpu")
        out = torch.empty_like(x)

        def best(op: Callable[..., Tensor]) -> float:
            times = []
            for _ in range(7):
                start = time.perf_counter()
                for _ in range(8):
                    op(x, out=out)
                times.append(time.perf_counter() - start)
            return min(times)

        best(torch.exp), best(torch.exp2)  # warm-up
        return best(torch.exp2) * _EXP2_MARGIN <= best(torch.exp)


def _cpu_exponential() -> bool:
    """:data:`EXP2_FASTER`: the environment variable ``KLPEN_CPU_EXP`` (``exp`` or ``exp2``)
    where it is set, for results that must be the same bits on every CPU; else measured.

    Example:
        >>> isinstance(_cpu_exponential(), bool)
        True
    """
    pinned = os.environ.get("KLPEN_CPU_EXP", "")
    if pinned not in ("", "exp", "exp2"):
        raise ValueError(f"KLPEN_CPU_EXP must be 'exp' or 'exp2' (or unset), got {pinned!r}")
    return exp2_measured_faster() if not pinned else pinned == "exp2"


# Whether :func:`exp_` and its kin compute fp32 exponentials on the CPU as ``exp2``, else as
# ``exp``: measured once per process (:func:`exp2_measured_faster`) unless pinned by the
# environment variable ``KLPEN_CPU_EXP``.
EXP2_FASTER = _cpu_exponential()

# On a GPU an op on a 16 MiB block takes a few microseconds, about what launching it costs:
# blocks there are this many times larger (64 MiB, still a few % of a large batch's logits).
ACCELERATOR_SCALE = 4


def rows_per_chunk(vocab_size: int, chunk_elements: int | None = None) -> int:
    """Rows of length ``vocab_size`` in one working block (at least one).

    Example:
        >>> rows_per_chunk(128_256), rows_per_chunk(8, chunk_elements=20)
        (32, 2)
    """
    budget = CHUNK_ELEMENTS if chunk_elements is None else chunk_elements
    return max(1, budget // max(vocab_size, 1))


def block_rows_for(x: Tensor) -> int:
    """Rows per block for the logits ``x``: :func:`rows_per_chunk`, scaled up off the CPU.

    Example:
        >>> block_rows_for(torch.zeros(2, 128_256))
        32
    """
    scale = 1 if x.device.type == "cpu" else ACCELERATOR_SCALE
    return rows_per_chunk(x.shape[-1], CHUNK_ELEMENTS * scale)


def block_buffer(x: Tensor, rows: int, dtype: torch.dtype) -> Tensor:
    """Scratch for one block of the rows of ``x (..., V)``: an empty ``(min(rows, N), V)``.

    In ``dtype`` (the compute dtype), on ``x``'s device. Allocated once per pass and sliced to
    each block's ``r`` rows, so that a pass over ``x`` never holds more than a block of
    temporaries.

    Example:
        >>> block_buffer(torch.zeros(2, 3, 5), rows=4, dtype=torch.float64).shape
        torch.Size([4, 5])
    """
    n = x.numel() // x.shape[-1]
    return torch.empty(min(rows, n), x.shape[-1], dtype=dtype, device=x.device)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype klpen computes in: fp32 for half-precision input, the input's dtype otherwise.

    Example:
        >>> compute_dtype(torch.bfloat16), compute_dtype(torch.float64)
        (torch.float32, torch.float64)
    """
    return torch.promote_types(dtype, torch.float32)


def _aligned_blocks(xs: tuple[Tensor, ...], rows: int) -> Iterator[tuple[int, tuple[Tensor, ...]]]:
    # Tensors of one shape are split at the same rows: the decision to view or to recurse along
    # the first axis depends on all of them, so a contiguous policy and a sliced reference
    # still yield matching blocks.
    vocab = xs[0].shape[-1]
    try:
        flats = tuple(x.view(-1, vocab) for x in xs)
    except RuntimeError:
        per_item = xs[0][0].numel() // vocab if vocab else 0
        for i in range(xs[0].shape[0]):
            for offset, blocks in _aligned_blocks(tuple(x[i] for x in xs), rows):
                yield i * per_item + offset, blocks
        return
    for start in range(0, flats[0].shape[0], rows):
        yield start, tuple(flat[start : start + rows] for flat in flats)


def row_blocks(x: Tensor, rows: int) -> Iterator[tuple[int, Tensor]]:
    """Yield ``(offset, block)``: consecutive ``(r, V)`` views of the rows of ``x``, r <= rows.

    ``offset`` is the index of the block's first row in ``x.reshape(-1, V)``. No block is ever
    a copy, also when ``x`` is a non-contiguous slice such as the shifted ``logits[:, :-1]``
    (where ``reshape`` would copy all of it).

    Example:
        >>> x = torch.arange(12.0).view(2, 3, 2)[:, :2]  # rows 0, 1 and 3, 4 of six
        >>> [(offset, block.tolist()) for offset, block in row_blocks(x, rows=3)]
        [(0, [[0.0, 1.0], [2.0, 3.0]]), (2, [[6.0, 7.0], [8.0, 9.0]])]
    """
    for offset, (block,) in _aligned_blocks((x,), rows):
        yield offset, block


def paired_row_blocks(a: Tensor, b: Tensor, rows: int) -> Iterator[tuple[int, Tensor, Tensor]]:
    """Like :func:`row_blocks` for two tensors of one shape: ``(offset, block_a, block_b)``.

    The blocks always cover the same rows, whatever the strides of each tensor (zipping two
    :func:`row_blocks` does not guarantee that when only one of them is a non-contiguous view).

    Example:
        >>> a, b = torch.zeros(2, 3, 4), torch.ones(2, 4, 4)[:, :3]  # b is strided
        >>> [(offset, x.shape[0], y.shape[0]) for offset, x, y in paired_row_blocks(a, b, 2)]
        [(0, 2, 2), (2, 1, 1), (3, 2, 2), (5, 1, 1)]
    """
    for offset, (block_a, block_b) in _aligned_blocks((a, b), rows):
        yield offset, block_a, block_b


S = TypeVar("S")

_POOL_LOCK = threading.Lock()
_POOL: list[ThreadPoolExecutor] = []  # at most one, grown when more threads are asked for
_POOL_SIZE: list[int] = [0]


def _forget_pool() -> None:
    # A forked child has the pool object but not its threads (nor, perhaps, a free lock):
    # it makes its own, on first use. The locks are new too; the mappings are the child's
    # copies, lent as before.
    global _POOL_LOCK, _MAPPINGS_LOCK
    _POOL_LOCK = threading.Lock()
    _MAPPINGS_LOCK = threading.Lock()
    _POOL.clear()
    _POOL_SIZE[0] = 0


os.register_at_fork(after_in_child=_forget_pool)


def _submit(workers: int, task: Callable[[], None], count: int) -> list[Future[None]]:
    """Submit ``task`` ``count`` times to the persistent pool of at least ``workers`` threads.

    The pool is created or grown (a new pool replacing the old) and the tasks submitted under
    one lock: a caller that grows the pool can never shut down the pool another caller is
    about to submit to. A replaced pool is shut down without waiting; the tasks already
    queued on it still run (``shutdown(wait=False)`` cancels nothing), and its threads exit
    when they are done.
    """
    with _POOL_LOCK:
        if _POOL_SIZE[0] < workers:
            if _POOL:
                _POOL.pop().shutdown(wait=False)
            _POOL.append(ThreadPoolExecutor(workers, thread_name_prefix="klpen-blocks"))
            _POOL_SIZE[0] = workers
        pool = _POOL[0]
        return [pool.submit(task) for _ in range(count)]


def _thread_local_modes() -> bool:
    """Whether a dispatch mode, a functorch transform or a compilation is active: they would
    not follow the blocks into the worker threads (grad and inference mode are carried over),
    and a compiler traces the sequential loop."""
    return (
        _get_current_dispatch_mode() is not None
        or torch._C._are_functorch_transforms_active()
        or torch.compiler.is_compiling()
    )


def pooled(device: torch.device) -> bool:
    """Whether :func:`for_each_task` shares its tasks among worker threads on ``device``: on
    the CPU with ``torch.get_num_threads() > 1``, outside a dispatch mode, a functorch
    transform and a compilation.

    Example:
        >>> pooled(torch.device("cpu")) == (torch.get_num_threads() > 1)
        True
    """
    return device.type == "cpu" and torch.get_num_threads() > 1 and not _thread_local_modes()


@contextlib.contextmanager
def single_threaded(x: Tensor) -> Iterator[None]:
    """Inside the ``with`` block, torch ops run on the calling thread alone, if ``x`` is on a
    device whose passes are pooled (:func:`pooled`); else nothing changes.

    For the small ops a kernel runs just before or just after a pooled pass: on its per-row
    vectors (the ``log`` of the sums, the ``exp`` of the coefficients) or on a few rows (a
    gradient's last position). ATen splits such an op over OpenMP threads from a few
    thousand entries on, and after the region GNU OpenMP's idle threads spin before they
    sleep, on the cores that the next pass's workers need at that moment
    (``benchmarks/RESULTS.md`` has the measurement). The results are the same bits: these
    ops are elementwise. The thread count is restored after the block, also on an error.

    Example:
        >>> threads = torch.get_num_threads()
        >>> with single_threaded(torch.zeros(3)):
        ...     inside = torch.get_num_threads()
        >>> inside == (1 if threads > 1 else threads), torch.get_num_threads() == threads
        (True, True)
    """
    with _one_thread() if pooled(x.device) else contextlib.nullcontext():
        yield


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    # torch.set_num_threads(1) for the block, the previous count restored, also on an error
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def for_each_task(
    count: int, body: Callable[[int, S], None], scratch: Callable[[], S], pool: bool
) -> None:
    """Call ``body(i, work)`` for ``i`` in ``range(count)``: independent tasks.

    ``work`` is the value of ``scratch()``, made once per worker, when it takes its first
    task. With ``pool`` (which the caller takes from :func:`pooled`, and may narrow), the tasks
    are shared out among ``torch.get_num_threads()`` workers (the calling thread and a
    persistent pool), each taking the next task from a shared counter and running its torch
    ops single-threaded, under ``torch.set_num_threads(1)`` for the duration (see the module
    docstring), also when there is a single task; a task's ops then run as they would at one
    thread, and give bitwise the same results, whatever the thread count. Without ``pool``,
    one sequential loop in the calling thread. Pooled tasks must write disjoint outputs. The
    calling thread's grad mode and inference mode are used in the workers. An exception in
    ``body`` is re-raised here. Safe under concurrent callers (each call's tasks are its own;
    the pool is grown and submitted to under one lock) and after ``fork`` (a child makes its
    own pool).

    Example:
        >>> out = torch.zeros(3)
        >>> def body(i, work):
        ...     out[i] = i + work
        >>> for_each_task(3, body, lambda: 10, pooled(torch.device("cpu")))
        >>> out
        tensor([10., 11., 12.])
    """
    threads = torch.get_num_threads()
    if not pool:
        work = scratch()
        for i in range(count):
            body(i, work)
        return
    workers = max(1, min(threads, count))
    # Each call has its own counter (next() on a range iterator is atomic under the GIL):
    # concurrent callers share the pool's threads, never each other's tasks.
    counter = iter(range(count))
    # autograd's modes are per thread: the workers take the caller's
    grad_enabled, inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()

    def worker() -> None:
        with torch.inference_mode(inference), torch.set_grad_enabled(grad_enabled):
            if torch.get_num_threads() != 1:
                torch.set_num_threads(1)
            work = None
            for i in counter:
                if work is None:
                    work = scratch()
                body(i, work)

    with _one_thread():
        futures = _submit(workers - 1, worker, workers - 1) if workers > 1 else []
        try:
            worker()
        finally:
            for future in futures:
                # one that has not started (its thread busy elsewhere) has nothing left to do
                if not future.cancel():
                    future.result()


def for_each_block(
    xs: tuple[Tensor, ...],
    rows: int,
    body: Callable[[int, tuple[Tensor, ...], S], None],
    scratch: Callable[[int], S],
    buffers: int = 1,
) -> None:
    """Call ``body(offset, blocks, work)`` for every block of rows of the tensors ``xs``.

    ``xs`` are tensors of one shape ``(..., V)``, split at the same rows (as
    :func:`paired_row_blocks` splits two), at most ``rows`` rows a block; on the CPU at most
    :data:`WORKER_CHUNK_ELEMENTS` elements too, shared among the ``buffers`` block-sized
    scratch tensors that ``body`` works in (so that they stay in a core's cache together).
    ``offset`` is the first row's flat index, ``blocks`` the ``(r, V)`` views, ``work`` the
    value of ``scratch(rows)`` (the scratch buffers for blocks of at most that many rows),
    made once per worker. ``body`` must write only the rows ``offset : offset + r`` of its
    outputs.

    On the CPU with ``torch.get_num_threads() > 1`` and more than one block, the blocks are
    the tasks of :func:`for_each_task`, shared out among that many workers running
    single-threaded torch ops on whole blocks; otherwise one sequential loop, with the same
    blocks and so bitwise the same results. Each worker allocates its own ``scratch``: with
    ``n`` threads, ``n`` times the scratch of one loop. Under a dispatch mode or a functorch
    transform, which would not follow into the workers, and while compiling, the loop is
    sequential.

    Example:
        >>> out = torch.empty(3)
        >>> def body(start, blocks, work):
        ...     torch.sum(blocks[0], dim=-1, out=out[start : start + blocks[0].shape[0]])
        >>> for_each_block((torch.ones(3, 2),), 2, body, lambda rows: None)
        >>> out
        tensor([2., 2., 2.])
    """
    if xs[0].device.type == "cpu":
        rows = min(rows, rows_per_chunk(xs[0].shape[-1], WORKER_CHUNK_ELEMENTS // buffers))
    blocks = list(_aligned_blocks(xs, rows))

    def task(i: int, work: S) -> None:
        start, views = blocks[i]
        body(start, views, work)

    # a single block's ops are split across the OpenMP threads instead
    pool = pooled(xs[0].device) and len(blocks) > 1
    for_each_task(len(blocks), task, lambda: scratch(rows), pool)


def exp_into(x: Tensor, out: Tensor, shift: Tensor | None = None, scale: float = 1.0) -> Tensor:
    """``exp(scale · (x - shift))`` in ``out``'s dtype, written to ``out`` (same shape); returns it.

    ``shift`` (broadcast) is optional. The subtraction comes first, as in :func:`scaled_into`.
    Half-precision ``x`` is widened first: ``torch.exp(x, out=out)`` would round the
    exponential to ``x``'s dtype before storing it. The exponential is :func:`exp_`'s: in
    fp32 on a CPU whose ``exp2`` is the cheaper, ``exp2`` with the scale folded into it.

    Example:
        >>> exp_into(torch.zeros(2, dtype=torch.bfloat16), torch.empty(2))
        tensor([1., 1.])
    """
    if _exp2_faster(out):
        return scaled_into(x, out, shift, scale * LOG2E).exp2_()
    if shift is None and scale == 1.0 and x.dtype == out.dtype:
        return torch.exp(x, out=out)
    return scaled_into(x, out, shift, scale).exp_()


def exp_(x: Tensor, scale: float = 1.0) -> Tensor:
    r"""``exp(scale · x)`` in place; returns ``x``.

    In fp32 on a CPU whose ``exp2`` is clearly cheaper than its ``exp`` (:data:`EXP2_FASTER`,
    measured when the module is imported; on some CPUs it is half the cost, on others
    ``exp`` is the cheaper, benchmarks/RESULTS.md has the figures), computed as
    ``exp2((scale · log2 e) · x)``: a temperature or a shift folded into the multiplication
    then costs nothing. Rounding the argument ``y`` to ``y · log2 e`` adds a relative error
    of about ``|y| · eps / 2`` to each exponential, which is below a few ulps where ``exp(y)``
    matters to a sum or a probability (``|y| <~ 20``). Elsewhere (on the other CPUs, in
    float64, where ``exp2`` is no faster, and on accelerators, where an op is paid in memory
    traffic) it is ``torch.exp``.

    Example:
        >>> exp_(torch.tensor([0.0, 1.0]), scale=2.0)
        tensor([1.0000, 7.3891])
    """
    if _exp2_faster(x):
        return x.mul_(scale * LOG2E).exp2_()
    return (x if scale == 1.0 else x.mul_(scale)).exp_()


def _exp2_faster(x: Tensor) -> bool:
    return EXP2_FASTER and x.dtype == torch.float32 and x.device.type == "cpu"


def exp_unit(x: Tensor) -> float:
    """The unit of the exponents that :func:`exp_` and :func:`exp_in_unit` use for ``x``.

    ``log2 e`` where they compute ``exp2`` (fp32 on a CPU where :data:`EXP2_FASTER`), else
    1: a loop that needs the exponents themselves as well (an entropy's ``E_p[y]``) forms
    ``y · unit`` once, takes :func:`exp_in_unit` of it, and divides what it sums of them by
    ``unit``.

    Example:
        >>> exp_unit(torch.zeros(1, dtype=torch.float64))
        1.0
    """
    return LOG2E if _exp2_faster(x) else 1.0


def exp_in_unit(y: Tensor, out: Tensor) -> Tensor:
    """``exp(y / unit)`` written to ``out``, ``y`` in the :func:`exp_unit` of ``out``.

    Example:
        >>> y = torch.tensor([0.0, 1.0])
        >>> exp_in_unit(y * exp_unit(y), torch.empty(2))
        tensor([1.0000, 2.7183])
    """
    return torch.exp2(y, out=out) if _exp2_faster(out) else torch.exp(y, out=out)


def sub_into(x: Tensor, y: Tensor, out: Tensor) -> Tensor:
    """``x - y`` (broadcasting ``y``) computed in ``out``'s dtype, written to ``out``; returns it.

    Mixed dtypes are widened by a copy first: that is exact, and faster than a mixed-dtype
    ``torch.sub(..., out=out)``, which converts element by element.

    Example:
        >>> sub_into(torch.ones(2, 2, dtype=torch.bfloat16), torch.tensor([[1.0], [2.0]]),
        ...          torch.empty(2, 2))
        tensor([[ 0.,  0.],
                [-1., -1.]])
    """
    if x.dtype == y.dtype == out.dtype:
        return torch.sub(x, y, out=out)
    return out.copy_(x).sub_(y)


def scaled_into(x: Tensor, out: Tensor, shift: Tensor | None = None, scale: float = 1.0) -> Tensor:
    """``scale * (x - shift)`` (``shift`` broadcast, optional) in ``out``'s dtype; returns ``out``.

    The subtraction comes first: ``x - shift`` of two nearby large logits is exact, and the
    scaling (an inverse temperature) then rounds the small difference only, where
    ``x * scale - shift * scale`` would round both large products.

    Example:
        >>> scaled_into(torch.tensor([[3.0, 1.0]]), torch.empty(1, 2), torch.tensor([[1.0]]), 0.5)
        tensor([[1., 0.]])
    """
    if shift is not None:
        sub_into(x, shift, out)
    elif scale != 1.0 and x.dtype == out.dtype:
        return torch.mul(x, scale, out=out)
    else:
        out.copy_(x)
    return out if scale == 1.0 else out.mul_(scale)


def exp_sums(
    x: Tensor, rows: int, dtype: torch.dtype, shift: Tensor | None = None, scale: float = 1.0
) -> Tensor:
    r"""Per-row sums of ``exp(scale · (x - shift))``, computed in ``dtype``: ``(N,)`` for N rows.

    .. math:: s_i = \textstyle\sum_v e^{k (x_{i,v} - c_i)}

    One pass over ``x`` with one block of scratch: with no ``shift`` (``c = 0``) and ``k = 1``
    this is the floor of any exact log-sum-exp, one ``exp`` and one ``sum`` per element, and
    ``log(s)`` is exact wherever :func:`shift_free_ok` holds. A ``shift`` (``(N,)``, in
    ``dtype``) costs a subtraction more; when ``c_i`` is an entry of row ``i`` (the chosen
    token's logit), the sum counts ``exp(0) = 1`` and is exact unless it overflows to ``inf``.
    ``scale`` (``k``, an inverse temperature) costs a multiplication when it is not 1.

    Example:
        >>> exp_sums(torch.zeros(2, 3), rows=1, dtype=torch.float32)
        tensor([3., 3.])
    """
    sums = torch.empty(x.numel() // x.shape[-1], dtype=dtype, device=x.device)

    def body(start: int, blocks: tuple[Tensor, ...], buf: Tensor) -> None:
        (block,) = blocks
        stop = start + block.shape[0]
        work = buf[: block.shape[0]]
        row_shift = None if shift is None else shift[start:stop, None]
        exp_into(block, work, row_shift, scale)
        torch.sum(work, dim=-1, out=sums[start:stop])

    for_each_block((x,), rows, body, lambda r: block_buffer(x, r, dtype))
    return sums


def shift_free_ok(sums: Tensor, vocab_size: int) -> Tensor:
    r"""Where an unshifted sum of exponentials (:func:`exp_sums`) is exact to rounding.

    ``exp(x)`` without subtracting the row max is exact unless a term overflows (then the sum
    is ``inf``, or NaN for NaN input) or the terms that matter fall into the subnormal range.
    A term below the smallest normal number ``tiny`` loses at most ``tiny`` of mass, so the
    ``V`` terms of a row lose at most ``V·tiny``, a relative error below ``eps`` once

    .. math:: s \ge V \cdot \mathrm{tiny} / \mathrm{eps}

    (about ``1e-26`` in fp32 for a 128k vocabulary: logits down to about -60 are fine).
    Returns a bool tensor of ``sums``' shape; rows that fail need the max-shifted log-sum-exp.

    Example:
        >>> shift_free_ok(torch.tensor([3.0, float("inf"), 1e-35]), vocab_size=3)
        tensor([ True, False, False])
    """
    info = torch.finfo(sums.dtype)
    return torch.isfinite(sums) & (sums >= vocab_size * info.tiny / info.eps)


def row_logsumexp(x: Tensor, rows: int, dtype: torch.dtype, shift: Tensor | None = None) -> Tensor:
    r"""Log-sum-exp of every row of ``x (..., V)``, in ``dtype``: a flat ``(N,)`` tensor.

    .. math:: \mathrm{lse}(x_i) = c_i + \log \textstyle\sum_v e^{x_{i,v} - c_i}

    One pass over ``x`` (:func:`exp_sums`) with no max subtracted: ``c = 0`` without ``shift``,
    exact where :func:`shift_free_ok` holds; or ``c`` = ``shift`` (``(N,)``, in ``dtype``),
    which must be an entry of its row (the chosen token's logit): then the sum counts
    ``exp(0) = 1``, is exact unless it overflows, and ``lse >= c`` holds exactly, so that
    ``c - lse`` is a log-probability that is never positive and is exactly 0 for a token with
    all the mass. The rows where the sum is not exact (``-inf`` and extreme logits, NaN) are
    redone with the max-shifted ``torch.logsumexp``: the result is ``torch.logsumexp``'s in
    every case, ``±inf`` and NaN rows included.

    Example:
        >>> x = torch.tensor([[0.0, 0.0], [1000.0, 1000.0], [float("-inf"), 0.0]])
        >>> row_logsumexp(x, rows=2, dtype=torch.float32)
        tensor([6.9315e-01, 1.0007e+03, 0.0000e+00])
    """
    sums = exp_sums(x, rows, dtype, shift)
    if shift is None:
        ok = shift_free_ok(sums, x.shape[-1])
        lse = sums.log_()
    else:
        ok = torch.isfinite(sums)
        lse = sums.log_().add_(shift)
    for index in index_blocks((~ok).nonzero().squeeze(-1), rows):
        lse[index] = torch.logsumexp(take_rows(x, index).to(dtype), dim=-1)
    return lse


def shifted_log_sums(
    x: Tensor, rows: int, dtype: torch.dtype, shift: Tensor, scale: float = 1.0
) -> tuple[Tensor, Tensor]:
    r"""Each row's log-sum-exp of ``scale · x`` as two parts, ``(c, log s)``, in ``dtype``.

    .. math:: \mathrm{lse}(k x_i) = k c_i + \log s_i, \qquad
        s_i = \textstyle\sum_v e^{k (x_{i,v} - c_i)}

    ``c`` is ``shift`` (``(N,)``, an entry of each row, such as the chosen token's logit) where
    that sum is finite, and the row max where it is not (``-inf`` or extreme logits; the few
    rows are redone by :func:`take_rows`). Kept apart, the two parts lose nothing to a large
    common offset of the logits: ``k (x_v - c) - log s`` is a log-probability exact to
    rounding however large ``c`` is, where ``x_v - lse`` rounds ``lse`` first (at logits near
    ``1e4``, by ``5e-4`` in fp32). A row with a ``+inf`` logit gets ``log s = inf``; a row of
    ``-inf`` only ``log s = -inf``; NaN stays NaN.

    Example:
        >>> x = torch.tensor([[1e4, 1e4], [0.0, 200.0]])
        >>> shifted_log_sums(x, rows=2, dtype=torch.float32, shift=x[:, 0].clone())
        (tensor([10000.,   200.]), tensor([0.6931, 0.0000]))
    """
    # excerpt: sums
    sums = exp_sums(x, rows, dtype, shift, scale)
    centre = shift.clone()
    with single_threaded(sums):
        log_s = sums.log_()
    # end excerpt
    for index in index_blocks((~torch.isfinite(sums)).nonzero().squeeze(-1), rows):
        sub = take_rows(x, index).to(dtype)
        top = sub.amax(dim=-1)
        top = torch.where(torch.isfinite(top), top, 0.0)
        centre[index] = top
        exps = exp_into(sub, torch.empty_like(sub), top[:, None], scale)
        log_s[index] = exps.sum(dim=-1).log_()
    return centre, log_s


def take_rows(x: Tensor, index: Tensor) -> Tensor:
    """The rows ``index`` (flat row numbers, as :func:`row_blocks` counts them) of ``x``.

    A ``(len(index), V)`` copy of those rows only, also when ``x`` cannot be viewed as
    ``(N, V)`` without copying all of it.

    Example:
        >>> x = torch.arange(12.0).view(3, 2, 2).transpose(0, 1)  # rows 0, 2, 4, 1, 3, 5
        >>> take_rows(x, torch.tensor([1, 3]))
        tensor([[4., 5.],
                [2., 3.]])
    """
    vocab = x.shape[-1]
    try:
        return x.view(-1, vocab).index_select(0, index)
    except RuntimeError:
        pass
    # Row number -> one index per leading axis (torch.unravel_index, which torch 2.1 lacks).
    coords, rest = [], index
    for size in reversed(x.shape[:-1]):
        coords.append(rest % size)
        rest = rest.div(size, rounding_mode="floor")
    return x[tuple(reversed(coords))]


def index_blocks(index: Tensor, rows: int) -> Iterator[Tensor]:
    """Consecutive slices of at most ``rows`` entries of the 1-D ``index``.

    The rows to redo with :func:`take_rows` are walked this way, so that their copy is bounded
    by a block too, however many there are.

    Example:
        >>> [b.tolist() for b in index_blocks(torch.tensor([3, 5, 8]), rows=2)]
        [[3, 5], [8]]
    """
    for start in range(0, index.shape[0], rows):
        yield index[start : start + rows]
