r"""The ``torch`` backend's hidden-state kernels: log-probs, entropy and KL over logit tiles.

A language model's last step is ``logits = hidden @ weight.T (+ bias)``. Here the output layer
and the reduction are fused: the vocabulary is walked in tiles of ``weight``'s rows, each
tile's logits ``(rows, tile)`` are computed by one matrix product into a reused scratch buffer,
reduced at once, and forgotten. Backward recomputes each tile (one more product) and
accumulates the three gradients tile by tile (:func:`backprop`, with a per-tile logit gradient
from :func:`logprob_grad` or :func:`kl_grad`). Where only the hidden states' gradient of the
log-probs is needed (a frozen output layer), the forward pass forms it instead, from each
tile's exponentials times the weight tile (:func:`token_sums`' ``mix``): no tile is
recomputed. Moved here from ``klpen.linear``.

Work: the vocabulary is cut into a fixed number of groups of whole tiles (:data:`GROUPS`,
fewer where there are fewer tiles) and the rows into chunks; the (row chunk, group) pairs are
walked in one sequential loop in the calling thread, whose matrix products and reductions use
torch's own intra-op threads. Each group sums its tiles into its own per-row partial sums,
which are added in group order at the end (the grouping depends on the shapes only). A narrow
(half-precision) weight's gradient is accumulated over all rows in fp32 before it is rounded
once, so its backward walks each group over all rows.

The per-tile reductions (:class:`TileOps`) are this module's torch operations, or a
backend's kernels where it has them (``Layer.backend``; the Triton backend's read each tile
once): one implementation of the passes, the arithmetic per tile swapped.

Numerics:

* All arithmetic is in the compute dtype (:func:`~klpen._validation.promoted_dtype` of the
  inputs): half-precision ``hidden``/``weight`` are widened exactly to fp32 per tile and
  multiplied with fp32 accumulation and fp32 results, so the logits are *more* accurate than
  the unfused bf16 path's, which rounds every one to bf16 (tested against float64). On CUDA,
  where every input shares one half-precision dtype and torch has the ``out_dtype`` product
  (:func:`product_dtype`), the logits' products run on the tensor cores instead: half operands
  (exact: they are the inputs' own values), fp32 accumulation and fp32 results, so that no
  logit is rounded to half precision. CPU products are IEEE fp32, and nothing here changes a
  setting of the process (thread counts, matmul precisions).
* Log-sum-exps use the shift-free sums of :mod:`klpen.kernels.blocks` (one ``exp`` per logit, no max
  pass); rows where that is not exact (``-inf`` logits from a masking ``bias``, extreme values)
  are redone with the row max subtracted, as :func:`~klpen.kernels.blocks.row_logsumexp` does.
* The KL is computed in a centred form whose terms are of the size of the log-ratios, not of
  the logits (:func:`_kl_centred`), in the compute dtype with float64 accumulators, so that
  nearby distributions lose no digits to cancellation; identical ones give exactly 0. The
  rows it cannot promise to 5e-5 (divergences below about 1e-6, ``-inf`` or extreme logits)
  are recomputed with float64 terms, a pass over their tiles only.
* Sums over the vocabulary are formed per tile, added within a group tile by tile and then
  across groups in order.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from itertools import pairwise
from typing import Any, Final, NamedTuple, Protocol

import torch
from torch import Tensor

from . import backend_named
from ._dispatch import sync_free
from .blocks import ACCELERATOR_SCALE, CHUNK_ELEMENTS, exp_, exp_into, shift_free_ok
from .torch_kl import centred_kl

# What other klpen modules import from here.
__all__ = [
    "KLStats",
    "Layer",
    "Reduce",
    "TileGrad",
    "backprop",
    "kl_grad",
    "kl_stats",
    "logprob_grad",
    "logprob_stats",
]

# Rows of one tile: the vocabulary tile is then CHUNK_ELEMENTS // rows columns (2048 for the
# issue's N = 2048), wide enough for an efficient matrix product, small enough to bound memory.
_MAX_TILE_ROWS: Final = 4096
_MIN_TILE_COLS: Final = 128
# Tiles of a half-precision weight hold this many times fewer logits (see tile_shape).
_NARROW_SHARE: Final = 4

# Vocabulary groups of a pass (fewer where there are fewer tiles), each with its own partial
# sums, added in group order: the order of every sum depends on the shapes only.
GROUPS: Final = 8


class Layer(NamedTuple):
    """An output layer applied to flat hidden states: ``(hidden @ weight.T + bias) * scale``.

    ``hidden`` is ``(N, H)`` in the compute dtype; ``weight`` ``(V, H)`` and ``bias`` ``(V,)``
    are in their own dtypes (a tile of them is widened when needed); ``dtype`` is the compute
    dtype. For a vocabulary split across ranks, ``weight`` and ``bias`` are the local slices.
    ``backend``: the kernel backend whose per-tile reductions (:class:`TileOps`) are used,
    where it has them; this module's torch operations otherwise. ``narrow``: the
    half-precision dtype that every floating input of the call shares (``None``: none), in
    which the logits' products may take their operands (:func:`product_dtype`).
    """

    hidden: Tensor
    weight: Tensor
    bias: Tensor | None
    scale: float
    dtype: torch.dtype
    backend: str = "torch"
    narrow: torch.dtype | None = None


class Tile(NamedTuple):
    """One tile of the logits: rows ``[r0, r1)`` and vocabulary entries ``[v0, v1)``."""

    r0: int
    r1: int
    v0: int
    v1: int


class Span(NamedTuple):
    """One task of a pass: rows ``[r0, r1)`` of the tiles of vocabulary group ``group``,
    which covers the entries ``[v0, v1)``."""

    r0: int
    r1: int
    group: int
    v0: int
    v1: int


def tile_shape(
    rows: int, vocab: int, budget: int, on_cpu: bool = True, narrow: bool = False
) -> tuple[int, int]:
    """``(rows, columns)`` of a logits tile for ``rows`` positions and a ``vocab``-row weight.

    At most ``budget`` entries (times :data:`~klpen.kernels.blocks.ACCELERATOR_SCALE` off the CPU,
    divided by 4 for a ``narrow``, half-precision, weight), at most 4096 rows, and at least
    128 columns where the vocabulary has them. A narrow weight's logits tensor, against which
    the scratch is weighed, is half as large, and each of its tiles is widened into one more
    buffer: the quarter keeps the scratch within a few % of it.

    Example:
        >>> tile_shape(2048, 128_256, 1 << 22), tile_shape(32_768, 128_256, 1 << 22)
        ((2048, 2048), (4096, 1024))
        >>> tile_shape(2048, 128_256, 1 << 22, narrow=True)
        (2048, 512)
    """
    scale = 1 if on_cpu else ACCELERATOR_SCALE
    if narrow:
        budget //= _NARROW_SHARE
    r = max(1, min(rows, _MAX_TILE_ROWS))
    return r, max(1, min(vocab, max(_MIN_TILE_COLS, budget * scale // r)))


def _tile_shape(layer: Layer, budget: int, rows: int | None = None) -> tuple[int, int]:
    on_cpu = layer.hidden.device.type == "cpu"
    narrow = layer.weight.dtype != layer.dtype
    n = layer.hidden.shape[0] if rows is None else min(rows, layer.hidden.shape[0])
    return tile_shape(n, layer.weight.shape[0], budget, on_cpu, narrow)


class Plan(NamedTuple):
    """How a pass walks the logits: tiles of ``rows x cols`` (a row chunk is ``rows`` rows)
    and the vocabulary groups ``[v0, v1)``, each a run of whole tiles."""

    rows: int
    cols: int
    groups: tuple[tuple[int, int], ...]


def plan(layer: Layer, budget: int, rows: int | None = None) -> Plan:
    """The :class:`Plan` of a pass with tiles of at most ``budget`` entries (see
    :func:`tile_shape`) and, if given, at most ``rows`` rows: :data:`GROUPS` groups of about
    equal numbers of tiles (one per tile where there are fewer).

    Example:
        >>> layer = Layer(torch.zeros(2048, 8), torch.zeros(128_256, 8), None, 1.0, torch.float32)
        >>> p = plan(layer, 1 << 22)
        >>> p.rows, p.cols, len(p.groups), p.groups[0], p.groups[-1][1]
        (2048, 2048, 8, (0, 14336), 128256)
    """
    vocab = layer.weight.shape[0]
    r, c = _tile_shape(layer, budget, rows)
    tiles = -(-vocab // c)
    count = min(GROUPS, tiles)
    starts = [g * tiles // count * c for g in range(count)] + [vocab]
    return Plan(r, c, tuple(pairwise(starts)))


def _spans(p: Plan, n: int, whole_rows: bool = False) -> list[Span]:
    """The tasks of a pass: every (row chunk, group) pair, chunk by chunk; with
    ``whole_rows``, one task per group over all ``n`` rows."""
    chunk = max(n, 1) if whole_rows else p.rows
    return [
        Span(r0, min(r0 + chunk, n), g, v0, v1)
        for r0 in range(0, n, chunk)
        for g, (v0, v1) in enumerate(p.groups)
    ]


def _span_tiles(span: Span, p: Plan) -> Iterator[tuple[Tile, bool]]:
    """A task's tiles: vocabulary outside, row blocks inside; the flag marks a tile's first
    rows (row 0 of the layer)."""
    for v0 in range(span.v0, span.v1, p.cols):
        for r0 in range(span.r0, span.r1, p.rows):
            yield Tile(r0, min(r0 + p.rows, span.r1), v0, min(v0 + p.cols, span.v1)), r0 == 0


class TileOps(Protocol):
    """The per-tile reductions of the passes (the torch ones: :class:`TorchTiles`).

    ``z``, ``w``: ``(r, c)`` logit tiles in the compute dtype, unit column stride; every other
    tensor ``(r,)``, in the compute dtype, but ``col``: int64 token columns relative to the
    tile (outside ``[0, c)``: not in this tile). Each may overwrite ``z`` and ``w``.
    """

    leaves_exp: bool
    """Whether :meth:`linear_logprob_tile` without entropy leaves ``e^y`` in ``z``."""

    def linear_logprob_tile(
        self, z: Tensor, col: Tensor, shift: Tensor | None, entropy: bool, exact: bool
    ) -> Tensor:
        """``(k, r)``: ``Σ e^y``, ``y[col]`` (0 outside), and with ``entropy`` ``Σ e^y y``
        (``0 · -inf`` written 0 with ``exact``, else NaN), ``y = z - shift``."""
        ...

    def linear_logprob_tile_grad(
        self,
        z: Tensor,
        col: Tensor,
        lse: Tensor,
        g: Tensor,
        ent: Tensor | None,
        gh: Tensor | None,
    ) -> Tensor:
        """``G`` in place of ``z``: ``-p (g + gh (log p + ent))`` (0 where ``p = 0``; ``-p g``
        without entropy), plus ``g`` at ``col``; ``log p = z - lse``."""
        ...

    def linear_kl_tile(self, z: Tensor, w: Tensor, centre: Tensor) -> Tensor:
        """``(4, r)``: ``Σ e``, ``Σ e v``, ``Σ e (expm1(v) - v)``, ``max e``; ``e = exp(z)``,
        ``v = (w - z) - centre``."""
        ...

    def linear_kl_tile_grad(
        self, z: Tensor, w: Tensor, lse_z: Tensor, shift: Tensor, g: Tensor, masked: bool
    ) -> Tensor:
        """``G = ((z - w) - shift) p g`` in place of ``z``, ``p = exp(z - lse_z)`` (0 where
        ``p = 0`` with ``masked``)."""
        ...


class TorchTiles:
    """The per-tile reductions of :class:`TileOps` in torch operations, with one pass's
    spare tile (``rows x cols``, allocated on first use): the reference of every backend's.

    Example:
        >>> ops = TorchTiles(1, 2, torch.float64, torch.device("cpu"))
        >>> ops.linear_logprob_tile(torch.zeros(1, 2, dtype=torch.float64), torch.tensor([1]),
        ...                         None, entropy=False, exact=False)
        tensor([[2.],
                [0.]], dtype=torch.float64)
    """

    leaves_exp = True

    def __init__(self, rows: int, cols: int, dtype: torch.dtype, device: torch.device) -> None:
        self._shape, self._dtype, self._device = (rows, cols), dtype, device
        self._buf: Tensor | None = None

    def _spare(self, like: Tensor) -> Tensor:
        if self._buf is None:
            self._buf = torch.empty(self._shape, dtype=self._dtype, device=self._device)
        return self._buf[: like.shape[0], : like.shape[1]]

    @staticmethod
    def _token(z: Tensor, col: Tensor) -> tuple[Tensor, Tensor]:
        """Where the token is in the tile, and its column clamped into it."""
        width = z.shape[1]
        return (col >= 0) & (col < width), col.clamp(0, width - 1)

    def linear_logprob_tile(
        self, z: Tensor, col: Tensor, shift: Tensor | None, entropy: bool, exact: bool
    ) -> Tensor:
        if shift is not None:
            z.sub_(shift[:, None])
        out = z.new_empty(3 if entropy else 2, z.shape[0])
        inside, at = self._token(z, col)
        out[1] = torch.where(inside, z.gather(1, at[:, None]).squeeze(1), 0.0)
        if not entropy:
            torch.sum(exp_(z), 1, out=out[0])
            return out
        e = torch.exp(z, out=self._spare(z))
        torch.sum(e, 1, out=out[0])
        ez = z.mul_(e)
        if exact:
            ez.masked_fill_(e == 0, 0.0)
        torch.sum(ez, 1, out=out[2])
        return out

    def linear_logprob_tile_grad(
        self,
        z: Tensor,
        col: Tensor,
        lse: Tensor,
        g: Tensor,
        ent: Tensor | None,
        gh: Tensor | None,
    ) -> Tensor:
        log_p = z.sub_(lse[:, None])
        if ent is None or gh is None:
            grad = exp_(log_p).mul_(-g[:, None])
        else:
            p = exp_into(log_p, self._spare(z))
            grad = log_p.add_(ent[:, None]).mul_(gh[:, None]).add_(g[:, None]).mul_(p).neg_()
            grad.masked_fill_(p == 0, 0.0)
        inside, at = self._token(z, col)
        return grad.scatter_add_(1, at[:, None], torch.where(inside, g, 0.0)[:, None])

    def linear_kl_tile(self, z: Tensor, w: Tensor, centre: Tensor) -> Tensor:
        v = w.sub_(z).sub_(centre[:, None])
        e = exp_(z)
        work = self._spare(z)
        out = z.new_empty(4, z.shape[0])
        torch.sum(e, 1, out=out[0])
        torch.sum(torch.mul(v, e, out=work), 1, out=out[1])
        torch.sum(torch.expm1(v, out=work).sub_(v).mul_(e), 1, out=out[2])
        torch.amax(e, 1, out=out[3])
        return out

    def linear_kl_tile_grad(
        self, z: Tensor, w: Tensor, lse_z: Tensor, shift: Tensor, g: Tensor, masked: bool
    ) -> Tensor:
        p = exp_into(z, self._spare(z), lse_z[:, None])
        grad = z.sub_(w).sub_(shift[:, None]).mul_(p).mul_(g[:, None])
        return grad.masked_fill_(p == 0, 0.0) if masked else grad


def _tile_ops(layer: Layer, p: Plan) -> TileOps:
    """The backend's per-tile reductions where it has them, else :class:`TorchTiles`."""
    if layer.backend != "torch":
        backend: Any = backend_named(layer.backend)
        if hasattr(backend, "linear_logprob_tile"):
            ops: TileOps = backend
            return ops
    return TorchTiles(p.rows, p.cols, layer.dtype, layer.hidden.device)


