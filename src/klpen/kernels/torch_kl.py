r"""The ``torch`` backend's full-KL kernels: per-row statistics and gradients, exact.

For policy logits ``z``, reference logits ``w`` and an inverse temperature ``k``, per row:
``lse(k z)``, ``lse(k w)``, ``KL(softmax(k z) ‖ softmax(k w))`` and ``E_p[k (z - w)]``
(:func:`kl_row_stats`: a one-pass fast formula, a centred second pass for the rows it cannot
promise, float64 for the rest), and the gradients of ``Σ g KL`` from them (:func:`kl_grads`).
Moved here from ``klpen.full_kl``, unchanged in arithmetic.
"""

from __future__ import annotations

from typing import Final, NamedTuple

import torch
from torch import Tensor

from ._rows import block_buffer, for_each_block, index_blocks, take_rows
from .blocks import exp_, exp_into, scaled_into, shift_free_ok, sub_into

# What other klpen modules import from here.
__all__ = [
    "EXACT_SHARE",
    "KLRows",
    "centred_kl",
    "exact_kl_stats",
    "exact_rows",
    "kl_grads",
    "kl_grads_from",
    "kl_row_stats",
]


class KLRows(NamedTuple):
    """What :func:`kl_row_stats` returns: ``stats`` ``(4, N)`` and ``redo`` ``(M,)``.

    ``stats`` holds, row by row, ``lse(k z)``, ``lse(k w)``, the KL (not clamped) and
    ``E_p[k (z - w)]`` (one tensor, so that a caller can all-reduce rows of it at once);
    ``redo`` the int64 numbers of the rows computed in float64, which the backward pass
    redoes too. The fields unpack as a pair, ``stats, redo = kl_row_stats(...)``.
    """

    stats: Tensor
    redo: Tensor

    @property
    def lse_z(self) -> Tensor:
        return self.stats[0]

    @property
    def lse_w(self) -> Tensor:
        return self.stats[1]

    @property
    def kl(self) -> Tensor:
        return self.stats[2]

    @property
    def mean_d(self) -> Tensor:
        return self.stats[3]


# The fast formula's rounding error is a few units of eps (the dtype's machine epsilon) times
# 1 + |E_p[d]| + std_p(d). Rows where FAST_ERROR_UNITS times that bound exceeds FAST_RTOL of
# their KL (in fp32, divergences below about 0.07) are refined by :func:`centred_rows`;
# those where even its error estimate exceeds CENTRED_RTOL of the KL go to float64.
FAST_ERROR_UNITS: Final = 8.0
FAST_RTOL: Final = 2e-5
CENTRED_ERROR_UNITS: Final = 2.0
CENTRED_RTOL: Final = 5e-5
# The float64 recomputation takes the rows a few at a time: its half-dozen float64
# temporaries then stay within about two fp32 blocks.
EXACT_SHARE: Final = 8


def kl_terms(
    z: Tensor, w: Tensor, lse_z: Tensor, lse_w: Tensor, buf_p: Tensor, buf_t: Tensor
) -> tuple[Tensor, Tensor]:
    """``p = exp(z - lse_z)`` and ``p (log p - log q)`` of one block, written to the buffers.

    ``z``, ``w`` are ``(r, V)`` blocks of logits, ``lse_z``, ``lse_w`` their ``(r,)``
    log-sum-exps, the buffers ``(r, V)`` in the compute dtype. A zero-probability term is
    exactly 0: ``0 · log(0 / q) = 0`` by convention, where the product is ``0 · (-inf) = NaN``.
    So is every term of a row where ``p`` is NaN: a rank's vocabulary slice with no policy mass
    has ``lse_z = -inf`` legitimately. Used by the gradient of the vocab-parallel KL, whose
    per-row statistics are global.
    """
    log_p = sub_into(z, lse_z[:, None], buf_p)
    # log p - log q = (z - lse_z) - (w - lse_w), built in place.
    terms = sub_into(w, lse_w[:, None], buf_t).neg_().add_(log_p)
    p = exp_(log_p)
    terms.mul_(p).masked_fill_(~(p > 0), 0.0)
    return p, terms


