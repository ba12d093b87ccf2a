r"""The ``torch`` backend's hidden-state kernels: log-probs, entropy and KL over logit tiles.

A language model's last step is ``logits = hidden @ weight.T (+ bias)``. Here the output layer
and the reduction are fused: the vocabulary is walked in tiles of ``weight``'s rows, each
tile's logits ``(rows, tile)`` are computed by one matrix product into a reused scratch buffer,
reduced at once, and forgotten. Backward recomputes each tile (one more product) and
accumulates the three gradients tile by tile (:func:`backprop`, with a per-tile logit gradient
from :func:`logprob_grad` or :func:`kl_grad`). Moved here from ``klpen.linear``.

Numerics:

* All arithmetic is in the compute dtype (:func:`~klpen._validation.promoted_dtype` of the
  inputs): half-precision ``hidden``/``weight`` are widened exactly to fp32 per tile and
  multiplied in fp32 with fp32 accumulation, so the result is *more* accurate than the unfused
  bf16 path, which rounds every logit to bf16 (tested against float64).
* Log-sum-exps use the shift-free sums of :mod:`klpen.kernels.blocks` (one ``exp`` per logit, no max
  pass); rows where that is not exact (``-inf`` logits from a masking ``bias``, extreme values)
  are redone with the row max subtracted, as :func:`~klpen.kernels.blocks.row_logsumexp` does.
* The KL is computed in a centred form whose terms are of the size of the log-ratios, not of
  the logits (:func:`_kl_centred`), in the compute dtype with float64 accumulators, so that
  nearby distributions lose no digits to cancellation; identical ones give exactly 0. The
  rows it cannot promise to 5e-5 (divergences below about 1e-6, ``-inf`` or extreme logits)
  are recomputed with float64 terms, a pass over their tiles only.
* Exponentials of fp32 tiles on the CPU are :func:`~klpen.kernels.blocks.exp_`'s ``exp2``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import NamedTuple

import torch
from torch import Tensor

from .blocks import (
    ACCELERATOR_SCALE,
    CHUNK_ELEMENTS,
    exp_,
    exp_in_unit,
    exp_into,
    exp_unit,
    shift_free_ok,
    sync_free,
)
from .torch_kl import centred_kl

__all__ = [
    "KLStats",
    "Layer",
    "Reduce",
    "Stats",
    "Sums",
    "Tile",
    "TileGrad",
    "backprop",
    "kl_grad",
    "kl_stats",
    "logprob_grad",
    "logprob_stats",
    "row_max",
    "tile_shape",
    "token_sums",
]

# Rows of one tile: the vocabulary tile is then CHUNK_ELEMENTS // rows columns (2048 for the
# issue's N = 2048), wide enough for an efficient matrix product, small enough to bound memory.
_MAX_TILE_ROWS = 4096
_MIN_TILE_COLS = 128
# Tiles of a half-precision weight hold this many times fewer logits (see tile_shape).
_NARROW_SHARE = 4


class Layer(NamedTuple):
    """An output layer applied to flat hidden states: ``(hidden @ weight.T + bias) * scale``.

    ``hidden`` is ``(N, H)`` in the compute dtype; ``weight`` ``(V, H)`` and ``bias`` ``(V,)``
    are in their own dtypes (a tile of them is widened when needed); ``dtype`` is the compute
    dtype. For a vocabulary split across ranks, ``weight`` and ``bias`` are the local slices.
    """

    hidden: Tensor
    weight: Tensor
    bias: Tensor | None
    scale: float
    dtype: torch.dtype


class Tile(NamedTuple):
    """One tile of the logits: rows ``[r0, r1)`` and vocabulary entries ``[v0, v1)``."""

    r0: int
    r1: int
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


def _tile_shape(layer: Layer, budget: int) -> tuple[int, int]:
    on_cpu = layer.hidden.device.type == "cpu"
    narrow = layer.weight.dtype != layer.dtype
    return tile_shape(layer.hidden.shape[0], layer.weight.shape[0], budget, on_cpu, narrow)


def _tiles(layer: Layer, rows: int, cols: int) -> Iterator[tuple[Tile, bool]]:
    """Vocabulary tiles outside, row blocks inside; the flag marks a tile's first row block."""
    n, v = layer.hidden.shape[0], layer.weight.shape[0]
    for v0 in range(0, v, cols):
        for r0 in range(0, n, rows):
            yield Tile(r0, min(r0 + rows, n), v0, min(v0 + cols, v)), r0 == 0


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
    """The logits of ``tile`` written to (a view of) ``buf``: one matrix product."""
    out = buf[: tile.r1 - tile.r0, : tile.v1 - tile.v0]
    h = layer.hidden[tile.r0 : tile.r1]
    if layer.bias is None:
        torch.mm(h, w.T, out=out)
    else:
        torch.addmm(layer.bias[tile.v0 : tile.v1].to(layer.dtype), h, w.T, out=out)
    if layer.scale != 1.0:
        out.mul_(layer.scale)
    return out


