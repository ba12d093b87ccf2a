"""The exact categorical KL divergence over the vocabulary, block by block.

Chapter 3 of the book. For policy logits ``z`` and reference logits ``w`` at one position,
with ``p = softmax(z)`` and ``q = softmax(w)``:

.. math:: \\mathrm{KL}(p \\,\\|\\, q) = \\sum_v p_v \\big[(z_v - \\mathrm{lse}(z)) - (w_v - \\mathrm{lse}(w))\\big]

The naive code materialises ``log_softmax`` of both, ``exp`` of one and their product: four or
five ``(B, T, V)`` tensors. Here every row is reduced inside a cache-sized block, and the
backward pass recomputes what it needs from the saved logits and three numbers per row.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ._chunks import compute_dtype, row_blocks, rows_per_chunk
from ._validation import check_coef, check_floating, check_same_device, check_shape

__all__ = ["full_kl", "kl_penalized_reward"]


def _kl_terms(z: Tensor, w: Tensor, lse_z: Tensor, lse_w: Tensor) -> tuple[Tensor, Tensor]:
    """``p`` and ``p * (log p - log q)`` of one block; a zero-probability term is exactly 0."""
    log_p = z - lse_z[:, None]
    p = torch.exp(log_p)
    terms = p * (log_p - (w - lse_w[:, None]))
    # 0 * log(0 / q) = 0 by convention; computed directly it is 0 * (-inf - ...) = NaN.
    return p, torch.where(p > 0, terms, 0.0)


class _FullKL(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, policy: Tensor, reference: Tensor, rows: int) -> Tensor:
        dtype = compute_dtype(torch.promote_types(policy.dtype, reference.dtype))
        n = policy.numel() // policy.shape[-1]
        kl = torch.empty(n, dtype=dtype, device=policy.device)
        lse_z, lse_w = torch.empty_like(kl), torch.empty_like(kl)
        for (start, z), (_, w) in zip(row_blocks(policy, rows), row_blocks(reference, rows)):
            stop = start + z.shape[0]
            z, w = z.to(dtype), w.to(dtype)
            lse_z[start:stop] = torch.logsumexp(z, dim=-1)
            lse_w[start:stop] = torch.logsumexp(w, dim=-1)
            _, terms = _kl_terms(z, w, lse_z[start:stop], lse_w[start:stop])
            kl[start:stop] = terms.sum(-1)
        # Rounding can leave a true 0 at -1e-8; the divergence itself is never negative.
        kl.clamp_(min=0.0)
        ctx.save_for_backward(policy, reference, lse_z, lse_w, kl)
        ctx.rows = rows
        return kl.view(policy.shape[:-1])

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, Tensor | None, None]:
        policy, reference, lse_z, lse_w, kl = ctx.saved_tensors
        need_z, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        vocab = policy.shape[-1]
        grad_z = torch.empty(policy.shape, dtype=policy.dtype, device=policy.device)
        grad_w = torch.empty(reference.shape, dtype=reference.dtype, device=reference.device)
        flat_gz, flat_gw = grad_z.view(-1, vocab), grad_w.view(-1, vocab)
        g = grad_out.reshape(-1, 1).to(kl.dtype)
        blocks = zip(row_blocks(policy, ctx.rows), row_blocks(reference, ctx.rows))
        for (start, z), (_, w) in blocks:
            stop = start + z.shape[0]
            z, w = z.to(kl.dtype), w.to(kl.dtype)
            p, terms = _kl_terms(z, w, lse_z[start:stop], lse_w[start:stop])
            g_block = g[start:stop]
            if need_z:
                # dKL/dz_j = p_j [log(p_j/q_j) - KL]
                flat_gz[start:stop] = (terms - p * kl[start:stop, None]).mul_(g_block)
            if need_w:
                # dKL/dw_j = q_j - p_j
                q = torch.exp(w - lse_w[start:stop, None])
                flat_gw[start:stop] = (q - p).mul_(g_block)
        return (grad_z if need_z else None), (grad_w if need_w else None), None


def full_kl(policy_logits: Tensor, reference_logits: Tensor) -> Tensor:
    r"""Exact ``KL(π ‖ π_ref)`` over the last axis, for any leading shape.

    .. math:: \mathrm{KL}(\pi \,\|\, \pi_\mathrm{ref}) = \sum_v \pi(v) \log \frac{\pi(v)}{\pi_\mathrm{ref}(v)}

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
    check_floating("policy_logits", policy_logits, min_ndim=1)
    check_floating("reference_logits", reference_logits, min_ndim=1)
    check_shape("reference_logits", reference_logits, policy_logits.shape, "the shape of policy_logits")
    check_same_device("reference_logits", reference_logits, "policy_logits", policy_logits)
    vocab = policy_logits.shape[-1]
    if vocab == 0:
        raise ValueError(
            f"policy_logits must have a non-empty last (vocabulary) axis, got {tuple(policy_logits.shape)}"
        )
    kl: Tensor = _FullKL.apply(policy_logits, reference_logits, rows_per_chunk(vocab))
    if kl.numel() and bool(torch.isnan(kl).any()):
        raise ValueError(
            "policy_logits or reference_logits contain NaN or +inf, or a row whose logits are "
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
    return reward - b * full_kl(policy_logits, ref_logits).to(reward.dtype)
