"""The hidden-state path's products of a bf16 call (`kernels.torch_linear.product_precision`).

Where every input of ``linear_logprobs`` / ``linear_full_kl`` is bf16, the passes' fp32 products
take bf16 operands with fp32 accumulation and results (oneDNN's bf16 "fpmath" mode): their
operands are bf16 values widened exactly, so the logits lose nothing. Checked here: the mode is
on for every product of such a call, forward and backward, and for no product of any other
call (fp32, a bf16 hidden state with an fp32 weight, a bf16 policy against an fp32 reference);
the process-wide setting is restored after every call, after an error too, and a user's own
setting (the legacy ``torch.set_float32_matmul_precision`` included) survives; at shapes where
oneDNN's bf16 kernels run, values stay within fp32 rounding of float64 and far inside the
unfused bf16 path's error.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
import torch
from torch import Tensor

import klpen
import klpen.kernels.torch_linear as lin
from klpen.linear import linear_full_kl, linear_logprobs

_MATMUL = getattr(torch.backends.mkldnn, "matmul", None)
pytestmark = pytest.mark.skipif(
    not hasattr(_MATMUL, "fp32_precision"),
    reason="this torch has no per-backend matmul precision: IEEE products",
)


@pytest.fixture(autouse=True)
def precision_settings() -> Iterator[None]:
    """Put torch's matmul precision settings back as they were, whatever a test set."""
    saved = (
        torch.backends.fp32_precision,
        _MATMUL.fp32_precision,
        torch.backends.cuda.matmul.fp32_precision,
    )
    yield
    torch.backends.fp32_precision = saved[0]
    _MATMUL.fp32_precision = saved[1]
    torch.backends.cuda.matmul.fp32_precision = saved[2]


