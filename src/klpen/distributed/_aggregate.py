r"""Data-parallel :func:`klpen.aggregate`: token counts and sums made global across a group.

Chapter 11 of the book. Each rank holds other rows (or packed sequences) of the batch; one
all-gather of six float64 numbers per rank (numerator, count, mode, ``max_length``, padded
width, a failure flag) makes the value global, and the gradient is scaled so that the
data-parallel average of the ranks' gradients is the gradient of the global aggregate.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from .._validation import check_choice
from ..masking import (
    _NORMALISED,
    AGGREGATION_ALIASES,
    AGGREGATION_MODES,
    _checked,
    _max_length,
    _zero_masked,
)
from ..packing import check_num_sequences, check_sequence_ids, per_sequence
from ._kernels import compute_dtype
from ._protocol import guarded_all_gather, meta_device, resolve_group

__all__ = ["aggregate"]

#: every name ``mode`` accepts, as in :func:`klpen.aggregate`; its index travels
_NAMES = (*AGGREGATION_MODES, *AGGREGATION_ALIASES)
#: the names that sum tokens (no per-sequence reduction)
_TOKEN_MODES = ("token-mean", "token-sum", "bnpo", "dapo", "seq-mean-token-sum-norm")
#: the names that average each sequence's token mean
_MEAN_OF_MEANS = ("seq-mean-token-mean", "grpo")
# One row per rank: numerator, count (tokens or sequences), the mode's index in _NAMES, the
# max_length given (-1: none), the padded width T, and the failure flag.
_NUMERATOR, _COUNT, _MODE, _LENGTH, _WIDTH = range(5)
_ROW = _WIDTH + 2


class _DataParallelAggregate(torch.autograd.Function):
    """The global aggregate as value; ``grad_out · scale_b`` at each valid token of row ``b``."""

    @staticmethod
    def forward(ctx: Any, values: Tensor, value: Tensor, mask: Tensor, scale: Tensor) -> Tensor:
        ctx.save_for_backward(mask, scale)
        return value.clone()

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor, None, None, None]:
        mask, scale = ctx.saved_tensors
        # where(), not a product with the mask: nothing at a masked slot reaches the gradient.
        grad = torch.where(mask, grad_out * scale, torch.zeros((), dtype=scale.dtype))
        return grad.to(grad_out.dtype), None, None, None


def aggregate(
    values: Tensor,
    mask: Tensor,
    mode: str,
    group: dist.ProcessGroup | None = None,
    *,
    sequence_ids: Tensor | None = None,
    max_length: float | None = None,
    num_sequences: int | None = None,
) -> Tensor:
    r""":func:`klpen.aggregate` over the rows of a batch split across a data-parallel group.

    Each rank holds its own rows: ``values`` and ``mask`` of shape ``(B_r, T_r)``, both sizes
    free to differ between ranks (``(1, total_r)`` when packed). Returns, on every rank,
    ``klpen.aggregate`` of the concatenated batch (the rows of all ranks, padded to one length
    with masked slots): counts and sums are global. With ``x`` the values, ``m`` the mask,
    ``n_s`` the valid tokens of sequence ``s``, ``C = Σ_{ranks} Σ_s n_s`` the global token
    count, ``R`` the global number of sequences with a valid token and ``N`` that of all
    sequences (empty ones included):

    =========================  ===================================  =========================
    mode                       value                                gradient on this rank
    =========================  ===================================  =========================
    ``"token-mean"``           :math:`\sum m x / C`                 :math:`W m / C`
    ``"token-sum"``            :math:`\sum m x`                     :math:`W m`
    ``"seq-mean-token-mean"``  :math:`\sum_s (\sum_t m x / n_s)/R`  :math:`W m / (n_s R)`
    ``"seq-mean-token-sum"``   :math:`\sum_s \sum_t m x / R`        :math:`W m / R`
    =========================  ===================================  =========================

    and the peers' names of :func:`klpen.aggregate`, made global the same way: ``"bnpo"`` and
    ``"dapo"`` are ``"token-mean"`` (TRL's ``dapo`` divides by ``num_items_in_batch``, the
    token count over every process: this ``C``); ``"grpo"`` is
    :math:`\frac1N \sum_s \sum_t m x / \max(1, n_s)`; ``"dr_grpo"`` is
    :math:`\sum m x / (N L)`; ``"seq-mean-token-sum-norm"`` is :math:`\sum m x / L`, with
    :math:`L` = ``max_length``, by default (unpacked ``seq-mean-token-sum-norm`` only) the
    padded length of the concatenated batch, ``max_r T_r``.

    **Packed rows** (``sequence_ids``, e.g. from :func:`~klpen.sequence_ids`): a sequence is a
    run of equal ids within a row *of one rank*; the ``seq-mean`` modes average over every
    rank's sequences. A sequence is never split across ranks: equal ids on two ranks are two
    sequences (pack each sequence whole on one rank). Ranks may mix packed and padded batches.
    ``"grpo"`` and ``"dr_grpo"`` count each rank's sequences as :func:`klpen.aggregate` does:
    by their indices (a zero-length sequence of ``cu_seqlens`` included), or ``num_sequences``.

    The gradient w.r.t. this rank's ``values`` is ``W`` (the group's size) times this rank's
    slice of the gradient of the global aggregate. Data-parallel training (DDP, FSDP)
    *averages* the parameter gradients of the ranks, so that average is exactly the gradient
    of the global aggregate; averaging per-rank ``klpen.aggregate`` losses instead weighs a
    token on a rank with few tokens more than one on a rank with many. With no valid token
    (or, in the seq-mean modes, no counted sequence) in the whole group, every mode returns 0
    with a zero gradient.

    Args:
        values: ``(B_r, T_r)`` floating tensor on this rank.
        mask: ``(B_r, T_r)`` bool, integer or floating 0/1 tensor. Whatever ``values`` holds at
            a masked slot (NaN, ``±inf``) reaches neither the value nor the gradient.
        mode: one of the four modes or the five aliases above, the same on every rank.
        group: the data-parallel process group; ``None`` for the default group.
        sequence_ids: optional ``(B_r, T_r)`` integer ids, non-decreasing along each row (a
            value check); ``None``: each row is one sequence.
        num_sequences: this rank's number of packed sequences, as for
            :func:`klpen.aggregate` (with ``sequence_ids`` only).
        max_length: ``L``, as for :func:`klpen.aggregate` (required for ``"dr_grpo"`` and for
            packed ``"seq-mean-token-sum-norm"``); given on every rank with the same value, or
            on none.

    Returns:
        A 0-d tensor in ``values``' dtype, identical on every rank (sums and counts are
        accumulated in float64), differentiable w.r.t. ``values``.

    Communication: one all-gather of 6 ``float64`` per rank (numerator, count, mode,
    ``max_length``, padded width, a failure flag); the backward pass communicates nothing.

    Raises:
        TypeError, ValueError: on any rank, what :func:`klpen.aggregate` refuses (wrong types,
            tensor kinds, shapes or devices, a mask that is not 0/1, NaN at a valid position,
            an unknown mode, bad ``sequence_ids``, a missing or misplaced ``max_length``): the
            other ranks raise a ``ValueError`` naming it; modes or ``max_length`` that differ
            between ranks. Every rank raises, none hangs.

    Example (rank 0 holds one row of three valid tokens, rank 1 one row of one)::

        >>> values = torch.tensor([[1.0, 1.0, 1.0]]) if dist.get_rank() == 0 else torch.tensor(
        ...     [[4.0, 0.0, 0.0]])  # doctest: +SKIP
        >>> mask = torch.tensor([[1, 1, 1]]) if dist.get_rank() == 0 else torch.tensor(
        ...     [[1, 0, 0]])  # doctest: +SKIP
        >>> aggregate(values, mask, "token-mean")  # doctest: +SKIP
        tensor(1.7500)

    The same number in one process, on the concatenated batch:

        >>> from klpen import aggregate as single_process_aggregate
        >>> values = torch.tensor([[1.0, 1.0, 1.0], [4.0, 0.0, 0.0]])
        >>> single_process_aggregate(values, torch.tensor([[1, 1, 1], [1, 0, 0]]), "token-mean")
        tensor(1.7500)
    """
    pg = resolve_group(group)
    world = dist.get_world_size(pg)
    buffer = torch.zeros(_ROW, dtype=torch.float64, device=meta_device(pg))
    local: dict[str, Any] = {}

    def local_sums() -> None:
        # The checks of klpen.aggregate: tensor kinds, dtype, device, a 0/1 mask of the same
        # shape, no NaN at a valid position, the sequence ids, the mode and max_length.
        m = _checked(values, mask)
        x = values
        if x.dim() != 2:
            raise ValueError(f"values must have shape (B, T), got {tuple(x.shape)}")
        name = check_choice("mode", mode, _NAMES)
        ids = None
        if sequence_ids is not None:
            ids = check_sequence_ids("sequence_ids", sequence_ids, x)
        sequences = check_num_sequences(num_sequences, ids)
        length = _max_length(name, max_length, x, ids is not None)
        kept = _zero_masked(x.detach(), m)  # the gradient comes from the Function
        f64 = torch.float64
        per_token = None  # (B, T) or (B, 1): n_s of each position's sequence, mean modes only
        if name in _TOKEN_MODES:
            numerator = kept.sum(dtype=f64)
            count = m.sum(dtype=f64) if AGGREGATION_ALIASES.get(name, name) == "token-mean" else 0
        else:
            seqs = per_sequence(kept, m, ids, f64, sequences)
            if name in _MEAN_OF_MEANS:
                numerator = (seqs.sums / seqs.counts.clamp(min=1)).sum()
                n = seqs.counts.clamp(min=1)
                per_token = n[:, None] if seqs.slot is None else n[seqs.slot]
            else:
                numerator = seqs.sums.sum()
            # Sequences without a valid token: left out of klpen's seq-means, counted by TRL's.
            if name in ("grpo", "dr_grpo"):
                count = seqs.sequences
            else:
                count = (seqs.counts > 0).sum(dtype=f64)
        buffer[_NUMERATOR] = numerator
        buffer[_COUNT] = count
        buffer[_MODE] = _NAMES.index(name)
        explicit = name in _NORMALISED and max_length is not None
        buffer[_LENGTH] = length if explicit and length is not None else -1
        buffer[_WIDTH] = x.shape[-1]
        local.update(values=x, mask=m, mode=name, per_token=per_token)

    table = guarded_all_gather(buffer, pg, local_sums, "values/mask/mode").cpu().tolist()
    names = [_NAMES[int(row[_MODE])] for row in table]
    if len(set(names)) > 1:
        raise ValueError(
            f"mode must be the same on every rank, got {dict(enumerate(names))} (rank: mode)"
        )
    x, m, name = local["values"], local["mask"], local["mode"]
    lengths = [row[_LENGTH] for row in table]
    if len(set(lengths)) > 1:
        got = {r: (int(v) if v >= 0 else None) for r, v in enumerate(lengths)}
        raise ValueError(
            f"max_length must be the same on every rank (given on all or on none), got {got} "
            "(rank: max_length)"
        )
    # The rows of every rank, in rank order: the same sums, bit for bit, on every rank.
    total = math.fsum(row[_NUMERATOR] for row in table)
    if name in ("token-sum", "seq-mean-token-sum-norm"):
        denominator = 1.0
    else:
        denominator = math.fsum(row[_COUNT] for row in table)
    if name in _NORMALISED:
        # The padded length of the concatenated batch (the widest rank's) by default.
        denominator *= lengths[0] if lengths[0] >= 0 else max(row[_WIDTH] for row in table)
    value = total / denominator if denominator > 0 else 0.0
    # d value / d x at a valid token, times W (data-parallel averaging).
    factor = world / denominator if denominator > 0 else 0.0
    scale = torch.full((x.shape[0], 1), factor, dtype=torch.float64, device=x.device)
    if local["per_token"] is not None:
        scale = scale / local["per_token"]
    result = torch.tensor(value, dtype=torch.float64, device=x.device).to(x.dtype)
    out: Tensor = _DataParallelAggregate.apply(x, result, m, scale.to(compute_dtype(x.dtype)))  # type: ignore[no-untyped-call]
    return out
