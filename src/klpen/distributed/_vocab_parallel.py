r"""Vocab-parallel log-probs and full KL: each rank holds a slice of the vocabulary's logits.

Each rank reduces its own slice, block by block, with the single-process kernels, to a few
numbers per row; the collectives of :mod:`klpen.distributed._protocol` combine them. For the
log-prob: with ``c_r`` the row max of slice ``r``, ``c = max_r c_r`` and
``s_r = Σ_{v ∈ V_r} e^{k (z_v - c_r)}``, the log-sum-exp stays split as
``k c + log Σ_r e^{k (c_r - c)} s_r``, so that a large common offset of the logits costs no
digits. For the KL: every slice's log-sum-exps, restricted KL and ``E[d]`` are gathered and
combined in the centred form (:func:`_combine_slices`), exact down to the smallest divergences.
The backward passes communicate nothing.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from .._autograd import KernelFunction
from .._validation import (
    check_floating,
    check_no_nan,
    check_same_device,
    check_shape,
    check_temperature,
    check_token_ids,
    check_tokens,
    promoted_dtype,
)
from ._kernels import (
    EXACT_SHARE,
    LogProbGrad,
    LogProbRows,
    block_rows_for,
    centred_kl,
    compute_dtype,
    exact_rows,
    exp_sums,
    index_blocks,
    kl_grads,
    kl_row_stats,
    take_rows,
    token_logprob_grad,
)
from ._protocol import (
    FLOAT_DTYPES,
    Metadata,
    check_agreement,
    check_same_ids,
    exchange_metadata,
    guarded_all_gather,
    guarded_all_reduce,
    id_digits,
    resolve_group,
    write_ids,
)

__all__ = ["vocab_parallel_full_kl", "vocab_parallel_logprobs"]


def _check_local_logits(name: str, x: object) -> Tensor:
    t = check_floating(name, x, min_ndim=1)  # also refuses the tensor kinds klpen cannot use
    if t.dtype not in FLOAT_DTYPES:
        names = ", ".join(str(d) for d in FLOAT_DTYPES)
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


def _shifted_exp(local: Tensor, top: Tensor, out: Tensor, scale: float = 1.0) -> Tensor:
    """``out = exp(scale · (local - top))``, with ``local - top`` written into ``local`` and
    returned."""
    shifted = local.sub_(top)
    torch.exp(shifted if scale == 1.0 else shifted * scale, out=out)
    return shifted


# --- autograd functions: the block math of logprobs.py and full_kl.py, plus collectives -------


class _VocabParallelLogProbs(KernelFunction):
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
        KernelFunction.named(ctx, "vocab_parallel_logprobs")
        # ``scale`` = k, the inverse temperature: the distribution is softmax(k z).
        dtype = compute_dtype(logits.dtype)
        n = tokens.numel()
        digits, bits = id_digits(total, dtype)
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
            write_ids(top[1:], ids, bits)
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
        guarded_all_reduce(top_buffer, dist.ReduceOp.MAX, group, local_statistics, what)
        check_same_ids(top[1:], tokens.shape, total)
        guarded_all_reduce(sum_buffer, dist.ReduceOp.SUM, group, slice_masses, what)
        log_s = sums[0].log_()
        logp = sums[1].sub(log_s).view(tokens.shape)
        # The global log-sum-exp of k z is k c + log S, kept as the two parts.
        ctx.save_for_backward(logits, saved["index"], saved["owned"], top[0], log_s)
        ctx.rows, ctx.scale = rows, scale
        return logp

    @staticmethod
    def gradients(ctx: Any, grad_out: Tensor) -> tuple[Tensor, None, None, None, None, None, None]:
        logits, index, owned, centre, log_s = ctx.saved_tensors
        # d/dz_j [k z_y - lse(k z)] = k (1[j = y] - softmax(k z)_j): the indicator lives on one
        # rank only; the softmax of each block is e^{k (z - c) - log S}, exact at any offset.
        stats = LogProbRows(centre, log_s, None, None)
        upstream = LogProbGrad(index, grad_out, None, owned)
        grad = token_logprob_grad(logits, stats, upstream, ctx.rows, ctx.scale)
        return grad, None, None, None, None, None, None


def _precise_rows(
    policy: Tensor, reference: Tensor, redo: Tensor, rows: int, scale: float, out: Tensor
) -> None:
    """``out[:, redo]`` = the four statistics of the rows ``redo``, in float64, a few at a time.

    The kernel's float64 rows (``-inf``, extreme or offset logits) come back rounded to the
    compute dtype: a log-sum-exp of ``1e4`` then carries an error of ``1e-3``, and so does
    ``E_p[d]`` where one logit is ``1e4`` (``d = 1e4 - w`` there), which would reach the slice
    masses and the slices' log-ratios below. These rows are computed again, centred, and kept
    in float64 (``out``: the ``(4, N)`` float64 rows of the gathered buffer).
    """
    for index in index_blocks(redo, max(1, rows // EXACT_SHARE)):
        exact = exact_rows(take_rows(policy, index), take_rows(reference, index), scale)
        out[:, index] = torch.stack(exact[:4])


def _log_softmax_parts(x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(softmax(x), max(x), log Σ e^{x - max})`` over the first axis, the weights normalised
    by the sum itself, so that they add up to 1 to rounding (``exp(x - lse(x))`` is off by
    ``eps · |x|``), and the log-sum-exp kept in two parts (``max + log Σ`` rounds away the
    second where the first is ``3e38``)."""
    top = x.amax(0)
    e = torch.exp(x - torch.where(torch.isfinite(top), top, 0.0))
    total = e.sum(0)
    return e / total, top, total.log()


