"""Contract section 3 against a hostile user and a long training run (issue 10).

What sits at a masked position never reaches a value or a gradient; an estimator that
overflows saturates instead of turning into NaN, and a gradient that cannot be finite stops the
run loudly instead of turning the parameters into NaN; a zero coefficient is no penalty, even
against an infinite KL; results are computed in the promoted dtype of the inputs. The references
are independent of klpen: float64 formulas written here, verl's ``kl_penalty`` as its source
states it, ``torch.distributions`` and exact enumeration over small vocabularies.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributions import Categorical, kl_divergence

import klpen
from klpen import (
    aggregate,
    compute_rlhf_objective,
    compute_token_kl,
    estimate_kl,
    get_logprobs_for_tokens,
    kl_penalized_reward,
    kl_penalty,
    masked_mean,
    masked_sum,
    shape_rewards,
)
from klpen.estimators import ESTIMATORS
from klpen.masking import AGGREGATION_MODES

F64 = torch.float64
POISON = [math.nan, math.inf, -math.inf, 1e30, -1e30]
MASK = torch.tensor([[1, 1, 1, 0, 0], [0, 1, 1, 1, 0], [1, 0, 0, 0, 0]], dtype=torch.bool)


def poisoned(clean: torch.Tensor, mask: torch.Tensor, value: float) -> torch.Tensor:
    """``clean`` with ``value`` written at every masked position, as a fresh leaf."""
    return torch.where(mask, clean, torch.full_like(clean, value)).requires_grad_(True)


def grads(fn: Callable[..., torch.Tensor], *inputs: torch.Tensor) -> list[torch.Tensor]:
    """Value of ``fn`` and the gradient of a weighted sum of it w.r.t. each input."""
    out = fn(*inputs)
    weights = torch.linspace(0.5, 1.5, out.numel(), dtype=out.dtype).reshape(out.shape)
    return [out.detach(), *torch.autograd.grad((out * weights).sum(), inputs)]


# ---------------------------------------------------------------- masked slots never leak

MASKING_FUNCTIONS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "masked_sum": lambda x, m: masked_sum(x, m),
    "masked_sum-dim": lambda x, m: masked_sum(x, m, dim=-1),
    "masked_mean": lambda x, m: masked_mean(x, m),
    "masked_mean-dim": lambda x, m: masked_mean(x, m, dim=1),
    **{
        f"aggregate-{mode}": (lambda x, m, mode=mode: aggregate(x, m, mode))
        for mode in AGGREGATION_MODES
    },
    "compute_token_kl-policy": lambda x, m: torch.cat(
        [t.flatten() for t in compute_token_kl(x, torch.full_like(x, -1.0), m)]
    ),
    "compute_token_kl-reference": lambda x, m: torch.cat(
        [t.flatten() for t in compute_token_kl(torch.full_like(x, -1.0), x, m)]
    ),
    "shape_rewards": lambda x, m: shape_rewards(torch.tensor([1.0, 2.0, 3.0]), x, m, 0.3),
    **{
        f"estimate_kl-{name}": (
            lambda x, m, name=name: estimate_kl(x, torch.full_like(x, -1.0), name, mask=m)
        )
        for name in ESTIMATORS
    },
    "estimate_kl-reference": lambda x, m: estimate_kl(torch.full_like(x, -1.0), x, "k3", mask=m),
    "estimate_kl-behavior": lambda x, m: estimate_kl(
        torch.full_like(x, -1.0), torch.full_like(x, -2.0), "k3", mask=m, behavior_logprobs=x
    ),
}


@pytest.mark.parametrize("name", MASKING_FUNCTIONS)
@pytest.mark.parametrize("bad", POISON)
def test_masked_slots_reach_neither_value_nor_gradient(name: str, bad: float) -> None:
    fn = MASKING_FUNCTIONS[name]
    gen = torch.Generator().manual_seed(0)
    clean = -torch.rand(MASK.shape, generator=gen) * 3
    reference_value, reference_grad = grads(lambda x: fn(x, MASK), poisoned(clean, MASK, -0.5))
    value, grad = grads(lambda x: fn(x, MASK), poisoned(clean, MASK, bad))
    assert torch.equal(value, reference_value)
    assert torch.isfinite(grad).all()
    assert (grad[~MASK] == 0).all()
    assert torch.equal(grad, reference_grad)


@pytest.mark.parametrize("estimator", list(ESTIMATORS))
@pytest.mark.parametrize("padding", ["logit-150", "logprob-100"])
def test_logprobs_estimate_masked_mean_chain_has_clean_gradients(
    estimator: str, padding: str
) -> None:
    # The intended chain with one extreme value at every padded position: k3 is +inf there
    # (exp(150) overflows fp32), which used to make the whole row's gradient NaN.
    b, t, v = 3, 5, 7
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(b, t, v, generator=gen)
    reference = torch.randn(b, t, v, generator=gen)
    tokens = torch.randint(0, v, (b, t), generator=gen)
    if padding == "logit-150":
        pad = torch.full((v,), 0.0)
        logits[~MASK] = pad
        logits[..., 0].masked_fill_(~MASK, -150.0)  # (torch 2.4 cannot index [~MASK, 0])
        tokens[~MASK] = 0
    logits.requires_grad_(True)
    lp = get_logprobs_for_tokens(logits, tokens)
    if padding == "logprob-100":  # -100 at the padded slots, gradient still flowing there
        lp = lp + torch.where(MASK, 0.0, -100.0 - lp.detach())
    with torch.no_grad():
        ref_lp = get_logprobs_for_tokens(reference, tokens)
    loss = masked_mean(estimate_kl(lp, ref_lp, estimator), MASK)
    assert torch.isfinite(loss)
    loss.backward()
    assert logits.grad is not None
    assert torch.isfinite(logits.grad).all()
    assert (logits.grad[~MASK] == 0).all()
    assert (logits.grad[MASK].abs().sum(-1) > 0).all() or estimator == "k1"


# ---------------------------------------------------------------- k3 in the loss, one AdamW step


@pytest.mark.parametrize("estimator", list(ESTIMATORS))
@pytest.mark.parametrize("log_ratio", [100.0, -100.0])
@pytest.mark.parametrize("clamp", [None, 10.0])
def test_one_adamw_step_at_extreme_log_ratios_never_makes_nan_parameters(
    estimator: str, log_ratio: float, clamp: float | None
) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 6)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randn(2, 3, 4)
    tokens = torch.randint(0, 6, (2, 3))
    lp = get_logprobs_for_tokens(model(x), tokens)
    ref_lp = lp.detach() - log_ratio  # r = ±100 at every (valid) position
    loss = estimate_kl(lp, ref_lp, estimator, clamp=clamp).mean()
    before = [p.detach().clone() for p in model.parameters()]
    # fp32: exp(100) overflows, so k3 is +inf and its derivative -inf at r = -100
    overflows = estimator == "k3" and log_ratio < 0 and clamp is None
    if overflows:
        assert loss.item() == math.inf
        with pytest.raises(ValueError, match=r"'k3'.*no finite gradient.*clamp="):
            loss.backward()
        assert all(p.grad is None for p in model.parameters())
    else:
        loss.backward()
        assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
        optimizer.step()
    after = list(model.parameters())
    assert all(torch.isfinite(p).all() for p in after)
    if overflows:
        assert all(torch.equal(p0, p1) for p0, p1 in zip(before, after, strict=True))


# ---------------------------------------------------------------- saturation, never NaN


def float64_value(name: str, r: torch.Tensor) -> torch.Tensor:
    base = name.rstrip("+")
    if base == "k1":
        return r
    if base == "k2":
        return r * r / 2
    if base == "abs":
        return r.abs()
    return torch.where(r < -700, math.inf, torch.exp(-r) + r - 1)


@pytest.mark.parametrize("estimator", list(ESTIMATORS))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_overflowing_log_ratios_saturate_to_signed_infinity(
    estimator: str, dtype: torch.dtype
) -> None:
    big = torch.finfo(dtype).max
    p = torch.tensor([big, -big, big / 2, -100.0, 100.0, 0.0], dtype=dtype)
    q = torch.tensor([-big, big, -big / 2, 0.0, 0.0, -0.0], dtype=dtype)
    got = estimate_kl(p, q, estimator)
    assert got.dtype == (torch.float32 if dtype != torch.float32 else dtype)
    assert not got.isnan().any()
    expected = float64_value(estimator, p.double() - q.double()).to(got.dtype)
    assert torch.equal(torch.isinf(got), torch.isinf(expected)), (got, expected)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=0)


@settings(max_examples=60)
@given(
    pairs=st.lists(
        st.tuples(
            st.floats(width=32, allow_nan=False, allow_infinity=False),
            st.floats(width=32, allow_nan=False, allow_infinity=False),
        ),
        min_size=1,
        max_size=6,
    ),
    estimator=st.sampled_from(list(ESTIMATORS)),
    clamp=st.sampled_from([None, 10.0, 0.5]),
)
def test_finite_input_never_gives_nan(
    pairs: list[tuple[float, float]], estimator: str, clamp: float | None
) -> None:
    p = torch.tensor([a for a, _ in pairs])
    q = torch.tensor([b for _, b in pairs])
    out = estimate_kl(p, q, estimator, clamp=clamp)
    assert not out.isnan().any()
    r = p.double() - q.double()
    if estimator.rstrip("+") in ("k2", "k3", "abs"):
        assert (out >= 0).all()
    else:  # k1 keeps the sign of r
        assert torch.equal(torch.sign(out), torch.sign(r).float())


def test_half_precision_log_ratios_are_formed_in_fp32() -> None:
    p = torch.tensor([-0.01171875], dtype=torch.bfloat16)
    q = torch.tensor([-9.0], dtype=torch.bfloat16)
    out = estimate_kl(p, q, "k1")
    assert out.dtype == torch.float32 and out.item() == 8.98828125  # bf16 arithmetic: 9.0
    per_token, per_seq = compute_token_kl(p[None], q[None], torch.ones(1, 1))
    assert per_token.dtype == torch.float32 and per_seq.item() == 8.98828125
    assert estimate_kl(p.double(), q.float(), "k3").dtype == F64


# ---------------------------------------------------------------- clamp: verl's semantics


def verl_kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, kind: str) -> torch.Tensor:
    """verl's ``kl_penalty`` (verl/trainer/ppo/core_algos.py), as its source states it."""
    if kind == "kl":
        return logprob - ref_logprob
    if kind == "abs":
        return (logprob - ref_logprob).abs()
    if kind == "mse":
        return 0.5 * (logprob - ref_logprob).square()
    assert kind == "low_var_kl"
    kl = ref_logprob - logprob
    kl = torch.clamp(kl, min=-20, max=20)
    ratio = torch.exp(kl)
    kld = ratio - kl - 1
    return torch.clamp(kld, min=-10, max=10)


