r"""Chapter 8's experiments: when the tokens come from a sampler that is not the policy.

* :func:`position_logits`: a batch of positions with policy and reference logits;
* :func:`sampler_distribution`, :func:`sample_tokens`: the sampler's distribution and draws;
* :func:`mismatch_rows`, :func:`kl_rows`: the ratio and the KL estimate when the trainer's
  log-probs ignore the sampler's temperature or its top-k / top-p cut;
* :func:`behavior_logits`, :func:`offpolicy_estimates`: a stale policy and a bf16 engine as
  the sampler μ, and the (importance-weighted) KL estimates on its samples;
* :func:`offpolicy_gradient_rows`: the exact expected gradient of each estimator × weighting;
* :func:`generate_default_rows`: what the plain ``top_p=`` keyword misses of ``generate``'s
  sampler (its ``top_k=50`` default), against ``generation_config=``;
* :func:`kept_set_rows`: the kept set a bf16 engine used against the one a trainer recomputes
  from its own logits, and ``kept_mask=``;
* :func:`offpolicy_study`: a bandit trained on samples from a tempered sampler, with the
  penalty uncorrected, or weighted by a detached or a differentiated π/μ.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from klpen import full_kl, importance_weights, mismatch_metrics, sampler_logprobs
from klpen.estimators import ESTIMATORS, estimate_kl
from klpen.gradients import (
    PLACEMENTS,
    WEIGHTINGS,
    expected_offpolicy_gradients,
    expected_penalty_gradient,
    penalty_surrogate,
)

from .bandit import BanditRun, _check_bandit, _check_int, optimal_policy, single_threaded
from .bandit import forward_kl_optimal_policy as _forward_optimum
from .checks import check_choice, check_coef, check_floating, check_positive
from .loss_placement import _ZERO, _cosine

__all__ = [
    "GENERATE_DEFAULT_HEADERS",
    "KEPT_SET_HEADERS",
    "OFFPOLICY_GRADIENT_HEADERS",
    "OFFPOLICY_STUDY_HEADERS",
    "OffPolicyStudy",
    "behavior_logits",
    "generate_default_rows",
    "kept_set_rows",
    "kl_rows",
    "mismatch_headers",
    "mismatch_rows",
    "offpolicy_estimates",
    "offpolicy_gradient_rows",
    "offpolicy_study",
    "position_logits",
    "sample_tokens",
    "sampler_distribution",
]


def mismatch_headers(band: tuple[float, float] = (0.8, 1.25)) -> tuple[str, ...]:
    """Columns of :func:`mismatch_rows` for a given band.

    Example:
        >>> mismatch_headers((0.9, 1.1))[4]
        'ω outside [0.9, 1.1]'
    """
    return (
        "log-probs compared",
        "mean ω",
        "min ω",
        "max ω",
        f"ω outside [{band[0]:g}, {band[1]:g}]",
        "KL(μ‖π) k3",
    )


def position_logits(
    positions: int, vocab: int, *, scale: float, ref_noise: float, seed: int
) -> tuple[Tensor, Tensor]:
    r"""Policy and reference logits for ``positions`` independent positions, fp64.

    The policy's logits are :math:`s\,g` with :math:`g_v` standard normal (``scale`` = s sets
    how peaked a position is); the reference's are the policy's plus ``ref_noise`` times
    another normal draw, so that :math:`\mathrm{KL}(\pi\|\pi_\mathrm{ref})` grows with it.

    Example:
        >>> z, w = position_logits(3, 5, scale=2.0, ref_noise=0.5, seed=0)
        >>> tuple(z.shape), z.dtype
        ((3, 5), torch.float64)
    """
    n = _check_int("positions", positions, 1)
    v = _check_int("vocab", vocab, 2)
    s, noise = check_positive("scale", scale), check_coef("ref_noise", ref_noise)
    g = torch.Generator().manual_seed(_check_int("seed", seed, 0))
    policy = s * torch.randn(n, v, generator=g, dtype=torch.float64)
    reference = policy + noise * torch.randn(n, v, generator=g, dtype=torch.float64)
    return policy, reference


def sampler_distribution(
    logits: Tensor,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
) -> Tensor:
    r"""``(N, V)`` log-probs of every token under the sampler of :func:`klpen.sampler_logprobs`.

    The lab's enumeration of μ: each row's logits are repeated ``V`` times, once per candidate
    token, a few rows at a time. ``-inf`` marks the tokens the sampler cuts.

    Example:
        >>> z = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))
        >>> sampler_distribution(z, top_p=0.7).exp()
        tensor([[0.6250, 0.3750, 0.0000]])
    """
    z = check_floating("logits", logits, min_ndim=2)
    if z.dim() != 2:
        raise ValueError(f"logits must have shape (N, V), got {tuple(z.shape)}")
    return _enumerate(z, {"temperature": temperature, "top_k": top_k, "top_p": top_p})


#: Positions whose ``V`` copies :func:`_enumerate` hands to ``sampler_logprobs`` at once.
_ENUMERATED_ROWS = 32


def _enumerate(logits: Tensor, keywords: Mapping[str, object]) -> Tensor:
    """``(N, V)`` log-probs of every token: each position's logits repeated ``V`` times.

    The repeats are materialised for :data:`_ENUMERATED_ROWS` positions at a time (a few MB):
    a contiguous block runs several times faster through the sampler than a stride-0 view
    of the whole batch, and gives the same values, each row being computed alone.
    """
    n, v = logits.shape
    every = torch.arange(v, device=logits.device).expand(_ENUMERATED_ROWS, v)
    parts = []
    for start in range(0, n, _ENUMERATED_ROWS):
        block = logits[start : start + _ENUMERATED_ROWS]
        r = block.shape[0]
        repeated = block[:, None, :].expand(r, v, v).contiguous()
        logmu, _ = sampler_logprobs(repeated, every[:r], **keywords)  # type: ignore[arg-type]
        parts.append(logmu)
    return torch.cat(parts) if parts else logits.new_empty(0, v)


def sample_tokens(logprobs: Tensor, *, seed: int) -> Tensor:
    """One token per row of ``(N, V)`` log-probs (``-inf`` allowed), seeded.

    Example:
        >>> sample_tokens(torch.log(torch.tensor([[0.0, 1.0], [1.0, 0.0]])), seed=0).tolist()
        [1, 0]
    """
    p = check_floating("logprobs", logprobs, min_ndim=2).exp()
    g = torch.Generator().manual_seed(_check_int("seed", seed, 0))
    return torch.multinomial(p, 1, generator=g).squeeze(-1)


def mismatch_rows(
    pairs: Mapping[str, tuple[Tensor, Tensor]], band: tuple[float, float] = (0.8, 1.25)
) -> list[list[object]]:
    """One row of :func:`klpen.mismatch_metrics` per ``label -> (trainer, rollout)`` pair.

    Columns: :func:`mismatch_headers` (ω = trainer / rollout probability of the sampled token).

    Example:
        >>> a = torch.tensor([-1.0, -2.0])
        >>> mismatch_rows({"same": (a, a)})[0][1:4]
        [1.0, 1.0, 1.0]
    """
    rows: list[list[object]] = []
    for label, (trainer, rollout) in pairs.items():
        m = mismatch_metrics(
            trainer, rollout, torch.ones_like(trainer, dtype=torch.bool), band=band
        )
        rows.append(
            [label, m["mean_ratio"], m["min_ratio"], m["max_ratio"], m["outside_band"], m["kl_k3"]]
        )
    return rows


def kl_rows(
    estimates: Mapping[str, tuple[Tensor, float]], estimators: Sequence[str] = ("k1", "k3")
) -> list[list[object]]:
    r"""Mean, standard error and bias of per-position KL estimates against exact targets.

    Args:
        estimates: ``label -> (log_ratio, target)``: ``(N,)`` log-ratios
            :math:`\log p(y) - \log q(y)` of one sampled token per position, and the exact
            mean KL the estimate is meant to be.
        estimators: names of :func:`klpen.estimate_kl` applied to each log-ratio.

    Returns:
        Rows ``[label, estimator, mean, s.e., target, bias]``.

    Example:
        >>> kl_rows({"x": (torch.tensor([0.0, 0.2], dtype=torch.float64), 0.1)}, ["k1"])[0][:3]
        ['x', 'k1', 0.1]
    """
    rows: list[list[object]] = []
    for label, (log_ratio, target) in estimates.items():
        r = check_floating(f"estimates[{label!r}]", log_ratio, min_ndim=1).double()
        for name in estimators:
            k = estimate_kl(r, torch.zeros_like(r), name)
            mean = float(k.mean())
            se = float(k.std() / math.sqrt(k.numel()))
            rows.append([label, name, mean, se, float(target), mean - float(target)])
    return rows


def behavior_logits(
    policy_logits: Tensor, kind: str, *, updates: int = 3, step: float = 0.1, seed: int = 0
) -> Tensor:
    r"""The logits of a sampler μ that is not the policy: ``"stale"`` or ``"bf16"``.

    ``"stale"``: the policy ``updates`` steps ago, each step a random move of ``step`` per
    logit (a stand-in for optimiser steps); ``"bf16"``: the policy's logits rounded to
    bfloat16, as an engine running in bf16 would hold them (the kernels' own differences come
    on top of this in a real engine).

    Example:
        >>> z = torch.tensor([1.0, 2.001, 3.0], dtype=torch.float64)
        >>> behavior_logits(z, "bf16").tolist()
        [1.0, 2.0, 3.0]
    """
    z = check_floating("policy_logits", policy_logits, min_ndim=1)
    which = check_choice("kind", kind, ("stale", "bf16"))
    if which == "bf16":
        return z.to(torch.bfloat16).to(z.dtype)
    n = _check_int("updates", updates, 0)
    size = check_positive("step", step)
    g = torch.Generator().manual_seed(_check_int("seed", seed, 0))
    drift = sum(
        (torch.randn(z.shape, generator=g, dtype=z.dtype) for _ in range(n)),
        torch.zeros_like(z),
    )
    return z - size * drift


GENERATE_DEFAULT_HEADERS = (
    "top_p",
    "temperature",
    "mean |Δ log μ| (nats)",
    "max |Δ log μ|",
    "positions cut differently",
    "tokens kept: generate",
    "tokens kept: top_p= alone",
)


def _config_distribution(logits: Tensor, config: Mapping[str, object]) -> Tensor:
    """``(N, V)`` log-probs of every token under ``generate``'s sampler for ``config``."""
    return _enumerate(logits, {"generation_config": config})


