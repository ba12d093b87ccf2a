r"""Packed (padding-free) batches: several sequences in one row, and which position is whose.

Trainers that avoid padding (TRL's ``padding_free``, verl's ``use_remove_padding``, OpenRLHF's
``packing_samples``) concatenate the sequences of a batch into one row of shape ``(1, total)``
and mark where each starts, in one of two conventions:

- ``position_ids``, ``(1, total)``: each sequence's positions ``0, 1, …, l - 1``, restarting at
  0 where the next begins (what ``transformers`` reads to build packed attention);
- ``cu_seqlens``, ``(S + 1,)``: the cumulative lengths ``[0, l_0, l_0 + l_1, …, total]`` (the
  flash-attention convention; a zero-length sequence, a repeated entry, is allowed, as
  flash-attention allows it).

:func:`sequence_ids` turns either into the index of the sequence of every position. The other
names of this module are the building blocks that the packed forms of
:func:`~klpen.next_token_logprobs`, :func:`~klpen.response_mask`, :func:`~klpen.shape_rewards`,
:func:`~klpen.aggregate` and ``klpen.distributed.aggregate`` share; none reads a tensor's values
on the host except through the value checks of ``klpen._validation``.
"""

from __future__ import annotations

import operator
from typing import NamedTuple

import torch
from torch import Tensor

from ._validation import check_all, check_same_device, check_tensor_kind

__all__ = ["sequence_ids"]


_INDEX_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def _index_tensor(name: str, x: object) -> Tensor:
    """Require an integer tensor (of positions, lengths or ids); types only, values unchecked."""
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of integers, got {type(x).__name__}")
    check_tensor_kind(name, x)
    if x.dtype not in _INDEX_DTYPES:
        raise TypeError(
            f"{name} must be an int64, int32, int16, int8 or uint8 tensor, got dtype {x.dtype}"
        )
    return x


def _total(total: object) -> int:
    if isinstance(total, bool) or isinstance(total, Tensor):
        raise TypeError(f"total must be a Python int (the packed length), got {total!r}")
    try:
        n = operator.index(total)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(
            f"total must be a Python int (the packed length), got {type(total).__name__} {total!r}"
        ) from None
    if n < 0:
        raise ValueError(f"total must be non-negative, got {n}")
    return n


def _check_position_ids(pos: Tensor) -> None:
    """Values: 0 at the start of the row, then each entry 0 (a new sequence) or one more."""
    first = pos[:, :1] == 0
    step = (pos[:, 1:] == 0) | (pos[:, 1:] == pos[:, :-1].long() + 1)
    ok = torch.cat([first, step], dim=1)

    def describe(i: tuple[int, ...]) -> str:
        t = i[1]
        got = int(pos[0, t])
        if t == 0:
            return (
                "position_ids must start at 0 (each sequence counts 0, 1, 2, ...), got "
                f"{got} at index (0, 0)"
            )
        return (
            "position_ids must restart at 0 or increase by 1 within a sequence, got "
            f"{int(pos[0, t - 1])} then {got} at index (0, {t})"
        )

    check_all(ok, describe)


def _check_cu_seqlens(cu: Tensor, total: int) -> None:
    """Values: ``cu[0] == 0``, non-decreasing, ``cu[-1] == total``."""
    c = cu.long()
    ok = torch.cat([c[:1] == 0, c[1:] >= c[:-1], c[-1:] == total])

    def describe(i: tuple[int, ...]) -> str:
        k = i[0]
        if k == 0:
            return f"cu_seqlens must start at 0, got {int(c[0])}"
        if k < c.numel():
            return (
                "cu_seqlens must be non-decreasing (cumulative lengths), got "
                f"{int(c[k - 1])} then {int(c[k])} at index {k}"
            )
        return (
            f"cu_seqlens must end at the packed length {total}, got {int(c[-1])} "
            f"(its last entry, index {c.numel() - 1})"
        )

    check_all(ok, describe)


