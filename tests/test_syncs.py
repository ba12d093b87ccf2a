"""With value checks off, a call on finite inputs makes no host-device synchronisation.

Counted with a dispatch mode: every ``_local_scalar_dense`` (what ``.item()``, ``int()``,
``bool()`` and ``.tolist()`` of a tensor go through), ``nonzero`` and ``is_nonzero`` in the
forward and the backward of one call. Zero with ``klpen.validation(False)``, for every public
tensor function; with validation on the same calls do synchronise (the count is not vacuous).
The mode also sees the ops inside klpen's custom operators (``public_calls.ThroughKlpenOps``);
under a dispatch mode the CPU block pool runs its blocks sequentially, so the count covers the
pooled path's logic too (the pool itself reads no tensor values). On the CPU the kernels keep
their data-dependent paths (a read of a CPU tensor stalls no device):
``klpen.kernels.blocks.sync_free_on_cpu`` makes them take the accelerator's sync-free paths,
which are the ones counted.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from probes import SYNC_OPS
from public_calls import (
    CASES,
    HIDDEN,
    LEAVES,
    LOGITS,
    REF,
    TOKENS,
    WEIGHT,
    G,
    ThroughKlpenOps,
    sum_of,
)
from torch import Tensor

import klpen
from klpen.kernels.blocks import sync_free_on_cpu


class CountSyncs(ThroughKlpenOps):
    def __init__(self) -> None:
        super().__init__()
        self.count: dict[str, int] = {}

    def see(self, func: Any) -> None:
        name = str(func.overloadpacket)
        if name in SYNC_OPS:
            self.count[name] = self.count.get(name, 0) + 1


def _count(call: Callable[[], object]) -> dict[str, int]:
    for leaf in LEAVES:
        leaf.grad = None
    with CountSyncs() as mode:
        out = call()
        loss = sum_of(out)
        if loss.requires_grad:
            loss.backward()
    return mode.count


ALL = [pytest.param(call, id=name) for name, call in CASES]


@pytest.mark.parametrize("call", ALL)
def test_no_sync_with_validation_off(call: Callable[[], object]) -> None:
    with klpen.validation(False), sync_free_on_cpu():
        assert _count(call) == {}


@pytest.mark.skipif("triton" not in klpen.available_backends(), reason="no Triton backend here")
@pytest.mark.parametrize("call", ALL)
def test_no_sync_with_validation_off_on_the_triton_backend(call: Callable[[], object]) -> None:
    with klpen.validation(False), sync_free_on_cpu(), klpen.use_backend("triton"):
        assert _count(call) == {}


@pytest.mark.parametrize("call", ALL)
def test_with_validation_on_the_same_calls_do_synchronise(call: Callable[[], object]) -> None:
    assert sum(_count(call).values()) > 0


@pytest.mark.parametrize("call", ALL)
def test_sync_free_values_and_gradients_equal_the_checked_ones(
    call: Callable[[], object],
) -> None:
    def run() -> tuple[Tensor, list[Tensor | None]]:
        for leaf in (LOGITS, HIDDEN, WEIGHT):
            leaf.grad = None
        loss = sum_of(call())
        if loss.requires_grad:
            loss.backward()
        return loss.detach(), [leaf.grad for leaf in (LOGITS, HIDDEN, WEIGHT)]

    checked, grads = run()
    with klpen.validation(False), sync_free_on_cpu():
        free, free_grads = run()
    torch.testing.assert_close(free, checked, rtol=1e-5, atol=1e-5)
    for a, b in zip(free_grads, grads, strict=True):
        assert (a is None) == (b is None)
        if a is not None and b is not None:
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_sync_free_paths_are_exact_at_the_edges(dtype: torch.dtype) -> None:
    """-inf logits, a large common offset and a tiny KL: the sync-free kernels against
    float64 log_softmax, as the default path is tested."""
    z = torch.randn(6, 30, generator=G, dtype=dtype) * 4
    z[0, :5] = -torch.inf
    z[1] += 1e4
    w = z + 1e-4 * torch.randn(6, 30, generator=G, dtype=dtype)
    w[0, :5] = -torch.inf
    tokens = torch.randint(5, 30, (6,), generator=G)
    logq = z.double().log_softmax(-1)
    p = logq.exp()
    with klpen.validation(False), sync_free_on_cpu():
        logp, ent = klpen.logprobs_and_entropy(z, tokens)
        kl = klpen.full_kl(z, w)
    torch.testing.assert_close(logp.double(), logq.gather(-1, tokens[:, None])[:, 0])
    ref_ent = -torch.where(p > 0, p * logq, 0.0).sum(-1)
    torch.testing.assert_close(ent.double(), ref_ent, rtol=1e-5, atol=1e-5)
    ref_kl = torch.where(p > 0, p * (logq - w.double().log_softmax(-1)), 0.0).sum(-1)
    torch.testing.assert_close(kl.double(), ref_kl, rtol=1e-4, atol=1e-10)


def test_validation_switch_skips_only_value_checks() -> None:
    bad = TOKENS.clone()
    bad[0, 0] = -1
    with pytest.raises(ValueError, match="tokens must lie in"):
        klpen.get_logprobs_for_tokens(LOGITS, bad)
    with klpen.validation(False), pytest.raises(ValueError, match="tokens must have shape"):
        klpen.get_logprobs_for_tokens(LOGITS, TOKENS[:, :2])  # shapes are still checked
    nan = LOGITS.detach().clone()
    nan[0, 0, 0] = torch.nan
    with klpen.validation(False):
        assert torch.isnan(klpen.full_kl(nan, REF)).any()  # not reported: skipped
    with pytest.raises(ValueError, match="NaN"):
        klpen.full_kl(nan, REF)  # the switch is restored on exit
    klpen.set_validation(False)
    try:
        assert torch.isnan(klpen.token_entropy(nan)).any()
        with klpen.validation(True), pytest.raises(ValueError, match="NaN"):
            klpen.token_entropy(nan)
    finally:
        klpen.set_validation(True)
    with pytest.raises(TypeError, match="enabled must be True or False"):
        klpen.set_validation(1)  # type: ignore[arg-type]