def _scratch(layer: Layer, rows: int, cols: int, count: int) -> list[Tensor]:
    return [
        torch.empty(rows, cols, dtype=layer.dtype, device=layer.hidden.device) for _ in range(count)
    ]


class Sums(NamedTuple):
    """Per-row sums over a vocabulary, relative to a per-row shift ``m`` (0 when unshifted).

    ``s = Σ exp(z - m)``; ``taken = z[token] - m`` (0 for a row whose token is not in this
    vocabulary slice); ``t = Σ exp(z - m) (z - m)`` with ``0 · -inf = 0`` (only if asked).
    """

    s: Tensor
    taken: Tensor
    t: Tensor | None


def token_sums(
    layer: Layer, local: Tensor, *, shift: Tensor | None, entropy: bool, exact: bool
) -> Sums:
    """One pass over the vocabulary tiles: the :class:`Sums` of every row.

    ``local``: ``(N,)`` int64 token ids relative to this weight's first row (ids outside
    ``[0, V_local)`` are not taken). ``exact``: write ``0 · -inf`` terms of ``t`` as 0 (a
    pass more); on the fast path they make ``t`` NaN, which flags the row for the exact redo.
    """
    n = layer.hidden.shape[0]
    rows, cols = _tile_shape(layer, CHUNK_ELEMENTS)
    s = torch.zeros(n, dtype=layer.dtype, device=layer.hidden.device)
    taken = torch.zeros_like(s)
    t = torch.zeros_like(s) if entropy else None
    bufs = _scratch(layer, rows, cols, 2 if entropy else 1)
    unit = exp_unit(bufs[0])
    cache: dict[int, Tensor] = {}
    for tile, _ in _tiles(layer, rows, cols):
        z = _logit_tile(layer, tile, _weight_tile(layer, tile, cache), bufs[0])
        sl = slice(tile.r0, tile.r1)
        if shift is not None:
            z.sub_(shift[sl, None])
        col = local[sl] - tile.v0
        inside = (col >= 0) & (col < z.shape[1])
        picked = z.gather(1, col.clamp(0, z.shape[1] - 1)[:, None]).squeeze(1)
        taken[sl] += torch.where(inside, picked, 0.0)
        if t is None:
            s[sl] += exp_(z).sum(1)
            continue
        # z in the exponential's unit (see klpen.kernels.blocks.exp_unit), t divided back below
        e = exp_in_unit(z.mul_(unit), bufs[1][: z.shape[0], : z.shape[1]])
        s[sl] += e.sum(1)
        ez = z.mul_(e)
        if exact:
            ez.masked_fill_(e == 0, 0.0)
        t[sl] += ez.sum(1)
    if t is not None:
        t.div_(unit)
    return Sums(s, taken, t)


