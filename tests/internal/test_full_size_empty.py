"""``full_size_empty``: a kernel's large CPU output, mapped with huge pages advised and its
mapping kept for the next call once the output is freed."""

from __future__ import annotations

import gc
import mmap
import threading
import weakref
from collections.abc import Iterator

import pytest
import torch
from public_calls import ThroughKlpenOps
from torch import Tensor

import klpen
from klpen.kernels import blocks
from klpen.kernels.blocks import HUGE_PAGE_MIN_BYTES, full_size_empty

LARGE = (HUGE_PAGE_MIN_BYTES // 4 // 1000, 1000)  # fp32: one more row is over the threshold


@pytest.mark.skipif(not hasattr(mmap, "MADV_HUGEPAGE"), reason="no MADV_HUGEPAGE here")
def test_a_large_output_owns_a_mapping_that_is_released_with_it() -> None:
    shape = (LARGE[0] + 1, LARGE[1])
    x = full_size_empty(shape, torch.zeros(1))
    assert x.shape == shape and x.dtype == torch.float32 and x.is_contiguous()
    x.fill_(2.0)
    assert float(x[-1, -1]) == 2.0 and float(x.sum()) == 2.0 * x.numel()
    base = x.untyped_storage()
    assert base.nbytes() == x.numel() * 4
    # the tensor is an ordinary one for autograd: it accumulates, and is freed with its map
    leaf = torch.zeros(shape, requires_grad=True)
    leaf.grad = x
    leaf.grad += 1.0
    ref = weakref.ref(x)
    del x, base
    leaf.grad = None
    gc.collect()
    assert ref() is None


def test_small_outputs_other_dtypes_and_dispatch_modes_take_torch_empty() -> None:
    class Seen(ThroughKlpenOps):
        def __init__(self) -> None:
            super().__init__()
            self.ops: list[str] = []

        def see(self, func: object) -> None:
            self.ops.append(str(func))

    assert full_size_empty((3, 4), torch.zeros(1, dtype=torch.float64)).dtype == torch.float64
    big = (LARGE[0] + 1, LARGE[1])
    assert full_size_empty(big, torch.zeros(1, dtype=torch.int64)).dtype == torch.int64
    with Seen() as mode:
        x = full_size_empty(big, torch.zeros(1))
    assert x.shape == big
    assert any("empty" in op for op in mode.ops)  # a mode sees the allocation


# --- the mappings kept for the next call ------------------------------------------------------

needs_madvise = pytest.mark.skipif(not hasattr(mmap, "MADV_HUGEPAGE"), reason="no MADV_HUGEPAGE")
BIG = (2 * LARGE[0], LARGE[1])  # 128 MB of fp32, 64 of bf16: over the threshold in both


@pytest.fixture()
def no_kept_mappings() -> Iterator[None]:
    blocks.release_outputs()
    yield
    blocks.release_outputs()


def _kept() -> list[bool]:
    return [mapping.free() for mapping in blocks._MAPPINGS]


@needs_madvise
def test_a_freed_output_is_the_next_calls_and_a_live_one_or_its_view_never_is(
    no_kept_mappings: None,
) -> None:
    first = full_size_empty(BIG, torch.zeros(1))
    address = first.data_ptr()
    view = first[1:, :7].t()  # a view of a slice: the storage, not the tensor, holds it
    del first
    gc.collect()
    second = full_size_empty(BIG, torch.zeros(1))
    assert second.data_ptr() != address and _kept() == [False, False]
    view.fill_(1.0)
    second.fill_(2.0)  # the two own separate memory
    assert float(view.min()) == 1.0
    del view
    gc.collect()
    smaller = full_size_empty((2 * BIG[0] - 5, BIG[1]), torch.zeros(1, dtype=torch.bfloat16))
    assert smaller.data_ptr() == address, "a freed mapping at least as large is reused"
    assert smaller.dtype == torch.bfloat16 and smaller.is_contiguous()
    assert float(second.min()) == 2.0
    del second, smaller
    gc.collect()
    assert _kept() == [True, True]


@needs_madvise
def test_free_mappings_too_small_are_unmapped_and_at_most_the_kept_number_stay(
    no_kept_mappings: None,
) -> None:
    outputs = [full_size_empty(BIG, torch.zeros(1)) for _ in range(blocks.KEPT_FREE_MAPPINGS + 2)]
    del outputs
    gc.collect()
    assert len(blocks._MAPPINGS) == blocks.KEPT_FREE_MAPPINGS + 2  # dropped at the next call
    big = full_size_empty(BIG, torch.zeros(1))
    assert _kept() == [False] + [True] * blocks.KEPT_FREE_MAPPINGS
    larger = full_size_empty((2 * BIG[0], BIG[1]), torch.zeros(1))  # the free ones are too small
    assert _kept() == [False, False] and larger.untyped_storage().nbytes() == 2 * big.numel() * 4
    del big
    gc.collect()
    blocks.release_outputs()
    assert _kept() == [False], "only the mapping in use stays"
    del larger


@needs_madvise
def test_a_call_a_fifth_larger_fits_the_freed_mapping(no_kept_mappings: None) -> None:
    first = full_size_empty(BIG, torch.zeros(1))
    address = first.data_ptr()
    del first
    gc.collect()
    grown = full_size_empty((BIG[0] + BIG[0] // 5, BIG[1]), torch.zeros(1))
    assert grown.data_ptr() == address and _kept() == [False]
    grown.fill_(1.0)  # all of it is mapped
    assert float(grown[-1].sum()) == BIG[1]


@needs_madvise
def test_no_mapping_is_kept_when_keeping_is_off(
    no_kept_mappings: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(blocks, "KEPT_FREE_MAPPINGS", 0)
    first = full_size_empty(BIG, torch.zeros(1))
    del first
    gc.collect()
    second = full_size_empty(BIG, torch.zeros(1))
    assert _kept() == [False]
    del second


@needs_madvise
def test_threads_asking_at_once_never_share_a_mapping(no_kept_mappings: None) -> None:
    held: list[Tensor] = []
    lock = threading.Lock()
    start = threading.Barrier(4)

    def ask() -> None:
        start.wait()
        for _ in range(3):
            x = full_size_empty(BIG, torch.zeros(1))
            with lock:
                held.append(x)
            del x

    threads = [threading.Thread(target=ask) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len({x.data_ptr() for x in held}) == 12


@needs_madvise
def test_a_gradient_kept_across_steps_is_not_overwritten_by_the_next(
    no_kept_mappings: None,
) -> None:
    # the public path: get_logprobs_for_tokens's backward writes its gradient in such a mapping
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(BIG, generator=gen).mul_(3.0).requires_grad_()
    tokens = torch.randint(0, BIG[1], (BIG[0],), generator=gen)
    expected = torch.softmax(logits.detach().double(), -1).neg_()
    expected[torch.arange(BIG[0]), tokens] += 1.0
    klpen.get_logprobs_for_tokens(logits, tokens).sum().backward()
    kept, address = logits.grad, logits.grad.data_ptr()
    logits.grad = None
    (2.0 * klpen.get_logprobs_for_tokens(logits, tokens).sum()).backward()
    second = logits.grad.data_ptr()
    assert second != address and len(blocks._MAPPINGS) == 2
    torch.testing.assert_close(kept.double(), expected, rtol=0, atol=1e-6)
    torch.testing.assert_close(logits.grad.double(), 2.0 * expected, rtol=0, atol=2e-6)
    del kept
    logits.grad = None
    gc.collect()
    klpen.get_logprobs_for_tokens(logits, tokens).sum().backward()
    assert logits.grad.data_ptr() in (address, second) and len(blocks._MAPPINGS) == 2
    torch.testing.assert_close(logits.grad.double(), expected, rtol=0, atol=1e-6)
