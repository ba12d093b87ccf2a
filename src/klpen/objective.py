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
    check_all,
    check_coef,
    check_coef_fits,
    check_floating,
    check_floating_like,
    check_mask,
    check_no_nan_at,
    check_same_device,
    check_shape,
    check_tokens,
    promoted_dtype,
    scaled_penalty,
)
from .logprobs import get_logprobs_for_tokens
from .masking import compute_token_kl
from .packing import check_sequence_ids

__all__ = ["compute_rlhf_objective", "shape_rewards"]


def shape_rewards(
    scores: Tensor,
    per_token_kl: Tensor,
    mask: Tensor,
    kl_coef: float,
    *,
    sequence_ids: Tensor | None = None,
) -> Tensor:
    r"""Per-token rewards for PPO-style RLHF: a KL penalty at every token, the score at the last.

    .. math::
        \begin{aligned}
        R_{b,t} = m_{b,t}\Big(&-\beta\,\mathrm{kl}_{b,t} \\
        &+ [t = t^\mathrm{last}_b]\, s_b\Big)
        \end{aligned}

    where :math:`t^\mathrm{last}_b` is the last position with :math:`m_{b,t} = 1`. Left- and
    right-padded batches (and any other mask) are handled alike.

    **Packed** (``sequence_ids``, ``(B, T)`` integer ids in ``[0, S)``, e.g. from
    :func:`~klpen.sequence_ids`): ``scores`` is ``(S,)``, one per sequence, and score ``s`` is
    added at the last valid token of the positions whose id is ``s`` (the last in row-major
    order): the rewards equal those of the sequences padded into a batch.

    A row (or sequence) with no valid token has nowhere to put its score: that raises
    ``ValueError`` naming it, rather than dropping a reward silently. (TRL, verl and OpenRLHF
    put the score at position ``T - 1`` of such a row, a padded position that the loss then
    masks out, so the reward is lost there too; drop such rows, or give them a valid token,
    before shaping.)

    Args:
        scores: ``(B,)`` floating scalar reward of each response (``(S,)`` when packed).
        per_token_kl: ``(B, T)`` floating per-token KL estimate (e.g. k1 from
            :func:`~klpen.compute_token_kl`).
        mask: ``(B, T)`` 0/1 mask (bool, integer or floating) of the response tokens.
        kl_coef: β, finite and non-negative; ``0`` means no penalty, exactly (even where
            ``per_token_kl`` is infinite).
        sequence_ids: optional ``(B, T)`` integer sequence index of every position.

    Returns:
        ``(B, T)`` rewards in the promoted dtype of ``scores`` and ``per_token_kl`` (at least
        float32), zero where the mask is 0; differentiable w.r.t. both. Masked positions of
        ``per_token_kl`` (whatever they hold) reach neither the rewards nor a gradient.

    Raises:
        TypeError, ValueError: wrong types, shapes or devices; NaN in ``scores`` or at a valid
            position of ``per_token_kl``; a ``kl_coef`` that is negative, not finite, or
            beyond the compute dtype's range; a row (or sequence) with no valid token;
            ``sequence_ids`` outside ``[0, S)``. The last three, and the NaN and mask checks,
            are value checks (skipped with validation off, which then makes no host
            synchronisation).

    Example:
        >>> kl = torch.tensor([[0.5, 0.5, 0.0], [0.0, 1.0, 1.0]])
        >>> mask = torch.tensor([[1, 1, 0], [0, 1, 1]])  # right- and left-padded
        >>> shape_rewards(torch.tensor([1.0, 2.0]), kl, mask, kl_coef=0.1)
        tensor([[-0.0500,  0.9500,  0.0000],
                [ 0.0000, -0.1000,  1.9000]])
        >>> packed = torch.tensor([[0.5, 0.5, 1.0, 1.0]])  # the same two responses, packed
        >>> shape_rewards(torch.tensor([1.0, 2.0]), packed, torch.ones(1, 4), kl_coef=0.1,
        ...               sequence_ids=torch.tensor([[0, 0, 1, 1]]))
        tensor([[-0.0500,  0.9500, -0.1000,  1.9000]])
    """
    check_floating("per_token_kl", per_token_kl)
    if per_token_kl.dim() != 2:
        raise ValueError(f"per_token_kl must have shape (B, T), got {tuple(per_token_kl.shape)}")
    check_floating("scores", scores)
    ids = None
    if sequence_ids is None:
        check_shape("scores", scores, per_token_kl.shape[:1], "one score per row of per_token_kl")
    else:
        ids = check_sequence_ids(
            "sequence_ids", sequence_ids, per_token_kl, values_name="per_token_kl", ordered=False
        )
        if scores.dim() != 1:
            raise ValueError(
                f"scores must have shape (S,), one per sequence, got {tuple(scores.shape)}"
            )
    check_same_device("scores", scores, "per_token_kl", per_token_kl)
    m = check_mask("mask", mask, per_token_kl.shape, same_device_as=("per_token_kl", per_token_kl))
    dtype = promoted_dtype(scores, per_token_kl)
    beta = check_coef_fits("kl_coef", check_coef("kl_coef", kl_coef), dtype)
    check_no_nan_at("scores", scores)
    check_no_nan_at("per_token_kl", per_token_kl, m)
    if ids is not None:
        n = scores.shape[0]
        check_all(
            (ids >= 0) & (ids < n),
            lambda i: (
                f"sequence_ids must lie in [0, {n}) (one score per sequence, scores has {n}), "
                f"got {int(ids[i])} at index {i}"
            ),
        )
    zero = torch.zeros((), dtype=dtype, device=per_token_kl.device)
    # where() before the arithmetic: a masked NaN/inf must not reach a value or a gradient.
    # excerpt: rewards
    kl = torch.where(m, per_token_kl.to(dtype), zero)
    rewards = torch.where(m, -scaled_penalty(beta, kl), zero)
    # end excerpt
    if ids is not None:
        return rewards + _packed_scores(scores.to(dtype), m, ids, zero)
    check_all(
        m.any(dim=1),
        lambda i: (
            f"mask has no valid token in row {i[0]} (of {m.shape[0]}): its score "
            f"{scores[i[0]].item():.6g} would have nowhere to go; drop the row or give it a "
            "valid token"
        ),
    )
    if m.numel() == 0:
        return rewards
    # excerpt: rewards
    positions = torch.arange(m.shape[1], device=m.device)
    # The last valid position is the largest masked-in index, whatever the padding side.
    last = torch.where(m, positions, -1).amax(dim=1, keepdim=True)
    return rewards + torch.where(positions == last, scores.to(dtype)[:, None], zero)
    # end excerpt


