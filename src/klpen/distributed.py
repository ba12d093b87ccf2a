r"""Vocab-parallel log-probs and full KL over ``torch.distributed``, without gathering logits.

Chapter 8 of the book. In tensor-parallel training the output projection is split by columns:
rank ``r`` of a process group holds the logits ``z[..., V_r]`` of a contiguous slice ``V_r`` of
the vocabulary, the slices in rank order. Gathering the full logits to call
:func:`~klpen.get_logprobs_for_tokens` or :func:`~klpen.full_kl` would need ``B·T·V`` numbers
on every rank; both quantities only need a few numbers per row from each rank.

Each rank reduces its own slice, block by block, to per-row statistics: its local
log-sum-exp ``a_r = lse(z[V_r])`` (and ``b_r = lse(w[V_r])`` for the reference), the logit of
the target token when the rank owns it, and the KL of the two softmaxes *restricted* to its
slice, ``KL_r``. With ``m = max_r a_r`` and ``S = sum_r exp(a_r - m)``:

.. math::

    \begin{aligned}
    \mathrm{lse}(z) &= m + \log S, \\
    \log \pi(y) &= z_y - \mathrm{lse}(z),
    \end{aligned}

and with ``π_r = exp(a_r - lse(z))`` and ``ρ_r = exp(b_r - lse(w))``, the mass of slice ``r``
under the policy and the reference, the chain rule of the KL divergence gives

.. math:: \mathrm{KL}(p \,\|\, q)
    = \sum_r \pi_r \Big[\mathrm{KL}_r + \log \frac{\pi_r}{\rho_r}\Big].

Both take ``temperature=`` (the distributions are then ``softmax(z / T)``), as their
single-process counterparts do. The log-prob keeps the global log-sum-exp split as
``max + log S`` (each slice shifted by its own row max), so that a large common offset of the
logits costs no digits.

:func:`aggregate` is the data-parallel counterpart of :func:`klpen.aggregate`: each rank holds
other rows of the batch, and the token counts and sums are made global.

Failure on one rank is failure on every rank. Every input is checked before the first
collective; what can still fail afterwards (the local block computation) is caught, and a flag
travels with the next collective, so that every rank raises — the rank that failed its own
error, the others an error that names it and repeats its message — and no rank is ever left
waiting in a collective that its peers will not join.

Communication per forward call (``N`` = number of rows, i.e. the product of the leading
dimensions; floats in the compute dtype, fp32 for half-precision input; ``+1``: the failure
flag):

* ``vocab_parallel_logprobs``: one all-gather of 16 ``int64`` metadata per rank, one
  all-reduce (max) of ``3·N + 1`` floats (the slices' row maxima and the token ids and their
  negatives, which compares the tokens of all ranks exactly), one all-reduce (sum) of
  ``2·N + 1`` floats;
* ``vocab_parallel_full_kl``: one all-gather of 16 ``int64`` metadata per rank, one all-reduce
  (max) of ``2·N + 1`` floats, one all-reduce (sum) of ``3·N + 1`` floats;
* ``aggregate``: one all-reduce (sum) of 7 ``float64``.

(Vocabularies beyond ``2**24`` ids with fp32 logits send each id as two or more exact digits.)
An error adds one ``all_gather_object`` of the failing ranks' messages. The backward passes
communicate nothing: each rank recomputes the softmax of its own slice per block from the saved
local logits and the global per-row statistics.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor

from ._chunks import block_rows_for, compute_dtype, exp_sums, take_rows
from ._validation import (
    check_choice,
    check_floating,
    check_no_nan,
    check_same_device,
    check_shape,
    check_temperature,
    check_token_ids,
    check_tokens,
)
from .full_kl import _kl_grads, _kl_row_stats
from .logprobs import _logprob_grad
from .masking import AGGREGATION_MODES, _checked, _zero_masked

if TYPE_CHECKING:  # at run time it is imported on first use, see __getattr__ below
    from ._vocab_parallel_linear import vocab_parallel_linear_logprobs

__all__ = [
    "aggregate",
    "vocab_parallel_full_kl",
    "vocab_parallel_linear_logprobs",
    "vocab_parallel_logprobs",
]

# --- metadata ---------------------------------------------------------------------------------
# Every vocab-parallel call starts with one all-gather of a fixed-length int64 vector per rank.
# From it, every rank learns the slice sizes (hence its vocabulary offset and the total
# vocabulary), whether every rank accepted its inputs, and checks that all ranks agree on
# dtypes and leading shapes. All decisions are taken from the gathered data only, so every rank
# raises the same way: a misuse on one rank never leaves the others waiting in a collective.
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_OK, _VOCAB, _DTYPE, _REF_DTYPE, _NDIM, _SHAPE_HASH, _VOCAB_ARG, _TEMPERATURE = range(8)
_DIMS = 8
_SHAPE_SLOTS = 8  # leading dimensions spelled out for error messages (all are hashed)
META_LENGTH = _DIMS + _SHAPE_SLOTS  # 16
_HASH_MODULUS = (1 << 61) - 1


def _resolve_group(group: object) -> Any:
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


def _check_local_logits(name: str, x: object) -> Tensor:
    t = check_floating(name, x, min_ndim=1)  # also refuses the tensor kinds klpen cannot use
    if t.dtype not in _FLOAT_DTYPES:
        names = ", ".join(str(d) for d in _FLOAT_DTYPES)
        raise TypeError(f"{name} must have one of the dtypes {names}; got {t.dtype}")
    if t.shape[-1] == 0:
        raise ValueError(
            f"{name} must hold at least one vocabulary column on every rank, got shape "
            f"{tuple(t.shape)}"
        )
    return t


def _check_vocab_size(vocab_size: object) -> int | None:
    if vocab_size is None:
        return None
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int):
        raise TypeError(f"vocab_size must be an int or None, got {type(vocab_size).__name__}")
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}")
    return vocab_size


def _shape_hash(shape: tuple[int, ...]) -> int:
    h = len(shape) + 1
    for d in shape:
        h = (h * 1_000_003 + d + 1) % _HASH_MODULUS
    return h


def _meta_device(group: Any) -> torch.device:
    # NCCL only moves CUDA tensors; every other backend takes the metadata on the CPU.
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# --- failure on one rank is failure on every rank ---------------------------------------------


def _raise_everywhere(group: Any, failure: BaseException | None, what: str) -> None:
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


def _guarded_all_reduce(
    buffer: Tensor, op: Any, group: Any, fill: Callable[[], None], what: str
) -> None:
    """``fill()`` this rank's part of ``buffer[:-1]``, then all-reduce ``buffer`` in place.

    ``buffer[-1]`` is the failure flag: 0 where ``fill`` succeeded, 1 where it raised. A rank
    that fails still joins the all-reduce, and then every rank raises
    (:func:`_raise_everywhere`): no rank waits for a peer that has left.
    """
    failure: Exception | None = None
    try:
        fill()
    except Exception as exc:  # any failure: it must reach the peers, then it is re-raised
        failure = exc
        buffer[-1] = 1
    dist.all_reduce(buffer, op=op, group=group)
    if bool(buffer[-1] != 0):
        _raise_everywhere(group, failure, what)


def _exchange_metadata(
    group: Any,
    logits: Tensor | None,
    reference: Tensor | None,
    vocab_size: int | None,
    failure: BaseException | None,
    what: str,
    temperature: float = 1.0,
) -> Tensor:
    """All-gather each rank's metadata; ``failure`` flags a rank that rejected its input.

    Returns a ``(world, META_LENGTH)`` int64 tensor on the CPU, identical on every rank; if
    some rank failed, every rank raises instead.
    """
    meta = torch.zeros(META_LENGTH, dtype=torch.int64)
    if failure is None and logits is not None:
        leading = tuple(logits.shape[:-1])
        meta[_OK] = 1
        meta[_VOCAB] = logits.shape[-1]
        meta[_DTYPE] = _FLOAT_DTYPES.index(logits.dtype)
        meta[_REF_DTYPE] = -1 if reference is None else _FLOAT_DTYPES.index(reference.dtype)
        meta[_NDIM] = len(leading)
        meta[_SHAPE_HASH] = _shape_hash(leading)
        meta[_VOCAB_ARG] = -1 if vocab_size is None else vocab_size
        # The temperature's float64 bits: equal exactly when the temperatures are.
        meta[_TEMPERATURE] = torch.tensor(temperature, dtype=torch.float64).view(torch.int64)
        dims = leading[:_SHAPE_SLOTS]
        meta[_DIMS : _DIMS + len(dims)] = torch.tensor(dims, dtype=torch.int64)
    device = _meta_device(group)
    world = dist.get_world_size(group)
    parts = [torch.empty(META_LENGTH, dtype=torch.int64, device=device) for _ in range(world)]
    dist.all_gather(parts, meta.to(device), group=group)
    gathered = torch.stack(parts).cpu()
    if bool((gathered[:, _OK] == 0).any()):
        _raise_everywhere(group, failure, what)
    return gathered


def _leading_shape(row: Tensor) -> str:
    ndim = int(row[_NDIM])
    dims = [str(int(d)) for d in row[_DIMS : _DIMS + min(ndim, _SHAPE_SLOTS)]]
    if ndim > _SHAPE_SLOTS:
        dims.append("...")
    return "(" + ", ".join(dims) + ("," if ndim == 1 else "") + ")"


def _first_mismatch(meta: Tensor, columns: slice | int) -> int | None:
    """The first rank whose ``columns`` of metadata differ from rank 0's, or None."""
    same = (meta[:, columns] == meta[0, columns]).reshape(meta.shape[0], -1).all(dim=1)
    bad = (~same).nonzero()
    return int(bad[0]) if bad.numel() else None


