"""Exactness at any shift, temperature, entropy, the next-token shift and second derivatives.

References are independent of klpen: float64 ``torch.distributions`` (KL, entropy), float64
``log_softmax``, float64 autograd through the textbook formulas and ``gradcheck``. The fp32
inputs are rounded once, then both klpen and the reference see the same numbers: every error
measured is klpen's arithmetic, not the input's rounding.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor
from torch.distributions import Categorical, kl_divergence

from klpen import (
    full_kl,
    get_logprobs_for_tokens,
    logprobs_and_entropy,
    next_token_logprobs,
    token_entropy,
)

SHIFTS = [0.0, 60.0, -60.0, 85.0, -85.0, 1e3, -1e3, 1e4, -1e4]
NEG_INF = float("-inf")


def ref_kl(z: Tensor, w: Tensor, temperature: float = 1.0) -> Tensor:
    """KL(softmax(z/T) ‖ softmax(w/T)) by torch.distributions, in float64."""
    return kl_divergence(
        Categorical(logits=z.detach().double() / temperature),
        Categorical(logits=w.detach().double() / temperature),
    )


def ref_logprobs(z: Tensor, tokens: Tensor, temperature: float = 1.0) -> Tensor:
    logp = torch.log_softmax(z.detach().double() / temperature, dim=-1)
    return logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def naive_kl(z: Tensor, w: Tensor) -> Tensor:
    log_p, log_q = torch.log_softmax(z, -1), torch.log_softmax(w, -1)
    return (log_p.exp() * (log_p - log_q)).sum(-1)


def near_pair(seed: int, rows: int, vocab: int, kl: float, shift: float) -> tuple[Tensor, Tensor]:
    """fp32 logits ``z + shift`` and ``w + shift`` with ``KL(z ‖ w)`` about ``kl``."""
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(rows, vocab, generator=gen, dtype=torch.float64) * 2
    direction = torch.randn(rows, vocab, generator=gen, dtype=torch.float64)
    w = z + math.sqrt(2 * kl) / direction.std() * direction
    return (z + shift).float(), (w + shift).float()


def assert_kl_exact(got: Tensor, want: Tensor) -> None:
    """Relative error <= 1e-4 where the KL is >= 1e-7, absolute <= 1e-10 below (contract 3)."""
    got, want = got.double(), want.double()
    assert (got >= 0).all()
    big = want >= 1e-7
    rel = ((got - want).abs() / want.clamp(min=1e-300))[big]
    assert rel.numel() == 0 or rel.max() <= 1e-4, rel.max()
    assert ((got - want).abs()[~big] <= 1e-10).all()


# ---------------------------------------------------------------- full_kl: exact in fp32


@pytest.mark.parametrize("shift", SHIFTS)
@pytest.mark.parametrize("vocab", [2, 32000])
@pytest.mark.parametrize("kl", [1e-7, 1e-6, 1e-5, 1e-3, 0.3])
def test_full_kl_is_exact_at_any_common_shift(shift: float, vocab: int, kl: float) -> None:
    z, w = near_pair(int(abs(shift)) + vocab, 4 if vocab == 2 else 2, vocab, kl, shift)
    assert_kl_exact(full_kl(z, w), ref_kl(z, w))


@pytest.mark.parametrize("offset", [5.0, 57.0, -80.0])
@pytest.mark.parametrize("noise", [3e-2, 3e-3, 1e-3])
def test_full_kl_is_exact_when_the_reference_is_offset_from_the_policy(
    offset: float, noise: float
) -> None:
    # w = z + offset + small: softmax ignores the offset, but w - z rounds by eps·|offset|;
    # before the error estimate counted that, offset 57 at a KL of 4e-6 was 2.3e-4 off
    gen = torch.Generator().manual_seed(17)
    z = torch.randn(64, 2000, generator=gen) * 3
    small = noise * torch.randn(64, 2000, generator=gen, dtype=torch.float64)
    w = (z.double() + offset + small).float()
    assert_kl_exact(full_kl(z, w), ref_kl(z, w))


def test_full_kl_issue_example_small_kl_between_shifted_logits() -> None:
    # the issue's case: true KL 1.25e-5, up to 39 % wrong at shifts of 60-85 before the fix
    z, w = torch.tensor([[0.0, 0.0]]), torch.tensor([[0.0, 0.01]])
    for shift in torch.arange(60.0, 86.0, 0.5):
        assert_kl_exact(full_kl(z + shift, w + shift), ref_kl(z + shift, w + shift))


@pytest.mark.parametrize("shift", SHIFTS)
@pytest.mark.parametrize("vocab", [2, 32000])
def test_full_kl_of_identical_rows_is_exactly_zero(shift: float, vocab: int) -> None:
    z = near_pair(7, 3, vocab, 1.0, shift)[0]
    assert (full_kl(z, z.clone()) == 0).all()
    assert (full_kl(z, z.clone(), temperature=0.7) == 0).all()


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    vocab=st.integers(2, 64),
    shift=st.floats(-1e4, 1e4),
    log_kl=st.floats(-9.0, 1.0),
)
def test_full_kl_is_never_negative_and_exact(
    seed: int, vocab: int, shift: float, log_kl: float
) -> None:
    z, w = near_pair(seed, 3, vocab, 10.0**log_kl, shift)
    assert_kl_exact(full_kl(z, w), ref_kl(z, w))


@pytest.mark.parametrize("shift", [0.0, 85.0, -1e3, 1e4])
@pytest.mark.parametrize("kl", [1e-6, 1e-3, 0.3])
def test_full_kl_gradient_matches_float64_autograd_at_any_shift(shift: float, kl: float) -> None:
    z, w = near_pair(3, 4, 500, kl, shift)
    x = z.clone().requires_grad_()
    weights = torch.linspace(-1.0, 2.0, 4)
    (full_kl(x, w) * weights).sum().backward()
    x64 = z.double().requires_grad_()
    (naive_kl(x64 - shift, w.double() - shift) * weights.double()).sum().backward()
    assert x.grad is not None and x64.grad is not None
    scale = x64.grad.abs().max().item()
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=1e-4, atol=1e-4 * scale)


# ---------------------------------------------------------------- log-probs at any shift


@pytest.mark.parametrize("shift", SHIFTS)
def test_logprobs_keep_log_softmax_accuracy_at_any_shift(shift: float) -> None:
    gen = torch.Generator().manual_seed(5)
    z = (torch.randn(64, 1000, generator=gen) * 3 + shift).float()
    tokens = torch.randint(0, 1000, (64,), generator=gen)
    want = ref_logprobs(z, tokens)
    err = (get_logprobs_for_tokens(z, tokens).double() - want).abs().max().item()
    torch_err = (ref_logprobs(z.log_softmax(-1), tokens) - want).abs().max().item()
    # before the fix: 4.6e-4 at a shift of 1e4, against log_softmax's 1.9e-7
    assert err <= 2 * torch_err + 2e-7, (err, torch_err)


def test_logprob_gradient_matches_float64_at_a_large_shift() -> None:
    gen = torch.Generator().manual_seed(6)
    z = (torch.randn(8, 300, generator=gen) + 1e4).float()
    tokens = torch.randint(0, 300, (8,), generator=gen)
    x = z.clone().requires_grad_()
    get_logprobs_for_tokens(x, tokens).sum().backward()
    x64 = z.double().requires_grad_()
    torch.log_softmax(x64, -1).gather(-1, tokens[:, None]).sum().backward()
    assert x.grad is not None and x64.grad is not None
    # exp(z - lse) with a rounded lse would be off by 1e-3 relative here
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=1e-5, atol=1e-7)


# ---------------------------------------------------------------- temperature


@pytest.mark.parametrize("temperature", [0.3, 0.7, 1.0, 1.5])
def test_logprobs_and_full_kl_at_a_temperature(temperature: float) -> None:
    gen = torch.Generator().manual_seed(8)
    z = torch.randn(2, 5, 40, generator=gen) * 3
    w = z + torch.randn(2, 5, 40, generator=gen)
    tokens = torch.randint(0, 40, (2, 5), generator=gen)
    got = get_logprobs_for_tokens(z, tokens, temperature=temperature)
    torch.testing.assert_close(got.double(), ref_logprobs(z, tokens, temperature))
    kl = full_kl(z, w, temperature=temperature)
    torch.testing.assert_close(kl.double(), ref_kl(z, w, temperature), rtol=1e-5, atol=1e-7)
    ent = token_entropy(z, temperature=temperature)
    want = Categorical(logits=z.double() / temperature).entropy()
    torch.testing.assert_close(ent.double(), want, rtol=1e-5, atol=1e-6)


def test_temperature_one_is_the_default() -> None:
    gen = torch.Generator().manual_seed(9)
    z, w = torch.randn(3, 30, generator=gen), torch.randn(3, 30, generator=gen)
    tokens = torch.randint(0, 30, (3,), generator=gen)
    assert torch.equal(
        get_logprobs_for_tokens(z, tokens), get_logprobs_for_tokens(z, tokens, temperature=1.0)
    )
    assert torch.equal(full_kl(z, w), full_kl(z, w, temperature=1.0))


def test_temperature_is_not_dividing_the_logits_first() -> None:
    # z / T would round a logit of 1e4 by 5e-4; (z - c) / T does not
    z = torch.tensor([[1e4, 1e4 - 1.0, 1e4 - 3.0]])
    tokens = torch.tensor([1])
    got = get_logprobs_for_tokens(z, tokens, temperature=0.7)
    want = ref_logprobs(z - 1e4, tokens, 0.7)
    assert (got.double() - want).abs().max() <= 1e-6


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_gradcheck_with_temperature(temperature: float) -> None:
    gen = torch.Generator().manual_seed(10)
    z = torch.randn(2, 3, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(2, 3, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    tokens = torch.randint(0, 6, (2, 3), generator=gen)
    t = temperature
    assert torch.autograd.gradcheck(
        lambda x: get_logprobs_for_tokens(x, tokens, temperature=t), (z,)
    )
    assert torch.autograd.gradcheck(lambda x, y: full_kl(x, y, temperature=t), (z, w))
    assert torch.autograd.gradcheck(lambda x: token_entropy(x, temperature=t), (z,))
    assert torch.autograd.gradcheck(lambda x: logprobs_and_entropy(x, tokens, temperature=t), (z,))


# ---------------------------------------------------------------- entropy


@given(seed=st.integers(0, 2**31 - 1), vocab=st.integers(1, 50), scale=st.floats(0.1, 30.0))
@settings(deadline=None)
def test_entropy_matches_torch_distributions(seed: int, vocab: int, scale: float) -> None:
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(3, 4, vocab, generator=gen, dtype=torch.float64) * scale
    want = Categorical(logits=z).entropy()
    torch.testing.assert_close(token_entropy(z), want, rtol=1e-9, atol=1e-12)
    got32 = token_entropy(z.float()).double()
    torch.testing.assert_close(
        got32, Categorical(logits=z.float().double()).entropy(), rtol=1e-5, atol=2e-6
    )


@pytest.mark.parametrize("shift", [0.0, 85.0, -1e3, 1e4])
def test_entropy_at_a_shift_and_with_minus_inf(shift: float) -> None:
    gen = torch.Generator().manual_seed(11)
    z = torch.randn(6, 100, generator=gen) * 2 + shift
    z[0, :50] = NEG_INF
    z[1, 1:] = NEG_INF  # a certain token: entropy exactly 0
    got = token_entropy(z)
    want = Categorical(logits=(z.double() - shift)).entropy()
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    assert got[1] == 0.0
    x = z.clone().requires_grad_()
    token_entropy(x).sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    assert (x.grad[0, :50] == 0).all()


def test_logprobs_and_entropy_equal_the_separate_calls_in_value_and_gradient() -> None:
    gen = torch.Generator().manual_seed(12)
    z = torch.randn(3, 7, 90, generator=gen) * 2
    tokens = torch.randint(0, 90, (3, 7), generator=gen)
    a, b = torch.randn(3, 7, generator=gen), torch.randn(3, 7, generator=gen)
    x1, x2 = z.clone().requires_grad_(), z.clone().requires_grad_()
    logp, ent = logprobs_and_entropy(x1, tokens, temperature=0.8)
    ((logp * a).sum() + (ent * b).sum()).backward()
    logp2 = get_logprobs_for_tokens(x2, tokens, temperature=0.8)
    ent2 = token_entropy(x2, temperature=0.8)
    ((logp2 * a).sum() + (ent2 * b).sum()).backward()
    torch.testing.assert_close(logp, logp2)
    torch.testing.assert_close(ent, ent2)
    assert x1.grad is not None and x2.grad is not None
    torch.testing.assert_close(x1.grad, x2.grad, rtol=1e-5, atol=1e-6)
    # one output alone also differentiates
    x3 = z.clone().requires_grad_()
    logprobs_and_entropy(x3, tokens)[1].sum().backward()
    assert x3.grad is not None and torch.isfinite(x3.grad).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_entropy_of_half_precision_is_computed_in_fp32(dtype: torch.dtype) -> None:
    z = (torch.randn(4, 300, generator=torch.Generator().manual_seed(13)) * 3).to(dtype)
    ent = token_entropy(z)
    assert ent.dtype == torch.float32
    torch.testing.assert_close(
        ent.double(), Categorical(logits=z.double()).entropy(), rtol=1e-5, atol=1e-5
    )


# ---------------------------------------------------------------- next-token shift


def test_next_token_logprobs_is_the_shift_done_right() -> None:
    gen = torch.Generator().manual_seed(14)
    logits = torch.randn(2, 6, 30, generator=gen)
    ids = torch.randint(0, 30, (2, 6), generator=gen)
    got = next_token_logprobs(logits, ids, temperature=0.9)
    assert got.shape == (2, 5)
    want = torch.stack([ref_logprobs(logits[:, t], ids[:, t + 1], 0.9) for t in range(5)], dim=1)
    torch.testing.assert_close(got.double(), want)
    x = logits.clone().requires_grad_()
    next_token_logprobs(x, ids).sum().backward()
    assert x.grad is not None and (x.grad[:, -1] == 0).all() and (x.grad[:, :-1] != 0).any()


def test_next_token_logprobs_of_a_single_position_is_empty() -> None:
    assert next_token_logprobs(torch.zeros(2, 1, 4), torch.zeros(2, 1, dtype=torch.long)).shape == (
        2,
        0,
    )


# ---------------------------------------------------------------- second derivatives


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "name",
    [
        "get_logprobs_for_tokens",
        "full_kl",
        "token_entropy",
        "logprobs_and_entropy",
        "next_token_logprobs",
    ],
)
def test_second_derivative_raises_a_clear_error(name: str, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(15)
    z = torch.randn(2, 3, 8, generator=gen).to(dtype).requires_grad_()
    w = torch.randn(2, 3, 8, generator=gen).to(dtype)
    tokens = torch.randint(0, 8, (2, 3), generator=gen)
    calls = {
        "get_logprobs_for_tokens": lambda: get_logprobs_for_tokens(z, tokens),
        "full_kl": lambda: full_kl(z, w),
        "token_entropy": lambda: token_entropy(z),
        "logprobs_and_entropy": lambda: sum(logprobs_and_entropy(z, tokens)),
        "next_token_logprobs": lambda: next_token_logprobs(z, tokens),
    }
    out = calls[name]()
    (grad,) = torch.autograd.grad(out.sum(), z, create_graph=True)
    # the first derivative under create_graph=True is the ordinary one
    (plain,) = torch.autograd.grad(calls[name]().sum(), z)
    torch.testing.assert_close(grad, plain)
    with pytest.raises(RuntimeError, match=rf"klpen's {name} has no second derivative"):
        grad.pow(2).sum().backward()
