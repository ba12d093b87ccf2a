r"""Data-parallel :func:`klpen.mismatch_metrics`: the sampler-trainer mismatch of a whole batch.

Chapter 8 of the book. Each rank holds other rows of the batch; its sufficient statistics
(``klpen.sampling.mismatch_sums``: counts and sums, a max, a min) travel in one
all-gather, and every rank combines the same table into the global metrics.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from .._validation import check_all
from ..sampling import (
    MAX_FIELDS,
    MIN_FIELDS,
    SUM_FIELDS,
    MismatchSums,
    metrics_from_sums,
    mismatch_sums,
)
from ._protocol import guarded_all_gather, meta_device, resolve_group

__all__ = ["mismatch_metrics"]

_FIELDS = (*SUM_FIELDS, *MAX_FIELDS, *MIN_FIELDS)
_SUMS = slice(0, len(SUM_FIELDS))
_MAXES = slice(_SUMS.stop, _SUMS.stop + len(MAX_FIELDS))
_MINS = slice(_MAXES.stop, len(_FIELDS))
_BAND = slice(len(_FIELDS), len(_FIELDS) + 2)
_ROW = _BAND.stop + 1  # + the failure flag


def mismatch_metrics(
    trainer_logprobs: Tensor,
    rollout_logprobs: Tensor,
    mask: Tensor,
    group: dist.ProcessGroup | None = None,
    *,
    band: tuple[float, float] = (0.8, 1.25),
    as_tensors: bool = False,
) -> dict[str, float] | dict[str, Tensor]:
    r""":func:`klpen.mismatch_metrics` over a batch split across a data-parallel group.

    Each rank holds its own tokens (shapes free to differ between ranks). Returns, on every
    rank, the metrics of ``klpen.mismatch_metrics`` on the concatenation of every rank's valid
    tokens: with :math:`\delta = \log \pi_\mathrm{trainer}(y) - \log \mu(y)` and the ranks'
    statistics :math:`S_r` of ``klpen.sampling.mismatch_sums``,

    .. math::
        \begin{aligned}
        n &= \textstyle\sum_r n_r, \\
        \textstyle\sum \delta &= \textstyle\sum_r \big(\sum \delta\big)_r
            \ (\text{every sum}), \\
        \max \rho &= \max_r (\max \rho)_r, \\
        \min \rho &= \min_r (\min \rho)_r,
        \end{aligned}

    then ``klpen.sampling.metrics_from_sums`` (means are global sums over the global
    count ``n``; every metric is 0 when no rank has a valid token). The ranks' rows are
    combined in rank order, so the result is the same, bit for bit, on every rank.

    Args:
        trainer_logprobs: ``(...)`` log-probs the trainer computes for this rank's tokens.
        rollout_logprobs: ``(...)`` log-probs the sampler reported, same shape.
        mask: ``(...)`` 0/1 mask of the valid tokens.
        group: the data-parallel process group; ``None`` for the default group.
        band: ``(lo, hi)`` with ``0 < lo < hi`` finite, the same on every rank.
        as_tensors: return 0-d float64 tensors on the inputs' device instead of floats.

    Returns:
        The dict of :func:`klpen.mismatch_metrics`, global, identical on every rank.

    Communication: one all-gather of 12 ``float64`` per rank (the nine statistics, the band, a
    failure flag). With ``as_tensors=True`` no statistic and no metric is read on the host: the
    only host reads are the value checks of the inputs (NaN scans, the band agreement) and the
    one failure flag of the guard that makes a failure on one rank raise on every rank.

    Raises:
        TypeError, ValueError: on any rank, what :func:`klpen.mismatch_metrics` refuses
            (wrong types or shapes, NaN or ``+inf`` log-probs or a ``-inf`` rollout log-prob
            at a valid position, a bad band or ``as_tensors``): the other ranks raise a
            ``ValueError`` naming it; bands that differ between ranks. Every rank raises, none
            hangs.

    Example (rank 0 holds one valid token, rank 1 two)::

        >>> trainer = torch.tensor([-1.0]) if dist.get_rank() == 0 else torch.tensor(
        ...     [-2.0, -3.0])  # doctest: +SKIP
        >>> rollout = torch.tensor([-1.5]) if dist.get_rank() == 0 else torch.tensor(
        ...     [-2.0, -2.0])  # doctest: +SKIP
        >>> m = mismatch_metrics(trainer, rollout, torch.ones_like(trainer))  # doctest: +SKIP
        >>> m["tokens"], m["max_abs_log_ratio"]  # doctest: +SKIP
        (3.0, 1.0)

    The same numbers in one process, on the concatenated tokens:

        >>> from klpen import mismatch_metrics as single_process_metrics
        >>> m = single_process_metrics(torch.tensor([-1.0, -2.0, -3.0]),
        ...                            torch.tensor([-1.5, -2.0, -2.0]), torch.ones(3))
        >>> m["tokens"], m["max_abs_log_ratio"]
        (3.0, 1.0)
    """
    pg = resolve_group(group)
    buffer = torch.zeros(_ROW, dtype=torch.float64, device=meta_device(pg))
    where: list[torch.device] = []

    def local_sums() -> None:
        if not isinstance(as_tensors, bool):
            raise TypeError(f"as_tensors must be a bool, got {type(as_tensors).__name__}")
        sums = mismatch_sums(trainer_logprobs, rollout_logprobs, mask, band=band)
        stats = torch.stack([getattr(sums, f) for f in _FIELDS])
        buffer[: len(_FIELDS)] = stats.to(buffer.device)
        buffer[_BAND] = torch.tensor([float(b) for b in band], dtype=torch.float64)
        where.append(trainer_logprobs.device)

    table = guarded_all_gather(buffer, pg, local_sums, "trainer_logprobs/rollout_logprobs/mask")
    bands = table[:, _BAND]
    check_all(
        (bands == bands[:1]).all(dim=1),
        lambda i: (
            f"band must be the same on every rank, got {tuple(bands[0].tolist())} on rank 0 "
            f"and {tuple(bands[i[0]].tolist())} on rank {i[0]}"
        ),
    )
    # Rank order: the same sums, bit for bit, on every rank.
    combined = {
        **dict(zip(SUM_FIELDS, table[:, _SUMS].sum(dim=0).unbind(), strict=True)),
        **dict(zip(MAX_FIELDS, table[:, _MAXES].amax(dim=0).unbind(), strict=True)),
        **dict(zip(MIN_FIELDS, table[:, _MINS].amin(dim=0).unbind(), strict=True)),
    }
    device = where[0]
    sums = MismatchSums(**{f: combined[f].to(device) for f in MismatchSums._fields})
    metrics = metrics_from_sums(sums)
    if as_tensors:
        return metrics
    return {k: float(v) for k, v in metrics.items()}
