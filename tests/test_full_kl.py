"""``full_kl`` and ``kl_penalized_reward`` against ``torch.distributions.kl_divergence``.

Values are compared with the Categorical KL of torch.distributions (float64); gradients with
``gradcheck`` in float64 and with autograd through the naive formula; the edge cases (``-inf``
logits, huge logits, half precision, empty batches, non-contiguous slices) with float64 sums.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.distributions import Categorical, kl_divergence

from klpen import full_kl, kl_penalized_reward

NEG_INF = float("-inf")


def logits_pair(
    seed: int,
    shape: tuple[int, ...],
    vocab: int,
    dtype: torch.dtype = torch.float32,
    scale: float = 2.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(*shape, vocab, generator=gen, dtype=torch.float64) * scale
    w = torch.randn(*shape, vocab, generator=gen, dtype=torch.float64) * scale
    return z.to(dtype), w.to(dtype)


def reference_kl(z: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """KL(softmax(z) ‖ softmax(w)) over the last axis by torch.distributions, in float64."""
    return kl_divergence(
        Categorical(logits=z.detach().double()), Categorical(logits=w.detach().double())
    )


def naive_kl(z: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The textbook formula, differentiable, materialising every (..., V) temporary."""
    log_p, log_q = torch.log_softmax(z, -1), torch.log_softmax(w, -1)
    return (log_p.exp() * (log_p - log_q)).sum(-1)


# ---------------------------------------------------------------- values


@given(
    seed=st.integers(0, 2**31 - 1),
    b=st.integers(1, 3),
    t=st.integers(1, 5),
    v=st.integers(1, 40),
    dtype=st.sampled_from([torch.float32, torch.float64]),
)
def test_matches_torch_distributions(seed: int, b: int, t: int, v: int, dtype: torch.dtype) -> None:
    z, w = logits_pair(seed, (b, t), v, dtype)
    out = full_kl(z, w)
    assert out.shape == (b, t) and out.dtype == dtype
    tol = 1e-10 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(out.double(), reference_kl(z, w), rtol=tol, atol=tol)


@pytest.mark.parametrize("shape", [(), (6,), (2, 3), (2, 2, 3)])
def test_any_leading_shape(shape: tuple[int, ...]) -> None:
    z, w = logits_pair(1, shape, 5)
    out = full_kl(z, w)
    assert out.shape == shape
    torch.testing.assert_close(out.double(), reference_kl(z, w), rtol=1e-5, atol=1e-6)


@given(seed=st.integers(0, 2**31 - 1), v=st.integers(1, 50), scale=st.floats(0.0, 30.0))
def test_nonnegative_and_zero_for_equal_logits(seed: int, v: int, scale: float) -> None:
    z, w = logits_pair(seed, (3, 4), v, scale=scale)
    assert (full_kl(z, w) >= 0).all()
    assert torch.equal(full_kl(z, z), torch.zeros(3, 4))


@given(seed=st.integers(0, 2**31 - 1), shift=st.floats(-1e3, 1e3, allow_nan=False))
def test_invariant_to_per_row_constants(seed: int, shift: float) -> None:
    z, w = logits_pair(seed, (2, 3), 8, torch.float64)
    gen = torch.Generator().manual_seed(seed ^ 0x5EED)
    cz = torch.randn(2, 3, 1, generator=gen, dtype=torch.float64) * shift
    cw = torch.randn(2, 3, 1, generator=gen, dtype=torch.float64) * shift
    torch.testing.assert_close(full_kl(z + cz, w + cw), full_kl(z, w), rtol=1e-8, atol=1e-9)


@given(
    seed=st.integers(0, 2**31 - 1),
    cz=st.floats(-1e3, 1e3, allow_nan=False),
    cw=st.floats(-1e3, 1e3, allow_nan=False),
)
def test_float32_rows_far_from_zero_match_float64(seed: int, cz: float, cw: float) -> None:
    # exp(z) of such rows overflows or underflows in fp32; the result must not notice.
    z, w = logits_pair(seed, (2, 3), 7)
    z, w = z + cz, w + cw
    # An fp32 log-sum-exp of logits near c is only known to within ~eps * |c|.
    atol = 1e-6 + 4 * torch.finfo(torch.float32).eps * (abs(cz) + abs(cw))
    torch.testing.assert_close(
        full_kl(z, w).double(), naive_kl(z.double(), w.double()), rtol=1e-5, atol=atol
    )


def test_many_blocks_and_a_large_vocabulary() -> None:
    z, w = logits_pair(2, (2, 70), 4096)
    torch.testing.assert_close(full_kl(z, w).double(), reference_kl(z, w), rtol=1e-4, atol=1e-5)


