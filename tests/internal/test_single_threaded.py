"""The small ops between pooled passes run on one thread (`kernels.blocks.single_threaded`).

ATen splits a ``log`` or ``exp`` of a few thousand entries, and a fill of a few rows of a
gradient, over OpenMP threads; GNU OpenMP's idle threads then spin on the cores that the next
pooled pass needs. So the per-row vectors of the log-prob kernels (the ``log`` of the sums, the
``exp`` of the backward's coefficients, the shifted gradient's last rows, a packed batch's cut
rows) and of the full KL (its ratios, bounds and log-sum-exps between its two passes) must be
computed with one torch thread in the calling thread, and the thread count must be restored
after, also on an error. Checked by recording the thread count at every such op. The next-token
shift of the ids runs inside klpen's operators for the same reason: a compiled caller would
otherwise run it as a parallel kernel of its own right before the pass.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any
from unittest.mock import patch

import pytest
import torch
from probes import threads
from torch import Tensor
from torch.fx.experimental.proxy_tensor import make_fx

from klpen import (
    full_kl,
    get_logprobs_for_tokens,
    logprobs_and_entropy,
    next_token_logprobs,
    validation,
)
from klpen.kernels.blocks import single_threaded

ROWS, VOCAB = 4096, 64  # above ATen's split of a log / exp over threads


@contextmanager
def thread_counts(*methods: str) -> Iterator[list[tuple[str, tuple[int, ...], int]]]:
    """Record (method, shape, torch thread count) for each call of ``methods`` in this thread."""
    seen: list[tuple[str, tuple[int, ...], int]] = []
    main = threading.get_ident()

    def spy(name: str, real: Callable[..., Tensor]) -> Callable[..., Tensor]:
        def call(self: Tensor, *args: Any, **kwargs: Any) -> Tensor:
            if threading.get_ident() == main:
                seen.append((name, tuple(self.shape), torch.get_num_threads()))
            return real(self, *args, **kwargs)

        return call

    with patch.multiple(Tensor, **{m: spy(m, getattr(Tensor, m)) for m in methods}):
        yield seen


def _inputs(seed: int = 0) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(2, ROWS // 2, VOCAB, generator=gen).requires_grad_(True)
    ids = torch.randint(VOCAB, (2, ROWS // 2), generator=gen)
    return logits, ids


CALLS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "get_logprobs_for_tokens": lambda z, y: get_logprobs_for_tokens(z, y).sum(),
    "next_token_logprobs": lambda z, y: next_token_logprobs(z, y).sum(),
    "next_token_logprobs packed": lambda z, y: next_token_logprobs(
        z.reshape(1, ROWS, VOCAB),
        y.reshape(1, ROWS),
        position_ids=torch.arange(ROWS // 2).repeat(2)[None],
    ).sum(),
    "logprobs_and_entropy": lambda z, y: sum(t.sum() for t in logprobs_and_entropy(z, y)),
}


@pytest.mark.parametrize("name", sorted(CALLS))
def test_row_vector_ops_of_the_logprob_kernels_run_on_one_thread(name: str) -> None:
    logits, ids = _inputs()
    with threads(2):
        with thread_counts("log_", "exp_", "index_fill_", "__setitem__") as seen:
            CALLS[name](logits, ids).backward()
        assert torch.get_num_threads() == 2
    # the sizes from which ATen splits them: a log / exp from 2048 entries, a fill from 32768.
    # A log / exp of a row vector (the row sums, the per-row coefficients), not the blocks'
    # own exponential: with one block of logits (as here) it runs on the calling thread and
    # may take its threads (an exp_ where this CPU's exp is the faster, else an exp2_).
    big = [
        (op, shape, count)
        for op, shape, count in seen
        if (
            len(shape) == 1 and math.prod(shape) >= 2048
            if op in ("log_", "exp_")
            else math.prod(shape) >= 32768
        )
    ]
    assert any(op in ("log_", "exp_") for op, _, _ in big), seen  # the spy saw the kernel's ops
    assert all(count == 1 for _, _, count in big), big


def test_results_are_the_bits_of_one_thread() -> None:
    logits, ids = _inputs(1)
    grads = []
    for n in (1, 2):
        with threads(n):
            logits.grad = None
            lp, ent = logprobs_and_entropy(logits, ids)
            (lp.sum() + ent.sum()).backward()
            assert logits.grad is not None
            grads.append((lp.detach(), ent.detach(), logits.grad.clone()))
    for one, two in zip(*grads, strict=True):
        assert torch.equal(one, two)
    reference = logits.detach() + torch.randn(
        logits.shape, generator=torch.Generator().manual_seed(4)
    )
    kls = []
    for n in (1, 2):
        with threads(n):
            logits.grad = None
            kl = full_kl(logits, reference)
            kl.sum().backward()
            assert logits.grad is not None
            kls.append((kl.detach(), logits.grad.clone()))
    for one, two in zip(*kls, strict=True):
        assert torch.equal(one, two)


def test_single_threaded_sets_one_thread_where_passes_are_pooled_and_restores_it() -> None:
    with threads(2):
        with single_threaded(torch.zeros(3)):
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2
        with pytest.raises(RuntimeError, match="inside"):
            with single_threaded(torch.zeros(3)):
                raise RuntimeError("inside")
        assert torch.get_num_threads() == 2
        with single_threaded(torch.zeros(3, device="meta")):  # not a pooled device
            assert torch.get_num_threads() == 2
    with threads(1), single_threaded(torch.zeros(3)):
        assert torch.get_num_threads() == 1


def test_row_vector_ops_of_the_full_kl_run_on_one_thread() -> None:
    gen = torch.Generator().manual_seed(2)
    vocab = 8 * VOCAB  # several blocks of rows: the passes are pooled
    policy = torch.randn(2, ROWS // 2, vocab, generator=gen)
    # half the rows close to the policy: their KL takes the centred second pass
    noise = (
        torch.randn(2, ROWS // 2, vocab, generator=gen) * torch.tensor([0.3, 1e-4])[:, None, None]
    )
    reference = policy + noise
    with threads(2):
        with thread_counts("log", "log_", "sqrt_", "div_", "nonzero") as seen:
            full_kl(policy, reference)
        assert torch.get_num_threads() == 2
    big = [s for s in seen if math.prod(s[1]) >= 2048]
    assert {op for op, _, _ in big} >= {"log", "log_", "sqrt_", "div_", "nonzero"}, seen
    assert [s for s in big if s[2] != 1] == [], big


def test_next_token_logprobs_shifts_its_ids_inside_the_operator_on_one_thread() -> None:
    logits, ids = _inputs(3)
    seen: list[int] = []
    real = torch.cat

    def cat(*args: Any, **kwargs: Any) -> Tensor:
        seen.append(torch.get_num_threads())
        return real(*args, **kwargs)

    with threads(2), patch("torch.cat", cat):
        next_token_logprobs(logits, ids).sum().backward()
        # traced, the shift is no graph node of its own: it runs inside klpen's operators
        with validation(False):  # value checks would read the traced values
            graph = make_fx(lambda z, y: next_token_logprobs(z, y))(logits.detach(), ids)
    assert seen and all(count == 1 for count in seen), seen
    targets = [n.target for n in graph.graph.nodes if n.op == "call_function"]
    assert targets == [torch.ops.klpen.token_logprobs.default, *targets[1:]], targets
    assert torch.ops.aten.cat.default not in targets, targets
