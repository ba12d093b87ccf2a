"""Tests of the laboratory behind chapters 1-3 of the book.

Each lab function is checked against an independent reference: torch.distributions for
divergences and sampling, torch's cross_entropy for log-probs, closed-form float64 formulas for
the estimators and the discretised Gaussians, exact byte counts for the memory measurements.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributions import Categorical, Normal, kl_divergence

from klpen.kernels.blocks import CHUNK_ELEMENTS
from klpen_book import estimator_study, full_kl_study, logprob_study, memory
from klpen_book.figures import layout_problems


def _kl(policy_logits: torch.Tensor, reference_logits: torch.Tensor) -> torch.Tensor:
    return kl_divergence(Categorical(logits=policy_logits), Categorical(logits=reference_logits))


# --------------------------------------------------------------------------- chapter 1


class TestCategoricalPair:
    def test_deterministic_float64_and_close_to_half_scale_squared(self) -> None:
        z, w = estimator_study.categorical_pair(4000, 0.1, seed=3)
        z2, w2 = estimator_study.categorical_pair(4000, 0.1, seed=3)
        assert torch.equal(z, z2) and torch.equal(w, w2)
        assert z.dtype == w.dtype == torch.float64 and z.shape == (4000,)
        # KL ≈ Var_p(δ)/2 with δ ~ N(0, s²): 0.005 up to sampling of the logits
        assert float(_kl(z, w)) == pytest.approx(0.005, rel=0.15)

    def test_different_seeds_differ(self) -> None:
        z, _ = estimator_study.categorical_pair(10, 0.5, seed=0)
        z2, _ = estimator_study.categorical_pair(10, 0.5, seed=1)
        assert not torch.equal(z, z2)

    @pytest.mark.parametrize(
        ("kwargs", "match"),
        [
            ({"vocab_size": 0}, "vocab_size"),
            ({"scale": -1.0}, "scale"),
            ({"vocab_size": 2.5}, "vocab_size"),
        ],
    )
    def test_bad_arguments(self, kwargs: dict[str, float], match: str) -> None:
        args = {"vocab_size": 10, "scale": 0.5, **kwargs}
        with pytest.raises((ValueError, TypeError), match=match):
            estimator_study.categorical_pair(args["vocab_size"], args["scale"], seed=0)  # type: ignore[arg-type]


class TestSampleEstimates:
    z, w = estimator_study.categorical_pair(8, 0.8, seed=0)

    def test_tokens_are_drawn_from_the_policy(self) -> None:
        # k1 = log p(y) - log q(y) takes a distinct value per token here, so its draws identify
        # the tokens; their frequencies must match the policy, not the reference.
        n = 200_000
        r = estimator_study.sample_estimates(self.z, self.w, n, seed=1, estimators=("k1",))["k1"]
        logp, logq = torch.log_softmax(self.z, -1), torch.log_softmax(self.w, -1)
        per_token = logp - logq
        assert len(set(per_token.tolist())) == 8
        ids = (r[:, None] - per_token[None, :]).abs().argmin(-1)
        freq = torch.bincount(ids, minlength=8).double() / n
        p = logp.exp()
        tolerance = 5 * torch.sqrt(p * (1 - p) / n)
        assert bool(((freq - p).abs() < tolerance).all())
        assert float((freq - logq.exp()).abs().max()) > 0.05

    def test_estimator_values_follow_their_formulas(self) -> None:
        est = estimator_study.sample_estimates(self.z, self.w, 1000, seed=2)
        r = est["k1"]
        assert torch.allclose(est["k2"], r**2 / 2)
        assert torch.allclose(est["k3"], torch.exp(-r) - 1 + r, atol=1e-12)
        assert torch.equal(est["abs"], r.abs())

    def test_unbiased_estimators_average_to_the_exact_kl(self) -> None:
        n = 400_000
        est = estimator_study.sample_estimates(self.z, self.w, n, seed=3)
        kl = float(_kl(self.z, self.w))
        for name in ("k1", "k3"):
            se = float(est[name].std()) / math.sqrt(n)
            assert abs(float(est[name].mean()) - kl) < 5 * se, name
        # the control variate of k3: E_π[π_ref/π] = 1
        ratio = torch.exp(-est["k1"])
        assert abs(float(ratio.mean()) - 1) < 5 * float(ratio.std()) / math.sqrt(n)
        # abs is biased upwards by far more than its noise
        assert float(est["abs"].mean()) > kl + 20 * float(est["abs"].std()) / math.sqrt(n)

    def test_seeded(self) -> None:
        a = estimator_study.sample_estimates(self.z, self.w, 50, seed=7)
        b = estimator_study.sample_estimates(self.z, self.w, 50, seed=7)
        assert all(torch.equal(a[k], b[k]) for k in a)

    def test_bad_arguments(self) -> None:
        with pytest.raises(ValueError, match="estimators"):
            estimator_study.sample_estimates(self.z, self.w, 5, seed=0, estimators=("k4",))
        with pytest.raises(ValueError, match="reference_logits"):
            estimator_study.sample_estimates(self.z, self.w[:4], 5, seed=0)
        with pytest.raises(ValueError, match="n_samples"):
            estimator_study.sample_estimates(self.z, self.w, 0, seed=0)
        with pytest.raises(ValueError, match="policy_logits"):
            estimator_study.sample_estimates(self.z[None], self.w[None], 5, seed=0)


class TestEstimatorStats:
    def test_against_numpy(self) -> None:
        x = torch.randn(101, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
        (s,) = estimator_study.estimator_stats({"k1": x}, true_kl=0.3)
        a = x.numpy()
        assert s.mean == pytest.approx(a.mean(), abs=1e-14)
        assert s.std == pytest.approx(a.std(ddof=1), abs=1e-14)
        assert s.bias == pytest.approx(a.mean() - 0.3, abs=1e-14)
        assert s.standard_error == pytest.approx(a.std(ddof=1) / np.sqrt(101), abs=1e-14)
        assert s.negative_fraction == pytest.approx((a < 0).mean())
        assert s.n_samples == 101

    def test_table_is_relative_to_the_true_kl(self) -> None:
        stats = estimator_study.estimator_stats({"k2": torch.tensor([0.5, 1.5])}, true_kl=0.5)
        table = estimator_study.stats_table({"case": stats})
        last = table.splitlines()[-1].split()
        # mean 1.0, bias 0.5 -> bias/KL 1.0; std sqrt(0.5) -> std/KL 1.414; s.e. std/sqrt(2)
        assert last == ["case", "0.500", "k2", "1.000", "1.000", "1.414", "0.000"]

    def test_values_table_matches_formulas(self) -> None:
        lp, lr = torch.tensor([-1.0, -3.0]), torch.tensor([-1.5, -1.0])
        rows = [
            line.split() for line in estimator_study.estimator_values_table(lp, lr).splitlines()[2:]
        ]
        for row, r in zip(rows, (0.5, -2.0), strict=True):
            _, _, _, rr, k1, k2, k3, ab = (float(v) for v in row)
            expected = (r, r, r * r / 2, math.exp(-r) - 1 + r, abs(r))
            assert (rr, k1, k2, k3, ab) == pytest.approx(expected, abs=5e-4)


class TestEstimatorPlots:
    def test_curves_are_the_estimators(self) -> None:
        fig = estimator_study.plot_estimator_curves(-1.0, 1.0)
        lines = {line.get_label(): line for line in fig.axes[0].get_lines()}
        x, y = (np.asarray(v, dtype=float) for v in lines["k3"].get_data())
        assert x[0] == -1.0 and x[-1] == 1.0
        np.testing.assert_allclose(y, np.exp(-x) - 1 + x, atol=1e-12)

    def test_distribution_grid(self) -> None:
        z, w = estimator_study.categorical_pair(20, 0.5, seed=0)
        draws = {c: estimator_study.sample_estimates(z, w, 200, seed=s) for s, c in enumerate("ab")}
        fig = estimator_study.plot_estimate_distributions(draws, {"a": 0.1, "b": 0.1})
        assert len(fig.axes) == 8
        assert layout_problems(fig) == []
        # One column per case, one row per estimator; each histogram integrates to one
        # over the plotted range and is the histogram of its estimator's draws.
        columns = {round(ax.get_position().x0, 3) for ax in fig.axes}
        assert len(columns) == 2
        first = fig.axes[0]
        heights = np.array([patch.get_height() for patch in first.patches])
        widths = np.array([patch.get_width() for patch in first.patches])
        lo, hi = first.patches[0].get_x(), first.patches[-1].get_x() + widths[-1]
        values = draws["a"]["k1"].double().numpy()
        inside = values[(values >= lo) & (values <= hi)]
        expected, _ = np.histogram(inside, bins=len(heights), range=(lo, hi), density=True)
        np.testing.assert_allclose(heights, expected, rtol=1e-9)

    def test_distribution_grid_takes_at_most_two_cases(self) -> None:
        z, w = estimator_study.categorical_pair(20, 0.5, seed=0)
        draws = {c: estimator_study.sample_estimates(z, w, 50, seed=0) for c in "abc"}
        with pytest.raises(ValueError, match="estimates_by_case must hold one or two cases, got 3"):
            estimator_study.plot_estimate_distributions(draws, dict.fromkeys("abc", 0.1))

    def test_curves_fit_the_column(self) -> None:
        assert layout_problems(estimator_study.plot_estimator_curves()) == []


# --------------------------------------------------------------------------- chapter 2


class TestPeakExtraBytes:
    def test_single_allocation(self) -> None:
        x = torch.zeros(1000, dtype=torch.float64)
        assert memory.peak_extra_bytes(torch.exp, x) == 8000

    def test_peak_not_total(self) -> None:
        x = torch.zeros(1000)

        def two_in_sequence(t: torch.Tensor) -> None:
            a = torch.exp(t)  # 4000 bytes, freed before the next allocation
            del a
            b = torch.neg(t)
            del b

        def two_alive(t: torch.Tensor) -> torch.Tensor:
            a = torch.exp(t)
            b = torch.neg(t)
            return a + b  # 3 tensors alive at the end

        assert memory.peak_extra_bytes(two_in_sequence, x) == 4000
        assert memory.peak_extra_bytes(two_alive, x) == 12000

    def test_no_stderr_from_the_profiler(self, capfd: pytest.CaptureFixture[str]) -> None:
        memory.peak_extra_bytes(torch.exp, torch.zeros(10))
        assert capfd.readouterr().err == ""


class TestLogprobMemory:
    def test_naive_matches_cross_entropy(self) -> None:
        g = torch.Generator().manual_seed(0)
        logits = torch.randn(2, 5, 11, generator=g, dtype=torch.float64)
        tokens = torch.randint(0, 11, (2, 5), generator=g)
        ref = -F.cross_entropy(logits.reshape(-1, 11), tokens.reshape(-1), reduction="none")
        torch.testing.assert_close(memory.naive_token_logprobs(logits, tokens), ref.view(2, 5))
        half = memory.naive_token_logprobs(logits.bfloat16(), tokens)
        assert half.dtype == torch.float32

    def test_naive_copies_klpen_does_not(self) -> None:
        batch, seq, vocab = 2, 64, 32768
        fp32 = batch * seq * vocab * 4
        block = CHUNK_ELEMENTS * 4
        naive, ours = memory.logprob_memory(batch, seq, vocab)
        assert naive.logits_bytes == ours.logits_bytes == fp32
        # the naive forward holds a full fp32 log-prob copy; klpen about one block
        assert naive.forward_bytes >= fp32
        assert ours.forward_bytes <= 2 * block
        # backward: both produce a (B, T, V) gradient; naive also needs two more full copies
        assert naive.backward_bytes >= 3 * fp32
        assert fp32 <= ours.backward_bytes <= fp32 + 2 * block
        assert memory.logprob_memory(batch, seq, vocab) == [naive, ours]

    def test_bf16_naive_upcasts(self) -> None:
        naive, ours = memory.logprob_memory(2, 64, 32768, torch.bfloat16)
        fp32 = 2 * 64 * 32768 * 4
        assert naive.dtype == "bfloat16" and naive.logits_bytes == fp32 // 2
        assert naive.forward_bytes >= 2 * fp32  # the upcast copy and the log-softmax
        assert ours.forward_bytes <= 2 * CHUNK_ELEMENTS * 4

    def test_table_in_megabytes(self) -> None:
        row = memory.LogprobMemory("klpen", "float32", 2_500_000, 50_000, 2_600_000)
        assert memory.memory_table([row]).splitlines()[-1].split() == [
            "klpen",
            "float32",
            "2.5",
            "0.1",
            "2.6",
        ]

    def test_unknown_method(self) -> None:
        with pytest.raises(ValueError, match="methods"):
            memory.logprob_memory(1, 2, 3, methods=("fast",))


class TestToyModel:
    def test_bigram_and_causal(self) -> None:
        model = logprob_study.toy_language_model(seed=1)
        tokens = logprob_study.encode("<bos> the cat sat on the mat")
        logits = model(tokens)
        assert logits.shape == (1, 7, len(logprob_study.TOY_VOCAB))
        torch.testing.assert_close(logits[0], model.weight[tokens[0]])
        # changing the last token changes no logits before it
        other = tokens.clone()
        other[0, -1] = logprob_study.TOY_VOCAB.index("rug")
        torch.testing.assert_close(model(other)[:, :-1], logits[:, :-1])
        assert torch.equal(model.weight, logprob_study.toy_language_model(seed=1).weight)

    def test_encode_decode(self) -> None:
        text = "<bos> a dog ran . <eos>"
        assert " ".join(logprob_study.decode(logprob_study.encode(text)[0])) == text
        with pytest.raises(ValueError, match="vocabulary"):
            logprob_study.encode("the unicorn")

    def test_next_token_table_rows(self) -> None:
        tokens = logprob_study.encode("<bos> the cat sat on")[0]
        lp = torch.tensor([-0.5, -1.0, -1.5, -2.0])
        rows = logprob_study.next_token_table(tokens, lp, prompt_length=3).splitlines()[2:]
        parsed = [r.split() for r in rows]
        assert [p[1:4] for p in parsed] == [
            ["<bos>", "the", "prompt"],
            ["the", "cat", "prompt"],
            ["cat", "sat", "response"],
            ["sat", "on", "response"],
        ]
        assert [float(p[4]) for p in parsed] == [-0.5, -1.0, -1.5, -2.0]
        with pytest.raises(ValueError, match="tokens"):
            logprob_study.next_token_table(tokens, lp[:2], prompt_length=3)


class TestPrecision:
    def test_errors_against_cross_entropy_in_float64(self) -> None:
        g = torch.Generator().manual_seed(0)
        logits = (3 * torch.randn(8, 4096, generator=g)).bfloat16()
        tokens = torch.randint(0, 4096, (8,), generator=g)
        errors = logprob_study.logprob_errors(logits, tokens)
        ref = -F.cross_entropy(logits.double(), tokens, reduction="none")
        ours = torch.tensor(errors["klpen"][1])
        assert errors["klpen"][0] == torch.float32
        assert float(ours) < 1e-5
        native = torch.log_softmax(logits, -1).gather(-1, tokens[:, None]).squeeze(-1)
        expected = float((native.double() - ref).abs().max())
        assert errors["log_softmax in bfloat16"] == (torch.bfloat16, pytest.approx(expected))
        assert expected > 1e-3

    @settings(deadline=None, max_examples=60)
    @given(st.floats(min_value=1e-30, max_value=1e30))
    def test_order_of_magnitude_brackets(self, x: float) -> None:
        text = logprob_study.order_of_magnitude(x)
        k = int(text.split("e")[1])
        assert 10.0**k <= x * (1 + 1e-12) and x < 10.0 ** (k + 1) * (1 + 1e-12)
        assert logprob_study.order_of_magnitude(-x) == text

    def test_precision_table(self) -> None:
        table = logprob_study.precision_table({"klpen": (torch.float32, 4.2e-7)})
        assert table.splitlines()[-1].split() == ["klpen", "float32", "1e-07"]


# --------------------------------------------------------------------------- chapter 3


class TestExactMoments:
    z, w = estimator_study.categorical_pair(50, 0.8, seed=4)

    def test_against_numpy_enumeration(self) -> None:
        p = torch.softmax(self.z, -1).numpy()
        r = (torch.log_softmax(self.z, -1) - torch.log_softmax(self.w, -1)).numpy()
        formulas = {"k1": r, "k2": r**2 / 2, "k3": np.exp(-r) - 1 + r, "abs": np.abs(r)}
        for name, k in formulas.items():
            mean, std = full_kl_study.exact_moments(self.z, self.w, name)
            assert mean == pytest.approx(float((p * k).sum()), rel=1e-12)
            assert std == pytest.approx(
                float(np.sqrt((p * (k - (p * k).sum()) ** 2).sum())), rel=1e-9
            )

    def test_unbiased_estimators_have_the_exact_kl_as_mean(self) -> None:
        kl = float(_kl(self.z, self.w))
        for name in ("k1", "k3"):
            assert full_kl_study.exact_moments(self.z, self.w, name)[0] == pytest.approx(
                kl, rel=1e-12
            )
        # E|r| > |E r| whenever r takes both signs (k2's bias has no fixed sign)
        assert full_kl_study.exact_moments(self.z, self.w, "abs")[0] > kl

    def test_sample_moments_converge_to_them(self) -> None:
        n = 200_000
        draws = estimator_study.sample_estimates(self.z, self.w, n, seed=0, estimators=("k3",))
        mean, std = full_kl_study.exact_moments(self.z, self.w, "k3")
        assert float(draws["k3"].mean()) == pytest.approx(mean, abs=5 * std / math.sqrt(n))
        assert float(draws["k3"].std()) == pytest.approx(std, rel=0.05)

    def test_table(self) -> None:
        table = full_kl_study.exact_table({"c": (self.z, self.w)}, ["k1", "abs"], digits=6)
        rows = [line.split() for line in table.splitlines()[2:]]
        kl = float(_kl(self.z, self.w))
        mean_abs, std_abs = full_kl_study.exact_moments(self.z, self.w, "abs")
        assert float(rows[0][1]) == pytest.approx(kl, abs=1e-6)
        assert float(rows[0][3]) == pytest.approx(0.0, abs=1e-6)
        assert float(rows[1][3]) == pytest.approx((mean_abs - kl) / kl, abs=1e-6)
        assert float(rows[1][4]) == pytest.approx(std_abs / kl, abs=1e-6)


class TestRunningMeans:
    def test_is_the_cumulative_mean_of_the_same_draws(self) -> None:
        z, w = estimator_study.categorical_pair(30, 0.7, seed=0)
        m = full_kl_study.running_means(z, w, 500, n_runs=3, seed=5, estimator="k3")
        assert m.shape == (3, 500) and m.dtype == torch.float64
        for j in range(3):
            draws = estimator_study.sample_estimates(z, w, 500, seed=5 + j, estimators=("k3",))
            x = draws["k3"]
            assert float(m[j, 0]) == pytest.approx(float(x[0]))
            assert float(m[j, 99]) == pytest.approx(float(x[:100].mean()))
            assert float(m[j, -1]) == pytest.approx(float(x.mean()))

    def test_converges_to_the_exact_kl(self) -> None:
        z, w = estimator_study.categorical_pair(30, 0.7, seed=0)
        n = 100_000
        m = full_kl_study.running_means(z, w, n, n_runs=4, seed=0)
        x = estimator_study.sample_estimates(z, w, n, seed=99, estimators=("k1",))["k1"]
        se = float(x.std()) / math.sqrt(n)
        assert float((m[:, -1] - float(_kl(z, w))).abs().max()) < 5 * se

    def test_plot(self) -> None:
        m = torch.ones(2, 10, dtype=torch.float64)
        fig = full_kl_study.plot_convergence({"k1": m, "k3": m}, 1.0, {"k1": 0.5, "k3": 0.2})
        assert len(fig.axes) == 2
        assert layout_problems(fig) == []
        # The runs share one legend entry instead of five unlabelled colours.
        labels = [text.get_text() for text in fig.axes[0].get_legend().get_texts()]
        assert "2 independent runs" in labels

    def test_plot_takes_at_most_two_panels(self) -> None:
        m = torch.ones(2, 10, dtype=torch.float64)
        with pytest.raises(ValueError, match="one or two estimators, got 3"):
            full_kl_study.plot_convergence(
                {"k1": m, "k2": m, "k3": m}, 1.0, {"k1": 0.5, "k2": 0.5, "k3": 0.2}
            )


GRID = torch.linspace(-5, 5, 201, dtype=torch.float64)


class TestDiscretisedDistributions:
    def test_gaussian_matches_torch_normal(self) -> None:
        got = torch.log_softmax(full_kl_study.gaussian_logits(GRID, 0.7, 1.3), -1)
        ref = torch.log_softmax(Normal(0.7, 1.3).log_prob(GRID), -1)
        torch.testing.assert_close(got, ref)

    def test_gaussian_broadcasts(self) -> None:
        means, stds = torch.tensor([0.0, 1.0]), torch.tensor([0.5, 1.0, 2.0])
        out = full_kl_study.gaussian_logits(GRID, means[:, None], stds[None, :])
        assert out.shape == (2, 3, 201)
        torch.testing.assert_close(out[1, 2], full_kl_study.gaussian_logits(GRID, 1.0, 2.0))

    def test_bimodal_matches_mixture_density(self) -> None:
        got = torch.softmax(full_kl_study.bimodal_logits(GRID, (-2.0, 2.0), 0.6, (0.6, 0.4)), -1)
        x = GRID.numpy()
        density = sum(
            w * np.exp(-((x - m) ** 2) / (2 * 0.6**2)) for m, w in ((-2.0, 0.6), (2.0, 0.4))
        )
        np.testing.assert_allclose(got.numpy(), density / density.sum(), rtol=1e-10)


class TestFitUnimodal:
    means = torch.linspace(-4, 4, 161, dtype=torch.float64)
    stds = torch.linspace(0.2, 4.0, 77, dtype=torch.float64)
    target = full_kl_study.bimodal_logits(GRID)

    def test_recovers_a_gaussian_target_in_both_directions(self) -> None:
        p = full_kl_study.gaussian_logits(GRID, 1.0, 0.8)
        for direction in ("reverse", "forward"):
            fit = full_kl_study.fit_unimodal(p, GRID, direction, self.means, self.stds)
            assert (fit.mean, fit.std) == pytest.approx((1.0, 0.8), abs=1e-9)
            assert fit.kl == pytest.approx(0.0, abs=1e-12)

    def test_is_the_minimum_over_candidates(self) -> None:
        means, stds = self.means[::8], self.stds[::8]
        for direction in ("reverse", "forward"):
            fit = full_kl_study.fit_unimodal(self.target, GRID, direction, means, stds)
            best = math.inf
            for m in means.tolist():
                for s in stds.tolist():
                    q = full_kl_study.gaussian_logits(GRID, m, s)
                    kl = _kl(q, self.target) if direction == "reverse" else _kl(self.target, q)
                    best = min(best, float(kl))
            assert fit.kl == pytest.approx(best, rel=1e-9)
            q = fit.logits
            direct = _kl(q, self.target) if direction == "reverse" else _kl(self.target, q)
            assert fit.kl == pytest.approx(float(direct), rel=1e-9)

    def test_reverse_seeks_a_mode_forward_covers_the_mass(self) -> None:
        rev = full_kl_study.fit_unimodal(self.target, GRID, "reverse", self.means, self.stds)
        fwd = full_kl_study.fit_unimodal(self.target, GRID, "forward", self.means, self.stds)
        # reverse: the heavier mode at -2 with its own width
        assert (rev.mean, rev.std) == pytest.approx((-2.0, 0.6), abs=0.06)
        # forward: moment matching on the grid (the minimiser of KL(p‖q) over an exponential
        # family matches the sufficient statistics x and x²), up to the search step
        p, q = torch.softmax(self.target, -1), torch.softmax(fwd.logits, -1)
        for power, tol in ((1, 0.05), (2, 0.2)):
            assert float((q * GRID**power).sum()) == pytest.approx(
                float((p * GRID**power).sum()), abs=tol
            )
        assert fwd.std > 1.5 > rev.std

    def test_bad_arguments(self) -> None:
        with pytest.raises(ValueError, match="direction"):
            full_kl_study.fit_unimodal(self.target, GRID, "sideways", self.means, self.stds)
        with pytest.raises(ValueError, match="stds"):
            full_kl_study.fit_unimodal(self.target, GRID, "forward", self.means, -self.stds)

    def test_plot(self) -> None:
        fit = full_kl_study.fit_unimodal(self.target, GRID, "reverse", self.means[::8], self.stds)
        fig = full_kl_study.plot_forward_reverse(GRID, self.target, [fit])
        assert len(fig.axes[0].get_lines()) == 2
        assert layout_problems(fig) == []