def generate_default_rows(
    policy_logits: Tensor,
    settings: Sequence[tuple[float, float]],
    *,
    seed: int = 0,
) -> list[tuple[float, ...]]:
    r"""Per ``(top_p, temperature)``: the error of ``sampler_logprobs(top_p=, temperature=)``.

    ``generate(do_sample=True, top_p=p)`` also cuts to ``top_k=50`` (its default): the tokens
    are drawn from the distribution of ``generation_config={"do_sample": True, "top_p": p,
    "temperature": τ}``, and the row gives the mean and max of :math:`|\log \mu_\text{kw}(y)
    - \log \mu_\text{gen}(y)|` over those draws, the share of positions whose kept sets
    differ, and the mean size of each kept set.

    Example:
        >>> z, _ = position_logits(20, 80, scale=1.0, ref_noise=0.0, seed=0)
        >>> row = generate_default_rows(z, [(0.95, 1.0)])[0]
        >>> row[4] > 0.5 and row[5] <= 50 < row[6]
        True
    """
    z = check_floating("policy_logits", policy_logits, min_ndim=2)
    rows: list[tuple[float, ...]] = []
    for top_p, temperature in settings:
        config = {"do_sample": True, "top_p": top_p, "temperature": temperature}
        generate = _config_distribution(z, config)
        keyword = sampler_distribution(z, temperature=temperature, top_p=top_p)
        tokens = sample_tokens(generate, seed=seed)
        gap = (keyword.gather(-1, tokens[:, None]) - generate.gather(-1, tokens[:, None])).abs()
        kept_gen, kept_kw = torch.isfinite(generate), torch.isfinite(keyword)
        rows.append(
            (
                top_p,
                temperature,
                float(gap.mean()),
                float(gap.max()),
                float((kept_gen != kept_kw).any(-1).double().mean()),
                float(kept_gen.sum(-1).double().mean()),
                float(kept_kw.sum(-1).double().mean()),
            )
        )
    return rows


