"""linear_logprobs with a frozen output layer (LoRA, a frozen ``lm_head``): the forward keeps
each row's log-prob gradient w.r.t. its hidden state, and backward is one multiply.

Where only ``hidden`` requires grad (and no entropy is asked), the forward pass also sums
``Σ_v e^{z_v} W_v`` tile by tile, so that ``∂ log π(y)/∂x = (W_y - Σ_v π(v) W_v) / T`` is known
when it ends; backward then multiplies it by the upstream gradient instead of recomputing the
logits. References: the unfused float64 path (``hidden @ weight.T + bias`` and torch's
``log_softmax``), and the same call with the weight requiring grad (the tile-pass backward).
Small tiles (monkeypatched) make every test walk several row blocks and vocabulary tiles.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import pytest
import torch
from probes import threads
from torch import Tensor

import klpen
import klpen.kernels.torch_linear as lin
import klpen.linear
from klpen.kernels.blocks import sync_free_on_cpu
from klpen.linear import linear_logprobs


@pytest.fixture(autouse=True)
def small_tiles(monkeypatch: pytest.MonkeyPatch) -> None:
    # 3 rows x 16 vocabulary entries per tile: many tiles, ragged edges, several row blocks.
    monkeypatch.setattr(lin, "CHUNK_ELEMENTS", 48)
    monkeypatch.setattr(lin, "_MAX_TILE_ROWS", 3)
    monkeypatch.setattr(lin, "_MIN_TILE_COLS", 1)


def _inputs(seed: int = 3) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """float64 hidden (11, 6), weight (90, 6), bias with -inf entries, tokens: rows that
    take every path (shift-free, logits of 1e3 redone with their max, a masked vocabulary)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(11, 6, generator=g, dtype=torch.float64)
    w = torch.randn(90, 6, generator=g, dtype=torch.float64) / math.sqrt(6) * 3
    b = torch.randn(90, generator=g, dtype=torch.float64)
    b[::7] = -math.inf
    x[4] *= 1e3 / x[4].abs().max()  # its fp32 shift-free sums overflow: redone shifted
    tokens = torch.randint(0, 90, (11,), generator=g)
    tokens[tokens % 7 == 0] += 1  # no masked token: finite log-probs
    return x, w, b, tokens


def _reference(x: Tensor, w: Tensor, b: Tensor | None, tokens: Tensor, t: float) -> Tensor:
    """``∂ Σ_i g_i log π(y_i) / ∂x`` in float64 through torch's log_softmax, ``g`` = ``_g``."""
    x64 = x.detach().double().requires_grad_()
    logits = x64 @ w.double().T + (0.0 if b is None else b.double())
    lp = torch.log_softmax(logits / t, -1).gather(-1, tokens[..., None]).squeeze(-1)
    (grad,) = torch.autograd.grad((lp * _g(lp.shape[0])).sum(), x64)
    return grad


def _g(n: int) -> Tensor:
    return torch.linspace(-1.5, 2.0, n, dtype=torch.float64)


@contextlib.contextmanager
def tile_backward_calls() -> Iterator[list[int]]:
    """Counts the backward passes over the recomputed tiles (``backprop``)."""
    calls: list[int] = []
    real = klpen.linear.backprop

    def spy(*args: object, **kwargs: object) -> object:
        calls.append(1)
        return real(*args, **kwargs)  # type: ignore[arg-type]

    with pytest.MonkeyPatch.context() as m:
        m.setattr(klpen.linear, "backprop", spy)
        yield calls


def _frozen_grad(
    x: Tensor, w: Tensor, b: Tensor | None, tokens: Tensor, t: float
) -> tuple[Tensor, Tensor]:
    xg = x.clone().requires_grad_()
    lp = linear_logprobs(xg, w, tokens, bias=b, temperature=t)
    (grad,) = torch.autograd.grad((lp * _g(lp.shape[0]).to(lp.dtype)).sum(), xg)
    return lp, grad


