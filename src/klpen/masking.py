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
    check_all,
    check_choice,
    check_dim,
    check_floating,
    check_mask,
    check_no_nan_at,
    check_positive,
    check_same_device,
    check_shape,
    check_token_ids,
    promoted_dtype,
)
from .packing import check_num_sequences, check_sequence_ids, packed_layout, per_sequence

__all__ = [
    "AGGREGATION_ALIASES",
    "AGGREGATION_MODES",
    "aggregate",
    "compute_token_kl",
    "masked_mean",
    "masked_sum",
    "response_mask",
]

Dim = int | tuple[int, ...] | None

AGGREGATION_MODES = ("token-mean", "token-sum", "seq-mean-token-mean", "seq-mean-token-sum")

#: the peers' names accepted by :func:`aggregate`, and the klpen mode each corresponds to
#: (exactly for ``bnpo``/``dapo``; see :func:`aggregate` for the others' formulas)
AGGREGATION_ALIASES = {
    "bnpo": "token-mean",
    "dapo": "token-mean",
    "grpo": "seq-mean-token-mean",
    "dr_grpo": "seq-mean-token-sum",
    "seq-mean-token-sum-norm": "token-sum",
}
#: the aliases divided by a constant length
_NORMALISED = ("dr_grpo", "seq-mean-token-sum-norm")


def _zero_masked(values: Tensor, mask: Tensor) -> Tensor:
    # where(), not values * mask: 0 * NaN and 0 * inf are NaN.
    return torch.where(mask, values, torch.zeros((), dtype=values.dtype, device=values.device))


def _sum(values: Tensor, mask: Tensor, dim: Dim) -> Tensor:
    # Accumulated in fp32 at least (fp16 overflows at 65504), returned in values' dtype.
    kept, acc = _zero_masked(values, mask), promoted_dtype(values)
    total = kept.sum(dtype=acc) if dim is None else kept.sum(dim, dtype=acc)
    return total.to(values.dtype)


def _mean(values: Tensor, mask: Tensor, dim: Dim) -> Tensor:
    kept, acc = _zero_masked(values, mask), promoted_dtype(values)
    total = kept.sum(dtype=acc) if dim is None else kept.sum(dim, dtype=acc)
    count = mask.sum(dtype=acc) if dim is None else mask.sum(dim, dtype=acc)
    # A row with no valid position has sum 0 and count 0; dividing by max(count, 1) gives 0.
    return (total / count.clamp(min=1)).to(values.dtype)


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


def _max_length(name: str, max_length: object, values: Tensor, packed: bool) -> float | None:
    """The constant divisor of ``dr_grpo`` and ``seq-mean-token-sum-norm``; refused elsewhere."""
    if name not in _NORMALISED:
        if max_length is not None:
            raise ValueError(
                f"max_length is used only by the modes {list(_NORMALISED)}, got "
                f"max_length={max_length!r} with mode {name!r}"
            )
        return None
    if max_length is None:
        if name == "dr_grpo" or packed:
            why = "packed rows have no padded length" if packed else "TRL's max_completion_length"
            raise ValueError(f"mode {name!r} needs max_length= ({why}), got None")
        return float(values.shape[-1])  # verl's default: the padded response length
    length = check_positive("max_length", max_length)
    if isinstance(max_length, bool) or length != int(length):
        raise TypeError(f"max_length must be a whole number of tokens, got {max_length!r}")
    if not packed and length < values.shape[-1]:
        raise ValueError(
            f"max_length must be at least the padded length {values.shape[-1]} of values "
            f"(no row can be longer than the longest allowed response), got {max_length!r}"
        )
    return length