class _Work:
    """A pass's scratch: tile buffers (made on first use, by key), the widened
    weight tiles of two layers, and the per-tile reductions."""

    def __init__(self, layer: Layer, p: Plan) -> None:
        self._layer, self._shape = layer, (p.rows, p.cols)
        self._bufs: dict[str, Tensor] = {}
        self.caches: tuple[dict[int, Tensor], dict[int, Tensor]] = ({}, {})
        self.ops = _tile_ops(layer, p)

    def buf(self, key: str, dtype: torch.dtype | None = None, width: int | None = None) -> Tensor:
        """The buffer ``key`` in ``dtype`` (the compute dtype by default): a tile's
        ``rows x cols``, or with ``width`` a row of that width per vocabulary entry of a tile,
        ``cols x width`` (a tile of the weight's gradient)."""
        if key not in self._bufs:
            shape = self._shape if width is None else (self._shape[1], width)
            dtype = self._layer.dtype if dtype is None else dtype
            self._bufs[key] = torch.empty(shape, dtype=dtype, device=self._layer.hidden.device)
        return self._bufs[key]


def _run(layer: Layer, spans: list[Span], body: Callable[[Span, _Work], None], p: Plan) -> None:
    """``body(span, work)`` for every task, in order, with one :class:`_Work`."""
    work = _Work(layer, p)
    for span in spans:
        body(span, work)