MODES = ["checks", "validation-off", "sync-free"]


def _mode(name: str) -> contextlib.ExitStack:
    stack = contextlib.ExitStack()
    if name != "checks":
        stack.enter_context(klpen.validation(False))
    if name == "sync-free":
        stack.enter_context(sync_free_on_cpu())
    return stack


@pytest.mark.parametrize("backend", klpen.available_backends())
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("t", [1.0, 0.7])
def test_the_hidden_gradient_of_a_frozen_head_matches_float64(
    backend: str, dtype: torch.dtype, mode: str, t: float
) -> None:
    x, w, b, tokens = (a.to(dtype) if a.is_floating_point() else a for a in _inputs())
    with klpen.use_backend(backend), _mode(mode), tile_backward_calls() as calls:
        lp, grad = _frozen_grad(x, w, b, tokens, t)
        with torch.no_grad():
            plain = linear_logprobs(x, w, tokens, bias=b, temperature=t)
    assert calls == []  # no pass over the tiles in backward
    assert torch.equal(lp, plain)  # the same log-probs, bit for bit, as without grad
    want = _reference(x, w, b, tokens, t)
    tol = 1e-10 if dtype == torch.float64 else 2e-4
    assert grad.dtype == dtype and bool(torch.isfinite(grad).all())
    # fp32: the logits of the 1e3 row carry rounding errors of 1e-4 (relative 1e-7)
    torch.testing.assert_close(grad.double(), want, rtol=tol * 5, atol=tol * 10)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_it_agrees_with_the_tile_pass_backward(dtype: torch.dtype) -> None:
    """Against the same call with the weight requiring grad (the recomputing backward)."""
    x, w, _, tokens = (a.to(dtype) if a.is_floating_point() else a for a in _inputs(5))
    with tile_backward_calls() as calls:
        lp, grad = _frozen_grad(x, w, None, tokens, 0.8)
    assert calls == []
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    with tile_backward_calls() as calls:
        other = linear_logprobs(xg, wg, tokens, temperature=0.8)
        (other * _g(11).to(other.dtype)).sum().backward()
    assert calls == [1]
    assert torch.equal(lp, other)
    assert xg.grad is not None and xg.grad.dtype == grad.dtype == dtype
    tol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    scale = xg.grad.abs().max().item()
    # Row 4's logits (about 1e3) carry fp32 rounding errors of about 1e-4, differently in the
    # two passes (tiles of other shapes): there each is within the float64 test's bound.
    ours, theirs = grad.double(), xg.grad.double()
    rest = torch.arange(ours.shape[0]) != 4
    torch.testing.assert_close(ours[rest], theirs[rest], rtol=tol, atol=tol * scale)
    far = max(tol, 2e-3) if dtype == torch.float32 else tol
    torch.testing.assert_close(ours[4], theirs[4], rtol=far, atol=far * scale)


@pytest.mark.parametrize(
    "case",
    ["weight requires grad", "bias requires grad", "entropy", "no grad", "hidden frozen"],
)
def test_the_tile_pass_backward_stays_where_more_is_asked(case: str) -> None:
    """The forward keeps the row gradients only where the hidden gradient alone is needed."""
    x, w, b, tokens = _inputs()
    xg = x.clone().requires_grad_(case != "hidden frozen")
    wg = w.clone().requires_grad_(case == "weight requires grad")
    bg = b.clone().requires_grad_(case == "bias requires grad")
    seen: list[bool] = []
    real = lin.token_sums

    def spy(*args: object, **kwargs: object) -> lin.Sums:
        seen.append(kwargs.get("mix") is not None)
        return real(*args, **kwargs)  # type: ignore[arg-type]

    with pytest.MonkeyPatch.context() as m:
        m.setattr(lin, "token_sums", spy)
        with torch.set_grad_enabled(case != "no grad"):
            out = linear_logprobs(xg, wg, tokens, bias=bg, return_entropy=case == "entropy")
    assert seen and not any(seen)
    if out[0].requires_grad if isinstance(out, tuple) else out.requires_grad:
        with tile_backward_calls() as calls:
            total = sum(o.sum() for o in out) if isinstance(out, tuple) else out.sum()
            total.backward()
        assert calls == [1]