def verl_straight_through(logprob: torch.Tensor, ref: torch.Tensor, kind: str) -> torch.Tensor:
    """verl's ``+`` forms: the value of ``kind``, the gradient of ``mse``."""
    forward = verl_kl_penalty(logprob, ref, kind)
    backward = verl_kl_penalty(logprob, ref, "mse")
    return backward - backward.detach() + forward.detach()


@pytest.mark.parametrize(
    ("klpen_name", "verl_name", "plus"),
    [
        ("k3", "low_var_kl", False),
        ("k3+", "low_var_kl", True),
        ("k1+", "kl", True),
        ("abs+", "abs", True),
        ("k2+", "mse", True),
    ],
)
def test_clamp_10_on_k3_is_verls_low_var_kl_value_and_gradient(
    klpen_name: str, verl_name: str, plus: bool
) -> None:
    gen = torch.Generator().manual_seed(2)
    lp = (torch.rand(400, generator=gen, dtype=F64) * -60).requires_grad_(True)
    ref = torch.rand(400, generator=gen, dtype=F64) * -60
    clamp = 10.0 if verl_name == "low_var_kl" else None
    ours = estimate_kl(lp, ref, klpen_name, clamp=clamp)
    theirs = (verl_straight_through if plus else verl_kl_penalty)(lp, ref, verl_name)
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)
    (g_ours,) = torch.autograd.grad(ours.sum(), lp)
    (g_theirs,) = torch.autograd.grad(theirs.sum(), lp)
    torch.testing.assert_close(g_ours, g_theirs, rtol=1e-12, atol=1e-12)
    if not plus:  # a binding clamp: zero gradient, as through torch.clamp
        binding = verl_kl_penalty(lp.detach(), ref, verl_name) >= 10
        assert binding.any() and (g_ours[binding] == 0).all()


