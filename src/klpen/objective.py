"""The KL-penalised RLHF objective and per-token reward shaping.

Chapter 6 of the book. A reward model scores a whole response; the KL penalty is paid per
token. ``compute_rlhf_objective`` combines them per sequence (the objective written in the
papers), ``shape_rewards`` spreads them over tokens (what PPO trainers feed to their advantage
estimator).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._validation import (
    check_coef,
    check_floating,
    check_mask,
    check_same_device,
    check_shape,
    check_tokens,
)
from .logprobs import get_logprobs_for_tokens
from .masking import compute_token_kl

__all__ = ["compute_rlhf_objective", "shape_rewards"]


def shape_rewards(
    scores: Tensor, per_token_kl: Tensor, response_mask: Tensor, kl_coef: float
) -> Tensor:
    r"""Per-token rewards for PPO-style RLHF: a KL penalty at every token, the score at the last.

    .. math::
        R_{b,t} = m_{b,t}\Big(-\beta\,\mathrm{kl}_{b,t}
        + [t = t^\mathrm{last}_b]\, s_b\Big)

    where :math:`t^\mathrm{last}_b` is the last position with :math:`m_{b,t} = 1`. Left- and
    right-padded batches (and any other mask) are handled alike; a row with no valid token gets
    all zeros.

    Args:
        scores: ``(B,)`` floating scalar reward of each response.
        per_token_kl: ``(B, T)`` floating per-token KL estimate (e.g. k1 from
            :func:`~klpen.compute_token_kl`).
        response_mask: ``(B, T)`` 0/1 mask (bool, integer or floating) of the response tokens.
        kl_coef: β, finite and non-negative.

    Returns:
        ``(B, T)`` rewards in the promoted dtype of ``scores`` and ``per_token_kl``, zero where
        the mask is 0; differentiable w.r.t. both.

    Example:
        >>> kl = torch.tensor([[0.5, 0.5, 0.0], [0.0, 1.0, 1.0]])
        >>> mask = torch.tensor([[1, 1, 0], [0, 1, 1]])  # right- and left-padded
        >>> shape_rewards(torch.tensor([1.0, 2.0]), kl, mask, kl_coef=0.1)
        tensor([[-0.0500,  0.9500,  0.0000],
                [ 0.0000, -0.1000,  1.9000]])
    """
    check_floating("per_token_kl", per_token_kl)
    if per_token_kl.dim() != 2:
        raise ValueError(f"per_token_kl must have shape (B, T), got {tuple(per_token_kl.shape)}")
    check_floating("scores", scores)
    check_shape("scores", scores, per_token_kl.shape[:1], "one score per row of per_token_kl")
    check_same_device("scores", scores, "per_token_kl", per_token_kl)
    if isinstance(response_mask, Tensor):
        check_same_device("response_mask", response_mask, "per_token_kl", per_token_kl)
    mask = check_mask("response_mask", response_mask, per_token_kl.shape)
    beta = check_coef("kl_coef", kl_coef)
    dtype = torch.promote_types(scores.dtype, per_token_kl.dtype)
    zero = torch.zeros((), dtype=dtype, device=per_token_kl.device)
    rewards = torch.where(mask, -beta * per_token_kl.to(dtype), zero)
    positions = torch.arange(mask.shape[1], device=mask.device)
    # The last valid position is the largest masked-in index, whatever the padding side.
    last = torch.where(mask, positions, -1).amax(dim=1, keepdim=True) if mask.numel() else None
    if last is None:
        return rewards
    at_last = positions == last  # False everywhere in a row with no valid token (last = -1)
    return rewards + torch.where(at_last, scores.to(dtype)[:, None], zero)


def _logprobs(name: str, logits: Tensor, tokens: Tensor) -> Tensor:
    """:func:`get_logprobs_for_tokens`, its error message naming the caller's argument."""
    try:
        return get_logprobs_for_tokens(logits, tokens)
    except ValueError as err:
        raise ValueError(f"{name}: {err}") from err


