"""Row iteration: how the ``torch`` backend walks a ``(..., V)`` tensor without copying it.

Every exact quantity klpen computes over the vocabulary is a per-row reduction. Walking the
rows in blocks bounds the extra memory to a block or two of scratch (:func:`block_buffer`),
however large the batch. The blocks are views, also of a non-contiguous slice such as the
shifted ``logits[:, :-1]`` (:func:`row_blocks`, :func:`paired_row_blocks`); the few rows a
pass must redo are gathered a block at a time (:func:`index_blocks`, :func:`take_rows`).

Each loop is a plain sequential loop in the calling thread: a block's torch ops use torch's
own intra-op threads, as the caller configured them. Nothing here changes a setting of the
process.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TypeVar

import torch
from torch import Tensor

__all__ = [
    "block_buffer",
    "for_each_block",
    "index_blocks",
    "paired_row_blocks",
    "row_blocks",
    "take_rows",
]

S = TypeVar("S")


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


def for_each_block(
    xs: tuple[Tensor, ...],
    rows: int,
    body: Callable[[int, tuple[Tensor, ...], S], None],
    scratch: Callable[[int], S],
) -> None:
    """Call ``body(offset, blocks, work)`` for every block of rows of the tensors ``xs``.

    ``xs`` are tensors of one shape ``(..., V)``, split at the same rows (as
    :func:`paired_row_blocks` splits two), at most ``rows`` rows a block (whole blocks of
    :func:`~klpen.kernels.blocks.block_rows_for`: each torch op is one parallel region of
    torch's intra-op threads, whose closing barrier waits for the slowest thread, so fewer,
    larger blocks cost fewer barriers). ``offset`` is the first row's flat index,
    ``blocks`` the ``(r, V)`` views, ``work`` the value of ``scratch(rows)`` (the scratch
    buffers for blocks of at most that many rows), made once. One sequential loop in the
    calling thread.

    Example:
        >>> out = torch.empty(3)
        >>> def body(start, blocks, work):
        ...     torch.sum(blocks[0], dim=-1, out=out[start : start + blocks[0].shape[0]])
        >>> for_each_block((torch.ones(3, 2),), 2, body, lambda rows: None)
        >>> out
        tensor([2., 2., 2.])
    """
    work = scratch(rows)
    for start, views in _aligned_blocks(xs, rows):
        body(start, views, work)


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