@pytest.mark.parametrize("estimator", ["k1", "k2", "abs"])
def test_clamp_bounds_the_value_of_the_other_estimators(estimator: str) -> None:
    r = torch.tensor([-50.0, -3.0, -0.5, 0.0, 0.5, 3.0, 50.0], dtype=F64, requires_grad=True)
    out = estimate_kl(r, torch.zeros_like(r), estimator, clamp=2.0)
    expected = float64_value(estimator, r.detach()).clamp(-2.0, 2.0)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    (g,) = torch.autograd.grad(out.sum(), r)
    assert (g[expected.abs() == 2.0] == 0).all()


@pytest.mark.parametrize("bad", [0.0, -1.0, math.nan, math.inf, True, "10", 10**400])
def test_clamp_must_be_a_positive_finite_number(bad: object) -> None:
    with pytest.raises((TypeError, ValueError), match=r"^clamp must"):
        estimate_kl(torch.zeros(2), torch.zeros(2), "k3", clamp=bad)  # type: ignore[arg-type]


# ---------------------------------------------------------------- behavior_logprobs


def _enumerate(z: torch.Tensor, w: torch.Tensor, mu: torch.Tensor, *, detach: bool) -> tuple:
    """Σ_y μ(y) k(y) and its gradient w.r.t. the policy logits ``z``, μ held fixed."""
    z = z.clone().requires_grad_(True)
    lp, lq, lb = (torch.log_softmax(x, -1) for x in (z, w, mu))
    if detach:  # the biased alternative: a detached weight times the k3 estimate
        est = torch.exp(lp - lb).detach() * estimate_kl(lp, lq, "k3")
    else:
        est = estimate_kl(lp, lq, "k3", behavior_logprobs=lb)
    expectation = (lb.exp() * est).sum(-1)
    (g,) = torch.autograd.grad(expectation.sum(), z)
    return expectation.detach(), g


