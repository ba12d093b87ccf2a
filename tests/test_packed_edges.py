"""Issue 22, items 8, 9 and 12: the EOS id, half-precision aggregation, the controllers' edges.

Each table failed on klpen before this change (noted per test): an ``eos_token_id`` wrapped to
the tokens' dtype, negative token ids accepted, ``aggregate`` overflowing fp16 where the
distributed form accumulates in fp32, a bare ``OverflowError`` from a controller's update,
and a state key that ``state_dict`` never writes accepted.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from klpen import (
    AdaptiveKLController,
    DoublingKLController,
    FixedKLController,
    KLController,
    aggregate,
    masked_mean,
    masked_sum,
    response_mask,
)
from klpen.masking import AGGREGATION_MODES

# --- item 8: eos_token_id that does not fit the tokens' dtype; negative token ids ----------

#: (dtype, an id beyond its range that would wrap onto a real token); failed before: 261 on
#: uint8 matched 5, 2**32 + 5 on int32 matched 5 (torch compares after wrapping)
WRAPPING = [
    (torch.uint8, 256 + 5),
    (torch.int8, 128 + 5),
    (torch.int16, 2**16 + 5),
    (torch.int32, 2**32 + 5),
    (torch.int64, 2**64 + 5),
]


@pytest.mark.parametrize(("dtype", "eos"), WRAPPING, ids=[str(d) for d, _ in WRAPPING])
@pytest.mark.parametrize("packed", [False, True])
def test_an_eos_id_beyond_the_tokens_dtype_is_refused_by_name(
    dtype: torch.dtype, eos: int, packed: bool
) -> None:
    tokens = torch.tensor([[7, 5, 9, 9]], dtype=dtype)
    kwargs = {"position_ids": torch.tensor([[0, 1, 0, 1]])} if packed else {}
    with pytest.raises(ValueError, match=rf"eos_token_id must fit the dtype of tokens .*got {eos}"):
        response_mask(tokens, eos, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64])
def test_the_largest_id_of_each_dtype_is_accepted(dtype: torch.dtype) -> None:
    top = torch.iinfo(dtype).max
    tokens = torch.tensor([[1, top, 1]], dtype=dtype)
    assert response_mask(tokens, top).tolist() == [[True, True, False]]


@pytest.mark.parametrize("dtype", [torch.int8, torch.int16, torch.int32, torch.int64])
@pytest.mark.parametrize("packed", [False, True])
def test_negative_token_ids_are_refused_by_name(dtype: torch.dtype, packed: bool) -> None:
    # failed before: accepted (and -3 could even be the "EOS" of a wrapped id)
    tokens = torch.tensor([[4, -3, 2, 2]], dtype=dtype)
    kwargs = {"cu_seqlens": torch.tensor([0, 2, 4])} if packed else {}
    with pytest.raises(
        ValueError, match=r"tokens must be non-negative token ids, got -3 at index \(0, 1\)"
    ):
        response_mask(tokens, 2, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("eos", [-1, -(2**70)])
def test_a_negative_eos_id_is_refused(eos: int) -> None:
    with pytest.raises(ValueError, match="eos_token_id must be a non-negative token id"):
        response_mask(torch.tensor([[1, 2]]), eos)


# --- item 9: aggregate accumulates in fp32 -------------------------------------------------

HALF = [torch.float16, torch.bfloat16, torch.float32, torch.float64]


def _reference(values: torch.Tensor, mask: torch.Tensor, mode: str) -> float:
    x = values.double().tolist()
    m = mask.tolist()
    rows = [[v for v, k in zip(r, mr, strict=True) if k] for r, mr in zip(x, m, strict=True)]
    tokens = [v for r in rows for v in r]
    if mode == "token-mean":
        return sum(tokens) / max(len(tokens), 1)
    if mode == "token-sum":
        return sum(tokens)
    kept = [r for r in rows if r]
    per = [sum(r) / len(r) if mode == "seq-mean-token-mean" else sum(r) for r in kept]
    return sum(per) / max(len(per), 1)


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("mode", AGGREGATION_MODES)
@pytest.mark.parametrize("packed", [False, True])
def test_aggregate_of_large_half_values_does_not_overflow(
    dtype: torch.dtype, mode: str, packed: bool
) -> None:
    # failed before for fp16: token-mean of 6e4 gave inf (the sum overflowed 65504)
    values = torch.full((2, 8), 6e4, dtype=dtype)
    values[1, 4:] = 1e4
    mask = torch.ones(2, 8, dtype=torch.bool)
    mask[1, 6:] = False
    want = _reference(values, mask, mode)
    kwargs = {}
    if packed:  # the two rows as sequences of one packed row
        values, mask = values.reshape(1, 16), mask.reshape(1, 16)
        kwargs = {"sequence_ids": torch.tensor([[0] * 8 + [1] * 8])}
    got = aggregate(values, mask, mode, **kwargs)  # type: ignore[arg-type]
    assert got.dtype == dtype
    if math.isfinite(float(torch.tensor(want, dtype=dtype))):
        torch.testing.assert_close(
            got.double(), torch.tensor(want, dtype=torch.float64).to(dtype).double()
        )
    else:  # the true value is beyond the dtype: it saturates, as the rounding of it does
        assert got.item() == math.inf


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_masked_mean_and_sum_accumulate_half_in_fp32(dtype: torch.dtype) -> None:
    values = torch.full((1, 4), 6e4, dtype=dtype)
    mask = torch.ones(1, 4)
    assert masked_mean(values, mask).item() == pytest.approx(float(values[0, 0]))
    assert masked_mean(values, mask, dim=-1).item() == pytest.approx(float(values[0, 0]))
    # 3001 ones: an fp16 count would round to 3000 or 3002
    ones = torch.ones(1, 3001, dtype=dtype)
    assert masked_sum(ones, torch.ones(1, 3001)).float().item() == float(
        torch.tensor(3001.0).to(dtype)
    )
    assert aggregate(ones, torch.ones(1, 3001), "token-mean").item() == 1.0


def test_fp16_aggregate_gradient_is_finite_and_right() -> None:
    values = torch.full((2, 4), 6e4, dtype=torch.float16, requires_grad=True)
    out = aggregate(values, torch.ones(2, 4), "token-mean")
    (grad,) = torch.autograd.grad(out, values)
    assert grad.dtype == torch.float16
    torch.testing.assert_close(grad, torch.full((2, 4), 1 / 8, dtype=torch.float16))


# --- item 12: controllers ---------------------------------------------------------------------

FACTORIES = {
    "fixed": lambda: FixedKLController(0.05),
    "doubling": lambda: DoublingKLController(init_kl_coef=0.2, target_kl=6.0),
    "adaptive": lambda: AdaptiveKLController(0.2, target_kl=6.0, horizon=50),
}
HUGE_STEPS = [10**400, 2**1024, np.iinfo(np.int64).max * 10**300]
KLS = [
    3.0,
    np.float32(12.0),
    np.float64(1.0),
    torch.tensor(9.0),
    torch.tensor(7.0, dtype=torch.float64),
]


@pytest.mark.parametrize("kind", list(FACTORIES))
@pytest.mark.parametrize("n_steps", HUGE_STEPS, ids=["10**400", "2**1024", "int64max*1e300"])
@pytest.mark.parametrize("kl", KLS, ids=[repr(k) for k in KLS])
def test_update_refuses_an_n_steps_beyond_float_range_by_name(
    kind: str, n_steps: int, kl: object
) -> None:
    # failed before: AdaptiveKLController raised a bare OverflowError (int too large for float)
    ctl: KLController = FACTORIES[kind]()
    before = ctl.state_dict()
    with pytest.raises(ValueError, match=r"n_steps must fit a float"):
        ctl.update(kl, n_steps=n_steps)  # type: ignore[arg-type]
    assert ctl.state_dict() == before


def test_a_large_but_finite_n_steps_still_works_or_is_refused_cleanly() -> None:
    ctl = AdaptiveKLController(0.2, target_kl=6.0, horizon=1e-3)
    assert ctl.update(6.0, n_steps=10**300) == 0.2  # on target: e = 0, nothing moves
    with pytest.raises(ValueError, match="would set kl_coef to inf"):
        ctl.update(12.0, n_steps=10**308)
    assert ctl.kl_history == [6.0]


#: (kind, an extra key); failed before: accepted and ignored
EXTRA_KEYS = [
    ("doubling", "horizon", 100),
    ("fixed", "target_kl", 6.0),
    ("fixed", "horizon", 10),
    ("adaptive", "lr", 0.1),
    ("doubling", "value", 0.2),
    ("adaptive", 3, 1.0),
]


@pytest.mark.parametrize(("kind", "key", "value"), EXTRA_KEYS)
def test_load_state_dict_refuses_keys_state_dict_never_writes(
    kind: str, key: object, value: object
) -> None:
    source = FACTORIES[kind]()
    source.update(7.0)
    state = source.state_dict()
    state[key] = value  # type: ignore[index]
    target = FACTORIES[kind]()
    before = target.state_dict()
    with pytest.raises(ValueError, match=rf"never writes: {key!r}"):
        target.load_state_dict(state)
    assert target.state_dict() == before
    del state[key]  # type: ignore[arg-type]
    target.load_state_dict(state)
    assert target.state_dict() == source.state_dict()