@pytest.fixture
def modes(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The mkldnn fp32 matmul precision at every logits product of a pass (forward and the
    backward's recomputation, whose gradient products run under the same setting)."""
    seen: list[str] = []
    tile = lin._logit_tile

    def spy(*args: object) -> Tensor:
        seen.append(_MATMUL.fp32_precision)
        return tile(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(lin, "_logit_tile", spy)
    return seen


def _layer(n: int, h: int, v: int, seed: int = 0) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, generator=g, dtype=torch.float64)
    w = torch.randn(v, h, generator=g, dtype=torch.float64) * (3 / math.sqrt(h))
    rx = x + 0.1 * torch.randn(n, h, generator=g, dtype=torch.float64)
    rw = w + 0.01 * torch.randn(v, h, generator=g, dtype=torch.float64)
    return x, w, rx, rw


def _logprob_step(x: Tensor, w: Tensor, tokens: Tensor) -> None:
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    lp, ent = linear_logprobs(xg, wg, tokens, return_entropy=True)
    (lp.sum() + ent.sum()).backward()


def _kl_step(x: Tensor, w: Tensor, rx: Tensor, rw: Tensor) -> None:
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    linear_full_kl(xg, wg, rx, rw).sum().backward()


def test_a_bf16_call_multiplies_in_bf16_mode_forward_and_backward(modes: list[str]) -> None:
    x, w, rx, rw = (a.bfloat16() for a in _layer(5, 8, 60))
    tokens = torch.arange(5) * 7
    before = _MATMUL.fp32_precision
    _logprob_step(x, w, tokens)
    assert _MATMUL.fp32_precision == before
    _kl_step(x, w, rx, rw)
    assert _MATMUL.fp32_precision == before
    # forward (logprob, KL: two layers) and the backward's recomputed tiles all took the mode
    assert len(modes) >= 4 and set(modes) == {"bf16"}


@pytest.mark.parametrize(
    "dtypes",
    [
        ("float32", "float32", "float32"),  # fp32: IEEE products
        ("bfloat16", "float32", "float32"),  # a bf16 hidden state with an fp32 weight
        ("bfloat16", "bfloat16", "float32"),  # a bf16 policy against an fp32 reference
        ("float16", "float16", "float16"),  # fp16 values are not bf16 values
    ],
)
def test_no_other_call_changes_the_products(modes: list[str], dtypes: tuple[str, str, str]) -> None:
    x, w, rx, rw = _layer(5, 8, 60)
    hx, hw, ref = (getattr(torch, name) for name in dtypes)
    x, w, rx, rw = x.to(hx), w.to(hw), rx.to(ref), rw.to(ref)
    before = _MATMUL.fp32_precision
    if hx == hw != torch.bfloat16:  # (a bf16 policy's own log-probs are a bf16 call)
        _logprob_step(x, w, torch.arange(5) * 7)
    _kl_step(x, w, rx, rw)
    assert modes and set(modes) == {before} and "bf16" not in modes


def test_the_setting_is_restored_after_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    x, w, _, _ = (a.bfloat16() for a in _layer(5, 8, 60))
    before = _MATMUL.fp32_precision

    def fail(*args: object) -> Tensor:
        assert _MATMUL.fp32_precision == "bf16"
        raise RuntimeError("a tile failed")

    monkeypatch.setattr(lin.TorchTiles, "linear_logprob_tile", fail)
    with pytest.raises(RuntimeError, match="a tile failed"):
        linear_logprobs(x, w, torch.arange(5))
    assert _MATMUL.fp32_precision == before


@pytest.mark.parametrize("legacy", ["highest", "high", "medium"])
def test_a_users_legacy_matmul_precision_survives(legacy: str) -> None:
    torch.set_float32_matmul_precision(legacy)
    x, w, rx, rw = (a.bfloat16() for a in _layer(5, 8, 60))
    _logprob_step(x, w, torch.arange(5))
    _kl_step(x, w, rx, rw)
    # the legacy getter raises if the per-backend settings were left inconsistent
    assert torch.get_float32_matmul_precision() == legacy


def test_bf16_values_at_a_real_shape_are_those_of_fp32_logits() -> None:
    # Default tiles (no monkeypatching): oneDNN's bf16 kernels do these products.
    x, w, rx, rw = _layer(96, 256, 3000, seed=1)
    xb, wb, rxb, rwb = (a.bfloat16() for a in (x, w, rx, rw))
    tokens = torch.randint(0, 3000, (96,), generator=torch.Generator().manual_seed(2))
    # the exact values of these bf16 inputs
    x64, w64, rx64, rw64 = (a.double() for a in (xb, wb, rxb, rwb))
    logits = x64 @ w64.T
    exact_lp = torch.log_softmax(logits, -1).gather(-1, tokens[:, None]).squeeze(-1)
    exact_kl = klpen.full_kl(logits, rx64 @ rw64.T)
    lp = linear_logprobs(xb, wb, tokens)
    kl = linear_full_kl(xb, wb, rxb, rwb)
    unfused_lp = klpen.get_logprobs_for_tokens(xb @ wb.T, tokens)  # bf16 logits
    unfused_kl = klpen.full_kl(xb @ wb.T, rxb @ rwb.T)
    err_lp = (lp.double() - exact_lp).abs().max().item()
    err_kl = ((kl.double() - exact_kl).abs() / exact_kl).max().item()
    assert err_lp < 2e-5 and err_lp * 100 < (unfused_lp.double() - exact_lp).abs().max().item()
    assert err_kl < 1e-4 and err_kl * 10 < ((unfused_kl.double() - exact_kl).abs() / exact_kl).max()


def test_bf16_gradients_are_those_of_the_unfused_bf16_backward() -> None:
    # The logit gradient is rounded to bf16 inside its products, as autograd rounds the
    # unfused path's ∂L/∂logits to the logits' dtype: the two agree to bf16 rounding.
    x, w, _, _ = _layer(96, 256, 3000, seed=3)
    tokens = torch.randint(0, 3000, (96,), generator=torch.Generator().manual_seed(4))
    xb, wb = x.bfloat16().requires_grad_(), w.bfloat16().requires_grad_()
    linear_logprobs(xb, wb, tokens).sum().backward()
    xu, wu = x.bfloat16().requires_grad_(), w.bfloat16().requires_grad_()
    klpen.get_logprobs_for_tokens(xu @ wu.T, tokens).sum().backward()
    x64, w64 = xb.detach().double().requires_grad_(), wb.detach().double().requires_grad_()
    klpen.get_logprobs_for_tokens(x64 @ w64.T, tokens).sum().backward()
    for fused, unfused, exact in ((xb, xu, x64), (wb, wu, w64)):
        assert fused.grad is not None and unfused.grad is not None and exact.grad is not None
        scale = exact.grad.abs().max().item()
        err = (fused.grad.double() - exact.grad).abs().max().item() / scale
        err_unfused = (unfused.grad.double() - exact.grad).abs().max().item() / scale
        assert err < 2 * err_unfused + 2**-9