def aggregate(
    values: Tensor,
    mask: Tensor,
    mode: str,
    *,
    sequence_ids: Tensor | None = None,
    max_length: float | None = None,
    num_sequences: int | None = None,
) -> Tensor:
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

    **Packed rows** (``sequence_ids``, e.g. from :func:`~klpen.sequence_ids`): the ``seq-mean``
    modes average over the sequences, not the rows: a sequence is a run of equal ids within a
    row, and the result equals the same mode on the sequences padded into a batch. The ids are
    the sequences' indices (as :func:`~klpen.sequence_ids` gives them), so ``"grpo"`` and
    ``"dr_grpo"``, which count the sequences without a valid token, count as many as the padded
    batch has rows: an index that no position holds (a zero-length sequence of ``cu_seqlens``)
    is such a sequence; sequences after the last position leave no id, and ``num_sequences``
    counts them.

    **Peers' names** (aliases; each reproduces the peer's formula exactly, here with
    :math:`n_s` the valid tokens of sequence :math:`s`, :math:`N` the number of sequences
    *including* those without a valid token, and :math:`L` = ``max_length``):

    - ``"bnpo"``, ``"dapo"`` (TRL): :math:`\sum m x / \max(1, \sum m)`, klpen's ``"token-mean"``;
    - ``"grpo"`` (TRL): :math:`\frac1N \sum_s \sum_t m x / \max(1, n_s)`, klpen's
      ``"seq-mean-token-mean"`` but with the sequences without a valid token counted (as 0);
    - ``"dr_grpo"`` (TRL): :math:`\sum m x / (N L)`, klpen's ``"seq-mean-token-sum"`` over
      all :math:`N` sequences, divided by :math:`L`;
    - ``"seq-mean-token-sum-norm"`` (verl): :math:`\sum m x / L`, klpen's ``"token-sum"``
      divided by :math:`L` (default ``T = values.shape[-1]``, verl's default).

    TRL 1.16, ``trl/trainer/grpo_trainer.py``, ``GRPOTrainer._compute_loss`` (``loss_type``):
    ``grpo`` is ``((l * m).sum(-1) / m.sum(-1).clamp(min=1)).mean()`` (its mean counts rows
    without a valid token, as 0: where klpen's ``seq-mean-token-mean`` leaves them out),
    ``bnpo`` ``(l * m).sum() / m.sum().clamp(min=1)``, ``dr_grpo`` ``(l * m).sum() /
    (l.size(0) * max_completion_length)``, ``dapo`` ``(l * m).sum() / num_items_in_batch``
    (the token count of the whole generation batch, over every process: a single-process
    ``token-mean`` here, ``klpen.distributed.aggregate``'s ``token-mean`` across ranks). TRL
    also divides by the gradient-accumulation steps, which is the trainer's business. verl
    (``volcengine/verl`` at commit ``b178a3cd56f58b2d502255daba591e92833930a7``,
    ``verl/trainer/ppo/core_algos.py``, ``agg_loss``): ``seq-mean-token-sum-norm`` is
    ``torch.sum(seq_losses) / loss_scale_factor``, ``loss_scale_factor`` defaulting to
    ``loss_mask.shape[-1]``; verl's other three modes are klpen's (``dp_size``,
    ``batch_num_tokens`` and ``global_batch_size`` make them global, as
    ``klpen.distributed.aggregate`` does). An empty batch gives 0 in every mode, where the peers
    divide 0 by 0.

    Args:
        values: ``(B, T)`` floating tensor (``(1, total)`` when packed).
        mask: ``(B, T)`` bool, integer or floating 0/1 tensor.
        mode: one of the four modes or the five aliases above.
        sequence_ids: optional ``(B, T)`` integer ids, non-decreasing along each row (a value
            check); ``None``: each row is one sequence.
        max_length: ``L``, a whole number of tokens (at least ``T`` unless packed), for
            ``"dr_grpo"`` (required) and ``"seq-mean-token-sum-norm"`` (default ``T``; required
            when packed); refused with any other mode.
        num_sequences: with ``sequence_ids`` only: the number of sequences packed
            (``len(cu_seqlens) - 1``), when the last ones may be empty (``None``: each row's last
            id + 1, summed over rows; a value check requires at least that). Counted by
            ``"grpo"`` and ``"dr_grpo"`` only; klpen's modes leave empty sequences out.

    Returns:
        A 0-d tensor in ``values``' dtype (sums and counts accumulated in at least fp32, so
        fp16 values of 6e4 do not overflow on the way), differentiable w.r.t. ``values``.
        Whatever ``values`` holds at a masked position reaches neither value nor gradient.

    Raises:
        TypeError, ValueError: wrong types, shapes or devices, a mask that is not 0/1, NaN at
            a valid position, an unknown mode, ``sequence_ids`` that are not integers of
            ``values``' shape or decrease along a row, a missing or misplaced ``max_length``.
            With validation off the value checks (NaN, mask and id values) are skipped and the
            packed path makes no host synchronisation.

    Example:
        >>> values = torch.tensor([[1.0, 1.0, 1.0], [4.0, 0.0, 0.0]])
        >>> mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
        >>> [round(aggregate(values, mask, m).item(), 3) for m in AGGREGATION_MODES]
        [1.75, 7.0, 2.5, 3.5]
        >>> packed = torch.tensor([[1.0, 1.0, 1.0, 4.0]])  # the same two sequences, packed
        >>> ids = torch.tensor([[0, 0, 0, 1]])
        >>> aggregate(packed, torch.ones(1, 4), "seq-mean-token-mean", sequence_ids=ids)
        tensor(2.5000)
        >>> aggregate(values, mask, "dr_grpo", max_length=4)  # 7 / (2 * 4)
        tensor(0.8750)
    """
    m = _checked(values, mask)
    if values.dim() != 2:
        raise ValueError(f"values must have shape (B, T), got {tuple(values.shape)}")
    name = check_choice("mode", mode, (*AGGREGATION_MODES, *AGGREGATION_ALIASES))
    ids = None
    if sequence_ids is not None:
        ids = check_sequence_ids("sequence_ids", sequence_ids, values)
    sequences = check_num_sequences(num_sequences, ids)
    length = _max_length(name, max_length, values, ids is not None)
    name = AGGREGATION_ALIASES.get(name, name) if name in ("bnpo", "dapo") else name
    acc = promoted_dtype(values)
    # excerpt: modes
    kept = _zero_masked(values, m)
    if name in ("token-mean", "token-sum", "seq-mean-token-sum-norm"):
        total = kept.sum(dtype=acc)
        if name == "token-mean":
            total = total / m.sum(dtype=acc).clamp(min=1)
    else:
        seqs = per_sequence(kept, m, ids, acc, sequences)
        if name in ("seq-mean-token-mean", "grpo"):
            per_seq = seqs.sums / seqs.counts.clamp(min=1)
        else:
            per_seq = seqs.sums
        # Sequences without a valid token are left out of klpen's seq-means, counted by TRL's.
        if name in ("grpo", "dr_grpo"):
            counted = seqs.sequences
        else:
            counted = (seqs.counts > 0).sum(dtype=acc)
        total = per_seq.sum() / counted.clamp(min=1)
    if length is not None:
        total = total / length
    return total.to(values.dtype)
    # end excerpt


def aggregation_weights(
    mask: Tensor, mode: str, sequence_ids: Tensor | None, dtype: torch.dtype
) -> Tensor:
    r"""The ``(B, T)`` weights :math:`w` of one of klpen's four modes (``mode`` in
    ``AGGREGATION_MODES``): ``aggregate(values, mask, mode, sequence_ids=sequence_ids)``
    equals :math:`\sum w \cdot x` over the valid positions, so :math:`w` is its gradient
    w.r.t. ``values``. Each mode is linear in the values with weights that depend on the mask
    and the sequences only, which lets a fused loss take its gradients in the forward pass.

    ``mask``: the checked bool mask; ``sequence_ids``: checked ids or ``None``. ``w`` is 0 at
    the masked positions and positive at the valid ones (``1``; ``1 / n``; ``1 / R``;
    ``1 / (n_s R)``, with ``n`` valid tokens in all, ``n_s`` in the position's sequence and
    ``R`` sequences holding one), in ``dtype``. No host synchronisation.

    Example:
        >>> mask = torch.tensor([[True, True, True], [True, False, False]])
        >>> aggregation_weights(mask, "seq-mean-token-mean", None, torch.float64)
        tensor([[0.1667, 0.1667, 0.1667],
                [0.5000, 0.0000, 0.0000]], dtype=torch.float64)
    """
    ones = mask.to(dtype)
    if mode == "token-sum":
        return ones
    if mode == "token-mean":
        return ones / ones.sum().clamp(min=1)
    seqs = per_sequence(ones, mask, sequence_ids, dtype)
    counted = (seqs.counts > 0).sum(dtype=dtype).clamp(min=1)
    if mode == "seq-mean-token-sum":
        return ones / counted
    n = seqs.counts.clamp(min=1)
    per_token = n[:, None] if seqs.slot is None else n[seqs.slot]
    return ones / (per_token * counted)


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


def response_mask(
    tokens: Tensor,
    eos_token_id: int,
    *,
    include_eos: bool = True,
    position_ids: Tensor | None = None,
    cu_seqlens: Tensor | None = None,
) -> Tensor:
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

    **Packed** (``position_ids`` or ``cu_seqlens``, see :func:`~klpen.sequence_ids`):
    ``tokens`` is one ``(1, total)`` row of several sequences, and the count ``s`` runs from
    the start of ``t``'s own sequence: each sequence is masked after its own first EOS, and
    every sequence starts unmasked.

    Args:
        tokens: ``(..., T)`` integer token ids of the responses (``T`` last), non-negative;
            ``(1, total)`` when packed.
        eos_token_id: the end-of-sequence id, a non-negative Python int that fits ``tokens``'
            dtype (261 is refused for uint8 tokens rather than wrapped to 5).
        include_eos: keep the first EOS itself (default) or stop before it.
        position_ids: ``(1, total)`` positions restarting at 0 at each sequence (packed).
        cu_seqlens: ``(S + 1,)`` cumulative sequence lengths (packed); not with
            ``position_ids``.

    Returns:
        A ``torch.bool`` tensor of ``tokens``' shape.

    Raises:
        TypeError, ValueError: a non-integer ``tokens`` or ``eos_token_id``; an
            ``eos_token_id`` that is negative or beyond the range of ``tokens``' dtype; a
            ``(1, total)`` shape or packing argument that :func:`~klpen.sequence_ids` refuses;
            as value checks (skipped with validation off), negative ``tokens`` and the
            packing arguments' values.

    Example:
        >>> tokens = torch.tensor([[5, 7, 2, 0, 0], [5, 7, 8, 9, 6], [2, 2, 0, 0, 0]])
        >>> response_mask(tokens, eos_token_id=2).int()
        tensor([[1, 1, 1, 0, 0],
                [1, 1, 1, 1, 1],
                [1, 0, 0, 0, 0]], dtype=torch.int32)
        >>> packed = torch.tensor([[5, 2, 0, 5, 7, 2]])  # two sequences, of 3 tokens each
        >>> response_mask(packed, 2, position_ids=torch.tensor([[0, 1, 2, 0, 1, 2]])).int()
        tensor([[1, 1, 0, 1, 1, 1]], dtype=torch.int32)
    """
    ids = check_token_ids("tokens", tokens)
    if ids.dim() < 1:
        raise ValueError("tokens must have at least 1 dimension (..., T), got shape ()")
    if isinstance(eos_token_id, (bool, Tensor)):
        raise TypeError(f"eos_token_id must be a Python int, got {eos_token_id!r}")
    try:
        eos = operator.index(eos_token_id)
    except TypeError:
        raise TypeError(
            f"eos_token_id must be a Python int, got {type(eos_token_id).__name__} {eos_token_id!r}"
        ) from None
    if eos < 0:
        raise ValueError(f"eos_token_id must be a non-negative token id, got {eos}")
    largest = torch.iinfo(ids.dtype).max
    if eos > largest:
        raise ValueError(
            f"eos_token_id must fit the dtype of tokens ({ids.dtype}, ids up to {largest}), got "
            f"{eos}: it would wrap around and match another id"
        )
    if not isinstance(include_eos, bool):
        raise TypeError(f"include_eos must be True or False, got {include_eos!r}")
    starts = None
    if position_ids is not None or cu_seqlens is not None:
        _, starts = packed_layout("tokens", ids, position_ids, cu_seqlens)
    if ids.dtype != torch.uint8:
        check_all(
            ids >= 0,
            lambda i: f"tokens must be non-negative token ids, got {int(ids[i])} at index {i}",
        )
    is_eos = ids == eos
    seen = is_eos.cumsum(-1)  # EOS count up to and including t
    before_t = seen - is_eos.long()  # EOS count strictly before t
    before = before_t if include_eos else seen
    if starts is not None:
        # Only the EOS of t's own sequence count: subtract those before its first position.
        before = before - before_t.gather(-1, starts)
    return before == 0
