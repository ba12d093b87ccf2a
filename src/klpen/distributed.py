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

    \mathrm{lse}(z) = m + \log S, \qquad
    \log \pi(y) = z_y - \mathrm{lse}(z),

and with ``π_r = exp(a_r - lse(z))`` and ``ρ_r = exp(b_r - lse(w))``, the mass of slice ``r``
under the policy and the reference, the chain rule of the KL divergence gives

.. math:: \mathrm{KL}(p \,\|\, q)
    = \sum_r \pi_r \Big[\mathrm{KL}_r + \log \frac{\pi_r}{\rho_r}\Big].

Communication per forward call (``N`` = number of rows, i.e. the product of the leading
dimensions; floats in the compute dtype, fp32 for half-precision input):

* ``vocab_parallel_logprobs``: one all-gather of 16 ``int64`` metadata per rank, one
  all-reduce (max) of ``N`` floats, one all-reduce (sum) of ``2·N`` floats;
* ``vocab_parallel_full_kl``: one all-gather of 16 ``int64`` metadata per rank, one all-reduce
  (max) of ``2·N`` floats, one all-reduce (sum) of ``3·N`` floats.

The backward passes communicate nothing: each rank recomputes the softmax of its own slice per
block from the saved local logits and the global per-row statistics.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ._chunks import block_rows_for, compute_dtype, row_logsumexp
from ._validation import (
    check_floating,
    check_no_nan,
    check_same_device,
    check_shape,
    check_token_ids,
    check_tokens,
)
from .full_kl import _kl_grads, _kl_row_stats
from .logprobs import _logprob_grad

__all__ = ["vocab_parallel_full_kl", "vocab_parallel_logprobs"]

# --- metadata ---------------------------------------------------------------------------------
# Every call starts with one all-gather of a fixed-length int64 vector per rank. From it, every
# rank learns the slice sizes (hence its vocabulary offset and the total vocabulary), and checks
# that all ranks agree on dtypes, leading shapes and tokens. All decisions are taken from the
# gathered data only, so every rank raises the same way: a misuse on one rank never leaves the
# others waiting in a collective.
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_SHAPE_SLOTS = 8  # leading dimensions spelled out for error messages (all are hashed)
_OK, _VOCAB, _DTYPE, _REF_DTYPE, _NDIM, _SHAPE_HASH, _TOK_SUM, _TOK_HASH, _VOCAB_ARG = range(9)
_DIMS = 9
META_LENGTH = _DIMS + _SHAPE_SLOTS - 1  # 16
_HASH_MODULUS = (1 << 61) - 1
_GOLDEN = 0x9E3779B1  # odd multiplier: position weights of the token fingerprint


def _resolve_group(group: object) -> Any:
    """The process group to use; checks that it exists and that this process belongs to it."""
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


def _shape_hash(shape: tuple[int, ...]) -> int:
    h = len(shape) + 1
    for d in shape:
        h = (h * 1_000_003 + d + 1) % _HASH_MODULUS
    return h


def _token_fingerprint(ids: Tensor) -> tuple[int, int]:
    """Two int64 sums that differ, with overwhelming probability, between different tokens.

    The plain sum detects any single changed id exactly; the position-weighted sum (wrapping
    modulo 2**64, hence independent of the summation order) detects permutations.
    """
    flat = ids.reshape(-1).cpu()
    weights = torch.arange(1, flat.numel() + 1, dtype=torch.int64).mul_(_GOLDEN)
    return int(flat.sum()), int((flat * weights).sum())