KEPT_SET_HEADERS = (
    "top_p",
    "positions whose kept set differs",
    "draws outside the recomputed set",
    "mean |Δ log μ|, recomputed (finite draws)",
    "mean |Δ log μ|, kept_mask=",
    "max |Δ log μ|, kept_mask=",
)


def kept_set_rows(
    policy_logits: Tensor, top_ps: Sequence[float], *, seed: int = 0
) -> list[tuple[float, ...]]:
    r"""A bf16 engine's kept set against the one a trainer recomputes from its fp32 logits.

    The engine samples from top-p of the policy's logits rounded to bf16
    (:func:`behavior_logits`); the trainer scores the draws with ``sampler_logprobs`` on its
    fp32 logits, recomputing the cut, or passing the engine's recorded kept set as
    ``kept_mask=``. Per ``top_p``: the share of positions whose two kept sets differ, the
    share of draws the recomputed cut gives ``-inf``, and the log-prob gap to the engine's own
    :math:`\log \mu(y)` both ways (with ``kept_mask=`` only the logits' rounding remains).

    Example:
        >>> z, _ = position_logits(50, 64, scale=2.5, ref_noise=0.0, seed=0)
        >>> row = kept_set_rows(z, [0.9])[0]
        >>> 0 <= row[1] <= 1 and row[5] < 0.1  # with kept_mask=, only bf16's rounding is left
        True
    """
    z = check_floating("policy_logits", policy_logits, min_ndim=2).float()
    engine = behavior_logits(z.double(), "bf16").float()
    rows: list[tuple[float, ...]] = []
    for top_p in top_ps:
        engine_mu = sampler_distribution(engine, top_p=top_p)
        kept = torch.isfinite(engine_mu)
        recomputed = torch.isfinite(sampler_distribution(z, top_p=top_p))
        tokens = sample_tokens(engine_mu, seed=seed)
        target = engine_mu.gather(-1, tokens[:, None])[:, 0]
        cut, _ = sampler_logprobs(z, tokens, top_p=top_p)
        masked, _ = sampler_logprobs(z, tokens, kept_mask=kept)
        finite = torch.isfinite(cut)
        rows.append(
            (
                top_p,
                float((kept != recomputed).any(-1).double().mean()),
                float((~finite).double().mean()),
                float((cut - target).abs()[finite].mean()),
                float((masked - target).abs().mean()),
                float((masked - target).abs().max()),
            )
        )
    return rows


