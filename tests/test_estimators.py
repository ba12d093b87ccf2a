"""Sampled KL estimators (k1, k2, k3, abs, straight-through) and the NumPy ``kl_penalty``.

References are independent of klpen: exact rational (``fractions``) and high-precision decimal
arithmetic for k3, float64 NumPy/``math`` formulas for the rest, and
``torch.distributions.kl_divergence`` for the expectations of the unbiased estimators.
"""

from __future__ import annotations

import math
from decimal import Decimal, localcontext
from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st
from torch.distributions import Categorical, kl_divergence

from klpen import estimate_kl, kl_penalty
from klpen.estimators import ESTIMATORS

# ---------------------------------------------------------------- references


def k3_reference(r: float) -> float:
    """``exp(-r) + r - 1`` correctly rounded to float64, computed without any float arithmetic.

    For |r| <= 1 the Taylor series in exact rational arithmetic (40 terms: the remainder is
    below 1e-48 of the value); beyond, 60-digit decimals, where nothing cancels badly.
    """
    if abs(r) <= 1.0:
        x = Fraction(r)  # exact: every float is a dyadic rational
        total, term = Fraction(0), Fraction(1)
        for n in range(1, 42):
            term = term * (-x) / n
            if n >= 2:
                total += term
        return float(total)
    with localcontext() as ctx:
        ctx.prec = 60
        d = Decimal(r)
        return float((-d).exp() + d - 1)


def naive_float64(estimator: str, r: np.ndarray) -> np.ndarray:
    if estimator in ("k1", "k1+"):
        return r
    if estimator in ("k2", "k2+"):
        return r * r / 2
    if estimator in ("abs", "abs+"):
        return np.abs(r)
    return np.array([k3_reference(float(x)) for x in r.ravel()]).reshape(r.shape)


def derivative_float64(estimator: str, r: np.ndarray) -> np.ndarray:
    """d estimate / d r: the straight-through variants carry the gradient of k2, which is r."""
    if estimator in ("k2", "k1+", "k2+", "k3+", "abs+"):
        return r
    if estimator == "k1":
        return np.ones_like(r)
    if estimator == "abs":
        return np.sign(r)
    return -np.expm1(-r)  # k3' = 1 - exp(-r)


VALUE_OF = {name: name.rstrip("+") for name in ESTIMATORS}

finite_logprob = st.floats(min_value=-60.0, max_value=0.0, allow_nan=False)

# ---------------------------------------------------------------- estimate_kl values


def test_registry_is_the_documented_set() -> None:
    assert set(ESTIMATORS) == {"k1", "k2", "k3", "abs", "k1+", "k2+", "k3+", "abs+"}


@pytest.mark.parametrize("estimator", list(ESTIMATORS))
@given(
    pairs=st.lists(st.tuples(finite_logprob, finite_logprob), min_size=1, max_size=12),
)
def test_values_match_float64_formulas(estimator: str, pairs: list[tuple[float, float]]) -> None:
    lp = torch.tensor([p for p, _ in pairs], dtype=torch.float64)
    lr = torch.tensor([q for _, q in pairs], dtype=torch.float64)
    got = estimate_kl(lp, lr, estimator).numpy()
    expected = naive_float64(VALUE_OF[estimator], lp.numpy() - lr.numpy())
    np.testing.assert_allclose(got, expected, rtol=1e-13, atol=1e-300)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3", "abs"])
def test_float32_values_match_float64_formulas(estimator: str) -> None:
    gen = torch.Generator().manual_seed(0)
    lp = -torch.rand(64, 9, generator=gen) * 8
    lr = -torch.rand(64, 9, generator=gen) * 8
    got = estimate_kl(lp, lr, estimator)
    assert got.dtype == torch.float32 and got.shape == (64, 9)
    r = lp.double().numpy() - lr.double().numpy()
    np.testing.assert_allclose(got.numpy(), naive_float64(estimator, r), rtol=2e-5, atol=1e-6)


def test_contract_examples_of_the_docstring() -> None:
    lp, lr = torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -1.0])
    torch.testing.assert_close(estimate_kl(lp, lr), torch.tensor([0.5, -1.0]))
    torch.testing.assert_close(estimate_kl(lp, lr, "k2"), torch.tensor([0.125, 0.5]))
    torch.testing.assert_close(estimate_kl(lp, lr, "abs"), torch.tensor([0.5, 1.0]))
    expected_k3 = torch.tensor([math.exp(-0.5) - 0.5, math.exp(1.0) - 2.0])
    torch.testing.assert_close(estimate_kl(lp, lr, "k3"), expected_k3)


def test_promoted_dtype_and_any_shape() -> None:
    lp = torch.zeros(2, 3, 4, dtype=torch.float32)
    lr = torch.zeros(2, 3, 4, dtype=torch.float64)
    out = estimate_kl(lp, lr, "k3")
    assert out.dtype == torch.float64 and out.shape == (2, 3, 4)
    scalar = estimate_kl(torch.tensor(-1.0), torch.tensor(-2.0), "k2")
    assert scalar.shape == () and scalar.item() == 0.5


