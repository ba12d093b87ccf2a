"""Every differentiable public function: the right second derivative, or a refusal by name.

Contract section 3: "A second derivative that is not supported raises a clear error saying
so." For each function, the Hessian-vector product of a scalar loss is taken by double
backward (``create_graph=True``). Functions built on klpen's kernels must raise a
``RuntimeError`` naming the public function (or the klpen function it is built on); functions
made of differentiable torch ops must give the Hessian-vector product of an unfused float64
reference written here with torch's own ops.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import Tensor

import klpen

G = torch.Generator().manual_seed(0)
B, T, V, H = 2, 4, 7, 5
LOGITS = torch.randn(B, T, V, generator=G, dtype=torch.float64)
REF = torch.randn(B, T, V, generator=G, dtype=torch.float64)
TOKENS = torch.randint(0, V, (B, T), generator=G)
MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]], dtype=torch.bool)
LOGP = -torch.rand(B, T, generator=G, dtype=torch.float64) - 0.1
REF_LOGP = -torch.rand(B, T, generator=G, dtype=torch.float64) - 0.1
HIDDEN = torch.randn(B, T, H, generator=G, dtype=torch.float64)
WEIGHT = torch.randn(V, H, generator=G, dtype=torch.float64)
SCORES = torch.randn(B, generator=G, dtype=torch.float64)
WEIGHTS = torch.randn(B, T, generator=G, dtype=torch.float64)  # a fixed weighting of outputs


def _gather(logits: Tensor) -> Tensor:
    return logits.log_softmax(-1).gather(-1, TOKENS[..., None])[..., 0]


def _k3(r: Tensor) -> Tensor:
    return torch.exp(-r) + r - 1


Loss = Callable[[Tensor], Tensor]

# (id, input, klpen's loss, reference loss or None, the names a refusal may give)
ROWS: list[tuple[str, Tensor, Loss, Loss | None, tuple[str, ...]]] = [
    (
        "get_logprobs_for_tokens",
        LOGITS,
        lambda x: (klpen.get_logprobs_for_tokens(x, TOKENS) * WEIGHTS).sum(),
        None,
        ("get_logprobs_for_tokens",),
    ),
    (
        "next_token_logprobs",
        LOGITS,
        lambda x: klpen.next_token_logprobs(x, TOKENS).sum(),
        None,
        ("next_token_logprobs",),
    ),
    (
        "token_entropy",
        LOGITS,
        lambda x: (klpen.token_entropy(x) * WEIGHTS).sum(),
        None,
        ("token_entropy",),
    ),
    (
        "logprobs_and_entropy",
        LOGITS,
        lambda x: sum(o.sum() for o in klpen.logprobs_and_entropy(x, TOKENS)),
        None,
        ("logprobs_and_entropy",),
    ),
    ("full_kl", LOGITS, lambda x: (klpen.full_kl(x, REF) * WEIGHTS).sum(), None, ("full_kl",)),
    (
        "kl_penalized_reward",
        LOGITS,
        lambda x: klpen.kl_penalized_reward(x, REF, WEIGHTS, beta=0.3).sum(),
        None,
        ("kl_penalized_reward",),
    ),
    (
        "linear_logprobs-hidden",
        HIDDEN,
        lambda x: klpen.linear_logprobs(x, WEIGHT, TOKENS).sum(),
        None,
        ("linear_logprobs",),
    ),
    (
        "linear_logprobs-weight",
        WEIGHT,
        lambda x: klpen.linear_logprobs(HIDDEN, x, TOKENS, return_entropy=True)[1].sum(),
        None,
        ("linear_logprobs",),
    ),
    (
        "linear_full_kl",
        HIDDEN,
        lambda x: klpen.linear_full_kl(x, WEIGHT, HIDDEN, WEIGHT * 0.5).sum(),
        None,
        ("linear_full_kl",),
    ),
    (
        "compute_rlhf_objective",
        LOGITS,
        lambda x: klpen.compute_rlhf_objective(x, REF, TOKENS, SCORES, MASK, 0.2)["objective"],
        None,
        ("compute_rlhf_objective", "get_logprobs_for_tokens"),
    ),
    (
        "sampler_logprobs",
        LOGITS,
        lambda x: (
            klpen.sampler_logprobs(x, TOKENS, temperature=0.9, top_k=5)[0]
            .masked_fill(~MASK, 0.0)
            .clamp(min=-30)
            .sum()
        ),
        None,
        ("sampler_logprobs",),
    ),
    # made of differentiable torch ops: the true second derivative
    (
        "calculate_kl_penalty",
        LOGITS.log_softmax(-1),
        lambda x: (klpen.calculate_kl_penalty(x, REF.log_softmax(-1), TOKENS, 0.5) ** 2).sum(),
        lambda x: (
            (
                0.5
                * (
                    x.gather(-1, TOKENS[..., None])
                    - REF.log_softmax(-1).gather(-1, TOKENS[..., None])
                )
            )
            ** 2
        ).sum(),
        (),
    ),
    (
        "estimate_kl-k3",
        LOGP,
        lambda x: (klpen.estimate_kl(x, REF_LOGP, "k3") * WEIGHTS).sum(),
        lambda x: (_k3(x - REF_LOGP) * WEIGHTS).sum(),
        (),
    ),
    (
        "estimate_kl-k2",
        LOGP,
        lambda x: (klpen.estimate_kl(x, REF_LOGP, "k2") ** 2).sum(),
        lambda x: (((x - REF_LOGP) ** 2 / 2) ** 2).sum(),
        (),
    ),
    (
        "compute_token_kl",
        LOGP,
        lambda x: (klpen.compute_token_kl(x, REF_LOGP, MASK)[1] ** 2).sum(),
        lambda x: (((x - REF_LOGP) * MASK).sum(-1) ** 2).sum(),
        (),
    ),
    ("masked_sum", LOGP, lambda x: klpen.masked_sum(x**3, MASK), lambda x: (x**3 * MASK).sum(), ()),
    (
        "masked_mean",
        LOGP,
        lambda x: (klpen.masked_mean(x, MASK, dim=-1) ** 2).sum(),
        lambda x: (((x * MASK).sum(-1) / MASK.sum(-1)) ** 2).sum(),
        (),
    ),
    (
        "aggregate",
        LOGP,
        lambda x: klpen.aggregate(x**2, MASK, "seq-mean-token-mean"),
        lambda x: ((x**2 * MASK).sum(-1) / MASK.sum(-1)).mean(),
        (),
    ),
    (
        "shape_rewards",
        LOGP,
        lambda x: (klpen.shape_rewards(SCORES, x, MASK, 0.1) ** 2).sum(),
        lambda x: (
            (
                -0.1 * x * MASK
                + torch.stack(
                    [
                        torch.nn.functional.one_hot(MASK[b].sum() - 1, T) * SCORES[b]
                        for b in range(B)
                    ]
                )
            )
            ** 2
        ).sum(),
        (),
    ),
]

# the rows whose function belongs to another helper's module and fails here
OTHERS: dict[str, str] = {}


def _hvp(loss: Loss, x: Tensor, v: Tensor) -> Tensor:
    leaf = x.clone().requires_grad_()
    (g,) = torch.autograd.grad(loss(leaf), leaf, create_graph=True)
    (hv,) = torch.autograd.grad((g * v).sum(), leaf)
    return hv


def _params() -> list[object]:
    out = []
    for row in ROWS:
        marks = [pytest.mark.xfail(strict=True, reason=OTHERS[row[0]])] if row[0] in OTHERS else []
        out.append(pytest.param(*row[1:], id=row[0], marks=marks))
    return out


@pytest.mark.parametrize(("x", "loss", "reference", "names"), _params())
def test_second_derivative_is_right_or_refused_by_name(
    x: Tensor, loss: Loss, reference: Loss | None, names: tuple[str, ...]
) -> None:
    v = torch.randn(x.shape, generator=torch.Generator().manual_seed(1), dtype=x.dtype)
    if reference is None:
        pattern = "|".join(names)
        with pytest.raises(RuntimeError, match=rf"klpen's ({pattern}) has no second derivative"):
            _hvp(loss, x, v)
        return
    torch.testing.assert_close(_hvp(loss, x, v), _hvp(reference, x, v))


@pytest.mark.parametrize(("x", "loss", "reference", "names"), _params())
def test_first_derivative_is_unchanged_under_create_graph(
    x: Tensor, loss: Loss, reference: Loss | None, names: tuple[str, ...]
) -> None:
    """The guard changes nothing but the second derivative: create_graph=True gives the same
    first derivative as create_graph=False."""
    a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
    (ga,) = torch.autograd.grad(loss(a), a, create_graph=True)
    (gb,) = torch.autograd.grad(loss(b), b)
    torch.testing.assert_close(ga.detach(), gb)


def test_the_hidden_state_hessian_is_no_longer_silently_wrong() -> None:
    """Issue 19: linear_logprobs under create_graph=True returned a Hessian-vector product
    without the softmax's curvature; now it raises. The unfused value it must not pretend to
    be is checked to differ from the dropped-term one, so this test can fail."""
    v = torch.ones_like(HIDDEN)

    def unfused(x: Tensor) -> Tensor:
        return _gather(x @ WEIGHT.T).sum()

    def klpen_loss(x: Tensor) -> Tensor:
        return klpen.linear_logprobs(x, WEIGHT, TOKENS).sum()

    assert not torch.allclose(_hvp(unfused, HIDDEN, v), torch.zeros_like(HIDDEN))
    with pytest.raises(RuntimeError, match="klpen's linear_logprobs has no second derivative"):
        _hvp(klpen_loss, HIDDEN, v)
