"""Masking and aggregation against float64 Python loops; poison at masked positions never leaks.

Every reference below is a plain loop over Python floats, so it shares nothing with klpen's
vectorised ``where``/``sum``/``clamp`` code.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from klpen import aggregate, compute_token_kl, masked_mean, masked_sum, response_mask
from klpen.masking import AGGREGATION_MODES

POISON = [float("nan"), float("inf"), float("-inf"), 1e30, -1e30]


def batch(
    seed: int, b: int, t: int, p_valid: float = 0.6, dtype: torch.dtype = torch.float64
) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(b, t, generator=gen, dtype=torch.float64).to(dtype)
    mask = torch.rand(b, t, generator=gen) < p_valid
    return values, mask


def poisoned(values: torch.Tensor, mask: torch.Tensor, seed: int) -> torch.Tensor:
    """A copy of ``values`` with NaN/inf/huge numbers at every masked position."""
    gen = torch.Generator().manual_seed(seed)
    choice = torch.randint(0, len(POISON), values.shape, generator=gen)
    poison = torch.tensor(POISON, dtype=values.dtype)[choice]
    return torch.where(mask, values, poison)


# ---------------------------------------------------------------- float64 loop references


def loop_row_stats(values: torch.Tensor, mask: torch.Tensor) -> list[tuple[float, int]]:
    """(masked sum, count) per row, by a Python loop."""
    out = []
    for row_v, row_m in zip(values.tolist(), mask.tolist(), strict=True):
        s, n = 0.0, 0
        for v, m in zip(row_v, row_m, strict=True):
            if m:
                s += v
                n += 1
        out.append((s, n))
    return out


def loop_aggregate(values: torch.Tensor, mask: torch.Tensor, mode: str) -> float:
    stats = loop_row_stats(values, mask)
    total = sum(s for s, _ in stats)
    count = sum(n for _, n in stats)
    if mode == "token-sum":
        return total
    if mode == "token-mean":
        return total / count if count else 0.0
    per_row = [s / n if mode == "seq-mean-token-mean" else s for s, n in stats if n > 0]
    return sum(per_row) / len(per_row) if per_row else 0.0


# ---------------------------------------------------------------- masked_sum / masked_mean


@given(
    seed=st.integers(0, 2**31 - 1),
    b=st.integers(0, 5),
    t=st.integers(1, 7),
    p_valid=st.sampled_from([0.0, 0.3, 0.7, 1.0]),
)
def test_row_sums_and_means_match_loops(seed: int, b: int, t: int, p_valid: float) -> None:
    values, mask = batch(seed, b, t, p_valid)
    stats = loop_row_stats(values, mask)
    sums = masked_sum(values, mask, dim=-1)
    means = masked_mean(values, mask, dim=1)
    assert sums.shape == (b,) and means.shape == (b,)
    for i, (s, n) in enumerate(stats):
        assert sums[i].item() == pytest.approx(s, rel=1e-12, abs=1e-12)
        assert means[i].item() == pytest.approx(s / n if n else 0.0, rel=1e-12, abs=1e-12)
    total, count = sum(s for s, _ in stats), sum(n for _, n in stats)
    assert masked_sum(values, mask).item() == pytest.approx(total, rel=1e-12, abs=1e-12)
    expected_mean = total / count if count else 0.0
    assert masked_mean(values, mask).item() == pytest.approx(expected_mean, rel=1e-12, abs=1e-12)


def test_column_reduction_and_tuple_dims() -> None:
    values, mask = batch(1, 4, 6)
    cols = masked_sum(values, mask, dim=0)
    stats = loop_row_stats(values.t(), mask.t())
    torch.testing.assert_close(cols, torch.tensor([s for s, _ in stats], dtype=torch.float64))
    three = values.reshape(2, 2, 6)
    m3 = mask.reshape(2, 2, 6)
    torch.testing.assert_close(
        masked_mean(three, m3, dim=(0, 2)),
        masked_mean(three.transpose(0, 1), m3.transpose(0, 1), dim=(1, 2)),
    )
    torch.testing.assert_close(masked_sum(three, m3, dim=(-1, 0)).sum(), masked_sum(three, m3))
    # NumPy integers and lists name dimensions as well as Python ints and tuples
    assert torch.equal(masked_sum(values, mask, dim=np.int64(0)), cols)
    assert torch.equal(masked_mean(three, m3, dim=[0, 2]), masked_mean(three, m3, dim=(0, 2)))


def test_docstring_examples() -> None:
    nan = float("nan")
    out = masked_sum(torch.tensor([[1.0, 2.0, nan]]), torch.tensor([[1, 1, 0]]), dim=-1)
    assert torch.equal(out, torch.tensor([3.0]))
    values = torch.tensor([[1.0, 3.0, 100.0], [5.0, 0.0, 0.0]])
    out = masked_mean(values, torch.tensor([[1, 1, 0], [0, 0, 0]]), dim=-1)
    assert torch.equal(out, torch.tensor([2.0, 0.0]))


def test_all_masked_rows_give_zero_not_nan() -> None:
    values = torch.randn(3, 4)
    mask = torch.zeros(3, 4, dtype=torch.bool)
    assert torch.equal(masked_mean(values, mask, dim=-1), torch.zeros(3))
    assert torch.equal(masked_sum(values, mask, dim=-1), torch.zeros(3))
    assert masked_mean(values, mask).item() == 0.0
    empty = torch.zeros(0, 4)
    assert masked_mean(empty, torch.zeros(0, 4)).item() == 0.0
    assert masked_mean(empty, torch.zeros(0, 4), dim=-1).shape == (0,)


@pytest.mark.parametrize(
    "mask_dtype", [torch.bool, torch.int64, torch.int32, torch.uint8, torch.float32, torch.float64]
)
def test_bool_int_float_masks_agree(mask_dtype: torch.dtype) -> None:
    values, mask = batch(2, 3, 5)
    m = mask.to(mask_dtype)
    assert torch.equal(masked_sum(values, m, dim=-1), masked_sum(values, mask, dim=-1))
    assert torch.equal(masked_mean(values, m, dim=-1), masked_mean(values, mask, dim=-1))
    for mode in AGGREGATION_MODES:
        assert torch.equal(aggregate(values, m, mode), aggregate(values, mask, mode))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_result_keeps_the_values_dtype(dtype: torch.dtype) -> None:
    values, mask = batch(3, 2, 4, dtype=dtype)
    assert masked_sum(values, mask, dim=-1).dtype == dtype
    assert masked_mean(values, mask).dtype == dtype
    assert aggregate(values, mask, "seq-mean-token-mean").dtype == dtype


@given(seed=st.integers(0, 2**31 - 1), p_valid=st.sampled_from([0.0, 0.4, 0.9]))
def test_poison_at_masked_positions_never_leaks_values_or_gradients(
    seed: int, p_valid: float
) -> None:
    values, mask = batch(seed, 4, 6, p_valid)
    dirty = poisoned(values, mask, seed)

    def run(fn_name: str, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        leaf = x.clone().requires_grad_(True)
        if fn_name == "masked_sum":
            out = masked_sum(leaf, mask, dim=-1)
        elif fn_name == "masked_mean":
            out = masked_mean(leaf, mask, dim=-1)
        elif fn_name == "compute_token_kl":
            per_token, per_seq = compute_token_kl(leaf, torch.zeros_like(leaf), mask)
            out = torch.cat([per_token.flatten(), per_seq])
        else:
            out = aggregate(leaf, mask, fn_name).reshape(1)
        weights = torch.linspace(0.5, 1.5, out.numel(), dtype=out.dtype)
        (out * weights).sum().backward()
        assert leaf.grad is not None
        return out.detach(), leaf.grad

    for name in ("masked_sum", "masked_mean", "compute_token_kl", *AGGREGATION_MODES):
        clean_out, clean_grad = run(name, values)
        dirty_out, dirty_grad = run(name, dirty)
        assert torch.isfinite(dirty_out).all() and torch.isfinite(dirty_grad).all(), name
        assert torch.equal(clean_out, dirty_out), name
        assert torch.equal(clean_grad, dirty_grad), name
        assert (dirty_grad[~mask] == 0).all(), name


# ---------------------------------------------------------------- aggregate


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
@given(
    seed=st.integers(0, 2**31 - 1),
    b=st.integers(0, 5),
    t=st.integers(1, 6),
    p_valid=st.sampled_from([0.0, 0.2, 0.6, 1.0]),
)
def test_aggregate_matches_float64_loops(
    mode: str, seed: int, b: int, t: int, p_valid: float
) -> None:
    values, mask = batch(seed, b, t, p_valid)
    out = aggregate(values, mask, mode)
    assert out.shape == () and out.dtype == torch.float64
    assert out.item() == pytest.approx(loop_aggregate(values, mask, mode), rel=1e-12, abs=1e-12)


def test_aggregate_docstring_example_and_modes_differ() -> None:
    values = torch.tensor([[1.0, 1.0, 1.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    got = [aggregate(values, mask, m).item() for m in AGGREGATION_MODES]
    assert got == pytest.approx([7 / 4, 7.0, 2.5, 3.5])


def test_rows_without_valid_tokens_are_left_out_of_seq_means() -> None:
    values = torch.tensor([[2.0, 4.0], [100.0, 100.0], [6.0, 0.0]])
    mask = torch.tensor([[1, 1], [0, 0], [1, 0]])
    assert aggregate(values, mask, "seq-mean-token-mean").item() == pytest.approx((3.0 + 6.0) / 2)
    assert aggregate(values, mask, "seq-mean-token-sum").item() == pytest.approx((6.0 + 6.0) / 2)


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
def test_aggregate_all_masked_and_empty_batch_give_zero(mode: str) -> None:
    assert aggregate(torch.randn(3, 4), torch.zeros(3, 4), mode).item() == 0.0
    assert aggregate(torch.zeros(0, 4), torch.zeros(0, 4), mode).item() == 0.0


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
def test_aggregate_gradient_matches_the_loop_weights(mode: str) -> None:
    values, mask = batch(4, 4, 5, 0.5)
    mask[0] = False  # one row with no valid token
    leaf = values.clone().requires_grad_(True)
    aggregate(leaf, mask, mode).backward()
    assert leaf.grad is not None
    # Each valid token's weight in the aggregate, computed from the loop reference by finite
    # differences (the aggregate is linear in the values, so they are exact up to rounding).
    expected = torch.zeros_like(values)
    base = loop_aggregate(values, mask, mode)
    for i, j in itertools.product(range(4), range(5)):
        bumped = values.clone()
        bumped[i, j] += 1.0
        expected[i, j] = loop_aggregate(bumped, mask, mode) - base
    torch.testing.assert_close(leaf.grad, expected, rtol=1e-9, atol=1e-9)


# ---------------------------------------------------------------- compute_token_kl


def test_compute_token_kl_docstring_example() -> None:
    lp = torch.tensor([[-1.0, -2.0, -9.0]])
    lr = torch.tensor([[-1.5, -1.0, -1.0]])
    per_token, per_seq = compute_token_kl(lp, lr, torch.tensor([[1, 1, 0]]))
    assert torch.equal(per_token, torch.tensor([[0.5, -1.0, 0.0]]))
    assert torch.equal(per_seq, torch.tensor([-0.5]))


@given(seed=st.integers(0, 2**31 - 1), b=st.integers(0, 4), t=st.integers(1, 6))
def test_compute_token_kl_matches_loops(seed: int, b: int, t: int) -> None:
    lp, mask = batch(seed, b, t)
    lr, _ = batch(seed + 1, b, t)
    per_token, per_seq = compute_token_kl(lp, lr, mask)
    assert per_token.shape == (b, t) and per_seq.shape == (b,)
    for i in range(b):
        total = 0.0
        for j in range(t):
            expected = lp[i, j].item() - lr[i, j].item() if mask[i, j] else 0.0
            assert per_token[i, j].item() == expected
            total += expected
        assert per_seq[i].item() == pytest.approx(total, rel=1e-12, abs=1e-12)


def test_compute_token_kl_without_mask_counts_every_position() -> None:
    lp, _ = batch(5, 3, 4)
    lr, _ = batch(6, 3, 4)
    per_token, per_seq = compute_token_kl(lp, lr)
    torch.testing.assert_close(per_token, lp - lr)
    torch.testing.assert_close(per_seq, (lp - lr).sum(-1))
    masked = compute_token_kl(lp, lr, torch.ones(3, 4))
    assert torch.equal(masked[0], per_token) and torch.equal(masked[1], per_seq)


def test_compute_token_kl_minus_inf_logprobs_at_padding() -> None:
    # Padding often carries -inf log-probs under both models: -inf - -inf is NaN, must not leak.
    lp = torch.tensor([[-1.0, float("-inf")]], requires_grad=True)
    lr = torch.tensor([[-2.0, float("-inf")]], requires_grad=True)
    per_token, per_seq = compute_token_kl(lp, lr, torch.tensor([[True, False]]))
    assert torch.equal(per_token.detach(), torch.tensor([[1.0, 0.0]]))
    per_seq.sum().backward()
    assert lp.grad is not None and lr.grad is not None
    assert torch.equal(lp.grad, torch.tensor([[1.0, 0.0]]))
    assert torch.equal(lr.grad, torch.tensor([[-1.0, 0.0]]))


def test_all_masked_row_has_zero_sequence_kl() -> None:
    per_token, per_seq = compute_token_kl(torch.randn(2, 3), torch.randn(2, 3), torch.zeros(2, 3))
    assert torch.equal(per_token, torch.zeros(2, 3)) and torch.equal(per_seq, torch.zeros(2))


# ---------------------------------------------------------------- response_mask


def loop_response_mask(tokens: list[list[int]], eos: int, include_eos: bool) -> list[list[bool]]:
    """Reference: walk each row, keep tokens until the first EOS (kept or not)."""
    out = []
    for row in tokens:
        keep, ended = [], False
        for tok in row:
            if ended:
                keep.append(False)
                continue
            if tok == eos:
                ended = True
                keep.append(include_eos)
            else:
                keep.append(True)
        out.append(keep)
    return out


@given(
    rows=st.integers(0, 5).flatmap(
        lambda t: st.lists(st.lists(st.integers(0, 4), min_size=t, max_size=t), max_size=5)
    ),
    eos=st.integers(0, 4),
    include_eos=st.booleans(),
    dtype=st.sampled_from([torch.int64, torch.int32, torch.uint8, torch.int16]),
)
def test_response_mask_matches_a_loop(
    rows: list[list[int]], eos: int, include_eos: bool, dtype: torch.dtype
) -> None:
    t = len(rows[0]) if rows else 0
    tokens = torch.tensor(rows, dtype=dtype).reshape(len(rows), t)
    got = response_mask(tokens, eos, include_eos=include_eos)
    assert got.dtype == torch.bool and got.shape == tokens.shape
    assert got.tolist() == loop_response_mask(rows, eos, include_eos)


def test_response_mask_contract_cases() -> None:
    tokens = torch.tensor([[5, 7, 2, 0, 0], [5, 7, 8, 9, 6], [2, 2, 0, 0, 0], [5, 2, 5, 2, 5]])
    expected = [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0], [1, 1, 0, 0, 0]]
    assert response_mask(tokens, eos_token_id=2).int().tolist() == expected
    without = response_mask(tokens, 2, include_eos=False).int().tolist()
    assert without == [[1, 1, 0, 0, 0], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0], [1, 0, 0, 0, 0]]
    # any leading shape; an EOS id the tokens never hold; numpy ints are ints
    assert response_mask(tokens[None], np.int64(2)).shape == (1, 4, 5)
    assert response_mask(tokens, 10**6).all()


@pytest.mark.parametrize(
    ("tokens", "eos", "kwargs", "exc", "match"),
    [
        (torch.zeros(2, 3), 0, {}, TypeError, r"tokens must hold integer token ids.*float32"),
        (torch.zeros(2, 3, dtype=torch.bool), 0, {}, TypeError, r"tokens .*torch.bool"),
        ([[1, 2]], 0, {}, TypeError, r"tokens must be a torch.Tensor of token ids, got list"),
        (torch.tensor(3), 0, {}, ValueError, r"tokens must have at least 1 dimension"),
        (torch.zeros(2, 3, dtype=torch.long), 2.0, {}, TypeError, r"eos_token_id must be .*int"),
        (torch.zeros(2, 3, dtype=torch.long), True, {}, TypeError, r"eos_token_id .*True"),
        (torch.zeros(2, 3, dtype=torch.long), torch.tensor(2), {}, TypeError, "eos_token_id"),
        (torch.zeros(2, 3, dtype=torch.long), -1, {}, ValueError, r"eos_token_id .*got -1"),
        (torch.zeros(2, 3, dtype=torch.long), 0, {"include_eos": 1}, TypeError, "include_eos"),
        (torch.zeros(2, 3, dtype=torch.uint16), 0, {}, TypeError, r"tokens .*torch.uint16"),
    ],
)
def test_response_mask_rejects_bad_input(
    tokens: object, eos: object, kwargs: dict[str, object], exc: type[Exception], match: str
) -> None:
    with pytest.raises(exc, match=match):
        response_mask(tokens, eos, **kwargs)  # type: ignore[arg-type]