def offpolicy_estimates(
    policy_logits: Tensor,
    reference_logits: Tensor,
    behavior: Tensor,
    n_samples: int,
    *,
    cap: float = 2.0,
    seed: int,
) -> dict[str, Tensor]:
    r"""KL estimates of :math:`\mathrm{KL}(\pi\|\pi_\mathrm{ref})` from ``n_samples`` draws of μ.

    For a ``(V,)`` categorical: k1 and k3 on the draws as they are, then weighted by
    :math:`\pi/\mu` (:func:`klpen.importance_weights`), truncated at ``cap`` (TIS) and masked
    above it (MIS). The weighted k1 and k3 are unbiased; truncation and masking trade bias for
    variance.

    Returns:
        ``{label: (n_samples,) tensor}`` for :func:`klpen_book.estimator_study.estimator_stats`.

    Example:
        >>> z = torch.tensor([1.0, 0.0, -1.0], dtype=torch.float64)
        >>> est = offpolicy_estimates(z, torch.zeros(3, dtype=torch.float64), z, 5, seed=0)
        >>> torch.equal(est["k3"], est["k3·π/μ"])  # μ = π: every weight is 1
        True
    """
    z = check_floating("policy_logits", policy_logits, min_ndim=1)
    logp = torch.log_softmax(z, -1)
    logq = torch.log_softmax(reference_logits, -1)
    logmu = torch.log_softmax(behavior, -1)
    g = torch.Generator().manual_seed(_check_int("seed", seed, 0))
    y = torch.multinomial(
        logmu.exp(), _check_int("n_samples", n_samples, 2), replacement=True, generator=g
    )
    lp, lq, lm = logp[y], logq[y], logmu[y]
    ones = torch.ones_like(lp, dtype=torch.bool)
    w = importance_weights(lp, lm, ones)
    tis = importance_weights(lp, lm, ones, cap=cap, mode="truncate")
    mis = importance_weights(lp, lm, ones, cap=cap, mode="mask")
    k1, k3 = estimate_kl(lp, lq, "k1"), estimate_kl(lp, lq, "k3")
    return {
        "k1": k1,
        "k3": k3,
        "k1·π/μ": w * k1,
        "k3·π/μ": w * k3,
        f"k3·TIS({cap:g})": tis * k3,
        f"k3·MIS({cap:g})": mis * k3,
    }