def _fold(parts: Tensor, op: str = "sum") -> Tensor:
    """The groups' partial results ``(G, ...)`` combined in group order into ``(...)``."""
    if parts.shape[0] == 0:
        return parts.new_full(parts.shape[1:], 0.0 if op == "sum" else -math.inf)
    out = parts[0].clone()
    for part in parts[1:]:
        if op == "sum":
            out.add_(part)
        else:
            torch.maximum(out, part, out=out)
    return out


def product_dtype(device: torch.device, narrow: torch.dtype | None) -> torch.dtype | None:
    """The dtype of the operands of the logits' products, where it is not the compute dtype.

    ``narrow`` (a :class:`Layer`'s: the half-precision dtype every input shares) on CUDA,
    where torch has the matrix product with ``out_dtype`` (``aten::mm.dtype_out``, torch
    2.6 and later): the tensor cores' half-precision products with fp32 accumulation and fp32
    results. ``None`` elsewhere: products in the compute dtype (IEEE fp32 on the CPU).

    Example:
        >>> product_dtype(torch.device("cpu"), torch.bfloat16) is None
        True
    """
    if narrow is None or device.type != "cuda" or not _HAS_OUT_DTYPE:
        return None
    return narrow


# torch's matrix products with an output dtype of their own (absent before torch 2.6).
_HAS_OUT_DTYPE: Final = hasattr(torch.ops.aten.mm, "dtype_out") and hasattr(
    torch.ops.aten.addmm, "dtype_out"
)


