"""``shape_rewards`` and ``compute_rlhf_objective`` against loops and float64 formulas.

Per-token rewards are checked against a Python loop that finds each row's last valid token by
scanning; the objective against the contract's formula evaluated with ``cross_entropy`` log-probs
in float64; padding side and whatever sits at padded positions must not matter.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from klpen import compute_rlhf_objective, shape_rewards

POISON = [float("nan"), float("inf"), float("-inf"), 1e30]


def loop_shape_rewards(
    scores: torch.Tensor, kl: torch.Tensor, mask: torch.Tensor, beta: float
) -> torch.Tensor:
    out = torch.zeros(kl.shape, dtype=torch.float64)
    for i in range(kl.shape[0]):
        last = None
        for j in range(kl.shape[1]):
            if mask[i, j]:
                out[i, j] = -beta * kl[i, j].item()
                last = j
        if last is not None:
            out[i, last] += scores[i].item()
    return out


# ---------------------------------------------------------------- shape_rewards


def test_shape_rewards_docstring_example() -> None:
    kl = torch.tensor([[0.5, 0.5, 0.0], [0.0, 1.0, 1.0]])
    mask = torch.tensor([[1, 1, 0], [0, 1, 1]])
    out = shape_rewards(torch.tensor([1.0, 2.0]), kl, mask, kl_coef=0.1)
    expected = torch.tensor([[-0.05, 0.95, 0.0], [0.0, -0.1, 1.9]])
    torch.testing.assert_close(out, expected)


@given(
    seed=st.integers(0, 2**31 - 1),
    b=st.integers(0, 5),
    t=st.integers(0, 7),
    beta=st.floats(0.0, 2.0, allow_nan=False),
    p_valid=st.sampled_from([0.0, 0.3, 0.8, 1.0]),
)
def test_shape_rewards_matches_a_loop_for_any_mask(
    seed: int, b: int, t: int, beta: float, p_valid: float
) -> None:
    gen = torch.Generator().manual_seed(seed)
    kl = torch.randn(b, t, generator=gen, dtype=torch.float64)
    scores = torch.randn(b, generator=gen, dtype=torch.float64)
    mask = torch.rand(b, t, generator=gen) < p_valid
    empty = (~mask.any(-1)).nonzero()
    if len(empty):  # a score with nowhere to go is refused, naming the first such row
        with pytest.raises(ValueError, match=rf"no valid token in row {int(empty[0, 0])} "):
            shape_rewards(scores, kl, mask, beta)
        return
    out = shape_rewards(scores, kl, mask, beta)
    assert out.shape == (b, t) and out.dtype == torch.float64
    torch.testing.assert_close(out, loop_shape_rewards(scores, kl, mask, beta), rtol=1e-12, atol=0)


@given(
    seed=st.integers(0, 2**31 - 1),
    lengths=st.lists(st.integers(1, 6), min_size=1, max_size=5),
    beta=st.floats(0.0, 2.0, allow_nan=False),
)
def test_left_and_right_padding_give_the_same_rewards(
    seed: int, lengths: list[int], beta: float
) -> None:
    t = 6
    b = len(lengths)
    gen = torch.Generator().manual_seed(seed)
    tokens_kl = torch.randn(b, t, generator=gen)
    scores = torch.randn(b, generator=gen)
    poison = torch.tensor(POISON)[torch.randint(0, len(POISON), (b, t), generator=gen)]
    right_mask = torch.zeros(b, t, dtype=torch.bool)
    left_mask = torch.zeros(b, t, dtype=torch.bool)
    right_kl, left_kl = poison.clone(), poison.flip(-1).clone()
    for i, n in enumerate(lengths):
        right_mask[i, :n] = True
        left_mask[i, t - n :] = True
        right_kl[i, :n] = tokens_kl[i, :n]
        left_kl[i, t - n :] = tokens_kl[i, :n]
    right = shape_rewards(scores, right_kl, right_mask.long(), beta)
    left = shape_rewards(scores, left_kl, left_mask.float(), beta)
    for i, n in enumerate(lengths):
        assert torch.equal(right[i, :n], left[i, t - n :])
        assert (right[i, n:] == 0).all() and (left[i, : t - n] == 0).all()
        if n:
            assert right[i, n - 1] == pytest.approx(
                scores[i].item() - beta * tokens_kl[i, n - 1].item(), rel=1e-6, abs=1e-6
            )
    assert torch.isfinite(right).all() and torch.isfinite(left).all()


def test_shape_rewards_gradients_and_poison_at_padding() -> None:
    kl = torch.tensor([[0.5, float("nan"), 0.2, float("inf")], [1.0, 2.0, 3.0, 4.0]])
    kl.requires_grad_(True)
    scores = torch.tensor([1.0, 2.0], requires_grad=True)
    mask = torch.tensor([[1, 0, 1, 0], [0, 0, 1, 0]])
    out = shape_rewards(scores, kl, mask, kl_coef=0.5)
    assert torch.isfinite(out).all()
    expected = torch.tensor([[-0.25, 0.0, 0.9, 0.0], [0.0, 0.0, 0.5, 0.0]])
    torch.testing.assert_close(out.detach(), expected)
    weights = torch.arange(1.0, 9.0).reshape(2, 4)
    (out * weights).sum().backward()
    assert kl.grad is not None and scores.grad is not None
    torch.testing.assert_close(kl.grad, -0.5 * weights * mask)
    torch.testing.assert_close(scores.grad, torch.tensor([3.0, 7.0]))  # weight at the last token


def test_shape_rewards_promotes_and_accepts_zero_coef_and_empty() -> None:
    out = shape_rewards(torch.ones(2, dtype=torch.float64), torch.ones(2, 3), torch.ones(2, 3), 0)
    assert out.dtype == torch.float64
    assert torch.equal(out, torch.tensor([[0.0, 0.0, 1.0]] * 2, dtype=torch.float64))
    assert shape_rewards(torch.zeros(0), torch.zeros(0, 3), torch.zeros(0, 3), 0.1).shape == (0, 3)
    assert shape_rewards(torch.zeros(0), torch.zeros(0, 0), torch.zeros(0, 0), 0.1).shape == (0, 0)
    with pytest.raises(ValueError, match=r"no valid token in row 0 \(of 2\)"):
        shape_rewards(torch.ones(2), torch.zeros(2, 0), torch.zeros(2, 0), 0.1)


# ---------------------------------------------------------------- compute_rlhf_objective


def make_batch(
    seed: int, b: int, t: int, v: int, p_valid: float = 0.7
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    policy = torch.randn(b, t, v, generator=gen) * 2
    reference = policy + 0.5 * torch.randn(b, t, v, generator=gen)
    tokens = torch.randint(0, v, (b, t), generator=gen)
    rewards = torch.randn(b, generator=gen)
    mask = (torch.rand(b, t, generator=gen) < p_valid).long()
    return policy, reference, tokens, rewards, mask


def float64_objective(
    policy: torch.Tensor,
    reference: torch.Tensor,
    tokens: torch.Tensor,
    rewards: torch.Tensor,
    mask: torch.Tensor,
    beta: float,
) -> dict[str, float | torch.Tensor]:
    """The contract's formula, with log-probs from cross_entropy in float64."""
    b, t, v = policy.shape

    def lp(x: torch.Tensor) -> torch.Tensor:
        ce = F.cross_entropy(x.double().reshape(-1, v), tokens.reshape(-1), reduction="none")
        return -ce.reshape(b, t)

    log_ratio = lp(policy) - lp(reference)
    per_token = torch.where(mask.bool(), log_ratio, torch.zeros((), dtype=torch.float64))
    sequence_kl = per_token.sum(-1)
    penalized = rewards.double() - beta * sequence_kl
    return {
        "objective": penalized.mean(),
        "mean_reward": rewards.double().mean().item(),
        "mean_kl": sequence_kl.mean().item(),
        "mean_penalized_reward": penalized.mean().item(),
        "kl_penalty": beta * sequence_kl.mean().item(),
        "per_token_kl": per_token,
    }


