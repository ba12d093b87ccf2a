"""klpen_book.bandit and klpen_book.loss_placement: optima, training runs, where they converge."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from klpen_book.bandit import (
    HISTORY_KEYS,
    BanditRun,
    forward_kl_optimal_policy,
    optimal_policy,
    plot_bandit,
    single_threaded,
    train_bandit,
)
from klpen_book.figures import layout_problems
from klpen_book.loss_placement import (
    OPTIMA_HEADERS,
    STATIONARY_HEADERS,
    STUDY_HEADERS,
    TWO_TOKEN_HEADERS,
    TWO_TOKEN_PENALTIES,
    expected_flow,
    k3_reward_stationary_points,
    monte_carlo_table,
    optima_rows,
    placement_study,
    two_token_gradient_rows,
)

F64 = torch.float64


def objective(p: np.ndarray, q: np.ndarray, r: np.ndarray, kl_coef: float, forward: bool) -> float:
    """E_p[r] - β KL, in NumPy float64 (KL(q‖p) if forward else KL(p‖q))."""
    kl = float(np.sum(q * np.log(q / p))) if forward else float(np.sum(p * np.log(p / q)))
    return float(p @ r) - kl_coef * kl


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


bandits = st.integers(2, 8).flatmap(
    lambda v: st.tuples(
        st.lists(st.floats(-2, 2), min_size=v, max_size=v),
        st.lists(st.floats(-1, 1), min_size=v, max_size=v),
        st.floats(0.05, 2.0),
        st.integers(0, 2**16),
    )
)


@settings(deadline=None, max_examples=40)
@given(bandits)
def test_optimal_policies_maximise_their_objectives(case: tuple) -> None:
    w_list, r_list, kl_coef, seed = case
    w, r = np.array(w_list), np.array(r_list)
    q = softmax(w)
    star = optimal_policy(torch.tensor(w), torch.tensor(r), kl_coef).numpy()
    fwd = forward_kl_optimal_policy(torch.tensor(w), torch.tensor(r), kl_coef).numpy()
    # Closed form of π* and the value β log Σ q e^{r/β} of the objective there.
    expected = q * np.exp(r / kl_coef)
    np.testing.assert_allclose(star, expected / expected.sum(), rtol=1e-12, atol=1e-15)
    value = kl_coef * math.log(float(np.sum(q * np.exp(r / kl_coef))))
    assert math.isclose(objective(star, q, r, kl_coef, False), value, rel_tol=1e-9, abs_tol=1e-12)
    # π_fwd satisfies its stationarity condition r + β q/π = λ on every response.
    assert math.isclose(fwd.sum(), 1.0, rel_tol=1e-12)
    lam = r + kl_coef * q / fwd
    np.testing.assert_allclose(lam, lam.mean(), rtol=1e-9, atol=1e-9)
    # Both beat random policies (and each other) on their own objective.
    rng = np.random.default_rng(seed)
    for _ in range(20):
        other = softmax(np.log(star) + rng.normal(0, 0.5, size=len(w)))
        assert (
            objective(other, q, r, kl_coef, False) <= objective(star, q, r, kl_coef, False) + 1e-12
        )
        other = softmax(np.log(fwd) + rng.normal(0, 0.5, size=len(w)))
        assert objective(other, q, r, kl_coef, True) <= objective(fwd, q, r, kl_coef, True) + 1e-12
    assert objective(fwd, q, r, kl_coef, True) >= objective(star, q, r, kl_coef, True) - 1e-12


def test_forward_optimum_two_responses() -> None:
    # q = (1/2, 1/2), r = (1, 0), β = 1: λ² - 2λ + 1/2 = 0, λ = 1 + 1/√2.
    p = forward_kl_optimal_policy(
        torch.zeros(2, dtype=F64), torch.tensor([1.0, 0.0], dtype=F64), 1.0
    )
    torch.testing.assert_close(p, torch.tensor([1 / math.sqrt(2), 1 - 1 / math.sqrt(2)], dtype=F64))


def test_optimal_policy_dtype() -> None:
    assert (
        optimal_policy(torch.zeros(3, dtype=torch.bfloat16), torch.zeros(3), 1.0).dtype
        == torch.float32
    )
    p = forward_kl_optimal_policy(torch.zeros(3), torch.zeros(3), 0.5)
    assert p.dtype == torch.float32
    torch.testing.assert_close(p, torch.full((3,), 1 / 3))


W = torch.tensor([0.5, 0.0, -0.5, 1.0, 0.2], dtype=F64)
R = torch.tensor([0.1, 0.9, 0.4, 0.0, 0.6], dtype=F64)


def tv(p: torch.Tensor, q: torch.Tensor) -> float:
    return 0.5 * float((p.double() - q.double()).abs().sum())


def test_history_is_exact_and_deterministic() -> None:
    true = torch.tensor([0.0, 1.0, 0.0, 0.0, 0.0], dtype=F64)
    run = train_bandit(W, R, kl_coef=0.3, true_reward=true, steps=40, batch_size=16, seed=5)
    again = train_bandit(W, R, kl_coef=0.3, true_reward=true, steps=40, batch_size=16, seed=5)
    other = train_bandit(W, R, kl_coef=0.3, true_reward=true, steps=40, batch_size=16, seed=6)
    assert isinstance(run, BanditRun) and set(run.history) == set(HISTORY_KEYS)
    assert all(len(v) == 40 for v in run.history.values())
    assert run.history == again.history
    assert torch.equal(run.policy_logits, again.policy_logits)
    assert run.history["kl"] != other.history["kl"]
    # Entry 0 is the reference itself.
    q = torch.softmax(W, -1)
    assert run.history["kl"][0] == 0.0
    assert math.isclose(run.history["proxy_reward"][0], float(q @ R), rel_tol=1e-12)
    assert math.isclose(run.history["true_reward"][0], float(q[1]), rel_tol=1e-12)
    for proxy, kl, obj in zip(
        run.history["proxy_reward"], run.history["kl"], run.history["objective"], strict=True
    ):
        assert math.isclose(obj, proxy - 0.3 * kl, rel_tol=1e-12, abs_tol=1e-15)
    # Without a true reward, the true reward is the proxy.
    plain = train_bandit(W, R, kl_coef=0.3, steps=3)
    assert plain.history["true_reward"] == plain.history["proxy_reward"]


@pytest.mark.parametrize(
    ("placement", "estimator", "target"),
    [
        ("reward", "k1", "star"),
        ("loss", "k2", "star"),
        ("loss", "k1+", "star"),
        ("loss", "k3", "fwd"),
    ],
)
def test_training_converges_to_the_predicted_optimum(
    placement: str, estimator: str, target: str
) -> None:
    kl_coef = 0.3
    star, fwd = optimal_policy(W, R, kl_coef), forward_kl_optimal_policy(W, R, kl_coef)
    assert tv(star, fwd) > 0.05  # the two optima are distinguishable here
    run = train_bandit(
        W, R, kl_coef=kl_coef, placement=placement, estimator=estimator, steps=300, seed=0
    )
    mine, theirs = (star, fwd) if target == "star" else (fwd, star)
    assert tv(run.probs, mine) < 0.03 < tv(run.probs, theirs)


def test_no_penalty_and_k1_in_the_loss_ignore_beta() -> None:
    kl_coef = 0.3
    none = train_bandit(W, R, kl_coef=kl_coef, placement="none", steps=300)
    none_other_beta = train_bandit(W, R, kl_coef=5.0, placement="none", steps=300)
    assert torch.equal(none.policy_logits, none_other_beta.policy_logits)
    k1_loss = train_bandit(W, R, kl_coef=kl_coef, placement="loss", estimator="k1", steps=300)
    star = optimal_policy(W, R, kl_coef)
    for run in (none, k1_loss):
        # Both run off towards the best response, far past the regularised optimum.
        assert float(run.probs[1]) > 0.9 and run.history["kl"][-1] > 3 * float(
            (star * (star.log() - torch.log_softmax(W, -1))).sum()
        )


def test_expected_flow_reaches_the_fixed_points() -> None:
    kl_coef = 0.3
    star, fwd = optimal_policy(W, R, kl_coef), forward_kl_optimal_policy(W, R, kl_coef)
    for placement, estimator, target in [
        ("reward", "k1", star),
        ("loss", "k2", star),
        ("loss", "k3+", star),
        ("loss", "k3", fwd),
    ]:
        p = expected_flow(W, R, kl_coef=kl_coef, placement=placement, estimator=estimator)
        assert tv(p, target) < 1e-3, (placement, estimator)
    # k3 in the reward has no interior fixed point: responses it starves are driven to 0.
    p = expected_flow(W, R, kl_coef=kl_coef, placement="reward", estimator="k3")
    assert float(p.min()) < 1e-6 and tv(p, star) > 0.1


def test_placement_study_rows_and_runs() -> None:
    study = placement_study(
        W, R, kl_coef=0.3, configs=[("reward", "k1"), ("loss", "k3")], steps=100, flow_steps=500
    )
    assert len(study.rows) == 2 and all(len(row) == len(STUDY_HEADERS) for row in study.rows)
    assert set(study.runs) == {"reward/k1", "loss/k3"}
    assert study.rows[0][2] < 0.02 < study.rows[0][3]
    assert study.rows[1][3] < 0.02 < study.rows[1][2]
    torch.testing.assert_close(study.optimum, optimal_policy(W, R, 0.3))
    run = study.runs["loss/k3"]
    torch.testing.assert_close(
        torch.tensor(study.rows[1][6], dtype=F64),
        torch.tensor(run.history["kl"][-1], dtype=F64),
        atol=0.05,
        rtol=0,
    )


def test_plot_bandit() -> None:
    runs = {
        "a": train_bandit(W, R, kl_coef=0.3, steps=5),
        "b": train_bandit(W, R, kl_coef=0.3, steps=5, seed=1),
    }
    fig = plot_bandit(runs, optimum={"π*": optimal_policy(W, R, 0.3)}, metrics=("kl",))
    assert len(fig.axes) == 2
    assert fig.axes[0].get_ylabel() == "KL(π ‖ π_ref) (nats)"
    fig = plot_bandit(runs, optimum=optimal_policy(W, R, 0.3))
    assert len(fig.axes) == 3
    # Laid out for the column: at most two panels a row, every axis labelled, one legend for
    # the whole figure naming every run and the optimum, in a readable size.
    fig = plot_bandit(runs, optimum=optimal_policy(W, R, 0.3), metrics=HISTORY_KEYS[:3])
    assert len(fig.axes) == 4
    fig.canvas.draw()
    assert layout_problems(fig) == []
    fig = plot_bandit(runs, optimum=optimal_policy(W, R, 0.3), metrics=HISTORY_KEYS[:2])
    fig.canvas.draw()
    assert layout_problems(fig) == []  # the odd panel spans the last row
    for ax in fig.axes:
        assert ax.get_subplotspec().get_gridspec().ncols <= 2
        assert ax.get_xlabel() and ax.get_ylabel()
        assert ax.get_legend() is None
    (legend,) = fig.legends
    assert [t.get_text() for t in legend.get_texts()] == ["a", "b", "optimum"]
    assert all(t.get_fontsize() >= 9 for t in legend.get_texts())
    with pytest.raises(ValueError, match="metrics must be one of"):
        plot_bandit(runs, metrics=("reward",))
    with pytest.raises(ValueError, match="non-empty mapping"):
        plot_bandit({})
    with pytest.raises(TypeError, match=r"runs\['x'\] must be a BanditRun"):
        plot_bandit({"x": 1})  # type: ignore[dict-item]


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (
            {"reference_logits": torch.zeros(2, 5), "reward": torch.zeros(2, 5)},
            ValueError,
            r"reference_logits must have shape \(V,\)",
        ),
        ({"reward": torch.zeros(4)}, ValueError, r"reward must have shape \(5,\)"),
        ({"reward": torch.tensor([0.0, 1, 2, 3, math.inf])}, ValueError, "reward must be finite"),
        ({"kl_coef": -0.1}, ValueError, "kl_coef must be finite and non-negative"),
        ({"placement": "advantage"}, ValueError, "placement must be one of"),
        ({"estimator": "k5"}, ValueError, "estimator must be one of"),
        ({"steps": 0}, ValueError, "steps must be at least 1"),
        ({"steps": 2.5}, TypeError, "steps must be an integer"),
        ({"batch_size": 1}, ValueError, "batch_size must be at least 2"),
        ({"batch_size": True}, TypeError, "batch_size must be an integer"),
        ({"lr": 0.0}, ValueError, "lr must be finite and positive"),
        ({"seed": -1}, ValueError, "seed must be at least 0"),
        ({"true_reward": torch.zeros(3)}, ValueError, r"true_reward must have shape \(5,\)"),
    ],
)
def test_train_bandit_bad_input(
    kwargs: dict[str, object], error: type[Exception], match: str
) -> None:
    args: dict[str, object] = {"reference_logits": W, "reward": R, "kl_coef": 0.1, "steps": 2}
    args.update(kwargs)
    with pytest.raises(error, match=match):
        train_bandit(**args)  # type: ignore[arg-type]


def test_optimum_bad_input() -> None:
    with pytest.raises(ValueError, match="kl_coef must be finite and positive"):
        optimal_policy(W, R, 0.0)
    with pytest.raises(ValueError, match="kl_coef must be finite and positive"):
        forward_kl_optimal_policy(W, R, math.nan)
    with pytest.raises(TypeError, match=r"reward must be a torch\.Tensor"):
        optimal_policy(W, [0.0] * 5, 1.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="placement must be one of"):
        expected_flow(W, R, kl_coef=0.1, placement="both")
    with pytest.raises(ValueError, match="configs must be a non-empty"):
        placement_study(W, R, kl_coef=0.1, configs=[])


def test_optima_rows_match_the_optima() -> None:
    rows = optima_rows(W, R, 0.3)
    star, fwd = optimal_policy(W, R, 0.3), forward_kl_optimal_policy(W, R, 0.3)
    q = torch.softmax(W, -1)
    assert [row[0] for row in rows] == list(range(5))
    for y, row in enumerate(rows):
        assert len(row) == len(OPTIMA_HEADERS)
        assert row[1:] == pytest.approx([float(q[y]), float(R[y]), float(star[y]), float(fwd[y])])


def test_monte_carlo_table_rows() -> None:
    z = torch.tensor([0.8, -0.4, 0.0, 1.2, -1.0], dtype=F64)
    w = torch.tensor([0.0, 0.5, -0.3, 0.1, 0.4], dtype=F64)
    configs = [("loss", "k3"), ("reward", "k1")]
    rows = monte_carlo_table(z, w, configs, samples=5000, seed=2)
    assert [tuple(row[:2]) for row in rows] == configs
    for _, _, gap, se, z_max in rows:
        assert 0 < se < 0.05 and gap <= z_max * se + 1e-15 and z_max < 5
    with pytest.raises(TypeError, match="pairs"):
        monte_carlo_table(z, w, [("loss", "k3", 1)], samples=10)  # type: ignore[list-item]
    with pytest.raises(ValueError, match="non-empty"):
        monte_carlo_table(z, w, "loss", samples=10)  # type: ignore[arg-type]


def test_single_threaded_restores_the_thread_count_after_an_error() -> None:
    before = torch.get_num_threads()
    with pytest.raises(RuntimeError, match="boom"), single_threaded():
        assert torch.get_num_threads() == 1
        raise RuntimeError("boom")
    assert torch.get_num_threads() == before


def _k3_reward_field(
    logits: np.ndarray, ref: np.ndarray, r: np.ndarray, kl_coef: float
) -> np.ndarray:
    """Ascent field π_y (A_y − E_π A), A = r − β k3(log π/π_ref), in NumPy float64."""
    p = softmax(logits)
    u = p / ref
    a = r - kl_coef * (1 / u + np.log(u) - 1)
    return p * (a - p @ a)


def test_k3_reward_stationary_points_of_the_chapter_7_bandit() -> None:
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(6, generator=gen, dtype=F64)
    r = torch.rand(6, generator=gen, dtype=F64)
    rows = k3_reward_stationary_points(w, r, kl_coef=0.2)
    assert len(rows[0]) == len(STATIONARY_HEADERS)
    # Chapter 7's claim: seven interior stationary points, none of them stable.
    assert len(rows) == 7
    assert {row[-1] for row in rows} == {"no"}
    ref, rr = softmax(w.numpy()), r.numpy()
    for row in rows:
        p = np.array([float(x) for x in row[1].strip("[]").split(",")])
        assert p.sum() == pytest.approx(1.0, abs=5e-3)
        # Stationary under the independent NumPy field (to the printed 3 decimals).
        assert np.abs(_k3_reward_field(np.log(p), ref, rr, 0.2)).max() < 5e-3
        assert float(row[3]) > 0


@settings(deadline=None, max_examples=15)
@given(st.floats(-1.5, 1.5), st.floats(0.05, 1.0), st.booleans(), st.floats(0.1, 2.0))
def test_k3_reward_stationary_points_two_responses(
    w1: float, r1: float, negative: bool, kl_coef: float
) -> None:
    """V = 2: the points are the sign changes of a 1-D field, found by an independent scan."""
    r1 = -r1 if negative else r1
    w = torch.tensor([0.0, w1], dtype=F64)
    r = torch.tensor([0.0, r1], dtype=F64)
    rows = k3_reward_stationary_points(w, r, kl_coef=kl_coef)
    ref = softmax(w.numpy())
    xs = np.linspace(-25, 25, 200_001)
    # The field on response 1 along logits (0, x), vectorised form of _k3_reward_field.
    p1 = 1 / (1 + np.exp(-xs))
    p = np.stack([1 - p1, p1], axis=-1)
    u = p / ref
    a = r.numpy() - kl_coef * (1 / u + np.log(u) - 1)
    field = p1 * (a[:, 1] - (p * a).sum(-1))
    changes = np.nonzero(np.sign(field[:-1]) != np.sign(field[1:]))[0]
    assert len(rows) == len(changes)
    found = sorted(float(row[1].strip("[]").split(",")[1]) for row in rows)
    expected = sorted(softmax(np.array([0.0, xs[i]]))[1] for i in changes)
    np.testing.assert_allclose(found, expected, atol=2e-3)
    # In one dimension an interior zero is stable exactly when the field falls through it.
    for i, row in zip(
        sorted(changes, key=lambda i: softmax(np.array([0.0, xs[i]]))[0]), rows, strict=True
    ):
        assert (row[-1] == "yes") == bool(field[i] > 0 > field[i + 1])


def test_k3_reward_stationary_points_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="kl_coef"):
        k3_reward_stationary_points(W, R, kl_coef=0.0)
    with pytest.raises(ValueError, match="at most 12"):
        k3_reward_stationary_points(torch.zeros(13), torch.zeros(13), kl_coef=1.0)
    with pytest.raises(ValueError, match="finite"):
        k3_reward_stationary_points(torch.tensor([0.0, math.inf]), torch.zeros(2), kl_coef=1.0)


def test_two_token_gradient_rows_against_the_future_kl_term() -> None:
    gen = torch.Generator().manual_seed(3)
    v = 3
    w1, w2 = torch.randn(v, generator=gen, dtype=F64), torch.randn(v, v, generator=gen, dtype=F64)
    z1 = w1 + torch.randn(v, generator=gen, dtype=F64)
    z2 = w2 + torch.randn(v, v, generator=gen, dtype=F64)
    rows = {row[0]: row[1:] for row in two_token_gradient_rows(z1, z2, w1, w2)}
    assert list(rows) == list(TWO_TOKEN_PENALTIES)
    assert len(TWO_TOKEN_HEADERS) == 3
    # Independent NumPy: the missing term E_π1[KL2(y1) (e_y1 − π1)] on the step-1 logits.
    p1, q2, p2 = softmax(z1.numpy()), None, np.stack([softmax(row) for row in z2.numpy()])
    q2 = np.stack([softmax(row) for row in w2.numpy()])
    kl2 = (p2 * np.log(p2 / q2)).sum(-1)
    future = p1 * (kl2 - p1 @ kl2)
    gap = float(np.abs(future).max())
    assert gap > 0.01
    assert rows["k1 in the reward, reward-to-go"] == [0.0, 0.0]
    for label in ("k2 in the loss", "k3+ in the loss", "exact full KL per position in the loss"):
        assert rows[label][0] == pytest.approx(gap, abs=2e-6)
        assert rows[label][1] == 0.0
    assert rows["k3 in the loss"][1] > 0.01  # the forward KL at step 2 too


def test_two_token_gradient_rows_rejects_bad_shapes() -> None:
    with pytest.raises(ValueError, match=r"policy_second must have shape \(2, 2\)"):
        two_token_gradient_rows(
            torch.zeros(2), torch.zeros(3, 3), torch.zeros(2), torch.zeros(3, 3)
        )
    with pytest.raises(ValueError, match="reference_first"):
        two_token_gradient_rows(
            torch.zeros(2), torch.zeros(2, 2), torch.zeros(3), torch.zeros(2, 2)
        )