def _meta_device(group: Any) -> torch.device:
    # NCCL only moves CUDA tensors; every other backend takes the metadata on the CPU.
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _exchange_metadata(
    group: Any,
    logits: Tensor | None,
    reference: Tensor | None,
    ids: Tensor | None,
    vocab_size: int | None,
) -> Tensor:
    """All-gather each rank's metadata; ``logits is None`` flags a rank that rejected its input.

    Returns a ``(world, META_LENGTH)`` int64 tensor on the CPU, identical on every rank.
    """
    meta = torch.zeros(META_LENGTH, dtype=torch.int64)
    if logits is not None:
        leading = tuple(logits.shape[:-1])
        meta[_OK] = 1
        meta[_VOCAB] = logits.shape[-1]
        meta[_DTYPE] = _FLOAT_DTYPES.index(logits.dtype)
        meta[_REF_DTYPE] = -1 if reference is None else _FLOAT_DTYPES.index(reference.dtype)
        meta[_NDIM] = len(leading)
        meta[_SHAPE_HASH] = _shape_hash(leading)
        if ids is not None:
            meta[_TOK_SUM], meta[_TOK_HASH] = _token_fingerprint(ids)
        meta[_VOCAB_ARG] = -1 if vocab_size is None else vocab_size
        dims = leading[:_SHAPE_SLOTS]
        meta[_DIMS : _DIMS + len(dims)] = torch.tensor(dims, dtype=torch.int64)
    device = _meta_device(group)
    world = dist.get_world_size(group)
    parts = [torch.empty(META_LENGTH, dtype=torch.int64, device=device) for _ in range(world)]
    dist.all_gather(parts, meta.to(device), group=group)
    return torch.stack(parts).cpu()


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
    meta: Tensor, rank: int, logits_name: str, reference_name: str | None, has_tokens: bool
) -> tuple[int, int]:
    """Raise unless all ranks agree; return ``(offset, total_vocab)`` of this rank."""
    failed = (meta[:, _OK] == 0).nonzero().flatten().tolist()
    if failed:
        names = logits_name if reference_name is None else f"{logits_name}/{reference_name}"
        raise ValueError(
            f"{names}: rank(s) {failed} of the process group rejected their inputs (see the "
            "error raised there); every rank must pass valid inputs"
        )
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
    if has_tokens:
        r = _first_mismatch(meta, slice(_TOK_SUM, _TOK_HASH + 1))
        if r is not None:
            raise ValueError(
                f"tokens must be identical on every rank, got different token ids on rank {r} "
                "and rank 0"
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


def _check_local_logits(name: str, x: object) -> Tensor:
    t = check_floating(name, x, min_ndim=1)
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


# --- autograd functions: the block math of logprobs.py and full_kl.py, plus collectives -------


class _VocabParallelLogProbs(torch.autograd.Function):
    """``log_softmax(full logits)[token]`` per row from each rank's slice of the vocabulary."""

    @staticmethod
    def forward(
        ctx: Any, logits: Tensor, tokens: Tensor, offset: int, rows: int, group: Any
    ) -> Tensor:
        dtype = compute_dtype(logits.dtype)
        local = tokens.reshape(-1) - offset
        owned = (local >= 0) & (local < logits.shape[-1])
        index = torch.where(owned, local, 0).unsqueeze(-1)
        n = index.shape[0]
        # Row 0: exp(local lse - global max), row 1: the target logit (0 where not owned). One
        # gather over the whole (possibly strided) tensor reads N numbers: no copy.
        sums = torch.empty(2, n, dtype=dtype, device=logits.device)
        sums[1] = logits.gather(-1, index.view(*tokens.shape, 1)).reshape(-1)
        lse = row_logsumexp(logits, rows, dtype)  # -inf for a row that is all -inf here
        sums[1].masked_fill_(~owned, 0.0)
        top = lse.clone()
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
        # A slice whose logits are all -inf has lse -inf and adds exp(-inf) = 0; a row that is
        # -inf on every rank gives -inf - (-inf) = NaN, reported by the caller.
        torch.exp(lse.sub_(top), out=sums[0])
        dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
        lse = top.add_(sums[0].log_())
        ctx.save_for_backward(logits, index, owned, lse)
        ctx.rows = rows
        return sums[1].sub_(lse).view(tokens.shape)

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor, None, None, None, None]:
        logits, index, owned, lse = ctx.saved_tensors
        # d/dz_j [z_y - lse(z)] = 1[j = y] - softmax(z)_j: the indicator lives on one rank only.
        grad = _logprob_grad(logits, index, lse, grad_out, ctx.rows, owned)
        return grad, None, None, None, None