def test_objective_docstring_example() -> None:
    logits = torch.zeros(1, 2, 3)
    out = compute_rlhf_objective(
        logits, logits, torch.tensor([[0, 1]]), torch.tensor([1.0]), torch.ones(1, 2), kl_coef=0.1
    )
    assert torch.equal(out["objective"], torch.tensor(1.0)) and out["mean_kl"] == 0.0


@given(
    seed=st.integers(0, 2**31 - 1),
    b=st.integers(1, 4),
    t=st.integers(1, 5),
    v=st.integers(2, 12),
    beta=st.floats(0.0, 2.0, allow_nan=False),
)
def test_objective_matches_the_formula(seed: int, b: int, t: int, v: int, beta: float) -> None:
    batch = make_batch(seed, b, t, v)
    out = compute_rlhf_objective(*batch, kl_coef=beta)
    ref = float64_objective(*batch, beta)
    assert set(out) == set(ref)
    objective = out["objective"]
    assert isinstance(objective, torch.Tensor) and objective.shape == ()
    torch.testing.assert_close(objective.double(), ref["objective"], rtol=1e-5, atol=1e-5)
    for key in ("mean_reward", "mean_kl", "mean_penalized_reward", "kl_penalty"):
        assert type(out[key]) is float, key
        assert out[key] == pytest.approx(ref[key], rel=1e-5, abs=1e-5), key
    per_token = out["per_token_kl"]
    assert isinstance(per_token, torch.Tensor) and per_token.shape == (b, t)
    torch.testing.assert_close(per_token.double(), ref["per_token_kl"], rtol=1e-5, atol=1e-5)
    assert out["mean_penalized_reward"] == pytest.approx(objective.item(), rel=1e-6)
    assert out["kl_penalty"] == pytest.approx(beta * out["mean_kl"], rel=1e-12, abs=1e-15)