def compute_rlhf_objective(
    policy_logits: Tensor,
    reference_logits: Tensor,
    response_tokens: Tensor,
    rewards: Tensor,
    attention_mask: Tensor,
    kl_coef: float,
) -> dict[str, Tensor | float]:
    r"""The KL-penalised objective of a batch of sampled responses.

    .. math::
        J = \frac1B \sum_b \Big(R_b - \beta \sum_t m_{b,t}
        \big[\log\pi(y_{b,t}) - \log\pi_\mathrm{ref}(y_{b,t})\big]\Big)

    The response tokens must be samples of the policy: only then is the summed log-ratio an
    unbiased estimate of the sequence KL (chapter 6 shows what happens otherwise).

    Args:
        policy_logits: ``(B, T, V)`` policy logits, position ``t`` scoring
            ``response_tokens[:, t]``.
        reference_logits: ``(B, T, V)`` reference logits, same shape. No gradient reaches them.
        response_tokens: ``(B, T)`` integer token ids in ``[0, V)``.
        rewards: ``(B,)`` floating reward-model scores.
        attention_mask: ``(B, T)`` 0/1 mask of the response tokens.
        kl_coef: β, finite and non-negative.

    Returns:
        A dict with ``objective`` (0-d tensor, differentiable w.r.t. ``policy_logits``),
        ``mean_reward``, ``mean_kl`` (mean sequence KL), ``mean_penalized_reward``,
        ``kl_penalty`` (``kl_coef * mean_kl``) as Python floats, and ``per_token_kl``
        (``(B, T)``, zero where masked).

    Raises:
        TypeError, ValueError: wrong types, shapes, devices, token ids outside ``[0, V)``, a
            mask that is not 0/1, a negative or non-finite ``kl_coef``; logits that
            :func:`~klpen.get_logprobs_for_tokens` rejects (NaN), padded positions included:
            the log-probs are computed before the mask is applied.

    Example:
        >>> logits = torch.zeros(1, 2, 3)
        >>> out = compute_rlhf_objective(logits, logits, torch.tensor([[0, 1]]),
        ...                              torch.tensor([1.0]), torch.ones(1, 2), kl_coef=0.1)
        >>> out["objective"], out["mean_kl"]
        (tensor(1.), 0.0)
    """
    check_floating("policy_logits", policy_logits, min_ndim=3)
    if policy_logits.dim() != 3:
        raise ValueError(
            f"policy_logits must have shape (B, T, V), got {tuple(policy_logits.shape)}"
        )
    check_floating("reference_logits", reference_logits)
    check_shape("reference_logits", reference_logits, policy_logits.shape, "policy_logits' shape")
    check_same_device("reference_logits", reference_logits, "policy_logits", policy_logits)
    if isinstance(response_tokens, Tensor):
        check_same_device("response_tokens", response_tokens, "policy_logits", policy_logits)
    # Checked here, not only inside get_logprobs_for_tokens, so that a message names this
    # function's argument ("response_tokens", not "tokens").
    tokens = check_tokens(
        "response_tokens", response_tokens, policy_logits.shape[:2], policy_logits.shape[2]
    )
    check_floating("rewards", rewards)
    check_shape("rewards", rewards, policy_logits.shape[:1], "one reward per row of policy_logits")
    check_same_device("rewards", rewards, "policy_logits", policy_logits)
    beta = check_coef("kl_coef", kl_coef)
    if isinstance(attention_mask, Tensor):
        check_same_device("attention_mask", attention_mask, "policy_logits", policy_logits)
    mask = check_mask("attention_mask", attention_mask, policy_logits.shape[:2])
    policy_lp = _logprobs("policy_logits", policy_logits, tokens)
    with torch.no_grad():
        reference_lp = _logprobs("reference_logits", reference_logits, tokens)
    per_token_kl, sequence_kl = compute_token_kl(policy_lp, reference_lp, mask)
    penalized = rewards.to(sequence_kl.dtype) - beta * sequence_kl
    # Means over max(B, 1) rows: an empty batch gives 0 rather than NaN.
    rows = max(penalized.numel(), 1)
    objective = penalized.sum() / rows
    mean_kl = sequence_kl.detach().sum().item() / rows
    return {
        "objective": objective,
        "mean_reward": rewards.detach().sum().item() / rows,
        "mean_kl": mean_kl,
        "mean_penalized_reward": objective.item(),
        "kl_penalty": beta * mean_kl,
        "per_token_kl": per_token_kl,
    }