def test_a_nan_row_stays_in_its_row_with_validation_off() -> None:
    """A masked slot holding NaN: its own gradient is NaN (as torch's unfused path gives, and
    the tile-pass backward), every other row's is exact."""
    x, w, b, tokens = _inputs()
    x[2] = math.nan
    g = _g(11)
    g[2] = 0.0
    with klpen.validation(False):
        xg = x.clone().requires_grad_()
        lp = linear_logprobs(xg, w, tokens, bias=b)
        (torch.where(g != 0, lp, 0.0) * g).sum().backward()
        xo, wo = x.clone().requires_grad_(), w.clone().requires_grad_()
        other = linear_logprobs(xo, wo, tokens, bias=b)
        (torch.where(g != 0, other, 0.0) * g).sum().backward()
    assert xg.grad is not None and xo.grad is not None
    keep = torch.arange(11) != 2
    assert bool(torch.isfinite(xg.grad[keep]).all())
    torch.testing.assert_close(xg.grad[keep], xo.grad[keep], rtol=1e-12, atol=1e-12)
    assert torch.isnan(xg.grad[2]).all() == torch.isnan(xo.grad[2]).all()


def test_a_second_derivative_is_refused_by_name() -> None:
    x, w, b, tokens = _inputs()
    xg = x.clone().requires_grad_()
    (grad,) = torch.autograd.grad(
        linear_logprobs(xg, w, tokens, bias=b).sum(), xg, create_graph=True
    )
    with pytest.raises(RuntimeError, match="linear_logprobs has no second derivative"):
        grad.sum().backward()


def test_batch_shapes_and_an_empty_batch() -> None:
    x, w, b, tokens = _inputs()
    xg = x[:10].reshape(2, 5, 6).clone().requires_grad_()
    lp = linear_logprobs(xg, w, tokens[:10].reshape(2, 5), bias=b)
    (lp * _g(10).reshape(2, 5)).sum().backward()
    assert xg.grad is not None and xg.grad.shape == (2, 5, 6)
    _, flat = _frozen_grad(x[:10], w, b, tokens[:10], 1.0)
    assert torch.equal(xg.grad.reshape(10, 6), flat)
    empty = torch.zeros(0, 6, dtype=torch.float64, requires_grad=True)
    out = linear_logprobs(empty, w, torch.zeros(0, dtype=torch.long))
    out.sum().backward()
    assert empty.grad is not None and empty.grad.shape == (0, 6)


@pytest.mark.parametrize("count", [1, 2])
def test_memory_is_the_scratch_and_a_few_hidden_sized_buffers(
    count: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Forward: the fused scratch, one ``(N, H)`` fp32 buffer per group in flight and the row
    gradients it keeps; backward: the hidden gradient alone (no tile is recomputed)."""
    from klpen_book.hidden_states import fused_scratch_bytes
    from klpen_book.memory import peak_extra_bytes

    monkeypatch.undo()
    n, h, v = 1024, 16, 32_000
    g = torch.Generator().manual_seed(14)
    x, w = torch.randn(n, h, generator=g), torch.randn(v, h, generator=g) / 4
    tokens = torch.randint(0, v, (n,), generator=g)
    xg = x.clone().requires_grad_()
    out: list[Tensor] = []
    with threads(count):
        forward = peak_extra_bytes(lambda: out.append(linear_logprobs(xg, w, tokens)))
        backward = peak_extra_bytes(lambda: out[0].sum().backward())
    hidden_sized = 4 * n * h
    assert (
        forward
        <= 1.05 * fused_scratch_bytes(n, h, v, half=False, workers=count)
        + (count + 1) * hidden_sized
    )
    assert forward < 0.15 * 4 * n * v
    assert backward <= 1.05 * hidden_sized + 4096