def _check_agreement(
    meta: Tensor, rank: int, logits_name: str, reference_name: str | None
) -> tuple[int, int]:
    """Raise unless all ranks agree; return ``(offset, total_vocab)`` of this rank."""
    r = _first_mismatch(meta, _DTYPE)
    if r is not None:
        raise ValueError(
            f"{logits_name} must have the same dtype on every rank, got "
            f"{_FLOAT_DTYPES[int(meta[0, _DTYPE])]} on rank 0 and "
            f"{_FLOAT_DTYPES[int(meta[r, _DTYPE])]} on rank {r}"
        )
    r = _first_mismatch(meta, _REF_DTYPE)
    if r is not None and reference_name is not None:
        raise ValueError(
            f"{reference_name} must have the same dtype on every rank, got "
            f"{_FLOAT_DTYPES[int(meta[0, _REF_DTYPE])]} on rank 0 and "
            f"{_FLOAT_DTYPES[int(meta[r, _REF_DTYPE])]} on rank {r}"
        )
    r = _first_mismatch(meta, slice(_NDIM, _SHAPE_HASH + 1))
    if r is not None:
        raise ValueError(
            f"{logits_name} must have the same leading shape on every rank (only the last, "
            f"vocabulary axis is split), got {_leading_shape(meta[0])} on rank 0 and "
            f"{_leading_shape(meta[r])} on rank {r}"
        )
    r = _first_mismatch(meta, _TEMPERATURE)
    if r is not None:
        t0, tr = (float(meta[i, _TEMPERATURE].view(torch.float64)) for i in (0, r))
        raise ValueError(
            f"temperature must be the same on every rank, got {t0} on rank 0 and {tr} on rank {r}"
        )
    sizes = meta[:, _VOCAB].tolist()
    total = sum(sizes)
    r = _first_mismatch(meta, _VOCAB_ARG)
    if r is not None:
        raise ValueError(
            f"vocab_size must be the same on every rank, got {int(meta[0, _VOCAB_ARG])} on "
            f"rank 0 and {int(meta[r, _VOCAB_ARG])} on rank {r} (-1 means None)"
        )
    expected = int(meta[0, _VOCAB_ARG])
    if expected >= 0 and total != expected:
        raise ValueError(
            f"vocab_size is {expected} but the slices of {logits_name} held by the ranks have "
            f"sizes {sizes}, which add up to {total}"
        )
    return sum(sizes[:rank]), total


