"""The hidden-state path's tasks (`kernels.torch_linear`): (row chunk, vocabulary group) pairs.

With more than one torch thread on the CPU the passes of ``linear_logprobs`` and
``linear_full_kl`` share their tasks among the block pool's workers, which run single-threaded
products and reductions. The grouping of the vocabulary is fixed by the shapes, and each group's
partial sums are added in group order: values and all three gradients must be bitwise those of
one thread, on every path a row can take (shift-free sums, rows redone with the max, the
centred KL, float64 redo rows, ``-inf`` bias entries), for fp32, float64 and bf16 weights; the
pool must really have been used; and the extra memory at two threads must stay that of one
scratch set per worker.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from unittest.mock import patch

import pytest
import torch
from probes import counting_pool, threads
from torch import Tensor

import klpen
import klpen.kernels.torch_linear as lin
from klpen.linear import linear_full_kl, linear_logprobs


@pytest.fixture
def small_tiles(monkeypatch: pytest.MonkeyPatch) -> None:
    # 4 rows x 24 vocabulary entries per tile: several row chunks, groups of several tiles.
    monkeypatch.setattr(lin, "CHUNK_ELEMENTS", 96)
    monkeypatch.setattr(lin, "_MAX_TILE_ROWS", 4)
    monkeypatch.setattr(lin, "_MIN_TILE_COLS", 1)


def _inputs(dtype: torch.dtype, wdtype: torch.dtype) -> tuple[Tensor, ...]:
    g = torch.Generator().manual_seed(7)
    n, h, v = 22, 12, 700
    x = torch.randn(n, h, generator=g, dtype=torch.float64)
    w = torch.randn(v, h, generator=g, dtype=torch.float64) / math.sqrt(h) * 3
    b = torch.randn(v, generator=g, dtype=torch.float64)
    b[::5] = -math.inf  # masked entries: the rows are redone with their max
    x[3] *= 300.0  # logits in the hundreds: fp32 shift-free sums overflow
    rx = x + 0.05 * torch.randn(n, h, generator=g, dtype=torch.float64)
    rx[4] = x[4]  # identical rows: a KL of exactly 0 (the float64 pass)
    tokens = torch.randint(0, v, (n,), generator=g)
    tokens[tokens % 5 == 0] += 1  # no masked token: finite log-probs
    return x.to(dtype), w.to(wdtype), b.to(wdtype), rx.to(dtype), tokens


def _everything(x: Tensor, w: Tensor, b: Tensor, rx: Tensor, tokens: Tensor) -> list[Tensor]:
    xg, wg, bg = (a.clone().requires_grad_() for a in (x, w, b))
    lp, ent = linear_logprobs(xg, wg, tokens, bias=bg, return_entropy=True)
    (lp.sum() + (ent * torch.linspace(0.5, 1.5, ent.shape[0], dtype=ent.dtype)).sum()).backward()
    assert xg.grad is not None and wg.grad is not None and bg.grad is not None
    out = [lp, ent, xg.grad, wg.grad, bg.grad]
    xg, wg, bg = (a.clone().requires_grad_() for a in (x, w, b))
    kl = linear_full_kl(xg, wg, rx, w, bias=bg, ref_bias=b)
    kl.sum().backward()
    assert xg.grad is not None and wg.grad is not None and bg.grad is not None
    return [*out, kl, xg.grad, wg.grad, bg.grad]


@pytest.mark.parametrize(
    ("dtype", "wdtype"),
    [
        (torch.float32, torch.float32),
        (torch.float64, torch.float64),
        (torch.bfloat16, torch.bfloat16),
        (torch.float32, torch.bfloat16),
    ],
)
@pytest.mark.usefixtures("small_tiles")
def test_two_threads_give_bitwise_the_one_thread_results(
    dtype: torch.dtype, wdtype: torch.dtype
) -> None:
    inputs = _inputs(dtype, wdtype)
    with threads(1), counting_pool() as calls:
        want = _everything(*inputs)
    assert calls == []
    with threads(2), counting_pool() as calls:
        got = _everything(*inputs)
    assert len(calls) >= 4  # forward and backward passes of both functions went to the pool
    for name, a, b in zip(
        ["logp", "ent", "gx", "gw", "gb", "kl", "kl gx", "kl gw", "kl gb"], want, got, strict=True
    ):
        assert a.dtype == b.dtype, name
        assert torch.equal(a, b), name
        assert bool(torch.isfinite(a).all()), name
    # and right: against the unfused float64 path
    x, w, b, rx, tokens = (t.double() if t.is_floating_point() else t for t in inputs)
    logits = x @ w.T + b
    tol = 1e-9 if dtype == wdtype == torch.float64 else 2e-3
    ref = klpen.get_logprobs_for_tokens(logits, tokens)
    torch.testing.assert_close(got[0].double(), ref, rtol=tol, atol=tol)
    ref_kl = klpen.full_kl(logits, rx @ w.T + b)
    torch.testing.assert_close(got[5].double(), ref_kl, rtol=tol, atol=tol)
    assert got[5][4].item() == 0.0


def test_the_tasks_and_groups_follow_the_shapes_only() -> None:
    layer = lin.Layer(torch.zeros(5000, 8), torch.zeros(128_256, 8), None, 1.0, torch.float32)
    plan = lin.plan(layer, 1 << 22)
    assert (plan.rows, plan.cols) == lin.tile_shape(5000, 128_256, 1 << 22)
    assert len(plan.groups) == lin.GROUPS
    starts = [v0 for v0, _ in plan.groups]
    assert starts[0] == 0 and plan.groups[-1][1] == 128_256
    assert all(v0 % plan.cols == 0 for v0 in starts)  # whole tiles
    assert all(a[1] == b[0] for a, b in zip(plan.groups, plan.groups[1:], strict=False))
    sizes = [v1 - v0 for v0, v1 in plan.groups[:-1]]
    assert max(sizes) - min(sizes) <= plan.cols
    with threads(1):
        one = lin.plan(layer, 1 << 22)
    assert one == plan
    few = lin.plan(layer._replace(weight=torch.zeros(3000, 8)), 1 << 22)
    assert len(few.groups) == 3  # one group per tile where there are fewer tiles
    spans = lin._spans(plan, 5000)
    assert len(spans) == 2 * lin.GROUPS  # two row chunks of at most 4096 rows


@contextmanager
def three_dim_buffers() -> Iterator[list[tuple[int, ...]]]:
    """The shapes of the 3-d buffers the kernels allocate inside the block (the backward's
    per-group hidden gradients)."""
    seen: list[tuple[int, ...]] = []
    real = torch.empty

    def spy(*shape: int, **kwargs: object) -> Tensor:
        if len(shape) == 3:
            seen.append(tuple(shape))
        return real(*shape, **kwargs)  # type: ignore[call-overload,no-any-return]

    with patch.object(lin.torch, "empty", spy):
        yield seen


@contextmanager
def group_buffers() -> Iterator[list[tuple[int, ...]]]:
    """The ``(count, N, H)`` shapes of the per-group buffers of whole-row passes (a narrow
    weight's backward, a frozen head's mean weight rows)."""
    seen: list[tuple[int, ...]] = []
    real = lin._group_buffers

    def spy(count: int, like: Tensor) -> Tensor:
        seen.append((count, *like.shape))
        return real(count, like)

    with patch.object(lin, "_group_buffers", spy):
        yield seen


def test_the_hidden_gradient_buffers_stay_within_one_block() -> None:
    """The per-group hidden-gradient buffers of backward hold at most CHUNK_ELEMENTS numbers."""
    x = torch.randn(3000, 64, requires_grad=True)
    w = torch.randn(20_000, 64, requires_grad=True)
    tokens = torch.randint(0, 20_000, (3000,))
    with three_dim_buffers() as seen:
        linear_logprobs(x, w, tokens).sum().backward()
    assert len(seen) == 1
    groups, rows, h = seen[0]
    assert groups <= lin.GROUPS and h == 64
    assert groups * rows * h <= lin.CHUNK_ELEMENTS


@pytest.mark.parametrize("half", [False, True])
def test_memory_at_two_threads_is_one_scratch_set_per_worker(half: bool) -> None:
    from klpen_book.hidden_states import fused_scratch_bytes
    from klpen_book.memory import peak_extra_bytes

    n, h, v = 1024, 16, 32_000
    g = torch.Generator().manual_seed(14)
    x, w = torch.randn(n, h, generator=g), torch.randn(v, h, generator=g)
    if half:
        x, w = x.bfloat16(), w.bfloat16()
    tokens = torch.randint(0, v, (n,), generator=g)
    with threads(2), counting_pool() as calls:
        peak = peak_extra_bytes(lambda: linear_logprobs(x, w, tokens))
    assert calls
    assert peak <= 1.05 * fused_scratch_bytes(n, h, v, half=half, workers=2)
    assert peak < 0.15 * 4 * n * v


@pytest.mark.usefixtures("small_tiles")
def test_a_narrow_weights_backward_runs_its_groups_in_bounded_waves(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """bf16: each group's hidden gradient over all rows in its own buffer, one group per
    worker at a time within NARROW_GRAD_ELEMENTS, added in group order: the same bits
    whatever the wave."""
    x, w, _, _, tokens = _inputs(torch.bfloat16, torch.bfloat16)
    n, h = x.shape
    scale = torch.linspace(0.5, 1.5, n)

    def backward() -> tuple[list[tuple[int, ...]], list[int], list[Tensor]]:
        xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
        lp = linear_logprobs(xg, wg, tokens)
        with group_buffers() as seen, counting_pool() as calls:
            (lp * scale).sum().backward()
        assert xg.grad is not None and wg.grad is not None
        return seen, calls, [xg.grad, wg.grad]

    with threads(1):
        seen, calls, want = backward()
    assert seen == [(1, n, h)] and calls == []
    with threads(2):
        seen, calls, got = backward()
    # two groups at a time, each wave on the calling thread and one pool worker
    assert seen == [(2, n, h)] and len(calls) == lin.GROUPS // 2 and set(calls) == {1}
    assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))
    monkeypatch.setattr(lin, "NARROW_GRAD_ELEMENTS", n * h)  # room for one buffer only
    with threads(2):
        seen, calls, got = backward()
    assert seen == [(1, n, h)] and calls == []
    assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))
    # no room for a buffer: the groups add into the hidden gradient in turn, at any thread
    # count the same (and within rounding of the buffered sums)
    monkeypatch.setattr(lin, "NARROW_GRAD_ELEMENTS", n * h - 1)
    results = []
    for count in (1, 2):
        with threads(count):
            seen, calls, got = backward()
        assert seen == [] and calls == []
        results.append(got)
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))
    for a, b in zip(want, results[0], strict=True):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2 * a.abs().max().item())