def test_behavior_weighted_k3_is_unbiased_in_value_and_gradient() -> None:
    gen = torch.Generator().manual_seed(3)
    z, w, mu = (torch.randn(6, 9, generator=gen, dtype=F64) for _ in range(3))
    value, grad = _enumerate(z, w, mu, detach=False)
    exact = kl_divergence(Categorical(logits=z), Categorical(logits=w))
    torch.testing.assert_close(value, exact, rtol=1e-12, atol=1e-12)
    zz = z.clone().requires_grad_(True)
    (exact_grad,) = torch.autograd.grad(
        kl_divergence(Categorical(logits=zz), Categorical(logits=w)).sum(), zz
    )
    torch.testing.assert_close(grad, exact_grad, rtol=1e-10, atol=1e-12)
    # a detached weight gives the right value but the wrong gradient
    value_d, grad_d = _enumerate(z, w, mu, detach=True)
    torch.testing.assert_close(value_d, exact, rtol=1e-12, atol=1e-12)
    assert not torch.allclose(grad_d, exact_grad, rtol=1e-3, atol=1e-6)


def test_behavior_equal_to_policy_gives_weight_one_values() -> None:
    lp = torch.tensor([-1.0, -2.0, -0.3])
    lr = torch.tensor([-1.5, -1.0, -0.3])
    for name in ESTIMATORS:
        plain = estimate_kl(lp, lr, name)
        weighted = estimate_kl(lp, lr, name, behavior_logprobs=lp.clone())
        torch.testing.assert_close(weighted, plain, rtol=0, atol=0)


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
def test_behavior_logprobs_must_be_finite_at_valid_positions(bad: float) -> None:
    lp = torch.full((2, 3), -1.0)
    b = torch.full((2, 3), -1.0)
    b[0, 1] = bad
    with pytest.raises(ValueError, match=r"behavior_logprobs .*(finite|NaN).*index \(0, 1\)"):
        estimate_kl(lp, lp, "k3", behavior_logprobs=b)
    mask = torch.ones(2, 3, dtype=torch.bool)
    mask[0, 1] = False
    out = estimate_kl(lp, lp - 1, "k3", behavior_logprobs=b, mask=mask)
    assert torch.isfinite(out).all() and out[0, 1] == 0


# ---------------------------------------------------------------- a zero coefficient is no penalty