#: Columns of :func:`offpolicy_gradient_rows`.
OFFPOLICY_GRADIENT_HEADERS = (
    "placement",
    "weighting",
    "estimator",
    "|g|/|∇KL|",
    "cos ∇KL(π‖ref)",
    "max|g-∇KL(π‖ref)|",
    "max|g-∇KL(ref‖π)|",
)


def offpolicy_gradient_rows(
    policy_logits: Tensor,
    reference_logits: Tensor,
    behavior_logits: Tensor,
    estimators: Sequence[str] = ("k1", "k2", "k3"),
    placements: Sequence[str] = PLACEMENTS,
) -> list[list[object]]:
    """One row per placement × weighting × estimator of the exact off-policy gradients.

    From :func:`klpen.gradients.expected_offpolicy_gradients`; columns
    :data:`OFFPOLICY_GRADIENT_HEADERS` (norm relative to ∇KL(π‖π_ref), cosine with it, and
    the largest difference to the reverse- and the forward-KL gradient).

    Example:
        >>> z = torch.tensor([1.0, 0.0, -1.0], dtype=torch.float64)
        >>> w, b = torch.zeros(3, dtype=torch.float64), torch.tensor([0.0, 0.0, 1.0]).double()
        >>> row = offpolicy_gradient_rows(z, w, b, ["k3"], ["loss"])[2]
        >>> row[:3], f"{row[4]:.3f}", row[5] < 1e-12  # k3 · differentiated π/μ = ∇KL(π‖ref)
        (['loss', 'differentiated', 'k3'], '1.000', True)
    """
    g = expected_offpolicy_gradients(
        policy_logits, reference_logits, behavior_logits, estimators, placements
    )
    rev, fwd = g.reverse_kl.flatten(), g.forward_kl.flatten()
    rows: list[list[object]] = []
    for where in PLACEMENTS:
        for how in WEIGHTINGS:
            for name in estimators:
                if (where, how, name) not in g.gradients:
                    continue
                flat = g.gradients[where, how, name].flatten()
                ratio = float(flat.norm() / rev.norm())
                rows.append(
                    [
                        where,
                        how,
                        name,
                        ratio,
                        "zero" if ratio < _ZERO else _cosine(flat, rev),
                        float((flat - rev).abs().max()),
                        float((flat - fwd).abs().max()),
                    ]
                )
    return rows


#: Columns of :attr:`OffPolicyStudy.rows`.
OFFPOLICY_STUDY_HEADERS = (
    "weighting",
    "estimator",
    "TV(flow, π*)",
    "TV(flow, π_fwd)",
    "TV(trained, π*)",
    "KL(trained‖ref)",
)


@dataclass(frozen=True)
class OffPolicyStudy:
    """Result of :func:`offpolicy_study`.

    Attributes:
        rows: one row per configuration (:data:`OFFPOLICY_STUDY_HEADERS`).
        runs: ``"weighting/estimator"`` -> the sampled :class:`~klpen_book.bandit.BanditRun`.
        flows: ``"weighting/estimator"`` -> final probabilities of the exact flow.
        optimum: π* of the reverse-KL objective; forward_optimum: that of the forward one.
    """

    rows: list[list[object]]
    runs: dict[str, BanditRun]
    flows: dict[str, Tensor]
    optimum: Tensor
    forward_optimum: Tensor


def _tv(p: Tensor, q: Tensor) -> float:
    return float(0.5 * (p - q).abs().sum())


def _offpolicy_flow(
    ref: Tensor,
    r: Tensor,
    kl_coef: float,
    temperature: float,
    estimator: str,
    weighting: str,
    steps: int,
    lr: float,
) -> Tensor:
    # Exact expected gradients: the reward term on-policy (corrected), the penalty as sampled
    # from μ = softmax(z / T) with the given weighting. Plain descent, as expected_flow does.
    logits = ref.clone()
    for _ in range(steps):
        p = torch.softmax(logits, dim=-1)
        grad = p * (p @ r - r)
        grad = grad + kl_coef * expected_penalty_gradient(
            logits,
            ref,
            estimator,
            "loss",
            behavior_logits=logits / temperature,
            weighting=weighting,
        )
        logits = logits - lr * grad
    return torch.softmax(logits, dim=-1)


