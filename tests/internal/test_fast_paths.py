"""The fast paths of ``get_logprobs_for_tokens`` and ``full_kl``, against independent references.

Both functions walk the rows in blocks (``klpen.kernels.blocks``), add up exponentials without a max
pass, and redo the few rows where that is not exact (``-inf`` or extreme logits) with the
max-shifted log-sum-exp. These tests pin down what that machinery must not change: the values
(float64 ``cross_entropy`` and ``torch.distributions`` references), their independence of the
block size, the gradients (autograd through the naive formulas), half-precision input, strided
input without copies, the ``-inf`` conventions, and the memory bound (no ``(N, V)`` temporary,
checked by logging every tensor torch allocates).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any
from unittest.mock import patch

import pytest
import torch
import torch.nn.functional as F
from hypothesis import example, given
from hypothesis import strategies as st
from public_calls import ThroughKlpenOps
from torch import Tensor
from torch.distributions import Categorical, kl_divergence
from torch.utils._pytree import tree_flatten

from klpen import (
    full_kl,
    get_logprobs_for_tokens,
    logprobs_and_entropy,
    next_token_logprobs,
    token_entropy,
)
from klpen.kernels import blocks as _chunks
from klpen.kernels.torch_kl import kl_row_stats as _kl_row_stats

NEG_INF = float("-inf")
HALF = [torch.bfloat16, torch.float16]


# ---------------------------------------------------------------- helpers


def logits_batch(
    seed: int, lead: tuple[int, ...], vocab: int, scale: float = 3.0, device: str = "cpu"
) -> tuple[Tensor, Tensor, Tensor]:
    """fp32 policy logits, a nearby reference and token ids, reproducibly."""
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(*lead, vocab, generator=gen) * scale
    w = z + torch.randn(*lead, vocab, generator=gen)
    tokens = torch.randint(0, vocab, lead, generator=gen)
    return z.to(device), w.to(device), tokens.to(device)


def ref_logprobs(logits: Tensor, tokens: Tensor) -> Tensor:
    """-cross_entropy in float64: torch's own kernel, not klpen's block loop."""
    flat = logits.detach().double().reshape(-1, logits.shape[-1])
    nll = F.cross_entropy(flat, tokens.reshape(-1), reduction="none")
    return (-nll).reshape(tokens.shape)


def ref_kl(z: Tensor, w: Tensor) -> Tensor:
    """torch.distributions' categorical KL in float64 (0 where p = 0, inf where q = 0 < p)."""
    p, q = Categorical(logits=z.detach().double()), Categorical(logits=w.detach().double())
    return kl_divergence(p, q)


