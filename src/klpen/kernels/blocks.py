r"""Blocks of rows: their size, and the exact per-row numerics the ``torch`` backend runs on them.

Every exact quantity klpen computes over the vocabulary (log-sum-exp, a gathered log-prob, the
full KL and their gradients) is a per-row reduction, computed a block of rows at a time
(:mod:`klpen.kernels._rows`): the extra memory is a block or two of scratch, however large the
batch. This module holds the block size (:func:`block_rows_for`) and the row numerics.

A log-sum-exp costs one ``exp`` and one ``sum`` per element (:func:`exp_sums`) instead of
``torch.logsumexp``'s four passes, because no max is subtracted: either nothing is (the sum is
exact wherever :func:`shift_free_ok` says so), or a value known to be in the row is (the chosen
token's logit: then the sum counts ``exp(0) = 1`` and is exact unless it overflows). The rare
rows where that fails (``-inf`` and extreme logits, NaN) are gathered with :func:`take_rows`
and redone with the max-shifted ``torch.logsumexp``.

The exponential is always ``torch.exp`` (within 0.5 ulp): a call gives the same bits in every
process with the same inputs, thread count and environment. The loops use torch's own
intra-op threads and change no setting of the process. The sync-free switch
(:func:`sync_free`) and the row iteration are re-exported here from
:mod:`klpen.kernels._dispatch` and :mod:`klpen.kernels._rows`.
"""

from __future__ import annotations

from typing import Final

import torch
from torch import Tensor

from ._dispatch import row_mask, rows_of, sync_free
from ._dispatch import sync_free_on_cpu as sync_free_on_cpu
from ._rows import block_buffer, index_blocks, paired_row_blocks, row_blocks, take_rows
from ._rows import for_each_block as for_each_block

# What other klpen modules import from here.
__all__ = [
    "block_buffer",
    "block_rows_for",
    "compute_dtype",
    "exp_sums",
    "index_blocks",
    "paired_row_blocks",
    "row_blocks",
    "row_mask",
    "rows_of",
    "shifted_log_sums",
    "sync_free",
    "take_rows",
]

# Elements in one working block: 16 MiB of fp32, 32 rows of a 128k vocabulary. Each op on a
# CPU block is one parallel region of torch's intra-op threads: large blocks, few barriers.
CHUNK_ELEMENTS: Final = 1 << 22

# On a GPU an op on a 16 MiB block takes a few microseconds, about what launching it costs:
# blocks there are this many times larger (64 MiB, still a few % of a large batch's logits).
ACCELERATOR_SCALE: Final = 4


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


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype klpen computes in: fp32 for half-precision input, the input's dtype otherwise.

    Example:
        >>> compute_dtype(torch.bfloat16), compute_dtype(torch.float64)
        (torch.float32, torch.float64)
    """
    return torch.promote_types(dtype, torch.float32)


def exp_into(x: Tensor, out: Tensor, shift: Tensor | None = None, scale: float = 1.0) -> Tensor:
    """``exp(scale · (x - shift))`` in ``out``'s dtype, written to ``out`` (same shape); returns it.

    ``shift`` (broadcast) is optional. The subtraction comes first, as in :func:`scaled_into`.
    Half-precision ``x`` is widened first: ``torch.exp(x, out=out)`` would round the
    exponential to ``x``'s dtype before storing it.

    Example:
        >>> exp_into(torch.zeros(2, dtype=torch.bfloat16), torch.empty(2))
        tensor([1., 1.])
    """
    if shift is None and scale == 1.0 and x.dtype == out.dtype:
        return torch.exp(x, out=out)
    return scaled_into(x, out, shift, scale).exp_()


def exp_(x: Tensor, scale: float = 1.0) -> Tensor:
    """``exp(scale · x)`` in place; returns ``x``.

    Example:
        >>> exp_(torch.tensor([0.0, 1.0]), scale=2.0)
        tensor([1.0000, 7.3891])
    """
    return (x if scale == 1.0 else x.mul_(scale)).exp_()


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
    rows are redone by :func:`take_rows`). Kept apart, the two parts lose
    nothing to a large common offset of the logits: ``k (x_v - c) - log s`` is a
    log-probability exact to rounding however large ``c`` is, where ``x_v - lse`` rounds
    ``lse`` first (at logits near ``1e4``, by ``5e-4`` in fp32). A row with a ``+inf`` logit
    gets ``log s = inf``; a row of ``-inf`` only ``log s = -inf``; NaN stays NaN.

    Example:
        >>> x = torch.tensor([[1e4, 1e4], [0.0, 200.0]])
        >>> shifted_log_sums(x, rows=2, dtype=torch.float32, shift=x[:, 0].clone())
        (tensor([10000.,   200.]), tensor([0.6931, 0.0000]))
    """
    # excerpt: sums
    sums = exp_sums(x, rows, dtype, shift, scale)
    centre = shift.clone()
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