# ---------------------------------------------------------------- k3: non-negative, no cancellation


@given(r=st.floats(min_value=-0.5, max_value=0.5, allow_nan=False, allow_subnormal=False))
@example(r=1e-8)
@example(r=-1e-8)
@example(r=1e-150)
@example(r=0.4999999)
@example(r=-0.5)
@example(r=0.5)
def test_k3_accurate_for_small_r_float64(r: float) -> None:
    # The closed form expm1(-r) + r already loses ~|log10 r| digits; a plain exp(-r) + r - 1
    # returns 0 or garbage for |r| < 1e-8. The series must keep the full precision.
    got = estimate_kl(
        torch.tensor([r], dtype=torch.float64), torch.zeros(1, dtype=torch.float64), "k3"
    )
    assert math.isclose(got.item(), k3_reference(r), rel_tol=1e-14, abs_tol=1e-300)


@given(r=st.floats(min_value=-700.0, max_value=700.0, allow_nan=False))
def test_k3_accurate_everywhere_float64(r: float) -> None:
    got = estimate_kl(
        torch.tensor([r], dtype=torch.float64), torch.zeros(1, dtype=torch.float64), "k3"
    )
    assert math.isclose(got.item(), k3_reference(r), rel_tol=1e-13, abs_tol=1e-300)


@given(r=st.floats(min_value=-1e-2, max_value=1e-2, allow_nan=False, allow_subnormal=False))
@example(r=1e-6)
@example(r=-3e-5)
def test_k3_accurate_for_small_r_float32(r: float) -> None:
    x = torch.tensor([r], dtype=torch.float32)
    got = estimate_kl(x, torch.zeros(1), "k3").item()
    expected = k3_reference(x.double().item())  # the float32 input, exactly
    assert math.isclose(got, expected, rel_tol=1e-6, abs_tol=1e-38)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@given(r=st.floats(allow_nan=False, allow_infinity=False, width=16))
def test_k3_never_negative_never_nan(dtype: torch.dtype, r: float) -> None:
    x = torch.tensor([r], dtype=dtype)
    out = estimate_kl(x, torch.zeros_like(x), "k3")
    assert not out.isnan().any() and (out >= 0).all()


@pytest.mark.parametrize("estimator", list(ESTIMATORS))
def test_never_nan_for_finite_extreme_input(estimator: str) -> None:
    big = torch.finfo(torch.float32).max / 4
    lp = torch.tensor([big, -big, 1e30, -1e30, 0.0, 1e-30])
    lr = torch.tensor([-big, big, 0.0, 0.0, 0.0, 0.0])
    lp.requires_grad_(True)
    out = estimate_kl(lp, lr, estimator)
    assert not out.isnan().any()
    if estimator == "k3":  # exp(-r) overflows at r = -big and -1e30: no finite gradient there
        with pytest.raises(ValueError, match=r"no finite gradient at 2 position.*index \(1,\)"):
            out.sum().backward()
        return
    out.sum().backward()
    assert lp.grad is not None and torch.isfinite(lp.grad).all()


@pytest.mark.parametrize("estimator", ["k2", "k3", "abs"])
@given(
    pairs=st.lists(
        st.tuples(
            st.floats(-1e4, 1e4, allow_nan=False),
            st.floats(-1e4, 1e4, allow_nan=False),
        ),
        min_size=1,
        max_size=8,
    )
)
def test_nonnegative_estimators(estimator: str, pairs: list[tuple[float, float]]) -> None:
    lp = torch.tensor([p for p, _ in pairs])
    lr = torch.tensor([q for _, q in pairs])
    assert (estimate_kl(lp, lr, estimator) >= 0).all()


# ---------------------------------------------------------------- expectations under π


