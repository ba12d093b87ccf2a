r"""When the sampler is not the policy: sampler log-probs, importance weights, mismatch metrics.

Chapter 9 of the book. The tokens of an RLHF batch are drawn by a sampler, not from
:math:`\mathrm{softmax}(z)`: a temperature :math:`T`, a top-k / top-p cut, a policy a few
updates old or another engine's numerics stand between the trainer's logits and the token.

* :func:`sampler_logprobs` gives the log-probs under the distribution really sampled from,
  :math:`\mu(y) = e^{z_y/T} / \sum_{v \in K} e^{z_v/T}` on the kept set :math:`K`, and the log
  kept mass :math:`\log S`, exactly as Hugging Face ``generate`` builds it;
* :func:`importance_weights` gives the (truncated or masked) weights :math:`\pi/\mu` that turn
  an expectation under :math:`\mu` into one under :math:`\pi` (TIS / MIS);
* :func:`mismatch_metrics` gives the numbers a trainer logs to see that :math:`\mu \ne \pi`.

**Hugging Face semantics** (``transformers`` ``TemperatureLogitsWarper``, ``TopKLogitsWarper``,
``TopPLogitsWarper``, applied in this order by ``generate``): the scores are divided by ``T``;
top-k keeps every token whose score is ``>=`` the k-th largest (ties at the boundary are all
kept, so more than k tokens can survive); top-p sorts the scores ascending, takes the softmax
and its cumulative sum, removes the tokens whose cumulative mass is ``<= 1 - top_p`` and always
keeps the most probable token. The boundary token (the one whose inclusion makes the kept mass
reach ``top_p``) is kept; among tokens tied at the boundary, which ones fall is decided by the
order of ``torch.sort`` (the same call is made here, so the same ones fall).

**vLLM** applies temperature, then top-k and top-p with the same ascending-sort rule in its
PyTorch path, but (i) the log-probs it returns are by default those of the *raw* logits, before
temperature and the cuts (``logprobs_mode="raw_logprobs"``; ``"processed_logprobs"`` returns the
sampler's), and (ii) its FlashInfer sampling kernels draw top-k / top-p by rejection sampling
without sorting, whose kept set can differ at ties. Log-probs reported by an engine are
therefore checked with :func:`mismatch_metrics`, not trusted.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import torch
from torch import Tensor

from ._chunks import block_buffer, block_rows_for, compute_dtype, row_blocks
from ._validation import (
    check_choice,
    check_floating,
    check_floating_like,
    check_mask,
    check_positive,
    check_same_device,
    check_temperature,
    check_token_ids,
    check_tokens,
)
from .estimators import k3
from .logprobs import get_logprobs_for_tokens
from .masking import _zero_masked

__all__ = [
    "IMPORTANCE_LEVELS",
    "IMPORTANCE_MODES",
    "importance_weights",
    "mismatch_metrics",
    "sampler_logprobs",
]

#: Levels of :func:`importance_weights`: per token, per sequence (product), geometric mean.
IMPORTANCE_LEVELS = ("token", "sequence", "geometric")
#: What :func:`importance_weights` does above ``cap``: clip to it (TIS) or drop the weight (MIS).
IMPORTANCE_MODES = ("truncate", "mask")

# Blocks of a top-k / top-p pass are this many times smaller than klpen's usual block.
_CUT_BLOCK_DIVISOR = 4


def _check_top_k(top_k: object) -> int | None:
    if top_k is None:
        return None
    if isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral):
        raise TypeError(f"top_k must be None or an int >= 1, got {type(top_k).__name__} {top_k!r}")
    if int(top_k) < 1:
        raise ValueError(f"top_k must be None or an int >= 1, got {int(top_k)}")
    return int(top_k)


def _check_top_p(top_p: object) -> float | None:
    if top_p is None:
        return None
    if isinstance(top_p, bool) or not isinstance(top_p, numbers.Real):
        raise TypeError(f"top_p must be None or a float in (0, 1], got {type(top_p).__name__}")
    p = float(top_p)
    if not 0.0 < p <= 1.0:
        raise ValueError(f"top_p must lie in (0, 1], got {p}")
    return p


def _kept_scores(
    block: Tensor, dtype: torch.dtype, temperature: float, top_k: int | None, top_p: float | None
) -> tuple[Tensor, Tensor]:
    """``(scaled, kept)``: the block's ``z / T`` in ``dtype`` and the same with cut tokens -inf.

    The operations of ``transformers``' warpers, in ``generate``'s order, on a ``(r, V)`` block.
    """
    # excerpt: cut
    scaled = block.to(dtype) / temperature  # division, as TemperatureLogitsWarper does
    kept = scaled
    if top_k is not None and top_k < scaled.shape[-1]:
        boundary = torch.topk(kept, top_k).values[..., -1:]
        kept = kept.masked_fill(kept < boundary, -math.inf)
    if top_p is not None and top_p < 1.0:
        ordered, order = torch.sort(kept, descending=False)
        cumulative = ordered.softmax(dim=-1).cumsum(dim=-1)
        cut = cumulative <= (1 - top_p)
        cut[..., -1:] = False  # min_tokens_to_keep = 1: the most probable token stays
        kept = kept.masked_fill(cut.scatter(1, order, cut), -math.inf)
    # end excerpt
    return scaled, kept


class _SamplerLogProbs(torch.autograd.Function):
    """Per row: ``log μ(y)`` on the kept set and ``log S``; saves two numbers per row."""

    @staticmethod
    def forward(
        ctx: Any,
        logits: Tensor,
        tokens: Tensor,
        temperature: float,
        top_k: int | None,
        top_p: float | None,
        rows: int,
    ) -> tuple[Tensor, Tensor]:
        dtype = compute_dtype(logits.dtype)
        n = tokens.numel()
        flat_tokens = tokens.reshape(-1, 1)
        logp = torch.empty(n, dtype=dtype, device=logits.device)
        lse_kept = torch.empty_like(logp)
        lse_all = torch.empty_like(logp)
        for start, block in row_blocks(logits, rows):
            stop = start + block.shape[0]
            scaled, kept = _kept_scores(block, dtype, temperature, top_k, top_p)
            torch.logsumexp(kept, dim=-1, out=lse_kept[start:stop])
            torch.logsumexp(scaled, dim=-1, out=lse_all[start:stop])
            taken = kept.gather(-1, flat_tokens[start:stop]).squeeze(-1)
            torch.sub(taken, lse_kept[start:stop], out=logp[start:stop])
        ctx.save_for_backward(logits, tokens, lse_kept, lse_all)
        ctx.settings = (temperature, top_k, top_p, rows)
        shape = tokens.shape
        return logp.view(shape), (lse_kept - lse_all).view(shape)

    @staticmethod
    def backward(
        ctx: Any, grad_logp: Tensor, grad_log_kept: Tensor
    ) -> tuple[Tensor | None, None, None, None, None, None]:
        logits, tokens, lse_kept, lse_all = ctx.saved_tensors
        temperature, top_k, top_p, rows = ctx.settings
        dtype = lse_kept.dtype
        index = tokens.reshape(-1, 1)
        g = grad_logp.reshape(-1, 1).to(dtype)
        h = grad_log_kept.reshape(-1, 1).to(dtype)
        zero = torch.zeros((), dtype=dtype, device=g.device)
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        flat_grad = grad.view(-1, logits.shape[-1])
        buf = block_buffer(logits, rows, dtype)
        for start, block in row_blocks(logits, rows):
            stop = start + block.shape[0]
            scaled, kept = _kept_scores(block, dtype, temperature, top_k, top_p)
            rows_index = index[start:stop]
            # A token outside the kept set has log-prob -inf for all nearby logits: no gradient.
            hit = torch.isfinite(kept.gather(-1, rows_index))
            gs, hs = torch.where(hit, g[start:stop], zero), h[start:stop]
            # d/dz_j [g log mu(y) + h log S] = (g (1[j=y] - mu_j) + h (mu_j - p_j)) / T, with
            # mu the kept-set softmax and p the full softmax of z / T.
            work = torch.sub(kept, lse_kept[start:stop, None], out=buf[: block.shape[0]]).exp_()
            p = scaled.sub_(lse_all[start:stop, None]).exp_()
            work.mul_(hs - gs).sub_(p.mul_(hs))
            work.scatter_add_(-1, rows_index, gs)
            flat_grad[start:stop].copy_(work.div_(temperature))
        return grad, None, None, None, None, None


def sampler_logprobs(
    logits: Tensor,
    tokens: Tensor,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
) -> tuple[Tensor, Tensor]:
    r"""Log-probs of ``tokens`` under the distribution that a temperature / top-k / top-p
    sampler drew them from.

    With scaled scores :math:`s = z / T` and the kept set :math:`K` (top-k first, then
    top-p, as Hugging Face ``generate`` applies them):

    .. math::

        \begin{aligned}
        \log \mu(y) &= s_y - \log \textstyle\sum_{v \in K} e^{s_v}, \\
        \log S &= \log \textstyle\sum_{v \in K} e^{s_v} \\
        &\quad - \log \textstyle\sum_v e^{s_v}
        \end{aligned}

    so that :math:`\log \mu(y) = \log \mathrm{softmax}(s)_y - \log S` for :math:`y \in K`,
    and :math:`-\infty` for a token outside :math:`K`. The kept set follows ``transformers``
    exactly, ties and the boundary token of top-p included (see the module docstring, which
    also says what vLLM does differently).

    Args:
        logits: ``(..., V)`` floating logits; position ``t`` scores ``tokens[..., t]``.
            ``-inf`` entries (a masked vocabulary) are allowed.
        tokens: ``(...)`` integer token ids in ``[0, V)``.
        temperature: finite and ``> 0`` (0, greedy decoding, has no log-probs).
        top_k: ``None`` (no cut) or an int ``>= 1``; ``top_k >= V`` keeps everything.
        top_p: ``None`` or a float in ``(0, 1]``; 1 keeps everything.

    Returns:
        ``(logprobs, log_kept_mass)``, both ``(...)`` in the compute dtype (fp32 for
        half-precision logits, else the logits' dtype). Both are differentiable w.r.t.
        ``logits`` through the kept set (the set itself is piecewise constant); a token outside
        it gets ``-inf`` and no gradient.

    Without a cut (no ``top_k``, or ``top_k >= V``; no ``top_p``, or 1) this is
    :func:`klpen.get_logprobs_for_tokens` with ``temperature`` and a kept mass of exactly 1.

    Memory: the rows are processed in blocks (sort and cumulative sum of one block at a time,
    a quarter of klpen's usual 16 MiB block when there is a cut); the forward keeps two numbers
    per row, the backward recomputes the kept set per block. The extra memory is a fixed
    amount (about 40 MB of temporaries on the CPU, whatever the batch), never a copy of the
    logits.

    Raises:
        TypeError, ValueError: wrong types, shapes, devices or token ids; a temperature that is
            not finite and positive; ``top_k < 1``; ``top_p`` outside ``(0, 1]``; NaN or
            ``+inf`` logits, or a row whose logits are all ``-inf``.

    Example:
        >>> z = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))
        >>> logp, log_s = sampler_logprobs(z, torch.tensor([0]), top_p=0.7)  # keeps 0.5, 0.3
        >>> logp.exp(), log_s.exp()
        (tensor([0.6250]), tensor([0.8000]))
    """
    check_floating("logits", logits, min_ndim=1)
    check_same_device("tokens", check_token_ids("tokens", tokens), "logits", logits)
    vocab = logits.shape[-1]
    if vocab == 0:
        raise ValueError(
            f"logits must have a non-empty last (vocabulary) axis, got {tuple(logits.shape)}"
        )
    ids = check_tokens("tokens", tokens, logits.shape[:-1], vocab)
    t = check_temperature("temperature", temperature)
    k, p = _check_top_k(top_k), _check_top_p(top_p)
    if (k is None or k >= vocab) and (p is None or p == 1.0):
        # Nothing is cut: the sampler is softmax(z / T), S = 1, and the one-pass log-prob
        # kernel computes it (to rounding: it multiplies by 1/T where transformers divides).
        logp = get_logprobs_for_tokens(logits, ids, temperature=t)
        return logp, torch.zeros_like(logp)
    # A cut holds about ten block-sized temporaries at once (the sort's values and int64
    # indices, softmax, cumulative sum, masks): a quarter block keeps them near 2.5 blocks.
    rows = max(1, block_rows_for(logits) // _CUT_BLOCK_DIVISOR)
    result: tuple[Tensor, Tensor] = _SamplerLogProbs.apply(  # type: ignore[no-untyped-call]
        logits, ids, t, k, p, rows
    )
    logp, log_kept = result
    if log_kept.numel() and not bool(torch.isfinite(log_kept).all()):
        raise ValueError(
            "logits contain NaN or +inf, or a row whose logits are all -inf "
            "(or a temperature so small that they overflow); got a non-finite kept mass"
        )
    return logp, log_kept


def _check_pair(
    name: str, values: object, other_name: str, other: object, mask: object
) -> tuple[Tensor, Tensor, Tensor]:
    """Two floating ``(...)`` log-prob tensors of one shape and a mask; NaN/+inf at valid slots
    raise. Returns the pair in the compute dtype and the mask as bool."""
    x = check_floating(name, values)
    y = check_floating_like(other_name, other, name, x, f"the shape of {name}")
    m = check_mask("mask", mask, x.shape, same_device_as=(name, x))
    dtype = compute_dtype(torch.promote_types(x.dtype, y.dtype))
    out = []
    for n, v in ((name, x), (other_name, y)):
        v = _zero_masked(v.detach().to(dtype), m)
        bad = torch.isnan(v) | (v == math.inf)
        if bool(bad.any()):
            raise ValueError(f"{n} must not be NaN or +inf at a valid position, got {v[bad][0]}")
        out.append(v)
    return out[0], out[1], m


def importance_weights(
    logprobs: Tensor,
    behavior_logprobs: Tensor,
    mask: Tensor,
    *,
    level: str = "token",
    cap: float | None = None,
    mode: str = "truncate",
) -> Tensor:
    r"""Importance weights :math:`\pi/\mu` for tokens drawn from a behavior policy :math:`\mu`.

    With the valid log-ratios :math:`\delta_t = \log \pi(y_t) - \log \mu(y_t)` of a row:

    .. math::

        w_t = \begin{cases}
            e^{\delta_t} & \text{token} \\
            e^{\sum_s \delta_s} & \text{sequence} \\
            e^{\frac{1}{n}\sum_s \delta_s} & \text{geometric}
        \end{cases}

    the sequence and geometric weights repeated at every valid token of the row. With ``cap``:
    ``mode="truncate"`` returns :math:`\min(w, c)` (truncated importance sampling, TIS);
    ``mode="mask"`` returns 0 where :math:`w > c` (masked importance sampling, MIS).

    Args:
        logprobs: ``(..., T)`` log π of the sampled tokens (the trainer's; detached here).
        behavior_logprobs: ``(..., T)`` log μ of the same tokens (the sampler's), same shape.
            ``-inf`` at a valid position (a token μ could not draw) is refused.
        mask: ``(..., T)`` 0/1 mask of the valid tokens.
        level: ``"token"``, ``"sequence"`` or ``"geometric"``.
        cap: ``None`` or a finite positive upper bound.
        mode: ``"truncate"`` or ``"mask"``.

    Returns:
        ``(..., T)`` weights in the compute dtype, detached, 0 at masked positions. Without a
        cap a weight can overflow to ``inf`` (a sequence weight does quickly); with one it
        never does.

    Raises:
        TypeError, ValueError: wrong types or shapes; NaN or ``+inf`` log-probs, or a ``-inf``
            behavior log-prob, at a valid position; an unknown level or mode; a bad cap.

    Example:
        >>> lp = torch.log(torch.tensor([[0.5, 0.2, 0.9]]))
        >>> mu = torch.log(torch.tensor([[0.25, 0.4, 0.9]]))
        >>> importance_weights(lp, mu, torch.tensor([[1, 1, 0]]), cap=1.5)
        tensor([[1.5000, 0.5000, 0.0000]])
    """
    x, y, m = _check_pair("logprobs", logprobs, "behavior_logprobs", behavior_logprobs, mask)
    if bool((m & (y == -math.inf)).any()):
        raise ValueError(
            "behavior_logprobs must not be -inf at a valid position: the behavior policy "
            "could not have drawn that token"
        )
    which = check_choice("level", level, IMPORTANCE_LEVELS)
    how = check_choice("mode", mode, IMPORTANCE_MODES)
    c = None if cap is None else check_positive("cap", cap)
    if x.dim() == 0 and which != "token":
        raise ValueError(f"level={which!r} needs a (..., T) tensor, got a 0-d logprobs")
    # excerpt: weights
    delta = _zero_masked(x - y, m)
    if which == "sequence":
        delta = delta.sum(-1, keepdim=True).expand_as(delta)
    elif which == "geometric":
        count = m.sum(-1, keepdim=True).clamp(min=1).to(delta.dtype)
        delta = (delta.sum(-1, keepdim=True) / count).expand_as(delta)
    w = delta.exp()
    if c is not None:
        w = w.clamp(max=c) if how == "truncate" else torch.where(w > c, 0.0, w)
    return _zero_masked(w, m)
    # end excerpt


def mismatch_metrics(
    trainer_logprobs: Tensor,
    rollout_logprobs: Tensor,
    mask: Tensor,
    *,
    band: tuple[float, float] = (0.8, 1.25),
) -> dict[str, float]:
    r"""What a trainer logs to see that the sampler's log-probs are not the trainer's.

    Over the valid tokens, drawn by the rollout engine :math:`\mu`, with
    :math:`\delta = \log \pi_\mathrm{trainer}(y) - \log \mu(y)` and ratio :math:`\rho = e^\delta`:

    * ``"mean_abs_log_ratio"``, ``"max_abs_log_ratio"``: mean and max of :math:`|\delta|`;
    * ``"mean_ratio"``, ``"min_ratio"``, ``"max_ratio"``: of :math:`\rho`; the mean estimates
      the trainer's mass on the sampler's support, 1 when nothing is cut;
    * ``"kl_k3"``: the k3 estimate of :math:`\mathrm{KL}(\mu \| \pi_\mathrm{trainer})`,
      :math:`\frac{1}{n}\sum (\rho - 1 - \delta)`, never negative;
    * ``"kl_k1"``: the k1 estimate :math:`-\frac{1}{n}\sum \delta` of the same KL;
    * ``"outside_band"``: the share of tokens with :math:`\rho \notin [\mathrm{lo}, \mathrm{hi}]`;
    * ``"tokens"``: the number of valid tokens.

    With no valid token every metric is 0.

    Args:
        trainer_logprobs: ``(...)`` log-probs the trainer computes for the sampled tokens.
        rollout_logprobs: ``(...)`` log-probs the sampler reported, same shape.
        mask: ``(...)`` 0/1 mask of the valid tokens.
        band: ``(lo, hi)`` with ``0 < lo < hi`` finite.

    Returns:
        A dict of Python floats, rounded to nothing (format them when printing).

    Example:
        >>> m = mismatch_metrics(torch.tensor([-1.0, -2.0]), torch.tensor([-1.0, -1.5]),
        ...                      torch.tensor([1, 1]))
        >>> round(m["max_abs_log_ratio"], 3), m["outside_band"], round(m["kl_k3"], 4)
        (0.5, 0.5, 0.0533)
    """
    x, y, m = _check_pair(
        "trainer_logprobs", trainer_logprobs, "rollout_logprobs", rollout_logprobs, mask
    )
    if not isinstance(band, tuple | list) or len(band) != 2:
        raise TypeError(f"band must be a pair (lo, hi), got {band!r}")
    lo, hi = check_positive("band[0]", band[0]), check_positive("band[1]", band[1])
    if not lo < hi:
        raise ValueError(f"band must satisfy lo < hi, got {(lo, hi)}")
    if bool((m & (y == -math.inf)).any()):
        raise ValueError("rollout_logprobs must not be -inf at a valid position")
    n = int(m.sum())
    keys = (
        "mean_abs_log_ratio",
        "max_abs_log_ratio",
        "mean_ratio",
        "min_ratio",
        "max_ratio",
        "kl_k3",
        "kl_k1",
        "outside_band",
    )
    if n == 0:
        return {**dict.fromkeys(keys, 0.0), "tokens": 0.0}
    # excerpt: metrics
    delta = (x - y)[m]
    ratio = delta.exp()
    return {
        "mean_abs_log_ratio": float(delta.abs().mean()),
        "max_abs_log_ratio": float(delta.abs().max()),
        "mean_ratio": float(ratio.mean()),
        "min_ratio": float(ratio.min()),
        "max_ratio": float(ratio.max()),
        "kl_k3": float(k3(-delta).mean()),
        "kl_k1": float(-delta.mean()),
        "outside_band": float(((ratio < lo) | (ratio > hi)).to(delta.dtype).mean()),
        "tokens": float(n),
    }
    # end excerpt