def test_objective_gradient_goes_to_the_policy_only() -> None:
    policy, reference, tokens, rewards, mask = make_batch(3, 3, 4, 7)
    p1 = policy.clone().requires_grad_(True)
    r1 = reference.clone().requires_grad_(True)
    rw = rewards.clone().requires_grad_(True)
    out = compute_rlhf_objective(p1, r1, tokens, rw, mask, kl_coef=0.3)
    objective = out["objective"]
    assert isinstance(objective, torch.Tensor)
    objective.backward()
    assert r1.grad is None
    assert p1.grad is not None
    # autograd through the naive formula (log_softmax + gather) in float64
    p2 = policy.double().requires_grad_(True)
    lp = torch.log_softmax(p2, -1).gather(-1, tokens[..., None]).squeeze(-1)
    lr = torch.log_softmax(reference.double(), -1).gather(-1, tokens[..., None]).squeeze(-1)
    seq = ((lp - lr) * mask).sum(-1)
    (rewards.double() - 0.3 * seq).mean().backward()
    assert p2.grad is not None
    torch.testing.assert_close(p1.grad.double(), p2.grad, rtol=1e-5, atol=1e-7)
    # positions outside the mask get no gradient at all
    assert (p1.grad[mask == 0] == 0).all()


def test_objective_padding_content_does_not_matter() -> None:
    policy, reference, tokens, rewards, mask = make_batch(4, 3, 5, 6, p_valid=0.5)
    pad = mask == 0
    gen = torch.Generator().manual_seed(5)
    # garbage at padded positions: other tokens, huge logits, -inf at the padding token in both
    other_tokens = torch.where(pad, torch.randint(0, 6, tokens.shape, generator=gen), tokens)
    dirty_p = torch.where(pad[..., None], 1e4 * torch.randn(policy.shape, generator=gen), policy)
    dirty_r = torch.where(
        pad[..., None], -1e4 * torch.randn(policy.shape, generator=gen), reference
    )
    b_idx, t_idx = pad.nonzero(as_tuple=True)
    dirty_p[b_idx, t_idx, other_tokens[b_idx, t_idx]] = float("-inf")
    dirty_r[b_idx, t_idx, other_tokens[b_idx, t_idx]] = float("-inf")

    def run(
        p: torch.Tensor, r: torch.Tensor, tok: torch.Tensor
    ) -> tuple[dict[str, object], torch.Tensor]:
        leaf = p.clone().requires_grad_(True)
        out = compute_rlhf_objective(leaf, r, tok, rewards, mask, kl_coef=0.2)
        objective = out["objective"]
        assert isinstance(objective, torch.Tensor)
        objective.backward()
        assert leaf.grad is not None
        return out, leaf.grad

    clean, clean_grad = run(policy, reference, tokens)
    dirty, dirty_grad = run(dirty_p, dirty_r, other_tokens)
    for key in ("mean_reward", "mean_kl", "mean_penalized_reward", "kl_penalty"):
        assert clean[key] == dirty[key], key
    assert torch.equal(clean["per_token_kl"], dirty["per_token_kl"])  # type: ignore[arg-type]
    assert torch.isfinite(dirty_grad).all()
    assert torch.equal(clean_grad[~pad], dirty_grad[~pad])
    assert (dirty_grad[pad] == 0).all()


def test_objective_edge_cases_empty_batch_all_masked_zero_coef() -> None:
    empty = compute_rlhf_objective(
        torch.zeros(0, 3, 4),
        torch.zeros(0, 3, 4),
        torch.zeros(0, 3, dtype=torch.long),
        torch.zeros(0),
        torch.zeros(0, 3),
        kl_coef=0.1,
    )
    assert empty["objective"].item() == 0.0  # type: ignore[union-attr]
    assert [
        empty[k] for k in ("mean_reward", "mean_kl", "mean_penalized_reward", "kl_penalty")
    ] == [0.0] * 4
    policy, reference, tokens, rewards, _ = make_batch(6, 2, 3, 5)
    masked = compute_rlhf_objective(policy, reference, tokens, rewards, torch.zeros(2, 3), 0.5)
    assert masked["mean_kl"] == 0.0
    assert masked["objective"].item() == pytest.approx(rewards.mean().item())  # type: ignore[union-attr]
    free = compute_rlhf_objective(policy, reference, tokens, rewards, torch.ones(2, 3), 0.0)
    assert free["kl_penalty"] == 0.0
    assert free["objective"].item() == pytest.approx(rewards.mean().item())  # type: ignore[union-attr]


def test_objective_accepts_int32_tokens_bool_mask_and_half_logits() -> None:
    policy, reference, tokens, rewards, mask = make_batch(7, 2, 3, 5)
    base = compute_rlhf_objective(policy, reference, tokens, rewards, mask, 0.1)
    alt = compute_rlhf_objective(policy, reference, tokens.int(), rewards, mask.bool(), 0.1)
    assert base["mean_kl"] == alt["mean_kl"]
    half = compute_rlhf_objective(
        policy.bfloat16(), reference.bfloat16(), tokens, rewards, mask, 0.1
    )
    assert half["objective"].dtype == torch.float32  # type: ignore[union-attr]
    ref = float64_objective(policy.bfloat16(), reference.bfloat16(), tokens, rewards, mask, 0.1)
    assert half["mean_kl"] == pytest.approx(ref["mean_kl"], rel=1e-5, abs=1e-5)