def _resolve(
    position_ids: object, cu_seqlens: object, total: int | None, device: torch.device | None
) -> tuple[Tensor, Tensor]:
    """Validated ``(ids, starts)``, both ``(1, total)`` int64: each position's sequence index and
    the index of that sequence's first position. ``total`` is known here (``None`` only with
    ``position_ids``, whose width it then is)."""
    if (position_ids is None) == (cu_seqlens is None):
        raise ValueError(
            "pass exactly one of position_ids and cu_seqlens, got "
            + ("both" if position_ids is not None else "neither")
        )
    if position_ids is not None:
        pos = _index_tensor("position_ids", position_ids)
        if pos.dim() != 2 or pos.shape[0] != 1:
            raise ValueError(
                f"position_ids must have shape (1, total) (one packed row), got {tuple(pos.shape)}"
            )
        if total is not None and pos.shape[1] != total:
            raise ValueError(
                f"position_ids must have shape (1, {total}) (the packed length), got "
                f"{tuple(pos.shape)}"
            )
        if device is not None and pos.device != device:
            raise ValueError(
                f"position_ids is on device {pos.device} but the packed tensor is on {device}; "
                "move them to the same device"
            )
        _check_position_ids(pos)
        p = pos.long()
        # A sequence starts where the position is 0: cumulative count, no host round trip.
        ids = (p == 0).cumsum(-1).sub_(1).clamp_(min=0)
        here = torch.arange(p.shape[1], device=p.device)
        starts = (here - p).clamp_(min=0)
        return ids, starts
    cu = _index_tensor("cu_seqlens", cu_seqlens)
    if cu.dim() != 1 or cu.numel() == 0:
        raise ValueError(
            "cu_seqlens must be a 1-D tensor [0, l0, l0 + l1, ..., total] of at least one "
            f"entry, got shape {tuple(cu.shape)}"
        )
    if total is None:
        raise ValueError(
            "total (the packed length, e.g. input_ids.shape[-1]) is required with cu_seqlens: "
            "reading it from cu_seqlens[-1] would synchronise the host"
        )
    if device is not None and cu.device != device:
        raise ValueError(
            f"cu_seqlens is on device {cu.device} but the packed tensor is on {device}; "
            "move them to the same device"
        )
    _check_cu_seqlens(cu, total)
    c = cu.long()
    here = torch.arange(total, device=cu.device)
    # The sequence of position p: how many sequences end at or before p (zero-length ones too).
    ids = torch.searchsorted(c[1:], here, right=True).clamp_(max=max(c.numel() - 2, 0))
    starts = c[ids].clamp_(min=0)
    return ids[None], starts[None]


def sequence_ids(
    *,
    position_ids: Tensor | None = None,
    cu_seqlens: Tensor | None = None,
    total: int | None = None,
) -> Tensor:
    r"""The index of the sequence each position of a packed row belongs to.

    .. math::
        \begin{aligned}
        \mathrm{id}_t &= \#\{s \le t : p_s = 0\} - 1 \\
        &\quad (\text{position\_ids } p), \\
        \mathrm{id}_t &= \#\{k \ge 1 : c_k \le t\} \\
        &\quad (\text{cu\_seqlens } c)
        \end{aligned}

    With ``cu_seqlens`` a zero-length sequence keeps its index: ``[0, 2, 2, 3]`` gives
    ``[[0, 0, 2]]`` (sequence 1 has no position), so that index ``s`` is the ``s``-th sequence
    (and the ``s``-th score of :func:`~klpen.shape_rewards`) in both conventions.

    Args:
        position_ids: ``(1, total)`` integer positions, ``0, 1, …`` within each sequence,
            restarting at 0 where the next begins; the row starts at 0.
        cu_seqlens: ``(S + 1,)`` integer cumulative lengths: starts at 0, non-decreasing, ends
            at ``total``.
        total: the packed length. Required with ``cu_seqlens`` (not read from
            ``cu_seqlens[-1]``, which would synchronise the host: pass
            ``input_ids.shape[-1]``); with ``position_ids`` optional, and then checked against
            its width.

    Returns:
        ``(1, total)`` int64 sequence indices, non-decreasing, on the device of the argument.

    Raises:
        TypeError, ValueError: both or neither of ``position_ids``/``cu_seqlens``; a
            non-integer tensor; a wrong shape; ``total`` missing (with ``cu_seqlens``), not a
            non-negative int, or disagreeing; and, as value checks (skipped with validation
            off, which then makes no host synchronisation), ``position_ids`` that do not start
            at 0 or that neither restart at 0 nor grow by 1, ``cu_seqlens`` that do not start at
            0, decrease, or do not end at ``total``.

    Example:
        >>> sequence_ids(position_ids=torch.tensor([[0, 1, 2, 0, 1, 0]]))
        tensor([[0, 0, 0, 1, 1, 2]])
        >>> sequence_ids(cu_seqlens=torch.tensor([0, 3, 5, 6], dtype=torch.int32), total=6)
        tensor([[0, 0, 0, 1, 1, 2]])
    """
    n = None if total is None else _total(total)
    ids, _ = _resolve(position_ids, cu_seqlens, n, None)
    return ids


