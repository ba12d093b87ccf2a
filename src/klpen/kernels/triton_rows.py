# mypy: disable-error-code="untyped-decorator"
"""What the Triton kernels of :mod:`klpen.kernels.triton_backend` and
:mod:`klpen.kernels.triton_jsd` share: the compute dtype, the row layout of a ``(..., V)``
logits tensor as at most two strides (one program per row), and the jitted helpers both use
(a row's start, ``expm1(v) - v`` without cancellation, the bfloat16 rounding of a store).
"""

from __future__ import annotations

import torch
import triton  # type: ignore[import-untyped]
import triton.language as tl  # type: ignore[import-untyped]
from torch import Tensor

__all__: list[str] = []


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _tl_dtype(dtype: torch.dtype) -> tl.constexpr:
    return tl.float64 if dtype == torch.float64 else tl.float32


def _layout(x: Tensor) -> tuple[Tensor, int, int, int, int]:
    """``(x, n_inner, stride_outer, stride_inner, stride_v)``: the rows as at most two strides.

    Row ``r`` of the flattened leading axes starts at ``(r // n_inner) * stride_outer +
    (r % n_inner) * stride_inner``. Leading axes that cannot be merged into two are copied
    (contiguous tensors and views like ``logits[:, :-1]`` never are).
    """
    merged: list[tuple[int, int]] = []
    for size, stride in zip(x.shape[:-1], x.stride()[:-1], strict=True):
        if size == 1:
            continue
        if merged and merged[-1][1] == stride * size:
            merged[-1] = (merged[-1][0] * size, stride)
        else:
            merged.append((size, stride))
    if len(merged) > 2:
        x = x.contiguous()
        merged = [(x.numel() // x.shape[-1], x.shape[-1])]
    if not merged:
        return x, 1, 0, 0, x.stride(-1)
    if len(merged) == 1:
        return x, merged[0][0], 0, merged[0][1], x.stride(-1)
    return x, merged[1][0], merged[0][1], merged[1][1], x.stride(-1)


@triton.jit
def _row_start(ptr, row, n_inner, stride_outer, stride_inner):  # type: ignore[no-untyped-def]
    return ptr + (row // n_inner) * stride_outer + (row % n_inner) * stride_inner


@triton.jit
def _expm1_minus_series(v, DT: tl.constexpr, LONG: tl.constexpr):  # type: ignore[no-untyped-def]
    """``(expm1(v) - v) / v²`` for ``|v| < 1/2`` by its series ``Σ_(n≥2) v^(n-2) / n!`` in
    Horner's rule, in multiply-adds: to ``n = 16`` in float64, ``n = 9`` in float32, or, with
    ``LONG``, to ``n = 20`` and ``n = 11`` (the first term left out is below
    ``2 (1/2)^(n-1) / (n+1)!`` of the sum: ``2e-19`` and ``2e-9``, or ``2e-25`` and
    ``5e-12``). ``v`` a block or a scalar."""
    if DT == tl.float64:
        if LONG:
            p = 4.110317623312165e-19 * v + 8.22063524662433e-18  # 1/20!, 1/19!
            p = p * v + 1.5619206968586225e-16  # 1/18!
            p = p * v + 2.8114572543455206e-15  # 1/17!
            p = p * v + 4.779477332387385e-14  # 1/16!
            p = p * v + 7.647163731819816e-13  # 1/15!
        else:
            p = 4.779477332387385e-14 * v + 7.647163731819816e-13  # 1/16!, 1/15!
        p = p * v + 1.1470745597729725e-11  # 1/14!
        p = p * v + 1.6059043836821613e-10  # 1/13!
        p = p * v + 2.08767569878681e-09  # 1/12!
        p = p * v + 2.505210838544172e-08  # 1/11!
        p = p * v + 2.755731922398589e-07  # 1/10!
        p = p * v + 2.7557319223985893e-06  # 1/9!
        p = p * v + 2.48015873015873e-05  # 1/8!
    elif LONG:
        p = 2.505210838544172e-08 * v + 2.755731922398589e-07  # 1/11!, 1/10!
        p = p * v + 2.7557319223985893e-06  # 1/9!
        p = p * v + 2.48015873015873e-05  # 1/8!
    else:
        p = 2.7557319223985893e-06 * v + 2.48015873015873e-05  # 1/9!, 1/8!
    p = p * v + 0.0001984126984126984  # 1/7!
    p = p * v + 0.001388888888888889  # 1/6!
    p = p * v + 0.008333333333333333  # 1/5!
    p = p * v + 0.041666666666666664  # 1/4!
    p = p * v + 0.16666666666666666  # 1/3!
    p = p * v + 0.5  # 1/2!
    return p


@triton.jit
def _expm1_minus(v, DT: tl.constexpr):  # type: ignore[no-untyped-def]
    """``expm1(v) - v`` without cancellation: below ``|v| = 1/2`` ``v² P(v)`` by
    :func:`_expm1_minus_series` (its long form: truncation below the dtype's precision), else
    ``exp(v) - 1 - v``. ``v`` a block or a scalar."""
    direct = tl.exp(v) - 1.0 - v
    return tl.where(tl.abs(v) < 0.5, _expm1_minus_series(v, DT, True) * v * v, direct)


@triton.jit
def _to_bf16(x):  # type: ignore[no-untyped-def]
    """fp32 ``x`` rounded to the nearest bfloat16 (ties to even), NaN kept NaN, by its bits:
    the rounding of torch's cast and of the GPU's, which Triton's interpreter truncates."""
    bits = x.to(tl.uint32, bitcast=True)
    rounded = (bits + (0x7FFF + ((bits >> 16) & 1))) >> 16
    top = tl.where(x != x, (bits >> 16) | 0x40, rounded)
    return top.to(tl.uint16).to(tl.bfloat16, bitcast=True)


def _pair_layout(
    policy: Tensor, reference: Tensor
) -> tuple[Tensor, Tensor, tuple[int, int, int, int, int, int, int]]:
    """:func:`_layout` of both logits tensors, with one row layout for both: where their
    inner row counts differ, the reference's rows are re-expressed with the policy's (a
    contiguous copy of the reference). Returns ``(z, w, strides)``, ``strides`` the pair
    kernels' ``(n_inner, zs_outer, zs_inner, zs_v, ws_outer, ws_inner, ws_v)``."""
    z, n_inner, zo, zi, zv = _layout(policy)
    w, w_inner, wo, wi, wv = _layout(reference)
    if w_inner != n_inner:
        vocab = policy.shape[-1]
        w = reference.contiguous()
        wo, wi, wv = vocab * n_inner, vocab, 1
    return z, w, (n_inner, zo, zi, zv, wo, wi, wv)
