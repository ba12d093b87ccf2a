"""The ``torch`` backend: the reference block loops, the oracle of every other backend.

Each method is a thin adapter from the :class:`~klpen.kernels.Backend` protocol to the block
loops of :mod:`klpen.kernels.torch_logprobs` and :mod:`klpen.kernels.torch_kl`, which run on
any device torch runs on (sequential loops over blocks of rows, :mod:`klpen.kernels._rows`).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .blocks import block_rows_for, compute_dtype, row_mask, rows_of, shifted_log_sums, sync_free
from .torch_jsd import jsd_backward_saved, jsd_forward_saved, jsd_saved_like
from .torch_kl import KLRows, exact_kl_stats, kl_grads, kl_row_stats
from .torch_logprobs import LogProbGrad, LogProbRows, entropy_sums, logprob_grad, row_max_sums

__all__ = ["TorchBackend"]


def _empty(like: Tensor, dtype: torch.dtype) -> Tensor:
    return torch.empty(0, dtype=dtype, device=like.device)


def _redo_rows(mask: Tensor, device: torch.device) -> Tensor:
    """The rows a forward redid, from the mask it saved (empty: none)."""
    return rows_of(mask) if mask.numel() else torch.empty(0, dtype=torch.int64, device=device)


class TorchBackend:
    """The reference kernels (see :mod:`klpen.kernels` for the protocol).

    Where :func:`~klpen.kernels.blocks.sync_free` says so (value checks off, on an
    accelerator), each method takes a path without data-dependent steps, so that it makes no
    host synchronisation: the
    log-probs and entropy are shifted by the row max (one more read of the logits), and the
    full KL is computed for every row by the float64 form that the default path keeps for
    the rows its fast formulas cannot promise (exact, and slower).

    Example:
        >>> logp, ent, saved = TorchBackend().logprobs_forward(
        ...     torch.tensor([[2.0, 0.0, 0.0]]), torch.tensor([0]), 1.0, True)
        >>> logp, ent
        (tensor([-0.2395]), tensor([0.6656]))
    """

    name = "torch"

    def logprobs_forward(
        self, logits: Tensor, tokens: Tensor | None, scale: float, entropy: bool
    ) -> tuple[Tensor, Tensor, tuple[Tensor, ...]]:
        dtype = compute_dtype(logits.dtype)
        shape = logits.shape[:-1]
        rows = block_rows_for(logits)
        if sync_free(logits):
            return self._logprobs_sync_free(logits, tokens, scale, entropy, rows)
        # excerpt: forward
        # The sums are shifted by an entry of each row: the token's logit (one gather over the
        # whole, possibly strided, tensor reads N numbers), or the row max for the entropy
        # alone (then H = log s - E_p[y] adds two non-negative numbers, without cancellation).
        # The sum counts exp(0) = 1: it cannot underflow, and log s >= 0.
        if tokens is None:
            shift = logits.amax(dim=-1).reshape(-1).to(dtype)
        else:
            shift = logits.gather(-1, tokens.unsqueeze(-1)).reshape(-1).to(dtype)
        # end excerpt
        if entropy:
            centre, log_s, mean_y, redo = entropy_sums(logits, rows, dtype, shift, scale)
            redo = row_mask(redo, shift.shape[0])
            ent = (log_s - mean_y).view(shape)
        else:
            centre, log_s = shifted_log_sums(logits, rows, dtype, shift, scale)
            ent, mean_y = _empty(logits, dtype), _empty(logits, dtype)
            redo = _empty(logits, torch.bool)
        logp = _empty(logits, dtype)
        # excerpt: forward
        if tokens is not None:
            # -log s where the token's logit is the shift: no large number is subtracted, so
            # a common offset of the logits costs no digits (log_softmax's accuracy).
            logp = (shift - centre).mul_(scale).sub_(log_s)
            # A +inf logit elsewhere in the row gives log s = inf, a quiet -inf: NaN it, for
            # the public function to report.
            logp = torch.where(log_s == math.inf, math.nan, logp).view(shape)
        # end excerpt
        # redo: the (N,) rows that entropy_sums redid with 0 · log 0 = 0, as a mask
        return logp, ent, (centre, log_s, mean_y, redo)

    def _logprobs_sync_free(
        self, logits: Tensor, tokens: Tensor | None, scale: float, entropy: bool, rows: int
    ) -> tuple[Tensor, Tensor, tuple[Tensor, ...]]:
        dtype = compute_dtype(logits.dtype)
        shape = logits.shape[:-1]
        centre, log_s, mean_y = row_max_sums(logits, rows, dtype, scale, entropy)
        ent = _empty(logits, dtype) if mean_y is None else (log_s - mean_y).view(shape)
        logp = _empty(logits, dtype)
        if tokens is not None:
            taken = logits.gather(-1, tokens.unsqueeze(-1)).reshape(-1).to(dtype)
            logp = (taken - centre).mul_(scale).sub_(log_s)
            logp = torch.where(log_s == math.inf, math.nan, logp).view(shape)
        # no rows to redo: the gradient writes 0 · log 0 = 0 in every block (grad_block)
        saved_mean = _empty(logits, dtype) if mean_y is None else mean_y
        return logp, ent, (centre, log_s, saved_mean, _empty(logits, torch.bool))

    def logprobs_saved_like(
        self, logits: Tensor, tokens: Tensor | None, entropy: bool
    ) -> tuple[Tensor, ...]:
        """Empty tensors shaped as what :meth:`logprobs_forward` saves (for fake tensors)."""
        dtype = compute_dtype(logits.dtype)
        n = logits.numel() // logits.shape[-1]
        mean = (n if entropy else 0,)
        redo = (0,) if sync_free(logits) or not entropy else (n,)
        return (
            logits.new_empty(n, dtype=dtype),
            logits.new_empty(n, dtype=dtype),
            logits.new_empty(mean, dtype=dtype),
            logits.new_empty(redo, dtype=torch.bool),
        )

    def logprobs_backward(
        self,
        logits: Tensor,
        tokens: Tensor | None,
        saved: tuple[Tensor, ...],
        grad_logp: Tensor | None,
        grad_ent: Tensor | None,
        scale: float,
    ) -> Tensor:
        centre, log_s, mean_y, mask = saved
        redo = _redo_rows(mask, logits.device)
        index = None if tokens is None or grad_logp is None else tokens.reshape(-1, 1)
        stats = LogProbRows(centre, log_s, mean_y, redo)
        upstream = LogProbGrad(index, grad_logp, grad_ent)
        return logprob_grad(logits, stats, upstream, block_rows_for(logits), scale)

    def full_kl_forward(
        self, policy: Tensor, reference: Tensor, scale: float
    ) -> tuple[Tensor, tuple[Tensor, ...]]:
        dtype = compute_dtype(torch.promote_types(policy.dtype, reference.dtype))
        rows = block_rows_for(policy)
        if sync_free(policy):
            stats, redo = exact_kl_stats(policy, reference, rows, dtype, scale)
        else:
            stats, redo = kl_row_stats(policy, reference, rows, dtype, scale)
        lse_z, lse_w, kl, _ = stats.unbind()
        # Rounding can leave a true 0 at -1e-8; the divergence itself is never negative.
        kl.clamp_(min=0.0)
        # NaN or +inf logits, or a row of -inf only (and nothing else) make a log-sum-exp
        # non-finite: its divergence is NaN-ed here, for full_kl to report.
        kl.masked_fill_(~(torch.isfinite(lse_z) & torch.isfinite(lse_w)), math.nan)
        # the divergence is returned apart from the saved statistics (which hold it too)
        # The rows redone in float64, as a mask; every row in the sync-free path (none saved).
        mask = _empty(policy, torch.bool) if sync_free(policy) else row_mask(redo, kl.shape[0])
        return kl.view(policy.shape[:-1]).clone(), (stats, mask)

    def full_kl_saved_like(self, policy: Tensor, reference: Tensor) -> tuple[Tensor, ...]:
        """Empty tensors shaped as what :meth:`full_kl_forward` saves (for fake tensors)."""
        dtype = compute_dtype(torch.promote_types(policy.dtype, reference.dtype))
        n = policy.numel() // policy.shape[-1]
        mask = 0 if sync_free(policy) else n
        return (
            policy.new_empty((4, n), dtype=dtype),
            policy.new_empty(mask, dtype=torch.bool),
        )

    def full_kl_backward(
        self,
        policy: Tensor,
        reference: Tensor,
        saved: tuple[Tensor, ...],
        grad: Tensor,
        scale: float,
    ) -> Tensor:
        grad_z, _ = self.full_kl_backward_both(policy, reference, saved, grad, scale, (True, False))
        assert grad_z is not None
        return grad_z

    def full_kl_backward_both(
        self,
        policy: Tensor,
        reference: Tensor,
        saved: tuple[Tensor, ...],
        grad: Tensor,
        scale: float,
        needs: tuple[bool, bool],
    ) -> tuple[Tensor | None, Tensor | None]:
        """The gradients w.r.t. the policy and (where ``needs`` says) the reference logits."""
        stats, mask = saved
        if sync_free(policy):
            redo = torch.arange(stats.shape[1], device=policy.device)
        else:
            redo = _redo_rows(mask, policy.device)
        rows = block_rows_for(policy)
        return kl_grads(policy, reference, KLRows(stats, redo), grad, rows, needs, scale)

    # The generalized JSD of klpen.distill: the block loops of torch_jsd; the forward saves
    # a few numbers per row so that the student's gradient needs no reduction.

    def jsd_forward(
        self, student: Tensor, teacher: Tensor, scale: float, beta: float
    ) -> tuple[Tensor, tuple[Tensor, ...]]:
        """``J_β`` per row and the ``(N, 6)`` statistics the backward reads (see
        :func:`klpen.kernels.torch_jsd.jsd_forward_saved`)."""
        values, saved = jsd_forward_saved(student, teacher, scale, beta)
        return values, (saved,)

    def jsd_saved_like(self, student: Tensor, teacher: Tensor) -> tuple[Tensor, ...]:
        """An empty tensor shaped as what :meth:`jsd_forward` saves."""
        return (jsd_saved_like(student, teacher),)

    def jsd_backward(
        self,
        student: Tensor,
        teacher: Tensor,
        saved: tuple[Tensor, ...],
        grad: Tensor,
        scale: float,
        beta: float,
        needs: tuple[bool, bool],
    ) -> tuple[Tensor | None, Tensor | None]:
        """``(d/dstudent, d/dteacher)`` of ``Σ grad · J_β`` where ``needs`` says."""
        return jsd_backward_saved(student, teacher, saved[0], grad, scale, beta, needs)
