"""Chapter 1's laboratory: sampled KL estimators, drawn from the policy and compared.

The estimators k1, k2, k3 and abs (:func:`klpen.estimate_kl`) are functions of one log-ratio
``r = log π(y) - log π_ref(y)`` of a token ``y ~ π``. Their bias and spread only show over many
draws, so this module draws tokens from a categorical policy, evaluates every estimator on each
draw and summarises them against the exact divergence (:func:`klpen.full_kl`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from klpen.estimators import ESTIMATORS, estimate_kl

from .checks import check_choice, check_floating, check_positive, check_shape
from .figures import FIGURE_DPI, FIGURE_SIZE, FIGURE_WIDTH
from .tables import format_table

__all__ = [
    "CLASSIC_ESTIMATORS",
    "EstimatorStats",
    "categorical_pair",
    "estimator_stats",
    "estimator_values_table",
    "plot_estimate_distributions",
    "plot_estimator_curves",
    "sample_estimates",
    "stats_table",
]

#: The four estimators of chapter 1 (chapter 7 adds the straight-through ones).
CLASSIC_ESTIMATORS = ("k1", "k2", "k3", "abs")


def _check_estimators(estimators: Sequence[str]) -> tuple[str, ...]:
    return tuple(check_choice("estimators", e, list(ESTIMATORS)) for e in estimators)


def _check_count(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    check_positive(name, value)
    return value


def categorical_pair(vocab_size: int, scale: float, *, seed: int) -> tuple[Tensor, Tensor]:
    r"""Policy and reference logits over one vocabulary, ``scale`` apart.

    The reference logits are standard normal; the policy adds an independent normal
    perturbation of standard deviation ``scale``:

    .. math:: w_v \sim \mathcal N(0, 1), \qquad z_v = w_v + \mathrm{scale}\cdot\varepsilon_v,
              \quad \varepsilon_v \sim \mathcal N(0, 1)

    so that :math:`\mathrm{KL}(\pi \,\|\, \pi_\mathrm{ref}) \approx \mathrm{scale}^2/2` for a
    small ``scale``.

    Args:
        vocab_size: ``V``, the number of tokens.
        scale: positive standard deviation of the policy's perturbation.
        seed: seed of the private generator (the global RNG is left alone).

    Returns:
        ``(policy_logits, reference_logits)``, each ``(V,)`` float64.

    Example:
        >>> from klpen import full_kl
        >>> z, w = categorical_pair(1000, 0.1, seed=0)
        >>> round(float(full_kl(z, w)), 4)
        0.0049
    """
    v = _check_count("vocab_size", vocab_size)
    s = check_positive("scale", scale)
    g = torch.Generator().manual_seed(seed)
    reference = torch.randn(v, generator=g, dtype=torch.float64)
    policy = reference + s * torch.randn(v, generator=g, dtype=torch.float64)
    return policy, reference


def sample_estimates(
    policy_logits: Tensor,
    reference_logits: Tensor,
    n_samples: int,
    *,
    seed: int,
    estimators: Sequence[str] = CLASSIC_ESTIMATORS,
) -> dict[str, Tensor]:
    r"""Draw ``n_samples`` tokens ``y ~ π`` and evaluate each estimator on every draw.

    .. math:: r_i = \log \pi(y_i) - \log \pi_\mathrm{ref}(y_i), \quad y_i \sim \pi, \qquad
              \text{estimate}_i = k(r_i)

    Args:
        policy_logits: ``(V,)`` floating logits of π.
        reference_logits: ``(V,)`` logits of π_ref, same shape.
        n_samples: number of independent draws.
        seed: seed of the private generator used to draw.
        estimators: names accepted by :func:`klpen.estimate_kl`.

    Returns:
        ``{name: (n_samples,) tensor}`` in the promoted dtype of the logits, one estimate per
        draw, all estimators evaluated on the same draws.

    Example:
        >>> z, w = categorical_pair(10, 0.5, seed=0)
        >>> est = sample_estimates(z, w, 4, seed=1)
        >>> sorted(est), tuple(est["k1"].shape)
        (['abs', 'k1', 'k2', 'k3'], (4,))
        >>> bool(torch.equal(est["abs"], est["k1"].abs()))
        True
    """
    check_floating("policy_logits", policy_logits, min_ndim=1)
    check_floating("reference_logits", reference_logits, min_ndim=1)
    if policy_logits.dim() != 1:
        raise ValueError(f"policy_logits must have shape (V,), got {tuple(policy_logits.shape)}")
    check_shape(
        "reference_logits", reference_logits, policy_logits.shape, "the shape of policy_logits"
    )
    n = _check_count("n_samples", n_samples)
    names = _check_estimators(estimators)
    g = torch.Generator().manual_seed(seed)
    logp = torch.log_softmax(policy_logits, dim=-1)
    logq = torch.log_softmax(reference_logits, dim=-1)
    tokens = torch.multinomial(logp.exp(), n, replacement=True, generator=g)
    return {name: estimate_kl(logp[tokens], logq[tokens], name) for name in names}


@dataclass(frozen=True)
class EstimatorStats:
    """Summary of one estimator's draws against the exact divergence.

    Attributes:
        estimator: its name.
        true_kl: the exact ``KL(π ‖ π_ref)``.
        mean: mean of the draws.
        std: standard deviation of a single draw.
        negative_fraction: fraction of draws below zero.
        n_samples: number of draws.
    """

    estimator: str
    true_kl: float
    mean: float
    std: float
    negative_fraction: float
    n_samples: int

    @property
    def bias(self) -> float:
        """``mean - true_kl``."""
        return self.mean - self.true_kl

    @property
    def standard_error(self) -> float:
        """Standard error of ``mean``: ``std / sqrt(n_samples)``."""
        return self.std / math.sqrt(self.n_samples)


def estimator_stats(estimates: Mapping[str, Tensor], true_kl: float) -> list[EstimatorStats]:
    r"""Bias, spread and sign of each estimator's draws.

    .. math:: \mathrm{bias} = \bar k - \mathrm{KL}, \qquad
              \mathrm{std} = \sqrt{\tfrac{1}{n-1}\textstyle\sum_i (k_i - \bar k)^2}

    Args:
        estimates: ``{name: (n,) tensor}``, as returned by :func:`sample_estimates`.
        true_kl: the exact divergence the draws estimate.

    Returns:
        One :class:`EstimatorStats` per entry, in the mapping's order, computed in float64.

    Example:
        >>> s = estimator_stats({"k1": torch.tensor([-1.0, 1.0, 3.0])}, true_kl=1.0)
        >>> s[0].bias, s[0].std, round(s[0].negative_fraction, 3)
        (0.0, 2.0, 0.333)
    """
    out = []
    for name, values in estimates.items():
        x = check_floating(f"estimates[{name!r}]", values, min_ndim=1).double().flatten()
        out.append(
            EstimatorStats(
                estimator=name,
                true_kl=float(true_kl),
                mean=float(x.mean()),
                std=float(x.std()),
                negative_fraction=float((x < 0).double().mean()),
                n_samples=x.numel(),
            )
        )
    return out


def stats_table(stats_by_case: Mapping[str, Sequence[EstimatorStats]], digits: int = 3) -> str:
    """Plain-text table of :func:`estimator_stats` results, relative to the true divergence.

    Columns: the case, the true KL, the estimator, ``bias/KL``, ``s.e./KL`` (the standard
    error of the measured bias: a bias within about two of these is sampling noise),
    ``std/KL`` (the standard deviation of one draw, as in Schulman's note) and the fraction of
    negative draws.

    Example:
        >>> s = estimator_stats({"k1": torch.tensor([-1.0, 1.0, 3.0])}, true_kl=1.0)
        >>> print(stats_table({"toy": s}))
        case     KL  estimator  bias/KL  s.e./KL  std/KL  P(<0)
        ----  -----  ---------  -------  -------  ------  -----
        toy   1.000  k1           0.000    1.155   2.000  0.333
    """
    rows: list[list[object]] = [
        [
            case,
            s.true_kl,
            s.estimator,
            s.bias / s.true_kl,
            s.standard_error / s.true_kl,
            s.std / s.true_kl,
            s.negative_fraction,
        ]
        for case, stats in stats_by_case.items()
        for s in stats
    ]
    headers = ["case", "KL", "estimator", "bias/KL", "s.e./KL", "std/KL", "P(<0)"]
    return format_table(rows, headers, digits=digits)


def estimator_values_table(
    policy_logprobs: Tensor,
    reference_logprobs: Tensor,
    estimators: Sequence[str] = CLASSIC_ESTIMATORS,
    digits: int = 3,
) -> str:
    """Each estimator's value on each sampled token, side by side, as a plain-text table.

    Args:
        policy_logprobs: ``(T,)`` log π of the sampled tokens.
        reference_logprobs: ``(T,)`` log π_ref of the same tokens.
        estimators: names accepted by :func:`klpen.estimate_kl`.
        digits: decimals shown.

    Example:
        >>> print(estimator_values_table(torch.tensor([-1.0]), torch.tensor([-2.0])))
        t   log π  log π_ref      ρ     k1     k2     k3    abs
        -  ------  ---------  -----  -----  -----  -----  -----
        0  -1.000     -2.000  1.000  1.000  0.500  0.368  1.000
    """
    names = _check_estimators(estimators)
    values = {e: estimate_kl(policy_logprobs, reference_logprobs, e).tolist() for e in names}
    r = (policy_logprobs - reference_logprobs).tolist()
    rows = [
        [i, lp, lr, ri, *(values[e][i] for e in names)]
        for i, (lp, lr, ri) in enumerate(
            zip(policy_logprobs.tolist(), reference_logprobs.tolist(), r, strict=True)
        )
    ]
    return format_table(rows, ["t", "log π", "log π_ref", "ρ", *names], digits=digits)


def plot_estimator_curves(
    r_min: float = -2.0, r_max: float = 2.0, estimators: Sequence[str] = CLASSIC_ESTIMATORS
) -> Any:
    """Each estimator as a function of the log-ratio ``r``, on one axis.

    Returns:
        A :class:`matplotlib.figure.Figure` (not attached to pyplot).

    Example:
        >>> fig = plot_estimator_curves()
        >>> [line.get_label() for line in fig.axes[0].get_lines()][:4]
        ['k1', 'k2', 'k3', 'abs']
    """
    from matplotlib.figure import Figure

    names = _check_estimators(estimators)
    r = torch.linspace(r_min, r_max, 401, dtype=torch.float64)
    fig = Figure(figsize=FIGURE_SIZE, dpi=FIGURE_DPI, layout="constrained")
    ax = fig.add_subplot()
    zero = torch.zeros_like(r)
    for name in names:
        ax.plot(r.numpy(), estimate_kl(r, zero, name).numpy(), label=name)
    ax.axhline(0.0, color="grey", lw=0.8)
    ax.set_xlabel(r"log-ratio $\rho = \log\pi(y) - \log\pi_{\mathrm{ref}}(y)$")
    ax.set_ylabel("single-sample estimate")
    ax.legend(title="estimator")
    return fig


def plot_estimate_distributions(
    estimates_by_case: Mapping[str, Mapping[str, Tensor]],
    true_kls: Mapping[str, float],
    bins: int = 60,
) -> Any:
    """Histograms of single-sample estimates: one column per case, one row per estimator.

    At most two cases (columns), so that the panels stay readable in a book's column. The
    panels of a column share their horizontal range, the 0.5%–99.5% quantiles of all that
    case's draws, so that rare extreme draws do not squash the picture; the true KL is the
    dashed line, zero the grey one, and each panel's title gives the mean of its draws.

    Args:
        estimates_by_case: ``{case: {estimator: (n,) tensor}}``, one or two cases, each with
            the same estimators.
        true_kls: ``{case: exact KL}``.
        bins: histogram bins per panel.

    Returns:
        A :class:`matplotlib.figure.Figure` with ``estimators × cases`` axes.

    Example:
        >>> z, w = categorical_pair(20, 0.5, seed=0)
        >>> draws = {"a": sample_estimates(z, w, 100, seed=0)}
        >>> fig = plot_estimate_distributions(draws, {"a": 0.1})
        >>> len(fig.axes), fig.axes[0].get_ylabel()
        (4, 'density')
    """
    from matplotlib.figure import Figure

    n_cols = len(estimates_by_case)
    if not 1 <= n_cols <= 2:
        raise ValueError(f"estimates_by_case must hold one or two cases, got {n_cols}")
    n_rows = max(len(e) for e in estimates_by_case.values())
    fig = Figure(figsize=(FIGURE_WIDTH, 1.9 * n_rows + 0.4), dpi=FIGURE_DPI, layout="constrained")
    axes = fig.subplots(n_rows, n_cols, squeeze=False)
    for column, (case, estimates) in zip(axes.T, estimates_by_case.items(), strict=True):
        everything = torch.cat([v.double().flatten() for v in estimates.values()])
        q = torch.tensor([0.005, 0.995], dtype=torch.float64)
        lo, hi = (float(x) for x in torch.quantile(everything, q))
        kl = true_kls[case]
        for ax, (name, values) in zip(column, estimates.items(), strict=False):
            x = values.double().flatten()
            ax.hist(x.numpy(), bins=bins, range=(lo, hi), density=True, color="C0")
            ax.axvline(kl, color="black", ls="--", lw=1.0)
            ax.axvline(0.0, color="grey", lw=0.6)
            ax.set_title(f"{name}, {case}: mean {float(x.mean()):.3f}", fontsize="medium")
            ax.set_ylabel("density")
        column[-1].set_xlabel(f"single-sample estimate (KL = {kl:.3f})")
    return fig
