r"""The ``torch`` backend's log-prob and entropy kernels: per-row statistics and gradients.

For logits ``z`` of a row, an inverse temperature ``k`` and an entry ``c`` of the row (the
chosen token's logit, or the row max), with ``y = k (z - c)`` and ``s = Σ_v e^{y_v}``:

.. math:: \log \pi_v = y_v - \log s, \qquad H = \log s - E_\pi[y]

One pass over the blocks of rows gives ``(c, log s, E_π[y])`` per row (:func:`entropy_sums`,
or :func:`~klpen.kernels.blocks.shifted_log_sums` without entropy); the backward pass
recomputes ``π`` block by block from the saved logits and those numbers (:func:`logprob_grad`).
Moved here from ``klpen.logprobs``, unchanged in arithmetic.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from ._rows import block_buffer, for_each_block, index_blocks, take_rows
from .blocks import exp_into, scaled_into

# What other klpen modules import from here.
__all__ = ["LogProbGrad", "LogProbRows", "entropy_sums", "logprob_grad", "row_max_sums"]


class LogProbRows(NamedTuple):
    """Per-row statistics of a log-prob / entropy pass, all ``(N,)`` in the compute dtype.

    ``centre``: the shift ``c`` of each row; with ``log_s`` ``None`` it is the whole row's
    log-sum-exp (for a vocabulary slice, the global one), else an entry of the row and the
    log-sum-exp is ``k c + log s``. ``mean_y``: ``E_π[k (z - c)]`` (entropy only; then
    ``H = log s - mean_y``). ``redo``: int64 numbers of the rows with ``-inf`` logits, where
    the entropy gradient must apply ``0 · log 0 = 0`` (``None``: none).
    """

    centre: Tensor
    log_s: Tensor | None = None
    mean_y: Tensor | None = None
    redo: Tensor | None = None


class LogProbGrad(NamedTuple):
    """The upstream gradients of a log-prob / entropy pass and where the log-prob term lands.

    ``token_index``: ``(N, 1)`` int64 column of each row's token in the logits (``None``: no
    log-prob term). ``grad_logp``: the ``(...)`` upstream gradient ``g`` of the log-probs or
    ``None``; ``grad_ent``: ``h``, of the entropies, or ``None``. ``owned``: optional ``(N,)``
    bool, the rows whose token is in these logits (with a vocabulary split across ranks, the
    indicator lives on one rank only); ``None``: every row.
    """

    token_index: Tensor | None
    grad_logp: Tensor | None
    grad_ent: Tensor | None = None
    owned: Tensor | None = None


def entropy_sums(
    x: Tensor, rows: int, dtype: torch.dtype, shift: Tensor, scale: float
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    r"""Per row ``(c, log s, E_p[y], redo)`` of the logits ``x``, in one pass over them.

    With ``y = k (x - c)`` and ``s = Σ_v e^{y_v}``, ``log p_v = y_v - log s`` and the entropy
    of ``p = softmax(k x)`` is ``H = log s - E_p[y]``. ``c`` is ``shift`` (an entry of each
    row), or the row max where the sums are not finite (extreme or ``-inf`` logits: those rows,
    returned as ``redo``, are redone with ``0 · log 0 = 0``). One ``exp`` and two reductions per
    element (two sums and a product), as :func:`~klpen.kernels.blocks.shifted_log_sums` plus
    one dot.

    Example:
        >>> x = torch.tensor([[0.0, 0.0]])
        >>> c, log_s, mean_y, redo = entropy_sums(x, 1, torch.float32, x.amax(-1), 1.0)
        >>> (log_s - mean_y), redo
        (tensor([0.6931]), tensor([], dtype=torch.int64))
    """
    n = x.numel() // x.shape[-1]
    sums = torch.empty(2, n, dtype=dtype, device=x.device)
    s, sy = sums.unbind()

    def body(start: int, blocks: tuple[Tensor, ...], bufs: tuple[Tensor, Tensor]) -> None:
        (block,) = blocks
        stop, r = start + block.shape[0], block.shape[0]
        y = scaled_into(block, bufs[0][:r], shift[start:stop, None], scale)
        e = torch.exp(y, out=bufs[1][:r])
        torch.sum(e, dim=-1, out=s[start:stop])
        torch.sum(y.mul_(e), dim=-1, out=sy[start:stop])

    def scratch(r: int) -> tuple[Tensor, Tensor]:
        return block_buffer(x, r, dtype), block_buffer(x, r, dtype)

    for_each_block((x,), rows, body, scratch)
    centre = shift.clone()
    redo = (~torch.isfinite(sums).all(0)).nonzero().squeeze(-1)
    for index in index_blocks(redo, rows):
        sub = take_rows(x, index).to(dtype)
        top = sub.amax(dim=-1)
        top = torch.where(torch.isfinite(top), top, 0.0)
        centre[index] = top
        y = scaled_into(sub, torch.empty_like(sub), top[:, None], scale)
        e = y.exp()
        s[index] = e.sum(-1)
        sy[index] = torch.where(e > 0, e * y, 0.0).sum(-1)
    sy.div_(s)
    log_s = s.log_()
    return centre, log_s, sy, redo


def row_max_sums(
    x: Tensor, rows: int, dtype: torch.dtype, scale: float, entropy: bool
) -> tuple[Tensor, Tensor, Tensor | None]:
    r"""Per row ``(c, log s, E_p[y])`` with ``c`` the row max: no data-dependent step at all.

    The sync-free form of :func:`entropy_sums` / :func:`~klpen.kernels.blocks.shifted_log_sums`,
    used when value checks are off (no host synchronisation may happen): shifted by the row
    max (``0`` for a row without a finite max), every sum lies in ``[1, V]`` for a valid row,
    so that no row has to be redone; ``0 · log 0`` terms are written as 0 in the block. The
    price is one more read of the logits (the max). Invalid rows (NaN, ``+inf``, only
    ``-inf``) come out non-finite, as from the other forms. ``E_p[y]`` is ``None`` without
    ``entropy``.

    Example:
        >>> c, log_s, mean_y = row_max_sums(torch.tensor([[0.0, 0.0]]), 1, torch.float32, 1.0, True)
        >>> c, log_s - mean_y
        (tensor([0.]), tensor([0.6931]))
    """
    top = x.amax(dim=-1).reshape(-1).to(dtype)
    centre = torch.where(torch.isfinite(top), top, 0.0)
    n = centre.shape[0]
    sums = torch.zeros(2, n, dtype=dtype, device=x.device)
    s, sy = sums.unbind()

    def body(start: int, blocks: tuple[Tensor, ...], bufs: tuple[Tensor, Tensor]) -> None:
        (block,) = blocks
        stop, r = start + block.shape[0], block.shape[0]
        y = scaled_into(block, bufs[0][:r], centre[start:stop, None], scale)
        e = torch.exp(y, out=bufs[1][:r])
        torch.sum(e, dim=-1, out=s[start:stop])
        if entropy:
            torch.sum(y.mul_(e).masked_fill_(e == 0, 0.0), dim=-1, out=sy[start:stop])

    def scratch(r: int) -> tuple[Tensor, Tensor]:
        return block_buffer(x, r, dtype), block_buffer(x, r, dtype)

    for_each_block((x,), rows, body, scratch)
    mean_y = sy.div_(s) if entropy else None
    return centre, s.log_(), mean_y


def logprob_grad(
    logits: Tensor, stats: LogProbRows, upstream: LogProbGrad, rows: int, scale: float = 1.0
) -> Tensor:
    r"""Gradient of ``Σ_i g_i log π(y_i) + h_i H_i`` w.r.t. the logits, block by block.

    For ``π = softmax(k z)`` (``k`` = ``scale``, the inverse temperature), with
    ``u = k (z - c) - log s = log π``:

    .. math:: \frac{\partial}{\partial z_{ij}} = k \big[g_i \mathbb{1}[j = y_i]
        - \pi_{ij} \big(g_i + h_i (u_{ij} + H_i)\big)\big]

    ``logits``: the saved ``(..., V)`` logits (or a rank's slice of them); ``stats``: the
    rows' :class:`LogProbRows`; ``upstream``: :class:`LogProbGrad`; ``rows``: rows per block.
    Returns a new ``(..., V)`` tensor in the logits' dtype.

    Example:
        >>> z = torch.zeros(1, 2)
        >>> stats = LogProbRows(torch.logsumexp(z, -1))
        >>> logprob_grad(z, stats, LogProbGrad(torch.tensor([[0]]), torch.ones(1)), rows=1)
        tensor([[ 0.5000, -0.5000]])
    """
    lse, log_s, mean_y, redo = stats
    index, grad_out, grad_entropy, owned = upstream
    dtype = lse.dtype
    grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
    flat_grad = grad.view(-1, logits.shape[-1])
    n = flat_grad.shape[0]
    # Per-row coefficients: the block's gradient is k g 1[j = y] + a exp(k (z - c)) [u' + b],
    # with u' = k (z - c) in the entropy case and 1 otherwise.
    inv_s = (
        torch.ones(n, dtype=dtype, device=logits.device) if log_s is None else log_s.neg().exp_()
    )
    g = (
        torch.zeros(n, dtype=dtype, device=logits.device)
        if grad_out is None
        else grad_out.reshape(-1).to(dtype)
    )
    a = inv_s.mul_(-scale)
    b = None
    if grad_entropy is not None:
        assert mean_y is not None
        h = grad_entropy.reshape(-1).to(dtype)
        # g + h (u + H) = h k (z - c) + [g - h mean_y]
        b = a * (g - h * mean_y)
        a = a * h
    else:
        a = a * g
    hit = None
    if index is not None:
        hit = g * scale if owned is None else g * scale * owned

    # Half-precision gradients are computed in an fp32 block and rounded once, as autograd
    # through logits.float() would; otherwise each block is computed in place in the result.
    def scratch(r: int) -> tuple[Tensor | None, Tensor | None]:
        buf = None if grad.dtype == dtype else block_buffer(logits, r, dtype)
        return buf, None if b is None else block_buffer(logits, r, dtype)

    # excerpt: block
    def body(
        start: int, blocks: tuple[Tensor, ...], bufs: tuple[Tensor | None, Tensor | None]
    ) -> None:
        (block,), (buf, buf_y) = blocks, bufs
        stop, r = start + block.shape[0], block.shape[0]
        target = flat_grad[start:stop]
        work = target if buf is None else buf[:r]
        grad_block(
            block,
            work,
            None if buf_y is None else buf_y[:r],
            lse[start:stop, None],
            scale,
            a[start:stop, None],
            None if b is None else b[start:stop, None],
        )
        if hit is not None and index is not None:
            work.scatter_add_(-1, index[start:stop], hit[start:stop, None])
        if buf is not None:
            target.copy_(work)
        # end excerpt

    for_each_block((logits,), rows, body, scratch)
    if b is not None and redo is not None:
        # Rows with -inf logits: there exp(...) = 0 meets u = -inf; the term is 0.
        for rows_index in index_blocks(redo, rows):
            sub = take_rows(logits, rows_index).to(dtype)
            work = torch.empty_like(sub)
            grad_block(
                sub,
                work,
                torch.empty_like(sub),
                lse[rows_index, None],
                scale,
                a[rows_index, None],
                b[rows_index, None],
            )
            work.masked_fill_(sub == -math.inf, 0.0)
            if hit is not None and index is not None:
                work.scatter_add_(-1, index[rows_index], hit[rows_index, None])
            flat_grad[rows_index] = work.to(grad.dtype)
    return grad


def grad_block(
    block: Tensor,
    work: Tensor,
    buf_y: Tensor | None,
    centre: Tensor,
    scale: float,
    a: Tensor,
    b: Tensor | None,
) -> None:
    """``a e^{k (z - c)}`` (log-prob only, ``b`` None) or ``e^{k (z - c)} (a k (z - c) + b)``."""
    if b is None or buf_y is None:
        exp_into(block, work, centre, scale).mul_(a)
        return
    y = scaled_into(block, buf_y, centre, scale)
    torch.exp(y, out=work)
    factor = y.mul_(a).add_(b)
    # Where the probability underflows to 0 its term is 0, also when the factor overflows
    # (a logit -inf, or far below the row's centre at a small temperature): not 0 · inf.
    work.mul_(factor.masked_fill_(work == 0, 0.0))
