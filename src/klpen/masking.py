"""Masking padded positions and aggregating per-token values into one number.

Chapter 4 of the book. Batches of responses have unequal lengths, so every per-token quantity
sits in a ``(B, T)`` tensor with padding. Masked positions must never reach a result: not as a
value, not as a NaN or inf stored there, not through a division by a zero count.
"""

from __future__ import annotations

import operator

import torch
from torch import Tensor

from ._validation import (
    check_choice,
    check_dim,
    check_floating,
    check_mask,
    check_no_nan_at,
    check_same_device,
    check_shape,
    check_token_ids,
    promoted_dtype,
)

__all__ = [
    "AGGREGATION_MODES",
    "aggregate",
    "compute_token_kl",
    "masked_mean",
    "masked_sum",
    "response_mask",
]

Dim = int | tuple[int, ...] | None

AGGREGATION_MODES = ("token-mean", "token-sum", "seq-mean-token-mean", "seq-mean-token-sum")


def _zero_masked(values: Tensor, mask: Tensor) -> Tensor:
    # where(), not values * mask: 0 * NaN and 0 * inf are NaN.
    return torch.where(mask, values, torch.zeros((), dtype=values.dtype, device=values.device))


def _sum(values: Tensor, mask: Tensor, dim: Dim) -> Tensor:
    kept = _zero_masked(values, mask)
    return kept.sum() if dim is None else kept.sum(dim)


def _mean(values: Tensor, mask: Tensor, dim: Dim) -> Tensor:
    count = mask.sum() if dim is None else mask.sum(dim)
    # A row with no valid position has sum 0 and count 0; dividing by max(count, 1) gives 0.
    return _sum(values, mask, dim) / count.clamp(min=1).to(values.dtype)


def _checked(values: Tensor, mask: Tensor) -> Tensor:
    check_floating("values", values)
    m = check_mask("mask", mask, values.shape, same_device_as=("values", values))
    check_no_nan_at("values", values, m)
    return m


def masked_sum(values: Tensor, mask: Tensor, dim: Dim = None) -> Tensor:
    r"""Sum of ``values`` over the positions where ``mask`` is 1.

    .. math::

        \begin{aligned}
        &\sum_i m_i x_i, \\
        &\text{with } m_i x_i := 0 \text{ where } m_i = 0
        \end{aligned}

    Args:
        values: floating tensor of any shape.
        mask: bool, integer or floating 0/1 tensor of the same shape.
        dim: dimension(s) to reduce; ``None`` reduces all.

    Returns:
        The masked sum, in ``values``' dtype. Whatever is stored at masked positions (NaN and
        inf included) never reaches the result or its gradient (exactly 0 there).

    Raises:
        ValueError: NaN at a valid position of ``values``; a mask that is not 0/1 or does not
            have ``values``' shape.

    Example:
        >>> masked_sum(torch.tensor([[1.0, 2.0, float("nan")]]), torch.tensor([[1, 1, 0]]), dim=-1)
        tensor([3.])
    """
    m = _checked(values, mask)
    return _sum(values, m, check_dim("dim", dim, values.dim()))


def masked_mean(values: Tensor, mask: Tensor, dim: Dim = None) -> Tensor:
    r"""Mean of ``values`` over the positions where ``mask`` is 1.

    .. math:: \frac{\sum_i m_i x_i}{\max(1, \sum_i m_i)}

    A row (or a whole tensor) with no valid position has mean 0, not NaN. Masked positions
    reach neither the result nor its gradient; NaN at a valid position raises ``ValueError``.

    Args:
        values: floating tensor of any shape.
        mask: bool, integer or floating 0/1 tensor of the same shape.
        dim: dimension(s) to reduce; ``None`` reduces all.

    Returns:
        The masked mean, in ``values``' dtype, with the dimensions ``dim`` reduced (a 0-d
        tensor for ``dim=None``); differentiable w.r.t. ``values``.

    Example:
        >>> values = torch.tensor([[1.0, 3.0, 100.0], [5.0, 0.0, 0.0]])
        >>> masked_mean(values, torch.tensor([[1, 1, 0], [0, 0, 0]]), dim=-1)
        tensor([2., 0.])
    """
    m = _checked(values, mask)
    return _mean(values, m, check_dim("dim", dim, values.dim()))