# --- exact token agreement ----------------------------------------------------------------------


def _id_digits(vocab_size: int, dtype: torch.dtype) -> tuple[int, int]:
    """``(digits, bits)``: ids below ``vocab_size`` as ``digits`` integers of ``bits`` bits each,
    every one exactly representable in ``dtype`` (24 bits for fp32, 53 for fp64)."""
    bits = 1 - round(math.log2(torch.finfo(dtype).eps))
    return max(1, math.ceil((vocab_size - 1).bit_length() / bits)), bits


def _write_ids(out: Tensor, ids: Tensor, bits: int) -> None:
    """Write the base-``2**bits`` digits of ``ids (N,)`` into ``out (2·D, N)``: the digits in
    the first ``D`` rows, their negatives in the last ``D``. After an all-reduce (max), row
    ``d`` holds the largest digit over the ranks and row ``D + d`` minus the smallest: the ids
    agree on every rank exactly when the two are equal."""
    d = out.shape[0] // 2
    for k in range(d):
        digit = (ids >> (bits * k)) & ((1 << bits) - 1) if d > 1 else ids
        out[k] = digit
        torch.neg(out[k], out=out[d + k])


def _check_same_ids(reduced: Tensor, shape: torch.Size) -> None:
    """Raise (identically on every rank) unless the all-reduced digits show identical ids."""
    d = reduced.shape[0] // 2
    differ = (reduced[:d] != -reduced[d:]).any(dim=0)
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


def _shifted_exp(local: Tensor, top: Tensor, out: Tensor, scale: float = 1.0) -> Tensor:
    """``out = exp(scale · (local - top))``, with ``local - top`` written into ``local`` and
    returned."""
    shifted = local.sub_(top)
    torch.exp(shifted if scale == 1.0 else shifted * scale, out=out)
    return shifted


# --- autograd functions: the block math of logprobs.py and full_kl.py, plus collectives -------


