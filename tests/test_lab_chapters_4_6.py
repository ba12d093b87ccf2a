"""Tests of the laboratories of chapters 4-6: masking_study, controller_study, objective_study.

Each lab function is checked against an independent float64 reference or a derived property
(the closed-form weights of the aggregation modes, the closed-form relaxation of the simulated
KL, the identity E_q[log π/π_ref] = KL(q‖π_ref) − KL(q‖π), ...).
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import klpen
from klpen.masking import AGGREGATION_MODES
from klpen_book import bandit, controller_study, masking_study, objective_study
from klpen_book.figures import layout_problems

FAST = settings(deadline=None, max_examples=25)


def _table_rows(text: str) -> list[list[str]]:
    """The body of a format_table as whitespace-split cells (labels must be one word)."""
    return [line.split() for line in text.splitlines()[2:]]


# --- chapter 4: masking_study --------------------------------------------------------------


@pytest.mark.parametrize("padding", ["right", "left"])
def test_padded_batch_layout(padding: str) -> None:
    lengths = [5, 0, 3, 7]
    batch = masking_study.padded_batch(lengths, total_length=8, padding=padding, seed=3)
    assert batch.policy_logits.shape == batch.reference_logits.shape == (4, 8, 32)
    assert batch.mask.sum(-1).tolist() == lengths
    # Pad id 0 exactly at the padded positions, real tokens (never 0) in the responses.
    assert torch.equal(batch.tokens == 0, ~batch.mask)
    rows = torch.arange(8)[None, :]
    n = torch.tensor(lengths)[:, None]
    expected = rows < n if padding == "right" else rows >= 8 - n
    assert torch.equal(batch.mask, expected)


def test_left_padding_is_the_right_padded_batch_rotated() -> None:
    lengths = [6, 2, 4]
    right = masking_study.padded_batch(lengths, padding="right", seed=1)
    left = masking_study.padded_batch(lengths, padding="left", seed=1)
    t = max(lengths)
    for b, n in enumerate(lengths):
        assert torch.equal(left.tokens[b, t - n :], right.tokens[b, :n])
        assert torch.equal(left.policy_logits[b, t - n :], right.policy_logits[b, :n])
        assert torch.equal(left.reference_logits[b, t - n :], right.reference_logits[b, :n])


def test_padded_batch_pad_boost_inflates_the_unmasked_kl_only() -> None:
    batch = masking_study.padded_batch([8, 2], seed=0, pad_boost=4.0)
    plain = masking_study.padded_batch([8, 2], seed=0, pad_boost=0.0)
    lp = klpen.get_logprobs_for_tokens(batch.policy_logits, batch.tokens)
    lr = klpen.get_logprobs_for_tokens(batch.reference_logits, batch.tokens)
    lp0 = klpen.get_logprobs_for_tokens(plain.policy_logits, plain.tokens)
    lr0 = klpen.get_logprobs_for_tokens(plain.reference_logits, plain.tokens)
    masked = klpen.compute_token_kl(lp, lr, batch.mask)[1]
    masked0 = klpen.compute_token_kl(lp0, lr0, plain.mask)[1]
    unmasked = klpen.compute_token_kl(lp, lr)[1]
    unmasked0 = klpen.compute_token_kl(lp0, lr0)[1]
    # The boost raises log π(pad) at padded positions: log-ratio strictly larger there...
    assert unmasked[1] > unmasked0[1] + 6 * 1.0
    # ...and touches nothing inside the responses: the masked sums ignore it entirely.
    assert torch.equal(masked, masked0)


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"padding": "middle"}, ValueError),
        ({"vocab_size": 1}, ValueError),
        ({"total_length": 2}, ValueError),
        ({"pad_boost": -1.0}, ValueError),
    ],
)
def test_padded_batch_rejects_bad_arguments(kwargs: dict[str, object], error: type) -> None:
    with pytest.raises(error):
        masking_study.padded_batch([3, 1], **kwargs)  # type: ignore[arg-type]


def _expected_weight(lengths: list[int], mode: str) -> np.ndarray:
    """Closed-form weight of one token of each row (chapter 4's table)."""
    n_tokens = sum(lengths)
    rows = sum(1 for n in lengths if n)
    out = []
    for n in lengths:
        if n == 0:
            out.append(0.0)
        elif mode == "token-mean":
            out.append(1 / n_tokens)
        elif mode == "token-sum":
            out.append(1.0)
        elif mode == "seq-mean-token-mean":
            out.append(1 / (rows * n))
        else:
            out.append(1 / rows)
    return np.array(out)


@FAST
@given(
    lengths=st.lists(st.integers(0, 9), min_size=1, max_size=5).filter(any),
    mode=st.sampled_from(AGGREGATION_MODES),
    seed=st.integers(0, 2**16),
)
def test_token_weights_are_the_closed_form_and_reproduce_aggregate(
    lengths: list[int], mode: str, seed: int
) -> None:
    t = max(lengths)
    mask = torch.arange(t)[None, :] < torch.tensor(lengths)[:, None]
    weights = masking_study.token_weights(mask, mode)
    expected = _expected_weight(lengths, mode)[:, None] * mask.numpy()
    np.testing.assert_allclose(weights.numpy(), expected, rtol=1e-12, atol=0)
    # Linearity: aggregate(x) is the weighted sum, for any values (padding included).
    values = torch.randn(len(lengths), t, generator=torch.Generator().manual_seed(seed)).double()
    values[~mask] = float("nan")
    assert math.isclose(
        klpen.aggregate(values, mask, mode).item(),
        float((weights * torch.nan_to_num(values)).sum()),
        rel_tol=1e-12,
        abs_tol=1e-12,
    )


def test_length_bias_table_numbers() -> None:
    lengths = [2, 6]
    rows = {
        r[0]: [float(x) for x in r[1:]]
        for r in _table_rows(masking_study.length_bias_table(lengths))
    }
    assert set(rows) == set(AGGREGATION_MODES)
    for mode, cells in rows.items():
        w = _expected_weight(lengths, mode)
        expected = [w[0], w[0] * 2, w[1], w[1] * 6]
        np.testing.assert_allclose(cells, expected, atol=5e-4)


def test_plot_length_bias_bars_are_the_weights() -> None:
    fig = masking_study.plot_length_bias([3, 12])
    token_ax, row_ax = fig.axes
    heights = sorted(round(p.get_height(), 9) for p in token_ax.patches)
    expected = sorted(
        round(float(w), 9) for m in AGGREGATION_MODES for w in _expected_weight([3, 12], m)
    )
    assert heights == expected
    assert token_ax.get_yscale() == row_ax.get_yscale() == "log"
    assert layout_problems(fig) == []


# --- chapter 5: controller_study -----------------------------------------------------------


def test_noise_free_run_relaxes_geometrically_toward_the_equilibrium() -> None:
    # Fixed β: the equilibrium is m·target·(β0/β)^γ, reached geometrically in log space.
    kl_coef, beta0, target, m, rate, gamma = 0.4, 0.1, 6.0, 3.0, 0.3, 0.5
    run = controller_study.simulate_run(
        klpen.FixedKLController(kl_coef),
        [controller_study.Phase("p", 30, m)],
        target_kl=target,
        init_kl_coef=beta0,
        gamma=gamma,
        rate=rate,
        noise=0.0,
    )
    eq = math.log(m * target * (beta0 / kl_coef) ** gamma)
    expected = [math.exp(eq + (1 - rate) ** t * (math.log(target) - eq)) for t in range(30)]
    np.testing.assert_allclose(run.true_kl, expected, rtol=1e-12)
    assert run.kl == run.true_kl
    assert run.kl_coef == [kl_coef] * 30
    assert run.phase == ["p"] * 30


def test_noise_is_lognormal_from_the_seed() -> None:
    run = controller_study.simulate_run(klpen.FixedKLController(0.1), noise=0.25, seed=7)
    eps = np.random.default_rng(7).standard_normal(len(run.kl))
    np.testing.assert_allclose(np.log(np.array(run.kl) / np.array(run.true_kl)), 0.25 * eps)


def test_controller_sees_the_measurements_and_n_steps() -> None:
    ctl = klpen.AdaptiveKLController(0.1, 6.0, 1000)
    run = controller_study.simulate_run(ctl, n_steps=64, seed=2)
    assert ctl.kl_history == run.kl
    # Independent replay of Ziegler et al.'s rule on the recorded measurements.
    coef, betas = 0.1, []
    for kl in run.kl:
        coef *= 1 + min(max(kl / 6.0 - 1, -0.2), 0.2) * 64 / 1000
        betas.append(coef)
    np.testing.assert_allclose(run.kl_coef, betas, rtol=1e-12)


@FAST
@given(cut=st.integers(0, 400))
def test_cut_save_restore_resume_is_identical(cut: int) -> None:
    uncut_ctl = klpen.DoublingKLController(0.1, 6.0)
    uncut = controller_study.simulate_run(uncut_ctl, seed=5)
    first_ctl = klpen.DoublingKLController(0.1, 6.0)
    first = controller_study.simulate_run(first_ctl, stop=cut, seed=5)
    restored = klpen.DoublingKLController(3.0, 1.0)
    restored.load_state_dict(json.loads(json.dumps(first_ctl.state_dict())))
    second = controller_study.simulate_run(
        restored, start=cut, initial_kl=first.next_kl if cut else None, seed=5
    )
    assert first.kl_coef + second.kl_coef == uncut.kl_coef
    assert first.kl + second.kl == uncut.kl
    assert restored.coef_history == uncut_ctl.coef_history


def test_doubling_rule_saturates_and_cycles() -> None:
    run = controller_study.simulate_run(klpen.DoublingKLController(0.1, 6.0))
    by_phase = {
        name: [b for b, p in zip(run.kl_coef, run.phase, strict=True) if p == name]
        for name in dict.fromkeys(run.phase)
    }
    assert by_phase["high"][-1] == klpen.DoublingKLController.MAX_COEF
    assert by_phase["low"][-1] == klpen.DoublingKLController.MIN_COEF
    # γ = 2 and no lag: doubling β divides the KL by 4 > 2.25, so it can never settle.
    cycle = controller_study.simulate_run(
        klpen.DoublingKLController(0.1, 6.0),
        [controller_study.Phase("steady", 40, 2.5)],
        gamma=2.0,
        rate=1.0,
        noise=0.0,
    )
    # Step 0 starts on target (β stays 0.1); from then on β alternates and the KL jumps the zone.
    assert cycle.kl_coef == pytest.approx([0.1, 0.2] * 20)
    assert all(not 4.0 <= kl <= 9.0 for kl in cycle.kl[1:])


def test_phase_table_statistics() -> None:
    run = controller_study.simulate_run(klpen.FixedKLController(0.1), seed=4)
    rows = _table_rows(controller_study.phase_table({"fixed": run}))
    assert [r[1] for r in rows] == ["high", "near", "low", "near"]  # "near again" splits
    kl = np.array(run.kl[:100])
    assert float(rows[0][2]) == pytest.approx(np.median(kl), abs=5e-3)
    inside = np.mean((kl >= 4.0) & (kl <= 9.0))
    assert rows[0][3] == f"{inside:.0%}"


@pytest.mark.parametrize(
    "kwargs", [{"rate": 1.5}, {"rate": 0.0}, {"stop": 401}, {"start": 5, "stop": 4}]
)
def test_simulate_run_rejects_bad_arguments(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        controller_study.simulate_run(klpen.FixedKLController(0.1), **kwargs)  # type: ignore[arg-type]


def test_plot_runs_shades_the_stable_zone() -> None:
    run = controller_study.simulate_run(klpen.FixedKLController(0.1))
    fig = controller_study.plot_runs({"fixed": run}, target_kl=6.0)
    kl_ax, beta_ax = fig.axes
    fig.canvas.draw()
    assert layout_problems(fig) == []  # the book's column, at most two panels a row, labels
    assert kl_ax.get_ylabel() and beta_ax.get_ylabel() and beta_ax.get_xlabel()
    assert kl_ax.get_legend().get_texts()[0].get_fontsize() >= 9
    (zone,) = kl_ax.patches
    assert (zone.get_y(), zone.get_y() + zone.get_height()) == pytest.approx((4.0, 9.0))
    (line,) = [ln for ln in kl_ax.lines if ln.get_label() == "fixed"]
    assert list(line.get_ydata()) == run.kl
    assert kl_ax.get_yscale() == beta_ax.get_yscale() == "log"


# --- chapter 6: objective_study ------------------------------------------------------------


def test_synthetic_rollout_structure() -> None:
    on = objective_study.synthetic_rollout(8, 10, 12, sharpness=3.0, seed=4)
    off = objective_study.synthetic_rollout(8, 10, 12, sharpness=3.0, tokens="uniform", seed=4)
    assert torch.equal(on.policy_logits, 3.0 * on.reference_logits)
    for name in ("policy_logits", "reference_logits", "mask", "rewards"):
        assert torch.equal(getattr(on, name), getattr(off, name))
    lengths = on.mask.sum(-1)
    assert int(lengths.min()) >= 5 and int(lengths.max()) <= 10
    assert on.tokens.min() >= 0 and on.tokens.max() < 12


def test_sampled_log_ratio_estimates_kl_on_policy_and_a_kl_difference_off_policy() -> None:
    # Many independent positions: the batch mean of the log-ratio vs its float64 expectation.
    on = objective_study.synthetic_rollout(512, 16, 20, seed=0)
    off = objective_study.synthetic_rollout(512, 16, 20, tokens="uniform", seed=0)
    logp = torch.log_softmax(on.policy_logits.double(), -1)
    logq = torch.log_softmax(on.reference_logits.double(), -1)
    log_u = -math.log(20)
    kl_pq = (logp.exp() * (logp - logq)).sum(-1)  # KL(π‖π_ref) per position
    u_minus = (math.exp(log_u) * ((log_u - logq) - (log_u - logp))).sum(-1)  # KL(u‖ref)-KL(u‖π)
    for rollout, expectation in ((on, kl_pq), (off, u_minus)):
        lp = torch.gather(logp, -1, rollout.tokens[..., None])[..., 0]
        lq = torch.gather(logq, -1, rollout.tokens[..., None])[..., 0]
        r = (lp - lq)[rollout.mask]
        target = expectation[rollout.mask].mean().item()
        stderr = r.std().item() / math.sqrt(r.numel())
        assert abs(r.mean().item() - target) < 5 * stderr
    assert u_minus.mean() < 0 < kl_pq.mean()  # the sign flip chapter 6 shows


def test_objective_table_matches_the_formula() -> None:
    rollout = objective_study.synthetic_rollout(16, 6, 10, tokens="uniform", seed=2)
    rows = _table_rows(objective_study.objective_table({"u": rollout}, [0.1, 1.0]))
    logp = torch.log_softmax(rollout.policy_logits.double(), -1)
    logq = torch.log_softmax(rollout.reference_logits.double(), -1)
    idx = rollout.tokens[..., None]
    ratio = (logp.gather(-1, idx) - logq.gather(-1, idx))[..., 0] * rollout.mask
    seq_kl = ratio.sum(-1)
    exact = ((logp.exp() * (logp - logq)).sum(-1) * rollout.mask).sum(-1).mean().item()
    for row, kl_coef in zip(rows, (0.1, 1.0), strict=True):
        kl, ex, reward, penalised = (float(x) for x in row[2:])
        assert kl == pytest.approx(seq_kl.mean().item(), abs=5e-4)
        assert ex == pytest.approx(exact, abs=5e-4)
        assert reward == pytest.approx(rollout.rewards.double().mean().item(), abs=5e-4)
        expected = (rollout.rewards.double() - kl_coef * seq_kl).mean().item()
        assert penalised == pytest.approx(expected, abs=5e-4)
    # A negative "KL": the larger β, the larger the penalised reward.
    assert float(rows[1][5]) > float(rows[0][5])


def test_placement_table_rewards_to_go() -> None:
    rollout = objective_study.synthetic_rollout(4, 8, 10, seed=1)
    kl_coef, row = 0.3, 2
    rows = [
        [float(x) for x in r]
        for r in _table_rows(objective_study.placement_table(rollout, row, kl_coef))
    ]
    n = int(rollout.mask[row].sum())
    assert len(rows) == n
    logp = torch.log_softmax(rollout.policy_logits[row].double(), -1)
    logq = torch.log_softmax(rollout.reference_logits[row].double(), -1)
    tok = rollout.tokens[row, :n]
    kl = (logp[torch.arange(n), tok] - logq[torch.arange(n), tok]).tolist()
    score = rollout.rewards[row].item()
    for t, cells in enumerate(rows):
        per_token_g = score - kl_coef * sum(kl[t:])
        assert cells[1] == pytest.approx(kl[t], abs=5e-4)
        assert cells[3] == pytest.approx(per_token_g, abs=5e-4)
        assert cells[5] == pytest.approx(score - kl_coef * sum(kl), abs=5e-4)
    assert rows[0][3] == rows[0][5]  # same total return G_0


def test_hackable_bandit_and_optimum_table() -> None:
    ref, proxy, true = objective_study.hackable_bandit()
    assert torch.equal(proxy[:8], true[:8])
    assert set(torch.nonzero(proxy == proxy.max()).flatten().tolist()) == {8, 9}
    assert int(true.argmax()) == 4
    betas = [0.1, 0.7, 5.0]
    rows = _table_rows(objective_study.optimum_table(ref, proxy, true, betas))
    q = torch.softmax(ref.double(), -1)
    for cells, kl_coef in zip(rows, betas, strict=True):
        w = q * torch.exp(proxy.double() / kl_coef)
        p = w / w.sum()
        expected = [
            (p @ proxy.double()).item(),
            (p @ true.double()).item(),
            (p * (p / q).log()).sum().item(),
        ]
        np.testing.assert_allclose([float(x) for x in cells[1:]], expected, atol=5e-4)
    # The overoptimisation curve: the true reward of π*_β peaks at an intermediate β.
    true_rewards = [float(r[2]) for r in rows]
    assert true_rewards[1] > max(true_rewards[0], true_rewards[2])


def test_bandit_table_and_overoptimization_plot() -> None:
    ref, proxy, true = objective_study.hackable_bandit()
    run = bandit.train_bandit(ref, proxy, kl_coef=1.0, true_reward=true, steps=3)
    target = bandit.optimal_policy(ref, proxy, 1.0)
    rows = _table_rows(
        objective_study.bandit_table(
            {"a": run, "b": run}, ref, proxy, true, {"a": target, "b": None}
        )
    )
    p = run.probs
    assert float(rows[0][1]) == pytest.approx((p @ proxy.double()).item(), abs=5e-4)
    assert float(rows[0][4]) == pytest.approx(
        0.5 * (p - target.double()).abs().sum().item(), abs=5e-4
    )
    assert rows[1][4] == "-"
    fig = objective_study.plot_overoptimization(ref, proxy, true, [0.5, 1.0, 2.0])
    fig.canvas.draw()
    assert layout_problems(fig) == []
    proxy_line = fig.axes[0].lines[0]
    kls = [
        float(klpen.full_kl(torch.log(bandit.optimal_policy(ref, proxy, b)), ref))
        for b in (0.5, 1.0, 2.0)
    ]
    np.testing.assert_allclose(proxy_line.get_xdata(), kls, rtol=1e-6)


@pytest.mark.parametrize(
    "kwargs", [{"tokens": "greedy"}, {"sharpness": 0.0}, {"length": 1}, {"batch_size": 0}]
)
def test_synthetic_rollout_rejects_bad_arguments(kwargs: dict[str, object]) -> None:
    with pytest.raises((ValueError, TypeError)):
        objective_study.synthetic_rollout(**kwargs)  # type: ignore[arg-type]


def test_negative_mean_table_matches_normal_theory_and_sampling() -> None:
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(50, generator=gen, dtype=torch.float64)
    z = w + 0.1 * torch.randn(50, generator=gen, dtype=torch.float64)
    rows = _table_rows(objective_study.negative_mean_table(z, w, [20, 200], repeats=4000, seed=1))
    p = torch.softmax(z, -1)
    ratio = torch.log_softmax(z, -1) - torch.log_softmax(w, -1)
    kl = float(
        torch.distributions.kl_divergence(
            torch.distributions.Categorical(logits=z), torch.distributions.Categorical(logits=w)
        )
    )
    sd = float(torch.sqrt(p @ (ratio - kl) ** 2))
    for row, n in zip(rows, [20, 200], strict=True):
        assert int(row[0]) == n
        assert float(row[1]) == pytest.approx(kl, abs=1e-4)
        assert float(row[2]) == pytest.approx(sd, abs=1e-4)
        normal = float(
            torch.distributions.Normal(0.0, 1.0).cdf(torch.tensor(-math.sqrt(n) * kl / sd))
        )
        assert float(row[3]) == pytest.approx(100 * normal, abs=0.051)
        sampled, se = float(row[5]), float(row[7])
        # The sampled share agrees with the normal approximation to a few standard errors
        # (plus the approximation's own error, small for these N and a smooth ratio).
        assert abs(sampled - 100 * normal) < 4 * se + 1.5
        assert 0 < sampled < 50


def test_negative_mean_table_rejects_bad_input() -> None:
    z, w = torch.zeros(3), torch.zeros(3)
    with pytest.raises(ValueError, match="sample_sizes"):
        objective_study.negative_mean_table(z, w, [0])
    with pytest.raises(TypeError, match="sample_sizes"):
        objective_study.negative_mean_table(z, w, 10)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="repeats"):
        objective_study.negative_mean_table(z, w, [10], repeats=0)
    with pytest.raises(ValueError, match="1-D"):
        objective_study.negative_mean_table(torch.zeros(2, 3), torch.zeros(2, 3), [10])
    with pytest.raises(ValueError, match="reference_logits"):
        objective_study.negative_mean_table(z, torch.zeros(4), [10])
