"""Issue 22, the rules in the core modules, table-driven (each row failed before the fix).

1. A temperature whose inverse overflows the compute dtype, or that is subnormal there, is
   refused naming ``temperature`` by every entry point (it was a bare RuntimeError in
   ``full_kl``, a ValueError blaming the logits, or accepted by the hidden-state functions).
2. Entropy gradients are finite (0) where a probability underflows, also when the factor
   beside it overflows (they were NaN).
6. ``linear_full_kl`` gives ``+inf`` for a ``-inf`` reference-bias entry where the policy has
   mass, as ``full_kl`` does on the same logits (it refused it as invalid).
12. ``calculate_kl_penalty`` refuses a ``beta`` beyond the compute dtype (it returned NaN).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import klpen

G = torch.Generator().manual_seed(0)


def _entry_points(dtype: torch.dtype) -> list[tuple[str, Callable[[float], object]]]:
    z = torch.randn(2, 3, 6, generator=G).to(dtype)
    w = torch.randn(2, 3, 6, generator=G).to(dtype)
    tokens = torch.randint(0, 6, (2, 3), generator=G)
    hidden = torch.randn(2, 3, 4, generator=G).to(dtype)
    weight = torch.randn(6, 4, generator=G).to(dtype)
    return [
        (
            "get_logprobs_for_tokens",
            lambda t: klpen.get_logprobs_for_tokens(z, tokens, temperature=t),
        ),
        ("next_token_logprobs", lambda t: klpen.next_token_logprobs(z, tokens, temperature=t)),
        ("token_entropy", lambda t: klpen.token_entropy(z, temperature=t)),
        ("logprobs_and_entropy", lambda t: klpen.logprobs_and_entropy(z, tokens, temperature=t)),
        ("full_kl", lambda t: klpen.full_kl(z, w, temperature=t)),
        ("linear_logprobs", lambda t: klpen.linear_logprobs(hidden, weight, tokens, temperature=t)),
        (
            "linear_full_kl",
            lambda t: klpen.linear_full_kl(hidden, weight, hidden, weight, temperature=t),
        ),
    ]


# (dtype, temperature): each refused in that compute dtype
BAD_TEMPERATURES = [
    (torch.float32, 1e-40),  # 1/T overflows fp32
    (torch.bfloat16, 1e-40),  # computed in fp32
    (torch.float32, 1e-38),  # subnormal in fp32
    (torch.float32, 1e39),  # T itself beyond fp32
    (torch.float64, 1e-310),  # subnormal in float64
    (torch.float64, 1e-320),
]


@pytest.mark.parametrize(("dtype", "temperature"), BAD_TEMPERATURES)
@pytest.mark.parametrize("which", range(7))
def test_temperatures_beyond_the_compute_dtype_are_refused_by_name(
    dtype: torch.dtype, temperature: float, which: int
) -> None:
    _, call = _entry_points(dtype)[which]
    with pytest.raises(ValueError, match=r"^temperature must be .*compute dtype torch.float"):
        call(temperature)


@pytest.mark.parametrize("which", range(7))
def test_extreme_but_representable_temperatures_are_accepted(which: int) -> None:
    _, call = _entry_points(torch.float64)[which]
    out = call(1e-38)  # normal in float64, 1/T = 1e38 finite: a one-hot distribution
    parts = out if isinstance(out, tuple) else (out,)
    assert all(not torch.isnan(p).any() for p in parts)


# (id, logits, temperature, dtype): finite entropy, finite gradient expected
ENTROPY_EDGES = [
    ("fp32-extremes", [[3e38, -3e38, 0.0]], 1.0, torch.float32),
    ("fp64-extremes", [[1e308, -1e308, 0.0]], 1.0, torch.float64),
    ("fp64-T=1e-38", [[1.0, 0.5, -2.0]], 1e-38, torch.float64),
    ("fp32-T=1e-4-logits-1e34", [[1e34, 0.0, -1e34]], 1e-4, torch.float32),
    ("fp32-T=1e-30", [[1.0, 0.999, -1.0]], 1e-30, torch.float32),
]


@pytest.mark.parametrize(
    ("logits", "temperature", "dtype"),
    [e[1:] for e in ENTROPY_EDGES],
    ids=[e[0] for e in ENTROPY_EDGES],
)
@pytest.mark.parametrize("form", ["token_entropy", "logprobs_and_entropy", "linear"])
def test_entropy_gradients_are_finite_where_the_entropy_is(
    logits: list[list[float]], temperature: float, dtype: torch.dtype, form: str
) -> None:
    z = torch.tensor(logits, dtype=dtype, requires_grad=True)
    if form == "token_entropy":
        ent = klpen.token_entropy(z, temperature=temperature)
        leaf = z
    elif form == "logprobs_and_entropy":
        ent = klpen.logprobs_and_entropy(z, torch.tensor([0]), temperature=temperature)[1]
        leaf = z
    else:  # the logits as a bias of a zero output layer: the same distribution
        hidden = torch.zeros(1, 2, dtype=dtype)
        weight = torch.zeros(z.shape[-1], 2, dtype=dtype)
        ent = klpen.linear_logprobs(
            hidden,
            weight,
            torch.tensor([0]),
            bias=z[0],
            temperature=temperature,
            return_entropy=True,
        )[1]
        leaf = z
    assert torch.isfinite(ent).all()
    (grad,) = torch.autograd.grad(ent.sum(), leaf)
    assert torch.isfinite(grad).all(), grad
    # the distribution is (numerically) one-hot or a near tie: the true gradient is ~0 or
    # that of a two-point entropy; in every row here the entropy is that of the top two
    p = torch.softmax(z.detach().double() / temperature, -1)
    ref = -torch.where(p > 0, p * p.log(), 0.0).sum(-1)
    torch.testing.assert_close(ent.double(), ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_minus_inf_reference_bias_gives_inf_as_full_kl_does(dtype: torch.dtype) -> None:
    x = torch.randn(3, 4, generator=G, dtype=dtype)
    w = torch.randn(5, 4, generator=G, dtype=dtype)
    ref_bias = torch.zeros(5, dtype=dtype)
    ref_bias[2] = -torch.inf
    logits = x @ w.T
    full = klpen.full_kl(logits, logits + ref_bias)
    fused = klpen.linear_full_kl(x, w, x, w, ref_bias=ref_bias)
    assert torch.isinf(full).all() and torch.equal(fused, full)
    # and on the policy side a -inf entry contributes 0, also in both
    bias = ref_bias.clone()
    fused = klpen.linear_full_kl(x, w, x, w, bias=bias, ref_bias=torch.zeros(5, dtype=dtype))
    torch.testing.assert_close(fused, klpen.full_kl(logits + bias, logits))


@pytest.mark.parametrize(("beta", "dtype"), [(1e39, torch.float32), (1e39, torch.bfloat16)])
def test_calculate_kl_penalty_refuses_an_overflowing_beta(beta: float, dtype: torch.dtype) -> None:
    rl = torch.randn(1, 2, 3, generator=G).log_softmax(-1).to(dtype)
    with pytest.raises(ValueError, match=r"beta must fit the compute dtype torch.float32"):
        klpen.calculate_kl_penalty(rl, rl, torch.tensor([[0, 1]]), beta)
    # in float64 the same beta fits, and equal inputs give an exact 0, not 0 * inf = NaN
    out = klpen.calculate_kl_penalty(rl.double(), rl.double(), torch.tensor([[0, 1]]), beta)
    assert torch.equal(out, torch.zeros(1, 2, dtype=torch.float64))