def _packed_scores(scores: Tensor, m: Tensor, ids: Tensor, zero: Tensor) -> Tensor:
    """``(B, T)``: ``scores[s]`` at the last valid position (row-major) of sequence ``s``."""
    flat = ids.reshape(-1).long()
    positions = torch.arange(flat.numel(), device=m.device)
    valid = torch.where(m.reshape(-1), positions, -1)
    last = torch.full((scores.shape[0],), -1, dtype=positions.dtype, device=m.device)
    last = last.scatter_reduce(0, flat, valid, reduce="amax")
    check_all(
        last >= 0,
        lambda i: (
            f"mask has no valid token in sequence {i[0]} (of {scores.shape[0]}): its score "
            f"{scores[i[0]].item():.6g} would have nowhere to go; drop the sequence or give it "
            "a valid token"
        ),
    )
    at_last = (positions == last[flat]).view(m.shape)
    return torch.where(at_last, scores[flat].view(m.shape), zero)


def _logprobs(name: str, logits: Tensor, tokens: Tensor, mask: Tensor) -> Tensor:
    """:func:`get_logprobs_for_tokens`, its error message naming the caller's argument.

    Rows that the kernel refuses (NaN, ``+inf``, all ``-inf``) are an error only at valid
    positions: if some lie at masked positions, those rows are replaced by zeros and the
    log-probs computed again. The copy of the logits this takes is made on that path only.
    """
    try:
        return get_logprobs_for_tokens(logits, tokens)
    except ValueError as err:
        if bool(mask.all()):
            raise ValueError(f"{name}: {err}") from err
        first = err
    # masked_fill: the gradient at the masked rows is exactly 0, not a NaN from their values
    clean = logits.masked_fill(~mask[..., None], 0.0)
    try:
        return get_logprobs_for_tokens(clean, tokens)
    except ValueError:
        raise ValueError(f"{name}: {first} (at a valid position)") from first


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
        \begin{aligned}
        J = \frac1B \sum_b \Big(&R_b - \beta \sum_t m_{b,t} \\
        &\big[\log\pi(y_{b,t}) \\
        &\; - \log\pi_\mathrm{ref}(y_{b,t})\big]\Big)
        \end{aligned}

    The response tokens must be samples of the policy: only then is the summed log-ratio an
    unbiased estimate of the sequence KL (chapter 6 shows what happens otherwise).

    Args:
        policy_logits: ``(B, T, V)`` policy logits, position ``t`` scoring
            ``response_tokens[:, t]``.
        reference_logits: ``(B, T, V)`` reference logits, same shape. No gradient reaches them.
        response_tokens: ``(B, T)`` integer token ids in ``[0, V)``.
        rewards: ``(B,)`` floating reward-model scores.
        attention_mask: ``(B, T)`` 0/1 mask of the response tokens.
        kl_coef: β, finite and non-negative; ``0`` means no penalty, exactly (even where the
            log-ratio is infinite).

    Returns:
        A dict with ``objective`` (0-d tensor, differentiable w.r.t. ``policy_logits``),
        ``mean_reward``, ``mean_kl`` (mean sequence KL), ``mean_penalized_reward``,
        ``kl_penalty`` (``kl_coef * mean_kl``) as Python floats, and ``per_token_kl``
        (``(B, T)``, zero where masked). Computed in the promoted dtype of ``rewards`` and the
        log-probs (fp32 for half-precision logits), so that ``mean_penalized_reward`` equals
        ``mean_reward - kl_penalty`` up to that dtype's rounding.

    Raises:
        TypeError, ValueError: wrong types, shapes, devices, token ids outside ``[0, V)``, a
            mask that is not 0/1, a negative or non-finite ``kl_coef`` (or one beyond the
            compute dtype's range), NaN in ``rewards``; logits that
            :func:`~klpen.get_logprobs_for_tokens` rejects (NaN, ``+inf``, a row of ``-inf``)
            at a valid position. At masked positions the logits may hold anything: it
            reaches neither the result nor the gradient (exactly 0 there).

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
    check_floating_like(
        "reference_logits", reference_logits, "policy_logits", policy_logits, "policy_logits' shape"
    )
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
    dtype = promoted_dtype(policy_logits, reference_logits, rewards)
    check_coef_fits("kl_coef", beta, dtype)
    check_no_nan_at("rewards", rewards)
    mask = check_mask(
        "attention_mask",
        attention_mask,
        policy_logits.shape[:2],
        same_device_as=("policy_logits", policy_logits),
    )
    # excerpt: objective
    policy_lp = _logprobs("policy_logits", policy_logits, tokens, mask)
    with torch.no_grad():
        reference_lp = _logprobs("reference_logits", reference_logits, tokens, mask)
    per_token_kl, sequence_kl = compute_token_kl(policy_lp.to(dtype), reference_lp.to(dtype), mask)
    penalized = rewards.to(dtype) - scaled_penalty(beta, sequence_kl)
    # Means over max(B, 1) rows: an empty batch gives 0 rather than NaN.
    rows = max(penalized.numel(), 1)
    objective = penalized.sum() / rows
    # end excerpt
    mean_kl = sequence_kl.detach().sum().item() / rows
    return {
        "objective": objective,
        "mean_reward": rewards.detach().to(dtype).sum().item() / rows,
        "mean_kl": mean_kl,
        "mean_penalized_reward": objective.item(),
        "kl_penalty": beta * mean_kl if beta else 0.0,
        "per_token_kl": per_token_kl,
    }
