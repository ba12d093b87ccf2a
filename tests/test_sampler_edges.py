"""Issue 22 items 3, 4, 5, 12, the second derivative of sampler_logprobs, mismatch sums.

References: float64 formulas written so that nothing overflows (the weight of a row holding
a token with π = 0 is 0; w·k with k = 0 is 0), and the metrics of the whole batch against
the sums of its parts reduced as a data-parallel group would (sum, max, min).
"""

from __future__ import annotations

import math

import pytest
import torch

import klpen
from klpen import estimate_kl, importance_weights, mismatch_metrics, sampler_logprobs
from klpen.estimators import ESTIMATORS, REGISTRY
from klpen.sampling import MAX_FIELDS, MIN_FIELDS, SUM_FIELDS, metrics_from_sums, mismatch_sums

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]


def test_second_derivative_is_refused_by_name() -> None:
    z = torch.randn(2, 3, 10, dtype=torch.float64, requires_grad=True)
    tok = torch.randint(0, 10, (2, 3), generator=torch.Generator().manual_seed(0))
    logp, log_s = sampler_logprobs(z, tok, top_k=4, top_p=0.9, temperature=0.7)
    finite = torch.isfinite(logp)
    (g,) = torch.autograd.grad(
        torch.where(finite, logp, 0.0).sum() + log_s.sum(), z, create_graph=True
    )
    with pytest.raises(RuntimeError, match="sampler_logprobs has no second derivative"):
        g.pow(2).sum().backward()
    # and once, without create_graph, the first derivative is the float64 reference
    zr = z.detach().clone().requires_grad_()
    s = zr / 0.7
    kept = s.masked_fill(s < s.topk(4).values[..., -1:], -math.inf)
    ordered, order = kept.sort()
    cut = ordered.softmax(-1).cumsum(-1) <= (1 - 0.9)
    cut[..., -1] = False
    kept = kept.masked_fill(cut.scatter(-1, order, cut), -math.inf)
    ref = kept.log_softmax(-1).gather(-1, tok[..., None]).squeeze(-1)
    ref_s = kept.logsumexp(-1) - s.logsumexp(-1)
    torch.testing.assert_close(logp, ref, rtol=1e-12, atol=1e-12)
    (torch.where(finite, ref, 0.0).sum() + ref_s.sum()).backward()
    torch.testing.assert_close(g, zr.grad, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------- item 3


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("level", ["sequence", "geometric"])
def test_importance_weight_with_a_zero_probability_token_is_zero(
    dtype: torch.dtype, level: str
) -> None:
    big = torch.finfo(dtype).max
    # the log-ratios sum past the dtype's range (+inf) and meet π = 0 (-inf): the weight is 0
    lp = torch.tensor([[0.0, 0.0, -math.inf, -0.5], [0.0, -1.0, -2.0, -0.5]], dtype=dtype)
    mu = torch.tensor([[-big, -big, -1.0, -0.5], [-0.5, -1.0, -2.5, -0.5]], dtype=dtype)
    mask = torch.ones(2, 4)
    w = importance_weights(lp, mu, mask, level=level)
    assert not bool(w.isnan().any())
    assert torch.equal(w[0], torch.zeros(4, dtype=w.dtype))
    delta = lp[1].double() - mu[1].double()
    expected = delta.sum().exp() if level == "sequence" else delta.mean().exp()
    torch.testing.assert_close(w[1].double(), expected.expand(4), rtol=1e-6, atol=0)
    # partial sums that overflow in opposite directions (true mean 0): weight 1, not NaN
    lp2 = torch.tensor([[0.0, 0.0, -big, -big]], dtype=dtype)
    mu2 = torch.tensor([[-big, -big, 0.0, 0.0]], dtype=dtype)
    w2 = importance_weights(lp2, mu2, torch.ones(1, 4), level=level)
    torch.testing.assert_close(w2, torch.ones_like(w2), rtol=1e-6, atol=0)


# ---------------------------------------------------------------- item 4


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(ESTIMATORS))
def test_weighted_estimate_with_an_overflowing_weight_is_its_finite_value(
    dtype: torch.dtype, name: str
) -> None:
    compute = torch.promote_types(dtype, torch.float32)
    log_w = 90.0 if compute == torch.float32 else 800.0  # e^{log w} overflows the compute dtype
    p = torch.tensor([-1.0, -1.0, -2.0], dtype=dtype)
    q = torch.tensor([-1.0, -1.0 - 1e-3, -2.0], dtype=dtype)  # r = 0, a small r, r = 0
    b = (p.to(compute) - torch.tensor([log_w, log_w, 0.5], dtype=compute)).to(compute)
    out = estimate_kl(p, q, name, behavior_logprobs=b)
    assert bool(torch.isfinite(out[[0, 2]]).all()), out
    assert float(out[0]) == 0.0 and float(out[2]) == 0.0  # π = π_ref: the truth is 0
    # r small: w·k is finite where it fits (k2, k3: ~1e-7·e^{90}); in float64 by logs
    r = float(p[1].double() - q[1].double())
    lw = float(p[1].double() - b[1].double())
    base = float(REGISTRY[name].value(torch.tensor([r], dtype=torch.float64)))
    if base == 0.0:
        assert float(out[1]) == 0.0
        return
    log_expected = lw + math.log(abs(base))
    if log_expected < math.log(torch.finfo(compute).max):
        assert float(out[1]) == pytest.approx(math.copysign(math.exp(log_expected), base), rel=1e-3)
    else:
        expected = base
        assert float(out[1]) == math.copysign(math.inf, expected)


