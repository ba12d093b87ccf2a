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

from typing import Any

import torch
from torch import Tensor

from ._chunks import (
    block_rows_for,
    compute_dtype,
    exp_into,
    index_blocks,
    paired_row_blocks,
    shift_free_ok,
    sub_into,
    take_rows,
)
from ._validation import check_coef, check_floating, check_same_device, check_shape

__all__ = ["full_kl", "kl_penalized_reward"]


def _kl_terms(z: Tensor, w: Tensor, lse_z: Tensor, lse_w: Tensor) -> tuple[Tensor, Tensor]:
    """``p`` and ``p * (log p - log q)`` of one block; a zero-probability term is exactly 0."""
    log_p = z - lse_z[:, None]
    p = torch.exp(log_p)
    terms = p * (log_p - (w - lse_w[:, None]))
    # 0 * log(0 / q) = 0 by convention; computed directly it is 0 * (-inf - ...) = NaN. A NaN p
    # (NaN or +inf logits, an all -inf row) stays NaN, for full_kl to report.
    return p, torch.where(p == 0, 0.0, terms)


class _FullKL(torch.autograd.Function):
    r"""Block-wise KL with a fast path for finite rows and an exact slow path for the others.

    Fast path (every row whose logits are finite and in the range where unshifted exponentials
    are exact, see :func:`~klpen._chunks.shift_free_ok`): with ``e = exp(z)``,
    ``S_z = sum(e)``, ``S_w = sum(exp(w))``,

    .. math:: \mathrm{KL} = \frac{\sum_v e_v (z_v - w_v)}{S_z} - \log S_z + \log S_w

    which reads each logit once and needs no max pass and no per-element ``where``. The other
    rows (``-inf`` logits, extreme values, NaN) are few; they are redone with the max-shifted
    log-sum-exp and the ``0 log 0 = 0`` convention of :func:`_kl_terms`.
    """

    @staticmethod
    def forward(ctx: Any, policy: Tensor, reference: Tensor, rows: int) -> Tensor:
        dtype = compute_dtype(torch.promote_types(policy.dtype, reference.dtype))
        vocab = policy.shape[-1]
        n = policy.numel() // vocab
        s_z, s_w, dot = (torch.empty(n, dtype=dtype, device=policy.device) for _ in range(3))
        buf_e = torch.empty(min(rows, n), vocab, dtype=dtype, device=policy.device)
        buf_d = torch.empty_like(buf_e)
        for start, z, w in paired_row_blocks(policy, reference, rows):
            stop = start + z.shape[0]
            e = exp_into(z, buf_e[: z.shape[0]])
            torch.sum(e, dim=-1, out=s_z[start:stop])
            torch.sum(exp_into(w, buf_d[: z.shape[0]]), dim=-1, out=s_w[start:stop])
            d = sub_into(z, w, buf_d[: z.shape[0]])
            torch.sum(d.mul_(e), dim=-1, out=dot[start:stop])
        ok = shift_free_ok(s_z, vocab) & shift_free_ok(s_w, vocab)
        kl = dot.div_(s_z)
        lse_z, lse_w = s_z.log_(), s_w.log_()
        kl.sub_(lse_z).add_(lse_w)
        redo = (~(ok & torch.isfinite(kl))).nonzero().squeeze(-1)
        for index in index_blocks(redo, rows):
            z, w = take_rows(policy, index).to(dtype), take_rows(reference, index).to(dtype)
            lse_z[index] = torch.logsumexp(z, dim=-1)
            lse_w[index] = torch.logsumexp(w, dim=-1)
            kl[index] = _kl_terms(z, w, lse_z[index], lse_w[index])[1].sum(-1)
        # Rounding can leave a true 0 at -1e-8; the divergence itself is never negative.
        kl.clamp_(min=0.0)
        ctx.save_for_backward(policy, reference, lse_z, lse_w, kl, redo)
        ctx.rows = rows
        return kl.view(policy.shape[:-1])

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, Tensor | None, None]:
        policy, reference, lse_z, lse_w, kl, redo = ctx.saved_tensors
        need_z, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        rows, vocab, dtype = ctx.rows, policy.shape[-1], kl.dtype
        # Only the gradients asked for are allocated (usually the policy's alone).
        grad_z = torch.empty(
            policy.shape if need_z else 0, dtype=policy.dtype, device=policy.device
        )
        grad_w = torch.empty(
            reference.shape if need_w else 0, dtype=reference.dtype, device=reference.device
        )
        flat_gz, flat_gw = grad_z.view(-1, vocab), grad_w.view(-1, vocab)
        g = grad_out.reshape(-1, 1).to(dtype)
        # log p - log q - KL = (z - w) - shift, per row
        shift = (lse_z - lse_w + kl)[:, None]
        buf_p = torch.empty(min(rows, kl.shape[0]), vocab, dtype=dtype, device=policy.device)
        buf_d = torch.empty_like(buf_p)
        for start, z, w in paired_row_blocks(policy, reference, rows):
            stop, r = start + z.shape[0], z.shape[0]
            p = sub_into(z, lse_z[start:stop, None], buf_p[:r]).exp_()
            if need_z:
                # dKL/dz_j = p_j [log(p_j/q_j) - KL]
                d = sub_into(z, w, buf_d[:r]).sub_(shift[start:stop]).mul_(g[start:stop])
                torch.mul(d, p, out=flat_gz[start:stop])
            if need_w:
                # dKL/dw_j = q_j - p_j
                q = sub_into(w, lse_w[start:stop, None], buf_d[:r]).exp_()
                torch.mul(q.sub_(p), g[start:stop], out=flat_gw[start:stop])
        # Rows with -inf or extreme logits: redo them with the 0 log 0 = 0 convention.
        for index in index_blocks(redo, rows):
            z, w = take_rows(policy, index).to(dtype), take_rows(reference, index).to(dtype)
            p, terms = _kl_terms(z, w, lse_z[index], lse_w[index])
            if need_z:
                flat_gz[index] = ((terms - p * kl[index, None]) * g[index]).to(grad_z.dtype)
            if need_w:
                q = torch.exp(w - lse_w[index, None])
                flat_gw[index] = ((q - p) * g[index]).to(grad_w.dtype)
        return (grad_z if need_z else None), (grad_w if need_w else None), None


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
    if kl.numel() and bool(torch.isnan(kl).any()):
        raise ValueError(
            f"{policy_name} or {reference_name} contain NaN or +inf, or a row whose logits are "
            "all -inf; got a NaN divergence in those rows"
        )
    return kl


def kl_penalized_reward(
    policy_logits: Tensor, ref_logits: Tensor, reward: Tensor, beta: float = 0.1
) -> Tensor:
    r"""Reward minus ``beta`` times the full categorical KL at every position.

    .. math:: \tilde r = r - \beta\, \mathrm{KL}(\pi \,\|\, \pi_\mathrm{ref})

    Args:
        policy_logits: ``(..., V)`` policy logits.
        ref_logits: ``(..., V)`` reference logits, same shape.
        reward: ``(...)`` floating rewards, the leading shape of the logits.
        beta: finite, non-negative penalty coefficient.

    Returns:
        A tensor of ``reward``'s shape: ``reward - beta * full_kl(policy_logits, ref_logits)``.
        Differentiable w.r.t. the policy logits and the reward.

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
    kl = _checked_kl(policy_logits, ref_logits, "policy_logits", "ref_logits")
    return reward - b * kl.to(reward.dtype)