def _combine_slices(stats: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    r"""``(KL, E_p[d], lse(k z), lse(k w))`` of whole rows from every slice's statistics.

    ``stats``: ``(W, 4, N)`` float64, for each rank ``r`` the rows ``a_r = lse(k z[V_r])``,
    ``b_r = lse(k w[V_r])``, ``KL_r`` (the divergence restricted to the slice) and
    ``m_r = E_{p_r}[d]``, ``d = k (z - w)``. With ``π_r = softmax(a)_r`` and
    ``ρ_r = softmax(b)_r`` the slice masses, the chain rule of the KL divergence gives two
    non-negative parts,

    .. math:: \mathrm{KL} = \sum_r \pi_r \mathrm{KL}_r + \mathrm{KL}(\pi \,\|\, \rho),

    and the second is the KL of two small categoricals whose log-ratio
    ``δ_r = b_r - a_r = KL_r - m_r`` is known without the offsets of the logits (the rows
    redone in float64 carry float64 statistics: a ``KL_r - m_r`` with ``m_r ≈ 1e4``, one
    extreme logit, would otherwise keep the rounding of ``m_r``). It is
    computed in the centred form of :func:`~klpen.kernels.torch_kl.centred_kl` with the centre
    ``c = E_π[δ]``, ``v_r = δ_r - c``: ``F + (log1p(u) - u)``, every term non-negative or
    second order, so that a KL of ``1e-9`` costs no digits; where ``|u| >= 1/2`` (a large
    divergence, where that form would cancel) as ``log E_π[e^v] - E_π[v]``, in the log domain.
    Reference mass in slices the policy does not reach (``a_r = -inf``) adds
    ``Σ e^{b_r - lse(a) - c}`` to ``u`` and ``F``, each exponent taken relative to the slice
    ``o`` of the largest ``a_r``, as ``(b_r - b_o) - log Σ_s e^{a_s - a_o} + v_o``: free of
    the offsets too (with one policy logit of ``3e38``, ``b_r - lse(a)`` is ``-3e38``, and
    subtracting ``c ≈ -3e38`` from it leaves nothing of ``b_r``).
    """
    # excerpt: combine
    a, b, kl_r, mean_r = stats.unbind(1)
    mass, top_z, log_total_z = _log_softmax_parts(a)
    _, top_w, log_total_w = _log_softmax_parts(b)
    lse_z, lse_w = top_z + log_total_z, top_w + log_total_w
    log_mass = a - lse_z
    has = mass > 0
    delta = torch.where(has, kl_r - mean_r, 0.0)
    centre = (mass * delta).sum(0)
    v = torch.where(has, delta - centre, 0.0)
    sum_v = (mass * v).sum(0)
    anchor = a.argmax(0, keepdim=True)  # o: the slice of the largest policy mass
    log_extra = (b - b.gather(0, anchor)) - log_total_z + v.gather(0, anchor)
    log_extra = torch.where(has, -math.inf, log_extra)
    sum_f = (mass * (torch.expm1(v) - v)).sum(0) + log_extra.exp().sum(0)
    ones = torch.ones_like(sum_v)
    centred = centred_kl(ones, sum_v, sum_f, mass.amax(0), centre, torch.finfo(a.dtype).eps)[0]
    # Where the slices' log-ratios are not small (u = E_π[expm1 v] + extra beyond ±1/2), the
    # centred form would cancel (F and u both large): there the KL of the slice masses is
    # large enough for log E_π[e^v] - E_π[v] itself, summed in the log domain.
    direct = torch.logsumexp(torch.cat([torch.where(has, log_mass + v, -math.inf), log_extra]), 0)
    u = sum_v + sum_f
    kl_slices = torch.where(u.abs() < 0.5, centred, direct - sum_v)
    within = torch.where(has, mass * kl_r, 0.0).sum(0)
    kl = (within + kl_slices).clamp_(min=0.0)
    # end excerpt
    # Policy mass where the reference has none (a -inf reference logit, or a whole slice):
    # +inf, the true value.
    kl.masked_fill_((has & (torch.isinf(kl_r) | (b == -math.inf))).any(0), math.inf)
    # NaN or +inf logits, or a row of -inf only: NaN, for the caller to report.
    kl.masked_fill_(~(torch.isfinite(lse_z) & torch.isfinite(lse_w)), math.nan)
    return kl, torch.where(has, mass * mean_r, 0.0).sum(0), lse_z, lse_w


class _VocabParallelFullKL(KernelFunction):
    """``KL(softmax(k z) ‖ softmax(k w))`` per row from each rank's slices of ``z`` and ``w``."""

    @staticmethod
    def forward(
        ctx: Any, policy: Tensor, reference: Tensor, rows: int, scale: float, group: Any
    ) -> Tensor:
        KernelFunction.named(ctx, "vocab_parallel_full_kl")
        # ``scale`` = k, the inverse temperature: the distributions are softmax(k z), softmax(k w).
        dtype = compute_dtype(torch.promote_types(policy.dtype, reference.dtype))
        n = policy.shape[:-1].numel()
        # All-gather: a_r, b_r, KL_r, E_{p_r}[d] of every row in float64, and the failure flag.
        buffer = torch.zeros(4 * n + 1, dtype=torch.float64, device=policy.device)
        saved: dict[str, Tensor] = {}

        def local_statistics() -> None:
            # The single-process row statistics of this slice: exact, also for -inf and
            # extreme logits (those rows come back as ``redo``).
            stats, saved["redo"] = kl_row_stats(policy, reference, rows, dtype, scale)
            local = buffer[:-1].view(4, n)
            local.copy_(stats)
            _precise_rows(policy, reference, saved["redo"], rows, scale, local)

        what = "vocab_parallel_full_kl"
        gathered = guarded_all_gather(buffer, group, local_statistics, what)
        # Every rank combines the same gathered numbers the same way: identical results.
        kl64, mean_d, lse_z64, lse_w64 = _combine_slices(gathered.view(gathered.shape[0], 4, n))
        kl = kl64.to(dtype)
        lse_z, lse_w = lse_z64.to(dtype), lse_w64.to(dtype)
        # The gradient needs E_p[d] = lse_z - lse_w + KL; at a large common offset of the
        # logits the rounded log-sum-exps would cost it digits, so the saved "KL" is the
        # number that gives back E_p[d] from the rounded ones (the KL itself where infinite).
        offset = lse_z.double() - lse_w.double()
        kl_for_grad = torch.where(torch.isfinite(kl64), mean_d - offset, kl64).to(dtype)
        ctx.save_for_backward(policy, reference, lse_z, lse_w, kl_for_grad, saved["redo"])
        ctx.rows, ctx.scale = rows, scale
        return kl.view(policy.shape[:-1])

    @staticmethod
    def gradients(
        ctx: Any, grad_out: Tensor
    ) -> tuple[Tensor | None, Tensor | None, None, None, None]:
        policy, reference, lse_z, lse_w, kl, redo = ctx.saved_tensors
        needs = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        k = ctx.scale
        # The single-process gradient, evaluated on this slice with the global statistics of
        # each row; the rows redone are those with -inf or extreme logits in this slice.
        grads = kl_grads(
            policy, reference, lse_z, lse_w, kl, redo[:0] if k != 1.0 else redo, grad_out,
            ctx.rows, needs, scale=k,
        )  # fmt: skip
        if k != 1.0 and redo.numel():
            # The shared redo of slice rows takes unscaled logits: give it these few rows
            # multiplied by k (and the upstream gradient times k, the chain rule), in float64
            # so that scaling before the subtraction of the log-sum-exp costs no digits.
            few = kl_grads(
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
    pg = resolve_group(group)
    failure: Exception | None = None
    meta: Metadata | None = None
    try:
        logits = _check_local_logits("local_logits", local_logits)
        tokens = check_token_ids("tokens", tokens)
        check_shape("tokens", tokens, logits.shape[:-1], "the leading shape of local_logits")
        check_same_device("tokens", tokens, "local_logits", logits)
        # the single-process rule, in the dtype the logits are scaled in
        t = check_temperature("temperature", temperature, promoted_dtype(logits))
        meta = Metadata(
            vocab=logits.shape[-1],
            vocab_size=_check_vocab_size(vocab_size),
            leading_shape=tuple(logits.shape[:-1]),
            hidden_size=None,
            temperature=t,
            dtypes=(("local_logits", logits.dtype),),
        )
    except (TypeError, ValueError) as exc:
        failure = exc
    # Every rank takes part in the metadata exchange, also one that rejected its inputs; then
    # all raise together.
    table = exchange_metadata(pg, meta, failure, "local_logits/tokens/temperature")
    assert meta is not None
    offset, total = check_agreement(table, meta, dist.get_rank(pg))
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
    pg = resolve_group(group)
    failure: Exception | None = None
    meta: Metadata | None = None
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
        t = check_temperature("temperature", temperature, promoted_dtype(policy, reference))
        meta = Metadata(
            vocab=policy.shape[-1],
            vocab_size=_check_vocab_size(vocab_size),
            leading_shape=tuple(policy.shape[:-1]),
            hidden_size=None,
            temperature=t,
            dtypes=(
                ("local_policy_logits", policy.dtype),
                ("local_reference_logits", reference.dtype),
            ),
        )
    except (TypeError, ValueError) as exc:
        failure = exc
    names = "local_policy_logits/local_reference_logits/temperature"
    table = exchange_metadata(pg, meta, failure, names)
    assert meta is not None
    check_agreement(table, meta, dist.get_rank(pg))
    rows = block_rows_for(policy)
    kl: Tensor = _VocabParallelFullKL.apply(policy, reference, rows, 1.0 / t, pg)  # type: ignore[no-untyped-call]
    return check_no_nan(
        kl,
        "local_policy_logits or local_reference_logits contain NaN or +inf on some rank, "
        "or a row whose logits are -inf on every rank; got a NaN divergence in those rows",
    )
