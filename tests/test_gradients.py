"""klpen.gradients: the exact expected gradient of each KL estimator, in the loss and the reward.

References are independent of klpen: closed-form float64 gradients of the two divergences and
of each placement, written out with the softmax Jacobian ``∂ log π(y) / ∂z = e_y - π``.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from klpen.estimators import ESTIMATORS
from klpen.gradients import (
    PLACEMENTS,
    expected_estimator_gradients,
    expected_penalty_gradient,
    penalty_surrogate,
)
from klpen_book.loss_placement import gradient_table, monte_carlo_gradient

F64 = torch.float64


def _probs(z: torch.Tensor) -> torch.Tensor:
    return torch.exp(z - torch.logsumexp(z, -1, keepdim=True))


def reverse_kl_grad(z: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """∂/∂z Σ p log(p/q) = p (log(p/q) - KL)."""
    p, q = _probs(z), _probs(w)
    log_ratio = p.log() - q.log()
    kl = (p * log_ratio).sum(-1, keepdim=True)
    return p * (log_ratio - kl)


def forward_kl_grad(z: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """∂/∂z Σ q log(q/p) = p - q."""
    return _probs(z) - _probs(w)


# Each estimator as a function of the log-ratio r and its derivative dk/dr (straight-through
# ones: the value of k1 / k3, the derivative of k2).
VALUE = {
    "k1": lambda r: r,
    "k2": lambda r: r * r / 2,
    "k3": lambda r: torch.exp(-r) + r - 1,
    "abs": lambda r: r.abs(),
    "k1+": lambda r: r,
    "k2+": lambda r: r * r / 2,
    "k3+": lambda r: torch.exp(-r) + r - 1,
    "abs+": lambda r: r.abs(),
}
SLOPE = {
    "k1": lambda r: torch.ones_like(r),
    "k2": lambda r: r,
    "k3": lambda r: 1 - torch.exp(-r),
    "abs": lambda r: torch.sign(r),
    "k1+": lambda r: r,
    "k2+": lambda r: r,
    "k3+": lambda r: r,
    "abs+": lambda r: r,
}


def placement_grad(z: torch.Tensor, w: torch.Tensor, name: str, placement: str) -> torch.Tensor:
    """Σ_y π(y) c(y) (e_y - π) = π ⊙ (c - E_π c), c = dk/dr (loss) or k (reward)."""
    p = _probs(z)
    r = p.log() - _probs(w).log()
    c = (SLOPE if placement == "loss" else VALUE)[name](r)
    return p * (c - (p * c).sum(-1, keepdim=True))


logits = st.integers(2, 7).flatmap(
    lambda v: st.tuples(
        st.lists(st.floats(-3, 3), min_size=v, max_size=v),
        st.lists(st.floats(-3, 3), min_size=v, max_size=v),
    )
)


@settings(deadline=None, max_examples=40)
@given(logits)
def test_pinned_facts_for_random_logits(pair: tuple[list[float], list[float]]) -> None:
    z, w = (torch.tensor(x, dtype=F64) for x in pair)
    g = expected_estimator_gradients(z, w)
    rev, fwd = reverse_kl_grad(z, w), forward_kl_grad(z, w)
    tol = {"atol": 1e-12, "rtol": 1e-9}
    torch.testing.assert_close(g.reverse_kl, rev, **tol)
    torch.testing.assert_close(g.forward_kl, fwd, **tol)
    # In the loss: k1 gives nothing, k2 and the straight-through pair the reverse KL, k3 the
    # forward KL.
    torch.testing.assert_close(g.loss["k1"], torch.zeros_like(z), **tol)
    for name in ("k2", "k1+", "k2+", "k3+", "abs+"):
        torch.testing.assert_close(g.loss[name], rev, **tol)
    torch.testing.assert_close(g.loss["k3"], fwd, **tol)
    # In the reward (score function): k1 gives the reverse KL; k3 gives reverse - forward.
    torch.testing.assert_close(g.reward["k1"], rev, **tol)
    torch.testing.assert_close(g.reward["k3"], rev - fwd, **tol)
    # Every placement × estimator against its closed form.
    for placement, by_name in (("loss", g.loss), ("reward", g.reward)):
        assert set(by_name) == set(ESTIMATORS)
        for name, grad in by_name.items():
            torch.testing.assert_close(grad, placement_grad(z, w, name, placement), **tol)


def test_full_gradient_of_expected_k1_and_k3_is_the_reverse_kl() -> None:
    # loss + reward = ∇ E_π[k] with the sampling differentiated too; E_π[k1] = E_π[k3] = KL.
    z = torch.tensor([0.3, -1.2, 2.0, 0.0], dtype=F64)
    w = torch.tensor([1.0, 0.5, -0.5, 0.2], dtype=F64)
    g = expected_estimator_gradients(z, w, ["k1", "k3", "k2"])
    for name in ("k1", "k3"):
        torch.testing.assert_close(g.loss[name] + g.reward[name], g.reverse_kl)
    # For k2 it is the gradient of E_π[r²/2], a different function.
    zz = z.clone().requires_grad_(True)
    p = torch.softmax(zz, -1)
    r = torch.log_softmax(zz, -1) - torch.log_softmax(w, -1)
    (expected,) = torch.autograd.grad((p * r * r / 2).sum(), zz)
    torch.testing.assert_close(g.loss["k2"] + g.reward["k2"], expected)


def test_leading_shape_rows_are_independent() -> None:
    gen = torch.Generator().manual_seed(3)
    z = torch.randn(2, 3, 5, generator=gen, dtype=F64)
    w = torch.randn(2, 3, 5, generator=gen, dtype=F64)
    g = expected_estimator_gradients(z, w, ["k3"])
    assert g.loss["k3"].shape == (2, 3, 5)
    for i in range(2):
        for j in range(3):
            row = expected_estimator_gradients(z[i, j], w[i, j], ["k3"])
            torch.testing.assert_close(g.loss["k3"][i, j], row.loss["k3"])
            torch.testing.assert_close(g.reward["k3"][i, j], row.reward["k3"])
            torch.testing.assert_close(g.reverse_kl[i, j], row.reverse_kl)


def test_expected_penalty_gradient_is_one_entry() -> None:
    z = torch.tensor([[0.5, -0.5, 1.5], [0.0, 0.1, -2.0]], dtype=F64)
    w = torch.tensor([[0.0, 0.0, 0.0], [1.0, -1.0, 0.5]], dtype=F64)
    g = expected_estimator_gradients(z, w)
    for placement in PLACEMENTS:
        for name in ESTIMATORS:
            single = expected_penalty_gradient(z, w, name, placement)
            torch.testing.assert_close(single, getattr(g, placement)[name], rtol=0, atol=0)


def test_placements_subset() -> None:
    z, w = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0])
    g = expected_estimator_gradients(z, w, ["k1"], placements=["reward"])
    assert g.loss == {} and set(g.reward) == {"k1"}


@pytest.mark.parametrize(
    ("dtype", "expected"),
    [
        (torch.float16, torch.float32),
        (torch.bfloat16, torch.float32),
        (torch.float32, torch.float32),
    ],
)
def test_dtype_rules(dtype: torch.dtype, expected: torch.dtype) -> None:
    z = torch.tensor([0.5, -0.5, 1.0], dtype=dtype)
    w = torch.zeros(3, dtype=dtype)
    g = expected_estimator_gradients(z, w, ["k2"])
    assert g.loss["k2"].dtype == expected and g.reverse_kl.dtype == expected
    torch.testing.assert_close(
        g.loss["k2"].double(), reverse_kl_grad(z.double(), w.double()), atol=2e-3, rtol=0
    )


@pytest.mark.parametrize(
    ("estimator", "placement"), [(e, p) for p in PLACEMENTS for e in ESTIMATORS]
)
def test_monte_carlo_average_approaches_the_exact_gradient(estimator: str, placement: str) -> None:
    # Sampled gradients of the surrogate, one per draw, averaged: within a few standard errors
    # of the exact expectation (fixed seed; 5 SE per coordinate leaves a margin for the
    # 4 × 12 tests, while a biased mean, e.g. the wrong placement, lies far outside).
    z = torch.tensor([0.8, -0.4, 0.0, 1.2, -1.0], dtype=F64)
    w = torch.tensor([0.0, 0.5, -0.3, 0.1, 0.4], dtype=F64)
    mean, se = monte_carlo_gradient(
        z, w, estimator=estimator, placement=placement, samples=20_000, seed=1
    )
    exact = placement_grad(z, w, estimator, placement)
    assert bool(((mean - exact).abs() <= 5 * se + 1e-12).all()), (mean, exact, se)
    assert float(se.max()) < 0.02  # the check is not vacuous


def test_monte_carlo_distinguishes_the_placements() -> None:
    # The same samples, averaged, separate k3 in the loss from k3 in the reward.
    z = torch.tensor([0.8, -0.4, 0.0, 1.2, -1.0], dtype=F64)
    w = torch.tensor([0.0, 0.5, -0.3, 0.1, 0.4], dtype=F64)
    mean, se = monte_carlo_gradient(z, w, estimator="k3", placement="loss", samples=20_000)
    other = placement_grad(z, w, "k3", "reward")
    assert bool(((mean - other).abs() > 5 * se).any())


def test_penalty_surrogate_values_and_gradients() -> None:
    lp = torch.tensor([-1.0, -2.0, -0.5], dtype=F64, requires_grad=True)
    lr = torch.tensor([-1.5, -1.0, -0.5], dtype=F64)
    r = (lp - lr).detach()
    s = penalty_surrogate(lp, lr, "k3", "loss")
    torch.testing.assert_close(s.detach(), torch.exp(-r) + r - 1)
    (g,) = torch.autograd.grad(s.sum(), lp)
    torch.testing.assert_close(g, 1 - torch.exp(-r))
    s = penalty_surrogate(lp, lr, "k3", "reward")
    torch.testing.assert_close(s.detach(), (torch.exp(-r) + r - 1) * lp.detach())
    (g,) = torch.autograd.grad(s.sum(), lp)
    torch.testing.assert_close(g, torch.exp(-r) + r - 1)
    # In the reward the penalty is a constant coefficient: no gradient reaches the reference.
    lr2 = lr.clone().requires_grad_(True)
    s = penalty_surrogate(lp, lr2, "k3", "reward").sum()
    g_lp, g_lr = torch.autograd.grad(s, [lp, lr2], allow_unused=True)
    assert g_lr is None
    torch.testing.assert_close(g_lp, torch.exp(-r) + r - 1)


def test_gradient_table_rows() -> None:
    z = torch.tensor([1.0, 0.0, -1.0, 0.5], dtype=F64)
    w = torch.tensor([0.0, 0.3, 0.2, -0.1], dtype=F64)
    rows = {(row[0], row[1]): row for row in gradient_table(z, w)}
    assert len(rows) == 2 * len(ESTIMATORS)
    assert rows[("loss", "k1")][3] == "zero" and rows[("loss", "k1")][2] < 1e-12
    for key in (("loss", "k2"), ("loss", "k1+"), ("loss", "k3+"), ("reward", "k1")):
        assert math.isclose(rows[key][3], 1.0, abs_tol=1e-12) and rows[key][5] < 1e-12
    assert math.isclose(rows[("loss", "k3")][4], 1.0, abs_tol=1e-12)
    assert rows[("loss", "k3")][6] < 1e-12 and rows[("loss", "k3")][5] > 1e-3


def test_overflow_is_an_error_not_nan() -> None:
    # π(1) = e^-200 underflows to 0 in fp32 while k3's e^{-r} overflows: 0 · inf.
    z = torch.tensor([0.0, -200.0])
    w = torch.zeros(2)
    with pytest.raises(ValueError, match=r"underflows in torch\.float32"):
        expected_estimator_gradients(z, w, ["k3"])
    # In fp64 the same logits are fine and exact.
    g = expected_estimator_gradients(z.double(), w.double(), ["k3"])
    torch.testing.assert_close(g.loss["k3"], forward_kl_grad(z.double(), w.double()))


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"policy_logits": [1.0, 2.0]}, TypeError, "policy_logits must be a torch.Tensor"),
        ({"policy_logits": torch.tensor([1, 2])}, TypeError, "policy_logits must be a floating"),
        (
            {"reference_logits": torch.zeros(3)},
            ValueError,
            r"reference_logits must have shape \(2,\)",
        ),
        (
            {"policy_logits": torch.tensor([0.0, math.nan])},
            ValueError,
            "policy_logits must be finite",
        ),
        (
            {"reference_logits": torch.tensor([0.0, -math.inf])},
            ValueError,
            "reference_logits must be finite",
        ),
        (
            {"policy_logits": torch.zeros(2, 0), "reference_logits": torch.zeros(2, 0)},
            ValueError,
            "non-empty",
        ),
        ({"estimators": ["k4"]}, ValueError, "estimators must be one of"),
        ({"estimators": "k1"}, TypeError, "sequence of names"),
        ({"placements": ["value"]}, ValueError, "placements must be one of"),
    ],
)
def test_bad_input(kwargs: dict[str, object], error: type[Exception], match: str) -> None:
    args: dict[str, object] = {"policy_logits": torch.zeros(2), "reference_logits": torch.zeros(2)}
    args.update(kwargs)
    with pytest.raises(error, match=match):
        expected_estimator_gradients(**args)  # type: ignore[arg-type]


def test_bad_input_single_and_surrogate() -> None:
    z = torch.zeros(3)
    with pytest.raises(ValueError, match="placement must be one of"):
        expected_penalty_gradient(z, z, "k1", "advantage")
    with pytest.raises(ValueError, match="estimator must be one of"):
        expected_penalty_gradient(z, z, "kl", "loss")
    with pytest.raises(ValueError, match="placement must be one of"):
        penalty_surrogate(z, z, "k1", "both")
    with pytest.raises(ValueError, match="reference_logprobs must have shape"):
        penalty_surrogate(z, torch.zeros(2), "k1", "loss")
    with pytest.raises(ValueError, match="samples must be at least 2"):
        monte_carlo_gradient(z, z, estimator="k1", placement="loss", samples=1)
    with pytest.raises(ValueError, match=r"policy_logits must have shape \(V,\)"):
        monte_carlo_gradient(
            torch.zeros(2, 3), torch.zeros(2, 3), estimator="k1", placement="loss", samples=10
        )
