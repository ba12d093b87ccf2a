"""Sampled estimators of ``KL(π ‖ π_ref)`` from the log-probs of tokens drawn from π.

Chapter 1 of the book. With ``r = log π(y) - log π_ref(y)`` for a sample ``y ~ π``:

* ``k1 = r``: unbiased, but any single value can be negative and its variance is high;
* ``k2 = r²/2``: biased, never negative, low variance when π is close to π_ref;
* ``k3 = exp(-r) + r - 1``: unbiased and never negative (Schulman's control-variate form);
* ``abs = |r|``: never negative, biased upwards.

Chapter 7 adds the straight-through variants ``k1+``, ``k2+``, ``k3+`` and ``abs+``: the value of
the named estimator with the gradient of k2, so that, used inside a loss, they descend the
reverse KL (``k2+`` is k2 itself; verl offers it under that name).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
from torch import Tensor

from ._ops import concrete
from ._validation import (
    check_choice,
    check_coef,
    check_floating,
    check_floating_like,
    check_mask,
    check_no_nan,
    check_no_nan_at,
    check_positive,
    check_tensor_kind,
    promoted_dtype,
    value_checks_enabled,
)

__all__ = [
    "ESTIMATORS",
    "LOG_RATIO_CLAMP",
    "REGISTRY",
    "Estimator",
    "estimate_kl",
    "k3",
    "kl_penalty",
]


# Below this |r| the series of exp(-r) + r - 1 is used: the closed form loses digits there by
# cancelling 1 against exp(-r) (relative error ~ 2 eps / |r|). The terms n = 2..16 give full
# fp64 precision up to |r| = 0.5: the first omitted one, 0.5**17 / 17!, is 1e-20 of k3(0.5).
_SERIES_LIMIT = 0.5
_SERIES = [(-1.0) ** n / math.factorial(n) for n in range(2, 17)]

#: With ``clamp=``, the log-ratio is clamped to ``[-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP]`` before
#: k3's exponential, as verl's ``kl_penalty`` does (``exp(20)`` is finite even in fp16... after
#: the fp32 promotion klpen applies to half-precision input).
LOG_RATIO_CLAMP = 20.0


def k3(r: Tensor) -> Tensor:
    r"""``exp(-r) + r - 1`` evaluated without cancellation, with a gradient everywhere finite
    where the value is.

    .. math::

        \begin{aligned}
        k_3(r) &= e^{-r} + r - 1 \\
        &= \sum_{n \ge 2} \frac{(-r)^n}{n!} \ge 0
        \end{aligned}

    Saturates to ``+inf`` where the value exceeds the dtype's range (also for ``r = ±inf``).

    Args:
        r: floating log-ratio ``log π(y) - log π_ref(y)``, any shape; not validated here
            (:func:`estimate_kl` is the checked entry point).

    Returns:
        ``k3(r)`` of ``r``'s shape and dtype, never negative, differentiable w.r.t. ``r``.

    Example:
        >>> k3(torch.tensor([1e-4, 0.0, 2.0], dtype=torch.float64))
        tensor([4.9998e-09, 0.0000e+00, 1.1353e+00], dtype=torch.float64)
    """
    # excerpt: series
    small = r.abs() < _SERIES_LIMIT
    # Each branch only ever sees inputs where it is accurate and finite (the other gets a
    # harmless stand-in), so neither value nor gradient of the unused branch can be inf or NaN.
    rs = torch.where(small, r, torch.zeros_like(r))
    rl = torch.where(small, torch.ones_like(r), r)
    poly = torch.full_like(rs, _SERIES[-1])
    for c in reversed(_SERIES[:-1]):
        poly = poly * rs + c
    series = poly * rs * rs
    # clamp: at r = -inf, expm1(inf) + (-inf) would be NaN; -max keeps it +inf
    closed = torch.expm1(-rl) + rl.clamp(min=-torch.finfo(r.dtype).max)
    return torch.where(small, series, closed).clamp(min=0.0)
    # end excerpt


def _k1(r: Tensor) -> Tensor:
    return r


def _k2(r: Tensor) -> Tensor:
    return 0.5 * r * r


def _abs(r: Tensor) -> Tensor:
    return r.abs()


def _log_abs(r: Tensor) -> Tensor:
    """``log |r|``: the log-magnitude of k1 and abs."""
    return r.abs().log()


def _log_k2(r: Tensor) -> Tensor:
    """``log(r²/2)`` without forming ``r²`` (finite where k2 overflows)."""
    return 2.0 * r.abs().log() - math.log(2.0)


def _log_k3(r: Tensor) -> Tensor:
    """``log k3(r)``, finite where ``k3`` overflows: ``-r + log1p((r - 1) e^r)`` for ``r < 0``
    (``k3 = e^{-r} (1 + (r - 1) e^r)``), ``log k3(r)`` elsewhere."""
    negative = r < 0
    rn = torch.where(negative, r, torch.zeros_like(r))
    far = -rn + torch.log1p((rn - 1) * rn.exp())
    return torch.where(negative & (r < -1.0), far, k3(r).log())


def _product(lv: Tensor, w: Tensor, r: Tensor, k: Tensor) -> Tensor:
    """``w·k`` where ``w = 0`` gives 0 (not ``0 · inf``): for k1, k2 and abs the limit of
    ``w·k`` as ``w → 0`` is 0 (``w log^n w → 0``)."""
    return torch.where(w == 0, 0.0, w * k)


def _k3_product(lv: Tensor, w: Tensor, r: Tensor, k: Tensor) -> Tensor:
    """``w·k3 = e^{lv} + w (r - 1)`` with ``lv = log π_ref - log μ`` (``w e^{-r} = e^{lv}``):
    finite where ``w`` underflows to 0 or ``k3`` overflows; where both terms are huge, the
    first wins."""
    exact = torch.exp(lv) + w * (r - 1)
    return torch.where(torch.isnan(exact), torch.inf, exact)


def _k3_limit(dtype: torch.dtype) -> float:
    """``-r`` beyond which k3 (> max/e) is treated as overflowing in ``dtype``."""
    return math.log(torch.finfo(dtype).max) - 1.0


def _k2_gradient(value: Tensor, r: Tensor) -> Tensor:
    """``value`` (detached) forward, the gradient of ``k2(r)`` (the reverse-KL one) backward."""
    # Adds k2(r) - k2(f) with f = r.detach(), written as its exact expansion around f,
    # d (f + d/2) with d = r - f: as a function of r the same quadratic (every derivative
    # of k2 kept), but its value is 0 * finite = 0, where r²/2 - f²/2 would overflow to
    # inf - inf = NaN for finite r (already at |r| > 362 in fp16).
    d = r - r.detach()
    return value.detach() + d * (r.detach() + 0.5 * d)


@dataclass(frozen=True)
class Estimator:
    """One sampled estimator of ``KL(π ‖ π_ref)``, as a record of the registry :data:`REGISTRY`.

    Every estimator-specific rule of :func:`estimate_kl` is a field here; the code that uses
    them has no branch on a name.

    Attributes:
        name: the name :func:`estimate_kl` takes (``"k3"``, ``"k3+"``, ...).
        value: ``k(r)`` of the log-ratio, unclamped (the value of the ``+`` forms too).
        log_magnitude: ``log |k(r)|``, finite where ``k`` itself overflows: the weighted
            estimate ``w·k`` is formed in log space from it.
        straight_through: the gradient is that of k2 (``r``), not that of ``value``.
        clamps_log_ratio: with ``clamp=``, ``r`` is first clamped to
            ``[-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP]`` (verl's rule for k3's exponential).
        overflow_limit: ``None``, or the ``-r`` (for a dtype) beyond which the derivative of
            ``value`` is treated as overflowing (k3's exponential).
        weighted: ``w·k`` from ``(lv, w, r, k)``, ``lv = log π_ref - log μ``, used where the
            weight underflows to 0 or the plain product is not finite (k3's exact form).
        formula: the value in words, as the table of :func:`estimate_kl` gives it.

    Example:
        >>> REGISTRY["k3+"].straight_through, REGISTRY["k3+"].value is REGISTRY["k3"].value
        (True, True)
    """

    name: str
    value: Callable[[Tensor], Tensor]
    log_magnitude: Callable[[Tensor], Tensor]
    straight_through: bool
    clamps_log_ratio: bool
    overflow_limit: Callable[[torch.dtype], float] | None
    weighted: Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]
    formula: str

    def __call__(self, r: Tensor) -> Tensor:
        """The estimate at ``r`` (unclamped, unguarded): ``value``, with k2's gradient for a
        straight-through record."""
        return _k2_gradient(self.value(r), r) if self.straight_through else self.value(r)


_BASES = (
    Estimator("k1", _k1, _log_abs, False, False, None, _product, "r"),
    Estimator("k2", _k2, _log_k2, False, False, None, _product, "r²/2"),
    Estimator("k3", k3, _log_k3, False, True, _k3_limit, _k3_product, "exp(-r) + r - 1"),
    Estimator("abs", _abs, _log_abs, False, False, None, _product, "|r|"),
)

#: every estimator name -> its :class:`Estimator` record: the bases and their straight-through
#: ``+`` forms (value of the base, gradient of k2), in that order.
REGISTRY: dict[str, Estimator] = {
    **{e.name: e for e in _BASES},
    **{
        f"{e.name}+": replace(
            e,
            name=f"{e.name}+",
            straight_through=True,
            formula=f"value of {e.name}, gradient of k2",
        )
        for e in _BASES
    },
}

#: every estimator name -> its function of the log-ratio ``r`` (unclamped): the records of
#: :data:`REGISTRY`, which are callable.
ESTIMATORS: dict[str, Callable[[Tensor], Tensor]] = dict(REGISTRY)


def _clamped_value(entry: Estimator, r: Tensor, clamp: float | None) -> Tensor:
    """The record's value at ``r``, clamped as verl does when ``clamp`` is given."""
    if clamp is None:
        return entry.value(r)
    if entry.clamps_log_ratio:
        r = r.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return entry.value(r).clamp(-clamp, clamp)


def _apply(entry: Estimator, r: Tensor, clamp: float | None) -> Tensor:
    """The estimate at ``r`` with its gradient: the value (clamped when asked) and, for a
    straight-through record, the unclamped k2 gradient."""
    if entry.straight_through:
        return _k2_gradient(_clamped_value(entry, r.detach(), clamp), r)
    return _clamped_value(entry, r, clamp)


def _refuse_at(
    what: str, hazard: Tensor, valid: Tensor | None, message: Callable[[tuple[int, ...]], str]
) -> None:
    """Raise ``ValueError(message(index))`` at the first ``hazard`` where ``valid`` (``None``:
    everywhere). A value check made through ``_validation`` (skipped when value checks are
    off); the index is looked up only once it has failed."""
    hit = hazard if valid is None else hazard & valid
    if hit.numel() == 0:
        return
    try:
        check_no_nan(torch.where(hit, math.nan, 0.0), what)
    except ValueError:
        index = tuple(int(i) for i in hit.nonzero()[0])
        raise ValueError(message(index)) from None


class _OverflowGuard(torch.autograd.Function):
    """Identity forward; backward raises if a non-zero gradient reaches a position whose
    derivative is not finite (``bad``), and otherwise passes the gradient on unchanged.

    Written in the ``setup_context`` form with a generated vmap rule, so that it runs under
    ``torch.func`` transforms; its check goes through ``_validation`` (off when value checks
    are off)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(value: Tensor, bad: Tensor, r: Tensor, name: str) -> Tensor:
        return value.clone()

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        _, bad, r, name = inputs
        ctx.save_for_backward(bad, r)
        ctx.name = name

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        bad, r = ctx.saved_tensors
        _refuse_at(
            "gradient",
            bad & (grad != 0),
            None,
            lambda index: (
                f"estimate_kl(..., {ctx.name!r}) has no finite gradient at "
                f"{int((bad & (grad != 0)).sum())} position(s) that receive one (first at index "
                f"{index}, log-ratio {r[index].item():.6g}): the estimate or its derivative "
                f"overflows {r.dtype} there. Pass clamp= (verl uses 10), a straight-through '+' "
                "estimator, or mask the position"
            ),
        )
        return grad, None, None, None


def _weighted(
    entry: Estimator,
    saturated: Tensor,
    r0: Tensor,
    lw: Tensor,
    lv: Tensor,
    clamp: float | None,
) -> Tensor:
    """``w·k`` with ``w = e^{lw}`` and ``k = saturated``, never ``inf · 0``.

    The plain product where it is finite and ``w > 0``; the record's ``weighted`` form where
    ``w`` underflows or the product is not finite; and, where ``w`` itself overflows, the
    product in log space, ``sign(k) e^{lw + log|k|}`` (``log|k|`` from the record, finite
    where ``k`` overflows). ``k = 0`` gives 0 whatever the weight."""
    w = lw.exp()
    direct = w * saturated
    fallback = (entry.weighted if clamp is None else _product)(lv, w, r0, saturated)
    value = torch.where(torch.isfinite(direct) & (w != 0), direct, fallback)
    log_k = entry.log_magnitude(r0) if clamp is None else saturated.abs().log()
    in_logs = torch.sign(saturated) * torch.exp(lw + log_k)
    value = torch.where(torch.isinf(w), in_logs, value)
    return torch.where(saturated == 0, 0.0, value)


def _estimate(
    r: Tensor,
    entry: Estimator,
    clamp: float | None,
    valid: Tensor | None,
    log_w: tuple[Tensor, Tensor] | None,
) -> Tensor:
    """``estimate_kl`` on a checked log-ratio (in the compute dtype); ``log_w`` holds
    ``log π - log μ`` and ``log π_ref - log μ`` when the tokens come from μ.

    No Python branch reads a tensor value: the same operations run whatever the data
    (``torch.func.vmap`` and ``torch.compile`` trace them)."""
    with torch.no_grad():
        r0 = r.detach()
        saturated = _clamped_value(entry, r0, clamp)  # the value everywhere, without gradient
        # Positions with no finite derivative: a non-finite log-ratio (unless a binding clamp
        # makes the derivative 0 there), and an overflowing exponential (k3).
        plain = clamp is not None and not entry.straight_through
        bad = torch.isnan(r0) if plain else ~torch.isfinite(r0)
        limit = entry.overflow_limit
        if limit is not None and not entry.straight_through and clamp is None:
            bad |= r0 < -limit(r0.dtype)
        if log_w is not None:
            lw, lv = (x.detach() for x in log_w)
            # With a weight the gradient holds w k and w k': not computable where the plain
            # product w k is not finite (the weight or the estimate overflowing, or 0 · inf).
            bad |= ~torch.isfinite(lw.exp() * saturated)
            saturated = _weighted(entry, saturated, r0, lw, lv, clamp)
        stand_in = bad if valid is None else bad | ~valid
        if valid is not None:
            bad &= valid
    # The differentiable path sees 0 wherever it would produce a non-finite value or
    # gradient (or where the mask says the position does not count); those positions take
    # the saturated value, with a zero gradient that the guard refuses to hand out silently.
    rs = torch.where(stand_in, 0.0, r)
    value = _apply(entry, rs, clamp)
    if log_w is not None:
        value = torch.where(stand_in, 0.0, log_w[0]).exp() * value
    value = torch.where(stand_in, saturated, value)
    if value.requires_grad and value_checks_enabled():  # the guard is a value check
        value = _OverflowGuard.apply(value, bad, r0, entry.name)  # type: ignore[no-untyped-call]
    if valid is not None:
        value = torch.where(valid, value, 0.0)
    return value


def estimate_kl(
    policy_logprobs: Tensor,
    reference_logprobs: Tensor,
    estimator: str = "k1",
    *,
    clamp: float | None = None,
    mask: Tensor | None = None,
    behavior_logprobs: Tensor | None = None,
) -> Tensor:
    r"""Per-token sampled estimate of ``KL(π ‖ π_ref)`` from log-probs of sampled tokens.

    With the log-ratio :math:`r = \log \pi(y) - \log \pi_\mathrm{ref}(y)`, :math:`y \sim \pi`:

    ==========  ==============================  =========================================
    estimator   value                           notes
    ==========  ==============================  =========================================
    ``"k1"``    :math:`r`                       unbiased; a single value may be negative
    ``"k2"``    :math:`r^2/2`                   biased; never negative; low variance
    ``"k3"``    :math:`e^{-r} + r - 1`          unbiased; never negative
    ``"abs"``   :math:`|r|`                     biased upwards; never negative
    ``"k1+"``   value of k1, gradient of k2     straight-through (chapter 7)
    ``"k2+"``   value of k2, gradient of k2     = k2 (verl's name for it)
    ``"k3+"``   value of k3, gradient of k2     straight-through (chapter 7)
    ``"abs+"``  value of abs, gradient of k2    straight-through
    ==========  ==============================  =========================================

    **Clamping** (``clamp=c``, verl's semantics). For k3 the log-ratio is first clamped to
    ``[-20, 20]`` (:data:`~klpen.estimators.LOG_RATIO_CLAMP`) before the exponential, then the
    value is clamped to ``[-c, c]``; for k1, k2 and abs the value is clamped to ``[-c, c]``. verl's
    ``low_var_kl`` is ``estimate_kl(..., "k3", clamp=10.0)``. Where a clamp binds, the gradient
    is **zero**, as through ``torch.clamp``: a token whose estimate is clamped no longer
    pulls the policy at all. The ``+`` forms clamp their value only; their gradient stays the
    unclamped k2 gradient ``r`` (as verl's ``+`` forms do).

    **Overflow** (no ``clamp``). Values beyond the compute dtype's range saturate to the
    correctly signed infinity, never NaN for finite input (k3 at ``r < -88.7`` in fp32 is
    ``+inf``). Where the gradient is not finite (k3 where ``-r`` exceeds ``log(max) - 1``,
    87.7 in fp32, so that value and derivative are within a factor e of overflowing; any
    estimator where ``r`` itself overflowed), positions that receive no gradient (masked
    afterwards by :func:`~klpen.masked_mean` and friends) get exactly 0, and a position that
    does receive one makes ``backward`` raise a ``ValueError`` saying where and what to do:
    a run stops loudly instead of turning its parameters into NaN. The ``+`` forms have the finite
    gradient ``r`` and never raise for finite ``r``. With ``behavior_logprobs`` the gradient
    also holds the value (``k ∇w``), so it raises wherever ``w·k`` is not finite; that value
    saturates to its limit (for k3, ``w·k3 = e^{log π_ref - log μ} + w (r - 1)``, finite
    where ``w`` underflows).

    Args:
        policy_logprobs: ``(...)`` log π of the sampled tokens.
        reference_logprobs: ``(...)`` log π_ref of the same tokens, same shape.
        estimator: one of the names above.
        clamp: ``None`` (no clamping) or a positive bound for the value, see above.
        mask: optional 0/1 mask of the shape of ``policy_logprobs``. Masked positions give 0
            and may hold anything (NaN, ±inf): it reaches neither the value nor a gradient.
        behavior_logprobs: optional log μ of the tokens when they were drawn from a behavior
            policy μ ≠ π (an old policy, an inference engine). The estimate is then multiplied
            by the importance weight :math:`w = e^{\log\pi - \log\mu}`, **not detached**:
            :math:`E_\mu[w\,k] = E_\pi[k]`, and differentiating the weight makes
            :math:`E_\mu[\nabla(w\,k_3)] = \nabla \mathrm{KL}(\pi \| \pi_\mathrm{ref})`.
            Must be finite at valid positions (a sampled token has μ(y) > 0). No gradient
            reaches it unless it requires one.

    Returns:
        ``(...)`` tensor in the promoted dtype of the floating inputs, at least float32
        (half-precision inputs are computed in fp32: ``bf16`` log-ratios lose digits),
        differentiable w.r.t. the log-probs.

    Raises:
        TypeError, ValueError: wrong types, shapes or devices; an unknown estimator (the
            message lists the valid ones); a non-positive ``clamp``; NaN at a valid position
            of any input; a log-ratio ``inf - inf`` (both log-probs infinite alike).

    Example:
        >>> lp = torch.tensor([-1.0, -2.0])
        >>> lr = torch.tensor([-1.5, -1.0])
        >>> estimate_kl(lp, lr, "k1")
        tensor([ 0.5000, -1.0000])
        >>> estimate_kl(lp, lr, "k3")
        tensor([0.1065, 0.7183])
        >>> estimate_kl(torch.tensor([-100.0]), torch.tensor([-0.5]), "k3", clamp=10.0)
        tensor([10.])
    """
    check_floating("policy_logprobs", policy_logprobs)
    check_floating_like(
        "reference_logprobs",
        reference_logprobs,
        "policy_logprobs",
        policy_logprobs,
        "policy_logprobs' shape",
    )
    entry = REGISTRY[check_choice("estimator", estimator, list(REGISTRY))]
    # concrete: a clamp bound is an argument of torch.clamp, never a symbolic float
    bound = None if clamp is None else concrete(check_positive("clamp", clamp))
    valid = None
    if mask is not None:
        valid = check_mask(
            "mask", mask, policy_logprobs.shape, same_device_as=("policy_logprobs", policy_logprobs)
        )
    inputs = [policy_logprobs, reference_logprobs]
    if behavior_logprobs is not None:
        check_floating_like(
            "behavior_logprobs",
            behavior_logprobs,
            "policy_logprobs",
            policy_logprobs,
            "policy_logprobs' shape",
        )
        inputs.append(behavior_logprobs)
    dtype = promoted_dtype(*inputs)
    # excerpt: log-ratio
    p, q = policy_logprobs.to(dtype), reference_logprobs.to(dtype)
    r = p - q
    # end excerpt
    names = ("policy_logprobs", "reference_logprobs", "behavior_logprobs")

    def undefined(index: tuple[int, ...]) -> str:
        # NaN in the log-ratio: a NaN input (named by its own check), or inf - inf
        for arg, x in zip(names, inputs[:2], strict=False):
            check_no_nan_at(arg, x, valid)
        return (
            "policy_logprobs and reference_logprobs are both infinite with the same sign at "
            f"index {index}: the log-ratio is undefined there (mask the position)"
        )

    # One check (one host synchronisation) for both inputs: any NaN in them is NaN in r.
    _refuse_at("log-ratio", torch.isnan(r.detach()), valid, undefined)
    log_w = None
    if behavior_logprobs is not None:
        b = behavior_logprobs.to(dtype)

        def not_finite(index: tuple[int, ...]) -> str:
            check_no_nan_at(names[2], behavior_logprobs, valid)
            return (
                f"behavior_logprobs must be finite at valid positions (a sampled token has "
                f"μ(y) > 0), got {b[index].item()} at index {index}"
            )

        _refuse_at("behavior_logprobs", ~torch.isfinite(b.detach()), valid, not_finite)
        log_w = (p - b, q - b)
    # excerpt: log-ratio
    return _estimate(r, entry, bound, valid, log_w)
    # end excerpt


def kl_penalty(
    logp_policy: Sequence[float] | np.ndarray,
    logp_reference: Sequence[float] | np.ndarray,
    beta: float,
) -> float:
    r"""``beta`` times the mean sampled log-ratio of one sequence, rounded to 2 decimals.

    .. math::

        \begin{aligned}
        &\beta \cdot \frac{1}{T} \sum_t \big(\log \pi(y_t) \\
        &\qquad - \log \pi_\mathrm{ref}(y_t)\big)
        \end{aligned}

    The NumPy form of the k1 penalty that the reference texts use in their exercises. The
    sign is kept: a single sampled estimate of a KL divergence can be negative.

    Args:
        logp_policy: ``(T,)`` list or array of policy log-probs of the sampled tokens.
        logp_reference: ``(T,)`` reference log-probs of the same tokens.
        beta: finite, non-negative coefficient.

    Returns:
        A Python ``float`` rounded to 2 decimals (``0.0``, never ``-0.0``, for identical inputs).

    Example:
        >>> kl_penalty([-1.0, -2.0], [-1.5, -2.5], 0.1)
        0.05
        >>> kl_penalty([-2.0, -3.0], [-1.0, -1.0], 1.0)
        -1.5
        >>> kl_penalty([-1.0, -2.0], [-1.0, -2.0], 0.5)
        0.0
    """
    b = check_coef("beta", beta)
    arrays = []
    for name, value in (("logp_policy", logp_policy), ("logp_reference", logp_reference)):
        if isinstance(value, torch.Tensor):
            check_tensor_kind(name, value)
            # via float64: NumPy has no bfloat16, and the result is computed in float64 anyway
            t = value.detach().cpu()
            value = (t.double() if t.is_floating_point() else t).numpy()
        try:
            raw = np.asarray(value)
        except (TypeError, ValueError) as err:  # e.g. ragged nested lists
            raise TypeError(f"{name} must be a list or array of numbers, got {value!r}") from err
        if raw.dtype.kind == "O":
            try:  # Python ints beyond float64's range, such as 10**400, land here
                np.asarray(value, dtype=np.float64)
            except OverflowError:
                raise ValueError(
                    f"{name} holds a number that does not fit a float (|x| < 1.8e308)"
                ) from None
            except (TypeError, ValueError):
                pass
        # Only integers and reals: np.asarray(..., dtype=float) would also parse strings.
        if raw.dtype.kind not in "iuf":
            raise TypeError(
                f"{name} must be a list or array of real numbers, got dtype {raw.dtype}: {value!r}"
            )
        arr = raw.astype(np.float64)
        if arr.ndim != 1 or arr.size == 0:
            raise ValueError(f"{name} must have shape (T,) with T >= 1, got shape {arr.shape}")
        if not np.isfinite(arr).all():
            raise ValueError(f"{name} must be finite, got {arr.tolist()}")
        arrays.append(arr)
    lp, lr = arrays
    if lp.shape != lr.shape:
        raise ValueError(
            f"logp_reference must have the shape of logp_policy {lp.shape}, got {lr.shape}"
        )
    if b == 0.0:
        return 0.0  # no penalty, exactly, whatever the log-ratios
    with np.errstate(over="ignore", invalid="ignore"):
        # excerpt: penalty
        mean = float(np.mean(lp - lr))
        # end excerpt
        if not math.isfinite(mean):
            # lp - lr or its sum overflowed float64 (|values| near 1e308): halves cannot
            # overflow, and a mean of them, doubled, saturates only if the true mean does.
            mean = 2.0 * float(np.sum((lp / 2 - lr / 2) / lp.size))
        # excerpt: penalty
        # + 0.0 turns a rounded -0.0 into 0.0
        return round(b * mean, 2) + 0.0
        # end excerpt
