"""With value checks off, a call on finite inputs makes no host-device synchronisation.

Counted with a dispatch mode: every ``_local_scalar_dense`` (what ``.item()``, ``int()``,
``bool()`` and ``.tolist()`` of a tensor go through), ``nonzero`` and ``is_nonzero`` in the
forward and the backward of one call. Zero with ``klpen.validation(False)``, for every public
tensor function; with validation on the same calls do synchronise (the count is not vacuous).
Under a dispatch mode the CPU block pool runs its blocks sequentially, so the count covers the
pooled path's logic too (the pool itself reads no tensor values).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

import klpen

SYNC_OPS = {"aten._local_scalar_dense", "aten.nonzero", "aten.is_nonzero", "aten.item"}


class CountSyncs(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count: dict[str, int] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = str(func.overloadpacket)
        if name in SYNC_OPS:
            self.count[name] = self.count.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


G = torch.Generator().manual_seed(0)
B, T, V, H = 2, 5, 40, 6


def _leaf(*shape: int, scale: float = 1.0) -> Tensor:
    return (torch.randn(*shape, generator=G) * scale).requires_grad_()


LOGITS = _leaf(B, T, V, scale=3.0)
REF = torch.randn(B, T, V, generator=G) * 3.0
TOKENS = torch.randint(0, V, (B, T), generator=G)
MASK = torch.ones(B, T, dtype=torch.bool)
MASK[1, 3:] = False
LOGP = _leaf(B, T)
REF_LOGP = torch.randn(B, T, generator=G)
HIDDEN = _leaf(B, T, H)
WEIGHT = _leaf(V, H)
REWARD = torch.randn(B, generator=G)


def _sum(out: object) -> Tensor:
    if isinstance(out, Tensor):
        return out.float().sum()
    if isinstance(out, dict):
        return sum(_sum(v) for v in out.values() if isinstance(v, Tensor))  # type: ignore[return-value]
    return sum(_sum(o) for o in out if isinstance(o, Tensor))  # type: ignore[union-attr, return-value]


# compute_rlhf_objective is left out: contract section 1 makes it return Python floats
# (mean_reward, mean_kl, ...), one read each by definition.
NOT_YET = None
OTHERS = None
POSITIONS = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3, 4]])

CASES: list[tuple[str, Callable[[], object], str | None]] = [
    ("get_logprobs_for_tokens", lambda: klpen.get_logprobs_for_tokens(LOGITS, TOKENS), None),
    (
        "get_logprobs_for_tokens-T",
        lambda: klpen.get_logprobs_for_tokens(LOGITS, TOKENS, temperature=0.7),
        None,
    ),
    ("next_token_logprobs", lambda: klpen.next_token_logprobs(LOGITS, TOKENS), None),
    ("token_entropy", lambda: klpen.token_entropy(LOGITS, temperature=1.3), None),
    ("logprobs_and_entropy", lambda: klpen.logprobs_and_entropy(LOGITS, TOKENS), None),
    ("full_kl", lambda: klpen.full_kl(LOGITS, REF, temperature=0.9), None),
    (
        "kl_penalized_reward",
        lambda: klpen.kl_penalized_reward(LOGITS, REF, torch.zeros(B, T), beta=0.1),
        None,
    ),
    (
        "calculate_kl_penalty",
        lambda: klpen.calculate_kl_penalty(
            LOGITS.log_softmax(-1), REF.log_softmax(-1), TOKENS, 0.1
        ),
        None,
    ),
    ("linear_logprobs", lambda: klpen.linear_logprobs(HIDDEN, WEIGHT, TOKENS), None),
    (
        "linear_logprobs-entropy",
        lambda: klpen.linear_logprobs(HIDDEN, WEIGHT, TOKENS, return_entropy=True, temperature=0.8),
        None,
    ),
    (
        "linear_full_kl",
        lambda: klpen.linear_full_kl(HIDDEN, WEIGHT, HIDDEN.detach() + 0.1, WEIGHT.detach()),
        None,
    ),
    ("estimate_kl", lambda: klpen.estimate_kl(LOGP, REF_LOGP, "k3"), NOT_YET),
    ("compute_token_kl", lambda: klpen.compute_token_kl(LOGP, REF_LOGP, MASK), OTHERS),
    ("masked_sum", lambda: klpen.masked_sum(LOGP, MASK), OTHERS),
    ("masked_mean", lambda: klpen.masked_mean(LOGP, MASK, dim=-1), OTHERS),
    ("aggregate", lambda: klpen.aggregate(LOGP, MASK, "seq-mean-token-mean"), OTHERS),
    ("shape_rewards", lambda: klpen.shape_rewards(REWARD, LOGP, MASK, 0.1), NOT_YET),
    (
        "next_token_logprobs-packed",
        lambda: klpen.next_token_logprobs(
            LOGITS.reshape(1, -1, LOGITS.shape[-1])[:, :10],
            TOKENS.reshape(1, -1)[:, :10],
            position_ids=POSITIONS,
        ),
        None,
    ),
    ("sequence_ids", lambda: klpen.sequence_ids(position_ids=POSITIONS), None),
    (
        "mismatch_metrics-tensors",
        lambda: klpen.mismatch_metrics(LOGP, REF_LOGP, MASK, as_tensors=True),
        None,
    ),
    (
        "sampler_logprobs",
        lambda: klpen.sampler_logprobs(LOGITS, TOKENS, temperature=0.8, top_k=10, top_p=0.9),
        NOT_YET,
    ),
    ("importance_weights", lambda: klpen.importance_weights(LOGP, REF_LOGP, MASK), NOT_YET),
    ("response_mask", lambda: klpen.response_mask(TOKENS, 3), OTHERS),
]


def _count(call: Callable[[], object]) -> dict[str, int]:
    for leaf in (LOGITS, LOGP, HIDDEN, WEIGHT):
        leaf.grad = None
    with CountSyncs() as mode:
        out = call()
        loss = _sum(out)
        if loss.requires_grad:
            loss.backward()
    return mode.count


def _params() -> list[Any]:
    out = []
    for name, call, reason in CASES:
        marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
        out.append(pytest.param(call, id=name, marks=marks))
    return out


@pytest.mark.parametrize("call", _params())
def test_no_sync_with_validation_off(call: Callable[[], object]) -> None:
    with klpen.validation(False):
        assert _count(call) == {}


MINE = [pytest.param(call, id=name) for name, call, reason in CASES if reason is None]


@pytest.mark.parametrize("call", MINE)
def test_with_validation_on_the_same_calls_do_synchronise(call: Callable[[], object]) -> None:
    assert sum(_count(call).values()) > 0


@pytest.mark.parametrize("call", MINE)
def test_sync_free_values_and_gradients_equal_the_checked_ones(
    call: Callable[[], object],
) -> None:
    def run() -> tuple[Tensor, list[Tensor | None]]:
        for leaf in (LOGITS, HIDDEN, WEIGHT):
            leaf.grad = None
        loss = _sum(call())
        if loss.requires_grad:
            loss.backward()
        return loss.detach(), [leaf.grad for leaf in (LOGITS, HIDDEN, WEIGHT)]

    checked, grads = run()
    with klpen.validation(False):
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
    with klpen.validation(False):
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