class _VocabParallelLogProbs(torch.autograd.Function):
    """``log_softmax(full logits)[token]`` per row from each rank's slice of the vocabulary."""

    @staticmethod
    def forward(
        ctx: Any,
        logits: Tensor,
        tokens: Tensor,
        offset: int,
        total: int,
        rows: int,
        scale: float,
        group: Any,
    ) -> Tensor:
        # ``scale`` = k, the inverse temperature: the distribution is softmax(k z).
        dtype = compute_dtype(logits.dtype)
        n = tokens.numel()
        digits, bits = _id_digits(total, dtype)
        # All-reduce (max): each slice's row max c_r, the token ids' digits and their
        # negatives, a flag.
        top_buffer = torch.zeros((1 + 2 * digits) * n + 1, dtype=dtype, device=logits.device)
        top = top_buffer[:-1].view(1 + 2 * digits, n)
        # All-reduce (sum): e^{k (c_r - c)} s_r with s_r = sum of e^{k (z - c_r)} over the
        # slice and c the global row max; k (z_y - c) from the rank that owns y (0 elsewhere);
        # a flag.
        sum_buffer = torch.zeros(2 * n + 1, dtype=dtype, device=logits.device)
        sums = sum_buffer[:-1].view(2, n)
        saved: dict[str, Tensor] = {}

        def local_statistics() -> None:
            ids = check_tokens("tokens", tokens, tokens.shape, total).reshape(-1)
            local = ids - offset
            owned = (local >= 0) & (local < logits.shape[-1])
            index = torch.where(owned, local, 0).unsqueeze(-1)
            # One gather over the whole (possibly strided) tensor reads N numbers: no copy.
            saved["target"] = logits.gather(-1, index.view(*tokens.shape, 1)).reshape(-1)
            centre = logits.amax(dim=-1).reshape(-1).to(dtype)
            # Shifted by the row max, every term is at most 1 and one of them is 1: the sum
            # lies in [1, V_r], exact. A slice of -inf only (c_r = -inf) is summed unshifted
            # to 0 and adds nothing below.
            shift = torch.where(torch.isfinite(centre), centre, 0.0)
            saved["s"] = exp_sums(logits, rows, dtype, shift, scale)
            saved["centre"] = top[0] = centre
            _write_ids(top[1:], ids, bits)
            saved["index"], saved["owned"] = index, owned

        def slice_masses() -> None:
            # The log-sum-exp stays split as c + log S, S = sum_r e^{c_r - c} s_r in [1, V]:
            # a large common offset of the logits costs no digits (c is exact, z_y - c is the
            # difference of two nearby numbers), as in get_logprobs_for_tokens. A row that is
            # -inf on every rank gives -inf - (-inf) = NaN, reported by the caller.
            _shifted_exp(saved["centre"], top[0], sums[0], scale)
            sums[0].mul_(saved["s"])
            target = saved["target"].to(dtype) - top[0]
            if scale != 1.0:
                target.mul_(scale)
            sums[1] = target.masked_fill_(~saved["owned"], 0.0)

        what = "vocab_parallel_logprobs"
        _guarded_all_reduce(top_buffer, dist.ReduceOp.MAX, group, local_statistics, what)
        _check_same_ids(top[1:], tokens.shape)
        _guarded_all_reduce(sum_buffer, dist.ReduceOp.SUM, group, slice_masses, what)
        log_s = sums[0].log_()
        logp = sums[1].sub(log_s).view(tokens.shape)
        # The global log-sum-exp of k z is k c + log S, kept as the two parts.
        ctx.save_for_backward(logits, saved["index"], saved["owned"], top[0], log_s)
        ctx.rows, ctx.scale = rows, scale
        return logp

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor, None, None, None, None, None, None]:
        logits, index, owned, centre, log_s = ctx.saved_tensors
        # d/dz_j [k z_y - lse(k z)] = k (1[j = y] - softmax(k z)_j): the indicator lives on one
        # rank only; the softmax of each block is e^{k (z - c) - log S}, exact at any offset.
        grad = _logprob_grad(
            logits, index, centre, grad_out, ctx.rows, owned, log_s=log_s, scale=ctx.scale
        )
        return grad, None, None, None, None, None, None