def _weight_tile(layer: Layer, tile: Tile, cache: dict[int, Tensor]) -> Tensor:
    """``weight[v0:v1]`` in the compute dtype (a widened copy only for narrower weights).

    The copy is written into the previous tile's buffer (``cache`` holds it): one allocation
    per pass, not one per tile.
    """
    block = layer.weight[tile.v0 : tile.v1]
    if block.dtype == layer.dtype:
        return block
    if tile.v0 not in cache:
        buf = next(iter(cache.values()), None)
        cache.clear()
        if buf is None or buf.shape[0] < block.shape[0]:
            buf = torch.empty(block.shape, dtype=layer.dtype, device=block.device)
        cache[tile.v0] = buf[: block.shape[0]].copy_(block)
    return cache[tile.v0]


def _logit_tile(layer: Layer, tile: Tile, w: Tensor, buf: Tensor) -> Tensor:
    """The logits of ``tile`` written to (a view of) ``buf``: one matrix product.

    In the compute dtype, or with :func:`product_dtype`'s operands: the hidden rows and the
    weight tile in their own half-precision dtype (the hidden states were widened exactly),
    fp32 results.
    """
    out = buf[: tile.r1 - tile.r0, : tile.v1 - tile.v0]
    h = layer.hidden[tile.r0 : tile.r1]
    bias = None if layer.bias is None else layer.bias[tile.v0 : tile.v1].to(layer.dtype)
    operand = product_dtype(h.device, layer.narrow)
    if operand is not None:
        h, w = h.to(operand), layer.weight[tile.v0 : tile.v1]
        tile_product(h, w, bias, out, out_dtype=out.dtype)
    else:
        tile_product(h, w, bias, out)
    if layer.scale != 1.0:
        out.mul_(layer.scale)
    return out


def tile_product(
    h: Tensor, w: Tensor, bias: Tensor | None, out: Tensor, out_dtype: torch.dtype | None = None
) -> Tensor:
    """``h @ w.T (+ bias)`` written to ``out``; with ``out_dtype``, the product whose operands
    keep their (half-precision) dtype and whose results are ``out_dtype`` (``aten::mm`` /
    ``aten::addmm`` ``.dtype_out``: fp32 accumulation, CUDA only).

    Example:
        >>> tile_product(torch.ones(1, 2), torch.ones(3, 2), None, torch.empty(1, 3))
        tensor([[2., 2., 2.]])
    """
    if out_dtype is None:
        if bias is None:
            return torch.mm(h, w.T, out=out)
        return torch.addmm(bias, h, w.T, out=out)
    if bias is None:
        torch.ops.aten.mm.dtype_out(h, w.T, out_dtype, out=out)
    else:
        torch.ops.aten.addmm.dtype_out(bias, h, w.T, out_dtype, out=out)
    return out


def _logits(layer: Layer, tile: Tile, work: _Work, key: str = "z", side: int = 0) -> Tensor:
    """The tile's logits of ``layer`` in the pass's buffer ``key`` (``side``: which of the
    two weight caches)."""
    w = _weight_tile(layer, tile, work.caches[side])
    return _logit_tile(layer, tile, w, work.buf(key))


class Sums(NamedTuple):
    """Per-row sums over a vocabulary, relative to a per-row shift ``m`` (0 when unshifted).

    ``s = Σ exp(z - m)``; ``taken = z[token] - m`` (0 for a row whose token is not in this
    vocabulary slice); ``t = Σ exp(z - m) (z - m)`` with ``0 · -inf = 0`` (only if asked).
    """

    s: Tensor
    taken: Tensor
    t: Tensor | None


