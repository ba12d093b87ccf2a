"""Chapter 6's experiments: the penalised objective on synthetic rollouts, reward placement.

The synthetic "models" are logits: a reference, and a policy that is a sharpened copy of it
(fine-tuned policies are typically lower-entropy than their reference). Whether the response
tokens are sampled from the policy or picked uniformly at random decides whether the summed
log-ratio estimates the KL at all.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from klpen import (
    compute_rlhf_objective,
    compute_token_kl,
    full_kl,
    get_logprobs_for_tokens,
    masked_sum,
    shape_rewards,
)

from .bandit import BanditRun, _check_int, optimal_policy
from .checks import check_choice, check_coef, check_logit_pair, check_positive
from .figures import FIGURE_DPI, FIGURE_WIDTH
from .tables import format_table

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = [
    "Rollout",
    "bandit_table",
    "hackable_bandit",
    "negative_mean_table",
    "objective_table",
    "optimum_table",
    "placement_table",
    "plot_overoptimization",
    "synthetic_rollout",
    "tempered_two_step",
]

TOKEN_SOURCES = ("policy", "uniform")


@dataclass(frozen=True)
class Rollout:
    """A batch of responses with everything :func:`klpen.compute_rlhf_objective` takes.

    Attributes:
        policy_logits, reference_logits: ``(B, T, V)`` float32.
        tokens: ``(B, T)`` int64 response tokens.
        mask: ``(B, T)`` bool, right-padded.
        rewards: ``(B,)`` float32 reward-model scores.
    """

    policy_logits: Tensor
    reference_logits: Tensor
    tokens: Tensor
    mask: Tensor
    rewards: Tensor


def synthetic_rollout(
    batch_size: int = 64,
    length: int = 16,
    vocab_size: int = 100,
    *,
    sharpness: float = 2.0,
    tokens: str = "policy",
    seed: int = 0,
) -> Rollout:
    r"""A seeded synthetic rollout: reference logits, a sharpened policy, sampled tokens.

    Reference logits are standard normal; the policy's are ``sharpness`` times them
    (:math:`\pi \propto \pi_\mathrm{ref}^{s}`). Response lengths are uniform in
    ``[length/2, length]``; rewards are normal with mean 1 and scale 0.5. The logits, lengths
    and rewards depend only on ``seed``; ``tokens`` decides how the response tokens are drawn.

    Args:
        batch_size, length, vocab_size: ``B``, ``T``, ``V`` (positive ints, ``T >= 2``).
        sharpness: ``s`` > 0 (1 makes the policy equal to its reference).
        tokens: ``"policy"`` (sampled from the policy, as in a real rollout) or ``"uniform"``
            (uniformly random ids: what a careless test or an off-policy batch feeds in).
        seed: seed of the private ``torch.Generator``.

    Example:
        >>> r = synthetic_rollout(4, 6, 10, tokens="uniform")
        >>> r.policy_logits.shape, r.tokens.shape, r.mask.sum(-1).min().item() >= 3
        (torch.Size([4, 6, 10]), torch.Size([4, 6]), True)
    """
    source = check_choice("tokens", tokens, TOKEN_SOURCES)
    s = check_positive("sharpness", sharpness)
    for name, value in (("batch_size", batch_size), ("length", length), ("vocab_size", vocab_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if length < 2:
        raise ValueError(f"length must be >= 2, got {length}")
    gen = torch.Generator().manual_seed(seed)
    reference = torch.randn(batch_size, length, vocab_size, generator=gen)
    policy = s * reference
    lengths = torch.randint(length // 2, length + 1, (batch_size,), generator=gen)
    mask = torch.arange(length)[None, :] < lengths[:, None]
    rewards = 1.0 + 0.5 * torch.randn(batch_size, generator=gen)
    # Separate generator for the tokens: the two sources share logits, lengths and rewards.
    token_gen = torch.Generator().manual_seed(seed + 1)
    if source == "policy":
        probs = torch.softmax(policy, dim=-1).reshape(-1, vocab_size)
        ids = torch.multinomial(probs, 1, generator=token_gen).view(batch_size, length)
    else:
        ids = torch.randint(vocab_size, (batch_size, length), generator=token_gen)
    return Rollout(policy, reference, ids, mask, rewards)


def objective_table(rollouts: Mapping[str, Rollout], betas: Sequence[float]) -> str:
    r""":func:`klpen.compute_rlhf_objective` of each rollout at each β, next to the exact KL.

    Columns: the rollout's label, β, the sampled mean sequence KL (k1 summed over the
    response), the exact mean sequence KL
    :math:`\sum_t \mathrm{KL}(\pi_t\,\|\,\pi_{\mathrm{ref},t})` from
    :func:`klpen.full_kl`, the mean reward and the mean penalised reward.

    Example:
        >>> r = synthetic_rollout(8, 4, 10)
        >>> print(objective_table({"policy": r}, [0.1]).splitlines()[0])
        tokens  β      sampled KL  exact KL  score  penalised reward
    """
    rows: list[list[object]] = []
    for label, r in rollouts.items():
        exact = masked_sum(full_kl(r.policy_logits, r.reference_logits), r.mask, dim=-1)
        for kl_coef in betas:
            out = compute_rlhf_objective(
                r.policy_logits, r.reference_logits, r.tokens, r.rewards, r.mask, kl_coef
            )
            rows.append(
                [
                    label,
                    f"{kl_coef:g}",
                    out["mean_kl"],
                    exact.mean().item(),
                    out["mean_reward"],
                    out["mean_penalized_reward"],
                ]
            )
    headers = ["tokens", "β", "sampled KL", "exact KL", "score", "penalised reward"]
    return format_table(rows, headers)


def placement_table(rollout: Rollout, row: int, kl_coef: float) -> str:
    r"""Per token of one response: its KL, and both reward placements with their rewards-to-go.

    *Per token* is :func:`klpen.shape_rewards`: :math:`-\beta\,\mathrm{kl}_t` at every token
    and the score added at the last. *Per sequence* puts :math:`R - \beta\sum_t \mathrm{kl}_t`
    on the last token. The reward-to-go :math:`G_t = \sum_{u \ge t} R_u` (undiscounted) is
    what token ``t`` is credited with; both placements give the same :math:`G_0`.

    Example:
        >>> r = synthetic_rollout(2, 4, 10)
        >>> print(placement_table(r, 0, 0.1).splitlines()[0])
        t  k_t     per-token r_t  per-token G_t  per-sequence r_t  per-sequence G_t
    """
    b = check_coef("kl_coef", kl_coef)
    if not 0 <= row < rollout.tokens.shape[0]:
        raise ValueError(f"row must lie in [0, {rollout.tokens.shape[0]}), got {row}")
    policy_lp = get_logprobs_for_tokens(rollout.policy_logits, rollout.tokens)
    reference_lp = get_logprobs_for_tokens(rollout.reference_logits, rollout.tokens)
    kl, seq_kl = compute_token_kl(policy_lp, reference_lp, rollout.mask)
    shaped = shape_rewards(rollout.rewards, kl, rollout.mask, b)
    # One penalty per sequence: the same shaping with the whole penalty folded into the score.
    sequence = shape_rewards(rollout.rewards - b * seq_kl, torch.zeros_like(kl), rollout.mask, 0.0)
    n = int(rollout.mask[row].sum())
    to_go = [x[row, :n].flip(0).cumsum(0).flip(0) for x in (shaped, sequence)]
    rows = [
        [
            t,
            kl[row, t].item(),
            shaped[row, t].item(),
            to_go[0][t].item(),
            sequence[row, t].item(),
            to_go[1][t].item(),
        ]
        for t in range(n)
    ]
    headers = [
        "t",
        "k_t",
        "per-token r_t",
        "per-token G_t",
        "per-sequence r_t",
        "per-sequence G_t",
    ]
    return format_table(rows, headers)


def hackable_bandit() -> tuple[Tensor, Tensor, Tensor]:
    """A ten-response bandit whose proxy reward can be hacked: ``(reference_logits, proxy, true)``.

    Responses 0-7 are ordinary: the proxy reward equals the true reward, highest (2.0) for
    response 4. Responses 8 and 9 are rare under the reference (probability 0.5 % each) and
    bad (true reward -2), but the proxy overrates them at 3.0, above everything else: the
    degenerate outputs a learned reward model has never been taught to score.

    Example:
        >>> reference_logits, proxy, true = hackable_bandit()
        >>> int(proxy.argmax()), int(true.argmax())
        (8, 4)
    """
    reference_logits = torch.tensor([0.5, 0.2, 0.0, 0.3, 0.8, -0.2, 0.1, 0.4, -3.0, -3.0])
    true = torch.tensor([0.0, 0.6, 1.0, 1.6, 2.0, 0.4, -0.4, 1.2, -2.0, -2.0])
    proxy = torch.cat([true[:8], torch.tensor([3.0, 3.0])])
    return reference_logits, proxy, true


def _rewards_and_kl(
    probs: Tensor, reference_logits: Tensor, proxy: Tensor, true: Tensor
) -> tuple[float, float, float]:
    p = probs.double()
    kl = full_kl(torch.log(p), reference_logits.double())
    return float(p @ proxy.double()), float(p @ true.double()), float(kl)


def optimum_table(
    reference_logits: Tensor, proxy: Tensor, true: Tensor, betas: Sequence[float]
) -> str:
    r"""Proxy reward, true reward and KL of the closed-form optimum π*_β for each β.

    :math:`\pi^*_\beta \propto \pi_\mathrm{ref}\, e^{r_\mathrm{proxy}/\beta}`
    (:func:`klpen_book.bandit.optimal_policy`), all by exact enumeration.

    Example:
        >>> print(optimum_table(*hackable_bandit(), [1.0]).splitlines()[2])
        1      1.547        1.288  0.287
    """
    rows: list[list[object]] = []
    for kl_coef in betas:
        probs = optimal_policy(reference_logits, proxy, kl_coef)
        rows.append([f"{kl_coef:g}", *_rewards_and_kl(probs, reference_logits, proxy, true)])
    return format_table(rows, ["β", "proxy score", "true score", "KL"])


def bandit_table(
    runs: Mapping[str, BanditRun],
    reference_logits: Tensor,
    proxy: Tensor,
    true: Tensor,
    optima: Mapping[str, Tensor | None],
) -> str:
    """Final proxy reward, true reward and KL of trained bandit policies, and their distance
    to the optimum they should reach (total variation; "-" where ``optima`` gives ``None``).

    Example:
        >>> from klpen_book.bandit import train_bandit
        >>> ref, proxy, true = hackable_bandit()
        >>> run = train_bandit(ref, proxy, kl_coef=1.0, true_reward=true, steps=2)
        >>> print(bandit_table({"β=1": run}, ref, proxy, true, {"β=1": None}).splitlines()[0])
        run  proxy score  true score  KL     TV to optimum
    """
    rows: list[list[object]] = []
    for label, run in runs.items():
        target = optima.get(label)
        tv = (
            "-"
            if target is None
            else f"{0.5 * float((run.probs - target.double()).abs().sum()):.3f}"
        )
        rows.append([label, *_rewards_and_kl(run.probs, reference_logits, proxy, true), tv])
    return format_table(rows, ["run", "proxy score", "true score", "KL", "TV to optimum"])


def plot_overoptimization(
    reference_logits: Tensor, proxy: Tensor, true: Tensor, betas: Sequence[float]
) -> Figure:
    """Proxy and true reward of the optimum π*_β against its KL, one point per β (log KL axis).

    Example:
        >>> fig = plot_overoptimization(*hackable_bandit(), [0.5, 1.0, 2.0])
        >>> fig.axes[0].get_xscale()
        'log'
    """
    from matplotlib.figure import Figure

    points = [
        _rewards_and_kl(optimal_policy(reference_logits, proxy, b), reference_logits, proxy, true)
        for b in betas
    ]
    fig = Figure(figsize=(FIGURE_WIDTH, 3.8), dpi=FIGURE_DPI, layout="constrained")
    ax = fig.subplots()
    kl = [p[2] for p in points]
    ax.plot(kl, [p[0] for p in points], "o-", ms=3, label="proxy score (trained on)")
    ax.plot(kl, [p[1] for p in points], "s-", ms=3, label="true score")
    start = _rewards_and_kl(
        torch.softmax(reference_logits.double(), -1), reference_logits, proxy, true
    )
    ax.axhline(start[1], color="grey", ls=":", lw=1, label="true score of π_ref")
    ax.set_xscale("log")
    ax.set_xlabel("KL(π*_β ‖ π_ref)  (nats; β decreases to the right)")
    ax.set_ylabel("expected score")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=10)
    return fig


def negative_mean_table(
    policy_logits: Tensor,
    reference_logits: Tensor,
    sample_sizes: Sequence[int],
    *,
    repeats: int = 20_000,
    seed: int = 0,
) -> str:
    r"""How often the mean of ``N`` on-policy k1 samples is negative, although the KL is not.

    For each ``N``, draws ``repeats`` batches of ``N`` tokens :math:`y \sim \pi` and counts the
    batches whose mean log-ratio :math:`\frac1N\sum_i \log\frac{\pi(y_i)}{\pi_\mathrm{ref}(y_i)}`
    is below 0 (Monte Carlo, with its standard error). Next to it the normal approximation
    :math:`\Phi\big(-\sqrt N\,\mathrm{KL}/\sigma\big)`, with the exact KL and the exact
    standard deviation :math:`\sigma` of one sample's log-ratio under :math:`\pi`.

    Args:
        policy_logits: ``(V,)`` finite policy logits.
        reference_logits: ``(V,)`` finite reference logits.
        sample_sizes: the batch sizes ``N`` (each >= 1).
        repeats: batches drawn per ``N`` (>= 1).
        seed: seed of the private generator.

    Returns:
        A table with one row per ``N`` (probabilities in %).

    Example:
        >>> z, w = torch.tensor([0.2, 0.0, -0.1]), torch.zeros(3)
        >>> print(negative_mean_table(z, w, [10], repeats=100).splitlines()[0])
        N   KL (nats)  sd of one sample  P(mean < 0), normal approx.  P(mean < 0), sampled
    """
    z, w = check_logit_pair("policy_logits", policy_logits, "reference_logits", reference_logits)
    if z.dim() != 1:
        raise ValueError(f"policy_logits must be 1-D (V,), got shape {tuple(z.shape)}")
    if isinstance(sample_sizes, str | bytes) or not isinstance(sample_sizes, Sequence):
        raise TypeError(f"sample_sizes must be a sequence of ints, got {sample_sizes!r}")
    sizes = [_check_int("sample_sizes", n, 1) for n in sample_sizes]
    n_repeats = _check_int("repeats", repeats, 1)
    logp = torch.log_softmax(z.double(), dim=-1)
    ratio = logp - torch.log_softmax(w.double(), dim=-1)
    p = logp.exp()
    kl = float(p @ ratio)
    sd = math.sqrt(max(float(p @ (ratio - kl) ** 2), 0.0))
    gen = torch.Generator().manual_seed(seed)
    rows: list[list[object]] = []
    for n in sizes:
        normal = 0.5 * math.erfc(math.sqrt(n) * kl / sd / math.sqrt(2)) if sd > 0 else 0.0
        negative = 0
        # Batches of draws, so that memory stays at about a million samples.
        per_chunk = max(1, 1_000_000 // n)
        for start in range(0, n_repeats, per_chunk):
            count = min(per_chunk, n_repeats - start)
            draws = torch.multinomial(p, count * n, replacement=True, generator=gen)
            means = ratio[draws].view(count, n).mean(dim=1)
            negative += int((means < 0).sum())
        share = negative / n_repeats
        se = math.sqrt(share * (1 - share) / n_repeats)
        rows.append(
            [
                n,
                f"{kl:.4f}",
                f"{sd:.4f}",
                f"{100 * normal:.1f} %",
                f"{100 * share:.1f} ± {100 * se:.1f} %",
            ]
        )
    headers = ["N", "KL (nats)", "sd of one sample", "P(mean < 0), normal approx."]
    return format_table(rows, [*headers, "P(mean < 0), sampled"])


def tempered_two_step(tau: float = 0.5) -> tuple[list[float], list[float]]:
    r"""Tempering a two-token reference per token vs per sequence, over ``aa, ab, ba, bb``.

    The reference draws its first token uniformly from ``{a, b}``; after ``a`` it says ``a``
    with probability 0.9, after ``b`` it is uniform. Tempering each next-token distribution,
    :math:`\pi_\mathrm{ref}(y_t \mid y_{<t})^{1/\tau}` renormalised per prefix, is what a
    trainer does that scores the reference at a temperature; it is not the tempered sequence
    distribution :math:`\pi_\mathrm{ref}(y)^{1/\tau}` renormalised over sequences.

    Returns:
        ``(per_token, per_sequence)``, the probabilities of ``aa, ab, ba, bb``.

    Example:
        >>> [round(p, 3) for p in tempered_two_step(0.5)[0]]
        [0.494, 0.006, 0.25, 0.25]
        >>> [round(p, 3) for p in tempered_two_step(0.5)[1]]
        [0.614, 0.008, 0.189, 0.189]
    """
    b = 1.0 / check_positive("tau", tau)
    first = torch.tensor([0.5, 0.5], dtype=torch.float64)
    second = torch.tensor([[0.9, 0.1], [0.5, 0.5]], dtype=torch.float64)
    joint = (first[:, None] * second).reshape(-1)

    def temper(p: Tensor) -> Tensor:
        return p**b / (p**b).sum(-1, keepdim=True)

    per_token = (temper(first)[:, None] * temper(second)).reshape(-1)
    return per_token.tolist(), temper(joint).tolist()