def test_zero_coefficient_is_exactly_no_penalty_against_an_infinite_kl() -> None:
    # the reference cannot emit token 0, which the policy can: KL = +inf at that position
    policy = torch.zeros(2, 3, 4, requires_grad=True)
    reference = torch.zeros(2, 3, 4)
    reference[:, :, 0] = -math.inf
    reward = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    out = kl_penalized_reward(policy, reference, reward.requires_grad_(True), beta=0.0)
    assert torch.equal(out, reward)
    g_policy, g_reward = torch.autograd.grad(out.sum(), (policy, reward), allow_unused=True)
    assert g_policy is None and torch.equal(g_reward, torch.ones_like(reward))
    assert (kl_penalized_reward(policy, reference, reward, beta=0.1) == -math.inf).all()

    tokens = torch.zeros(2, 3, dtype=torch.long)
    rewards = torch.tensor([1.0, 3.0])
    result = compute_rlhf_objective(policy, reference, tokens, rewards, torch.ones(2, 3), 0.0)
    assert result["mean_kl"] == math.inf
    assert result["objective"].item() == 2.0  # type: ignore[union-attr]
    assert result["kl_penalty"] == 0.0 and result["mean_penalized_reward"] == 2.0
    (g,) = torch.autograd.grad(result["objective"], policy)  # type: ignore[arg-type]
    assert torch.equal(g, torch.zeros_like(g))

    kl = torch.tensor([[math.inf, 1.0], [2.0, -math.inf]])
    shaped = shape_rewards(rewards, kl, torch.ones(2, 2), kl_coef=0)
    assert torch.equal(shaped, torch.tensor([[0.0, 1.0], [0.0, 3.0]]))

    assert kl_penalty([1e308, -1e308], [-1e308, 1e308], 0.0) == 0.0