def token_sums(
    layer: Layer,
    local: Tensor,
    *,
    shift: Tensor | None,
    entropy: bool,
    exact: bool,
    mix: Tensor | None = None,
) -> Sums:
    """One pass over the vocabulary tiles: the :class:`Sums` of every row.

    ``local``: ``(N,)`` int64 token ids relative to this weight's first row (ids outside
    ``[0, V_local)`` are not taken). ``exact``: write ``0 · -inf`` terms of ``t`` as 0 (a
    pass more); on the fast path they make ``t`` NaN, which flags the row for the exact redo.

    ``mix``: an ``(N, H)`` buffer (compute dtype, no ``entropy``) into which the same pass
    writes ``Σ_v e^{z_v - m} W_v``, the weight rows weighted by the unnormalised
    probabilities (one more product per tile; divided by ``s`` it is the mean weight row
    under the softmax). The tiles, and so the sums, are those of the pass without ``mix``.
    """
    if mix is not None:
        assert not entropy, "mix: log-probs only"
        mix.zero_()
    n = layer.hidden.shape[0]
    p = plan(layer, CHUNK_ELEMENTS)
    parts = torch.zeros(
        len(p.groups), 3 if entropy else 2, n, dtype=layer.dtype, device=layer.hidden.device
    )

    def body(span: Span, work: _Work) -> None:
        for tile, _ in _span_tiles(span, p):
            sl = slice(tile.r0, tile.r1)
            w = _weight_tile(layer, tile, work.caches[0])
            z = _logit_tile(layer, tile, w, work.buf("z"))
            parts[span.group, :, sl] += work.ops.linear_logprob_tile(
                z, local[sl] - tile.v0, None if shift is None else shift[sl], entropy, exact
            )
            if mix is None:
                continue
            if not work.ops.leaves_exp:  # the mixing product's operand, e^(z - m)
                exp_(z if shift is None else z.sub_(shift[sl, None]))
            mix[sl].addmm_(z, w)

    _run(layer, _spans(p, n), body, p)
    total = _fold(parts)
    return Sums(total[0], total[1], total[2] if entropy else None)


def row_max(layer: Layer) -> Tensor:
    """``max_v z_v`` of every row: a pass over the tiles (for the rows the fast path fails)."""
    n = layer.hidden.shape[0]
    p = plan(layer, CHUNK_ELEMENTS)
    parts = torch.full((len(p.groups), n), -math.inf, dtype=layer.dtype, device=layer.hidden.device)

    def body(span: Span, work: _Work) -> None:
        top = parts[span.group, span.r0 : span.r1]
        for tile, _ in _span_tiles(span, p):
            torch.maximum(top, _logits(layer, tile, work).amax(1), out=top)

    _run(layer, _spans(p, n), body, p)
    return _fold(parts, "max")


def _sub_layer(layer: Layer, index: Tensor) -> Layer:
    return layer._replace(hidden=layer.hidden.index_select(0, index))


class Stats(NamedTuple):
    """Per-row results of a log-prob pass: log-sum-exp, log-prob and entropy (or ``None``)."""

    lse: Tensor
    logprob: Tensor
    entropy: Tensor | None


def _close(sums: Sums, shift: Tensor | None) -> Stats:
    log_s = sums.s.log()
    lse = log_s if shift is None else log_s + shift
    # The token's term is in s, so log s >= taken up to the rounding of log: never positive.
    logprob = (sums.taken - log_s).clamp_(max=0.0)
    entropy = None if sums.t is None else log_s - sums.t / sums.s
    return Stats(lse, logprob, entropy)


Reduce = Callable[[Callable[[], Tensor], tuple[int, ...], str], Tensor]
"""``reduce(compute, shape, op)``: ``compute()`` this rank's part (of ``shape``), reduced
across ranks (``"sum"`` or ``"max"``). In one process: ``compute()``; across ranks the
computation is guarded, so that a rank that fails still joins the collective and every rank
raises."""


def _local(compute: Callable[[], Tensor], shape: tuple[int, ...], op: str) -> Tensor:
    return compute()


def _reduced_sums(compute: Callable[[], Sums], shape: tuple[int, int], reduce: Reduce) -> Sums:
    """:class:`Sums` of the whole vocabulary from each rank's (one all-reduce)."""

    def packed() -> Tensor:
        sums = compute()
        return torch.stack([sums.s, sums.taken] + ([] if sums.t is None else [sums.t]))

    out = reduce(packed, shape, "sum")
    return Sums(out[0], out[1], out[2] if out.shape[0] > 2 else None)


def logprob_stats(
    layer: Layer,
    local: Tensor,
    entropy: bool,
    vocab: int | None = None,
    reduce: Reduce = _local,
    mean_weight: Tensor | None = None,
) -> Stats:
    """Log-sum-exp, log-prob of the tokens and (if asked) entropy of every row, exactly.

    The shift-free pass first; the rows where it is not exact (``-inf`` or extreme logits,
    NaN) are redone with their max subtracted. A row with NaN or ``+inf`` logits, or only
    ``-inf`` ones, gets a NaN log-prob. ``local``: token ids relative to ``layer.weight``'s
    first row. Under vocabulary parallelism ``layer`` holds a rank's slice, ``vocab`` is the
    whole vocabulary's size and ``reduce`` all-reduces across the ranks; every decision is
    taken on reduced values, so all ranks take part in the same collectives. With value
    checks off (no host synchronisation allowed) every row takes the max-shifted path: one
    more pass over the tiles, no data-dependent step.

    ``mean_weight``: an ``(N, H)`` buffer (compute dtype; in one process, without entropy)
    that receives each row's mean weight row under its softmax, ``Σ_v π(v) W_v``, from the
    same passes (:func:`token_sums`' ``mix``), so that ``∂ log π(y)/∂x = (W_y - Σ_v π(v)
    W_v) / T`` needs no backward pass over the tiles.
    """
    vocab = layer.weight.shape[0] if vocab is None else vocab
    n, k = local.shape[0], 3 if entropy else 2
    if mean_weight is not None:
        assert reduce is _local and not entropy, "mean_weight: one process, log-probs only"
    if sync_free(layer.hidden):
        top = reduce(lambda: row_max(layer), (n,), "max")
        top = torch.where(torch.isfinite(top), top, 0.0)
        every = _reduced_sums(
            lambda: token_sums(
                layer, local, shift=top, entropy=entropy, exact=True, mix=mean_weight
            ),
            (k, n),
            reduce,
        )
        if mean_weight is not None:
            mean_weight.div_(every.s[:, None])
        stats = _close(every, top)
        stats.logprob.masked_fill_(~torch.isfinite(stats.lse), math.nan)
        return stats
    sums = _reduced_sums(
        lambda: token_sums(layer, local, shift=None, entropy=entropy, exact=False, mix=mean_weight),
        (k, n),
        reduce,
    )
    stats = _close(sums, None)
    ok = shift_free_ok(sums.s, vocab)
    if stats.entropy is not None:
        ok &= torch.isfinite(stats.entropy)
    if mean_weight is not None:
        mean_weight.div_(sums.s[:, None])
        # a product of the unshifted exponentials that overflowed: redo the row shifted
        ok &= torch.isfinite(mean_weight).all(1)
    redo = (~ok).nonzero().squeeze(-1)
    if redo.numel():
        sub = _sub_layer(layer, redo)
        r = redo.shape[0]
        m = reduce(lambda: row_max(sub), (r,), "max")
        part_mean = None if mean_weight is None else mean_weight.new_empty(r, layer.hidden.shape[1])
        part = _reduced_sums(
            lambda: token_sums(
                sub, local[redo], shift=m, entropy=entropy, exact=True, mix=part_mean
            ),
            (k, r),
            reduce,
        )
        exact = _close(part, m)
        for full, part_stat in zip(stats, exact, strict=True):
            if full is not None and part_stat is not None:
                full[redo] = part_stat
        if mean_weight is not None and part_mean is not None:
            mean_weight[redo] = part_mean.div_(part.s[:, None])
    # +inf anywhere in the row: its lse is +inf and the log-prob a quiet -inf; NaN it.
    stats.logprob.masked_fill_(~torch.isfinite(stats.lse), math.nan)
    return stats