def _offpolicy_run(
    ref: Tensor,
    r: Tensor,
    kl_coef: float,
    temperature: float,
    estimator: str,
    weighting: str,
    steps: int,
    batch_size: int,
    lr: float,
    seed: int,
) -> BanditRun:
    gen = torch.Generator().manual_seed(seed)
    ref_logprobs = torch.log_softmax(ref, dim=-1)
    logits = ref.clone().requires_grad_(True)
    optimiser = torch.optim.Adam([logits], lr=lr)
    history: dict[str, list[float]] = {"kl": [], "objective": []}
    for _ in range(steps):
        with torch.no_grad():
            probs = torch.softmax(logits, dim=-1)
            kl = float(full_kl(logits, ref))
            history["kl"].append(kl)
            history["objective"].append(float(probs @ r) - kl_coef * kl)
        logmu = torch.log_softmax(logits.detach() / temperature, dim=-1)
        y = torch.multinomial(logmu.exp(), batch_size, replacement=True, generator=gen)
        logp = torch.log_softmax(logits, dim=-1)[y]
        rho = (logp.detach() - logmu[y]).exp()
        baseline = (r[y].sum() - r[y]) / (batch_size - 1)
        # Reward term importance-weighted (detached ratio times the score): unbiased for
        # ∇E_π[r]; only the penalty's weighting differs between the configurations.
        loss = -(rho * (r[y] - baseline) * logp).mean()
        penalty = penalty_surrogate(
            logp,
            ref_logprobs[y],
            estimator,
            "loss",
            behavior_logprobs=logmu[y],
            weighting=weighting,
        )
        loss = loss + kl_coef * penalty.mean()
        (logits.grad,) = torch.autograd.grad(loss, logits)
        optimiser.step()
    return BanditRun(policy_logits=logits.detach(), history=history)


def offpolicy_study(
    reference_logits: Tensor,
    reward: Tensor,
    *,
    kl_coef: float,
    temperature: float,
    configs: Sequence[tuple[str, str]],
    steps: int = 300,
    batch_size: int = 64,
    lr: float = 0.1,
    flow_steps: int = 1000,
    flow_lr: float = 2.0,
    seed: int = 0,
) -> OffPolicyStudy:
    r"""A bandit trained on samples from the tempered sampler :math:`\mu = \mathrm{softmax}(z/T)`.

    Each ``(weighting, estimator)`` of ``configs`` puts the penalty in the loss with that
    weighting (:func:`klpen.gradients.penalty_surrogate`); the reward term is importance
    weighted in every run, so only the penalty differs. Each configuration is trained twice:
    with REINFORCE on sampled batches (Adam, as :func:`klpen_book.bandit.train_bandit`) and on
    the exact expected gradients (plain descent), whose end point is the fixed point.

    Example:
        >>> s = offpolicy_study(torch.zeros(3), torch.tensor([1.0, 0.0, 0.0]), kl_coef=1.0,
        ...                     temperature=0.5, configs=[("differentiated", "k3")], steps=5)
        >>> s.rows[0][:2]
        ['differentiated', 'k3']
    """
    w, rew = _check_bandit(reference_logits, reward)
    b = check_positive("kl_coef", kl_coef)
    t = check_positive("temperature", temperature)
    checked = [
        (
            check_choice("weighting", how, WEIGHTINGS),
            check_choice("estimator", name, list(ESTIMATORS)),
        )
        for how, name in configs
    ]
    n_steps, n = _check_int("steps", steps, 1), _check_int("batch_size", batch_size, 2)
    rate = check_positive("lr", lr)
    f_steps, f_rate = _check_int("flow_steps", flow_steps, 1), check_positive("flow_lr", flow_lr)
    seed = _check_int("seed", seed, 0)
    ref, r = w.detach().double(), rew.detach().double()
    optimum = optimal_policy(ref, r, b)
    forward = _forward_optimum(ref, r, b)
    rows: list[list[object]] = []
    runs: dict[str, BanditRun] = {}
    flows: dict[str, Tensor] = {}
    with single_threaded():
        for how, name in checked:
            key = f"{how}/{name}"
            flows[key] = _offpolicy_flow(ref, r, b, t, name, how, f_steps, f_rate)
            runs[key] = _offpolicy_run(ref, r, b, t, name, how, n_steps, n, rate, seed)
            trained = runs[key].probs
            rows.append(
                [
                    how,
                    name,
                    _tv(flows[key], optimum),
                    _tv(flows[key], forward),
                    _tv(trained, optimum),
                    float(full_kl(runs[key].policy_logits, ref)),
                ]
            )
    return OffPolicyStudy(
        rows=rows, runs=runs, flows=flows, optimum=optimum, forward_optimum=forward
    )
