"""Every equality that book/coming_from.md claims between klpen and a peer trainer.

Each peer's formula is written down here as its source states it (TRL, verl and OpenRLHF at the
commits the page names), in plain torch, and compared with klpen. Where the page says the two
*differ*, the test pins the difference instead, so that the page cannot drift from either side.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import Tensor

import klpen

# --- the peers' formulas, as their sources state them ------------------------------------------


def verl_kl_penalty_forward(logprob: Tensor, ref_logprob: Tensor, name: str) -> Tensor:
    """verl ``core_algos.kl_penalty_forward``."""
    if name in ("kl", "k1"):
        return logprob - ref_logprob
    if name == "abs":
        return (logprob - ref_logprob).abs()
    if name in ("mse", "k2"):
        return 0.5 * (logprob - ref_logprob).square()
    if name in ("low_var_kl", "k3"):
        kl = torch.clamp(ref_logprob - logprob, min=-20, max=20)
        return torch.clamp(torch.exp(kl) - kl - 1, min=-10, max=10)
    raise NotImplementedError(name)


def verl_straight_through(logprob: Tensor, ref_logprob: Tensor, name: str) -> Tensor:
    """verl's documented ``+`` forms: the value of ``name``, the gradient of k2."""
    forward = verl_kl_penalty_forward(logprob, ref_logprob, name)
    backward = 0.5 * (logprob - ref_logprob).square()
    return backward - backward.detach() + forward.detach()


def openrlhf_compute_approx_kl(log_probs: Tensor, log_probs_base: Tensor, name: str) -> Tensor:
    """OpenRLHF ``models.utils.compute_approx_kl``."""
    log_ratio = log_probs.float() - log_probs_base.float()
    if name == "k2":
        log_ratio = log_ratio**2 / 2.0
    elif name == "k3":
        log_ratio = (-log_ratio).exp() - 1 + log_ratio
    return log_ratio.clamp(min=-10, max=10)


def trl_grpo_per_token_kl(per_token_logps: Tensor, ref_per_token_logps: Tensor) -> Tensor:
    """TRL ``GRPOTrainer``'s KL term."""
    d = ref_per_token_logps - per_token_logps
    return torch.exp(d) - d - 1


def trl_selective_log_softmax(logits: Tensor, index: Tensor) -> Tensor:
    """TRL ``selective_log_softmax`` (its fp32 branch)."""
    selected = torch.gather(logits, dim=-1, index=index.unsqueeze(-1)).squeeze(-1)
    lse = torch.stack([torch.logsumexp(row, dim=-1) for row in logits])
    return selected - lse


def trl_entropy_from_logits(logits: Tensor, chunk_size: int = 128) -> Tensor:
    """TRL ``entropy_from_logits``."""
    flat = logits.reshape(-1, logits.shape[-1])
    parts = []
    for chunk in flat.split(chunk_size, dim=0):
        logps = torch.log_softmax(chunk, dim=-1)
        parts.append(-(torch.exp(logps) * logps).sum(-1))
    return torch.cat(parts).reshape(logits.shape[:-1])


def openrlhf_log_probs_from_logits(logits: Tensor, labels: Tensor, temperature: float) -> Tensor:
    """OpenRLHF ``log_probs_from_logits`` (its fp32 branch without flash-attn): divides in place."""
    if temperature != 1.0:
        logits.div_(temperature)
    taken = torch.gather(logits, dim=-1, index=labels.unsqueeze(-1)).squeeze(-1)
    return taken - torch.logsumexp(logits, dim=-1)


def verl_agg_loss(loss_mat: Tensor, loss_mask: Tensor, mode: str) -> Tensor:
    """verl ``core_algos.agg_loss`` on one data-parallel rank (``dp_size=1``)."""
    if mode == "token-mean":
        return (loss_mat * loss_mask).sum() / loss_mask.sum()
    if mode == "seq-mean-token-sum":
        seq_losses = torch.sum(loss_mat * loss_mask, dim=-1)
        seq_mask = (torch.sum(loss_mask, dim=-1) > 0).float()
        return (seq_losses * seq_mask).sum() / seq_mask.sum()
    if mode == "seq-mean-token-mean":
        counts = torch.sum(loss_mask, dim=-1)
        seq_losses = torch.sum(loss_mat * loss_mask, dim=-1) / (counts + 1e-8)
        seq_mask = (counts > 0).float()
        return (seq_losses * seq_mask).sum() / seq_mask.sum()
    if mode == "seq-mean-token-sum-norm":
        return torch.sum(torch.sum(loss_mat * loss_mask, dim=-1)) / loss_mask.shape[-1]
    raise ValueError(mode)