def packed_layout(
    like_name: str,
    like: Tensor,
    position_ids: object,
    cu_seqlens: object,
) -> tuple[Tensor, Tensor]:
    """``(ids, starts)`` for the packed tensor ``like`` of shape ``(1, total)`` (validated).

    Used by the packed forms of :func:`~klpen.next_token_logprobs` and
    :func:`~klpen.response_mask`; ``like_name`` names ``like`` in the messages.
    """
    if like.dim() != 2 or like.shape[0] != 1:
        raise ValueError(
            f"{like_name} must have shape (1, total) (one packed row) with position_ids or "
            f"cu_seqlens, got {tuple(like.shape)}"
        )
    return _resolve(position_ids, cu_seqlens, like.shape[1], like.device)


def next_token_keep(input_ids: Tensor, position_ids: object, cu_seqlens: object) -> Tensor:
    """The packed shift's rows: ``(1, total - 1)`` bool, False where the next token of the
    packed row ``input_ids (1, total)`` starts a new sequence (no next-token log-prob there).

    ``next_token_logprobs`` hands it to the log-prob kernel, which writes 0 at those rows and
    gives them no gradient, whatever the logits hold there (NaN, ``±inf``).
    """
    ids, _ = packed_layout("input_ids", input_ids, position_ids, cu_seqlens)
    return ids[:, 1:] == ids[:, :-1]


class SequenceSums(NamedTuple):
    """Per-sequence masked sums of a packed (or padded) batch; see :func:`per_sequence`."""

    #: ``(N,)`` masked sum of each sequence's values, in the accumulation dtype
    sums: Tensor
    #: ``(N,)`` number of valid tokens of each sequence, in the accumulation dtype
    counts: Tensor
    #: 0-d, in the accumulation dtype: how many sequences the batch holds, those without a
    #: position or a valid token included (``B`` for a padded batch; see :func:`per_sequence`)
    sequences: Tensor
    #: ``values``' shape, int64: the slot of each position (``None`` for a padded batch, where
    #: the slot of row ``b`` is ``b``)
    slot: Tensor | None


def check_sequence_ids(
    name: str, ids: object, values: Tensor, *, values_name: str = "values", ordered: bool = True
) -> Tensor:
    """Require ``(B, T)`` integer sequence ids of ``values``' shape and device and, if
    ``ordered``, non-decreasing along each row (a value check); return them."""
    t = _index_tensor(name, ids)
    if tuple(t.shape) != tuple(values.shape):
        raise ValueError(
            f"{name} must have the shape of {values_name} {tuple(values.shape)}, got "
            f"{tuple(t.shape)}"
        )
    check_same_device(name, t, values_name, values)
    if not ordered:
        return t
    check_all(
        t[..., :1] >= 0,
        lambda i: (
            f"{name} must be non-negative (the index of each position's sequence, from 0), got "
            f"{int(t[i[0], 0])} at index ({i[0]}, 0)"
        ),
    )
    ok = t[..., 1:] >= t[..., :-1]
    check_all(
        ok,
        lambda i: (
            f"{name} must be non-decreasing along each row (each sequence one run of equal ids), "
            f"got {int(t[i[0], i[1]])} then {int(t[i[0], i[1] + 1])} at index ({i[0]}, {i[1] + 1})"
        ),
    )
    return t


def check_num_sequences(num_sequences: object, ids: Tensor | None) -> int | None:
    """Require ``None`` or a non-negative Python int, only with ``ids`` (packed sequence ids),
    and (a value check) at least the number of sequences that ``ids`` index; return it."""
    if num_sequences is None:
        return None
    if ids is None:
        raise ValueError(
            f"num_sequences is used only with sequence_ids (a packed batch), got "
            f"num_sequences={num_sequences!r} and sequence_ids=None"
        )
    if isinstance(num_sequences, bool) or isinstance(num_sequences, Tensor):
        raise TypeError(f"num_sequences must be a Python int, got {num_sequences!r}")
    try:
        n = operator.index(num_sequences)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(
            f"num_sequences must be a Python int, got {type(num_sequences).__name__} "
            f"{num_sequences!r}"
        ) from None
    if n < 0:
        raise ValueError(f"num_sequences must be non-negative, got {n}")
    indexed = _indexed(ids, torch.int64)
    check_all(
        (indexed <= n).reshape(1),
        lambda _: (
            f"num_sequences must be at least the number of sequences that sequence_ids index "
            f"(the last id of each row + 1, summed over rows: {int(indexed)}), got {n}"
        ),
    )
    return n