class _VocabParallelFullKL(torch.autograd.Function):
    """``KL(softmax(z) ‖ softmax(w))`` per row from each rank's slices of ``z`` and ``w``."""

    @staticmethod
    def forward(
        ctx: Any, policy: Tensor, reference: Tensor, rows: int, scale: float, group: Any
    ) -> Tensor:
        # ``scale`` = k, the inverse temperature: the distributions are softmax(k z), softmax(k w).
        dtype = compute_dtype(torch.promote_types(policy.dtype, reference.dtype))
        n = policy.shape[:-1].numel()
        # All-reduce (max): local lse of z and of w, a flag. All-reduce (sum): π_r·S_a,
        # ρ_r·S_b, π_r·S_a·[KL_r + log(π_r/ρ_r)] (S: the sums of exp(lse - max)), a flag.
        top_buffer = torch.zeros(2 * n + 1, dtype=dtype, device=policy.device)
        sum_buffer = torch.zeros(3 * n + 1, dtype=dtype, device=policy.device)
        top, sums = top_buffer[:-1].view(2, n), sum_buffer[:-1].view(3, n)
        saved: dict[str, Tensor] = {}

        def local_statistics() -> None:
            # Rows: local lse of z, local lse of w, KL of the softmaxes restricted to this
            # slice; -inf and extreme logits in the slice are handled exactly, as in full_kl.
            local, saved["redo"] = _kl_row_stats(policy, reference, rows, dtype, scale)
            # A slice with no reference mass (b = -inf) has no restricted KL; its
            # log(π_r/ρ_r) is +inf, which decides the result wherever the policy has mass.
            local[2].masked_fill_(local[1] == float("-inf"), 0.0)
            top.copy_(local[:2])
            saved["local"] = local

        def slice_masses() -> None:
            local = saved["local"]
            # excerpt: combine
            shifted = _shifted_exp(local[:2], top, sums[:2])  # a_r - max a, b_r - max b
            mass = sums[0]
            contribution = mass * (local[2] + shifted[0] - shifted[1])
            sums[2] = contribution.masked_fill_(~(mass > 0), 0.0)
            # end excerpt

        what = "vocab_parallel_full_kl"
        # excerpt: combine
        _guarded_all_reduce(top_buffer, dist.ReduceOp.MAX, group, local_statistics, what)
        _guarded_all_reduce(sum_buffer, dist.ReduceOp.SUM, group, slice_masses, what)
        log_s_a, log_s_b = sums[0].log(), sums[1].log()
        # KL = Σ_r π_r [KL_r + log π_r - log ρ_r], with Σ_r π_r = 1 taken out of the sum.
        kl = (sums[2] / sums[0]).add_(log_s_b).sub_(log_s_a).clamp_(min=0.0)
        # end excerpt
        lse_z, lse_w = top[0].add_(log_s_a), top[1].add_(log_s_b)
        ctx.save_for_backward(policy, reference, lse_z, lse_w, kl, saved["redo"])
        ctx.rows, ctx.scale = rows, scale
        return kl.view(policy.shape[:-1])

    @staticmethod
    def backward(
        ctx: Any, grad_out: Tensor
    ) -> tuple[Tensor | None, Tensor | None, None, None, None]:
        policy, reference, lse_z, lse_w, kl, redo = ctx.saved_tensors
        needs = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        k = ctx.scale
        # The single-process gradient, evaluated on this slice with the global statistics of
        # each row; the rows redone are those with -inf or extreme logits in this slice.
        grads = _kl_grads(
            policy, reference, lse_z, lse_w, kl, redo[:0] if k != 1.0 else redo, grad_out,
            ctx.rows, needs, scale=k,
        )  # fmt: skip
        if k != 1.0 and redo.numel():
            # The shared redo of slice rows takes unscaled logits: give it these few rows
            # multiplied by k (and the upstream gradient times k, the chain rule), in float64
            # so that scaling before the subtraction of the log-sum-exp costs no digits.
            few = _kl_grads(
                take_rows(policy, redo).double() * k, take_rows(reference, redo).double() * k,
                lse_z[redo].double(), lse_w[redo].double(), kl[redo].double(),
                torch.arange(redo.numel(), device=redo.device),
                grad_out.reshape(-1)[redo].double() * k, ctx.rows, needs,
            )  # fmt: skip
            for grad, part in zip(grads, few, strict=True):
                if grad is not None and part is not None:
                    grad.view(-1, grad.shape[-1])[redo] = part.to(grad.dtype)
        return *grads, None, None, None


# --- public functions -------------------------------------------------------------------------