@pytest.mark.parametrize("estimator", ["k1", "k3", "k1+", "k3+"])
def test_unbiased_estimators_average_to_the_exact_kl(estimator: str) -> None:
    # E_{y~π}[k(r(y))] computed exactly as Σ_v π(v) k(r(v)): k1 and k3 are unbiased.
    gen = torch.Generator().manual_seed(1)
    z = torch.randn(16, 11, generator=gen, dtype=torch.float64) * 2
    w = torch.randn(16, 11, generator=gen, dtype=torch.float64) * 2
    lp, lq = torch.log_softmax(z, -1), torch.log_softmax(w, -1)
    expectation = (lp.exp() * estimate_kl(lp, lq, estimator)).sum(-1)
    exact = kl_divergence(Categorical(logits=z), Categorical(logits=w))
    torch.testing.assert_close(expectation, exact, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("estimator", ["k2", "abs"])
def test_biased_estimators_overestimate_near_and_far(estimator: str) -> None:
    gen = torch.Generator().manual_seed(2)
    z = torch.randn(16, 11, generator=gen, dtype=torch.float64) * 3
    w = torch.randn(16, 11, generator=gen, dtype=torch.float64) * 3
    lp, lq = torch.log_softmax(z, -1), torch.log_softmax(w, -1)
    expectation = (lp.exp() * estimate_kl(lp, lq, estimator)).sum(-1)
    exact = kl_divergence(Categorical(logits=z), Categorical(logits=w))
    assert not torch.allclose(expectation, exact, rtol=1e-3)


# ---------------------------------------------------------------- gradients


@pytest.mark.parametrize("estimator", list(ESTIMATORS))
def test_gradients_match_float64_derivatives(estimator: str) -> None:
    gen = torch.Generator().manual_seed(3)
    lp = (-torch.rand(40, generator=gen, dtype=torch.float64) * 6).requires_grad_(True)
    lr = (-torch.rand(40, generator=gen, dtype=torch.float64) * 6).requires_grad_(True)
    estimate_kl(lp, lr, estimator).sum().backward()
    r = (lp - lr).detach().numpy()
    d = derivative_float64(estimator, r)
    assert lp.grad is not None and lr.grad is not None
    np.testing.assert_allclose(lp.grad.numpy(), d, rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(lr.grad.numpy(), -d, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("estimator", ["k2", "k3", "abs", "k1+", "k3+"])
def test_gradient_finite_and_zero_at_r_equal_zero(estimator: str) -> None:
    lp = torch.tensor([-1.0, -2.0], requires_grad=True)
    estimate_kl(lp, torch.tensor([-1.0, -2.0]), estimator).sum().backward()
    assert lp.grad is not None
    assert torch.equal(lp.grad, torch.zeros(2))


@pytest.mark.parametrize("estimator", ["k1+", "k2+", "k3+", "abs+"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.float64])
def test_straight_through_has_k2_derivatives_and_k_values(
    estimator: str, dtype: torch.dtype
) -> None:
    # r up to 400: r²/2 overflows fp16, the straight-through value must not notice
    r = torch.tensor([-3.0, -0.25, 0.0, 0.5, 400.0], dtype=dtype, requires_grad=True)
    zero = torch.zeros_like(r)
    out = estimate_kl(r, zero, estimator)
    torch.testing.assert_close(out.detach(), estimate_kl(r.detach(), zero, estimator.rstrip("+")))
    (grad,) = torch.autograd.grad(out.sum(), r, create_graph=True)
    torch.testing.assert_close(grad.detach(), r.detach())  # d k2 / dr = r
    (second,) = torch.autograd.grad(grad.sum(), r)
    torch.testing.assert_close(second, torch.ones_like(r))  # d² k2 / dr² = 1


def test_k3_gradcheck_float64_across_the_series_boundary() -> None:
    r = torch.tensor([-2.0, -0.5001, -0.4999, -1e-3, 0.0, 1e-6, 0.3, 0.4999, 0.5001, 3.0])
    r = r.double().requires_grad_(True)
    zero = torch.zeros_like(r)
    assert torch.autograd.gradcheck(lambda x: estimate_kl(x, zero, "k3"), (r,))


# ---------------------------------------------------------------- kl_penalty (NumPy, seed surface)


def test_kl_penalty_contract_examples() -> None:
    assert kl_penalty([-1, -2], [-1.5, -2.5], 0.1) == 0.05
    assert kl_penalty([-2, -3], [-1, -1], 1.0) == -1.5
    same = kl_penalty([-1.25, -0.5, -3.0], [-1.25, -0.5, -3.0], 0.7)
    assert same == 0.0 and math.copysign(1.0, same) == 1.0  # 0.0, not -0.0


def test_kl_penalty_returns_a_python_float() -> None:
    out = kl_penalty(np.array([-1.0, -2.0]), np.array([-1.5, -2.5]), 0.1)
    assert type(out) is float


def test_kl_penalty_keeps_tiny_negative_as_zero_not_minus_zero() -> None:
    out = kl_penalty([-1.0], [-0.999], 1.0)  # -0.001 rounds to -0.0
    assert out == 0.0 and math.copysign(1.0, out) == 1.0


@given(
    values=st.lists(
        st.tuples(st.floats(-50, 0, allow_nan=False), st.floats(-50, 0, allow_nan=False)),
        min_size=1,
        max_size=20,
    ),
    beta=st.floats(0.0, 5.0, allow_nan=False),
)
def test_kl_penalty_matches_the_rounded_float64_formula(
    values: list[tuple[float, float]], beta: float
) -> None:
    lp = [p for p, _ in values]
    lr = [q for _, q in values]
    expected = round(beta * sum(p - q for p, q in values) / len(values), 2)
    got = kl_penalty(lp, lr, beta)
    # np.mean and a Python sum may differ in the last bit, which can flip a rounding tie.
    assert abs(got - expected) <= 0.01 + 1e-12
    assert got == round(got, 2)


def test_kl_penalty_sign_is_kept_never_clipped() -> None:
    assert kl_penalty([-5.0, -5.0], [-1.0, -1.0], 0.5) == -2.0


def test_kl_penalty_accepts_tensors_and_integer_arrays() -> None:
    assert kl_penalty(torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -2.5]), 0.1) == 0.05
    half = torch.tensor([-1.0, -2.0], dtype=torch.bfloat16)
    assert kl_penalty(half, torch.tensor([-1.5, -2.5]).bfloat16(), 0.1) == 0.05
    assert kl_penalty(np.array([-1, -2]), np.array([-2, -3]), 1) == 1.0