def _indexed(ids: Tensor, dtype: torch.dtype) -> Tensor:
    """0-d: the sequences that ``(B, T)`` ids index, each row's last id + 1, summed over rows."""
    if ids.shape[-1] == 0:
        return torch.zeros((), dtype=dtype, device=ids.device)
    return ids[..., -1].to(dtype).add(1).sum()


def per_sequence(
    kept: Tensor,
    mask: Tensor,
    sequence_ids: Tensor | None,
    dtype: torch.dtype,
    num_sequences: int | None = None,
) -> SequenceSums:
    r"""Per-sequence sums and valid-token counts, accumulated in ``dtype``, without a host sync.

    ``kept`` is the ``(B, T)`` values already zeroed at masked positions, ``mask`` the bool
    mask. Without ``sequence_ids`` the sequences are the rows (``N = B``). With them (``(B, T)``,
    non-decreasing along each row) a sequence is a run of equal ids within a row and ``N = B·T``
    slots are used, one per possible run, in order; the unused ones count 0. (Runs, not the id
    values, index the slots: ids need not be dense, and a zero-length sequence of
    ``cu_seqlens`` simply has no slot.) Differentiable w.r.t. ``kept``.

    ``sequences`` counts the sequences as the padded batch has rows: the ids are the sequences'
    indices (as :func:`sequence_ids` gives them: a zero-length sequence keeps its index), so a
    row holds its last id + 1 sequences, the indices that no position holds (a zero-length
    sequence, or one whose only position a next-token shift dropped) included;
    ``num_sequences``, when given, replaces that count (the sequences after the last position,
    which leave no id: ``cu_seqlens = [0, 2, 5, 5]`` holds 3, its ids count 2).

    This is the per-sequence reduction of :func:`~klpen.aggregate` and of
    ``klpen.distributed.aggregate``: with ``s = per_sequence(...)``, ``n = s.counts`` and
    ``R = (n > 0).sum()``, the ``seq-mean-token-mean`` value is ``Σ (s.sums / n.clamp(1)) / R``
    and its gradient at a valid token ``1 / (n[s.slot] R)``.

    Example:
        >>> x = torch.tensor([[1.0, 3.0, 5.0, 0.0]])
        >>> m = torch.tensor([[True, True, True, False]])
        >>> s = per_sequence(x, m, torch.tensor([[0, 0, 1, 1]]), torch.float64)
        >>> s.sums[:3].tolist(), s.counts[:3].tolist(), s.sequences.item()
        ([4.0, 5.0, 0.0], [2.0, 1.0, 0.0], 2.0)
        >>> per_sequence(x, m, torch.tensor([[0, 0, 2, 2]]), torch.float64).sequences.item()
        3.0
    """
    if sequence_ids is None:
        rows = kept.shape[0]
        return SequenceSums(
            kept.sum(-1, dtype=dtype),
            mask.sum(-1, dtype=dtype),
            torch.full((), rows, dtype=dtype, device=kept.device),
            None,
        )
    ids = sequence_ids
    n = ids.numel()
    change = torch.ones(ids.shape, dtype=torch.bool, device=ids.device)
    change[..., 1:] = ids[..., 1:] != ids[..., :-1]
    index = change.reshape(-1).cumsum(0).sub_(1).view(ids.shape)
    flat = index.reshape(-1)
    sums = torch.zeros(n, dtype=dtype, device=kept.device).index_add(
        0, flat, kept.reshape(-1).to(dtype)
    )
    counts = torch.zeros(n, dtype=dtype, device=kept.device).index_add_(
        0, flat, mask.reshape(-1).to(dtype)
    )
    if num_sequences is None:
        sequences = _indexed(ids, dtype).to(kept.device)
    else:
        sequences = torch.full((), num_sequences, dtype=dtype, device=kept.device)
    return SequenceSums(sums, counts, sequences, index)
