r"""Vocab-parallel log-probs from hidden states: a vocabulary-sharded output layer, no logits.

Chapter 8. In tensor parallelism the output layer ``weight (V, H)`` is split by rows: rank ``r``
holds ``weight[o_r : o_r + V_r]`` (contiguous, in rank order, possibly uneven) and the same
``hidden`` states. Each rank walks the tiles of its own slice exactly as
:func:`~klpen.linear.linear_logprobs` does and reduces them to a few numbers per row; one
all-reduce (sum) of them gives the log-sum-exp and the token's logit of the whole vocabulary:

.. math:: \mathrm{lse}(z) = \log \textstyle\sum_r \sum_{v \in V_r} e^{z_v}, \qquad
    \log \pi(y) = z_y - \mathrm{lse}(z)

(shift-free sums, exact for logits within the range of :func:`~klpen._chunks.shift_free_ok`; the
rows outside it are redone, on every rank alike, after an all-reduce (max) of the row maxes).

Backward, like Megatron's column-parallel output layer: each rank recomputes its tiles, forms
the gradient of its own logits, and gets its ``weight`` (and ``bias``) slice's gradient locally;
the gradient of the replicated ``hidden`` is the sum of every rank's ``G_r W_r``, one
all-reduce (sum) of ``N × H`` numbers.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ._validation import (
    check_no_nan,
    check_positive,
    check_same_device,
    check_token_ids,
    check_tokens,
)
from .distributed import _check_agreement, _exchange_metadata, _resolve_group
from .linear import (
    Layer,
    backprop,
    check_layer,
    flat_layer,
    logprob_grad,
    logprob_stats,
)

__all__ = ["vocab_parallel_linear_logprobs"]


def _reducer(group: Any) -> Any:
    ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}

    def reduce(x: Tensor, op: str) -> Tensor:
        dist.all_reduce(x, op=ops[op], group=group)
        return x

    return reduce


class _VocabParallelLinearLogProbs(torch.autograd.Function):
    """Log-probs of ``tokens`` from each rank's slice of an output layer."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        local: Tensor,
        temperature: float,
        vocab: int,
        group: Any,
    ) -> Tensor:
        layer = flat_layer(hidden, weight, bias, temperature)
        stats = logprob_stats(layer, local, False, vocab, _reducer(group))
        ctx.save_for_backward(hidden, weight, bias, local, stats.lse)
        ctx.temperature, ctx.group = temperature, group
        return stats.logprob.view(hidden.shape[:-1])

    @staticmethod
    def backward(
        ctx: Any, grad_out: Tensor
    ) -> tuple[Tensor | None, Tensor | None, Tensor | None, None, None, None, None]:
        hidden, weight, bias, local, lse = ctx.saved_tensors
        layer: Layer = flat_layer(hidden, weight, bias, ctx.temperature)
        needs = (True, ctx.needs_input_grad[1], ctx.needs_input_grad[2])
        # Every rank all-reduces the hidden gradient, whether or not its hidden requires grad,
        # so that no rank waits alone.
        gx, gw, gb = backprop(layer, logprob_grad(layer, local, lse, grad_out, None), needs)
        assert gx is not None
        dist.all_reduce(gx, op=dist.ReduceOp.SUM, group=ctx.group)
        grad_x = gx.view(hidden.shape).to(hidden.dtype) if ctx.needs_input_grad[0] else None
        return grad_x, gw, gb, None, None, None, None


def vocab_parallel_linear_logprobs(
    hidden: Tensor,
    local_weight: Tensor,
    tokens: Tensor,
    *,
    local_bias: Tensor | None = None,
    temperature: float = 1.0,
    group: dist.ProcessGroup | None = None,
) -> Tensor:
    r"""Log-probs of ``tokens`` under an output layer whose rows are split across ranks.

    Rank ``r`` of ``group`` holds rows ``[o_r, o_r + V_r)`` of ``weight`` (and of ``bias``),
    contiguous and in rank order (uneven slices allowed, each at least one row); every rank
    holds the same ``hidden`` and ``tokens``. Returns, on every rank,
    ``linear_logprobs(hidden, weight, tokens, bias=bias, temperature=temperature)`` of the
    whole layer, never building logits.

    Args:
        hidden: ``(..., H)`` hidden states, the same on every rank.
        local_weight: ``(V_r, H)`` this rank's rows of the output weight.
        tokens: ``(...)`` global token ids in ``[0, V)``, ``V = Σ_r V_r``; identical on every
            rank.
        local_bias: optional ``(V_r,)`` this rank's entries of the bias (all ranks or none).
        temperature: finite, positive ``T``.
        group: the process group holding the slices; ``None`` for the default group.

    Returns:
        ``(...)`` log-probabilities, the same on every rank, in the compute dtype (fp32 for
        half-precision inputs). Differentiable w.r.t. ``hidden`` (the gradient is all-reduced
        across the ranks in backward: every rank must call backward, with the same upstream
        gradient, as in tensor parallelism), ``local_weight`` and ``local_bias`` (this rank's
        slice of the single-process gradient).

    Communication: forward, one all-gather of 16 ``int64`` per rank (slice sizes, checks that
    dtypes, shapes and tokens agree) and one all-reduce (sum) of ``2·N`` floats, plus, only if
    some row has extreme or ``-inf`` logits, an all-reduce (max) and one (sum) for those rows;
    backward, one all-reduce (sum) of ``N·H`` floats.

    Raises:
        TypeError, ValueError: as :func:`~klpen.linear.linear_logprobs` on any rank (the other
            ranks raise a ``ValueError`` naming it), or dtypes, leading shapes or tokens that
            differ across ranks.

    Example (on each of two ranks, rank 0 holding row 0 and rank 1 row 1)::

        >>> hidden, weight = torch.tensor([[1.0, 0.0]]), torch.tensor([[2.0, 0.0], [0.0, 1.0]])
        >>> local = weight[dist.get_rank() : dist.get_rank() + 1]  # doctest: +SKIP
        >>> vocab_parallel_linear_logprobs(hidden, local, torch.tensor([0]))  # doctest: +SKIP
        tensor([-0.1269])
    """
    pg = _resolve_group(group)
    error: Exception | None = None
    shape_probe: Tensor | None = None
    ids: Tensor | None = None
    try:
        h, w, b = check_layer(
            ("hidden", "local_weight", "local_bias"), hidden, local_weight, local_bias
        )
        ids = check_token_ids("tokens", tokens).long()
        check_same_device("tokens", ids, "hidden", h)
        t = check_positive("temperature", temperature)
        # What the metadata exchange reads of "the local logits": leading shape, slice size,
        # dtype; an expanded 0-d tensor has them without holding any memory.
        shape_probe = torch.empty((), dtype=w.dtype).expand(*h.shape[:-1], w.shape[0])
    except (TypeError, ValueError) as exc:
        error, shape_probe = exc, None
    meta = _exchange_metadata(pg, shape_probe, None, ids, None)
    if error is not None:
        raise error
    assert shape_probe is not None and ids is not None
    offset, total = _check_agreement(meta, dist.get_rank(pg), "local_weight", None, True)
    ids = check_tokens("tokens", ids, h.shape[:-1], total)
    local = ids.reshape(-1) - offset
    out: Tensor = _VocabParallelLinearLogProbs.apply(h, w, b, local, t, total, pg)  # type: ignore[no-untyped-call]
    return check_no_nan(
        out,
        "hidden, local_weight or local_bias contain NaN or inf on some rank, or give a row "
        "whose logits are all -inf; got a NaN log-prob in those rows",
    )
