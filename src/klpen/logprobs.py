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

from ._chunks import (
    block_buffer,
    block_rows_for,
    compute_dtype,
    row_blocks,
    row_logsumexp,
    sub_into,
)
from ._validation import (
    check_coef,
    check_floating,
    check_no_nan,
    check_same_device,
    check_token_ids,
    check_tokens,
)

__all__ = ["calculate_kl_penalty", "get_logprobs_for_tokens"]


class _TokenLogProbs(torch.autograd.Function):
    """``log_softmax(logits)[token]`` per row; saves only the per-row log-sum-exp."""

    @staticmethod
    def forward(ctx: Any, logits: Tensor, tokens: Tensor, rows: int) -> Tensor:
        dtype = compute_dtype(logits.dtype)
        # One gather over the whole (possibly strided) tensor reads N numbers: no copy.
        taken = logits.gather(-1, tokens.unsqueeze(-1)).reshape(-1).to(dtype)
        # Shifted by the token's own logit, the sum counts exp(0) = 1: lse >= the logit, so the
        # log-prob is never positive, and exactly 0 for a token with all the mass, as with the
        # max shift of log_softmax, but with no max pass.
        lse = row_logsumexp(logits, rows, dtype, shift=taken)
        out = taken - lse
        # A +inf logit elsewhere in the row would give a quiet -inf: NaN it, for
        # get_logprobs_for_tokens to report.
        out = torch.where(lse == math.inf, math.nan, out)
        ctx.save_for_backward(logits, tokens, lse)
        ctx.rows = rows
        return out.view(tokens.shape)

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor, None, None]:
        logits, tokens, lse = ctx.saved_tensors
        return _logprob_grad(logits, tokens.reshape(-1, 1), lse, grad_out, ctx.rows), None, None


def _logprob_grad(
    logits: Tensor,
    index: Tensor,
    lse: Tensor,
    grad_out: Tensor,
    rows: int,
    owned: Tensor | None = None,
) -> Tensor:
    r"""Gradient of ``Σ_i g_i log π(y_i)`` w.r.t. the logits, block by block.

    .. math:: \frac{\partial}{\partial z_{ij}} \sum_k g_k \log \pi(y_k)
        = g_i \big(\mathbb{1}[j = y_i] - e^{z_{ij} - \mathrm{lse}_i}\big)

    Args:
        logits: the saved ``(..., V)`` logits (or a rank's slice of them).
        index: ``(N, 1)`` int64 column of each row's token in ``logits``.
        lse: ``(N,)`` log-sum-exp of each whole row (for a slice, the global one), in the
            compute dtype.
        grad_out: the ``(...)`` upstream gradient ``g``.
        rows: rows per block.
        owned: optional ``(N,)`` bool, the rows whose token is in ``logits`` (with a vocabulary
            split across ranks, the indicator lives on one rank only); ``None``: every row.

    Returns:
        A new ``(..., V)`` tensor in the logits' dtype.

    Example:
        >>> z = torch.zeros(1, 2)
        >>> _logprob_grad(z, torch.tensor([[0]]), torch.logsumexp(z, -1), torch.ones(1), rows=1)
        tensor([[ 0.5000, -0.5000]])
    """
    grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
    flat_grad = grad.view(-1, logits.shape[-1])
    g = grad_out.reshape(-1, 1).to(lse.dtype)
    neg_g = -g
    g_hit = g if owned is None else g * owned[:, None]
    # Half-precision gradients are computed in an fp32 block and rounded once, as autograd
    # through logits.float() would; otherwise each block is computed in place in the result.
    buf = None if grad.dtype == lse.dtype else block_buffer(logits, rows, lse.dtype)
    for start, block in row_blocks(logits, rows):
        stop = start + block.shape[0]
        target = flat_grad[start:stop]
        work = target if buf is None else buf[: block.shape[0]]
        sub_into(block, lse[start:stop, None], work).exp_().mul_(neg_g[start:stop])
        work.scatter_add_(-1, index[start:stop], g_hit[start:stop])
        if buf is not None:
            target.copy_(work)
    return grad


def get_logprobs_for_tokens(logits: Tensor, tokens: Tensor) -> Tensor:
    r"""Log-probability of each chosen token under the softmax of its logits.

    .. math:: \log \pi(y_t) = z_{t, y_t} - \log \textstyle\sum_v e^{z_{t, v}}

    Args:
        logits: ``(..., V)`` floating tensor; ``(B, T, V)`` in a language model. Position ``t``
            must already score ``tokens[..., t]`` (apply the next-token shift first, see
            chapter 2). ``-inf`` entries (masked vocabulary) are allowed.
        tokens: ``(...)`` integer token ids in ``[0, V)``, the leading shape of ``logits``.

    Returns:
        ``(...)`` log-probabilities. Half-precision (bf16/fp16) logits are computed in fp32 and
        returned as fp32; fp32 and fp64 keep their dtype. Differentiable w.r.t. ``logits``.

    Memory: never builds a full ``(..., V)`` log-prob tensor. Forward and backward work over
    blocks of rows and keep one fp32 block and one number per row besides the inputs (and, in
    backward, the gradient itself). A token whose logit is ``-inf`` has log-prob ``-inf``.

    Raises:
        TypeError, ValueError: wrong types, shapes, devices, or token ids outside ``[0, V)``;
            NaN or ``+inf`` logits, or a row whose logits are all ``-inf``.

    Example:
        >>> logits = torch.tensor([[[2.0, 0.0, 0.0], [0.0, 0.0, 0.0]]])
        >>> get_logprobs_for_tokens(logits, torch.tensor([[0, 2]]))
        tensor([[-0.2395, -1.0986]])
    """
    check_floating("logits", logits, min_ndim=1)
    check_same_device("tokens", check_token_ids("tokens", tokens), "logits", logits)
    vocab = logits.shape[-1]
    if vocab == 0:
        raise ValueError(
            f"logits must have a non-empty last (vocabulary) axis, got {tuple(logits.shape)}"
        )
    ids = check_tokens("tokens", tokens, logits.shape[:-1], vocab)
    out: Tensor = _TokenLogProbs.apply(logits, ids, block_rows_for(logits))  # type: ignore[no-untyped-call]
    return check_no_nan(
        out,
        "logits contain NaN or +inf, or a row whose logits are all -inf; "
        "got a NaN log-prob in those rows",
    )


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
    return b * (taken_rl - taken_sft)