def vocab_parallel_logprobs(
    local_logits: Tensor,
    tokens: Tensor,
    group: dist.ProcessGroup | None = None,
    *,
    vocab_size: int | None = None,
    temperature: float = 1.0,
) -> Tensor:
    r"""Log-probabilities of chosen tokens when each rank holds a slice of the vocabulary.

    Rank ``r`` of ``group`` holds the logits of the contiguous vocabulary slice
    ``[o_r, o_r + V_r)``, where ``o_r = V_0 + … + V_{r-1}`` is learned from the slice sizes of
    all ranks (slices may be uneven; each holds at least one column). Returns, on every rank,
    ``get_logprobs_for_tokens(full_logits, tokens, temperature=T)`` for the concatenated
    logits. With ``k = 1/T``, ``c_r`` the row max of slice ``r`` and ``c = max_r c_r``:

    .. math::

        \begin{aligned}
        \log \pi(y) &= k (z_y - c) - \log S, \\
        S &= \textstyle\sum_r e^{k (c_r - c)} s_r, \\
        s_r &= \textstyle\sum_{v \in V_r} e^{k (z_v - c_r)},
        \end{aligned}

    where ``z_y`` comes from the one rank that owns token ``y``. The log-sum-exp stays split
    as ``k c + log S`` (``1 <= S <= V``): a large common offset of the logits costs no digits,
    as in the single-process function.

    Args:
        local_logits: ``(..., V_r)`` floating logits of this rank's slice. The leading shape
            and dtype must be the same on every rank.
        tokens: ``(...)`` integer token ids in ``[0, V)`` (global ids, ``V = Σ_r V_r``),
            identical on every rank.
        group: the process group whose ranks hold the slices, in rank order; ``None`` for the
            default group.
        vocab_size: optional total ``V``; if given, the slice sizes must add up to it.
        temperature: the sampling temperature ``T`` (finite, > 0, the same on every rank):
            the distribution is ``softmax(z / T)``, computed without a copy of the logits, as
            in :func:`~klpen.get_logprobs_for_tokens`.

    Returns:
        ``(...)`` log-probabilities, the same on every rank: fp32 for half-precision logits,
        the logits' dtype otherwise. Differentiable w.r.t. ``local_logits``: if every rank
        back-propagates the same upstream gradient (a loss computed alike on every rank from
        the replicated result, as in tensor parallelism), each rank receives exactly its slice
        of the single-process gradient. The backward pass communicates nothing.

    Communication: one all-gather of 16 ``int64`` per rank (slice sizes and consistency
    checks), one all-reduce (max) of ``3·N + 1`` floats (the slices' row maxima, and the token
    ids and their negatives: the largest and smallest id at each position, which compares the
    tokens of all ranks exactly) and one all-reduce (sum) of ``2·N + 1`` floats, ``N`` = the
    number of rows; the ``+ 1`` is the failure flag. Memory is bounded as in
    :func:`~klpen.get_logprobs_for_tokens`: block-sized temporaries and a few numbers per row.

    Raises:
        TypeError, ValueError: wrong types, tensor kinds (nested, sparse, mkldnn, meta,
            complex, float8, unsigned ids wider than 8 bits), shapes or devices on any rank
            (the other ranks raise a ``ValueError`` naming it and repeating its message),
            dtypes, leading shapes or tokens that differ across ranks (any difference), token
            ids outside ``[0, V)``, slice sizes that do not add up to ``vocab_size``, no
            initialised process group; NaN or ``+inf`` logits, or a row whose logits are all
            ``-inf``. Every rank raises, none hangs.
        RuntimeError: the local computation failed on some rank (an unexpected error, such
            as running out of memory): that rank re-raises it, the others name it.

    Example (on each of two ranks, rank 0 holding columns 0-1 and rank 1 column 2)::

        >>> full = torch.tensor([[2.0, 0.0, 0.0]])
        >>> local = full[:, :2] if dist.get_rank() == 0 else full[:, 2:]  # doctest: +SKIP
        >>> vocab_parallel_logprobs(local, torch.tensor([0]))  # doctest: +SKIP
        tensor([-0.2395])

    The same numbers in one process, for comparison:

        >>> from klpen import get_logprobs_for_tokens
        >>> get_logprobs_for_tokens(full, torch.tensor([0]))
        tensor([-0.2395])
    """
    pg = _resolve_group(group)
    failure: Exception | None = None
    logits: Tensor | None = None
    vocab: int | None = None
    try:
        logits = _check_local_logits("local_logits", local_logits)
        tokens = check_token_ids("tokens", tokens)
        check_shape("tokens", tokens, logits.shape[:-1], "the leading shape of local_logits")
        check_same_device("tokens", tokens, "local_logits", logits)
        vocab = _check_vocab_size(vocab_size)
        t = check_temperature("temperature", temperature)
    except (TypeError, ValueError) as exc:
        failure, t = exc, 1.0
    # Every rank takes part in the metadata exchange, also one that rejected its inputs; then
    # all raise together.
    names = "local_logits/tokens/temperature"
    meta = _exchange_metadata(pg, logits, None, vocab, failure, names, t)
    assert logits is not None
    offset, total = _check_agreement(meta, dist.get_rank(pg), "local_logits", None)
    rows = block_rows_for(logits)
    out: Tensor = _VocabParallelLogProbs.apply(logits, tokens, offset, total, rows, 1.0 / t, pg)  # type: ignore[no-untyped-call]
    return check_no_nan(
        out,
        "local_logits contain NaN or +inf on some rank, or a row whose logits are -inf on "
        "every rank; got a NaN log-prob in those rows",
    )