class _VocabParallelFullKL(torch.autograd.Function):
    """``KL(softmax(z) ‖ softmax(w))`` per row from each rank's slices of ``z`` and ``w``."""

    @staticmethod
    def forward(ctx: Any, policy: Tensor, reference: Tensor, rows: int, group: Any) -> Tensor:
        dtype = compute_dtype(torch.promote_types(policy.dtype, reference.dtype))
        # Rows: local lse of z, local lse of w, KL of the softmaxes restricted to this slice;
        # -inf and extreme logits in the slice are handled exactly, as in full_kl.
        local, redo = _kl_row_stats(policy, reference, rows, dtype)
        n = local.shape[1]
        # A slice with no reference mass (b = -inf) has no restricted KL; its log(π_r/ρ_r) is
        # +inf, which decides the result wherever the policy puts mass there.
        local[2].masked_fill_(local[1] == float("-inf"), 0.0)
        top = local[:2].clone()
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
        shifted = local[:2].sub_(top)  # a_r - max a, b_r - max b
        # Rows: exp(a_r - max a) = π_r·S_a, exp(b_r - max b) = ρ_r·S_b, π_r·S_a·[KL_r + ...].
        sums = torch.empty(3, n, dtype=dtype, device=policy.device)
        torch.exp(shifted, out=sums[:2])
        mass = sums[0]
        contribution = mass * (local[2] + shifted[0] - shifted[1])
        sums[2] = contribution.masked_fill_(~(mass > 0), 0.0)
        dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
        log_s_a, log_s_b = sums[0].log(), sums[1].log()
        # KL = Σ_r π_r [KL_r + log π_r - log ρ_r], with Σ_r π_r = 1 taken out of the sum.
        kl = (sums[2] / sums[0]).add_(log_s_b).sub_(log_s_a).clamp_(min=0.0)
        lse_z, lse_w = top[0].add_(log_s_a), top[1].add_(log_s_b)
        ctx.save_for_backward(policy, reference, lse_z, lse_w, kl, redo)
        ctx.rows = rows
        return kl.view(policy.shape[:-1])

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, Tensor | None, None, None]:
        policy, reference, lse_z, lse_w, kl, redo = ctx.saved_tensors
        needs = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        # The single-process gradient, evaluated on this slice with the global statistics of
        # each row; the rows redone are those with -inf or extreme logits in this slice.
        grads = _kl_grads(policy, reference, lse_z, lse_w, kl, redo, grad_out, ctx.rows, needs)
        return *grads, None, None


# --- public functions -------------------------------------------------------------------------