def aggregate(values: Tensor, mask: Tensor, mode: str) -> Tensor:
    r"""Reduce ``(B, T)`` per-token values to one scalar, in one of four conventions.

    =========================  ============================================================
    mode                       value
    =========================  ============================================================
    ``"token-mean"``           :math:`\sum_{b,t} m x / \sum_{b,t} m`: every token weighs the same
    ``"token-sum"``            :math:`\sum_{b,t} m x`
    ``"seq-mean-token-mean"``  mean over rows of each row's token mean: every row weighs the same
    ``"seq-mean-token-sum"``   mean over rows of each row's token sum
    =========================  ============================================================

    Rows with no valid token are left out of the ``seq-mean`` modes; with no valid token at
    all every mode returns 0.

    Args:
        values: ``(B, T)`` floating tensor.
        mask: ``(B, T)`` bool, integer or floating 0/1 tensor.
        mode: one of the four names above.

    Returns:
        A 0-d tensor in ``values``' dtype, differentiable w.r.t. ``values``.

    Example:
        >>> values = torch.tensor([[1.0, 1.0, 1.0], [4.0, 0.0, 0.0]])
        >>> mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
        >>> [round(aggregate(values, mask, m).item(), 3) for m in AGGREGATION_MODES]
        [1.75, 7.0, 2.5, 3.5]
    """
    m = _checked(values, mask)
    if values.dim() != 2:
        raise ValueError(f"values must have shape (B, T), got {tuple(values.shape)}")
    name = check_choice("mode", mode, AGGREGATION_MODES)
    # excerpt: modes
    if name == "token-mean":
        return _mean(values, m, None)
    if name == "token-sum":
        return _sum(values, m, None)
    per_row = _mean(values, m, -1) if name == "seq-mean-token-mean" else _sum(values, m, -1)
    return _mean(per_row, m.any(-1), None)
    # end excerpt