def test_kl_penalty_of_huge_log_probs_is_not_nan() -> None:
    assert kl_penalty([1e308, -1e308], [-1e308, 1e308], 1.0) == 0.0
    assert kl_penalty([1e308, 1e308], [-1e308, -1e308], 1.0) == math.inf
    assert kl_penalty([-1e308, -1e308], [1e308, 1e308], 0.5) == -math.inf
    with pytest.raises(ValueError, match=r"beta must fit a float"):
        kl_penalty([1.0], [1.0], 10**400)
    with pytest.raises(ValueError, match=r"logp_reference holds a number that does not fit"):
        kl_penalty([1.0], [10**400], 1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_a_coefficient_that_overflows_the_compute_dtype_is_refused(dtype: torch.dtype) -> None:
    logits = torch.zeros(2, 3, 4, dtype=dtype)
    reward = torch.zeros(2, 3, dtype=dtype)
    tokens = torch.zeros(2, 3, dtype=torch.long)
    match = r"must fit the compute dtype torch.float32"
    with pytest.raises(ValueError, match=rf"beta {match}"):
        kl_penalized_reward(logits, logits, reward, beta=1e39)
    with pytest.raises(ValueError, match=rf"kl_coef {match}"):
        shape_rewards(reward[:, 0], reward, torch.ones(2, 3), kl_coef=1e39)
    with pytest.raises(ValueError, match=rf"kl_coef {match}"):
        compute_rlhf_objective(logits, logits, tokens, reward[:, 0], torch.ones(2, 3), 1e39)
    # fine in float64, where 1e39 is an ordinary number
    out = shape_rewards(reward[:, 0].double(), reward.double(), torch.ones(2, 3), kl_coef=1e39)
    assert out.dtype == F64 and torch.equal(out, torch.zeros(2, 3, dtype=F64))
    with pytest.raises(ValueError, match=r"kl_coef must fit a float"):
        shape_rewards(reward[:, 0], reward, torch.ones(2, 3), kl_coef=10**400)


# ---------------------------------------------------------------- promoted dtypes


def test_kl_penalized_reward_does_not_round_the_kl_to_an_fp16_reward() -> None:
    policy = torch.tensor([[0.0, -1e4]])
    reference = torch.tensor([[-1e5, 0.0]])
    kl = klpen.full_kl(policy, reference)
    assert kl.item() == pytest.approx(1e5, rel=1e-4)
    out = kl_penalized_reward(policy, reference, torch.ones(1, dtype=torch.float16), beta=1e-3)
    assert out.dtype == torch.float32
    assert out.item() == pytest.approx(1 - 1e-3 * kl.item(), rel=1e-6)  # fp16 gives -inf


def test_objective_with_fp64_rewards_is_consistent_in_fp64() -> None:
    gen = torch.Generator().manual_seed(4)
    policy = torch.randn(3, 4, 6, generator=gen)
    reference = torch.randn(3, 4, 6, generator=gen)
    tokens = torch.randint(0, 6, (3, 4), generator=gen)
    rewards = torch.tensor([1e8 + 0.1, -3.3, 0.7], dtype=F64)
    out = compute_rlhf_objective(policy, reference, tokens, rewards, torch.ones(3, 4), 0.37)
    assert out["objective"].dtype == F64  # type: ignore[union-attr]
    expected = out["mean_reward"] - out["kl_penalty"]  # type: ignore[operator]
    assert out["mean_penalized_reward"] == pytest.approx(expected, rel=1e-15, abs=1e-9)


def test_shape_rewards_computes_half_precision_in_fp32() -> None:
    kl = torch.tensor([[1e-3, 2.0]], dtype=torch.bfloat16)
    out = shape_rewards(torch.tensor([300.0], dtype=torch.bfloat16), kl, torch.ones(1, 2), 0.1)
    assert out.dtype == torch.float32
    expected = torch.tensor([[-0.1 * kl[0, 0].item(), 300.0 - 0.2]])
    torch.testing.assert_close(out, expected, rtol=1e-7, atol=0)


def test_behavior_weighted_k3_saturates_to_its_limit_not_nan() -> None:
    # w = π/μ underflows to 0 while k3 overflows: w k3 = exp(log π_ref - log μ) + w (r - 1)
    p = torch.tensor([-1e30, -1e30, -200.0, 0.0], dtype=torch.float32)
    q = torch.tensor([-2.0, -2.0, -0.5, -300.0])
    b = torch.tensor([-1.0, -3.0, -0.7, -0.25])
    out = estimate_kl(p, q, "k3", behavior_logprobs=b)
    p64, q64, b64 = p.double(), q.double(), b.double()
    # float64, written so that nothing cancels: w e^{-r} = e^{q - b}
    expected = torch.exp(q64 - b64) + torch.exp(p64 - b64) * (p64 - q64 - 1)
    torch.testing.assert_close(out, expected.float(), rtol=1e-6, atol=0)
    assert out[0].item() == pytest.approx(math.exp(-1.0), rel=1e-6)
    for name in ("k1", "k2", "abs", "k1+", "k3+"):
        assert not estimate_kl(p, q, name, behavior_logprobs=b).isnan().any()


@pytest.mark.parametrize("bad", ["nan", "inf", "-inf-row", "1e30"])
@pytest.mark.parametrize("which", ["policy", "reference"])
def test_objective_ignores_anything_in_the_logits_at_masked_positions(bad: str, which: str) -> None:
    gen = torch.Generator().manual_seed(5)
    policy = torch.randn(3, 5, 7, generator=gen)
    reference = torch.randn(3, 5, 7, generator=gen)
    tokens = torch.randint(0, 7, (3, 5), generator=gen)
    rewards = torch.tensor([1.0, -2.0, 0.5])

    def run(p: torch.Tensor, q: torch.Tensor) -> tuple[dict[str, object], torch.Tensor]:
        p = p.clone().requires_grad_(True)
        out = compute_rlhf_objective(p, q, tokens, rewards, MASK, kl_coef=0.2)
        (g,) = torch.autograd.grad(out["objective"], p)  # type: ignore[arg-type]
        return out, g

    clean, clean_grad = run(policy, reference)
    target = policy if which == "policy" else reference
    dirty_logits = target.clone()
    value = {"nan": math.nan, "inf": math.inf, "-inf-row": -math.inf, "1e30": 1e30}[bad]
    if bad == "-inf-row":
        dirty_logits[~MASK] = value
    else:
        dirty_logits[..., 3].masked_fill_(~MASK, value)  # (torch 2.4 cannot index [~MASK, 3])
    args = (dirty_logits, reference) if which == "policy" else (policy, dirty_logits)
    dirty, dirty_grad = run(*args)
    for key in ("mean_kl", "mean_penalized_reward", "kl_penalty"):
        assert dirty[key] == pytest.approx(clean[key], rel=1e-6, abs=1e-7)
    torch.testing.assert_close(dirty["per_token_kl"], clean["per_token_kl"])
    assert torch.isfinite(dirty_grad).all() and (dirty_grad[~MASK] == 0).all()
    torch.testing.assert_close(dirty_grad, clean_grad)
    # the same value at a valid position is refused, naming the argument
    if bad != "1e30":
        poisoned_valid = target.clone()
        poisoned_valid[0, 0, 3] = value if bad != "-inf-row" else -math.inf
        if bad == "-inf-row":
            poisoned_valid[0, 0] = -math.inf
        args = (poisoned_valid, reference) if which == "policy" else (policy, poisoned_valid)
        with pytest.raises(ValueError, match=rf"^{which}_logits"):
            compute_rlhf_objective(*args, tokens, rewards, MASK, kl_coef=0.2)
