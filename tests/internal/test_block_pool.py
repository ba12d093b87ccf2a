"""The threaded block loop (`kernels.blocks.for_each_block`): workers own whole blocks.

With more than one torch thread on the CPU, the kernels share their blocks out among a pool of
workers that run single-threaded ops. The results must be bitwise those of the sequential loop
(one thread) for the same blocks, forward and backward, whatever path a row takes; the thread
count must be 1 inside the loop and restored after it, also when the loop raises.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any
from unittest.mock import patch

import pytest
import torch
from probes import counting_pool, threads
from public_calls import ThroughKlpenOps
from torch import Tensor

from klpen import (
    full_kl,
    get_logprobs_for_tokens,
    logprobs_and_entropy,
    next_token_logprobs,
    token_entropy,
)
from klpen.kernels import blocks as _chunks


def test_workers_take_blocks_single_threaded_and_the_count_is_restored() -> None:
    seen: list[tuple[int, int, int]] = []
    out = torch.zeros(12)

    def body(start: int, blocks: tuple[Tensor, ...], work: Tensor) -> None:
        time.sleep(0.01)  # long enough for the second worker to take blocks too
        seen.append((start, threading.get_ident(), torch.get_num_threads()))
        out[start : start + blocks[0].shape[0]] = blocks[0].sum(-1) + work

    x = torch.arange(36.0).view(12, 3)
    with threads(2), counting_pool() as calls:
        _chunks.for_each_block((x,), 2, body, lambda rows: torch.ones(()))
        assert torch.get_num_threads() == 2
    assert calls == [1]
    assert sorted(s for s, _, _ in seen) == list(range(0, 12, 2))  # every block once
    assert len({ident for _, ident, _ in seen}) == 2
    assert {n for _, _, n in seen} == {1}
    assert torch.equal(out, x.sum(-1) + 1)


def block_starts(x: Tensor, rows: int, buffers: int = 1) -> list[int]:
    """The first row of every block that ``for_each_block`` hands to its body, as it sees them."""
    starts: list[int] = []

    def body(start: int, blocks: tuple[Tensor, ...], work: None) -> None:
        starts.append(start)

    _chunks.for_each_block((x,), rows, body, lambda rows: None, buffers=buffers)
    return starts


def test_sequential_with_one_thread_or_one_block() -> None:
    x = torch.zeros(4, 3)
    for n, rows in ((1, 1), (2, 4)):
        with threads(n), counting_pool() as calls:
            starts = block_starts(x, rows)
        assert calls == []
        assert starts == list(range(0, 4, rows))


@pytest.mark.parametrize("where", ["main", "worker"])
def test_an_error_in_a_block_is_raised_and_the_count_restored(where: str) -> None:
    main = threading.get_ident()

    def body(start: int, blocks: tuple[Tensor, ...], work: None) -> None:
        time.sleep(0.01)
        if (threading.get_ident() == main) == (where == "main"):
            raise ArithmeticError(f"block {start}")

    with threads(2), pytest.raises(ArithmeticError, match="block"):
        _chunks.for_each_block((torch.zeros(8, 2),), 1, body, lambda rows: None)
    with threads(2):
        assert torch.get_num_threads() == 2


def test_grad_mode_of_the_caller_holds_in_the_workers() -> None:
    modes: list[bool] = []

    def body(start: int, blocks: tuple[Tensor, ...], work: None) -> None:
        time.sleep(0.01)
        modes.append(torch.is_grad_enabled())

    for enabled in (False, True):
        modes.clear()
        with threads(2), torch.set_grad_enabled(enabled):
            _chunks.for_each_block((torch.zeros(6, 2),), 1, body, lambda rows: None)
        assert modes == [enabled] * 6


@pytest.mark.parametrize("grad", [False, True])
def test_kernels_run_pooled_in_inference_mode(grad: bool) -> None:
    # the outputs are inference tensors there: a worker outside that mode may not write them
    gen = torch.Generator().manual_seed(3)
    z, w = torch.randn(2, 9, 50, generator=gen), torch.randn(2, 9, 50, generator=gen)
    tokens = torch.randint(0, 50, (2, 9), generator=gen)
    want = (get_logprobs_for_tokens(z, tokens), full_kl(z, w), token_entropy(z))
    with patch.object(_chunks, "CHUNK_ELEMENTS", 2 * 50), threads(2), counting_pool() as calls:
        with torch.inference_mode(), torch.set_grad_enabled(grad):
            got = (get_logprobs_for_tokens(z, tokens), full_kl(z, w), token_entropy(z))
    assert len(calls) >= 3
    for a, b in zip(want, got, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6)


def test_sequential_under_a_dispatch_mode() -> None:
    # a mode is per thread: ops in the workers would escape it
    seen: list[str] = []

    class Log(ThroughKlpenOps):
        def see(self, func: Any) -> None:
            seen.append(str(func))

    z, tokens = torch.randn(8, 20), torch.randint(0, 20, (8,))
    with patch.object(_chunks, "CHUNK_ELEMENTS", 2 * 20), threads(2), counting_pool() as calls:
        with Log():
            get_logprobs_for_tokens(z, tokens)
    assert calls == []
    assert sum("aten.exp" in op for op in seen) == 4  # one per block, all seen


def kernel_cases() -> dict[str, Callable[[Tensor, Tensor, Tensor], tuple[Tensor, ...]]]:
    """Forward and backward of every kernel with a block loop, on ``(z, w, tokens)``."""

    def run(fn: Callable[[Tensor], Tensor], z: Tensor) -> tuple[Tensor, ...]:
        x = z.clone().requires_grad_()
        out = fn(x)
        weights = torch.linspace(-1.0, 2.0, out.numel()).view(out.shape)
        (out * weights).sum().backward()
        assert x.grad is not None
        return out.detach(), x.grad

    def both(z: Tensor, t: Tensor, temperature: float) -> tuple[Tensor, ...]:
        x = z.clone().requires_grad_()
        logp, ent = logprobs_and_entropy(x, t, temperature=temperature)
        (logp.sum() + 0.3 * ent.sum()).backward()
        assert x.grad is not None
        return logp.detach(), ent.detach(), x.grad

    return {
        "logprobs": lambda z, w, t: run(lambda x: get_logprobs_for_tokens(x, t), z),
        "logprobs T=0.7": lambda z, w, t: run(
            lambda x: get_logprobs_for_tokens(x, t, temperature=0.7), z
        ),
        "next_token (strided)": lambda z, w, t: run(lambda x: next_token_logprobs(x, t), z),
        "entropy": lambda z, w, t: run(lambda x: token_entropy(x), z),
        "logprobs and entropy": lambda z, w, t: both(z, t, 1.3),
        "full_kl": lambda z, w, t: run(lambda x: full_kl(x, w), z),
        "full_kl T=0.7": lambda z, w, t: run(lambda x: full_kl(x, w, temperature=0.7), z),
        # every row takes the centred second pass, a few the float64 one
        "full_kl near": lambda z, w, t: run(
            lambda x: full_kl(x, z + 1e-3 * (w - z).nan_to_num()), z
        ),
    }


@pytest.mark.parametrize("case", sorted(kernel_cases()))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_pooled_kernels_are_bitwise_the_sequential_ones(case: str, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(7)
    vocab = 300
    z = (3.0 * torch.randn(3, 13, vocab, generator=gen)).to(dtype)
    w = (z.float() + torch.randn(3, 13, vocab, generator=gen)).to(dtype)
    z[0, 1, :7] = -torch.inf  # masked vocabulary: the rows redone after the loop
    z[1, 2] += 1e4  # a large common offset
    tokens = torch.randint(7, vocab, (3, 13), generator=gen)
    fn = kernel_cases()[case]
    with patch.object(_chunks, "CHUNK_ELEMENTS", 3 * vocab):  # 13 blocks of 3 rows
        with threads(1), counting_pool() as calls:
            sequential = fn(z, w, tokens)
        assert calls == []
        with threads(2), counting_pool() as calls:
            pooled = fn(z, w, tokens)
            assert torch.get_num_threads() == 2
        assert calls  # the pooled path ran
    for a, b in zip(sequential, pooled, strict=True):
        assert a.dtype == b.dtype
        assert torch.equal(a.isnan(), b.isnan())
        assert torch.equal(a.nan_to_num(), b.nan_to_num())  # bitwise, NaN where NaN


def test_a_forked_child_makes_its_own_pool() -> None:
    x = torch.arange(24.0).view(12, 2)

    def loop() -> bool:
        out, workers = torch.zeros(12), set()

        def body(start: int, blocks: tuple[Tensor, ...], work: None) -> None:
            time.sleep(0.01)
            workers.add(threading.get_ident())
            out[start : start + blocks[0].shape[0]] = blocks[0].sum(-1)

        _chunks.for_each_block((x,), 1, body, lambda rows: None)
        return torch.equal(out, x.sum(-1)) and len(workers) == 2

    with threads(2):
        assert loop()  # the parent's pool exists now
        pid = os.fork()
        if pid == 0:  # the child has the pool object, not its threads
            os._exit(0 if loop() else 1)
    deadline = time.monotonic() + 60.0
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    if done[0] == 0:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail("the forked child's block loop hung")
    assert os.waitstatus_to_exitcode(done[1]) == 0


def test_loops_with_two_scratch_buffers_take_half_the_rows_per_cpu_block() -> None:
    x = torch.zeros(8, 5)
    for buffers, rows in ((1, 4), (2, 2)):
        with patch.object(_chunks, "WORKER_CHUNK_ELEMENTS", 4 * 5), threads(1):
            starts = block_starts(x, 8, buffers)
        assert starts == list(range(0, 8, rows))


@pytest.mark.parametrize("case", sorted(kernel_cases()))
def test_the_cpu_block_size_changes_no_bit(case: str) -> None:
    # what lets a loop cut its blocks by its scratch (the buffers argument) without a trace
    gen = torch.Generator().manual_seed(8)
    vocab = 300
    z = 3.0 * torch.randn(2, 13, vocab, generator=gen)
    w = z + torch.randn(2, 13, vocab, generator=gen)
    z[0, 1, :7] = -torch.inf
    tokens = torch.randint(7, vocab, (2, 13), generator=gen)
    results = []
    for rows in (1, 4, 13):
        with patch.object(_chunks, "WORKER_CHUNK_ELEMENTS", rows * vocab), threads(2):
            results.append(kernel_cases()[case](z, w, tokens))
    for other in results[1:]:
        for a, b in zip(results[0], other, strict=True):
            assert torch.equal(a.nan_to_num(), b.nan_to_num())
