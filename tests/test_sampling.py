"""klpen.sampling: gradients of sampler_logprobs, importance_weights, mismatch_metrics, bad input.

References: float64 autograd through torch's own log_softmax over an explicitly masked kept set,
and plain float64 formulas for the weights and metrics.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import klpen.kernels.blocks as chunks
from klpen import importance_weights, mismatch_metrics, sampler_logprobs

F64 = torch.float64
INF = math.inf


def kept_mask_reference(
    z: torch.Tensor, temperature: float, top_k: int | None, top_p: float | None
) -> torch.Tensor:
    """The kept set in plain float64 (no ties in these tests): top-k, then the smallest prefix
    of the descending order whose mass reaches top_p."""
    s = z.double() / temperature
    keep = torch.ones_like(s, dtype=torch.bool)
    if top_k is not None and top_k < s.shape[-1]:
        keep &= s >= s.topk(top_k, -1).values[..., -1:]
    if top_p is not None:
        p = torch.softmax(s.masked_fill(~keep, -INF), -1)
        ordered, order = p.sort(-1, descending=True)
        before = ordered.cumsum(-1) - ordered  # mass strictly above each token
        keep_sorted = before < top_p
        keep &= torch.zeros_like(keep).scatter(-1, order, keep_sorted)
    return keep


@given(
    seed=st.integers(0, 2**31 - 1),
    temperature=st.sampled_from([0.5, 1.0, 2.0]),
    top_k=st.one_of(st.none(), st.integers(1, 12)),
    top_p=st.one_of(st.none(), st.floats(0.1, 0.95)),
)
def test_values_and_gradients_against_float64_masked_softmax(
    seed: int, temperature: float, top_k: int | None, top_p: float | None
) -> None:
    g = torch.Generator().manual_seed(seed)
    z = (torch.randn(2, 3, 16, generator=g, dtype=F64) * 2).requires_grad_()
    keep = kept_mask_reference(z.detach(), temperature, top_k, top_p)
    tokens = torch.multinomial(keep.reshape(-1, 16).double(), 1, generator=g).view(2, 3)
    tokens[0, 0] = (~keep[0, 0]).double().argmax() if not bool(keep[0, 0].all()) else 0
    w1, w2 = torch.randn(2, 3, generator=g, dtype=F64), torch.randn(2, 3, generator=g, dtype=F64)

    logp, log_s = sampler_logprobs(z, tokens, temperature=temperature, top_k=top_k, top_p=top_p)
    (torch.where(torch.isfinite(logp), logp, 0.0) * w1 + log_s * w2).sum().backward()
    ours = z.grad

    z2 = z.detach().clone().requires_grad_()
    s = z2 / temperature
    kept = s.masked_fill(~keep, -INF)
    ref = kept.log_softmax(-1).gather(-1, tokens[..., None]).squeeze(-1)
    ref_s = kept.logsumexp(-1) - s.logsumexp(-1)
    (torch.where(torch.isfinite(ref), ref, 0.0) * w1 + ref_s * w2).sum().backward()
    assert torch.equal(torch.isinf(logp), torch.isinf(ref))
    finite = torch.isfinite(ref)
    torch.testing.assert_close(logp[finite], ref[finite].detach())
    torch.testing.assert_close(log_s, ref_s.detach())
    torch.testing.assert_close(ours, z2.grad)


def test_blocks_and_strided_input_give_the_same_result(monkeypatch: pytest.MonkeyPatch) -> None:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(3, 9, 30, generator=g)
    logits = base[:, :-1]  # non-contiguous: the next-token shift
    tokens = torch.randint(0, 30, (3, 8), generator=g)
    whole = sampler_logprobs(logits, tokens, temperature=0.8, top_k=12, top_p=0.9)
    monkeypatch.setattr(chunks, "CHUNK_ELEMENTS", 60)  # two rows per block
    blocked = sampler_logprobs(logits, tokens, temperature=0.8, top_k=12, top_p=0.9)
    for a, b in zip(whole, blocked, strict=True):
        assert torch.equal(a, b)


def test_half_precision_is_computed_in_fp32() -> None:
    z = torch.randn(4, 20, generator=torch.Generator().manual_seed(1))
    tokens = torch.zeros(4, dtype=torch.long)
    lp16, s16 = sampler_logprobs(z.bfloat16(), tokens, temperature=0.7, top_p=0.9)
    lp32, s32 = sampler_logprobs(z.bfloat16().float(), tokens, temperature=0.7, top_p=0.9)
    assert lp16.dtype == s16.dtype == torch.float32
    assert torch.equal(lp16, lp32) and torch.equal(s16, s32)


def test_masked_vocabulary_and_no_cut() -> None:
    z = torch.tensor([[0.0, -INF, 1.0, 2.0]])
    lp, log_s = sampler_logprobs(z, torch.tensor([1]))
    assert lp.item() == -INF and log_s.item() == 0.0
    lp, _ = sampler_logprobs(z, torch.tensor([3]), top_k=10, top_p=1.0)
    torch.testing.assert_close(lp, torch.log_softmax(z, -1)[:, 3])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"temperature": 0.0}, "temperature must be finite and positive, got 0.0"),
        ({"temperature": -1.0}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"top_k": 0}, "top_k must be None or an int >= 1, got 0"),
        ({"top_p": 0.0}, r"top_p must lie in \(0, 1\], got 0.0"),
        ({"top_p": 1.5}, "top_p must lie in"),
        ({"top_p": math.nan}, "top_p must lie in"),
    ],
)
def test_bad_settings_are_refused_by_name(kwargs: dict[str, float], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        sampler_logprobs(torch.zeros(2, 3), torch.zeros(2, dtype=torch.long), **kwargs)


def test_bad_types_and_logits_are_refused() -> None:
    z, y = torch.zeros(2, 3), torch.zeros(2, dtype=torch.long)
    with pytest.raises(TypeError, match="top_k"):
        sampler_logprobs(z, y, top_k=2.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="top_k"):
        sampler_logprobs(z, y, top_k=True)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="top_p"):
        sampler_logprobs(z, y, top_p="0.9")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="tokens must lie in"):
        sampler_logprobs(z, torch.tensor([0, 3]))
    for bad in (math.nan, INF):
        with pytest.raises(ValueError, match="NaN or \\+inf"):
            sampler_logprobs(torch.tensor([[0.0, bad, 1.0]]), torch.tensor([0]), top_p=0.5)
    with pytest.raises(ValueError, match="all -inf"):
        sampler_logprobs(torch.full((1, 3), -INF), torch.tensor([0]))


def ref_weights(lp: torch.Tensor, mu: torch.Tensor, m: torch.Tensor, level: str) -> torch.Tensor:
    delta = (lp.double() - mu.double()) * m
    if level == "sequence":
        delta = delta.sum(-1, keepdim=True).expand_as(delta)
    elif level == "geometric":
        delta = (delta.sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1)).expand_as(
            delta
        )
    return delta.exp() * m


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
@pytest.mark.parametrize(("cap", "mode"), [(None, "truncate"), (2.0, "truncate"), (1.2, "mask")])
def test_importance_weights_against_formula(level: str, cap: float | None, mode: str) -> None:
    g = torch.Generator().manual_seed(5)
    lp = -torch.rand(4, 6, generator=g, dtype=F64) * 3
    mu = lp + torch.randn(4, 6, generator=g, dtype=F64) * 0.4
    m = (torch.rand(4, 6, generator=g) > 0.3).double()
    m[3] = 0  # a row with no valid token
    ref = ref_weights(lp, mu, m, level)
    if cap is not None:
        ref = ref.clamp(max=cap) if mode == "truncate" else torch.where(ref > cap, 0.0, ref)
    lp_nan = torch.where(m.bool(), lp, math.nan).requires_grad_()
    mu_inf = torch.where(m.bool(), mu, INF)
    w = importance_weights(lp_nan, mu_inf, m, level=level, cap=cap, mode=mode)
    torch.testing.assert_close(w, ref)
    assert not w.requires_grad  # detached
    assert bool((w[m == 0] == 0).all())


def test_importance_weights_unbiased_for_an_expectation() -> None:
    # E_mu[w f] = E_pi[f] for token weights: exact over an enumerated vocabulary.
    pi = torch.softmax(torch.tensor([1.0, 0.0, -1.0, 0.5], dtype=F64), -1)
    mu = torch.softmax(torch.tensor([0.0, 0.3, 0.0, 1.0], dtype=F64), -1)
    f = torch.tensor([3.0, -1.0, 2.0, 0.5], dtype=F64)
    w = importance_weights(pi.log()[None], mu.log()[None], torch.ones(1, 4))
    torch.testing.assert_close((mu * w[0] * f).sum(), (pi * f).sum())


def test_importance_weights_bad_input() -> None:
    lp, m = torch.zeros(1, 3), torch.ones(1, 3)
    with pytest.raises(ValueError, match=r"behavior_logprobs must not be NaN or \+inf"):
        importance_weights(lp, torch.tensor([[0.0, INF, 0.0]]), m)
    with pytest.raises(ValueError, match="behavior_logprobs must not be -inf"):
        importance_weights(lp, torch.tensor([[0.0, -INF, 0.0]]), m)
    with pytest.raises(ValueError, match="logprobs must not be NaN"):
        importance_weights(torch.tensor([[0.0, math.nan, 0.0]]), lp, m)
    with pytest.raises(ValueError, match="level must be one of"):
        importance_weights(lp, lp, m, level="tokens")
    with pytest.raises(ValueError, match="mode must be one of"):
        importance_weights(lp, lp, m, mode="clip")
    with pytest.raises(ValueError, match="cap must be finite and positive"):
        importance_weights(lp, lp, m, cap=0.0)
    with pytest.raises(ValueError, match="mask must have shape"):
        importance_weights(lp, lp, torch.ones(3))
    # A policy log-prob of -inf is a weight of 0, not an error.
    w = importance_weights(torch.tensor([[-INF, 0.0]]), torch.zeros(1, 2), torch.ones(1, 2))
    assert w.tolist() == [[0.0, 1.0]]


def test_mismatch_metrics_against_formulas() -> None:
    g = torch.Generator().manual_seed(9)
    rollout = -torch.rand(3, 7, generator=g, dtype=F64) * 4
    trainer = rollout + torch.randn(3, 7, generator=g, dtype=F64) * 0.3
    m = torch.rand(3, 7, generator=g) > 0.25
    out = mismatch_metrics(
        torch.where(m, trainer, math.nan), torch.where(m, rollout, INF), m, band=(0.9, 1.1)
    )
    d = (trainer - rollout)[m]
    rho = d.exp()
    assert all(isinstance(v, float) for v in out.values())
    assert out["tokens"] == float(m.sum())
    assert out["mean_abs_log_ratio"] == pytest.approx(float(d.abs().mean()))
    assert out["max_abs_log_ratio"] == pytest.approx(float(d.abs().max()))
    assert out["mean_ratio"] == pytest.approx(float(rho.mean()))
    assert out["min_ratio"] == pytest.approx(float(rho.min()))
    assert out["max_ratio"] == pytest.approx(float(rho.max()))
    assert out["kl_k3"] == pytest.approx(float((rho - 1 - d).mean()))
    assert out["kl_k1"] == pytest.approx(float(-d.mean()))
    assert out["outside_band"] == pytest.approx(float(((rho < 0.9) | (rho > 1.1)).double().mean()))


def test_mismatch_metrics_k3_estimates_the_kl() -> None:
    # Tokens drawn from mu: the mean of k3 converges to KL(mu || pi).
    g = torch.Generator().manual_seed(2)
    zpi, zmu = torch.randn(30, generator=g, dtype=F64), torch.randn(30, generator=g, dtype=F64)
    lpi, lmu = zpi.log_softmax(-1), zmu.log_softmax(-1)
    y = torch.multinomial(lmu.exp(), 200_000, replacement=True, generator=g)
    out = mismatch_metrics(lpi[y], lmu[y], torch.ones_like(y))
    kl = float((lmu.exp() * (lmu - lpi)).sum())
    assert out["kl_k3"] == pytest.approx(kl, rel=0.03)
    assert out["mean_ratio"] == pytest.approx(1.0, abs=0.02)


def test_mismatch_metrics_edge_cases() -> None:
    x = torch.zeros(2, 2)
    out = mismatch_metrics(x, x, torch.zeros(2, 2))
    assert set(out.values()) == {0.0}
    with pytest.raises(ValueError, match="band must satisfy lo < hi"):
        mismatch_metrics(x, x, torch.ones(2, 2), band=(1.2, 0.8))
    with pytest.raises(ValueError, match=r"band\[0\] must be finite and positive"):
        mismatch_metrics(x, x, torch.ones(2, 2), band=(0.0, 1.2))
    with pytest.raises(TypeError, match="band must be a pair"):
        mismatch_metrics(x, x, torch.ones(2, 2), band=1.2)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"rollout_logprobs must not be NaN or \+inf"):
        mismatch_metrics(x, torch.tensor([[0.0, INF], [0.0, 0.0]]), torch.ones(2, 2))


def test_extra_memory_is_a_few_blocks_not_a_copy_of_the_logits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from klpen_book.memory import peak_extra_bytes

    monkeypatch.setattr(chunks, "CHUNK_ELEMENTS", 8_000)  # blocks of 8 rows (2 with a cut)
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(256, 1000, generator=g)
    tokens = torch.randint(0, 1000, (256,), generator=g)
    size = logits.numel() * logits.element_size()

    def forward() -> object:
        return sampler_logprobs(logits, tokens, temperature=0.7, top_k=100, top_p=0.9)

    def naive() -> object:  # the same with whole-tensor ops: several copies of the logits
        s = logits / 0.7
        s = s.masked_fill(s < s.topk(100, -1).values[..., -1:], -INF)
        ordered, order = s.sort(-1)
        cut = ordered.softmax(-1).cumsum(-1) <= 0.1
        return s.masked_fill(cut.scatter(-1, order, cut), -INF).log_softmax(-1)

    assert peak_extra_bytes(forward) < 0.1 * size
    assert peak_extra_bytes(naive) > 2 * size  # the measurement can see a copy
