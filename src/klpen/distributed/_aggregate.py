r"""Data-parallel :func:`klpen.aggregate`: token counts and sums made global across a group.

Chapter 8 of the book. Each rank holds other rows of the batch; one all-reduce (sum) of a few
float64 numbers (numerator, denominator, the mode of every rank, a failure flag) makes the
value global, and the gradient is scaled so that the data-parallel average of the ranks'
gradients is the gradient of the global aggregate.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from .._validation import check_choice
from ..masking import AGGREGATION_MODES, _checked, _zero_masked
from ._kernels import compute_dtype
from ._protocol import guarded_all_reduce, meta_device, resolve_group

__all__ = ["aggregate"]

_NUMERATOR, _DENOMINATOR, _MODES = 0, 1, 2
_AGGREGATE_LENGTH = _MODES + len(AGGREGATION_MODES) + 1  # + the failure flag


class _DataParallelAggregate(torch.autograd.Function):
    """The global aggregate as value; ``grad_out · scale_b`` at each valid token of row ``b``."""

    @staticmethod
    def forward(ctx: Any, values: Tensor, value: Tensor, mask: Tensor, scale: Tensor) -> Tensor:
        ctx.save_for_backward(mask, scale)
        return value.clone()

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor, None, None, None]:
        mask, scale = ctx.saved_tensors
        # where(), not a product with the mask: nothing at a masked slot reaches the gradient.
        grad = torch.where(mask, grad_out * scale, torch.zeros((), dtype=scale.dtype))
        return grad.to(grad_out.dtype), None, None, None


def aggregate(
    values: Tensor, mask: Tensor, mode: str, group: dist.ProcessGroup | None = None
) -> Tensor:
    r""":func:`klpen.aggregate` over the rows of a batch split across a data-parallel group.

    Each rank holds its own rows: ``values`` and ``mask`` of shape ``(B_r, T_r)``, both sizes
    free to differ between ranks. Returns, on every rank, ``klpen.aggregate`` of the
    concatenated batch (the rows of all ranks, padded to one length with masked slots):
    counts and sums are global. With ``x`` the values, ``m`` the mask, ``n_b = Σ_t m_{b,t}``,
    ``C = Σ_{ranks} Σ_b n_b`` the global token count and ``R`` the global number of rows with
    a valid token:

    =========================  ===================================  =========================
    mode                       value                                gradient on this rank
    =========================  ===================================  =========================
    ``"token-mean"``           :math:`\sum m x / C`                 :math:`W m / C`
    ``"token-sum"``            :math:`\sum m x`                     :math:`W m`
    ``"seq-mean-token-mean"``  :math:`\sum_b (\sum_t m x / n_b)/R`  :math:`W m / (n_b R)`
    ``"seq-mean-token-sum"``   :math:`\sum_b \sum_t m x / R`        :math:`W m / R`
    =========================  ===================================  =========================

    The gradient w.r.t. this rank's ``values`` is ``W`` (the group's size) times this rank's
    slice of the gradient of the global aggregate. Data-parallel training (DDP, FSDP)
    *averages* the parameter gradients of the ranks, so that average is exactly the gradient
    of the global aggregate; averaging per-rank ``klpen.aggregate`` losses instead weighs a
    token on a rank with few tokens more than one on a rank with many. With no valid token
    (or, in the seq-mean modes, no valid row) in the whole group, every mode returns 0 with a
    zero gradient.

    Args:
        values: ``(B_r, T_r)`` floating tensor on this rank.
        mask: ``(B_r, T_r)`` bool, integer or floating 0/1 tensor. Whatever ``values`` holds at
            a masked slot (NaN, ``±inf``) reaches neither the value nor the gradient.
        mode: one of the four modes above, the same on every rank.
        group: the data-parallel process group; ``None`` for the default group.

    Returns:
        A 0-d tensor in ``values``' dtype, identical on every rank (sums and counts are
        accumulated in float64), differentiable w.r.t. ``values``.

    Communication: one all-reduce (sum) of 7 ``float64`` (numerator, denominator, the mode
    of every rank, a failure flag); the backward pass communicates nothing.

    Raises:
        TypeError, ValueError: wrong types, tensor kinds, shapes or devices, a mask that is
            not 0/1, an unknown mode, or NaN at a valid position, on any rank (the other ranks
            raise a ``ValueError`` naming it), or modes that differ between ranks. Every rank
            raises, none hangs.

    Example (rank 0 holds one row of three valid tokens, rank 1 one row of one)::

        >>> values = torch.tensor([[1.0, 1.0, 1.0]]) if dist.get_rank() == 0 else torch.tensor(
        ...     [[4.0, 0.0, 0.0]])  # doctest: +SKIP
        >>> mask = torch.tensor([[1, 1, 1]]) if dist.get_rank() == 0 else torch.tensor(
        ...     [[1, 0, 0]])  # doctest: +SKIP
        >>> aggregate(values, mask, "token-mean")  # doctest: +SKIP
        tensor(1.7500)

    The same number in one process, on the concatenated batch:

        >>> from klpen import aggregate as single_process_aggregate
        >>> values = torch.tensor([[1.0, 1.0, 1.0], [4.0, 0.0, 0.0]])
        >>> single_process_aggregate(values, torch.tensor([[1, 1, 1], [1, 0, 0]]), "token-mean")
        tensor(1.7500)
    """
    pg = resolve_group(group)
    world = dist.get_world_size(pg)
    device = meta_device(pg)
    buffer = torch.zeros(_AGGREGATE_LENGTH, dtype=torch.float64, device=device)
    local: dict[str, Any] = {}

    def local_sums() -> None:
        # The checks of klpen.aggregate: tensor kinds, dtype, device, a 0/1 mask of the same
        # shape, no NaN at a valid position.
        m = _checked(values, mask)
        x = values
        if x.dim() != 2:
            raise ValueError(f"values must have shape (B, T), got {tuple(x.shape)}")
        name = check_choice("mode", mode, AGGREGATION_MODES)
        kept = _zero_masked(x.detach(), m)  # the gradient comes from the Function
        counts = m.sum(-1, dtype=torch.float64)  # n_b
        if name == "seq-mean-token-mean":
            numerator = (kept.sum(-1, dtype=torch.float64) / counts.clamp(min=1)).sum()
        else:
            numerator = kept.sum(dtype=torch.float64)
        if name == "token-mean":
            denominator = counts.sum()
        elif name == "token-sum":
            denominator = torch.ones((), dtype=torch.float64, device=x.device)
        else:
            denominator = (counts > 0).sum(dtype=torch.float64)
        buffer[_NUMERATOR] = numerator
        buffer[_DENOMINATOR] = denominator
        buffer[_MODES + AGGREGATION_MODES.index(name)] = 1
        local.update(values=x, mask=m, counts=counts, mode=name)

    guarded_all_reduce(buffer, dist.ReduceOp.SUM, pg, local_sums, "values/mask/mode")
    modes = buffer[_MODES:-1].tolist()
    if max(modes) != world:
        got = {AGGREGATION_MODES[i]: int(c) for i, c in enumerate(modes) if c}
        raise ValueError(
            f"mode must be the same on every rank, got these modes (and the "
            f"number of ranks using each): {got}"
        )
    x, m, name = local["values"], local["mask"], local["mode"]
    total = float(buffer[_NUMERATOR])
    denominator = float(buffer[_DENOMINATOR])
    if name == "token-sum":
        denominator = 1.0  # the all-reduce summed one 1 per rank
    value = total / denominator if denominator > 0 else 0.0
    # Per row: d value / d x_{b,t} at a valid token, times W (data-parallel averaging).
    if denominator == 0:
        factor = 0.0
    else:
        factor = world / denominator
    scale = torch.full((x.shape[0], 1), factor, dtype=torch.float64, device=x.device)
    if name == "seq-mean-token-mean":
        scale = scale / local["counts"].clamp(min=1).unsqueeze(-1)
    result = torch.tensor(value, dtype=torch.float64, device=x.device).to(x.dtype)
    out: Tensor = _DataParallelAggregate.apply(x, result, m, scale.to(compute_dtype(x.dtype)))  # type: ignore[no-untyped-call]
    return out
