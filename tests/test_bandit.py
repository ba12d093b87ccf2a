"""klpen.lab.bandit and klpen.lab.loss_placement: optima, training runs, where they converge."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from klpen.lab.bandit import (
    HISTORY_KEYS,
    BanditRun,
    forward_kl_optimal_policy,
    optimal_policy,
    plot_bandit,
    single_threaded,
    train_bandit,
)
from klpen.lab.loss_placement import (
    OPTIMA_HEADERS,
    STUDY_HEADERS,
    expected_flow,
    monte_carlo_table,
    optima_rows,
    placement_study,
)

F64 = torch.float64


def objective(p: np.ndarray, q: np.ndarray, r: np.ndarray, beta: float, forward: bool) -> float:
    """E_p[r] - β KL, in NumPy float64 (KL(q‖p) if forward else KL(p‖q))."""
    kl = float(np.sum(q * np.log(q / p))) if forward else float(np.sum(p * np.log(p / q)))
    return float(p @ r) - beta * kl


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
    w_list, r_list, beta, seed = case
    w, r = np.array(w_list), np.array(r_list)
    q = softmax(w)
    star = optimal_policy(torch.tensor(w), torch.tensor(r), beta).numpy()
    fwd = forward_kl_optimal_policy(torch.tensor(w), torch.tensor(r), beta).numpy()
    # Closed form of π* and the value β log Σ q e^{r/β} of the objective there.
    expected = q * np.exp(r / beta)
    np.testing.assert_allclose(star, expected / expected.sum(), rtol=1e-12, atol=1e-15)
    value = beta * math.log(float(np.sum(q * np.exp(r / beta))))
    assert math.isclose(objective(star, q, r, beta, False), value, rel_tol=1e-9, abs_tol=1e-12)
    # π_fwd satisfies its stationarity condition r + β q/π = λ on every response.
    assert math.isclose(fwd.sum(), 1.0, rel_tol=1e-12)
    lam = r + beta * q / fwd
    np.testing.assert_allclose(lam, lam.mean(), rtol=1e-9, atol=1e-9)
    # Both beat random policies (and each other) on their own objective.
    rng = np.random.default_rng(seed)
    for _ in range(20):
        other = softmax(np.log(star) + rng.normal(0, 0.5, size=len(w)))
        assert objective(other, q, r, beta, False) <= objective(star, q, r, beta, False) + 1e-12
        other = softmax(np.log(fwd) + rng.normal(0, 0.5, size=len(w)))
        assert objective(other, q, r, beta, True) <= objective(fwd, q, r, beta, True) + 1e-12
    assert objective(fwd, q, r, beta, True) >= objective(star, q, r, beta, True) - 1e-12


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
    run = train_bandit(W, R, beta=0.3, true_reward=true, steps=40, batch_size=16, seed=5)
    again = train_bandit(W, R, beta=0.3, true_reward=true, steps=40, batch_size=16, seed=5)
    other = train_bandit(W, R, beta=0.3, true_reward=true, steps=40, batch_size=16, seed=6)
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
    plain = train_bandit(W, R, beta=0.3, steps=3)
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
    beta = 0.3
    star, fwd = optimal_policy(W, R, beta), forward_kl_optimal_policy(W, R, beta)
    assert tv(star, fwd) > 0.05  # the two optima are distinguishable here
    run = train_bandit(W, R, beta=beta, placement=placement, estimator=estimator, steps=300, seed=0)
    mine, theirs = (star, fwd) if target == "star" else (fwd, star)
    assert tv(run.probs, mine) < 0.03 < tv(run.probs, theirs)


def test_no_penalty_and_k1_in_the_loss_ignore_beta() -> None:
    beta = 0.3
    none = train_bandit(W, R, beta=beta, placement="none", steps=300)
    none_other_beta = train_bandit(W, R, beta=5.0, placement="none", steps=300)
    assert torch.equal(none.policy_logits, none_other_beta.policy_logits)
    k1_loss = train_bandit(W, R, beta=beta, placement="loss", estimator="k1", steps=300)
    star = optimal_policy(W, R, beta)
    for run in (none, k1_loss):
        # Both run off towards the best response, far past the regularised optimum.
        assert float(run.probs[1]) > 0.9 and run.history["kl"][-1] > 3 * float(
            (star * (star.log() - torch.log_softmax(W, -1))).sum()
        )


def test_expected_flow_reaches_the_fixed_points() -> None:
    beta = 0.3
    star, fwd = optimal_policy(W, R, beta), forward_kl_optimal_policy(W, R, beta)
    for placement, estimator, target in [
        ("reward", "k1", star),
        ("loss", "k2", star),
        ("loss", "k3+", star),
        ("loss", "k3", fwd),
    ]:
        p = expected_flow(W, R, beta=beta, placement=placement, estimator=estimator)
        assert tv(p, target) < 1e-3, (placement, estimator)
    # k3 in the reward has no interior fixed point: responses it starves are driven to 0.
    p = expected_flow(W, R, beta=beta, placement="reward", estimator="k3")
    assert float(p.min()) < 1e-6 and tv(p, star) > 0.1


def test_placement_study_rows_and_runs() -> None:
    study = placement_study(
        W, R, beta=0.3, configs=[("reward", "k1"), ("loss", "k3")], steps=100, flow_steps=500
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
        "a": train_bandit(W, R, beta=0.3, steps=5),
        "b": train_bandit(W, R, beta=0.3, steps=5, seed=1),
    }
    fig = plot_bandit(runs, optimum={"π*": optimal_policy(W, R, 0.3)}, metrics=("kl",))
    assert len(fig.axes) == 2
    assert fig.axes[0].get_title() == "kl"
    fig = plot_bandit(runs, optimum=optimal_policy(W, R, 0.3))
    assert len(fig.axes) == 3
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
        ({"beta": -0.1}, ValueError, "beta must be finite and non-negative"),
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
    args: dict[str, object] = {"reference_logits": W, "reward": R, "beta": 0.1, "steps": 2}
    args.update(kwargs)
    with pytest.raises(error, match=match):
        train_bandit(**args)  # type: ignore[arg-type]


def test_optimum_bad_input() -> None:
    with pytest.raises(ValueError, match="beta must be finite and positive"):
        optimal_policy(W, R, 0.0)
    with pytest.raises(ValueError, match="beta must be finite and positive"):
        forward_kl_optimal_policy(W, R, math.nan)
    with pytest.raises(TypeError, match=r"reward must be a torch\.Tensor"):
        optimal_policy(W, [0.0] * 5, 1.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="placement must be one of"):
        expected_flow(W, R, beta=0.1, placement="both")
    with pytest.raises(ValueError, match="configs must be a non-empty"):
        placement_study(W, R, beta=0.1, configs=[])


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
