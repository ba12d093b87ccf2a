r"""Vocab-parallel log-probs from hidden states: a vocabulary-sharded output layer, no logits.

Chapter 11. In tensor parallelism the output layer ``weight (V, H)`` is split by rows: rank ``r``
holds ``weight[o_r : o_r + V_r]`` (contiguous, in rank order, possibly uneven) and the same
``hidden`` states. Each rank walks the tiles of its own slice exactly as
:func:`klpen.linear_logprobs` does and reduces them to a few numbers per row; one
all-reduce (sum) of them gives the log-sum-exp and the token's logit of the whole vocabulary:

.. math::

    \begin{aligned}
    \mathrm{lse}(z) &= \log \textstyle\sum_r \sum_{v \in V_r} e^{z_v}, \\
    \log \pi(y) &= z_y - \mathrm{lse}(z)
    \end{aligned}

(shift-free sums, exact for logits within the range of
:func:`~klpen.kernels.blocks.shift_free_ok`; the rows outside it are redone, on every rank
alike, after an all-reduce (max) of the row maxes).

Backward, like Megatron's column-parallel output layer: each rank recomputes its tiles, forms
the gradient of its own logits, and gets its ``weight`` (and ``bias``) slice's gradient locally;
the gradient of the replicated ``hidden`` is the sum of every rank's ``G_r W_r``, one
all-reduce (sum) of ``N × H`` numbers.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from .._autograd import KernelFunction
from .._validation import (
    check_no_nan,
    check_same_device,
    check_shape,
    check_temperature,
    check_token_ids,
)
from ._kernels import (
    Layer,
    Reduce,
    backprop,
    check_layer,
    flat_layer,
    layer_dtype,
    logprob_grad,
    logprob_stats,
)
from ._protocol import (
    Metadata,
    check_agreement,
    check_same_tokens,
    exchange_metadata,
    guarded_all_reduce,
    resolve_group,
)

__all__ = ["vocab_parallel_linear_logprobs"]


_WHAT = "vocab_parallel_linear_logprobs"


def _reducer(group: Any, dtype: torch.dtype, device: torch.device) -> Reduce:
    """All-reduce across ``group``, the local computation guarded (:mod:`._protocol`)."""
    ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}

    def reduce(compute: Callable[[], Tensor], shape: tuple[int, ...], op: str) -> Tensor:
        buffer = torch.zeros(math.prod(shape) + 1, dtype=dtype, device=device)
        out = buffer[:-1].view(shape)

        def fill() -> None:
            out.copy_(compute())

        guarded_all_reduce(buffer, ops[op], group, fill, _WHAT)
        return out

    return reduce


class _VocabParallelLinearLogProbs(KernelFunction):
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
        KernelFunction.named(ctx, "vocab_parallel_linear_logprobs")
        layer = flat_layer(hidden, weight, bias, temperature)
        reduce = _reducer(group, layer.dtype, hidden.device)
        stats = logprob_stats(layer, local, False, vocab, reduce)
        ctx.save_for_backward(hidden, weight, bias, local, stats.lse)
        ctx.temperature, ctx.group = temperature, group
        return stats.logprob.view(hidden.shape[:-1])

    @staticmethod
    def gradients(
        ctx: Any, grad_out: Tensor
    ) -> tuple[Tensor | None, Tensor | None, Tensor | None, None, None, None, None]:
        hidden, weight, bias, local, lse = ctx.saved_tensors
        layer: Layer = flat_layer(hidden, weight, bias, ctx.temperature)
        grads: dict[str, Tensor | None] = {}

        def local_grads() -> Tensor:
            # Every rank computes and all-reduces the hidden gradient, also where its hidden
            # does not require grad, so that no rank waits alone.
            needs = (True, ctx.needs_input_grad[1], ctx.needs_input_grad[2])
            tile_grad = logprob_grad(layer, local, lse, grad_out, None)
            gx, grads["weight"], grads["bias"] = backprop(layer, tile_grad, needs)
            assert gx is not None
            return gx

        reduce = _reducer(ctx.group, layer.dtype, hidden.device)
        gx = reduce(local_grads, tuple(layer.hidden.shape), "sum")
        grad_x = gx.view(hidden.shape).to(hidden.dtype) if ctx.needs_input_grad[0] else None
        return grad_x, grads["weight"], grads["bias"], None, None, None, None


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
    dtypes, hidden size, leading shape and temperature agree), one all-reduce (max) of ``2·N + 1``
    floats (the token ids and their negatives: tokens compared exactly; more digits beyond ``2**24``
    ids in fp32) and one all-reduce (sum) of ``2·N + 1`` floats, plus, only if some row has extreme
    or ``-inf`` logits, an all-reduce (max) and one (sum) for those rows; backward, one all-reduce
    (sum) of ``N·H + 1`` floats. ``+ 1``: the failure flag of :mod:`klpen.distributed`: an error on
    one rank (bad input, or a failure in its local computation) raises on every rank, none hangs.


    Raises:
        TypeError, ValueError: as :func:`klpen.linear_logprobs` on any rank (the other
            ranks raise a ``ValueError`` naming it and repeating its message), or dtypes (of
            ``hidden``, ``local_weight``, ``local_bias``, or a bias on some ranks only), hidden
            sizes, leading shapes, temperatures or tokens that differ across ranks (any
            difference): every rank raises a ``ValueError`` naming what differs.
        RuntimeError: the local computation failed on some rank; the others name it.

    Example (on each of two ranks, rank 0 holding row 0 and rank 1 row 1)::

        >>> hidden, weight = torch.tensor([[1.0, 0.0]]), torch.tensor([[2.0, 0.0], [0.0, 1.0]])
        >>> local = weight[dist.get_rank() : dist.get_rank() + 1]  # doctest: +SKIP
        >>> vocab_parallel_linear_logprobs(hidden, local, torch.tensor([0]))  # doctest: +SKIP
        tensor([-0.1269])
    """
    pg = resolve_group(group)
    failure: Exception | None = None
    meta: Metadata | None = None
    try:
        names = ("hidden", "local_weight", "local_bias")
        h, w, b = check_layer(names, hidden, local_weight, local_bias)
        ids = check_token_ids("tokens", tokens)
        check_shape("tokens", ids, h.shape[:-1], "the leading shape of hidden")
        check_same_device("tokens", ids, "hidden", h)
        t = check_temperature("temperature", temperature, layer_dtype(h, w, b))
        meta = Metadata(
            vocab=w.shape[0],
            vocab_size=None,
            leading_shape=tuple(h.shape[:-1]),
            hidden_size=h.shape[-1],
            temperature=t,
            dtypes=(
                ("hidden", h.dtype),
                ("local_weight", w.dtype),
                ("local_bias", None if b is None else b.dtype),
            ),
        )
    except (TypeError, ValueError) as exc:
        failure = exc
    # Every rank takes part in the metadata exchange, also one that rejected its inputs; then
    # all raise together. Agreeing dtypes, hidden size and leading shape give every rank the
    # same compute dtype and the same sizes in every later collective.
    table = exchange_metadata(pg, meta, failure, "hidden/local_weight/tokens")
    assert meta is not None
    offset, total = check_agreement(table, meta, dist.get_rank(pg))
    dtype = layer_dtype(h, w, b)
    check_same_tokens(pg, ids, total, dtype, _WHAT)
    local = ids.reshape(-1).long() - offset
    out: Tensor = _VocabParallelLinearLogProbs.apply(h, w, b, local, t, total, pg)  # type: ignore[no-untyped-call]
    return check_no_nan(
        out,
        "hidden, local_weight or local_bias contain NaN or inf on some rank, or give a row "
        "whose logits are all -inf; got a NaN log-prob in those rows",
    )
