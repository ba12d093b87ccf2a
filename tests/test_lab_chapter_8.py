"""klpen_book.sampler_study: the machinery of chapter 8, against independent references."""

from __future__ import annotations

import math

import pytest
import torch

from klpen import full_kl, mismatch_metrics, sampler_logprobs
from klpen_book import sampler_study as ss
from klpen_book.bandit import forward_kl_optimal_policy, optimal_policy

F64 = torch.float64


def test_position_logits_are_seeded_and_shaped() -> None:
    a = ss.position_logits(4, 7, scale=2.0, ref_noise=0.5, seed=3)
    b = ss.position_logits(4, 7, scale=2.0, ref_noise=0.5, seed=3)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    z, w = ss.position_logits(4, 7, scale=2.0, ref_noise=0.0, seed=3)
    assert z.shape == (4, 7) and torch.equal(z, w)  # no noise: the reference is the policy
    with pytest.raises(ValueError, match="scale must be finite and positive"):
        ss.position_logits(4, 7, scale=0.0, ref_noise=0.5, seed=0)


@pytest.mark.parametrize(("temperature", "top_k", "top_p"), [(1.0, None, 0.8), (0.7, 5, 0.9)])
def test_sampler_distribution_is_a_distribution_on_the_kept_set(
    temperature: float, top_k: int | None, top_p: float | None
) -> None:
    z, _ = ss.position_logits(6, 20, scale=2.0, ref_noise=0.0, seed=1)
    log_mu = ss.sampler_distribution(z, temperature=temperature, top_k=top_k, top_p=top_p)
    torch.testing.assert_close(log_mu.exp().sum(-1), torch.ones(6, dtype=F64))
    # On the kept set: softmax(z / T) renormalised by the kept mass.
    y = torch.argmax(z, -1)
    _, log_s = sampler_logprobs(z, y, temperature=temperature, top_k=top_k, top_p=top_p)
    full = torch.log_softmax(z / temperature, -1)
    kept = torch.isfinite(log_mu)
    torch.testing.assert_close(log_mu[kept], (full - log_s[:, None]).expand_as(full)[kept])
    torch.testing.assert_close(full.exp().masked_fill(~kept, 0).sum(-1).log(), log_s)


def test_sample_tokens_follow_the_distribution() -> None:
    p = torch.tensor([[0.1, 0.6, 0.3]], dtype=F64)
    y = ss.sample_tokens(p.log().expand(30_000, 3), seed=0)
    freq = torch.bincount(y, minlength=3).double() / y.numel()
    torch.testing.assert_close(freq, p[0], atol=0.015, rtol=0)


def test_mismatch_rows_are_mismatch_metrics() -> None:
    g = torch.Generator().manual_seed(0)
    a = -torch.rand(50, generator=g, dtype=F64)
    b = a + 0.2 * torch.randn(50, generator=g, dtype=F64)
    row = ss.mismatch_rows({"x": (a, b)}, band=(0.9, 1.1))[0]
    m = mismatch_metrics(a, b, torch.ones(50), band=(0.9, 1.1))
    assert row == [
        "x",
        m["mean_ratio"],
        m["min_ratio"],
        m["max_ratio"],
        m["outside_band"],
        m["kl_k3"],
    ]
    assert ss.mismatch_headers((0.9, 1.1))[4] == "ω outside [0.9, 1.1]"


def test_kl_rows_mean_and_bias() -> None:
    r = torch.tensor([0.5, -0.1, 0.2, 0.0], dtype=F64)
    (k1,), (k3,) = ss.kl_rows({"a": (r, 0.1)}, ["k1"]), ss.kl_rows({"a": (r, 0.1)}, ["k3"])
    assert k1[2] == pytest.approx(float(r.mean()))
    assert k1[3] == pytest.approx(float(r.std() / 2))
    assert k1[5] == pytest.approx(float(r.mean()) - 0.1)
    assert k3[2] == pytest.approx(float((torch.exp(-r) + r - 1).mean()))


def test_behavior_logits() -> None:
    z = torch.randn(5, 9, generator=torch.Generator().manual_seed(2), dtype=F64) * 3
    assert torch.equal(ss.behavior_logits(z, "bf16"), z.bfloat16().double())
    stale = ss.behavior_logits(z, "stale", updates=4, step=0.1, seed=1)
    drift = (stale - z) / 0.1  # a sum of 4 standard normals per logit: variance 4
    assert 2.0 < float(drift.var()) < 8.0
    assert torch.equal(ss.behavior_logits(z, "stale", updates=0), z)
    with pytest.raises(ValueError, match="kind must be one of"):
        ss.behavior_logits(z, "fp8")