def centred_log_softmax(x: Tensor) -> tuple[Tensor, Tensor]:
    """``(log_softmax(x), logsumexp(x))`` over the last axis, keeping the max apart.

    ``x - max`` is exact, so ``log_softmax`` is exact to rounding at any common offset of the
    row, also where ``logsumexp(x)`` itself rounds (at ``1e4``, by ``1e-12`` in float64).
    """
    top = x.amax(dim=-1, keepdim=True)
    centred = x - torch.where(torch.isfinite(top), top, 0.0)
    log_s = centred.exp().sum(-1, keepdim=True).log_()
    return centred - log_s, (top + log_s).squeeze(-1)


def exact_rows(z: Tensor, w: Tensor, scale: float) -> tuple[Tensor, ...]:
    r"""``(lse_z, lse_w, kl, mean_d, p, log p/q)`` of a few rows of ``k z``, ``k w``, in float64.

    The definition, term by term, from max-centred log-softmaxes (:func:`centred_log_softmax`):

    .. math:: \mathrm{KL} = \sum_v p_v \,(\log p_v - \log q_v)

    In float64 its rounding error, about ``1e-16`` times ``E_p|log p/q|`` plus a few units of
    ``1e-16``, is far below any fp32 divergence, at any common offset of the logits. ``-inf``
    policy logits contribute 0 (``0 · log 0 = 0``); a ``-inf`` reference logit where ``p > 0``
    gives ``+inf``; a rank's vocabulary slice without policy mass has a restricted KL of 0.
    ``mean_d`` is ``E_p[k (z - w)] = KL + lse_z - lse_w``.
    """
    z, w = z.double(), w.double()
    if scale != 1.0:
        z, w = z * scale, w * scale
    log_p, lse_z = centred_log_softmax(z)
    log_q, lse_w = centred_log_softmax(w)
    p = log_p.exp()
    log_ratio = log_p - log_q
    kl = torch.where(p > 0, p * log_ratio, 0.0).sum(-1)
    kl.masked_fill_(~(p.sum(-1) > 0), 0.0)
    return lse_z, lse_w, kl, kl + lse_z - lse_w, p, log_ratio


