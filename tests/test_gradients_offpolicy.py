"""klpen.gradients off-policy: samples from μ ≠ π, each estimator × placement × weighting.

References: float64 closed forms written with the softmax Jacobian ``∇ log π(y) = e_y - π``,
independent of klpen (each estimator as a function of r and its slope, shared with
test_gradients.py), and a Monte Carlo check through torch.distributions.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_gradients import SLOPE, VALUE, forward_kl_grad, reverse_kl_grad

from klpen.estimators import ESTIMATORS
from klpen.gradients import (
    PLACEMENTS,
    WEIGHTINGS,
    expected_estimator_gradients,
    expected_offpolicy_gradients,
    expected_penalty_gradient,
    penalty_surrogate,
)

F64 = torch.float64
TOL = {"atol": 1e-12, "rtol": 1e-9}


def closed_form(
    z: torch.Tensor, w: torch.Tensor, b: torch.Tensor, name: str, where: str, how: str
) -> torch.Tensor:
    """Σ_y c(y) (e_y - π) = c - π Σ c, with c(y) the per-token coefficient of ∇ log π(y)."""
    p, q, mu = z.softmax(-1), w.softmax(-1), b.softmax(-1)
    r = p.log() - q.log()
    k, slope = VALUE[name](r), SLOPE[name](r)
    if where == "loss":
        c = {"none": mu * slope, "detached": p * slope, "differentiated": p * (k + slope)}[how]
    else:
        c = {"none": mu * k, "detached": p * k, "differentiated": p * k}[how]
    return c - p * c.sum(-1, keepdim=True)


logits = st.integers(2, 6).flatmap(
    lambda v: st.tuples(*(st.lists(st.floats(-3, 3), min_size=v, max_size=v) for _ in range(3)))
)


@settings(deadline=None, max_examples=25)
@given(logits)
def test_every_combination_against_its_closed_form(
    triple: tuple[list[float], list[float], list[float]],
) -> None:
    z, w, b = (torch.tensor(x, dtype=F64) for x in triple)
    g = expected_offpolicy_gradients(z, w, b)
    assert set(g.gradients) == {
        (where, how, name) for where in PLACEMENTS for how in WEIGHTINGS for name in ESTIMATORS
    }
    for (where, how, name), grad in g.gradients.items():
        torch.testing.assert_close(grad, closed_form(z, w, b, name, where, how), **TOL)


@settings(deadline=None, max_examples=25)
@given(logits)
def test_pinned_facts(triple: tuple[list[float], list[float], list[float]]) -> None:
    z, w, b = (torch.tensor(x, dtype=F64) for x in triple)
    g = expected_offpolicy_gradients(z, w, b)
    p = z.softmax(-1)
    rev, fwd = reverse_kl_grad(z, w), forward_kl_grad(z, w)
    torch.testing.assert_close(g.reverse_kl, rev, **TOL)
    torch.testing.assert_close(g.forward_kl, fwd, **TOL)
    grads = g.gradients
    # k1 and k3 in the loss with the ratio differentiated: exactly ∇KL(π‖π_ref).
    for name in ("k1", "k3"):
        torch.testing.assert_close(grads["loss", "differentiated", name], rev, **TOL)
    # Detached ratio: the on-policy loss gradients (k3 -> the forward KL, k1 -> nothing).
    torch.testing.assert_close(grads["loss", "detached", "k3"], fwd, **TOL)
    torch.testing.assert_close(grads["loss", "detached", "k1"], torch.zeros_like(z), **TOL)
    torch.testing.assert_close(grads["loss", "detached", "k2"], rev, **TOL)
    # Unweighted k1 in the loss pulls π towards the sampler μ.
    torch.testing.assert_close(grads["loss", "none", "k1"], b.softmax(-1) - p, **TOL)
    # Reward placement: detached and differentiated ratios agree, and k1 gives ∇KL(π‖π_ref).
    for name in ESTIMATORS:
        torch.testing.assert_close(
            grads["reward", "differentiated", name], grads["reward", "detached", name], **TOL
        )
    torch.testing.assert_close(grads["reward", "detached", "k1"], rev, **TOL)
    # Detached weights reproduce the on-policy table exactly.
    on = expected_estimator_gradients(z, w)
    for name in ESTIMATORS:
        torch.testing.assert_close(grads["loss", "detached", name], on.loss[name], **TOL)
        torch.testing.assert_close(grads["reward", "detached", name], on.reward[name], **TOL)


def test_detached_k3_is_not_the_reverse_kl_off_policy() -> None:
    # The headline contrast of chapter 8, on one concrete triple.
    z = torch.tensor([1.5, 0.0, -1.0, 0.3], dtype=F64)
    w = torch.tensor([0.0, 0.5, 0.0, -0.5], dtype=F64)
    b = torch.tensor([0.5, 0.5, 0.0, 0.0], dtype=F64)
    g = expected_offpolicy_gradients(z, w, b, ["k3"], ["loss"])
    diff = g.gradients["loss", "differentiated", "k3"]
    det = g.gradients["loss", "detached", "k3"]
    none = g.gradients["loss", "none", "k3"]
    torch.testing.assert_close(diff, g.reverse_kl)
    assert (det - g.reverse_kl).abs().max() > 0.05
    assert (none - g.reverse_kl).abs().max() > 0.05


def test_single_gradient_matches_the_table_and_on_policy_default() -> None:
    z = torch.tensor([[0.2, -0.4, 1.0], [0.0, 0.0, 2.0]], dtype=F64)
    w = torch.zeros(2, 3, dtype=F64)
    b = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]], dtype=F64)
    table = expected_offpolicy_gradients(z, w, b).gradients
    for (where, how, name), grad in table.items():
        single = expected_penalty_gradient(z, w, name, where, behavior_logits=b, weighting=how)
        torch.testing.assert_close(single, grad, **TOL)
    # With μ = π, no weighting changes the value of the detached surrogate's gradient.
    torch.testing.assert_close(
        expected_penalty_gradient(z, w, "k3", "loss", behavior_logits=z, weighting="detached"),
        expected_penalty_gradient(z, w, "k3", "loss"),
        **TOL,
    )


def test_monte_carlo_average_of_the_surrogate_converges() -> None:
    # Sampled surrogates from μ (torch.distributions), averaged: the exact table's value.
    z = torch.tensor([0.8, -0.2, 0.1, -1.0], dtype=F64)
    w = torch.tensor([0.0, 0.4, -0.3, 0.2], dtype=F64)
    b = torch.tensor([0.0, 0.0, 0.6, 0.0], dtype=F64)
    torch.manual_seed(0)
    y = torch.distributions.Categorical(logits=b).sample((400_000,))
    for how in WEIGHTINGS:
        zz = z.clone().requires_grad_()
        logp = zz.log_softmax(-1)[y]
        s = penalty_surrogate(
            logp,
            w.log_softmax(-1)[y],
            "k3",
            "loss",
            behavior_logprobs=torch.distributions.Categorical(logits=b).log_prob(y),
            weighting=how,
        )
        (grad,) = torch.autograd.grad(s.mean(), zz)
        exact = expected_penalty_gradient(z, w, "k3", "loss", behavior_logits=b, weighting=how)
        torch.testing.assert_close(grad, exact, atol=5e-3, rtol=0)


def test_bad_input() -> None:
    z = torch.zeros(3, dtype=F64)
    with pytest.raises(ValueError, match="weighting must be one of"):
        expected_penalty_gradient(z, z, "k1", "loss", behavior_logits=z, weighting="tis")
    with pytest.raises(ValueError, match="weighting='detached' needs behavior_logits"):
        expected_penalty_gradient(z, z, "k1", "loss", weighting="detached")
    with pytest.raises(ValueError, match="behavior_logits must have shape"):
        expected_offpolicy_gradients(z, z, torch.zeros(4, dtype=F64))
    with pytest.raises(ValueError, match="behavior_logits must be finite"):
        expected_offpolicy_gradients(z, z, torch.tensor([0.0, float("inf"), 0.0]))
    with pytest.raises(TypeError, match="weightings must be a sequence"):
        expected_offpolicy_gradients(z, z, z, weightings="none")
    with pytest.raises(ValueError, match="needs behavior_logprobs"):
        penalty_surrogate(z, z, "k3", "loss", weighting="differentiated")
    with pytest.raises(ValueError, match="behavior_logprobs must have shape"):
        penalty_surrogate(z, z, "k3", "loss", behavior_logprobs=z[:2], weighting="detached")
