"""Row chunking: how klpen walks a ``(..., V)`` tensor without copying it.

Every exact quantity klpen computes over the vocabulary (log-sum-exp, a gathered log-prob, the
full KL and their gradients) is a per-row reduction. Walking the rows in small blocks keeps the
fp32 working set inside the cache and bounds the extra memory to one block, however large the
batch: the full ``(N, V)`` log-prob tensor of the naive code is never built.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor

# Elements in one fp32 working block. Sized so that a block and its temporaries stay in the
# cache of a current CPU core: small enough to be cheap, large enough to amortise per-call
# Python overhead.
CHUNK_ELEMENTS = 1 << 17


def rows_per_chunk(vocab_size: int, chunk_elements: int | None = None) -> int:
    """Rows of length ``vocab_size`` in one working block (at least one)."""
    budget = CHUNK_ELEMENTS if chunk_elements is None else chunk_elements
    return max(1, budget // max(vocab_size, 1))


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype klpen computes in: fp32 for half-precision input, the input's dtype otherwise."""
    return torch.promote_types(dtype, torch.float32)


def row_blocks(x: Tensor, rows: int) -> Iterator[tuple[int, Tensor]]:
    """Yield ``(offset, block)``: consecutive ``(r, V)`` views of the rows of ``x``, r <= rows.

    ``offset`` is the index of the block's first row in ``x.reshape(-1, V)``. No block is ever
    a copy, also when ``x`` is a non-contiguous slice such as the shifted ``logits[:, :-1]``
    (where ``reshape`` would copy all of it).
    """
    vocab = x.shape[-1]
    try:
        flat = x.view(-1, vocab)
    except RuntimeError:
        per_item = x[0].numel() // vocab if vocab else 0
        for i in range(x.shape[0]):
            for offset, block in row_blocks(x[i], rows):
                yield i * per_item + offset, block
        return
    for start in range(0, flat.shape[0], rows):
        yield start, flat[start : start + rows]