def kl_row_stats(
    policy: Tensor, reference: Tensor, rows: int, dtype: torch.dtype, scale: float = 1.0
) -> KLRows:
    r"""Per-row log-sum-exps of both logits, the KL of their softmaxes and ``E_p[d]``.

    For policy logits ``z`` and reference logits ``w`` of one shape ``(..., V)`` (the whole
    vocabulary, or a rank's slice of it), at inverse temperature ``k`` = ``scale``, computed in
    ``dtype``. Fast path, for every row whose unshifted sums are exact
    (:func:`~klpen.kernels.blocks.shift_free_ok`): with ``e = exp(k z)``, ``S_z = sum(e)``,
    ``S_w = sum(exp(k w))`` and ``d = k (z - w)``,

    .. math:: \mathrm{KL} = \frac{\sum_v e_v d_v}{S_z} + \log \frac{S_w}{S_z}

    which reads each logit once, with no max pass: two ``exp``, a subtraction, a product and
    three sums per element. Its rounding error is a few ``eps`` times
    ``1 + |E_p d| + std_p d``: the rows where that is not small against their KL (in fp32,
    divergences below about ``0.07``) are recomputed by a centred form without cancellation
    (:func:`centred_rows`, about twice the work for those rows); the few rows that even
    that cannot promise (two-token rows, divergences below about ``1e-6``) and the rows whose
    sums are not exact (``-inf``, extreme or NaN logits) from max-centred log-softmaxes in
    float64 (:func:`exact_rows`). The KL is then exact to rounding down to the smallest
    divergences, at any common offset of the logits.

    Returns:
        ``stats``, ``(4, N)`` in ``dtype``, ``N`` the number of rows: its rows are ``lse(k z)``,
        ``lse(k w)``, the KL (not clamped) and ``E_p[d]`` (one tensor, so that a caller can
        all-reduce rows of it at once); and ``redo``, the ``(M,)`` int64 numbers of the rows
        computed in float64, which the backward pass redoes too. Invalid logits (NaN, ``+inf``,
        all ``-inf``) give a non-finite log-sum-exp.

    Example:
        >>> stats, redo = kl_row_stats(torch.tensor([[2.0, 0.0, 0.0]]), torch.zeros(1, 3),
        ...                             rows=1, dtype=torch.float32)
        >>> stats[2], redo
        (tensor([0.4330]), tensor([], dtype=torch.int64))
    """
    vocab, eps = policy.shape[-1], torch.finfo(dtype).eps
    n = policy.numel() // vocab
    stats = torch.empty(4, n, dtype=dtype, device=policy.device)
    s_z, s_w, kl, mean_d = stats.unbind()
    pair = (policy, reference)

    def scratch(r: int, count: int = 3) -> tuple[Tensor, ...]:
        return tuple(block_buffer(policy, r, dtype) for _ in range(count))

    # excerpt: fast-path
    def sums(start: int, blocks: tuple[Tensor, ...], bufs: tuple[Tensor, ...]) -> None:
        (z, w), (buf_e, buf_d) = blocks, bufs[:2]
        stop, r = start + z.shape[0], z.shape[0]
        e = exp_into(z, buf_e[:r], None, scale)
        torch.sum(e, dim=-1, out=s_z[start:stop])
        torch.sum(exp_into(w, buf_d[:r], None, scale), dim=-1, out=s_w[start:stop])
        # E_p[w - z] by torch.sum, whose cascade keeps the error at a few eps (a BLAS dot
        # product accumulates sequentially and loses about sqrt(V) times more).
        torch.sum(sub_into(w, z, buf_d[:r]).mul_(e), dim=-1, out=mean_d[start:stop])

    for_each_block(pair, rows, sums, lambda r: scratch(r, 2))
    centre = mean_d.div_(s_z).clone()  # c = E_p[w - z], in the logits' units
    ratio = s_w / s_z
    # KL = E_p[k (z - w)] + log(S_w / S_z)
    torch.sub(ratio.log(), mean_d, alpha=scale, out=kl)
    # end excerpt
    # exact to rounding unless a sum or their ratio leaves the normal range
    in_range = shift_free_ok(s_z, vocab) & shift_free_ok(s_w, vocab) & torch.isfinite(kl)
    in_range &= ratio >= torch.finfo(dtype).tiny
    bound = (mean_d.abs() * scale + 1.0).add_(kl.abs().mul(2.0).sqrt_())
    small = in_range & (bound.mul_(FAST_ERROR_UNITS * eps) > FAST_RTOL * kl)
    mean_d.mul_(-scale)  # E_p[k (z - w)]
    exact = ~in_range
    any_small = bool(small.any())
    if any_small:
        # A second pass over the blocks that hold such rows (all of them when the reference is
        # close to the policy), on the blocks in place: no copy of the rows.
        def centred(start: int, blocks: tuple[Tensor, ...], bufs: tuple[Tensor, ...]) -> None:
            (z, w), (buf_e, buf_d, buf_t) = blocks, bufs
            stop, r = start + z.shape[0], z.shape[0]
            these = small[start:stop]
            if not bool(these.any()):
                return
            e = exp_into(z, buf_e[:r], None, scale)
            d = sub_into(w, z, buf_d[:r])
            kl_c, mean_c, unsure = centred_rows(
                e, d, buf_t[:r], s_z[start:stop], centre[start:stop], scale
            )
            kl[start:stop] = torch.where(these, kl_c, kl[start:stop])
            mean_d[start:stop] = torch.where(these, mean_c, mean_d[start:stop])
            exact[start:stop] |= these & unsure

        for_each_block(pair, rows, centred, scratch)
    lse_z, lse_w = s_z.log_(), s_w.log_()
    redo = exact.nonzero().squeeze(-1)
    for index in index_blocks(redo, max(1, rows // EXACT_SHARE)):
        exact_stats = exact_rows(take_rows(policy, index), take_rows(reference, index), scale)
        for row, value in zip((lse_z, lse_w, kl, mean_d), exact_stats, strict=False):
            row[index] = value.to(dtype)
    # every row redone in float64 here: the backward pass redoes each of them in float64 too
    return KLRows(stats, redo)


def exact_kl_stats(
    policy: Tensor, reference: Tensor, rows: int, dtype: torch.dtype, scale: float = 1.0
) -> KLRows:
    """:func:`kl_row_stats` with every row computed by :func:`exact_rows`, in float64.

    No data-dependent step (no host synchronisation): the sync-free path of the full KL when
    value checks are off. ``redo`` lists every row, so that the backward pass takes the
    float64 gradient for each (and skips its fast pass).

    Example:
        >>> stats, redo = exact_kl_stats(torch.tensor([[2.0, 0.0, 0.0]]), torch.zeros(1, 3),
        ...                              rows=1, dtype=torch.float32)
        >>> stats[2], redo
        (tensor([0.4330]), tensor([0]))
    """
    n = policy.numel() // policy.shape[-1]
    stats = torch.empty(4, n, dtype=dtype, device=policy.device)
    every = torch.arange(n, device=policy.device)
    for index in index_blocks(every, max(1, rows // EXACT_SHARE)):
        exact = exact_rows(take_rows(policy, index), take_rows(reference, index), scale)
        stats[:, index] = torch.stack(exact[:4]).to(dtype)
    return KLRows(stats, every)


def centred_rows(
    e: Tensor, d: Tensor, work: Tensor, s_z: Tensor, centre: Tensor, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    r"""``(KL, E_p[k (z - w)], unsure)`` of a few rows without cancellation.

    ``e = exp(k z)``, ``d = w - z`` (overwritten), ``s_z = Σ e``, ``centre = c ≈ E_p[d]``,
    all ``(r, V)`` or ``(r,)`` in the compute dtype; ``work`` is scratch. With
    ``v = k (d - c)``, the sums of :func:`centred_kl`: ``Σ e v`` and
    ``Σ e (expm1(v) - v)``, whose terms are ``O(v)`` and ``O(v²)`` rather than ``O(1)``.
    """
    v = d.sub_(centre[:, None])
    if scale != 1.0:
        v.mul_(scale)
    sum_v = torch.sum(torch.mul(v, e, out=work), dim=-1)
    sum_f = torch.sum(torch.expm1(v, out=work).sub_(v).mul_(e), dim=-1)
    return centred_kl(s_z, sum_v, sum_f, e.amax(dim=-1), centre * scale, torch.finfo(e.dtype).eps)


def centred_kl(
    s_z: Tensor,
    sum_v: Tensor,
    sum_f: Tensor,
    max_e: Tensor,
    centre: Tensor,
    eps: float,
    exact_difference: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    r"""``(KL, E_p[k (z - w)], unsure)`` per row from the sums of the centred form.

    ``s_z = Σ e``, ``sum_v = Σ e v``, ``sum_f = Σ e (expm1(v) - v)`` and ``max_e = max e``,
    with ``e = exp(k z)`` and ``v = k (w - z) - centre``, all ``(N,)`` (``centre`` in the units
    of ``v``); ``eps``: the machine epsilon of the dtype the terms were formed in. With
    ``F = E_p[expm1(v) - v] >= 0`` and ``u = E_p[expm1 v] = E_p[v] + F``, exactly for any
    centre,

    .. math:: \mathrm{KL} = \operatorname{log1p}(u) - E_p[v]
        = F + \big(\operatorname{log1p}(u) - u\big)

    ``F`` is a sum of non-negative terms of size ``v² / 2``; ``log1p(u) - u ≈ -u² / 2`` is
    formed in float64, so that a centre away from ``E_p[d]`` costs no digits unless
    ``E_p[v]²`` dwarfs the KL. The rounding errors, about ``eps · |v|`` per term (and
    ``eps · |c|`` for the difference ``w - z`` itself), average over a row to about
    ``eps · sqrt(max p) · sqrt(E_p v²) · (1 + |c|)``, plus ``eps · F`` for the sums; ``unsure``
    flags the rows where that estimate is not small against their KL (two-token rows,
    divergences below about ``1e-6``, log-ratios that overflow), for float64 terms. Shared
    by :func:`centred_rows` (whole rows of logits) and the hidden-state KL of
    :mod:`klpen.linear` (sums accumulated over vocabulary tiles).

    ``exact_difference``: the terms' ``v`` were formed as ``((w - z) - c') k`` from the exact
    difference ``w - z`` (its rounding error carried along, as the Triton kernel does), so
    that each ``v`` is off by about ``eps · |v|`` alone: the factor ``(1 + |c|)`` is dropped.
    The error is then first order in those ``δ_j`` with weights ``p_j g_j``,
    ``g = e^v / (1 + u) - 1`` (``∂KL/∂v_j = p_j g_j``), at most
    ``sqrt(E_p g²) · sqrt(E_p v²) · eps`` (Cauchy–Schwarz) whatever the signs, and
    ``E_p g²`` (the χ² divergence of ``π_ref`` from ``π``) is ``2 KL`` to leading order in
    ``v``; so ``sqrt(max p)`` gives way to ``sqrt(2 KL (1 + spread))`` where smaller. A centre
    off ``E_p[v]`` still costs its ``eps · E_p[v]²``, inside ``eps · F``.
    """
    mean_v = sum_v / s_z
    big_f = sum_f / s_z
    u = (mean_v + big_f).double()
    kl = (torch.log1p(u) - u).to(big_f.dtype).add_(big_f)
    spread = big_f.abs().mul(2.0).add_(mean_v * mean_v).sqrt_()
    weight = (max_e / s_z).sqrt_()
    if exact_difference:
        chi = kl.abs().mul(2.0).mul_(spread.add(1.0)).sqrt_()
        bound = spread.mul_(torch.minimum(weight, chi))
    else:
        bound = spread.mul_(weight).mul_(centre.abs().add(1.0))
    bound.add_(big_f.abs())
    bound.mul_(CENTRED_ERROR_UNITS * eps)
    # an overflowing expm1(v) (a log-ratio beyond ±88 in fp32) leaves the row unsure too
    unsure = (bound > CENTRED_RTOL * kl) | ~torch.isfinite(kl)
    return kl, centre.add(mean_v).neg_(), unsure


def kl_grads_from(
    policy: Tensor,
    reference: Tensor,
    lse_z: Tensor,
    lse_w: Tensor,
    kl: Tensor,
    redo: Tensor,
    grad_out: Tensor,
    rows: int,
    needs: tuple[bool, bool],
    *,
    mean_d: Tensor | None = None,
    scale: float = 1.0,
) -> tuple[Tensor | None, Tensor | None]:
    r"""Gradients of ``Σ_i g_i KL_i`` w.r.t. the policy and reference logits, block by block.

    For ``p = softmax(k z)``, ``q = softmax(k w)`` and ``d = k (z - w)``:

    .. math::

        \frac{\partial \mathrm{KL}}{\partial z_j} = k\, p_j \big[d_j - E_p[d]\big]
        = k\, p_j \Big[\log \frac{p_j}{q_j} - \mathrm{KL}\Big], \qquad
        \frac{\partial \mathrm{KL}}{\partial w_j} = k\, (q_j - p_j)

    ``policy``, ``reference``: the saved ``(..., V)`` logits (or a rank's slices of them).
    ``lse_z``, ``lse_w``, ``kl``: ``(N,)`` log-sum-exps and KL of the *whole* rows (for a
    slice, the global values), in the compute dtype. ``redo``: the rows to recompute
    exactly, as :func:`kl_row_stats` returned them. ``grad_out``: the ``(...)`` upstream
    gradient ``g``. ``needs``: which of the two gradients to build; only those are allocated
    (usually the policy's alone). ``mean_d``: ``E_p[d]`` from :func:`kl_row_stats` (whole
    rows): then the ``redo`` rows are recomputed in float64 from the logits, exact at any
    offset, and in the other rows ``d - E_p[d]`` is ``log p - log q`` less its mean over the
    block's own numbers, so that no per-row rounding (of a log-sum-exp, of a centre at a large
    offset between the two logits) shifts a row's gradient. Without it (a vocabulary slice),
    ``E_p[d] = KL + lse_z - lse_w`` and the ``redo`` rows apply ``0 log 0 = 0`` with the given
    global statistics.

    Returns:
        ``(grad_z, grad_w)`` in the logits' shapes and dtypes, ``None`` where not needed.

    Example:
        >>> z, w = torch.tensor([[0.0, 0.0]]), torch.tensor([[0.0, 1.0]])
        >>> stats, redo = kl_row_stats(z, w, rows=1, dtype=torch.float32)
        >>> lse_z, lse_w, kl, _ = stats.unbind()
        >>> kl_grads_from(z, w, lse_z, lse_w, kl, redo, torch.ones(1), rows=1, needs=(False, True))
        (None, tensor([[-0.2311,  0.2311]]))
    """
    vocab, dtype = policy.shape[-1], kl.dtype
    grad_z, grad_w = (
        torch.empty(x.shape, dtype=x.dtype, device=x.device) if need else None
        for x, need in zip((policy, reference), needs, strict=True)
    )
    flat_gz = None if grad_z is None else grad_z.view(-1, vocab)
    flat_gw = None if grad_w is None else grad_w.view(-1, vocab)
    g = grad_out.reshape(-1, 1).to(dtype) * scale
    # d - E_p[d] = k (z - w) - centre, per row
    centre = (lse_z - lse_w + kl if mean_d is None else mean_d)[:, None]

    # whole rows: each block's d - E_p[d] is formed from the block itself (see below)
    whole = mean_d is not None and flat_gz is not None

    def scratch(r: int) -> tuple[Tensor, ...]:
        return tuple(block_buffer(policy, r, dtype) for _ in range(3 if whole else 2))

    def body(start: int, blocks: tuple[Tensor, ...], bufs: tuple[Tensor, ...]) -> None:
        (z, w), (buf_p, buf_t) = blocks, bufs[:2]
        stop, r = start + z.shape[0], z.shape[0]
        if whole:
            # d - E_p[d] as log p - log q - E_p[log p - log q], each log-softmax formed from its
            # own side's logits (a common offset between the two sides costs no digits), p
            # normalised by its own sum and the mean summed from these same numbers: the
            # rounding of a log-sum-exp, a constant per row, cancels (the robustness of plain
            # fp32 autograd's gradient).
            log_p = scaled_into(z, buf_t[:r], lse_z[start:stop, None] / scale, scale)
            p = torch.exp(log_p, out=buf_p[:r])
            p.div_(p.sum(-1, keepdim=True))
            log_q = scaled_into(w, bufs[2][:r], lse_w[start:stop, None] / scale, scale)
            d = log_p.sub_(log_q)
            d.sub_(torch.mul(d, p, out=bufs[2][:r]).sum(-1, keepdim=True))
        else:
            p = scaled_exp_minus(z, buf_p[:r], scale, lse_z[start:stop, None])
        if flat_gz is not None:
            if not whole:
                d = sub_into(z, w, buf_t[:r])
                if scale != 1.0:
                    d.mul_(scale)
                d.sub_(centre[start:stop])
            torch.mul(d.mul_(g[start:stop]), p, out=flat_gz[start:stop])
        if flat_gw is not None:
            q = scaled_exp_minus(w, buf_t[:r], scale, lse_w[start:stop, None])
            torch.mul(q.sub_(p), g[start:stop], out=flat_gw[start:stop])

    # every row redone (the sync-free path): the fast pass would be overwritten
    if redo.shape[0] < flat_grad_rows(policy):
        for_each_block((policy, reference), rows, body, scratch)
    for index in index_blocks(redo, max(1, rows // EXACT_SHARE) if mean_d is not None else rows):
        z, w = take_rows(policy, index), take_rows(reference, index)
        if mean_d is not None:
            _, lse_w64, kl64, _, p, log_ratio = exact_rows(z, w, scale)
            g64 = g[index].double()
            if flat_gz is not None:
                terms = torch.where(p > 0, p * log_ratio, 0.0)
                gz = terms.sub_(p * kl64[:, None]).mul_(g64)
                flat_gz[index] = gz.to(flat_gz.dtype)
            if flat_gw is not None:
                q = torch.exp(w.double() * scale - lse_w64[:, None])
                flat_gw[index] = q.sub_(p).mul_(g64).to(flat_gw.dtype)
            continue
        # A vocabulary slice: the global statistics, with 0 log 0 = 0 where the fast formula
        # gives 0 · inf = NaN; the logits in the units of the statistics (times 1/T).
        z, w = z.to(dtype) * scale, w.to(dtype) * scale
        buf_p, buf_t = torch.empty_like(z), torch.empty_like(z)
        p, terms = kl_terms(z, w, lse_z[index], lse_w[index], buf_p, buf_t)
        if flat_gz is not None:
            flat_gz[index] = (terms - p * kl[index, None]).mul_(g[index]).to(flat_gz.dtype)
        if flat_gw is not None:
            q = torch.exp(w - lse_w[index, None])
            flat_gw[index] = q.sub_(p).mul_(g[index]).to(flat_gw.dtype)
    return grad_z, grad_w


def flat_grad_rows(x: Tensor) -> int:
    """The number of rows of ``x (..., V)``."""
    return x.numel() // max(x.shape[-1], 1)


def scaled_exp_minus(x: Tensor, out: Tensor, scale: float, lse: Tensor) -> Tensor:
    """``exp(scale * x - lse)`` in ``out``'s dtype, written to ``out``: a block of softmax."""
    if scale == 1.0:
        return exp_into(x, out, lse)
    return exp_(scaled_into(x, out, None, scale).sub_(lse))


def kl_grads(
    policy: Tensor,
    reference: Tensor,
    rows_stats: KLRows,
    grad_out: Tensor,
    rows: int,
    needs: tuple[bool, bool],
    scale: float = 1.0,
) -> tuple[Tensor | None, Tensor | None]:
    """:func:`kl_grads_from` for whole rows, from the :class:`KLRows` of :func:`kl_row_stats`.

    Example:
        >>> z, w = torch.tensor([[0.0, 0.0]]), torch.tensor([[0.0, 1.0]])
        >>> stats = kl_row_stats(z, w, rows=1, dtype=torch.float32)
        >>> kl_grads(z, w, stats, torch.ones(1), rows=1, needs=(True, False))[0]
        tensor([[ 0.2500, -0.2500]])
    """
    lse_z, lse_w, kl, mean_d = rows_stats.stats.unbind()
    return kl_grads_from(
        policy,
        reference,
        lse_z,
        lse_w,
        kl,
        rows_stats.redo,
        grad_out,
        rows,
        needs,
        mean_d=mean_d,
        scale=scale,
    )