def vocab_parallel_full_kl(
    local_policy_logits: Tensor,
    local_reference_logits: Tensor,
    group: dist.ProcessGroup | None = None,
    *,
    vocab_size: int | None = None,
    temperature: float = 1.0,
) -> Tensor:
    r"""Exact ``KL(π ‖ π_ref)`` over a vocabulary split across the ranks of a process group.

    Rank ``r`` holds the policy and reference logits of the contiguous vocabulary slice
    ``V_r`` (slices in rank order, possibly uneven). Returns, on every rank,
    ``full_kl(full_policy_logits, full_reference_logits, temperature=T)``. Below ``z`` and
    ``w`` stand for the logits divided by ``T``. With the local log-sum-exps
    ``a_r``, ``b_r`` of the two slices, the slice masses ``π_r = e^{a_r - lse(z)}``,
    ``ρ_r = e^{b_r - lse(w)}`` and ``KL_r`` the divergence of the two softmaxes restricted to
    the slice (the chain rule of the KL divergence):

    .. math::

        \begin{aligned}
        \mathrm{KL}(\pi \,\|\, \pi_\mathrm{ref})
            &= \sum_r \pi_r \Big[\mathrm{KL}_r + \log \frac{\pi_r}{\rho_r}\Big] \\
            &= \sum_r \sum_{v \in V_r} p_v (z_v - w_v) \\
            &\quad - \mathrm{lse}(z) + \mathrm{lse}(w).
        \end{aligned}

    Args:
        local_policy_logits: ``(..., V_r)`` floating policy logits of this rank's slice.
        local_reference_logits: ``(..., V_r)`` reference logits of the same slice, same shape.
            Shapes and dtypes must agree across ranks except for ``V_r``.
        group: the process group whose ranks hold the slices, in rank order; ``None`` for the
            default group.
        vocab_size: optional total ``V``; if given, the slice sizes must add up to it.
        temperature: the sampling temperature ``T`` (finite, > 0, the same on every rank):
            the divergence of ``softmax(z / T)`` from ``softmax(w / T)``, as in
            :func:`~klpen.full_kl`.

    Returns:
        ``(...)`` divergences, never negative, the same on every rank; dtype as
        :func:`~klpen.full_kl`. Differentiable w.r.t. both local inputs: with the same upstream
        gradient on every rank, each rank receives its slice of the single-process gradient.
        The backward pass communicates nothing. Edge cases as in :func:`~klpen.full_kl`.

    Communication: one all-gather of 16 ``int64`` per rank, one all-reduce (max) of
    ``2·N + 1`` floats and one all-reduce (sum) of ``3·N + 1`` floats, ``N`` = the number of
    rows.

    Raises:
        TypeError, ValueError: as :func:`~klpen.distributed.vocab_parallel_logprobs`, for both
            inputs.

    Example (on each of two ranks, rank 0 holding columns 0-1 and rank 1 column 2)::

        >>> z, w = torch.tensor([[2.0, 0.0, 0.0]]), torch.zeros(1, 3)
        >>> cols = slice(0, 2) if dist.get_rank() == 0 else slice(2, 3)  # doctest: +SKIP
        >>> vocab_parallel_full_kl(z[:, cols], w[:, cols])  # doctest: +SKIP
        tensor([0.4330])

    The same number in one process:

        >>> from klpen import full_kl
        >>> full_kl(z, w)
        tensor([0.4330])
    """
    pg = _resolve_group(group)
    failure: Exception | None = None
    policy: Tensor | None = None
    reference: Tensor | None = None
    vocab: int | None = None
    try:
        policy = _check_local_logits("local_policy_logits", local_policy_logits)
        reference = _check_local_logits("local_reference_logits", local_reference_logits)
        check_shape(
            "local_reference_logits",
            reference,
            policy.shape,
            "the shape of local_policy_logits",
        )
        check_same_device("local_reference_logits", reference, "local_policy_logits", policy)
        vocab = _check_vocab_size(vocab_size)
        t = check_temperature("temperature", temperature)
    except (TypeError, ValueError) as exc:
        failure, t = exc, 1.0
    names = "local_policy_logits/local_reference_logits/temperature"
    meta = _exchange_metadata(pg, policy, reference, vocab, failure, names, t)
    assert policy is not None and reference is not None
    _check_agreement(meta, dist.get_rank(pg), "local_policy_logits", "local_reference_logits")
    rows = block_rows_for(policy)
    kl: Tensor = _VocabParallelFullKL.apply(policy, reference, rows, 1.0 / t, pg)  # type: ignore[no-untyped-call]
    return check_no_nan(
        kl,
        "local_policy_logits or local_reference_logits contain NaN or +inf on some rank, "
        "or a row whose logits are -inf on every rank; got a NaN divergence in those rows",
    )