def vocab_parallel_logprobs(
    local_logits: Tensor,
    tokens: Tensor,
    group: dist.ProcessGroup | None = None,
    *,
    vocab_size: int | None = None,
) -> Tensor:
    r"""Log-probabilities of chosen tokens when each rank holds a slice of the vocabulary.

    Rank ``r`` of ``group`` holds the logits of the contiguous vocabulary slice
    ``[o_r, o_r + V_r)``, where ``o_r = V_0 + … + V_{r-1}`` is learned from the slice sizes of
    all ranks (slices may be uneven; each holds at least one column). Returns, on every rank,
    ``get_logprobs_for_tokens(full_logits, tokens)`` for the concatenated logits:

    .. math::

        \log \pi(y) = z_y - \big(m + \log \textstyle\sum_r e^{a_r - m}\big),
        \quad a_r = \log \sum_{v \in V_r} e^{z_v}, \quad m = \max_r a_r,

    where ``z_y`` comes from the one rank that owns token ``y``.

    Args:
        local_logits: ``(..., V_r)`` floating logits of this rank's slice. The leading shape
            and dtype must be the same on every rank.
        tokens: ``(...)`` integer token ids in ``[0, V)`` (global ids, ``V = Σ_r V_r``),
            identical on every rank.
        group: the process group whose ranks hold the slices, in rank order; ``None`` for the
            default group.
        vocab_size: optional total ``V``; if given, the slice sizes must add up to it.

    Returns:
        ``(...)`` log-probabilities, the same on every rank: fp32 for half-precision logits,
        the logits' dtype otherwise. Differentiable w.r.t. ``local_logits``: if every rank
        back-propagates the same upstream gradient (a loss computed alike on every rank from
        the replicated result, as in tensor parallelism), each rank receives exactly its slice
        of the single-process gradient. The backward pass communicates nothing.

    Communication: one all-gather of 16 ``int64`` per rank (slice sizes and consistency
    checks), one all-reduce (max) of ``N`` floats and one all-reduce (sum) of ``2·N`` floats,
    ``N`` = the number of rows. Memory is bounded as in
    :func:`~klpen.get_logprobs_for_tokens`: block-sized temporaries and a few numbers per row.

    Raises:
        TypeError, ValueError: wrong types, shapes or devices on any rank (the other ranks
            raise a ``ValueError`` naming it), dtypes, leading shapes or tokens that differ
            across ranks, token ids outside ``[0, V)``, slice sizes that do not add up to
            ``vocab_size``, no initialised process group; NaN or ``+inf`` logits, or a row
            whose logits are all ``-inf``.

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
    error: Exception | None = None
    logits: Tensor | None = None
    ids: Tensor | None = None
    try:
        logits = _check_local_logits("local_logits", local_logits)
        tokens = check_token_ids("tokens", tokens)
        check_shape("tokens", tokens, logits.shape[:-1], "the leading shape of local_logits")
        check_same_device("tokens", tokens, "local_logits", logits)
        ids = tokens.long()
        vocab = _check_vocab_size(vocab_size)
    except (TypeError, ValueError) as exc:
        error, logits, vocab = exc, None, None
    # Every rank takes part in the metadata exchange, also one that rejected its inputs.
    meta = _exchange_metadata(pg, logits, None, ids, vocab)
    if error is not None:
        raise error
    assert logits is not None and ids is not None
    offset, total = _check_agreement(meta, dist.get_rank(pg), "local_logits", None, True)
    # Identical on every rank (checked above), so every rank decides alike here.
    ids = check_tokens("tokens", ids, logits.shape[:-1], total)
    rows = block_rows_for(logits)
    out: Tensor = _VocabParallelLogProbs.apply(logits, ids, offset, rows, pg)  # type: ignore[no-untyped-call]
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
) -> Tensor:
    r"""Exact ``KL(π ‖ π_ref)`` over a vocabulary split across the ranks of a process group.

    Rank ``r`` holds the policy and reference logits of the contiguous vocabulary slice
    ``V_r`` (slices in rank order, possibly uneven). Returns, on every rank,
    ``full_kl(full_policy_logits, full_reference_logits)``. With the local log-sum-exps
    ``a_r``, ``b_r`` of the two slices, the slice masses ``π_r = e^{a_r - lse(z)}``,
    ``ρ_r = e^{b_r - lse(w)}`` and ``KL_r`` the divergence of the two softmaxes restricted to
    the slice (the chain rule of the KL divergence):

    .. math:: \mathrm{KL}(\pi \,\|\, \pi_\mathrm{ref}) = \sum_r \pi_r
        \Big[\mathrm{KL}_r + \log \frac{\pi_r}{\rho_r}\Big]
        = \sum_r \sum_{v \in V_r} p_v (z_v - w_v) - \mathrm{lse}(z) + \mathrm{lse}(w).

    Args:
        local_policy_logits: ``(..., V_r)`` floating policy logits of this rank's slice.
        local_reference_logits: ``(..., V_r)`` reference logits of the same slice, same shape.
            Shapes and dtypes must agree across ranks except for ``V_r``.
        group: the process group whose ranks hold the slices, in rank order; ``None`` for the
            default group.
        vocab_size: optional total ``V``; if given, the slice sizes must add up to it.

    Returns:
        ``(...)`` divergences, never negative, the same on every rank; dtype as
        :func:`~klpen.full_kl`. Differentiable w.r.t. both local inputs: with the same upstream
        gradient on every rank, each rank receives its slice of the single-process gradient.
        The backward pass communicates nothing. Edge cases as in :func:`~klpen.full_kl`.

    Communication: one all-gather of 16 ``int64`` per rank, one all-reduce (max) of ``2·N``
    floats and one all-reduce (sum) of ``3·N`` floats, ``N`` = the number of rows.

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
    error: Exception | None = None
    policy: Tensor | None = None
    reference: Tensor | None = None
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
    except (TypeError, ValueError) as exc:
        error, policy, vocab = exc, None, None
    meta = _exchange_metadata(pg, policy, reference, None, vocab)
    if error is not None:
        raise error
    assert policy is not None and reference is not None
    _check_agreement(
        meta, dist.get_rank(pg), "local_policy_logits", "local_reference_logits", False
    )
    rows = block_rows_for(policy)
    kl: Tensor = _VocabParallelFullKL.apply(policy, reference, rows, pg)  # type: ignore[no-untyped-call]
    return check_no_nan(
        kl,
        "local_policy_logits or local_reference_logits contain NaN or +inf on some rank, "
        "or a row whose logits are -inf on every rank; got a NaN divergence in those rows",
    )
