"""``get_logprobs_for_tokens`` and ``calculate_kl_penalty`` against torch's own references.

``-cross_entropy(reduction="none")`` is the reference log-prob of a token (an independent kernel,
not klpen's block loop); gradients are checked with ``gradcheck`` in float64 and against autograd
through the naive ``log_softmax(...).gather(...)``.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from klpen import calculate_kl_penalty, get_logprobs_for_tokens

DTYPES = [torch.float32, torch.float64]


def random_batch(
    seed: int,
    shape: tuple[int, ...],
    vocab: int,
    dtype: torch.dtype = torch.float32,
    scale: float = 3.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(*shape, vocab, generator=gen, dtype=torch.float64) * scale).to(dtype)
    tokens = torch.randint(0, vocab, shape, generator=gen)
    return logits, tokens


def reference_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """-cross_entropy per position, in float64."""
    flat = logits.detach().double().reshape(-1, logits.shape[-1])
    return -F.cross_entropy(flat, tokens.reshape(-1), reduction="none").reshape(tokens.shape)


# ---------------------------------------------------------------- values


@given(
    seed=st.integers(0, 2**31 - 1),
    b=st.integers(1, 4),
    t=st.integers(1, 6),
    v=st.integers(1, 40),
    dtype=st.sampled_from([torch.float32, torch.float64]),
)
def test_matches_cross_entropy(seed: int, b: int, t: int, v: int, dtype: torch.dtype) -> None:
    logits, tokens = random_batch(seed, (b, t), v, dtype)
    out = get_logprobs_for_tokens(logits, tokens)
    assert out.shape == (b, t) and out.dtype == dtype
    tol = 1e-12 if dtype == torch.float64 else 2e-5
    torch.testing.assert_close(out.double(), reference_logprobs(logits, tokens), rtol=tol, atol=tol)


@pytest.mark.parametrize("shape", [(), (5,), (2, 3), (2, 3, 2)])
def test_any_leading_shape(shape: tuple[int, ...]) -> None:
    logits, tokens = random_batch(0, shape, 7)
    out = get_logprobs_for_tokens(logits, tokens)
    assert out.shape == shape
    torch.testing.assert_close(
        out.double(), reference_logprobs(logits, tokens), rtol=2e-5, atol=2e-5
    )


def test_many_blocks_and_a_large_vocabulary() -> None:
    # 4096-wide rows: several working blocks over 2 * 70 rows, so the block seams are crossed.
    logits, tokens = random_batch(1, (2, 70), 4096)
    out = get_logprobs_for_tokens(logits, tokens)
    torch.testing.assert_close(
        out.double(), reference_logprobs(logits, tokens), rtol=1e-5, atol=1e-5
    )


def test_non_contiguous_logits_the_shifted_slice() -> None:
    # The next-token shift: logits[:, :-1] scores tokens[:, 1:]; a view, not contiguous.
    logits, tokens = random_batch(2, (3, 9), 4096)
    shifted, targets = logits[:, :-1], tokens[:, 1:]
    assert not shifted.is_contiguous()
    out = get_logprobs_for_tokens(shifted, targets)
    torch.testing.assert_close(
        out.double(), reference_logprobs(shifted, targets), rtol=1e-5, atol=1e-5
    )
    transposed = logits.transpose(0, 1)
    out_t = get_logprobs_for_tokens(transposed, tokens.t())
    expected_t = reference_logprobs(transposed, tokens.t())
    torch.testing.assert_close(out_t.double(), expected_t, rtol=1e-5, atol=1e-5)


@given(
    seed=st.integers(0, 2**31 - 1),
    shift=st.floats(-1e3, 1e3, allow_nan=False),
)
def test_invariant_to_a_per_row_constant(seed: int, shift: float) -> None:
    logits, tokens = random_batch(seed, (3, 4), 9, torch.float64)
    gen = torch.Generator().manual_seed(seed + 1)
    per_row = torch.randn(3, 4, 1, generator=gen, dtype=torch.float64) * shift
    a = get_logprobs_for_tokens(logits, tokens)
    b = get_logprobs_for_tokens(logits + per_row, tokens)
    torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


@given(seed=st.integers(0, 2**31 - 1), shift=st.floats(-1e3, 1e3, allow_nan=False))
def test_float32_rows_far_from_zero_match_float64(seed: int, shift: float) -> None:
    # exp(logits) of such rows overflows or underflows in fp32; the result must not notice.
    logits, tokens = random_batch(seed, (3, 4), 9)
    logits = logits + shift
    out = get_logprobs_for_tokens(logits, tokens)
    # An fp32 log-sum-exp of logits near c is only known to within ~eps * |c|.
    atol = 1e-6 + 4 * torch.finfo(torch.float32).eps * abs(shift)
    torch.testing.assert_close(
        out.double(), reference_logprobs(logits, tokens), rtol=1e-5, atol=atol
    )


@given(seed=st.integers(0, 2**31 - 1), v=st.integers(1, 30))
def test_probabilities_are_normalised(seed: int, v: int) -> None:
    logits, _ = random_batch(seed, (2, 3), v, torch.float64)
    # every token of the vocabulary at every position: the probabilities sum to 1
    per_token = torch.stack(
        [get_logprobs_for_tokens(logits, torch.full((2, 3), j)) for j in range(v)]
    )
    torch.testing.assert_close(per_token.exp().sum(0), torch.ones(2, 3, dtype=torch.float64))


@given(seed=st.integers(0, 2**31 - 1), v=st.integers(1, 30), dtype=st.sampled_from(DTYPES))
def test_log_probs_are_never_positive(seed: int, v: int, dtype: torch.dtype) -> None:
    logits, _ = random_batch(seed, (2, 3), v, dtype, scale=10.0)
    top = logits.argmax(-1)  # the token with the most mass: the one at risk
    assert (get_logprobs_for_tokens(logits, top) <= 0).all()
    assert (
        get_logprobs_for_tokens(logits[..., :1], torch.zeros(2, 3, dtype=torch.long)) == 0
    ).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_is_computed_and_returned_in_float32(dtype: torch.dtype) -> None:
    logits, tokens = random_batch(3, (2, 5), 300, dtype)
    out = get_logprobs_for_tokens(logits, tokens)
    assert out.dtype == torch.float32
    # exactly what fp32 arithmetic gives on the (exactly representable) upcast input
    expected = reference_logprobs(logits.float(), tokens)
    torch.testing.assert_close(out.double(), expected, rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int16, torch.uint8, torch.int64])
def test_integer_token_dtypes(dtype: torch.dtype) -> None:
    logits, tokens = random_batch(4, (2, 3), 50)
    out = get_logprobs_for_tokens(logits, tokens.to(dtype))
    torch.testing.assert_close(out, get_logprobs_for_tokens(logits, tokens))


def test_empty_batch() -> None:
    logits = torch.zeros(0, 4, 10, requires_grad=True)
    out = get_logprobs_for_tokens(logits, torch.zeros(0, 4, dtype=torch.long))
    assert out.shape == (0, 4)
    out.sum().backward()
    assert logits.grad is not None and logits.grad.shape == (0, 4, 10)


@pytest.mark.parametrize("scale", [40.0, 100.0, 1e4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_large_and_huge_logits_stay_finite_and_exact(scale: float, dtype: torch.dtype) -> None:
    logits, tokens = random_batch(5, (3, 4), 20, dtype, scale=scale)
    logits[0, 0, 0] = 0.9 * torch.finfo(dtype).max  # a single logit near the top of the range
    out = get_logprobs_for_tokens(logits, tokens)
    assert torch.isfinite(out[1:]).all()
    rtol = 1e-12 if dtype == torch.float64 else 1e-6
    expected = reference_logprobs(logits, tokens)
    torch.testing.assert_close(out.double(), expected, rtol=rtol, atol=rtol * scale)


def test_minus_inf_logits_masked_vocabulary() -> None:
    logits = torch.tensor([[[1.0, float("-inf"), 0.5, float("-inf")]]]).repeat(1, 2, 1)
    logits.requires_grad_(True)
    tokens = torch.tensor([[0, 1]])
    out = get_logprobs_for_tokens(logits, tokens)
    finite = torch.log_softmax(torch.tensor([1.0, 0.5]), -1)
    assert out[0, 0].item() == pytest.approx(finite[0].item(), rel=1e-6)
    assert out[0, 1].item() == float("-inf")  # a token the model cannot emit
    out[0, 0].backward()
    assert logits.grad is not None and torch.isfinite(logits.grad).all()
    assert (logits.grad[0, 0, [1, 3]] == 0).all()


@pytest.mark.parametrize(
    "row",
    [
        [float("nan"), 0.0, 0.0],
        [float("-inf"), float("-inf"), float("-inf")],
        [float("inf"), 0.0, 0.0],
    ],
    ids=["nan", "all-minus-inf", "plus-inf-at-the-token"],
)
def test_invalid_logits_raise_instead_of_nan(row: list[float]) -> None:
    with pytest.raises(ValueError, match="logits"):
        get_logprobs_for_tokens(torch.tensor([row]), torch.tensor([0]))


def test_plus_inf_logit_elsewhere_raises() -> None:
    with pytest.raises(ValueError, match="logits"):
        get_logprobs_for_tokens(torch.tensor([[0.0, float("inf"), 0.0]]), torch.tensor([0]))


# ---------------------------------------------------------------- gradients


def test_gradcheck_float64() -> None:
    logits, tokens = random_batch(6, (2, 3), 5, torch.float64)
    logits.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda x: get_logprobs_for_tokens(x, tokens), (logits,))


def test_gradcheck_float64_non_contiguous() -> None:
    logits, tokens = random_batch(7, (2, 4), 5, torch.float64)
    logits.requires_grad_(True)
    targets = tokens[:, 1:]
    assert torch.autograd.gradcheck(
        lambda x: get_logprobs_for_tokens(x[:, :-1], targets), (logits,)
    )


@pytest.mark.parametrize("vocab", [3, 4096])
def test_gradient_equals_autograd_through_the_naive_formula(vocab: int) -> None:
    logits, tokens = random_batch(8, (2, 40), vocab)
    weights = torch.randn(2, 40, generator=torch.Generator().manual_seed(9))
    a = logits.clone().requires_grad_(True)
    (get_logprobs_for_tokens(a, tokens) * weights).sum().backward()
    b = logits.clone().requires_grad_(True)
    naive = torch.log_softmax(b, -1).gather(-1, tokens[..., None]).squeeze(-1)
    (naive * weights).sum().backward()
    assert a.grad is not None and b.grad is not None
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6)


def test_gradient_in_the_dtype_of_the_logits() -> None:
    logits, tokens = random_batch(10, (2, 3), 16, torch.bfloat16)
    logits.requires_grad_(True)
    get_logprobs_for_tokens(logits, tokens).sum().backward()
    assert logits.grad is not None and logits.grad.dtype == torch.bfloat16
    ref = logits.detach().float().requires_grad_(True)
    torch.log_softmax(ref, -1).gather(-1, tokens[..., None]).sum().backward()
    assert ref.grad is not None
    torch.testing.assert_close(logits.grad.float(), ref.grad, rtol=1e-2, atol=1e-2)


# ---------------------------------------------------------------- calculate_kl_penalty


def test_calculate_kl_penalty_docstring_example() -> None:
    rl = torch.log(torch.tensor([[[0.5, 0.25, 0.25]]]))
    sft = torch.log(torch.tensor([[[0.25, 0.5, 0.25]]]))
    out = calculate_kl_penalty(rl, sft, torch.tensor([[0]]), beta=0.1)
    torch.testing.assert_close(out, torch.tensor([[0.1 * np.log(2.0)]], dtype=torch.float32))


@given(seed=st.integers(0, 2**31 - 1), beta=st.floats(0.0, 3.0, allow_nan=False))
def test_calculate_kl_penalty_matches_float64_indexing(seed: int, beta: float) -> None:
    gen = torch.Generator().manual_seed(seed)
    rl = torch.log_softmax(torch.randn(3, 5, 7, generator=gen), -1)
    sft = torch.log_softmax(torch.randn(3, 5, 7, generator=gen), -1)
    actions = torch.randint(0, 7, (3, 5), generator=gen)
    out = calculate_kl_penalty(rl, sft, actions, beta)
    a, r, s = actions.numpy(), rl.double().numpy(), sft.double().numpy()
    expected = np.empty((3, 5))
    for i in range(3):
        for j in range(5):
            expected[i, j] = beta * (r[i, j, a[i, j]] - s[i, j, a[i, j]])
    np.testing.assert_allclose(out.double().numpy(), expected, rtol=1e-6, atol=1e-6)


def test_calculate_kl_penalty_never_differentiates_the_reference() -> None:
    gen = torch.Generator().manual_seed(11)
    rl = torch.log_softmax(torch.randn(2, 3, 4, generator=gen), -1).requires_grad_(True)
    sft = torch.log_softmax(torch.randn(2, 3, 4, generator=gen), -1).requires_grad_(True)
    actions = torch.randint(0, 4, (2, 3), generator=gen)
    out = calculate_kl_penalty(rl, sft, actions, beta=0.5)
    out.sum().backward()
    assert sft.grad is None
    assert rl.grad is not None
    expected = 0.5 * F.one_hot(actions, 4).float()
    torch.testing.assert_close(rl.grad, expected)


def test_calculate_kl_penalty_int32_actions_and_promoted_dtype() -> None:
    rl = torch.log_softmax(torch.randn(1, 2, 3), -1)
    sft = torch.log_softmax(torch.randn(1, 2, 3, dtype=torch.float64), -1)
    out = calculate_kl_penalty(rl, sft, torch.tensor([[2, 0]], dtype=torch.int32), 1.0)
    assert out.dtype == torch.float64 and out.shape == (1, 2)


# ---------------------------------------------------------------- memory: what backward keeps


def saved_for_backward(fn: Callable[[], torch.Tensor]) -> list[torch.Tensor]:
    """Every tensor autograd saves while ``fn`` runs (custom Functions included)."""
    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return saved


def test_backward_keeps_the_logits_and_per_row_numbers_only() -> None:
    # The naive log_softmax(logits).gather(...) saves a second (B, T, V) tensor for backward;
    # klpen saves the logits themselves (no copy) and O(B*T) numbers.
    logits, tokens = random_batch(12, (4, 8), 1000)
    logits.requires_grad_(True)
    saved = saved_for_backward(lambda: get_logprobs_for_tokens(logits, tokens))
    inputs = {logits.untyped_storage().data_ptr(), tokens.untyped_storage().data_ptr()}
    extra = [t for t in saved if t.untyped_storage().data_ptr() not in inputs]
    assert sum(t.numel() for t in extra) <= 2 * tokens.numel(), [t.shape for t in extra]
    naive = saved_for_backward(lambda: torch.log_softmax(logits, -1).gather(-1, tokens[..., None]))
    assert any(
        t.numel() == logits.numel() and t.untyped_storage().data_ptr() not in inputs for t in naive
    ), "the check above would not see a (B, T, V) copy"