# --- data-parallel aggregation ------------------------------------------------------------------
_NUMERATOR, _DENOMINATOR, _MODES = 0, 1, 2
_AGGREGATE_LENGTH = _MODES + len(AGGREGATION_MODES) + 1  # + the failure flag


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
    values: Tensor, mask: Tensor, mode: str, group: dist.ProcessGroup | None = None
) -> Tensor:
    r""":func:`klpen.aggregate` over the rows of a batch split across a data-parallel group.

    Each rank holds its own rows: ``values`` and ``mask`` of shape ``(B_r, T_r)``, both sizes
    free to differ between ranks. Returns, on every rank, ``klpen.aggregate`` of the
    concatenated batch (the rows of all ranks, padded to one length with masked slots):
    counts and sums are global. With ``x`` the values, ``m`` the mask, ``n_b = Σ_t m_{b,t}``,
    ``C = Σ_{ranks} Σ_b n_b`` the global token count and ``R`` the global number of rows with
    a valid token:

    =========================  ===================================  =========================
    mode                       value                                gradient on this rank
    =========================  ===================================  =========================
    ``"token-mean"``           :math:`\sum m x / C`                 :math:`W m / C`
    ``"token-sum"``            :math:`\sum m x`                     :math:`W m`
    ``"seq-mean-token-mean"``  :math:`\sum_b (\sum_t m x / n_b)/R`  :math:`W m / (n_b R)`
    ``"seq-mean-token-sum"``   :math:`\sum_b \sum_t m x / R`        :math:`W m / R`
    =========================  ===================================  =========================

    The gradient w.r.t. this rank's ``values`` is ``W`` (the group's size) times this rank's
    slice of the gradient of the global aggregate. Data-parallel training (DDP, FSDP)
    *averages* the parameter gradients of the ranks, so that average is exactly the gradient
    of the global aggregate; averaging per-rank ``klpen.aggregate`` losses instead weighs a
    token on a rank with few tokens more than one on a rank with many. With no valid token
    (or, in the seq-mean modes, no valid row) in the whole group, every mode returns 0 with a
    zero gradient.

    Args:
        values: ``(B_r, T_r)`` floating tensor on this rank.
        mask: ``(B_r, T_r)`` bool, integer or floating 0/1 tensor. Whatever ``values`` holds at
            a masked slot (NaN, ``±inf``) reaches neither the value nor the gradient.
        mode: one of the four modes above, the same on every rank.
        group: the data-parallel process group; ``None`` for the default group.

    Returns:
        A 0-d tensor in ``values``' dtype, identical on every rank (sums and counts are
        accumulated in float64), differentiable w.r.t. ``values``.

    Communication: one all-reduce (sum) of 7 ``float64`` (numerator, denominator, the mode
    of every rank, a failure flag); the backward pass communicates nothing.

    Raises:
        TypeError, ValueError: wrong types, tensor kinds, shapes or devices, a mask that is
            not 0/1, an unknown mode, or NaN at a valid position, on any rank (the other ranks
            raise a ``ValueError`` naming it), or modes that differ between ranks. Every rank
            raises, none hangs.

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
    pg = _resolve_group(group)
    world = dist.get_world_size(pg)
    device = _meta_device(pg)
    buffer = torch.zeros(_AGGREGATE_LENGTH, dtype=torch.float64, device=device)
    local: dict[str, Any] = {}

    def local_sums() -> None:
        # The checks of klpen.aggregate: tensor kinds, dtype, device, a 0/1 mask of the same
        # shape, no NaN at a valid position.
        m = _checked(values, mask)
        x = values
        if x.dim() != 2:
            raise ValueError(f"values must have shape (B, T), got {tuple(x.shape)}")
        name = check_choice("mode", mode, AGGREGATION_MODES)
        kept = _zero_masked(x.detach(), m)  # the gradient comes from the Function
        counts = m.sum(-1, dtype=torch.float64)  # n_b
        if name == "seq-mean-token-mean":
            numerator = (kept.sum(-1, dtype=torch.float64) / counts.clamp(min=1)).sum()
        else:
            numerator = kept.sum(dtype=torch.float64)
        if name == "token-mean":
            denominator = counts.sum()
        elif name == "token-sum":
            denominator = torch.ones((), dtype=torch.float64, device=x.device)
        else:
            denominator = (counts > 0).sum(dtype=torch.float64)
        buffer[_NUMERATOR] = numerator
        buffer[_DENOMINATOR] = denominator
        buffer[_MODES + AGGREGATION_MODES.index(name)] = 1
        local.update(values=x, mask=m, counts=counts, mode=name)

    _guarded_all_reduce(buffer, dist.ReduceOp.SUM, pg, local_sums, "values/mask/mode")
    modes = buffer[_MODES:-1].tolist()
    if max(modes) != world:
        got = {AGGREGATION_MODES[i]: int(c) for i, c in enumerate(modes) if c}
        raise ValueError(
            f"mode must be the same on every rank, got these modes (and the "
            f"number of ranks using each): {got}"
        )
    x, m, name = local["values"], local["mask"], local["mode"]
    total = float(buffer[_NUMERATOR])
    denominator = float(buffer[_DENOMINATOR])
    if name == "token-sum":
        denominator = 1.0  # the all-reduce summed one 1 per rank
    value = total / denominator if denominator > 0 else 0.0
    # Per row: d value / d x_{b,t} at a valid token, times W (data-parallel averaging).
    if denominator == 0:
        factor = 0.0
    else:
        factor = world / denominator
    scale = torch.full((x.shape[0], 1), factor, dtype=torch.float64, device=x.device)
    if name == "seq-mean-token-mean":
        scale = scale / local["counts"].clamp(min=1).unsqueeze(-1)
    result = torch.tensor(value, dtype=torch.float64, device=x.device).to(x.dtype)
    out: Tensor = _DataParallelAggregate.apply(x, result, m, scale.to(compute_dtype(x.dtype)))  # type: ignore[no-untyped-call]
    return out


def __getattr__(name: str) -> Any:
    """``vocab_parallel_linear_logprobs``, the hidden-state form, imported on first use.

    It builds on the helpers above: importing it here at module level would be circular
    whenever ``klpen._vocab_parallel_linear`` is imported first (PEP 562 module attribute).
    """
    if name == "vocab_parallel_linear_logprobs":
        from ._vocab_parallel_linear import vocab_parallel_linear_logprobs

        return vocab_parallel_linear_logprobs
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