def compute_token_kl(
    policy_logprobs: Tensor, reference_logprobs: Tensor, attention_mask: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    r"""Per-token log-ratio and its per-sequence sum over valid tokens.

    .. math::
        \begin{aligned}
        \mathrm{kl}_{b,t} &= m_{b,t}\,\big(\log\pi(y_{b,t}) \\
        &\qquad - \log\pi_\mathrm{ref}(y_{b,t})\big), \\
        \mathrm{KL}_b &= \sum_t \mathrm{kl}_{b,t}
        \end{aligned}

    Args:
        policy_logprobs: ``(B, T)`` log π of the sampled tokens.
        reference_logprobs: ``(B, T)`` log π_ref of the same tokens.
        attention_mask: optional ``(B, T)`` 0/1 mask (bool, integer or floating); ``None``
            counts every position.

    Returns:
        ``(per_token_kl, sequence_kl)``: ``(B, T)``, zero where the mask is 0, and ``(B,)``,
        in the promoted dtype of the inputs (half precision computed in fp32). Masked
        positions (whatever they hold) reach neither result nor gradient; NaN at a valid
        position raises ``ValueError``.

    Example:
        >>> lp = torch.tensor([[-1.0, -2.0, -9.0]])
        >>> lr = torch.tensor([[-1.5, -1.0, -1.0]])
        >>> per_token, per_seq = compute_token_kl(lp, lr, torch.tensor([[1, 1, 0]]))
        >>> per_token, per_seq
        (tensor([[ 0.5000, -1.0000,  0.0000]]), tensor([-0.5000]))
    """
    check_floating("policy_logprobs", policy_logprobs)
    check_floating("reference_logprobs", reference_logprobs)
    if policy_logprobs.dim() != 2:
        raise ValueError(
            f"policy_logprobs must have shape (B, T), got {tuple(policy_logprobs.shape)}"
        )
    check_shape(
        "reference_logprobs", reference_logprobs, policy_logprobs.shape, "policy_logprobs' shape"
    )
    check_same_device("reference_logprobs", reference_logprobs, "policy_logprobs", policy_logprobs)
    m = None
    if attention_mask is not None:
        m = check_mask(
            "attention_mask",
            attention_mask,
            policy_logprobs.shape,
            same_device_as=("policy_logprobs", policy_logprobs),
        )
    check_no_nan_at("policy_logprobs", policy_logprobs, m)
    check_no_nan_at("reference_logprobs", reference_logprobs, m)
    dtype = promoted_dtype(policy_logprobs, reference_logprobs)
    p, q = policy_logprobs.to(dtype), reference_logprobs.to(dtype)
    if m is None:
        log_ratio = p - q
        return log_ratio, log_ratio.sum(-1)
    # excerpt: masked
    # where() before the subtraction: a masked -inf - (-inf) must not become a NaN gradient.
    zero = torch.zeros((), dtype=dtype, device=p.device)
    per_token = _zero_masked(torch.where(m, p, zero) - torch.where(m, q, zero), m)
    return per_token, per_token.sum(-1)
    # end excerpt


def response_mask(tokens: Tensor, eos_token_id: int, *, include_eos: bool = True) -> Tensor:
    r"""Mask of each row's tokens up to its first EOS: what a trainer must count and score.

    .. math::
        \begin{aligned}
        m_{b,t} &= \big[\,\#\{s < t : y_{b,s} = \mathrm{eos}\} = 0\,\big] \\
        &\quad (\text{with } s \le t \text{ if} \\
        &\quad \ \texttt{include\_eos=False})
        \end{aligned}

    Everything after the first EOS (the padding a generator appends, any later EOS) is
    masked out; a row without EOS (truncated at the length limit) is all ones. The EOS token
    itself is kept by default: its log-prob is part of the response and the score is placed
    on it by :func:`~klpen.shape_rewards`, not on a PAD token. Left padding (of prompts) is not
    this function's concern: combine with the attention mask if the response is left-padded.

    Args:
        tokens: ``(..., T)`` integer token ids of the responses (``T`` last).
        eos_token_id: the end-of-sequence id, a non-negative Python int.
        include_eos: keep the first EOS itself (default) or stop before it.

    Returns:
        A ``torch.bool`` tensor of ``tokens``' shape.

    Example:
        >>> tokens = torch.tensor([[5, 7, 2, 0, 0], [5, 7, 8, 9, 6], [2, 2, 0, 0, 0]])
        >>> response_mask(tokens, eos_token_id=2).int()
        tensor([[1, 1, 1, 0, 0],
                [1, 1, 1, 1, 1],
                [1, 0, 0, 0, 0]], dtype=torch.int32)
    """
    ids = check_token_ids("tokens", tokens)
    if ids.dim() < 1:
        raise ValueError("tokens must have at least 1 dimension (..., T), got shape ()")
    if isinstance(eos_token_id, bool | Tensor):
        raise TypeError(f"eos_token_id must be a Python int, got {eos_token_id!r}")
    try:
        eos = operator.index(eos_token_id)
    except TypeError:
        raise TypeError(
            f"eos_token_id must be a Python int, got {type(eos_token_id).__name__} {eos_token_id!r}"
        ) from None
    if not 0 <= eos <= torch.iinfo(torch.int64).max:
        raise ValueError(f"eos_token_id must be a non-negative int64 token id, got {eos}")
    if not isinstance(include_eos, bool):
        raise TypeError(f"include_eos must be True or False, got {include_eos!r}")
    is_eos = ids == eos
    seen = is_eos.cumsum(-1)  # EOS count up to and including t
    before = seen - is_eos.long() if include_eos else seen
    return before == 0