def row_max(layer: Layer) -> Tensor:
    """``max_v z_v`` of every row: a pass over the tiles (for the rows the fast path fails)."""
    rows, cols = _tile_shape(layer, CHUNK_ELEMENTS)
    m = torch.full(
        (layer.hidden.shape[0],), -math.inf, dtype=layer.dtype, device=layer.hidden.device
    )
    (buf,) = _scratch(layer, rows, cols, 1)
    cache: dict[int, Tensor] = {}
    for tile, _ in _tiles(layer, rows, cols):
        z = _logit_tile(layer, tile, _weight_tile(layer, tile, cache), buf)
        sl = slice(tile.r0, tile.r1)
        torch.maximum(m[sl], z.amax(1), out=m[sl])
    return m


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
    """
    vocab = layer.weight.shape[0] if vocab is None else vocab
    n, k = local.shape[0], 3 if entropy else 2
    if sync_free(layer.hidden):
        top = reduce(lambda: row_max(layer), (n,), "max")
        top = torch.where(torch.isfinite(top), top, 0.0)
        every = _reduced_sums(
            lambda: token_sums(layer, local, shift=top, entropy=entropy, exact=True),
            (k, n),
            reduce,
        )
        stats = _close(every, top)
        stats.logprob.masked_fill_(~torch.isfinite(stats.lse), math.nan)
        return stats
    sums = _reduced_sums(
        lambda: token_sums(layer, local, shift=None, entropy=entropy, exact=False), (k, n), reduce
    )
    stats = _close(sums, None)
    ok = shift_free_ok(sums.s, vocab)
    if stats.entropy is not None:
        ok &= torch.isfinite(stats.entropy)
    redo = (~ok).nonzero().squeeze(-1)
    if redo.numel():
        sub = _sub_layer(layer, redo)
        r = redo.shape[0]
        m = reduce(lambda: row_max(sub), (r,), "max")
        part = _reduced_sums(
            lambda: token_sums(sub, local[redo], shift=m, entropy=entropy, exact=True),
            (k, r),
            reduce,
        )
        exact = _close(part, m)
        for full, part_stat in zip(stats, exact, strict=True):
            if full is not None and part_stat is not None:
                full[redo] = part_stat
    # +inf anywhere in the row: its lse is +inf and the log-prob a quiet -inf; NaN it.
    stats.logprob.masked_fill_(~torch.isfinite(stats.lse), math.nan)
    return stats


TileGrad = Callable[[Tile, Tensor], Tensor]


def backprop(
    layer: Layer, logit_grad: TileGrad, needs: tuple[bool, bool, bool]
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    r"""Gradients w.r.t. ``hidden``, ``weight``, ``bias`` from per-tile logit gradients.

    Each tile's logits ``z`` are recomputed (into a scratch buffer) and handed to
    ``logit_grad(tile, z)``, which turns them in place into ``G = ∂L/∂z`` (already divided by
    the temperature, so that ``G`` is the gradient w.r.t. ``x W^T + b``). Then

    .. math:: \partial_x \mathrel{+}= G W, \quad \partial_W = G^\top x, \quad
        \partial_b = \textstyle\sum_i G_i

    tile by tile. Returns the hidden gradient ``(N, H)`` in the compute dtype (a rank's partial
    sum under vocabulary parallelism), the weight and bias gradients in their own dtypes, each
    ``None`` where ``needs`` says so.
    """
    x, weight, bias, dtype = layer.hidden, layer.weight, layer.bias, layer.dtype
    rows, cols = _tile_shape(layer, CHUNK_ELEMENTS)
    grad_x = torch.zeros_like(x) if needs[0] else None
    # Every tile writes its rows of the weight and bias gradients (no tiles: no positions).
    new = torch.empty_like if x.shape[0] else torch.zeros_like
    grad_w = new(weight) if needs[1] else None
    # The bias gradient is V numbers: accumulated in the compute dtype, rounded once.
    grad_b = new(bias, dtype=dtype) if needs[2] and bias is not None else None
    (buf,) = _scratch(layer, rows, cols, 1)
    gw_buf = None
    if grad_w is not None and grad_w.dtype != dtype:
        gw_buf = torch.empty(cols, weight.shape[1], dtype=dtype, device=weight.device)
    cache: dict[int, Tensor] = {}
    for tile, first in _tiles(layer, rows, cols):
        w = _weight_tile(layer, tile, cache)
        grad = logit_grad(tile, _logit_tile(layer, tile, w, buf))
        sl, width = slice(tile.r0, tile.r1), tile.v1 - tile.v0
        if grad_x is not None:
            grad_x[sl].addmm_(grad, w)
        if grad_w is not None:
            target = grad_w[tile.v0 : tile.v1] if gw_buf is None else gw_buf[:width]
            if first:
                torch.mm(grad.T, x[sl], out=target)
            else:
                target.addmm_(grad.T, x[sl])
            if gw_buf is not None and tile.r1 == x.shape[0]:
                grad_w[tile.v0 : tile.v1].copy_(target)
        if grad_b is not None:
            part = grad.sum(0)
            if first:
                grad_b[tile.v0 : tile.v1] = part
            else:
                grad_b[tile.v0 : tile.v1] += part
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
        ent = entropy[0][:, None]
        gh = (entropy[1].reshape(-1).to(dtype) * layer.scale)[:, None]
    rows, cols = _tile_shape(layer, CHUNK_ELEMENTS)
    pbuf = _scratch(layer, rows, cols, 1)[0] if entropy is not None else None

    def tile_grad(tile: Tile, z: Tensor) -> Tensor:
        sl, width = slice(tile.r0, tile.r1), z.shape[1]
        log_p = z.sub_(lse[sl, None])
        if ent is None or gh is None or pbuf is None:
            grad = exp_(log_p).mul_(-g[sl, None])
        else:
            p = exp_into(log_p, pbuf[: z.shape[0], :width])
            grad = log_p.add_(ent[sl]).mul_(gh[sl]).add_(g[sl, None]).mul_(p).neg_()
            grad.masked_fill_(p == 0, 0.0)
        col = local[sl] - tile.v0
        inside = (col >= 0) & (col < width)
        hit = torch.where(inside, g[sl], 0.0)[:, None]
        return grad.scatter_add_(1, col.clamp(0, width - 1)[:, None], hit)

    return tile_grad


def _paired_logits(
    policy: Layer, reference: Layer, budget: int, extra: tuple[torch.dtype, ...]
) -> Iterator[tuple[Tile, Tensor, Tensor, list[Tensor]]]:
    """Each tile's policy and reference logits, and a scratch buffer of a tile per ``extra``."""
    rows, cols = _tile_shape(policy, budget)
    bufs = _scratch(policy, rows, cols, 2)
    more = [torch.empty(rows, cols, dtype=d, device=policy.hidden.device) for d in extra]
    caches: tuple[dict[int, Tensor], dict[int, Tensor]] = ({}, {})
    for tile, _ in _tiles(policy, rows, cols):
        z = _logit_tile(policy, tile, _weight_tile(policy, tile, caches[0]), bufs[0])
        w = _logit_tile(reference, tile, _weight_tile(reference, tile, caches[1]), bufs[1])
        r, c = z.shape
        yield tile, z, w, [b[:r, :c] for b in more]


