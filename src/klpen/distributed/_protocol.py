r"""The collective protocol of :mod:`klpen.distributed`: groups, metadata, failure, token ids.

Every vocab-parallel call follows the same steps, all of them here:

1. :func:`resolve_group`: the process group, checked before any collective.
2. :func:`exchange_metadata`: one all-gather of a fixed-length ``int64`` vector per rank,
   the encoding of a :class:`Metadata` record (or, from a rank that rejected its inputs, a
   failure flag). Every rank then decodes the same table: a rank that failed makes every rank
   raise (:func:`raise_everywhere`), and :func:`check_agreement` raises, identically on every
   rank, a ``ValueError`` naming each field on which some rank differs from rank 0 and the
   two values. What must agree is what sizes or fixes the later collectives and the result:
   leading shape, dtypes, hidden size, temperature, the announced vocabulary size.
3. :func:`guarded_all_reduce` / :func:`guarded_all_gather`: a collective whose buffer carries
   one more element, a failure flag, so that a rank whose local computation raised still
   joins it, and then every rank raises.
4. :func:`check_same_tokens` (or :func:`write_ids` and :func:`check_same_ids` inside another
   all-reduce (max)): the token ids of all ranks compared exactly, as exact digits and their
   negatives.

This module imports nothing of klpen but :mod:`klpen._validation`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from .._validation import check_tokens

__all__ = [
    "FLOAT_DTYPES",
    "META_LENGTH",
    "Metadata",
    "check_agreement",
    "check_same_ids",
    "check_same_tokens",
    "exchange_metadata",
    "guarded_all_gather",
    "guarded_all_reduce",
    "id_digits",
    "meta_device",
    "raise_everywhere",
    "resolve_group",
    "write_ids",
]

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def resolve_group(group: object) -> Any:
    """The process group to use; checks that it exists and that this process belongs to it.

    (A rank given an invalid ``group`` raises here, before any collective: it cannot reach
    its peers through a group it does not have. The others then wait in their first
    collective until the group's timeout.)
    """
    if not dist.is_available():
        raise ValueError("group: this build of torch has no torch.distributed support")
    if group is dist.GroupMember.NON_GROUP_MEMBER:
        # What torch.distributed.new_group returns on the ranks it does not include.
        raise ValueError(
            "group: this process is not a member of the process group it was given (got the "
            "placeholder torch.distributed.new_group returns to non-members)"
        )
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            f"group must be a torch.distributed.ProcessGroup or None, got {type(group).__name__}"
        )
    if not dist.is_initialized():
        raise ValueError(
            f"group is {'None' if group is None else 'given'} but no default torch.distributed "
            "process group is initialised; call torch.distributed.init_process_group first"
        )
    if dist.get_rank(group) < 0:
        raise ValueError("group: this process is not a member of the process group it was given")
    return dist.group.WORLD if group is None else group


def meta_device(group: Any) -> torch.device:
    """Where small protocol tensors live: NCCL moves only CUDA tensors, the others the CPU's."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# --- failure on one rank is failure on every rank ---------------------------------------------


def raise_everywhere(group: Any, failure: BaseException | None, what: str) -> None:
    """Raise on every rank once some rank is known (to all) to have failed.

    Every rank must call this at the same point. One ``all_gather_object`` collects the failing
    ranks' messages; a failing rank re-raises its own exception, the others raise a
    ``ValueError`` (the failing rank rejected its input) or ``RuntimeError`` (it failed in its
    local computation) naming the rank and repeating its message.
    """
    mine = None if failure is None else (type(failure).__name__, str(failure))
    gathered: list[tuple[str, str] | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, mine, group=group)
    if failure is not None:
        raise failure
    failed = [r for r, m in enumerate(gathered) if m is not None]
    first = gathered[failed[0]]
    assert first is not None
    kind, message = first
    if kind in ("TypeError", "ValueError"):
        raise ValueError(
            f"{what}: rank(s) {failed} of the process group rejected their inputs; every rank "
            f"raises. Rank {failed[0]}: {kind}: {message}"
        )
    raise RuntimeError(
        f"{what}: rank(s) {failed} of the process group failed in their local computation; "
        f"every rank raises. Rank {failed[0]}: {kind}: {message}"
    )


def _guarded(buffer: Tensor, fill: Callable[[], None]) -> Exception | None:
    """``fill()``; on failure set the flag ``buffer[-1]`` and return the exception."""
    try:
        fill()
    except Exception as exc:  # any failure: it must reach the peers, then it is re-raised
        buffer[-1] = 1
        return exc
    return None


def guarded_all_reduce(
    buffer: Tensor, op: Any, group: Any, fill: Callable[[], None], what: str
) -> None:
    """``fill()`` this rank's part of ``buffer[:-1]``, then all-reduce ``buffer`` in place.

    ``buffer[-1]`` is the failure flag: 0 where ``fill`` succeeded, 1 where it raised. A rank
    that fails still joins the all-reduce, and then every rank raises
    (:func:`raise_everywhere`): no rank waits for a peer that has left.
    """
    failure = _guarded(buffer, fill)
    dist.all_reduce(buffer, op=op, group=group)
    if bool(buffer[-1] != 0):
        raise_everywhere(group, failure, what)


def guarded_all_gather(buffer: Tensor, group: Any, fill: Callable[[], None], what: str) -> Tensor:
    """``fill()`` this rank's ``buffer[:-1]``, then all-gather it: ``(world, len - 1)``.

    The flag ``buffer[-1]`` as in :func:`guarded_all_reduce`. The gathered rows are the same
    on every rank, in rank order.
    """
    failure = _guarded(buffer, fill)
    parts = [torch.empty_like(buffer) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, buffer, group=group)
    gathered = torch.stack(parts)
    if bool((gathered[:, -1] != 0).any()):
        raise_everywhere(group, failure, what)
    return gathered[:, :-1]


# --- metadata ---------------------------------------------------------------------------------


class Metadata(NamedTuple):
    """What a rank tells its peers before a vocab-parallel computation. Every field is required.

    ``dtypes`` names the call's floating arguments with their dtypes, in a fixed order per
    function (at most four; ``None`` for an optional argument not given, such as a bias); the
    names are the same on every rank and only the dtypes travel. The first name is the argument
    whose leading shape ``leading_shape`` is.
    """

    vocab: int  # this rank's slice size V_r (>= 1)
    vocab_size: int | None  # the total vocabulary the caller announced, if any
    leading_shape: tuple[int, ...]  # every dimension but the vocabulary (or hidden) axis
    hidden_size: int | None  # H of a hidden-state call; None where the inputs are logits
    temperature: float
    dtypes: tuple[tuple[str, torch.dtype | None], ...]


_OK, _VOCAB, _VOCAB_ARG, _NDIM, _SHAPE_HASH, _TEMPERATURE, _HIDDEN, _DTYPES = range(8)
_DIMS = 8
_SHAPE_SLOTS = 8  # leading dimensions spelled out for the messages (all of them are hashed)
META_LENGTH = _DIMS + _SHAPE_SLOTS  # 16
_MAX_DTYPES = 4
_HASH_MODULUS = (1 << 61) - 1


def _shape_hash(shape: tuple[int, ...]) -> int:
    h = len(shape) + 1
    for d in shape:
        h = (h * 1_000_003 + d + 1) % _HASH_MODULUS
    return h


def _dtype_code(dtype: torch.dtype | None) -> int:
    return 0 if dtype is None else FLOAT_DTYPES.index(dtype) + 1


def _encode(meta: Metadata) -> Tensor:
    if len(meta.dtypes) > _MAX_DTYPES:
        raise ValueError(f"at most {_MAX_DTYPES} dtypes travel in the metadata")
    row = torch.zeros(META_LENGTH, dtype=torch.int64)
    row[_OK] = 1
    row[_VOCAB] = meta.vocab
    row[_VOCAB_ARG] = -1 if meta.vocab_size is None else meta.vocab_size
    row[_NDIM] = len(meta.leading_shape)
    row[_SHAPE_HASH] = _shape_hash(meta.leading_shape)
    # The temperature's float64 bits: equal exactly when the temperatures are.
    row[_TEMPERATURE] = torch.tensor(meta.temperature, dtype=torch.float64).view(torch.int64)
    row[_HIDDEN] = -1 if meta.hidden_size is None else meta.hidden_size
    row[_DTYPES] = sum(_dtype_code(d) << (4 * i) for i, (_, d) in enumerate(meta.dtypes))
    dims = meta.leading_shape[:_SHAPE_SLOTS]
    row[_DIMS : _DIMS + len(dims)] = torch.tensor(dims, dtype=torch.int64)
    return row


def exchange_metadata(
    group: Any, meta: Metadata | None, failure: BaseException | None, what: str
) -> Tensor:
    """All-gather each rank's :class:`Metadata`; ``failure`` (``meta`` None) flags a rank that
    rejected its inputs.

    Returns the ``(world, META_LENGTH)`` int64 table on the CPU, identical on every rank, for
    :func:`check_agreement`; if some rank failed, every rank raises instead.
    """
    row = torch.zeros(META_LENGTH, dtype=torch.int64)
    if failure is None and meta is not None:
        row = _encode(meta)
    device = meta_device(group)
    world = dist.get_world_size(group)
    parts = [torch.empty(META_LENGTH, dtype=torch.int64, device=device) for _ in range(world)]
    dist.all_gather(parts, row.to(device), group=group)
    gathered = torch.stack(parts).cpu()
    if bool((gathered[:, _OK] == 0).any()):
        raise_everywhere(group, failure, what)
    return gathered


def _leading_shape(row: Tensor) -> str:
    ndim = int(row[_NDIM])
    dims = [str(int(d)) for d in row[_DIMS : _DIMS + min(ndim, _SHAPE_SLOTS)]]
    if ndim > _SHAPE_SLOTS:
        dims.append("...")
    return "(" + ", ".join(dims) + ("," if ndim == 1 else "") + ")"


def _first_mismatch(table: Tensor, columns: slice | int) -> int | None:
    """The first rank whose ``columns`` of the table differ from rank 0's, or None."""
    same = (table[:, columns] == table[0, columns]).reshape(table.shape[0], -1).all(dim=1)
    bad = (~same).nonzero()
    return int(bad[0]) if bad.numel() else None


def _dtype_at(row: Tensor, i: int) -> str:
    code = (int(row[_DTYPES]) >> (4 * i)) & 15
    return "none (not given)" if code == 0 else str(FLOAT_DTYPES[code - 1])


def _differences(table: Tensor, meta: Metadata) -> list[str]:
    """One phrase per field on which some rank differs from rank 0 (its first such rank)."""
    found: list[str] = []

    def differ(columns: slice | int, phrase: Callable[[int], str]) -> None:
        r = _first_mismatch(table, columns)
        if r is not None:
            found.append(phrase(r))

    first = meta.dtypes[0][0]
    for i, (name, _) in enumerate(meta.dtypes):
        codes = (table[:, _DTYPES] >> (4 * i)) & 15
        bad = (codes != codes[0]).nonzero()
        if bad.numel():
            r = int(bad[0])
            found.append(
                f"{name} must have the same dtype on every rank, got {_dtype_at(table[0], i)} on "
                f"rank 0 and {_dtype_at(table[r], i)} on rank {r}"
            )
    differ(
        slice(_NDIM, _SHAPE_HASH + 1),
        lambda r: (
            f"{first} must have the same leading shape on every rank (only the last "
            f"axis is split), got {_leading_shape(table[0])} on rank 0 and "
            f"{_leading_shape(table[r])} on rank {r}"
        ),
    )
    differ(
        _HIDDEN,
        lambda r: (
            f"the hidden size H (the last dimension of {first}) must be the same on every "
            f"rank, got {int(table[0, _HIDDEN])} on rank 0 and {int(table[r, _HIDDEN])} on rank {r}"
        ),
    )

    def temperature(r: int) -> str:
        t0, tr = (float(table[i, _TEMPERATURE].view(torch.float64)) for i in (0, r))
        return (
            f"temperature must be the same on every rank, got {t0} on rank 0 and {tr} on rank {r}"
        )

    differ(_TEMPERATURE, temperature)
    differ(
        _VOCAB_ARG,
        lambda r: (
            f"vocab_size must be the same on every rank, got {int(table[0, _VOCAB_ARG])} "
            f"on rank 0 and {int(table[r, _VOCAB_ARG])} on rank {r} (-1 means None)"
        ),
    )
    return found


def check_agreement(table: Tensor, meta: Metadata, rank: int) -> tuple[int, int]:
    """Raise unless all ranks agree; return ``(offset, total_vocab)`` of this rank.

    ``table``: what :func:`exchange_metadata` returned; ``meta``: this rank's record (for the
    argument names). The decision and the message depend on ``table`` only, so every rank
    raises the same ``ValueError``, which names every field that differs, with its values.
    """
    found = _differences(table, meta)
    if found:
        raise ValueError("; ".join(found))
    sizes = table[:, _VOCAB].tolist()
    total = sum(sizes)
    expected = int(table[0, _VOCAB_ARG])
    if expected >= 0 and total != expected:
        raise ValueError(
            f"vocab_size is {expected} but the slices of {meta.dtypes[0][0]} held by the ranks "
            f"have sizes {sizes}, which add up to {total}"
        )
    return sum(sizes[:rank]), total


# --- exact token agreement ----------------------------------------------------------------------


def id_digits(vocab_size: int, dtype: torch.dtype) -> tuple[int, int]:
    """``(digits, bits)``: ids below ``vocab_size`` as ``digits`` integers of ``bits`` bits each,
    every one exactly representable in ``dtype`` (24 bits for fp32, 53 for fp64)."""
    bits = 1 - round(math.log2(torch.finfo(dtype).eps))
    return max(1, math.ceil((vocab_size - 1).bit_length() / bits)), bits


def write_ids(out: Tensor, ids: Tensor, bits: int) -> None:
    """Write the base-``2**bits`` digits of ``ids (N,)`` into ``out (2·D, N)``: the digits in
    the first ``D`` rows, their negatives in the last ``D``. After an all-reduce (max), row
    ``d`` holds the largest digit over the ranks and row ``D + d`` minus the smallest: the ids
    agree on every rank exactly when the two are equal."""
    d = out.shape[0] // 2
    for k in range(d):
        digit = (ids >> (bits * k)) & ((1 << bits) - 1) if d > 1 else ids
        out[k] = digit
        torch.neg(out[k], out=out[d + k])


def check_same_ids(reduced: Tensor, shape: torch.Size, vocab: int | None = None) -> None:
    """Raise (identically on every rank) unless the all-reduced digits show identical ids, and,
    given ``vocab``, ids in ``[0, vocab)``.

    The range is checked here too, on the reduced digits that every rank holds alike: with the
    value checks off (which skip the local range check), an id that no rank's slice holds would
    otherwise give a plausible ``-logsumexp``; this read is made in any case (the comparison of
    the ranks' ids).
    """
    d = reduced.shape[0] // 2
    differ = (reduced[:d] != -reduced[d:]).any(dim=0)
    if vocab is not None and not bool(differ.any()):
        bits = 1 - round(math.log2(torch.finfo(reduced.dtype).eps))
        digits = reduced[:d].long()
        values = sum((digits[k] << (bits * k) for k in range(1, d)), digits[0])
        bad = (values < 0) | (values >= vocab)
        if bool(bad.any()):
            # (a negative id spread over several digits reads back as a large one)
            got = int(values[bad][0]) if d == 1 else "outside it"
            raise ValueError(
                f"tokens must lie in [0, {vocab}) for a vocabulary of {vocab}, got a token id {got}"
            )
    if bool(differ.any()):
        where = differ.nonzero().flatten()
        flat, index = int(where[0]), []
        for size in reversed(shape):  # (torch.unravel_index is not in torch 2.1)
            flat, i = divmod(flat, size)
            index.append(i)
        first = tuple(reversed(index))
        hi, lo = reduced[:d, where[0]], -reduced[d:, where[0]]
        bits = 1 - round(math.log2(torch.finfo(reduced.dtype).eps))
        ids = [sum(int(v) << (bits * k) for k, v in enumerate(x.tolist())) for x in (lo, hi)]
        raise ValueError(
            f"tokens must be identical on every rank, got different token ids at "
            f"{where.numel()} of {differ.numel()} positions (the first at index {first}, "
            f"ids from {ids[0]} to {ids[1]} across the ranks)"
        )


def check_same_tokens(group: Any, ids: Tensor, vocab: int, dtype: torch.dtype, what: str) -> None:
    """Raise on every rank unless all ranks hold identical token ids in ``[0, vocab)``.

    One all-reduce (max) of the ids' exact digits in ``dtype`` and their negatives; the range
    check runs inside the guarded computation, so that a rank whose ids differ and fail it
    does not leave alone.
    """
    digits, bits = id_digits(vocab, dtype)
    buffer = torch.zeros(2 * digits * ids.numel() + 1, dtype=dtype, device=ids.device)
    top = buffer[:-1].view(2 * digits, ids.numel())

    def fill() -> None:
        checked = check_tokens("tokens", ids, ids.shape, vocab)
        write_ids(top, checked.reshape(-1), bits)

    guarded_all_reduce(buffer, dist.ReduceOp.MAX, group, fill, what)
    check_same_ids(top, ids.shape, vocab)
