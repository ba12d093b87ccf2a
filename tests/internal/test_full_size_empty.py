"""``full_size_empty``: a kernel's large CPU output, mapped with huge pages advised."""

from __future__ import annotations

import gc
import mmap
import weakref

import pytest
import torch
from public_calls import ThroughKlpenOps

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