@pytest.mark.parametrize("dtype", DTYPES)
def test_weighted_estimate_gradient_where_the_weight_overflows_raises_not_nan(
    dtype: torch.dtype,
) -> None:
    compute = torch.promote_types(dtype, torch.float32)
    log_w = 90.0 if compute == torch.float32 else 800.0
    p = torch.tensor([-1.0, -1.0], dtype=dtype, requires_grad=True)
    q = torch.tensor([-1.0, -1.5], dtype=dtype)
    b = torch.tensor([-1.0 - log_w, -1.2], dtype=compute)
    out = estimate_kl(p, q, "k3", behavior_logprobs=b)
    # the masked-out position takes no gradient; the other gets a finite one
    (out * torch.tensor([0.0, 1.0], dtype=out.dtype)).sum().backward()
    assert p.grad is not None and bool(torch.isfinite(p.grad).all())
    with pytest.raises(ValueError, match="no finite gradient"):
        p.grad = None
        estimate_kl(p, q, "k3", behavior_logprobs=b).sum().backward()


# ---------------------------------------------------------------- item 5


@pytest.mark.parametrize("dtype", DTYPES)
def test_mismatch_mean_does_not_overflow(dtype: torch.dtype) -> None:
    big = min(3.4e38, torch.finfo(dtype).max)
    x = torch.tensor([0.0, 0.0, -1.0], dtype=dtype)
    y = torch.tensor([-big, -big, -1.0], dtype=dtype)
    m = mismatch_metrics(x, y, torch.ones(3))
    big_c = float(torch.tensor(big, dtype=dtype))
    assert m["max_abs_log_ratio"] == pytest.approx(big_c, rel=1e-6)
    assert m["mean_abs_log_ratio"] == pytest.approx(2 * big_c / 3, rel=1e-6)
    assert m["kl_k1"] == pytest.approx(-2 * big_c / 3, rel=1e-6)
    assert all(not math.isnan(v) for v in m.values())


def test_mismatch_as_tensors_and_sums_reduce_like_a_group() -> None:
    gen = torch.Generator().manual_seed(2)
    x = -torch.rand(4, 7, generator=gen, dtype=torch.float64) * 3
    y = x + torch.randn(4, 7, generator=gen, dtype=torch.float64) * 0.3
    mask = torch.rand(4, 7, generator=gen) > 0.3
    whole = mismatch_metrics(x, y, mask, as_tensors=True)
    floats = mismatch_metrics(x, y, mask)
    assert all(isinstance(v, torch.Tensor) and v.dim() == 0 for v in whole.values())
    assert {k: float(v) for k, v in whole.items()} == floats
    # two "ranks": their sums added, max and min reduced, give the whole batch's metrics
    parts = [mismatch_sums(x[:2], y[:2], mask[:2]), mismatch_sums(x[2:], y[2:], mask[2:])]
    reduced = {
        **{f: parts[0]._asdict()[f] + parts[1]._asdict()[f] for f in SUM_FIELDS},
        **{f: torch.maximum(parts[0]._asdict()[f], parts[1]._asdict()[f]) for f in MAX_FIELDS},
        **{f: torch.minimum(parts[0]._asdict()[f], parts[1]._asdict()[f]) for f in MIN_FIELDS},
    }
    combined = metrics_from_sums(type(parts[0])(**reduced))
    for k, v in combined.items():
        torch.testing.assert_close(v, whole[k], rtol=1e-12, atol=1e-15)
    # float64 formulas
    d = (x - y)[mask]
    torch.testing.assert_close(whole["kl_k3"], (d.exp() - 1 - d).mean())
    torch.testing.assert_close(whole["min_ratio"], d.exp().min())
    empty = mismatch_metrics(x, y, torch.zeros(4, 7), as_tensors=True)
    assert all(float(v) == 0.0 for v in empty.values())