def trl_grpo_loss(per_token_loss: Tensor, mask: Tensor, loss_type: str, max_len: int) -> Tensor:
    """TRL ``GRPOTrainer``'s aggregation (one process, no gradient accumulation)."""
    if loss_type == "grpo":
        return ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    if loss_type in ("bnpo", "dapo"):
        return (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)
    if loss_type == "dr_grpo":
        return (per_token_loss * mask).sum() / (per_token_loss.size(0) * max_len)
    raise ValueError(loss_type)


def openrlhf_compute_reward(r: Tensor, kl_coef: float, kl: Tensor, action_mask: Tensor) -> Tensor:
    """OpenRLHF ``models.utils.compute_reward`` (no reward clipping)."""
    if kl_coef <= 0.0:
        kl_coef = 0.0
    kl_reward = -kl_coef * kl
    eos = action_mask.size(1) - 1 - action_mask.long().fliplr().argmax(dim=1, keepdim=True)
    last_reward = torch.zeros_like(kl).scatter_(dim=1, index=eos, src=r.unsqueeze(1).to(kl.dtype))
    return last_reward + kl_reward


class PeerAdaptiveKLController:
    """verl's and OpenRLHF's ``AdaptiveKLController`` (identical rules)."""

    def __init__(self, init_kl_coef: float, target: float, horizon: float) -> None:
        self.value = init_kl_coef
        self.target = target
        self.horizon = horizon

    def update(self, current: float, n_steps: int) -> None:
        proportional_error = np.clip(current / self.target - 1, -0.2, 0.2)
        self.value *= 1 + proportional_error * n_steps / self.horizon


# --- inputs ------------------------------------------------------------------------------------


def logprob_pair(seed: int, n: int = 64, spread: float = 2.0) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(n, generator=g, dtype=torch.float64) * spread
    ref = -torch.rand(n, generator=g, dtype=torch.float64) * spread
    return logp, ref


def masked_batch(seed: int) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    values = torch.randn(5, 7, generator=g, dtype=torch.float64)
    mask = torch.ones(5, 7, dtype=torch.float64)
    mask[1, 4:] = 0
    mask[3, 1:] = 0
    mask[4, :2] = 0  # left padding
    return values, mask


# --- estimators --------------------------------------------------------------------------------

NAMES = [("k1", "k1"), ("kl", "k1"), ("abs", "abs"), ("k2", "k2"), ("mse", "k2"), ("k3", "k3")]
NAMES += [("low_var_kl", "k3")]


