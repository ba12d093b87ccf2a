"""Sampled estimators of ``KL(π ‖ π_ref)`` from the log-probs of tokens drawn from π.

Chapter 1 of the book. With ``r = log π(y) - log π_ref(y)`` for a sample ``y ~ π``:

* ``k1 = r``: unbiased, but any single value can be negative and its variance is high;
* ``k2 = r²/2``: biased, never negative, low variance when π is close to π_ref;
* ``k3 = exp(-r) + r - 1``: unbiased and never negative (Schulman's control-variate form);
* ``abs = |r|``: never negative, biased upwards.

Chapter 7 adds the straight-through variants ``k1+`` and ``k3+``: the value of k1 / k3 with the
gradient of k2, so that, used inside a loss, they descend the reverse KL.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np
import torch
from torch import Tensor

from ._validation import check_choice, check_coef, check_floating, check_same_device, check_shape

__all__ = ["ESTIMATORS", "estimate_kl", "k3", "kl_penalty"]


# Below this |r| the series of exp(-r) + r - 1 is used: the closed form loses digits there by
# cancelling 1 against exp(-r) (relative error ~ 2 eps / |r|). The terms n = 2..16 give full
# fp64 precision up to |r| = 0.5: the first omitted one, 0.5**17 / 17!, is 1e-20 of k3(0.5).
_SERIES_LIMIT = 0.5
_SERIES = [(-1.0) ** n / math.factorial(n) for n in range(2, 17)]


def k3(r: Tensor) -> Tensor:
    r"""``exp(-r) + r - 1`` evaluated without cancellation, with a gradient everywhere finite
    where the value is.

    .. math:: k_3(r) = e^{-r} + r - 1 = \sum_{n \ge 2} \frac{(-r)^n}{n!} \ge 0

    Example:
        >>> k3(torch.tensor([1e-4, 0.0, 2.0], dtype=torch.float64))
        tensor([4.9998e-09, 0.0000e+00, 1.1353e+00], dtype=torch.float64)
    """
    small = r.abs() < _SERIES_LIMIT
    # Each branch only ever sees inputs where it is accurate and finite (the other gets a
    # harmless stand-in), so neither value nor gradient of the unused branch can be inf or NaN.
    rs = torch.where(small, r, torch.zeros_like(r))
    rl = torch.where(small, torch.ones_like(r), r)
    poly = torch.full_like(rs, _SERIES[-1])
    for c in reversed(_SERIES[:-1]):
        poly = poly * rs + c
    series = poly * rs * rs
    closed = torch.expm1(-rl) + rl
    return torch.where(small, series, closed).clamp(min=0.0)


def _k1(r: Tensor) -> Tensor:
    return r


def _k2(r: Tensor) -> Tensor:
    return 0.5 * r * r


def _abs(r: Tensor) -> Tensor:
    return r.abs()


def _straight_through(value: Callable[[Tensor], Tensor]) -> Callable[[Tensor], Tensor]:
    """Forward value of ``value(r)``, backward gradient of ``k2(r)`` (the reverse-KL gradient)."""

    def estimator(r: Tensor) -> Tensor:
        # Adds k2(r) - k2(f) with f = r.detach(), written as its exact expansion around f,
        # d (f + d/2) with d = r - f: as a function of r the same quadratic (every derivative
        # of k2 kept), but its value is 0 * finite = 0, where r²/2 - f²/2 would overflow to
        # inf - inf = NaN for finite r (already at |r| > 362 in fp16).
        d = r - r.detach()
        return value(r).detach() + d * (r.detach() + 0.5 * d)

    return estimator


ESTIMATORS: dict[str, Callable[[Tensor], Tensor]] = {
    "k1": _k1,
    "k2": _k2,
    "k3": k3,
    "abs": _abs,
    "k1+": _straight_through(_k1),
    "k3+": _straight_through(k3),
}


def estimate_kl(
    policy_logprobs: Tensor, reference_logprobs: Tensor, estimator: str = "k1"
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
    ``"k3+"``   value of k3, gradient of k2     straight-through (chapter 7)
    ==========  ==============================  =========================================

    Args:
        policy_logprobs: ``(...)`` log π of the sampled tokens.
        reference_logprobs: ``(...)`` log π_ref of the same tokens, same shape.
        estimator: one of the names above.

    Returns:
        ``(...)`` tensor in the promoted dtype of the inputs, differentiable w.r.t. both.
        Never NaN for finite input: k3 is computed without cancellation for small ``r`` and
        overflows to ``+inf`` only where its true value exceeds the dtype's range.

    Example:
        >>> lp = torch.tensor([-1.0, -2.0])
        >>> lr = torch.tensor([-1.5, -1.0])
        >>> estimate_kl(lp, lr, "k1")
        tensor([ 0.5000, -1.0000])
        >>> estimate_kl(lp, lr, "k3")
        tensor([0.1065, 0.7183])
    """
    check_floating("policy_logprobs", policy_logprobs)
    check_floating("reference_logprobs", reference_logprobs)
    check_shape(
        "reference_logprobs", reference_logprobs, policy_logprobs.shape, "policy_logprobs' shape"
    )
    check_same_device("reference_logprobs", reference_logprobs, "policy_logprobs", policy_logprobs)
    name = check_choice("estimator", estimator, list(ESTIMATORS))
    return ESTIMATORS[name](policy_logprobs - reference_logprobs)


def kl_penalty(
    logp_policy: Sequence[float] | np.ndarray,
    logp_reference: Sequence[float] | np.ndarray,
    beta: float,
) -> float:
    r"""``beta`` times the mean sampled log-ratio of one sequence, rounded to 2 decimals.

    .. math:: \beta \cdot \frac{1}{T} \sum_t \big(\log \pi(y_t) - \log \pi_\mathrm{ref}(y_t)\big)

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
            # via float64: NumPy has no bfloat16, and the result is computed in float64 anyway
            t = value.detach().cpu()
            value = (t.double() if t.is_floating_point() else t).numpy()
        try:
            raw = np.asarray(value)
        except (TypeError, ValueError) as err:  # e.g. ragged nested lists
            raise TypeError(f"{name} must be a list or array of numbers, got {value!r}") from err
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
    # + 0.0 turns a rounded -0.0 into 0.0
    return round(float(b * np.mean(lp - lr)), 2) + 0.0
