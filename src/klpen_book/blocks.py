"""klpen's working-block sizes on the CPU, for the book's memory bookkeeping.

klpen never holds a whole ``(N, V)`` tensor of logits it computes with: it works through
blocks of at most :data:`BLOCK_ELEMENTS` entries. The chapters' memory tables predict the
scratch of a call from these sizes, at model sizes that cannot be run in a notebook. The
numbers restate klpen's documented block rule here, so that the book needs none of klpen's
internal names; ``tests/test_lab_blocks.py`` checks them against klpen's own.
"""

from __future__ import annotations

__all__ = [
    "BLOCK_ELEMENTS",
    "CPU_BLOCK_ELEMENTS",
    "GPU_BLOCK_ELEMENTS",
    "GROUPS",
    "block_bytes",
    "rows_per_block",
    "tile_shape",
]

BLOCK_ELEMENTS = 1 << 22
"""Entries of one tile of the hidden-state path's logits (16 MiB of fp32) on the CPU."""

CPU_BLOCK_ELEMENTS = 1 << 22
"""Entries of one working block of the logits functions' CPU loops (16 MiB of fp32)."""

GPU_BLOCK_ELEMENTS = 1 << 24
"""Entries of one working block of the torch backend on a GPU (64 MiB of fp32)."""

GROUPS = 8
"""Vocabulary groups of the hidden-state path: each keeps its own per-row partial sums."""

_MAX_TILE_ROWS = 4096
_MIN_TILE_COLS = 128
_NARROW_SHARE = 4


def rows_per_block(vocab: int) -> int:
    """Rows of length ``vocab`` in one working block of the logit functions (at least one).

    Example:
        >>> rows_per_block(128_256)
        32
    """
    return max(1, BLOCK_ELEMENTS // max(vocab, 1))


def block_bytes(rows: int, vocab: int, elements: int = CPU_BLOCK_ELEMENTS) -> int:
    """Bytes of one fp32 working block for ``rows`` rows of ``vocab`` logits.

    A block holds as many whole rows as fit in ``elements`` entries (at least one row, and
    never more rows than there are).

    Example:
        >>> block_bytes(32_768, 128_256) / 2**20  # 32 rows
        15.65625
        >>> block_bytes(32_768, 128_256, GPU_BLOCK_ELEMENTS) / 2**20  # 130 rows
        63.603515625
    """
    per_block = max(1, elements // max(vocab, 1))
    return min(per_block, max(rows, 1)) * vocab * 4


def tile_shape(rows: int, vocab: int, narrow: bool = False) -> tuple[int, int]:
    """``(rows, columns)`` of the hidden-state path's logits tile on the CPU.

    At most :data:`BLOCK_ELEMENTS` entries (a quarter of it for a ``narrow``, half-precision,
    weight, whose tiles are widened to fp32 in one more buffer), at most 4096 rows, and at
    least 128 columns where the vocabulary has them.

    Example:
        >>> tile_shape(2048, 128_256), tile_shape(32_768, 128_256), tile_shape(2048, 128_256, True)
        ((2048, 2048), (4096, 1024), (2048, 512))
    """
    budget = BLOCK_ELEMENTS // _NARROW_SHARE if narrow else BLOCK_ELEMENTS
    r = max(1, min(rows, _MAX_TILE_ROWS))
    return r, max(1, min(vocab, max(_MIN_TILE_COLS, budget // r)))