@pytest.mark.parametrize(("verl_name", "klpen_name"), NAMES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_verl_estimators_equal_klpen_within_verls_clamps(
    verl_name: str, klpen_name: str, seed: int
) -> None:
    # Log-ratios within ±2 (k3 at most e² - 3 < 10): verl's clamps do not bind, and the two are
    # the same estimator.
    logp, ref = logprob_pair(seed)
    expected = verl_kl_penalty_forward(logp, ref, verl_name)
    torch.testing.assert_close(klpen.estimate_kl(logp, ref, klpen_name), expected)


def test_verl_low_var_kl_with_clamp_equals_klpen_clamp() -> None:
    # Log-ratios up to ±40: verl's clamps bind; klpen's clamp reproduces them, value and gradient.
    logp = torch.linspace(-40.0, 0.0, 41, dtype=torch.float64).requires_grad_()
    ref = torch.flip(torch.linspace(-40.0, 0.0, 41, dtype=torch.float64), [0])
    logp_peer = logp.detach().clone().requires_grad_()
    mine = klpen.estimate_kl(logp, ref, "k3", clamp=10.0)
    theirs = verl_kl_penalty_forward(logp_peer, ref, "k3")
    torch.testing.assert_close(mine, theirs)
    mine.sum().backward()
    theirs.sum().backward()
    torch.testing.assert_close(logp.grad, logp_peer.grad)


@pytest.mark.parametrize("name", ["k1", "k3"])
def test_verl_documented_straight_through_equals_klpen_plus(name: str) -> None:
    # Log-ratios within ±6: verl's value clamp binds for k3 there, and klpen's clamp= matches it.
    logp, ref = logprob_pair(3, spread=6.0)
    logp = logp.requires_grad_()
    logp_peer = logp.detach().clone().requires_grad_()
    mine = klpen.estimate_kl(logp, ref, name + "+", clamp=10.0)
    theirs = verl_straight_through(logp_peer, ref, name)
    torch.testing.assert_close(mine, theirs)
    mine.sum().backward()
    theirs.sum().backward()
    torch.testing.assert_close(logp.grad, logp_peer.grad)


@pytest.mark.parametrize("name", ["k1", "k2", "k3"])
def test_openrlhf_estimators_equal_klpen_within_its_clamp(name: str) -> None:
    logp, ref = logprob_pair(4)
    expected = openrlhf_compute_approx_kl(logp.float(), ref.float(), name)
    torch.testing.assert_close(klpen.estimate_kl(logp.float(), ref.float(), name), expected)


def test_openrlhf_clamps_k1_too_klpen_does_not() -> None:
    logp = torch.tensor([-30.0, 0.0])
    ref = torch.tensor([0.0, -30.0])
    assert openrlhf_compute_approx_kl(logp, ref, "k1").tolist() == [-10.0, 10.0]
    assert klpen.estimate_kl(logp, ref, "k1").tolist() == [-30.0, 30.0]


def test_trl_grpo_kl_term_is_k3() -> None:
    logp, ref = logprob_pair(5)
    torch.testing.assert_close(klpen.estimate_kl(logp, ref, "k3"), trl_grpo_per_token_kl(logp, ref))


def test_verl_plus_forms_raise_in_the_commit_read() -> None:
    # The page says: verl's kl_penalty passes "k3+" unchanged to kl_penalty_forward.
    logp, ref = logprob_pair(6)
    with pytest.raises(NotImplementedError):
        verl_kl_penalty_forward(logp, ref, "k3+")


# --- log-probs ---------------------------------------------------------------------------------


def test_trl_selective_log_softmax_equals_klpen() -> None:
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(3, 5, 40, generator=g) * 4
    tokens = torch.randint(40, (3, 5), generator=g)
    torch.testing.assert_close(
        klpen.get_logprobs_for_tokens(logits, tokens), trl_selective_log_softmax(logits, tokens)
    )


def test_trl_entropy_from_logits_equals_klpen_token_entropy() -> None:
    g = torch.Generator().manual_seed(15)
    logits = torch.randn(3, 5, 40, generator=g, dtype=torch.float64) * 4
    torch.testing.assert_close(klpen.token_entropy(logits), trl_entropy_from_logits(logits))


def test_trl_slice_then_log_softmax_equals_next_token_logprobs() -> None:
    # TRL slices the logits by hand before the gather; next_token_logprobs does the same shift.
    g = torch.Generator().manual_seed(16)
    logits = torch.randn(2, 6, 30, generator=g)
    input_ids = torch.randint(30, (2, 6), generator=g)
    expected = trl_selective_log_softmax(logits[:, :-1], input_ids[:, 1:])
    torch.testing.assert_close(klpen.next_token_logprobs(logits, input_ids), expected)


def test_openrlhf_temperature_changes_the_callers_logits_klpen_does_not() -> None:
    g = torch.Generator().manual_seed(17)
    logits = torch.randn(2, 4, 30, generator=g)
    tokens = torch.randint(30, (2, 4), generator=g)
    before = logits.clone()
    mine = klpen.get_logprobs_for_tokens(logits, tokens, temperature=0.7)
    assert torch.equal(logits, before)
    theirs = openrlhf_log_probs_from_logits(logits, tokens, 0.7)
    torch.testing.assert_close(mine, theirs)
    torch.testing.assert_close(logits, before / 0.7)  # the caller's tensor was divided


# --- aggregation -------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_verl_agg_loss_equals_klpen_aggregate(mode: str) -> None:
    values, mask = masked_batch(8)
    empty = mask.clone()
    empty[2] = 0  # verl and klpen both leave an empty row out of the seq-mean modes
    for m in (mask, empty):
        torch.testing.assert_close(klpen.aggregate(values, m, mode), verl_agg_loss(values, m, mode))


def test_verl_seq_mean_token_sum_norm_is_token_sum_over_length() -> None:
    values, mask = masked_batch(9)
    expected = verl_agg_loss(values, mask, "seq-mean-token-sum-norm")
    mine = klpen.aggregate(values, mask, "token-sum") / mask.shape[-1]
    torch.testing.assert_close(mine, expected)


@pytest.mark.parametrize(
    ("loss_type", "mode"),
    [("grpo", "seq-mean-token-mean"), ("bnpo", "token-mean"), ("dapo", "token-mean")],
)
def test_trl_grpo_loss_types_equal_klpen_modes(loss_type: str, mode: str) -> None:
    values, mask = masked_batch(10)
    torch.testing.assert_close(
        klpen.aggregate(values, mask, mode), trl_grpo_loss(values, mask, loss_type, 7)
    )


def test_trl_dr_grpo_is_token_sum_over_rows_times_length() -> None:
    values, mask = masked_batch(11)
    expected = trl_grpo_loss(values, mask, "dr_grpo", 7)
    torch.testing.assert_close(klpen.aggregate(values, mask, "token-sum") / (5 * 7), expected)


def test_trl_grpo_counts_an_empty_row_as_zero_klpen_leaves_it_out() -> None:
    values, mask = masked_batch(12)
    mask[2] = 0
    trl = trl_grpo_loss(values, mask, "grpo", 7)
    mine = klpen.aggregate(values, mask, "seq-mean-token-mean")
    torch.testing.assert_close(trl, mine * 4 / 5)  # four non-empty rows of five


def test_peers_mask_by_multiplying_so_nan_leaks_klpen_does_not() -> None:
    values, mask = masked_batch(13)
    values[1, 5] = float("nan")  # a padded slot
    assert verl_agg_loss(values, mask, "token-mean").isnan()
    assert klpen.aggregate(values, mask, "token-mean").isfinite()


# --- reward shaping ----------------------------------------------------------------------------


def test_openrlhf_compute_reward_equals_klpen_shape_rewards_right_padded() -> None:
    g = torch.Generator().manual_seed(14)
    kl = torch.randn(4, 6, generator=g, dtype=torch.float64)
    mask = torch.ones(4, 6, dtype=torch.float64)
    mask[0, 3:] = 0
    mask[2, 5:] = 0
    scores = torch.randn(4, generator=g, dtype=torch.float64)
    # OpenRLHF does not mask the KL term itself: it expects a KL that is already 0 at padding.
    theirs = openrlhf_compute_reward(scores, 0.1, kl * mask, mask)
    torch.testing.assert_close(klpen.shape_rewards(scores, kl, mask, 0.1), theirs)


def test_empty_row_peers_move_the_score_to_the_last_slot_klpen_raises() -> None:
    kl = torch.zeros(2, 4, dtype=torch.float64)
    mask = torch.ones(2, 4, dtype=torch.float64)
    mask[1] = 0
    scores = torch.tensor([1.0, 2.0], dtype=torch.float64)
    assert openrlhf_compute_reward(scores, 0.1, kl, mask)[1, 3] == 2.0
    with pytest.raises(ValueError, match="row"):
        klpen.shape_rewards(scores, kl, mask, 0.1)


def test_zero_coefficient_with_infinite_kl_peers_nan_klpen_zero() -> None:
    kl = torch.tensor([[float("inf"), 0.5]], dtype=torch.float64)
    mask = torch.ones(1, 2, dtype=torch.float64)
    scores = torch.tensor([1.0], dtype=torch.float64)
    assert openrlhf_compute_reward(scores, 0.0, kl, mask)[0, 0].isnan()
    assert klpen.shape_rewards(scores, kl, mask, 0.0).tolist() == [[0.0, 1.0]]


# --- controllers -------------------------------------------------------------------------------


def test_adaptive_controller_matches_verl_and_openrlhf() -> None:
    peer = PeerAdaptiveKLController(0.2, 6.0, 10_000)
    mine = klpen.AdaptiveKLController(init_kl_coef=0.2, target_kl=6.0, horizon=10_000)
    for step, kl in enumerate([1.0, 3.0, 6.0, 9.0, 30.0, 0.1, 7.2]):
        n = 1 + step % 3
        peer.update(kl, n)
        mine.update(kl, n_steps=n)
        assert mine.get_coef() == pytest.approx(peer.value, rel=1e-12)