class KLStats(NamedTuple):
    """Per-row results of a KL pass.

    ``lse_z``: log-sum-exp of the policy logits; ``kl``: the divergence (not clamped);
    ``shift``: ``lse_z - lse_w + KL``, such that ``∂KL/∂z = p ((z - w) - shift)``.
    """

    lse_z: Tensor
    kl: Tensor
    shift: Tensor


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
    acc = torch.zeros(3, n, dtype=torch.float64, device=device)
    s_z, s_w, a = acc.unbind()
    wide = (torch.float64,) * 3
    for tile, z, w, (e_z, e_w, d) in _paired_logits(policy, reference, CHUNK_ELEMENTS // 4, wide):
        sl = slice(tile.r0, tile.r1)
        e_z.copy_(z)
        e_w.copy_(w)
        if shifts is not None:
            e_z.sub_(shifts[0][sl, None])
            e_w.sub_(shifts[1][sl, None])
        torch.sub(e_z, e_w, out=d)
        s_w[sl] += e_w.exp_().sum(1)
        terms = e_z.exp_()
        s_z[sl] += terms.sum(1)
        terms = terms.mul_(d)
        if shifts is not None:
            # 0 · log 0 = 0 where e^z = 0 and d = -inf (NaN logits show in the lse instead).
            terms.masked_fill_(terms.isnan(), 0.0)
        a[sl] += terms.sum(1)
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
    ``eps`` of ``p`` with the same log-ratios. Returns the stats and where they are exact:
    the sums in range (:func:`~klpen.kernels.blocks.shift_free_ok`), the result finite and the error
    estimate small against the KL. The other rows (divergences below about ``1e-6``, a
    reference offset that rounds ``w - z``, ``-inf`` or extreme logits) go to
    :func:`_kl_sums`.
    """
    n, vocab, device = policy.hidden.shape[0], policy.weight.shape[0], policy.hidden.device
    acc = torch.zeros(3, n, dtype=torch.float64, device=device)
    s_z, sum_v, sum_f = acc.unbind()
    top = torch.zeros(n, dtype=policy.dtype, device=device)
    centre = torch.zeros_like(top)
    for tile, z, w, (work,) in _paired_logits(
        policy, reference, CHUNK_ELEMENTS // 2, (policy.dtype,)
    ):
        sl = slice(tile.r0, tile.r1)
        v = w.sub_(z)
        if tile.v0 == 0:
            torch.mean(v, dim=1, out=centre[sl])
        v.sub_(centre[sl, None])
        e = exp_(z)
        s_z[sl] += e.sum(1)
        torch.maximum(top[sl], e.amax(1), out=top[sl])
        sum_v[sl] += torch.mul(v, e, out=work).sum(1)
        sum_f[sl] += torch.expm1(v, out=work).sub_(v).mul_(e).sum(1)
    eps = torch.finfo(policy.dtype).eps
    kl, shift, unsure = centred_kl(s_z, sum_v, sum_f, top.double(), centre.double(), eps)
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
    g = (grad_kl.reshape(-1).to(policy.dtype) * policy.scale)[:, None]
    rows, cols = _tile_shape(policy, CHUNK_ELEMENTS)
    wbuf, pbuf = _scratch(policy, rows, cols, 2)
    cache: dict[int, Tensor] = {}

    def tile_grad(tile: Tile, z: Tensor) -> Tensor:
        sl, (r, c) = slice(tile.r0, tile.r1), z.shape
        w = _logit_tile(reference, tile, _weight_tile(reference, tile, cache), wbuf)
        p = exp_into(z, pbuf[:r, :c], stats.lse_z[sl, None])
        grad = z.sub_(w).sub_(stats.shift[sl, None]).mul_(p).mul_(g[sl])
        return grad.masked_fill_(p == 0, 0.0) if masked else grad

    return tile_grad