TileGrad = Callable[[Tile, Tensor, Any], Tensor]
"""``logit_grad(tile, z, work)``: the tile's logits ``z`` turned in place into ``∂L/∂z``, with
the pass's scratch ``work`` (its buffers and per-tile reductions)."""


def backprop(
    layer: Layer, logit_grad: TileGrad, needs: tuple[bool, bool, bool]
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    r"""Gradients w.r.t. ``hidden``, ``weight``, ``bias`` from per-tile logit gradients.

    Each tile's logits ``z`` are recomputed (into a scratch buffer) and handed to
    ``logit_grad(tile, z, work)``, which turns them in place into ``G = ∂L/∂z`` (already
    divided by the temperature, so that ``G`` is the gradient w.r.t. ``x W^T + b``). Then

    .. math:: \partial_x \mathrel{+}= G W, \quad \partial_W = G^\top x, \quad
        \partial_b = \textstyle\sum_i G_i

    tile by tile, one vocabulary group at a time over all rows (so that a narrow weight's
    gradient is summed over all rows in fp32 and rounded once). Returns the hidden gradient
    ``(N, H)`` in the compute dtype (a rank's partial sum under vocabulary parallelism), the
    weight and bias gradients in their own dtypes, each ``None`` where ``needs`` says so.
    """
    x, weight, bias, dtype = layer.hidden, layer.weight, layer.bias, layer.dtype
    n = x.shape[0]
    narrow = weight.dtype != dtype
    p = plan(layer, CHUNK_ELEMENTS)
    grad_x = torch.zeros_like(x) if needs[0] else None
    # Every tile writes its rows of the weight and bias gradients (no tiles: no positions).
    new = torch.empty_like if n else torch.zeros_like
    grad_w = new(weight) if needs[1] else None
    # The bias gradient is V numbers: accumulated in the compute dtype, rounded once.
    grad_b = new(bias, dtype=dtype) if needs[2] and bias is not None else None

    def body(span: Span, work: _Work) -> None:
        for tile, first in _span_tiles(span, p):
            w = _weight_tile(layer, tile, work.caches[0])
            grad = logit_grad(tile, _logit_tile(layer, tile, w, work.buf("z")), work)
            sl, width = slice(tile.r0, tile.r1), tile.v1 - tile.v0
            if grad_x is not None:
                grad_x[sl].addmm_(grad, w)
            if grad_w is not None:
                if narrow:
                    target = work.buf("grad_w", width=weight.shape[1])[:width]
                else:
                    target = grad_w[tile.v0 : tile.v1]
                if first:
                    torch.mm(grad.T, x[sl], out=target)
                else:
                    target.addmm_(grad.T, x[sl])
                if narrow and tile.r1 == n:
                    grad_w[tile.v0 : tile.v1].copy_(target)
            if grad_b is not None:
                column = grad.sum(0)
                if first:
                    grad_b[tile.v0 : tile.v1] = column
                else:
                    grad_b[tile.v0 : tile.v1] += column

    _run(layer, _spans(p, n, whole_rows=True), body, p)
    return grad_x, grad_w, None if grad_b is None or bias is None else grad_b.to(bias.dtype)


def logprob_grad(
    layer: Layer,
    local: Tensor,
    lse: Tensor,
    grad_logprob: Tensor,
    entropy: tuple[Tensor, Tensor] | None,
) -> TileGrad:
    r"""The per-tile gradient of ``Σ_i g_i log π(y_i) + h_i H_i`` w.r.t. the logits.

    With ``p = softmax(z)`` and ``ℓ = z - lse`` (``lse`` of the whole row):

    .. math:: \frac{\partial}{\partial z_{ij}} = g_i \mathbb{1}[j = y_i]
        - p_{ij} \big(g_i + h_i (\ell_{ij} + H_i)\big)

    divided by the temperature. ``entropy``: ``(H, h)``, or ``None`` for no entropy term;
    ``local`` as in :func:`token_sums`. For :func:`backprop`.
    """
    dtype = layer.dtype
    g = grad_logprob.reshape(-1).to(dtype) * layer.scale
    ent = gh = None
    if entropy is not None:
        ent = entropy[0].reshape(-1)
        gh = entropy[1].reshape(-1).to(dtype) * layer.scale

    def tile_grad(tile: Tile, z: Tensor, work: _Work) -> Tensor:
        sl = slice(tile.r0, tile.r1)
        return work.ops.linear_logprob_tile_grad(
            z,
            local[sl] - tile.v0,
            lse[sl],
            g[sl],
            None if ent is None else ent[sl],
            None if gh is None else gh[sl],
        )

    return tile_grad


class KLStats(NamedTuple):
    """Per-row results of a KL pass.

    ``lse_z``: log-sum-exp of the policy logits; ``kl``: the divergence (not clamped);
    ``shift``: ``lse_z - lse_w + KL``, such that ``∂KL/∂z = p ((z - w) - shift)``.
    """

    lse_z: Tensor
    kl: Tensor
    shift: Tensor


def _paired(policy: Layer, reference: Layer, tile: Tile, work: _Work) -> tuple[Tensor, Tensor]:
    """The tile's policy and reference logits, in the pass's buffers ``z`` and ``w``."""
    return _logits(policy, tile, work), _logits(reference, tile, work, "w", 1)


def _kl_sums(
    policy: Layer, reference: Layer, shifts: tuple[Tensor, Tensor] | None
) -> tuple[KLStats, Tensor]:
    r"""The KL of every row in one pass, its terms and sums in float64; and where it is exact.

    With per-row shifts ``m_z``, ``m_w`` (0 without ``shifts``), ``S_z = Σ e^{z - m_z}``,
    ``S_w = Σ e^{w - m_w}`` and ``A = Σ e^{z - m_z} d``, ``d = (z - m_z) - (w - m_w)``, all
    formed and summed in float64 from each tile's logits,

    .. math:: \mathrm{KL} = A / S_z - \log S_z + \log S_w

    Where the policy and the reference are close this difference cancels to the KL's size
    (``~ d²`` for log-ratios ``d``): fp32 terms would leave a relative error ``~ eps / d``
    (5e-4 at a KL of 4e-7, measured), float64 terms leave ``~ 1e-16 / d``. Unshifted float64
    exponentials are exact for logits within about ±700
    (:func:`~klpen.kernels.blocks.shift_free_ok`); the rows where they are not are redone with their
    maxes as ``shifts``, which also writes ``0 · log 0`` terms as 0.
    """
    n, vocab, device = policy.hidden.shape[0], policy.weight.shape[0], policy.hidden.device
    p = plan(policy, CHUNK_ELEMENTS // 4)
    parts = torch.zeros(len(p.groups), 3, n, dtype=torch.float64, device=device)
    wide = torch.float64

    def body(span: Span, work: _Work) -> None:
        sl = slice(span.r0, span.r1)
        acc = parts[span.group, :, sl]
        for tile, _ in _span_tiles(span, p):
            z, w = _paired(policy, reference, tile, work)
            r, c = z.shape
            e_z, e_w, d = (work.buf(key, wide)[:r, :c] for key in ("e_z", "e_w", "d"))
            e_z.copy_(z)
            e_w.copy_(w)
            if shifts is not None:
                e_z.sub_(shifts[0][sl, None])
                e_w.sub_(shifts[1][sl, None])
            torch.sub(e_z, e_w, out=d)
            acc[1] += e_w.exp_().sum(1)
            terms = e_z.exp_()
            acc[0] += terms.sum(1)
            terms = terms.mul_(d)
            if shifts is not None:
                # 0 · log 0 = 0 where e^z = 0 and d = -inf (NaN logits show in the lse instead).
                terms.masked_fill_(terms.isnan(), 0.0)
            acc[2] += terms.sum(1)

    _run(policy, _spans(p, n), body, p)
    s_z, s_w, a = _fold(parts).unbind()
    ok = shift_free_ok(s_z, vocab) & shift_free_ok(s_w, vocab)
    lse_z, lse_w = s_z.log(), s_w.log()
    kl = a / s_z - lse_z + lse_w
    if shifts is not None:
        lse_z += shifts[0]
        lse_w += shifts[1]
        # A row of NaN, +inf or only -inf logits (either side) has a non-finite lse: NaN its
        # divergence. A -inf reference logit where the policy has mass leaves both finite
        # and the KL +inf, as full_kl gives it.
        kl = kl.masked_fill(~(torch.isfinite(lse_z) & torch.isfinite(lse_w)), math.nan)
    ok &= torch.isfinite(kl)
    dtype = policy.dtype
    return KLStats(lse_z.to(dtype), kl.to(dtype), (lse_z - lse_w + kl).to(dtype)), ok


def _kl_centred(policy: Layer, reference: Layer) -> tuple[KLStats, Tensor]:
    r"""The KL of every row in one pass in the compute dtype, centred; and where it is exact.

    With ``e = exp(z)`` (unshifted), ``d = w - z`` and, per row, ``c`` = the mean of ``d``
    over the first vocabulary tile (any constant would do; this one takes out the common
    offset of the two layers' logits), ``v = d - c``, ``F = E_p[expm1(v) - v]`` and
    ``u = E_p[v] + F``:

    .. math:: \mathrm{KL} = \log E_p[e^v] - E_p[v] = F + \big(\operatorname{log1p}(u) - u\big)

    (:func:`klpen.kernels.torch_kl.centred_kl`, as ``full_kl``'s second pass computes it). Its terms
    are ``O(v)`` and ``O(v²)``, not ``O(1)`` as in ``A / S_z - log S_z + log S_w``, so fp32
    terms summed into float64 accumulators lose no digits to cancellation; the rounding of
    each ``e`` is common to all sums, which then give the exact KL of a distribution within
    ``eps`` of ``p`` with the same log-ratios. The first tile of every row chunk is done
    first (it gives the centre), then the rest of the groups. Returns the stats and where
    they are exact: the sums in range (:func:`~klpen.kernels.blocks.shift_free_ok`), the result
    finite and the error estimate small against the KL. The other rows (divergences below
    about ``1e-6``, a reference offset that rounds ``w - z``, ``-inf`` or extreme logits) go
    to :func:`_kl_sums`.
    """
    n, vocab, device = policy.hidden.shape[0], policy.weight.shape[0], policy.hidden.device
    p = plan(policy, CHUNK_ELEMENTS // 2)
    parts = torch.zeros(len(p.groups), 3, n, dtype=torch.float64, device=device)
    tops = torch.zeros(len(p.groups), n, dtype=policy.dtype, device=device)
    centre = torch.zeros(n, dtype=policy.dtype, device=device)

    def body(span: Span, work: _Work) -> None:
        sl = slice(span.r0, span.r1)
        acc, top = parts[span.group, :, sl], tops[span.group, sl]
        for tile, _ in _span_tiles(span, p):
            z, w = _paired(policy, reference, tile, work)
            if tile.v0 == 0:
                v = torch.sub(w, z, out=work.buf("v")[: z.shape[0], : z.shape[1]])
                torch.mean(v, dim=1, out=centre[sl])
            sums = work.ops.linear_kl_tile(z, w, centre[sl])
            acc += sums[:3]
            torch.maximum(top, sums[3], out=top)

    spans = _spans(p, n)
    first = [s._replace(v1=min(s.v0 + p.cols, s.v1)) for s in spans if s.group == 0]
    rest = [s._replace(v0=s.v0 + p.cols) if s.group == 0 else s for s in spans]
    _run(policy, first, body, p)
    _run(policy, [s for s in rest if s.v0 < s.v1], body, p)
    s_z, sum_v, sum_f = _fold(parts).unbind()
    top_e = _fold(tops, "max")
    eps = torch.finfo(policy.dtype).eps
    kl, shift, unsure = centred_kl(s_z, sum_v, sum_f, top_e.double(), centre.double(), eps)
    lse_z = s_z.log()
    # lse_w = log Σ e^w = lse_z + c + log E_p[e^v]
    lse_w = lse_z + centre + torch.log1p((sum_v + sum_f) / s_z)
    ok = shift_free_ok(s_z.to(policy.dtype), vocab) & torch.isfinite(kl) & torch.isfinite(lse_w)
    ok &= ~unsure
    dtype = policy.dtype
    return KLStats(lse_z.to(dtype), kl.to(dtype), shift.to(dtype)), ok


def _kl_exact(policy: Layer, reference: Layer) -> KLStats:
    """The KL of (a few) rows with their maxes subtracted and ``0 · log 0 = 0``: three passes."""
    stats, _ = _kl_sums(policy, reference, (row_max(policy), row_max(reference)))
    return stats


def kl_stats(policy: Layer, reference: Layer) -> tuple[KLStats, Tensor]:
    """:class:`KLStats` of every row, exact: the fast pass, then the rows it could not do.

    Returns the stats and the ``(M,)`` int64 rows that were redone exactly (``-inf`` or extreme
    logits), whose gradient needs the ``0 · log 0 = 0`` convention. In float64 the terms are
    float64 throughout (exact to about 1e-15, where the centred pass promises 5e-5). With value
    checks off (no host synchronisation allowed) every row takes the exact float64 path and
    is returned as redone.
    """
    if sync_free(policy.hidden):
        every = torch.arange(policy.hidden.shape[0], device=policy.hidden.device)
        return _kl_exact(policy, reference), every
    if policy.dtype == torch.float64:
        return _kl_float64(policy, reference)
    stats, ok = _kl_centred(policy, reference)
    redo = (~ok).nonzero().squeeze(-1)
    if not redo.numel():
        return stats, redo
    # float64 terms for the rows the fp32 pass cannot promise: a pass over their tiles only
    part, worst = _kl_float64(_sub_layer(policy, redo), _sub_layer(reference, redo))
    for full, rows in zip(stats, part, strict=True):
        full[redo] = rows
    return stats, redo[worst]


def _kl_float64(policy: Layer, reference: Layer) -> tuple[KLStats, Tensor]:
    """:func:`_kl_sums` unshifted, then :func:`_kl_exact` for the rows where its sums are not
    exact; returns the stats and those rows."""
    stats, ok = _kl_sums(policy, reference, None)
    redo = (~ok).nonzero().squeeze(-1)
    if redo.numel():
        exact = _kl_exact(_sub_layer(policy, redo), _sub_layer(reference, redo))
        for full, rows in zip(stats, exact, strict=True):
            full[redo] = rows
    return stats, redo


def kl_grad(
    policy: Layer, reference: Layer, stats: KLStats, grad_kl: Tensor, masked: bool
) -> TileGrad:
    r"""The per-tile gradient of ``Σ_i g_i KL_i`` w.r.t. the policy logits, for :func:`backprop`.

    .. math:: \frac{\partial \mathrm{KL}}{\partial z_j} = p_j \big[(z_j - w_j)
        - (\mathrm{lse}_z - \mathrm{lse}_w + \mathrm{KL})\big]

    divided by the temperature. ``masked``: write the terms where ``p = 0`` as 0 (needed when
    some row has ``-inf`` logits).
    """
    g = grad_kl.reshape(-1).to(policy.dtype) * policy.scale

    def tile_grad(tile: Tile, z: Tensor, work: _Work) -> Tensor:
        sl = slice(tile.r0, tile.r1)
        w = _logits(reference, tile, work, "w", 1)
        return work.ops.linear_kl_tile_grad(z, w, stats.lse_z[sl], stats.shift[sl], g[sl], masked)

    return tile_grad
