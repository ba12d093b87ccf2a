"""Log-probabilities of chosen tokens, extracted from logits without a full log-softmax copy.

Chapter 2 of the book. The naive ``log_softmax(logits).gather(-1, tokens)`` builds a second
``(B, T, V)`` tensor only to read one entry per row. Here each row needs two numbers, its
log-sum-exp and the logit of its token, so the rows are processed in cache-sized blocks, and the
backward pass recomputes the softmax per block from the saved logits and per-row log-sum-exp.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from ._autograd import guard_second_derivative
from ._chunks import (
    block_buffer,
    block_rows_for,
    compute_dtype,
    exp_in_unit,
    exp_into,
    exp_unit,
    for_each_block,
    index_blocks,
    scaled_into,
    shifted_log_sums,
    take_rows,
)
from ._validation import (
    check_coef,
    check_floating,
    check_no_nan,
    check_no_nan_at,
    check_same_device,
    check_temperature,
    check_token_ids,
    check_tokens,
)
from .packing import next_token_rows

__all__ = ["calculate_kl_penalty", "get_logprobs_for_tokens", "next_token_logprobs"]


def _entropy_sums(
    x: Tensor, rows: int, dtype: torch.dtype, shift: Tensor, scale: float
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    r"""Per row ``(c, log s, E_p[y], redo)`` of the logits ``x``, in one pass over them.

    With ``y = k (x - c)`` and ``s = Σ_v e^{y_v}``, ``log p_v = y_v - log s`` and the entropy
    of ``p = softmax(k x)`` is ``H = log s - E_p[y]``. ``c`` is ``shift`` (an entry of each
    row), or the row max where the sums are not finite (extreme or ``-inf`` logits: those rows,
    returned as ``redo``, are redone with ``0 · log 0 = 0``). One ``exp`` and two reductions per
    element (two sums and a product), as :func:`~klpen._chunks.shifted_log_sums` plus one dot.
    """
    n = x.numel() // x.shape[-1]
    sums = torch.empty(2, n, dtype=dtype, device=x.device)
    s, sy = sums.unbind()

    # y in the exponential's unit (log2 e for fp32 on the CPU: see exp_), E_p[y] divided back.
    unit = exp_unit(sums)

    def body(start: int, blocks: tuple[Tensor, ...], bufs: tuple[Tensor, Tensor]) -> None:
        (block,) = blocks
        stop, r = start + block.shape[0], block.shape[0]
        y = scaled_into(block, bufs[0][:r], shift[start:stop, None], scale * unit)
        e = exp_in_unit(y, bufs[1][:r])
        torch.sum(e, dim=-1, out=s[start:stop])
        torch.sum(y.mul_(e), dim=-1, out=sy[start:stop])

    def scratch(r: int) -> tuple[Tensor, Tensor]:
        return block_buffer(x, r, dtype), block_buffer(x, r, dtype)

    for_each_block((x,), rows, body, scratch)
    sy.div_(unit)
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
    return centre, s.log_(), sy, redo


class _TokenLogProbs(torch.autograd.Function):
    """Per row, ``log softmax(k z)[token]`` and/or the entropy of ``softmax(k z)``, in one read.

    ``k`` is the inverse temperature. Saves the logits and two or three numbers per row.
    """

    @staticmethod
    def forward(
        ctx: Any,
        logits: Tensor,
        tokens: Tensor | None,
        rows: int,
        scale: float,
        entropy: bool,
        name: str,
    ) -> tuple[Tensor, Tensor]:
        dtype = compute_dtype(logits.dtype)
        shape = logits.shape[:-1]
        # excerpt: forward
        # The sums are shifted by an entry of each row: the token's logit (one gather over the
        # whole, possibly strided, tensor reads N numbers), or the row max for the entropy
        # alone (then H = log s - E_p[y] adds two non-negative numbers, without cancellation).
        # The sum counts exp(0) = 1: it cannot underflow, and log s >= 0.
        if tokens is None:
            shift = logits.amax(dim=-1).reshape(-1).to(dtype)
        else:
            shift = logits.gather(-1, tokens.unsqueeze(-1)).reshape(-1).to(dtype)
        # end excerpt
        redo = mean_y = None
        if entropy:
            centre, log_s, mean_y, redo = _entropy_sums(logits, rows, dtype, shift, scale)
            ent = (log_s - mean_y).view(shape)
        else:
            centre, log_s = shifted_log_sums(logits, rows, dtype, shift, scale)
            ent = torch.empty(0, dtype=dtype, device=logits.device)
        logp = torch.empty(0, dtype=dtype, device=logits.device)
        # excerpt: forward
        if tokens is not None:
            # -log s where the token's logit is the shift: no large number is subtracted, so
            # a common offset of the logits costs no digits (log_softmax's accuracy).
            logp = (shift - centre).mul_(scale).sub_(log_s)
            # A +inf logit elsewhere in the row gives log s = inf, a quiet -inf: NaN it, for
            # the public function to report.
            logp = torch.where(log_s == math.inf, math.nan, logp).view(shape)
        # end excerpt
        ctx.save_for_backward(logits, tokens, centre, log_s, mean_y, redo)
        ctx.rows, ctx.scale, ctx.name = rows, scale, name
        ctx.set_materialize_grads(False)
        # An output not asked for is an empty placeholder.
        ctx.mark_non_differentiable(
            *([ent] if mean_y is None else []), *([logp] if tokens is None else [])
        )
        return logp, ent

    @staticmethod
    def backward(
        ctx: Any, grad_logp: Tensor | None, grad_ent: Tensor | None
    ) -> tuple[Tensor | None, None, None, None, None, None]:
        logits, tokens, centre, log_s, mean_y, redo = ctx.saved_tensors
        if grad_logp is None and grad_ent is None:
            return None, None, None, None, None, None
        with torch.no_grad():
            index = None if tokens is None or grad_logp is None else tokens.reshape(-1, 1)
            grad = _logprob_grad(
                logits,
                index,
                centre,
                grad_logp,
                ctx.rows,
                log_s=log_s,
                scale=ctx.scale,
                grad_entropy=grad_ent,
                mean_y=mean_y,
                redo=redo,
            )
        anchors = tuple(t for t in (logits, grad_logp, grad_ent) if t is not None)
        (guarded,) = guard_second_derivative(ctx.name, (grad,), anchors)
        return guarded, None, None, None, None, None


def _logprob_grad(
    logits: Tensor,
    index: Tensor | None,
    lse: Tensor,
    grad_out: Tensor | None,
    rows: int,
    owned: Tensor | None = None,
    *,
    log_s: Tensor | None = None,
    scale: float = 1.0,
    grad_entropy: Tensor | None = None,
    mean_y: Tensor | None = None,
    redo: Tensor | None = None,
) -> Tensor:
    r"""Gradient of ``Σ_i g_i log π(y_i) + h_i H_i`` w.r.t. the logits, block by block.

    For ``π = softmax(k z)`` (``k`` = ``scale``, the inverse temperature), with
    ``u = k (z - c) - log s = log π``:

    .. math:: \frac{\partial}{\partial z_{ij}} = k \big[g_i \mathbb{1}[j = y_i]
        - \pi_{ij} \big(g_i + h_i (u_{ij} + H_i)\big)\big]

    Args:
        logits: the saved ``(..., V)`` logits (or a rank's slice of them).
        index: ``(N, 1)`` int64 column of each row's token in ``logits`` (``None``: no
            log-prob term).
        lse: ``(N,)`` per-row shift ``c`` in the compute dtype: the whole row's log-sum-exp
            when ``log_s`` is ``None`` (for a slice, the global one), else an entry of the row
            (see :func:`~klpen._chunks.shifted_log_sums`), the log-sum-exp being
            ``k c + log s``: a large common offset then costs no digits.
        grad_out: the ``(...)`` upstream gradient ``g`` of the log-probs, or ``None``.
        rows: rows per block.
        owned: optional ``(N,)`` bool, the rows whose token is in ``logits`` (with a vocabulary
            split across ranks, the indicator lives on one rank only); ``None``: every row.
        grad_entropy: the upstream gradient ``h`` of the entropies, with ``mean_y`` (``(N,)``,
            ``E_π[k (z - c)]``, so that ``H = log s - mean_y``) and ``redo`` (rows with
            ``-inf`` logits, where ``0 · log 0 = 0`` must be applied).

    Returns:
        A new ``(..., V)`` tensor in the logits' dtype.

    Example:
        >>> z = torch.zeros(1, 2)
        >>> _logprob_grad(z, torch.tensor([[0]]), torch.logsumexp(z, -1), torch.ones(1), rows=1)
        tensor([[ 0.5000, -0.5000]])
    """
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
        _grad_block(
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
            _grad_block(
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


def _grad_block(
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
    # y in the exponential's unit (see exp_unit): a / unit turns it back into k (z - c).
    unit = exp_unit(work)
    y = scaled_into(block, buf_y, centre, scale * unit)
    exp_in_unit(y, work)
    work.mul_(y.mul_(a / unit if unit != 1.0 else a).add_(b))


def _logprobs(
    logits: Tensor,
    tokens: Tensor | None,
    temperature: object,
    entropy: bool,
    name: str,
    tokens_name: str = "tokens",
    keep: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """The validated entry to :class:`_TokenLogProbs` for the public function ``name``.

    Returns ``(log-probs, entropies)``; an output not asked for is an empty placeholder.
    ``keep`` (bool, the log-probs' shape): the rows checked for NaN (``None``: all).
    """
    logits_name = "logits"
    check_floating(logits_name, logits, min_ndim=1)
    t = check_temperature("temperature", temperature)
    vocab = logits.shape[-1]
    if vocab == 0:
        raise ValueError(
            f"{logits_name} must have a non-empty last (vocabulary) axis, got {tuple(logits.shape)}"
        )
    ids = None
    if tokens is not None:
        check_same_device(tokens_name, check_token_ids(tokens_name, tokens), logits_name, logits)
        ids = check_tokens(tokens_name, tokens, logits.shape[:-1], vocab)
    logp: Tensor
    ent: Tensor
    rows = block_rows_for(logits)
    logp, ent = _TokenLogProbs.apply(logits, ids, rows, 1.0 / t, entropy, name)  # type: ignore[no-untyped-call]
    for result in (logp, ent):
        check_no_nan(
            result if keep is None or result.shape != keep.shape else result.masked_fill(~keep, 0),
            f"{logits_name} contain NaN or +inf, or a row whose logits are all -inf; "
            "got a NaN log-prob or entropy in those rows",
        )
    return logp, ent


def get_logprobs_for_tokens(logits: Tensor, tokens: Tensor, *, temperature: float = 1.0) -> Tensor:
    r"""Log-probability of each chosen token under the softmax of its logits.

    .. math::

        \begin{aligned}
        \log \pi(y_t) &= z_{t, y_t} / T \\
        &\quad - \log \textstyle\sum_v e^{z_{t, v} / T}
        \end{aligned}

    Args:
        logits: ``(..., V)`` floating tensor; ``(B, T, V)`` in a language model. Position ``t``
            must already score ``tokens[..., t]`` (apply the next-token shift first, see
            chapter 2, or call :func:`next_token_logprobs`). ``-inf`` entries (masked
            vocabulary) are allowed.
        tokens: ``(...)`` integer token ids in ``[0, V)``, the leading shape of ``logits``.
        temperature: the sampling temperature ``T`` (finite, > 0): the distribution is
            ``softmax(logits / T)``. ``1/T`` is folded into the per-block arithmetic: the
            logits are not copied.

    Returns:
        ``(...)`` log-probabilities. Half-precision (bf16/fp16) logits are computed in fp32 and
        returned as fp32; fp32 and fp64 keep their dtype. Differentiable w.r.t. ``logits``
        (once: a second derivative raises a ``RuntimeError`` saying so).

    Memory: never builds a full ``(..., V)`` log-prob tensor. Forward and backward work over
    blocks of rows and keep one fp32 block per thread and two numbers per row besides the
    inputs (and, in backward, the gradient itself). A token whose logit is ``-inf`` has
    log-prob ``-inf``.
    Threads: on the CPU with ``torch.get_num_threads() = n > 1``, ``n`` workers each take whole
    blocks and compute them single-threaded (no barrier per op, which a busy machine makes
    slow); ``torch.set_num_threads(1)`` is in force while they run and is restored after,
    also on error. The result is bitwise the one-thread result.
    Accuracy: the log-prob is ``-log s`` with ``s`` the sum of ``exp((z - z_y) / T)``, so a
    common offset of the logits (``1e4``, say) costs no digits, as with ``log_softmax``.

    Raises:
        TypeError, ValueError: wrong types, shapes, devices, token ids outside ``[0, V)``, a
            temperature that is not finite and positive; NaN or ``+inf`` logits, or a row
            whose logits are all ``-inf``.

    Example:
        >>> logits = torch.tensor([[[2.0, 0.0, 0.0], [0.0, 0.0, 0.0]]])
        >>> get_logprobs_for_tokens(logits, torch.tensor([[0, 2]]))
        tensor([[-0.2395, -1.0986]])
        >>> get_logprobs_for_tokens(logits, torch.tensor([[0, 2]]), temperature=2.0)
        tensor([[-0.5514, -1.0986]])
    """
    return _logprobs(logits, tokens, temperature, False, "get_logprobs_for_tokens")[0]


def next_token_logprobs(
    logits: Tensor,
    input_ids: Tensor,
    *,
    position_ids: Tensor | None = None,
    cu_seqlens: Tensor | None = None,
    temperature: float = 1.0,
) -> Tensor:
    r"""Log-probs of ``input_ids[..., 1:]`` under ``logits[..., :-1, :]``: the shift done right.

    A causal language model's logits at position ``t`` score the token at ``t + 1``.

    .. math::

        \begin{aligned}
        &\log \pi(x_{t+1} \mid x_{\le t}) \\
        &\quad = \big[\log\operatorname{softmax}(z_t / T)\big]_{x_{t+1}}, \\
        &t = 0, \dots, T_\text{seq} - 2
        \end{aligned}

    Args:
        logits: ``(..., T, V)`` floating logits of a causal LM for the sequences ``input_ids``.
        input_ids: ``(..., T)`` integer token ids in ``[0, V)``, the leading shape of
            ``logits``.
        position_ids: packed batches (see :func:`~klpen.sequence_ids`): ``(1, total)``
            positions restarting at 0 at each sequence.
        cu_seqlens: packed batches: ``(S + 1,)`` cumulative sequence lengths.
        temperature: finite, > 0, as in :func:`get_logprobs_for_tokens`.

    Packed (``position_ids`` or ``cu_seqlens``, with ``(1, total, V)`` logits): an entry whose
    next token starts a new sequence is no next-token log-prob; it is 0 and takes no gradient,
    and whatever the logits hold at those positions (NaN, ``±inf``) reaches neither.

    Returns:
        ``(..., T - 1)`` log-probabilities (fp32 for half-precision logits). Both shifted
        operands are views: nothing of size ``(..., V)`` is copied. Differentiable w.r.t.
        ``logits`` (the last position gets a zero gradient).

    Raises:
        TypeError, ValueError: as :func:`get_logprobs_for_tokens`, naming ``logits`` and
            ``input_ids``; logits with fewer than 2 dimensions.

    Example:
        >>> logits = torch.tensor([[[0.0, 0.0], [2.0, 0.0], [9.0, 9.0]]])
        >>> next_token_logprobs(logits, torch.tensor([[1, 0, 1]]))
        tensor([[-0.6931, -2.1269]])
        >>> packed = torch.zeros(1, 4, 2)  # two sequences of two tokens, one row
        >>> next_token_logprobs(packed, torch.tensor([[0, 1, 0, 1]]),
        ...                     position_ids=torch.tensor([[0, 1, 0, 1]]))
        tensor([[-0.6931,  0.0000, -0.6931]])
    """
    check_floating("logits", logits, min_ndim=2)
    ids = check_token_ids("input_ids", input_ids)
    if tuple(ids.shape) != tuple(logits.shape[:-1]):
        raise ValueError(
            f"input_ids must have shape {tuple(logits.shape[:-1])} (the leading shape of "
            f"logits), got {tuple(ids.shape)}"
        )
    shifted, keep = logits[..., :-1, :], None
    if position_ids is not None or cu_seqlens is not None:
        shifted, keep = next_token_rows(shifted, ids, position_ids, cu_seqlens)
    logp = _logprobs(
        shifted,
        ids[..., 1:],
        temperature,
        False,
        "next_token_logprobs",
        tokens_name="input_ids",
        keep=keep,
    )[0]
    return logp if keep is None else logp.masked_fill(~keep, 0.0)


def calculate_kl_penalty(
    log_probs_rl: Tensor, log_probs_sft: Tensor, actions: Tensor, beta: float
) -> Tensor:
    r"""Per-token sampled KL penalty ``beta * (log π_rl(a) - log π_sft(a))`` (the k1 estimate).

    Args:
        log_probs_rl: ``(B, T, V)`` log-probabilities of the policy being trained.
        log_probs_sft: ``(B, T, V)`` log-probabilities of the frozen reference (SFT) model.
            No gradient ever reaches it: it is detached.
        actions: ``(B, T)`` integer ids of the tokens taken, in ``[0, V)``.
        beta: finite, non-negative penalty coefficient.

    Returns:
        ``(B, T)`` tensor in the promoted dtype of the two inputs; differentiable w.r.t.
        ``log_probs_rl``.

    Example:
        >>> rl = torch.log(torch.tensor([[[0.5, 0.25, 0.25]]]))
        >>> sft = torch.log(torch.tensor([[[0.25, 0.5, 0.25]]]))
        >>> calculate_kl_penalty(rl, sft, torch.tensor([[0]]), beta=0.1)
        tensor([[0.0693]])
    """
    check_floating("log_probs_rl", log_probs_rl, min_ndim=3)
    check_floating("log_probs_sft", log_probs_sft, min_ndim=3)
    if log_probs_rl.dim() != 3:
        raise ValueError(f"log_probs_rl must have shape (B, T, V), got {tuple(log_probs_rl.shape)}")
    if log_probs_sft.shape != log_probs_rl.shape:
        raise ValueError(
            f"log_probs_sft must have the shape of log_probs_rl {tuple(log_probs_rl.shape)}, "
            f"got {tuple(log_probs_sft.shape)}"
        )
    check_same_device("log_probs_sft", log_probs_sft, "log_probs_rl", log_probs_rl)
    check_same_device("actions", check_token_ids("actions", actions), "log_probs_rl", log_probs_rl)
    ids = check_tokens("actions", actions, log_probs_rl.shape[:-1], log_probs_rl.shape[-1])
    b = check_coef("beta", beta)
    index = ids.unsqueeze(-1)
    taken_rl = log_probs_rl.gather(-1, index).squeeze(-1)
    taken_sft = log_probs_sft.detach().gather(-1, index).squeeze(-1)
    # Only the taken entries reach the result: a NaN there would come back silently.
    check_no_nan_at("log_probs_rl", taken_rl)
    check_no_nan_at("log_probs_sft", taken_sft)
    return b * (taken_rl - taken_sft)
