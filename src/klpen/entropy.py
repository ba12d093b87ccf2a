"""The entropy of the policy per position, alone or with the log-probs in the same read.

Trainers log the token entropy every step (a collapsing entropy is the first sign of a policy
that stops exploring), and some add it to the loss. Like the log-probs, it needs only a few
numbers per row: with ``y = (z - c) / T`` for an entry ``c`` of the row and ``s = Σ_v e^{y_v}``,

.. math:: H = -\\sum_v p_v \\log p_v = \\log s - E_p[y]

so one pass over the logits gives it, and the same pass gives the log-probs of chosen tokens.
"""

from __future__ import annotations

import torch  # noqa: F401  (the doctests' namespace)
from torch import Tensor

from .logprobs import _logprobs

__all__ = ["logprobs_and_entropy", "token_entropy"]


def token_entropy(logits: Tensor, *, temperature: float = 1.0) -> Tensor:
    r"""Entropy of ``softmax(logits / temperature)`` at every position.

    .. math::

        \begin{aligned}
        H_t &= -\sum_v \pi_t(v) \log \pi_t(v), \\
        \pi_t &= \operatorname{softmax}(z_t / T)
        \end{aligned}

    Args:
        logits: ``(..., V)`` floating logits. ``-inf`` entries (masked vocabulary) contribute 0.
        temperature: ``T``, finite and > 0 (folded into the per-block arithmetic: the logits
            are not copied).

    Returns:
        ``(...)`` entropies in nats, in ``[0, log V]``; fp32 for half-precision logits, else the
        logits' dtype. Differentiable w.r.t. ``logits`` (once). Memory: a block of scratch and
        three numbers per row, as :func:`~klpen.get_logprobs_for_tokens`.

    Raises:
        TypeError, ValueError: non-tensors, integer dtypes, an empty vocabulary, a temperature
            that is not finite and positive; NaN or ``+inf`` logits, or a row of ``-inf`` only.

    Example:
        >>> token_entropy(torch.tensor([[0.0, 0.0], [0.0, float("-inf")]]))
        tensor([0.6931, 0.0000])
    """
    return _logprobs(logits, None, temperature, True, "token_entropy")[1]


def logprobs_and_entropy(
    logits: Tensor, tokens: Tensor, *, temperature: float = 1.0
) -> tuple[Tensor, Tensor]:
    r"""Log-probs of ``tokens`` and the entropy at every position, from one read of the logits.

    ``(get_logprobs_for_tokens(logits, tokens, temperature=T), token_entropy(logits,
    temperature=T))``, computed together: each block of logits is read once for both (one
    ``exp`` per element, a product and two sums), well under the cost of the two calls
    (benchmarks/RESULTS.md has the measured ratio).

    Args:
        logits: ``(..., V)`` floating logits, position ``t`` scoring ``tokens[..., t]``.
        tokens: ``(...)`` integer token ids in ``[0, V)``.
        temperature: ``T``, finite and > 0.

    Returns:
        ``(logprobs, entropy)``, both ``(...)``, fp32 for half-precision logits. Both are
        differentiable w.r.t. ``logits`` (once), together or separately.

    Raises:
        TypeError, ValueError: as :func:`~klpen.get_logprobs_for_tokens`.

    Example:
        >>> logp, ent = logprobs_and_entropy(torch.tensor([[2.0, 0.0, 0.0]]), torch.tensor([0]))
        >>> logp, ent
        (tensor([-0.2395]), tensor([0.6656]))
    """
    return _logprobs(logits, tokens, temperature, True, "logprobs_and_entropy")