def test_offpolicy_estimates_weighted_are_unbiased_and_unweighted_k1_is_not() -> None:
    z, w = ss.position_logits(1, 30, scale=2.0, ref_noise=0.6, seed=5)
    z, w = z[0], w[0]
    mu = ss.behavior_logits(z, "stale", updates=5, step=0.3, seed=8)
    true_kl = float(full_kl(z, w))
    est = ss.offpolicy_estimates(z, w, mu, 40_000, cap=1.5, seed=1)

    def z_score(x: torch.Tensor) -> float:
        return (float(x.mean()) - true_kl) / (float(x.std()) / math.sqrt(x.numel()))

    assert abs(z_score(est["k1·π/μ"])) < 4 and abs(z_score(est["k3·π/μ"])) < 4
    assert abs(z_score(est["k1"])) > 4  # the unweighted average is under μ, not π
    # Truncation and masking only ever lower a weight.
    assert bool((est["k3·TIS(1.5)"] <= est["k3·π/μ"] + 1e-15).all())
    assert bool((est["k3·MIS(1.5)"] <= est["k3·TIS(1.5)"] + 1e-15).all())


def test_offpolicy_gradient_rows_pin_the_headline_facts() -> None:
    g = torch.Generator().manual_seed(7)
    ref = torch.randn(6, generator=g, dtype=F64)
    pol = ref + torch.randn(6, generator=g, dtype=F64)
    rows = {tuple(r[:3]): r for r in ss.offpolicy_gradient_rows(pol, ref, pol / 0.7)}
    assert rows["loss", "differentiated", "k3"][5] < 1e-12
    assert rows["loss", "differentiated", "k1"][5] < 1e-12
    assert rows["loss", "detached", "k3"][6] < 1e-12  # the forward KL's gradient
    assert rows["loss", "detached", "k1"][4] == "zero"
    assert rows["loss", "none", "k3"][5] > 1e-2 and rows["loss", "none", "k3"][6] > 1e-2


def test_offpolicy_study_flows_land_on_their_fixed_points() -> None:
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(6, generator=g, dtype=F64)
    reward = torch.rand(6, generator=g, dtype=F64)
    configs = [("differentiated", "k3"), ("detached", "k3"), ("none", "k3")]
    study = ss.offpolicy_study(
        ref,
        reward,
        kl_coef=0.2,
        temperature=0.7,
        configs=configs,
        steps=3,
        flow_steps=400,
        flow_lr=4.0,
    )
    star = optimal_policy(ref, reward, 0.2)
    fwd = forward_kl_optimal_policy(ref, reward, 0.2)
    torch.testing.assert_close(study.optimum, star)
    torch.testing.assert_close(study.flows["differentiated/k3"], star, atol=1e-4, rtol=0)
    torch.testing.assert_close(study.flows["detached/k3"], fwd, atol=1e-4, rtol=0)
    none = study.flows["none/k3"]
    assert float((none - star).abs().sum()) > 0.1 and float((none - fwd).abs().sum()) > 0.1
    assert [row[:2] for row in study.rows] == [list(c) for c in configs]
    assert set(study.runs) == {f"{how}/{name}" for how, name in configs}


def test_offpolicy_study_bad_input() -> None:
    ref, reward = torch.zeros(3), torch.tensor([1.0, 0.0, 0.0])
    with pytest.raises(ValueError, match="weighting must be one of"):
        ss.offpolicy_study(ref, reward, kl_coef=1.0, temperature=0.5, configs=[("tis", "k3")])
    with pytest.raises(ValueError, match="temperature must be finite and positive"):
        ss.offpolicy_study(ref, reward, kl_coef=1.0, temperature=0.0, configs=[("none", "k3")])


def test_chapter_8_excerpts_are_the_mathematics_only() -> None:
    import klpen
    from klpen_book.source import show_source

    for obj, name, line in (
        (klpen.sampling._kept_scores, "cut", "cut = cumulative <= (1 - top_p)"),
        (klpen.importance_weights, "weights", "w = delta.exp()"),
        (klpen.sampling.mismatch_sums, "metrics", "ratio = delta.exp()"),
    ):
        listing = show_source(obj, excerpt=name)
        assert line in listing.source
        assert "raise" not in listing.source and '"""' not in listing.source
        assert len(listing.source.splitlines()) < len(listing.full.splitlines())


def test_generate_default_rows_show_the_top_k_default() -> None:
    z, _ = ss.position_logits(40, 120, scale=1.0, ref_noise=0.0, seed=3)
    (row,) = ss.generate_default_rows(z, [(0.95, 1.0)])
    top_p, tau, mean_gap, max_gap, differ, kept_gen, kept_kw = row
    assert (top_p, tau) == (0.95, 1.0)
    assert kept_gen <= 50 < kept_kw  # generate's default top_k=50 cuts the nucleus
    assert 0 < mean_gap <= max_gap and differ > 0.5


def test_kept_mask_scores_every_engine_draw() -> None:
    z, _ = ss.position_logits(60, 64, scale=2.5, ref_noise=0.0, seed=4)
    for row in ss.kept_set_rows(z, [0.8, 0.95]):
        _, differ, outside, _, gap_mask, max_mask = row
        assert 0 <= differ <= 1 and 0 <= outside <= differ
        assert math.isfinite(max_mask) and gap_mask <= max_mask < 0.1  # bf16 rounding only