# ---------------------------------------------------------------- item 12 and issue 19


@pytest.mark.parametrize("name", list(ESTIMATORS))
def test_estimators_make_no_data_dependent_branch_under_vmap(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Value checks are _validation's (which steps aside under transforms); with them off,
    # estimators.py itself must trace under vmap, with and without a mask, weighted or not.
    import klpen.estimators as est

    monkeypatch.setattr(est, "check_no_nan_at", lambda name, x, mask=None: x)
    monkeypatch.setattr(est, "check_no_nan", lambda x, message: x)
    gen = torch.Generator().manual_seed(5)
    p, q, b = (-torch.rand(3, 4, generator=gen) * 2 for _ in range(3))
    mask = torch.rand(3, 4, generator=gen) > 0.3
    calls = {
        "plain": (lambda a, c, w, k: estimate_kl(a, c, name), estimate_kl(p, q, name)),
        "mask": (
            lambda a, c, w, k: estimate_kl(a, c, name, mask=k),
            estimate_kl(p, q, name, mask=mask),
        ),
        "weighted": (
            lambda a, c, w, k: estimate_kl(a, c, name, behavior_logprobs=w),
            estimate_kl(p, q, name, behavior_logprobs=b),
        ),
        "clamp": (
            lambda a, c, w, k: estimate_kl(a, c, name, clamp=3.0),
            estimate_kl(p, q, name, clamp=3.0),
        ),
    }
    for fn, expected in calls.values():
        torch.testing.assert_close(torch.func.vmap(fn)(p, q, b, mask), expected)
    # and the gradient, through vmap(grad)
    grads = torch.func.vmap(torch.func.grad(lambda a, c: estimate_kl(a, c, name).sum()))(p, q)
    pr = p.clone().requires_grad_()
    estimate_kl(pr, q, name).sum().backward()
    torch.testing.assert_close(grads, pr.grad)


@pytest.mark.skipif(
    not hasattr(klpen, "validation"), reason="needs the value-check switch of contract §7"
)
def test_vmap_over_estimate_kl() -> None:
    p, q = -torch.rand(3, 4), -torch.rand(3, 4)
    out = torch.func.vmap(lambda a, c: estimate_kl(a, c, "k3"))(p, q)
    torch.testing.assert_close(out, estimate_kl(p, q, "k3"))


def test_registry_records_carry_every_rule() -> None:
    assert list(REGISTRY) == ["k1", "k2", "k3", "abs", "k1+", "k2+", "k3+", "abs+"]
    assert ESTIMATORS.keys() == REGISTRY.keys()
    r = torch.linspace(-3, 3, 13, dtype=torch.float64)
    for name, entry in REGISTRY.items():
        assert entry.name == name and entry.straight_through == name.endswith("+")
        base = REGISTRY[name.rstrip("+")]
        torch.testing.assert_close(entry(r), base.value(r))
        nonzero = base.value(r) != 0
        torch.testing.assert_close(
            entry.log_magnitude(r)[nonzero], base.value(r)[nonzero].abs().log()
        )
    assert [n for n, e in REGISTRY.items() if e.clamps_log_ratio] == ["k3", "k3+"]
    # k3's log-magnitude stays finite where k3 overflows
    assert float(REGISTRY["k3"].log_magnitude(torch.tensor([-1e4]))) == pytest.approx(1e4)
    import inspect

    import klpen.estimators as est

    assert '== "k3"' not in inspect.getsource(est)


# ---------------------------------------------------------------- config path at its edges


def reference_with_penalty(
    z: torch.Tensor, tokens: torch.Tensor, ids: torch.Tensor, pen: float, t: float, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Whole-tensor float64 reference: penalty from each position's context, /T, top-k."""
    steps = tokens.shape[-1]
    prompt = ids.shape[-1] - steps
    out, mass = [], []
    for s in range(steps):
        seen = torch.zeros(z.shape[0], z.shape[-1], dtype=torch.bool)
        seen.scatter_(1, ids[:, : prompt + s], True)
        x = z[:, s]
        x = torch.where(seen, torch.where(x < 0, x * pen, x / pen), x) / t
        kept = x.masked_fill(x < x.topk(k).values[..., -1:], -math.inf)
        out.append(kept.log_softmax(-1).gather(-1, tokens[:, s, None]).squeeze(-1))
        mass.append(kept.logsumexp(-1) - x.logsumexp(-1))
    return torch.stack(out, 1), torch.stack(mass, 1)


def test_blocks_strides_and_half_precision_on_the_penalty_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from klpen.kernels import blocks as chunks

    gen = torch.Generator().manual_seed(8)
    wide = torch.randn(3, 9, 40, generator=gen, dtype=torch.float64) * 3
    z = wide[:, 1:, 5:35]  # (3, 8, 30), strided, not contiguous
    ids = torch.randint(0, 30, (3, 11), generator=gen)
    tokens = ids[:, 3:]
    config = {"repetition_penalty": 1.6, "temperature": 0.8, "top_k": 6}
    ref, ref_mass = reference_with_penalty(z, tokens, ids, 1.6, 0.8, 6)
    zr = z.detach().clone().requires_grad_()
    finite = torch.isfinite(ref)
    for rows in (8_000, 30, 90):  # one block, a row per block (with a cut), several rows
        monkeypatch.setattr(chunks, "CHUNK_ELEMENTS", rows)
        zz = z.detach().clone().requires_grad_()
        ours, mass = sampler_logprobs(zz, tokens, generation_config=config, input_ids=ids)
        torch.testing.assert_close(ours, ref, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(mass, ref_mass, rtol=1e-12, atol=1e-12)
        (torch.where(finite, ours, 0.0).sum() + 0.5 * mass.sum()).backward()
        if zr.grad is None:
            r2, m2 = reference_with_penalty(zr, tokens, ids, 1.6, 0.8, 6)
            (torch.where(finite, r2, 0.0).sum() + 0.5 * m2.sum()).backward()
        torch.testing.assert_close(zz.grad, zr.grad, rtol=1e-10, atol=1e-12)
    for half in (torch.float16, torch.bfloat16):
        zh = z.to(half)
        ours, _ = sampler_logprobs(zh, tokens, generation_config=config, input_ids=ids)
        assert ours.dtype == torch.float32
        expected, _ = reference_with_penalty(zh.double(), tokens, ids, 1.6, 0.8, 6)
        torch.testing.assert_close(ours.double(), expected, rtol=1e-5, atol=1e-5)


def test_kept_mask_values_and_gradients_against_the_masked_softmax() -> None:
    gen = torch.Generator().manual_seed(9)
    z = torch.randn(2, 5, 12, generator=gen, dtype=torch.float64, requires_grad=True)
    keep = torch.rand(2, 5, 12, generator=gen) > 0.5
    keep[..., 0] = True
    tokens = torch.randint(0, 12, (2, 5), generator=gen)
    logp, mass = sampler_logprobs(z, tokens, temperature=1.3, kept_mask=keep)
    s = z / 1.3
    kept = s.masked_fill(~keep, -math.inf)
    ref = kept.log_softmax(-1).gather(-1, tokens[..., None]).squeeze(-1)
    torch.testing.assert_close(logp, ref)
    torch.testing.assert_close(mass, kept.logsumexp(-1) - s.logsumexp(-1))
    finite = torch.isfinite(ref)
    assert bool((~finite).any()) and bool(finite.any())  # both cases are exercised
    (g,) = torch.autograd.grad(torch.where(finite, logp, 0.0).sum() + mass.sum(), z)
    (gr,) = torch.autograd.grad(
        torch.where(finite, ref, 0.0).sum() + (kept.logsumexp(-1) - s.logsumexp(-1)).sum(), z
    )
    torch.testing.assert_close(g, gr)


def test_extra_memory_with_every_field_is_a_few_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    from klpen.kernels import blocks as chunks
    from klpen_book.memory import peak_extra_bytes

    monkeypatch.setattr(chunks, "CHUNK_ELEMENTS", 8_000)
    g = torch.Generator().manual_seed(0)
    config = {
        "temperature": 0.8,
        "top_k": 300,
        "top_p": 0.95,
        "min_p": 0.01,
        "typical_p": 0.97,
        "epsilon_cutoff": 1e-4,
        "eta_cutoff": 1e-4,
        "repetition_penalty": 1.2,
    }

    def peak(sequences: int) -> tuple[int, int]:
        logits = torch.randn(sequences, 64, 1000, generator=g)
        ids = torch.randint(0, 1000, (sequences, 80), generator=g)
        tokens = ids[:, 16:]
        used = peak_extra_bytes(
            lambda: sampler_logprobs(logits, tokens, generation_config=config, input_ids=ids)
        )
        return used, logits.numel() * logits.element_size()

    small, _ = peak(2)
    large, size = peak(16)
    # a fixed amount of block temporaries; what grows with the batch is the outputs and the
    # (sequences, V) int64 first-position table (8 kB per sequence here)
    assert large - small < 14 * 1.25 * (1000 * 8 + 64 * 4 * 3)
    assert large < 0.1 * size
