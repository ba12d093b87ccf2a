"""The exact categorical KL divergence over the vocabulary, block by block.

Chapter 3 of the book. For policy logits ``z`` and reference logits ``w`` at one position,
with ``p = softmax(z)`` and ``q = softmax(w)``:

.. math::

    \\mathrm{KL}(p \\,\\|\\, q)
    = \\sum_v p_v \\big[(z_v - \\mathrm{lse}(z)) - (w_v - \\mathrm{lse}(w))\\big]

The naive code materialises ``log_softmax`` of both, ``exp`` of one and their product: four or
five ``(B, T, V)`` tensors. Here every row is reduced inside a cache-sized block, and the
backward pass recomputes what it needs from the saved logits and three numbers per row.
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
    exp_into,
    index_blocks,
    paired_row_blocks,
    shift_free_ok,
    sub_into,
    take_rows,
)
from ._validation import (
    check_coef,
    check_coef_fits,
    check_floating,
    check_no_nan,
    check_no_nan_at,
    check_same_device,
    check_shape,
    promoted_dtype,
    scaled_penalty,
)

__all__ = ["full_kl", "kl_penalized_reward"]


def _kl_terms(
    z: Tensor, w: Tensor, lse_z: Tensor, lse_w: Tensor, buf_p: Tensor, buf_t: Tensor
) -> tuple[Tensor, Tensor]:
    """``p = exp(z - lse_z)`` and ``p (log p - log q)`` of one block, written to the buffers.

    ``z``, ``w`` are ``(r, V)`` blocks of logits, ``lse_z``, ``lse_w`` their ``(r,)``
    log-sum-exps, the buffers ``(r, V)`` in the compute dtype. A zero-probability term is
    exactly 0: ``0 · log(0 / q) = 0`` by convention, where the product is ``0 · (-inf) = NaN``.
    So is every term of a row where ``p`` is NaN: a rank's vocabulary slice with no policy mass
    has ``lse_z = -inf`` legitimately. (Rows of NaN, ``+inf`` or all ``-inf`` logits, whose
    terms are zeroed too, are told by :func:`full_kl` from their non-finite log-sum-exps.)
    """
    log_p = sub_into(z, lse_z[:, None], buf_p)
    # log p - log q = (z - lse_z) - (w - lse_w), built in place.
    terms = sub_into(w, lse_w[:, None], buf_t).neg_().add_(log_p)
    p = log_p.exp_()
    terms.mul_(p).masked_fill_(~(p > 0), 0.0)
    return p, terms


def _kl_row_stats(
    policy: Tensor, reference: Tensor, rows: int, dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    r"""Per-row log-sum-exps of both logits and the KL of their softmaxes, block by block.

    For policy logits ``z`` and reference logits ``w`` of one shape ``(..., V)`` (the whole
    vocabulary, or a rank's slice of it), computed in ``dtype``. Fast path, for every row whose
    unshifted sums are exact (:func:`~klpen._chunks.shift_free_ok`): with ``e = exp(z)``,
    ``S_z = sum(e)``, ``S_w = sum(exp(w))``,

    .. math:: \mathrm{KL} = \frac{\sum_v e_v (z_v - w_v)}{S_z} - \log S_z + \log S_w

    which reads each logit once, with no max pass and no per-element ``where``. The other rows
    (``-inf`` logits, extreme values, NaN) are few; they are redone with the max-shifted
    log-sum-exp and the ``0 log 0 = 0`` convention of :func:`_kl_terms`.

    Returns:
        ``stats``, ``(3, N)`` in ``dtype``, ``N`` the number of rows: its rows are
        ``lse(z)``, ``lse(w)`` and the KL, not clamped (one tensor, so that a caller can
        all-reduce rows of it at once); and ``redo``, the ``(M,)`` int64 numbers of the rows
        computed exactly, which the backward pass must redo too. A row whose reference is all
        ``-inf`` has a NaN KL; invalid logits (NaN, ``+inf``, all ``-inf``) give a non-finite
        log-sum-exp.

    Example:
        >>> stats, redo = _kl_row_stats(torch.tensor([[2.0, 0.0, 0.0]]), torch.zeros(1, 3),
        ...                             rows=1, dtype=torch.float32)
        >>> stats[2], redo
        (tensor([0.4330]), tensor([], dtype=torch.int64))
    """
    vocab = policy.shape[-1]
    stats = torch.empty(3, policy.numel() // vocab, dtype=dtype, device=policy.device)
    s_z, s_w, kl = stats.unbind()
    buf_e = block_buffer(policy, rows, dtype)
    buf_d = torch.empty_like(buf_e)
    for start, z, w in paired_row_blocks(policy, reference, rows):
        stop, r = start + z.shape[0], z.shape[0]
        e = exp_into(z, buf_e[:r])
        torch.sum(e, dim=-1, out=s_z[start:stop])
        torch.sum(exp_into(w, buf_d[:r]), dim=-1, out=s_w[start:stop])
        torch.sum(sub_into(z, w, buf_d[:r]).mul_(e), dim=-1, out=kl[start:stop])
    ok = shift_free_ok(s_z, vocab) & shift_free_ok(s_w, vocab)
    kl.div_(s_z)
    lse_z, lse_w = s_z.log_(), s_w.log_()
    kl.sub_(lse_z).add_(lse_w)
    redo = (~(ok & torch.isfinite(kl))).nonzero().squeeze(-1)
    for index in index_blocks(redo, rows):
        z, w = take_rows(policy, index).to(dtype), take_rows(reference, index).to(dtype)
        lse_z[index] = torch.logsumexp(z, dim=-1)
        lse_w[index] = torch.logsumexp(w, dim=-1)
        k = index.shape[0]
        kl[index] = _kl_terms(z, w, lse_z[index], lse_w[index], buf_e[:k], buf_d[:k])[1].sum(-1)
    return stats, redo


def _kl_grads(
    policy: Tensor,
    reference: Tensor,
    lse_z: Tensor,
    lse_w: Tensor,
    kl: Tensor,
    redo: Tensor,
    grad_out: Tensor,
    rows: int,
    needs: tuple[bool, bool],
) -> tuple[Tensor | None, Tensor | None]:
    r"""Gradients of ``Σ_i g_i KL_i`` w.r.t. the policy and reference logits, block by block.

    .. math::

        \frac{\partial \mathrm{KL}}{\partial z_j} = p_j \Big[\log \frac{p_j}{q_j}
        - \mathrm{KL}\Big], \qquad
        \frac{\partial \mathrm{KL}}{\partial w_j} = q_j - p_j

    ``policy``, ``reference``: the saved ``(..., V)`` logits (or a rank's slices of them).
    ``lse_z``, ``lse_w``, ``kl``: ``(N,)`` log-sum-exps and KL of the *whole* rows (for a
    slice, the global values), in the compute dtype. ``redo``: the rows to compute with the
    ``0 log 0 = 0`` convention, as :func:`_kl_row_stats` returned them. ``grad_out``: the
    ``(...)`` upstream gradient ``g``. ``needs``: which of the two gradients to build; only
    those are allocated (usually the policy's alone).

    Returns:
        ``(grad_z, grad_w)`` in the logits' shapes and dtypes, ``None`` where not needed.

    Example:
        >>> z, w = torch.tensor([[0.0, 0.0]]), torch.tensor([[0.0, 1.0]])
        >>> stats, redo = _kl_row_stats(z, w, rows=1, dtype=torch.float32)
        >>> _kl_grads(z, w, *stats.unbind(), redo, torch.ones(1), rows=1, needs=(False, True))
        (None, tensor([[-0.2311,  0.2311]]))
    """
    vocab, dtype = policy.shape[-1], kl.dtype
    grad_z, grad_w = (
        torch.empty(x.shape, dtype=x.dtype, device=x.device) if need else None
        for x, need in zip((policy, reference), needs, strict=True)
    )
    flat_gz = None if grad_z is None else grad_z.view(-1, vocab)
    flat_gw = None if grad_w is None else grad_w.view(-1, vocab)
    g = grad_out.reshape(-1, 1).to(dtype)
    # log p - log q - KL = (z - w) - shift, per row
    shift = (lse_z - lse_w + kl)[:, None]
    buf_p = block_buffer(policy, rows, dtype)
    buf_t = torch.empty_like(buf_p)
    for start, z, w in paired_row_blocks(policy, reference, rows):
        stop, r = start + z.shape[0], z.shape[0]
        p = sub_into(z, lse_z[start:stop, None], buf_p[:r]).exp_()
        if flat_gz is not None:
            d = sub_into(z, w, buf_t[:r]).sub_(shift[start:stop]).mul_(g[start:stop])
            torch.mul(d, p, out=flat_gz[start:stop])
        if flat_gw is not None:
            q = sub_into(w, lse_w[start:stop, None], buf_t[:r]).exp_()
            torch.mul(q.sub_(p), g[start:stop], out=flat_gw[start:stop])
    # The rows the forward pass computed exactly (-inf or extreme logits), again with
    # 0 log 0 = 0: there the fast formula gives 0 · inf = NaN.
    for index in index_blocks(redo, rows):
        z, w = take_rows(policy, index).to(dtype), take_rows(reference, index).to(dtype)
        k = index.shape[0]
        p, terms = _kl_terms(z, w, lse_z[index], lse_w[index], buf_p[:k], buf_t[:k])
        if flat_gz is not None:
            flat_gz[index] = (terms - p * kl[index, None]).mul_(g[index]).to(flat_gz.dtype)
        if flat_gw is not None:
            q = torch.exp(w - lse_w[index, None])
            flat_gw[index] = q.sub_(p).mul_(g[index]).to(flat_gw.dtype)
    return grad_z, grad_w


class _FullKL(torch.autograd.Function):
    """``KL(softmax(z) ‖ softmax(w))`` per row: :func:`_kl_row_stats` and :func:`_kl_grads`."""

    @staticmethod
    def forward(ctx: Any, policy: Tensor, reference: Tensor, rows: int) -> Tensor:
        dtype = compute_dtype(torch.promote_types(policy.dtype, reference.dtype))
        stats, redo = _kl_row_stats(policy, reference, rows, dtype)
        lse_z, lse_w, kl = stats.unbind()
        # Rounding can leave a true 0 at -1e-8; the divergence itself is never negative.
        kl.clamp_(min=0.0)
        # NaN or +inf logits, or a row of -inf only (and nothing else) make a log-sum-exp
        # non-finite. _kl_terms zeroes the terms of such a row, which would then pass for a
        # valid one: its divergence is NaN-ed here, for full_kl to report.
        kl.masked_fill_(~(torch.isfinite(lse_z) & torch.isfinite(lse_w)), math.nan)
        ctx.save_for_backward(policy, reference, lse_z, lse_w, kl, redo)
        ctx.rows = rows
        return kl.view(policy.shape[:-1])

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, Tensor | None, None]:
        policy, reference, lse_z, lse_w, kl, redo = ctx.saved_tensors
        needs = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grads = _kl_grads(policy, reference, lse_z, lse_w, kl, redo, grad_out, ctx.rows, needs)
        return *grads, None


def full_kl(policy_logits: Tensor, reference_logits: Tensor) -> Tensor:
    r"""Exact ``KL(π ‖ π_ref)`` over the last axis, for any leading shape.

    .. math::

        \mathrm{KL}(\pi \,\|\, \pi_\mathrm{ref})
        = \sum_v \pi(v) \log \frac{\pi(v)}{\pi_\mathrm{ref}(v)}

    Args:
        policy_logits: ``(..., V)`` floating logits of the policy π.
        reference_logits: ``(..., V)`` floating logits of the reference π_ref, same shape.

    Returns:
        ``(...)`` divergences, never negative. Half-precision inputs are computed in fp32 and
        returned as fp32; otherwise the promoted dtype of the two inputs. Differentiable
        w.r.t. both inputs (usually only the policy requires grad).

    Edge cases: a ``-inf`` policy logit (a token the policy cannot emit, as after top-k or
    vocabulary masking) contributes 0; a ``-inf`` reference logit where the policy has mass
    gives ``+inf``, the true value. Memory is bounded as in
    :func:`~klpen.get_logprobs_for_tokens`: no ``(..., V)`` temporary is built.

    Raises:
        TypeError, ValueError: non-tensors, integer dtypes, mismatched shapes or devices, an
            empty vocabulary; NaN or ``+inf`` logits, or a row whose logits are all ``-inf``.

    Example:
        >>> z = torch.tensor([[2.0, 0.0, 0.0]])
        >>> full_kl(z, z)
        tensor([0.])
        >>> full_kl(z, torch.zeros(1, 3))
        tensor([0.4330])
    """
    return _checked_kl(policy_logits, reference_logits, "policy_logits", "reference_logits")


def _checked_kl(policy: Tensor, reference: Tensor, policy_name: str, reference_name: str) -> Tensor:
    """:func:`full_kl` with its arguments validated under the caller's names for them."""
    check_floating(policy_name, policy, min_ndim=1)
    check_floating(reference_name, reference, min_ndim=1)
    check_shape(reference_name, reference, policy.shape, f"the shape of {policy_name}")
    check_same_device(reference_name, reference, policy_name, policy)
    vocab = policy.shape[-1]
    if vocab == 0:
        raise ValueError(
            f"{policy_name} must have a non-empty last (vocabulary) axis, got {tuple(policy.shape)}"
        )
    kl: Tensor = _FullKL.apply(policy, reference, block_rows_for(policy))  # type: ignore[no-untyped-call]
    return check_no_nan(
        kl,
        f"{policy_name} or {reference_name} contain NaN or +inf, or a row whose logits are "
        "all -inf; got a NaN divergence in those rows",
    )


def kl_penalized_reward(
    policy_logits: Tensor, ref_logits: Tensor, reward: Tensor, beta: float = 0.1
) -> Tensor:
    r"""Reward minus ``beta`` times the full categorical KL at every position.

    .. math:: \tilde r = r - \beta\, \mathrm{KL}(\pi \,\|\, \pi_\mathrm{ref})

    Args:
        policy_logits: ``(..., V)`` policy logits.
        ref_logits: ``(..., V)`` reference logits, same shape.
        reward: ``(...)`` floating rewards, the leading shape of the logits.
        beta: finite, non-negative penalty coefficient; ``0`` means no penalty, exactly (the
            reward comes back unchanged even where the KL is ``+inf``, and no gradient
            reaches the logits).

    Returns:
        A tensor of ``reward``'s shape: ``reward - beta * full_kl(policy_logits, ref_logits)``,
        in the promoted dtype of ``reward`` and the KL (at least float32: an fp16 ``reward`` is
        not a reason to round the KL to fp16). Differentiable w.r.t. the policy logits and the
        reward.

    Raises:
        TypeError, ValueError: what :func:`full_kl` refuses; a ``reward`` of the wrong shape,
            device or kind, or with a NaN; a ``beta`` that is negative, not finite, or beyond
            the compute dtype's range.

    Example:
        >>> logits = torch.tensor([[[2.0, 0.0, 0.0]]])
        >>> kl_penalized_reward(logits, logits, torch.tensor([[1.0]]))
        tensor([[1.]])
    """
    check_floating("policy_logits", policy_logits, min_ndim=1)
    check_floating("reward", reward)
    check_shape("reward", reward, policy_logits.shape[:-1], "the leading shape of policy_logits")
    check_same_device("reward", reward, "policy_logits", policy_logits)
    b = check_coef("beta", beta)
    check_no_nan_at("reward", reward)
    # beta = 0: the penalty is the constant 0 (the logits are still checked); no gradient
    # reaches them, the true one being 0 (a backward through an infinite KL would be NaN).
    with torch.set_grad_enabled(torch.is_grad_enabled() and b != 0.0):
        kl = _checked_kl(policy_logits, ref_logits, "policy_logits", "ref_logits")
    dtype = promoted_dtype(reward, kl)
    check_coef_fits("beta", b, dtype)
    return reward.to(dtype) - scaled_penalty(b, kl.to(dtype))