def test_both_inputs_non_contiguous_shifted_slices() -> None:
    z, w = logits_pair(3, (3, 9), 4096)
    zs, ws = z[:, :-1], w[:, :-1]
    assert not zs.is_contiguous() and not ws.is_contiguous()
    torch.testing.assert_close(full_kl(zs, ws).double(), reference_kl(zs, ws), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("which", ["policy", "reference"])
def test_one_input_non_contiguous(which: str) -> None:
    z, w = logits_pair(4, (2, 5), 5)
    big = torch.randn(2, 6, 5, generator=torch.Generator().manual_seed(5))
    if which == "policy":
        z = big[:, :-1]
    else:
        w = big[:, :-1]
    torch.testing.assert_close(full_kl(z, w).double(), reference_kl(z, w), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_is_computed_and_returned_in_float32(dtype: torch.dtype) -> None:
    z, w = logits_pair(6, (2, 5), 300, dtype)
    out = full_kl(z, w)
    assert out.dtype == torch.float32
    torch.testing.assert_close(
        out.double(), reference_kl(z.float(), w.float()), rtol=1e-4, atol=1e-5
    )


def test_mixed_precision_promotes() -> None:
    z, w = logits_pair(7, (2,), 4)
    out = full_kl(z, w.double())
    assert out.dtype == torch.float64


def test_empty_batch() -> None:
    z = torch.zeros(0, 3, 5, requires_grad=True)
    out = full_kl(z, torch.zeros(0, 3, 5))
    assert out.shape == (0, 3)
    out.sum().backward()
    assert z.grad is not None and z.grad.shape == (0, 3, 5)


@pytest.mark.parametrize("scale", [40.0, 100.0, 1e4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_large_and_huge_logits_stay_finite_and_exact(scale: float, dtype: torch.dtype) -> None:
    # exp() of such logits overflows: only a max-shifted (or equivalent) evaluation survives.
    z, w = logits_pair(8, (4, 3), 6, dtype, scale=scale)
    z[0, 0, 0] = 0.9 * torch.finfo(dtype).max  # a single logit near the top of the range
    out = full_kl(z, w)
    assert torch.isfinite(out).all()
    # naive float64 formula: torch.distributions returns inf here (its probs underflow to 0)
    expected = naive_kl(z.double(), w.double())
    rtol = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(out.double(), expected, rtol=rtol, atol=rtol * scale)


# ---------------------------------------------------------------- -inf logits


def test_minus_inf_policy_logit_contributes_zero() -> None:
    z = torch.tensor([[1.0, NEG_INF, 0.5, -2.0]], dtype=torch.float64)
    w = torch.tensor([[0.3, 1.2, -0.4, 0.0]], dtype=torch.float64)
    # the sum over the policy's support only, in float64
    log_q = w - torch.logsumexp(w, -1, keepdim=True)
    support = torch.tensor([0, 2, 3])
    log_p = z[0, support] - torch.logsumexp(z[0, support], -1)
    expected = (log_p.exp() * (log_p - log_q[0, support])).sum()
    out = full_kl(z, w)
    assert torch.isfinite(out).all()
    assert out.item() == pytest.approx(expected.item(), rel=1e-12)


def test_minus_inf_in_both_at_the_same_token_contributes_zero() -> None:
    z = torch.tensor([[1.0, NEG_INF, 0.5]])
    w = torch.tensor([[0.0, NEG_INF, 0.25]])
    expected = reference_kl(z[:, [0, 2]], w[:, [0, 2]])
    torch.testing.assert_close(full_kl(z, w).double(), expected, rtol=1e-6, atol=1e-7)


def test_minus_inf_reference_logit_where_policy_has_mass_gives_plus_inf() -> None:
    z = torch.tensor([[1.0, 0.0, 0.5], [1.0, 0.0, 0.5]])
    w = torch.tensor([[0.0, NEG_INF, 0.25], [0.0, 0.1, 0.25]])
    out = full_kl(z, w)
    assert out[0].item() == math.inf
    assert math.isfinite(out[1].item())


def test_gradient_with_minus_inf_policy_logits_is_finite_and_zero_there() -> None:
    z = torch.tensor([[1.0, NEG_INF, 0.5, -2.0], [0.1, 0.2, NEG_INF, NEG_INF]])
    z.requires_grad_(True)
    w = torch.randn(2, 4, generator=torch.Generator().manual_seed(9))
    full_kl(z, w).sum().backward()
    assert z.grad is not None and torch.isfinite(z.grad).all()
    assert z.grad[0, 1] == 0 and (z.grad[1, 2:] == 0).all()
    # on the support, the gradient of the KL of the restricted distributions
    zs = torch.tensor([1.0, 0.5, -2.0], requires_grad=True)
    naive_kl(zs, w[0, [0, 2, 3]]).backward()
    assert zs.grad is not None
    torch.testing.assert_close(z.grad[0, [0, 2, 3]], zs.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("z_row", "w_row"),
    [
        ([0.0, 0.0, 0.0], [float("nan"), 0.0, 0.0]),
        ([0.0, 0.0, 0.0], [float("inf"), 0.0, 0.0]),
        ([0.0, 0.0, 0.0], [NEG_INF, NEG_INF, NEG_INF]),
    ],
    ids=["nan-reference", "plus-inf-reference", "all-minus-inf-reference"],
)
def test_invalid_reference_logits_raise(z_row: list[float], w_row: list[float]) -> None:
    with pytest.raises(ValueError, match="logits"):
        full_kl(torch.tensor([z_row]), torch.tensor([w_row]))


@pytest.mark.parametrize(
    "z_row",
    [[float("nan"), 0.0, 0.0], [float("inf"), 0.0, 0.0], [NEG_INF, NEG_INF, NEG_INF]],
    ids=["nan-policy", "plus-inf-policy", "all-minus-inf-policy"],
)
def test_invalid_policy_logits_raise(z_row: list[float]) -> None:
    with pytest.raises(ValueError, match="logits"):
        full_kl(torch.tensor([z_row]), torch.zeros(1, 3))


# ---------------------------------------------------------------- gradients


def test_gradcheck_float64_both_inputs() -> None:
    z, w = logits_pair(10, (2, 3), 5, torch.float64)
    z.requires_grad_(True)
    w.requires_grad_(True)
    assert torch.autograd.gradcheck(full_kl, (z, w))


def test_gradcheck_float64_non_contiguous() -> None:
    z, w = logits_pair(11, (2, 4), 5, torch.float64)
    z.requires_grad_(True)
    w.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda a, b: full_kl(a[:, 1:], b[:, 1:]), (z, w))


@pytest.mark.parametrize("vocab", [3, 4096])
def test_gradient_equals_autograd_through_the_naive_formula(vocab: int) -> None:
    z, w = logits_pair(12, (2, 40), vocab)
    weights = torch.randn(2, 40, generator=torch.Generator().manual_seed(13))
    z1, w1 = z.clone().requires_grad_(True), w.clone().requires_grad_(True)
    (full_kl(z1, w1) * weights).sum().backward()
    z2, w2 = z.clone().requires_grad_(True), w.clone().requires_grad_(True)
    (naive_kl(z2, w2) * weights).sum().backward()
    assert z1.grad is not None and z2.grad is not None
    assert w1.grad is not None and w2.grad is not None
    torch.testing.assert_close(z1.grad, z2.grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(w1.grad, w2.grad, rtol=1e-4, atol=1e-6)


def test_only_the_policy_gets_a_gradient_when_only_it_requires_one() -> None:
    z, w = logits_pair(14, (2, 3), 4)
    z.requires_grad_(True)
    full_kl(z, w).sum().backward()
    assert z.grad is not None and w.grad is None


# ---------------------------------------------------------------- kl_penalized_reward


def test_kl_penalized_reward_contract_example() -> None:
    logits = torch.tensor([[[2.0, 0.0, 0.0]]])
    out = kl_penalized_reward(logits, logits, torch.tensor([[1.0]]))
    assert torch.equal(out, torch.tensor([[1.0]]))


@given(seed=st.integers(0, 2**31 - 1), beta=st.floats(0.0, 2.0, allow_nan=False))
def test_kl_penalized_reward_formula(seed: int, beta: float) -> None:
    z, w = logits_pair(seed, (3, 4), 6, torch.float64)
    reward = torch.randn(3, 4, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    out = kl_penalized_reward(z, w, reward, beta)
    torch.testing.assert_close(out, reward - beta * reference_kl(z, w), rtol=1e-10, atol=1e-10)


def test_kl_penalized_reward_default_beta_and_dtype_and_grads() -> None:
    z, w = logits_pair(15, (2, 3), 5)
    z.requires_grad_(True)
    reward = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    out = kl_penalized_reward(z, w, reward)
    assert out.shape == (2, 3) and out.dtype == torch.float64
    expected = reward.detach() - 0.1 * reference_kl(z, w)
    torch.testing.assert_close(out.detach(), expected, rtol=1e-6, atol=1e-6)
    out.sum().backward()
    assert z.grad is not None and reward.grad is not None
    assert torch.equal(reward.grad, torch.ones(2, 3, dtype=torch.float64))


# ---------------------------------------------------------------- memory: what backward keeps


def test_backward_keeps_the_logits_and_per_row_numbers_only() -> None:
    # The naive formula saves log_softmax of both inputs and their exp: three (B, T, V)
    # tensors more. full_kl keeps the inputs themselves (no copy) and O(B*T) numbers.
    z, w = logits_pair(16, (4, 8), 1000)
    z.requires_grad_(True)
    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        full_kl(z, w)
    inputs = {z.untyped_storage().data_ptr(), w.untyped_storage().data_ptr()}
    extra = [t for t in saved if t.untyped_storage().data_ptr() not in inputs]
    rows = z.numel() // z.shape[-1]
    assert sum(t.numel() for t in extra) <= 6 * rows, [t.shape for t in extra]
