"""Kernel backends (contract section 7): the registry, the switch, and every backend against
the ``torch`` oracle.

Every backend other than ``"torch"`` is compared with the torch oracle (values and gradients);
every backend, the oracle included, is checked against float64 ``log_softmax`` and on invalid
rows.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import torch
from torch import Tensor

import klpen
from klpen.kernels import select_backend

BACKENDS = klpen.available_backends()
# The backends compared with the torch oracle (never the oracle with itself).
OTHERS = tuple(b for b in BACKENDS if b != "torch")
G = torch.Generator().manual_seed(0)


def _logits(*shape: int, dtype: torch.dtype = torch.float32, scale: float = 3.0) -> Tensor:
    return (torch.randn(*shape, generator=G, dtype=torch.float64) * scale).to(dtype)


def test_torch_is_always_available_and_first() -> None:
    assert BACKENDS[0] == "torch"
    assert set(BACKENDS) <= {"torch", "triton"}
    assert select_backend(torch.zeros(1)).name == "torch"  # "auto" on the CPU


def test_unknown_backend_is_refused_listing_the_available_ones() -> None:
    listed = ", ".join(repr(n) for n in BACKENDS)
    with pytest.raises(ValueError, match=f"backend must be one of 'auto', {listed}"):
        with klpen.use_backend("cuda-magic"):
            pass
    if "triton" not in BACKENDS:
        with pytest.raises(ValueError, match="got 'triton'"):
            klpen.use_backend("triton").__enter__()


def test_use_backend_is_scoped_and_per_thread() -> None:
    seen: list[str] = []
    with klpen.use_backend("torch"):
        assert select_backend(torch.zeros(1)).name == "torch"
        thread = threading.Thread(target=lambda: seen.append(select_backend(torch.zeros(1)).name))
        thread.start()
        thread.join()
    assert seen == ["torch"]  # "auto" in the other thread: torch on the CPU


def _cases() -> list[tuple[str, Callable[[Tensor], object]]]:
    tokens = torch.randint(0, 33, (3, 5), generator=G)
    ref = _logits(3, 5, 33)
    return [
        ("get_logprobs_for_tokens", lambda z: klpen.get_logprobs_for_tokens(z, tokens)),
        ("temperature", lambda z: klpen.get_logprobs_for_tokens(z, tokens, temperature=0.6)),
        ("next_token_logprobs", lambda z: klpen.next_token_logprobs(z, tokens)),
        ("token_entropy", lambda z: klpen.token_entropy(z, temperature=1.7)),
        ("logprobs_and_entropy", lambda z: klpen.logprobs_and_entropy(z, tokens)),
        ("full_kl", lambda z: klpen.full_kl(z, ref.to(z.dtype), temperature=0.8)),
    ]


def _loss(out: object) -> Tensor:
    parts = out if isinstance(out, tuple) else (out,)
    w = torch.linspace(0.5, 1.5, parts[0].numel()).view(parts[0].shape)
    return sum((p.double() * w).sum() for p in parts)  # type: ignore[return-value]


@pytest.mark.parametrize("backend", OTHERS)
@pytest.mark.parametrize(("name", "call"), _cases(), ids=[c[0] for c in _cases()])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("strided", [False, True])
def test_backend_matches_the_torch_oracle(
    backend: str, name: str, call: Callable[[Tensor], object], dtype: torch.dtype, strided: bool
) -> None:
    # strided: the next-token shift's view of a longer tensor, never copied by klpen
    z = _logits(3, 6 if strided else 5, 33, dtype=dtype)

    def view(t: Tensor) -> Tensor:
        return t[:, :5] if strided else t

    def run(which: str) -> tuple[Tensor, Tensor]:
        leaf = z.detach().clone().requires_grad_()
        with klpen.use_backend(which):
            out = call(view(leaf))
            loss = _loss(out)
            loss.backward()
        assert leaf.grad is not None and leaf.grad.dtype == leaf.dtype
        return loss.detach(), leaf.grad

    value, grad = run(backend)
    oracle, oracle_grad = run("torch")
    torch.testing.assert_close(value, oracle, rtol=1e-5, atol=1e-5)
    # bf16 gradients are rounded once from fp32 by each backend: one bf16 ulp apart at most;
    # in fp32 each backend is within about 1e-6 of float64 at these sizes (the KL's gradient
    # p (d - KL) cancels), so two backends may differ by a few of those
    ulp = 2.0**-7 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(grad, oracle_grad, rtol=ulp, atol=5e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_oracle_and_backends_against_float64_log_softmax(backend: str) -> None:
    z = _logits(4, 6, 50)
    z[0, 0, :10] = -torch.inf
    z[1] += 1e4  # a large common offset
    w = z + 1e-3 * _logits(4, 6, 50, scale=1.0)
    tokens = torch.randint(10, 50, (4, 6), generator=G)
    logq = (z.double() / 0.7).log_softmax(-1)
    p = logq.exp()
    with klpen.use_backend(backend):
        logp, ent = klpen.logprobs_and_entropy(z, tokens, temperature=0.7)
        kl = klpen.full_kl(z, w, temperature=0.7)
    # fp32 results: a few fp32 ulps of the log-prob (about 14 here)
    torch.testing.assert_close(
        logp.double(), logq.gather(-1, tokens[..., None])[..., 0], rtol=1e-6, atol=1e-7
    )
    ref_ent = -torch.where(p > 0, p * logq, 0.0).sum(-1)
    torch.testing.assert_close(ent.double(), ref_ent, rtol=1e-5, atol=1e-5)
    ref_kl = torch.where(p > 0, p * (logq - (w.double() / 0.7).log_softmax(-1)), 0.0).sum(-1)
    torch.testing.assert_close(kl.double(), ref_kl, rtol=1e-4, atol=1e-10)


@pytest.mark.parametrize("backend", BACKENDS)
def test_invalid_rows_are_reported_by_every_backend(backend: str) -> None:
    z = _logits(2, 8)
    z[1, 3] = torch.nan
    with klpen.use_backend(backend):
        with pytest.raises(ValueError, match="NaN"):
            klpen.get_logprobs_for_tokens(z, torch.tensor([0, 1]))
        with pytest.raises(ValueError, match="NaN"):
            klpen.full_kl(z, _logits(2, 8))
