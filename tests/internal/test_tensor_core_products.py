"""The hidden-state path's logits products on CUDA (issue 42 item 5), checked by dispatch.

No CUDA runs here: the choice of product is a pure function of the device, the inputs' common
half dtype and the installed torch (``product_dtype``), and the op it issues is recorded by a
dispatch mode on meta tensors: half operands with fp32 results (``aten::mm.dtype_out``, the
tensor cores' bf16/fp16 products with fp32 accumulation), never a logit rounded to half.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import klpen.kernels.torch_linear as lin

CUDA, CPU = torch.device("cuda"), torch.device("cpu")


class Ops(TorchDispatchMode):
    """Records ``(op, input dtypes, output dtype)`` of every op."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, tuple[torch.dtype, ...], torch.dtype | None]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        dtypes = tuple(a.dtype for a in args if isinstance(a, torch.Tensor))
        result = out.dtype if isinstance(out, torch.Tensor) else None
        self.seen.append((str(func), dtypes, result))
        return out


@pytest.mark.skipif(not lin._HAS_OUT_DTYPE, reason="torch without out_dtype products")
def test_half_inputs_on_cuda_take_half_operands() -> None:
    assert lin.product_dtype(CUDA, torch.bfloat16) == torch.bfloat16
    assert lin.product_dtype(CUDA, torch.float16) == torch.float16


def test_elsewhere_the_products_are_in_the_compute_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    assert lin.product_dtype(CPU, torch.bfloat16) is None  # IEEE fp32 on the CPU
    assert lin.product_dtype(CUDA, None) is None  # mixed or fp32 inputs
    monkeypatch.setattr(lin, "_HAS_OUT_DTYPE", False)  # torch 2.4 and 2.5
    assert lin.product_dtype(CUDA, torch.bfloat16) is None


@pytest.mark.skipif(not lin._HAS_OUT_DTYPE, reason="torch without out_dtype products")
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("narrow", [torch.bfloat16, torch.float16])
def test_a_logits_tile_issues_a_half_product_with_fp32_results(
    monkeypatch: pytest.MonkeyPatch, bias: bool, narrow: torch.dtype
) -> None:
    """``_logit_tile`` as a CUDA call runs it (the device choice patched in: meta tensors)."""
    monkeypatch.setattr(lin, "product_dtype", lambda device, dtype: dtype)
    meta = torch.device("meta")
    hidden = torch.empty(6, 8, device=meta)  # widened to the compute dtype by linear.py
    weight = torch.empty(40, 8, dtype=narrow, device=meta)
    b = torch.empty(40, dtype=narrow, device=meta) if bias else None
    layer = lin.Layer(hidden, weight, b, 1.0, torch.float32, narrow=narrow)
    tile = lin.Tile(0, 6, 8, 24)
    buf = torch.empty(6, 16, device=meta)
    wide = torch.empty(16, 8, device=meta)  # what _weight_tile would give: not used
    with Ops() as ops:
        out = lin._logit_tile(layer, tile, wide, buf)
    assert out.dtype == torch.float32 and out.shape == (6, 16)
    products = [s for s in ops.seen if "mm" in s[0]]
    name = "aten.addmm.dtype_out" if bias else "aten.mm.dtype_out"
    assert [p[0] for p in products] == [name]
    operands = products[0][1][1:3] if bias else products[0][1][:2]
    assert operands == (narrow, narrow)
    assert products[0][2] == torch.float32


def test_without_a_half_dtype_the_product_is_fp32() -> None:
    meta = torch.device("meta")
    weight = torch.empty(40, 8, dtype=torch.bfloat16, device=meta)
    layer = lin.Layer(torch.empty(6, 8, device=meta), weight, None, 1.0, torch.float32)
    wide = torch.empty(16, 8, device=meta)
    with Ops() as ops:
        lin._logit_tile(layer, lin.Tile(0, 6, 8, 24), wide, torch.empty(6, 16, device=meta))
    products = [s for s in ops.seen if "mm" in s[0]]
    assert [p[0] for p in products] == ["aten.mm.out"]
    assert products[0][1][:2] == (torch.float32, torch.float32)