def naive_logprobs(logits: Tensor, tokens: Tensor) -> Tensor:
    """The seed code, computed in fp32 for half input (autograd rounds the gradient back)."""
    x = logits.float() if logits.dtype in HALF else logits
    return torch.log_softmax(x, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def naive_kl(z: Tensor, w: Tensor) -> Tensor:
    z = z.float() if z.dtype in HALF else z
    w = w.float() if w.dtype in HALF else w
    lp, lq = torch.log_softmax(z, dim=-1), torch.log_softmax(w, dim=-1)
    return (lp.exp() * (lp - lq)).sum(-1)


@contextlib.contextmanager
def block_rows(rows: int, vocab: int) -> Iterator[None]:
    """Make klpen walk the logits ``rows`` rows at a time."""
    with patch.object(_chunks, "CHUNK_ELEMENTS", rows * vocab):
        assert _chunks.rows_per_chunk(vocab) == rows
        yield


class AllocationLog(ThroughKlpenOps):
    """Every tensor an aten op returns in new storage (not a view, not an ``out=``/in-place
    result), by bytes: what a computation allocates, independent of the allocator. The ops
    inside klpen's custom operators are seen (an operator's own outputs were allocated by
    them, and are not counted twice)."""

    def __init__(self) -> None:
        super().__init__()
        self.nbytes: list[int] = []

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        out = self.run(func, args, kwargs)
        if self.is_klpen_op(func):
            return out
        seen = {
            t.untyped_storage().data_ptr()
            for t in tree_flatten((args, kwargs))[0]
            if isinstance(t, Tensor)
        }
        for t in tree_flatten(out)[0]:
            if isinstance(t, Tensor) and t.untyped_storage().data_ptr() not in seen:
                self.nbytes.append(t.untyped_storage().nbytes())
        return out


def cuda_or_skip(device: str) -> None:
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")


DEVICES = ["cpu", "cuda"]


# ---------------------------------------------------------------- block size


@given(
    seed=st.integers(0, 2**31 - 1),
    n_rows=st.integers(1, 12),
    rows=st.integers(1, 15),
    vocab=st.integers(1, 70),
)
@example(seed=0, n_rows=9, rows=1, vocab=40)  # one row per block
@example(seed=0, n_rows=9, rows=50, vocab=40)  # one block, larger than the tensor
def test_logprobs_do_not_depend_on_the_block_size(
    seed: int, n_rows: int, rows: int, vocab: int
) -> None:
    # rows from 1 to more rows than exist (n_rows + 3): the last block is partial or the only one
    z, _, tokens = logits_batch(seed, (n_rows,), vocab)
    weights = torch.randn(n_rows, generator=torch.Generator().manual_seed(seed))
    with block_rows(rows, vocab):
        x = z.clone().requires_grad_()
        got = get_logprobs_for_tokens(x, tokens)
        (got * weights).sum().backward()
    x_ref = z.double().requires_grad_()
    want = naive_logprobs(x_ref, tokens)
    (want * weights).sum().backward()
    torch.testing.assert_close(got.double(), ref_logprobs(z, tokens), rtol=0, atol=2e-6)
    torch.testing.assert_close(x.grad, x_ref.grad.float(), rtol=1e-5, atol=1e-6)


@given(
    seed=st.integers(0, 2**31 - 1),
    n_rows=st.integers(1, 12),
    rows=st.integers(1, 15),
    vocab=st.integers(1, 70),
)
@example(seed=0, n_rows=9, rows=1, vocab=40)
@example(seed=0, n_rows=9, rows=50, vocab=40)
def test_full_kl_does_not_depend_on_the_block_size(
    seed: int, n_rows: int, rows: int, vocab: int
) -> None:
    z, w, _ = logits_batch(seed, (n_rows,), vocab)
    weights = torch.randn(n_rows, generator=torch.Generator().manual_seed(seed))
    with block_rows(rows, vocab):
        zg, wg = z.clone().requires_grad_(), w.clone().requires_grad_()
        got = full_kl(zg, wg)
        (got * weights).sum().backward()
    z64, w64 = z.double().requires_grad_(), w.double().requires_grad_()
    (naive_kl(z64, w64) * weights).sum().backward()
    torch.testing.assert_close(got.double(), ref_kl(z, w), rtol=1e-5, atol=2e-6)
    torch.testing.assert_close(zg.grad, z64.grad.float(), rtol=1e-4, atol=2e-6)
    torch.testing.assert_close(wg.grad, w64.grad.float(), rtol=1e-4, atol=2e-6)


# ---------------------------------------------------------------- strided input: views, no copy


def strided_variants(seed: int) -> dict[str, tuple[Tensor, Tensor]]:
    """(policy, reference) pairs of shape (3, 5, 11) laid out in memory in different ways."""
    z, w, _ = logits_batch(seed, (3, 6, 11), 11)
    zt, wt, _ = logits_batch(seed + 1, (5, 3, 11), 11)
    return {
        "contiguous": (z[:, :5].contiguous(), w[:, :5].contiguous()),
        "shifted slice": (z[:, :-1], w[:, :-1]),  # logits[:, :-1], as before a next-token shift
        "transposed": (zt.transpose(0, 1), wt.transpose(0, 1)),
        "mixed": (z[:, :5].contiguous(), w[:, 1:]),  # one contiguous, one strided
    }


@pytest.mark.parametrize("layout", ["contiguous", "shifted slice", "transposed", "mixed"])
def test_row_blocks_are_views_in_row_order(layout: str) -> None:
    z, w = strided_variants(0)[layout]
    for rows in (1, 2, 4, 100):
        blocks = list(_chunks.row_blocks(w, rows))
        # offsets count rows as reshape(-1, V) does, with no gap and no overlap
        assert [off for off, _ in blocks] == sorted({off for off, _ in blocks})
        torch.testing.assert_close(torch.cat([b for _, b in blocks]), w.reshape(-1, 11))
        for _, block in blocks:
            assert block.shape[0] <= rows
            assert block.untyped_storage().data_ptr() == w.untyped_storage().data_ptr()
        pairs = list(_chunks.paired_row_blocks(z, w, rows))
        torch.testing.assert_close(torch.cat([a for _, a, _ in pairs]), z.reshape(-1, 11))
        torch.testing.assert_close(torch.cat([b for _, _, b in pairs]), w.reshape(-1, 11))
        for _, a, b in pairs:
            assert a.shape == b.shape  # the same rows of both, whatever their strides


@pytest.mark.parametrize("layout", ["shifted slice", "transposed", "mixed"])
def test_strided_input_gives_the_same_values_without_a_copy(layout: str) -> None:
    z, w = strided_variants(1)[layout]
    tokens = torch.randint(0, 11, z.shape[:-1], generator=torch.Generator().manual_seed(1))
    with block_rows(2, 11), AllocationLog() as log:
        lp = get_logprobs_for_tokens(z, tokens)
        kl = full_kl(z, w)
    # a copy of either input would be an allocation of its size (3 * 5 * 11 fp32)
    assert max(log.nbytes) < z.numel() * 4 / 2
    torch.testing.assert_close(lp, get_logprobs_for_tokens(z.contiguous(), tokens))
    torch.testing.assert_close(kl, full_kl(z.contiguous(), w.contiguous()))
    torch.testing.assert_close(lp.double(), ref_logprobs(z, tokens), rtol=0, atol=2e-6)
    torch.testing.assert_close(kl.double(), ref_kl(z, w), rtol=1e-5, atol=2e-6)


def test_take_rows_reads_rows_of_a_strided_tensor() -> None:
    z, _ = strided_variants(2)["transposed"]
    index = torch.tensor([0, 4, 7, 14])
    torch.testing.assert_close(_chunks.take_rows(z, index), z.reshape(-1, 11)[index])


# ---------------------------------------------------------------- memory bound


def big_allocations(fn: Any, n_elements: int) -> list[int]:
    """Sizes of the allocations of at least half an (N, V) fp32 tensor made by ``fn()``."""
    with AllocationLog() as log:
        fn()
    return [b for b in log.nbytes if b >= n_elements * 4 // 2]


def test_no_full_size_temporary_forward_or_backward() -> None:
    n, vocab = 64, 512
    z, w, tokens = logits_batch(3, (4, 16), vocab)
    weights = torch.randn(4, 16)
    x = z.clone().requires_grad_()
    with block_rows(4, vocab):
        # the detector sees the naive code's full log-prob tensor (and its gradient's)
        assert big_allocations(lambda: naive_logprobs(z, tokens), n * vocab) == [n * vocab * 4]
        assert big_allocations(lambda: get_logprobs_for_tokens(z, tokens), n * vocab) == []
        assert big_allocations(lambda: full_kl(z, w), n * vocab) == []
        # backward: the gradient itself, exactly once, and nothing else of that size
        out = get_logprobs_for_tokens(x, tokens)
        grads = big_allocations(lambda: (out * weights).sum().backward(), n * vocab)
        assert grads == [n * vocab * 4]
        x.grad = None
        out = full_kl(x, w)  # the reference does not require grad: no gradient built for it
        grads = big_allocations(lambda: (out * weights).sum().backward(), n * vocab)
        assert grads == [n * vocab * 4]


def test_no_full_size_temporary_with_temperature_entropy_and_the_shift() -> None:
    n, vocab = 64, 512
    z, w, tokens = logits_batch(4, (4, 16), vocab)
    near = z + 1e-2 * (w - z)  # every row of full_kl takes the centred refinement
    weights = torch.randn(4, 16)
    with block_rows(4, vocab):
        calls = [
            lambda: get_logprobs_for_tokens(z, tokens, temperature=0.7),
            lambda: full_kl(z, w, temperature=0.7),
            lambda: full_kl(z, near),
            lambda: token_entropy(z, temperature=1.3),
            lambda: logprobs_and_entropy(z, tokens, temperature=0.7),
            lambda: next_token_logprobs(z, tokens),  # views of the shifted logits, no copy
        ]
        for call in calls:
            assert big_allocations(call, n * vocab) == []
        x = z.clone().requires_grad_()
        logp, ent = logprobs_and_entropy(x, tokens, temperature=0.7)
        grads = big_allocations(lambda: (logp * weights + ent).sum().backward(), n * vocab)
        assert grads == [n * vocab * 4]


def test_block_scratch_is_one_block() -> None:
    # everything but the gradient is at most a couple of blocks of 4 rows, in fp32
    vocab = 256
    z, w, tokens = logits_batch(4, (40,), vocab)
    x = z.clone().requires_grad_()
    with block_rows(4, vocab), AllocationLog() as log:
        (get_logprobs_for_tokens(x, tokens).sum() + full_kl(x, w).sum()).backward()
    small = [b for b in log.nbytes if b != x.numel() * 4]
    assert max(small) <= 4 * vocab * 4
    # full_kl's float64 recomputation of small-KL rows takes them a few at a time
    z, w = logits_batch(5, (40,), vocab)[0], logits_batch(6, (40,), vocab)[0]
    x = z.clone().requires_grad_()
    with block_rows(8, vocab), AllocationLog() as log:
        full_kl(x, z + 1e-3 * w).sum().backward()  # every row in the float64 path
    small = [b for b in log.nbytes if b != x.numel() * 4]
    assert max(small) <= 8 * vocab * 4


# ---------------------------------------------------------------- half precision


@pytest.mark.parametrize("dtype", HALF)
def test_half_precision_is_computed_in_fp32(dtype: torch.dtype) -> None:
    z, w, tokens = logits_batch(5, (6, 7), 1000, scale=4.0)
    z, w = z.to(dtype), w.to(dtype)
    lp, kl = get_logprobs_for_tokens(z, tokens), full_kl(z, w)
    assert lp.dtype == kl.dtype == torch.float32
    # exact up to fp32 rounding on the half-precision values, as read (not as fp32 originals)
    torch.testing.assert_close(lp.double(), ref_logprobs(z, tokens), rtol=0, atol=1e-5)
    torch.testing.assert_close(kl.double(), ref_kl(z, w), rtol=1e-4, atol=1e-5)


def test_mixed_precision_pair_is_computed_in_fp32() -> None:
    # a bf16 policy against an fp32 reference: promoted to fp32, both gradients in their dtype
    z, w, _ = logits_batch(12, (4, 5), 200)
    zb = z.bfloat16().requires_grad_()
    wf = w.clone().requires_grad_()
    kl = full_kl(zb, wf)
    assert kl.dtype == torch.float32
    torch.testing.assert_close(kl.double(), ref_kl(zb, w), rtol=1e-5, atol=2e-6)
    kl.sum().backward()
    assert zb.grad is not None and zb.grad.dtype == torch.bfloat16
    assert wf.grad is not None and wf.grad.dtype == torch.float32
    z64, w64 = zb.detach().double().requires_grad_(), w.double().requires_grad_()
    naive_kl(z64, w64).sum().backward()
    torch.testing.assert_close(wf.grad, w64.grad.float(), rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(zb.grad, z64.grad.bfloat16(), rtol=2**-7, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gradients_equal_autograd_through_the_naive_formulas(dtype: torch.dtype) -> None:
    z, w, tokens = logits_batch(6, (5, 9), 300)
    z, w = z.to(dtype), w.to(dtype)
    weights = torch.randn(5, 9, generator=torch.Generator().manual_seed(6))
    # bf16 gradients are fp32 gradients rounded once: equal up to one bf16 ulp (2^-8 relative)
    tol = {"rtol": 1e-5, "atol": 1e-7} if dtype == torch.float32 else {"rtol": 2**-7, "atol": 0}

    mine, naive = z.clone().requires_grad_(), z.clone().requires_grad_()
    (get_logprobs_for_tokens(mine, tokens) * weights).sum().backward()
    (naive_logprobs(naive, tokens) * weights).sum().backward()
    assert mine.grad is not None and mine.grad.dtype == dtype
    torch.testing.assert_close(mine.grad, naive.grad, **tol)

    pairs = [(t.clone().requires_grad_(), t.clone().requires_grad_()) for t in (z, w)]
    (full_kl(pairs[0][0], pairs[1][0]) * weights).sum().backward()
    (naive_kl(pairs[0][1], pairs[1][1]) * weights).sum().backward()
    tol_kl = {"rtol": 1e-4, "atol": 1e-6} if dtype == torch.float32 else tol
    for mine_t, naive_t in pairs:
        torch.testing.assert_close(mine_t.grad, naive_t.grad, **tol_kl)


# ---------------------------------------------------------------- -inf and extreme logits


def extreme_rows(seed: int) -> tuple[Tensor, Tensor, Tensor]:
    """Ordinary rows mixed with rows the unshifted sums cannot handle exactly."""
    z, w, tokens = logits_batch(seed, (8,), 50)
    z[1] += 200.0  # exp overflows fp32
    w[2] += 200.0
    z[3] -= 300.0  # every exp underflows
    w[4] -= 300.0
    tokens[5] = int(z[5].argmin())
    z[5, tokens[5]] = z[5].max() - 150.0  # a token e^150 times less likely than the top one
    z[6, ::3] = NEG_INF  # masked vocabulary in the policy ...
    w[7, 1::4] = NEG_INF  # ... and in the reference (where the policy has no mass: below)
    z[7, 1::4] = NEG_INF
    tokens[6] = 1
    return z, w, tokens


def test_extreme_rows_are_exact_forward_and_backward() -> None:
    z, w, tokens = extreme_rows(7)
    weights = torch.randn(8, generator=torch.Generator().manual_seed(7))
    x = z.clone().requires_grad_()
    lp = get_logprobs_for_tokens(x, tokens)
    (lp * weights).sum().backward()
    torch.testing.assert_close(lp.double(), ref_logprobs(z, tokens), rtol=1e-6, atol=1e-5)
    x64 = z.double().requires_grad_()
    (naive_logprobs(x64, tokens) * weights).sum().backward()
    # fp32 logits near ±300 are themselves rounded to 3e-5: so are any fp32 method's p = exp(...)
    torch.testing.assert_close(x.grad, x64.grad.float(), rtol=1e-4, atol=1e-5)

    x.grad = None
    kl = full_kl(x, w)
    (kl * weights).sum().backward()
    torch.testing.assert_close(kl.double(), ref_kl(z, w), rtol=1e-5, atol=2e-5)
    # reference gradient: the finite rows through the naive formula in float64 ...
    finite = torch.isfinite(z).all(-1) & torch.isfinite(w).all(-1)
    z64 = z.double().requires_grad_()
    (naive_kl(z64, w.double())[finite] * weights[finite]).sum().backward()
    torch.testing.assert_close(x.grad[finite], z64.grad[finite].float(), rtol=1e-4, atol=1e-5)
    # ... and the masked rows through the same formula on their unmasked vocabulary only
    for row in (6, 7):
        keep = torch.isfinite(z[row])
        zr = z[row, keep].double().requires_grad_()
        (naive_kl(zr, w[row, keep].double()) * weights[row]).backward()
        assert (x.grad[row, ~keep] == 0).all()
        torch.testing.assert_close(x.grad[row, keep], zr.grad.float(), rtol=1e-4, atol=1e-6)


def test_minus_inf_conventions_are_kept() -> None:
    z = torch.tensor([[1.0, NEG_INF, 0.5], [1.0, 2.0, 0.5], [NEG_INF, 2.0, 0.5]])
    w = torch.tensor([[0.0, 0.0, 0.0], [0.0, NEG_INF, 0.0], [NEG_INF, 1.0, 0.0]])
    # the masked token has log-prob -inf; the others are untouched by the mask
    lp = get_logprobs_for_tokens(z, torch.tensor([1, 1, 1]))
    assert lp[0] == NEG_INF
    torch.testing.assert_close(lp[1:].double(), ref_logprobs(z[1:], torch.tensor([1, 1])))
    kl = full_kl(z, w)
    # a -inf policy logit contributes 0; -inf in both contributes 0; -inf in the reference
    # where the policy has mass gives +inf
    want = ref_kl(z, w)
    assert want[1] == kl[1] == float("inf")
    torch.testing.assert_close(kl[[0, 2]].double(), want[[0, 2]], rtol=1e-5, atol=1e-6)
    # which is the KL of the policy's support alone when the reference masks the same tokens
    torch.testing.assert_close(kl[2].double(), ref_kl(z[2, 1:], w[2, 1:]), rtol=1e-5, atol=1e-6)
    # a gradient through a -inf token: d log p_y / d z = onehot - p, with p = 0 at the mask
    x = z[:1].clone().requires_grad_()
    get_logprobs_for_tokens(x, torch.tensor([1])).sum().backward()
    assert x.grad is not None
    assert x.grad[0, 1] == 1.0 and torch.isfinite(x.grad).all()


@pytest.mark.parametrize(
    "row",
    [[NEG_INF, NEG_INF, NEG_INF], [float("nan"), 0.0, 0.0], [0.0, float("inf"), 0.0]],
    ids=["all -inf", "nan", "+inf"],
)
def test_invalid_rows_raise_in_both_paths(row: list[float]) -> None:
    # one bad row among ordinary ones: the error is raised, not a quiet value
    z = torch.zeros(3, 3)
    z[1] = torch.tensor(row)
    with pytest.raises(ValueError, match="logits"):
        get_logprobs_for_tokens(z, torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="logits"):
        full_kl(z, torch.zeros(3, 3))
    with pytest.raises(ValueError, match="logits"):
        full_kl(torch.zeros(3, 3), z)


def test_log_probs_never_positive_and_a_certain_token_gets_zero() -> None:
    z, _, _ = logits_batch(8, (50,), 30, scale=20.0)
    top = z.argmax(-1)
    lp = get_logprobs_for_tokens(z, top)
    assert (lp <= 0).all()
    # the shift by the token's own logit makes a token with all the mass exactly 0
    assert (get_logprobs_for_tokens(z[:, :1], torch.zeros(50, dtype=torch.long)) == 0).all()
    dominant = torch.tensor([[120.0, 0.0, -5.0]])
    assert get_logprobs_for_tokens(dominant, torch.tensor([0])).item() == 0.0


def test_exp_sums_is_the_plain_sum_of_exponentials() -> None:
    x = torch.randn(7, 33, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    shift = x[:, 3].clone()
    torch.testing.assert_close(_chunks.exp_sums(x, 2, torch.float64), x.exp().sum(-1))
    torch.testing.assert_close(
        _chunks.exp_sums(x, 3, torch.float64, shift), (x - shift[:, None]).exp().sum(-1)
    )
    sums = torch.tensor([float("inf"), float("nan"), 0.0, 1e-30, 1e-20, 1.0, 3e38])
    assert _chunks.shift_free_ok(sums, 128_256).tolist() == [
        False,
        False,
        False,
        False,
        True,
        True,
        True,
    ]


def test_shared_kl_kernel_keeps_a_slice_without_policy_mass_finite() -> None:
    # _kl_row_stats also serves the vocab-parallel KL, where a row of -inf policy logits is a
    # rank's slice without policy mass: there its restricted KL must be 0, not NaN. full_kl,
    # where the row is the whole vocabulary, must still reject it.
    z = torch.tensor([[0.5, NEG_INF, 1.0], [NEG_INF, NEG_INF, NEG_INF], [0.1, 0.2, 0.3]])
    w = torch.tensor([[0.0, 1.0, 2.0], [0.3, -1.0, 2.0], [0.3, 0.2, 0.1]])
    stats, redo = _kl_row_stats(z, w, rows=2, dtype=torch.float32)
    lse_z, lse_w, kl, _ = stats.unbind()
    assert {0, 1} <= set(redo.tolist())  # the rows with -inf logits (and small KLs)
    torch.testing.assert_close(lse_z, torch.logsumexp(z, -1))
    torch.testing.assert_close(lse_w, torch.logsumexp(w, -1))
    assert kl[1] == 0.0
    torch.testing.assert_close(kl[[0, 2]].double(), ref_kl(z[[0, 2]], w[[0, 2]]))
    with pytest.raises(ValueError, match="all -inf"):
        full_kl(z, w)


# ---------------------------------------------------------------- CUDA


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_on_each_device_values_gradients_and_strides(device: str, dtype: torch.dtype) -> None:
    cuda_or_skip(device)
    z, w, tokens = extreme_rows(10)
    z, w, tokens = z.to(device, dtype), w.to(device, dtype), tokens.to(device)
    zs = torch.cat([z, z[:1]]).unsqueeze(0)[:, :-1]  # a strided (1, 8, 50) view
    lp = get_logprobs_for_tokens(zs, tokens[None])
    kl = full_kl(zs, w[None])
    assert lp.device == kl.device == z.device and lp.dtype == kl.dtype == torch.float32
    # logits near ±200-300 carry an fp32 rounding of 1.5e-5, as in log_softmax's own result
    want = ref_logprobs(z.cpu(), tokens.cpu())
    torch.testing.assert_close(lp[0].cpu().double(), want, rtol=1e-6, atol=3e-5)
    torch.testing.assert_close(kl[0].cpu().double(), ref_kl(z.cpu(), w.cpu()), rtol=1e-5, atol=2e-5)
    x = z.clone().requires_grad_()
    naive = z.clone().requires_grad_()
    get_logprobs_for_tokens(x, tokens).sum().backward()
    naive_logprobs(naive, tokens).sum().backward()
    assert x.grad is not None and x.grad.device == z.device
    tol = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 2**-7, "atol": 0}
    torch.testing.assert_close(x.grad, naive.grad, **tol)


@pytest.mark.parametrize("device", DEVICES)
def test_on_each_device_no_full_size_temporary(device: str) -> None:
    cuda_or_skip(device)
    z, w, tokens = logits_batch(11, (64,), 512, device=device)
    with block_rows(4, 512):
        assert big_allocations(lambda: get_logprobs_for_tokens(z, tokens), 64 * 512) == []
        assert big_allocations(lambda: full_kl(z, w), 64 * 512) == []
