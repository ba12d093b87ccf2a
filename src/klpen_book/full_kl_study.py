"""Chapter 3's laboratory: the sampled average against the exact KL, forward against reverse.

Two experiments. The first draws more and more tokens from the policy and follows the running
average of the k1 (and k3) estimates towards the exact divergence of :func:`klpen.full_kl`.
The second fits a single discretised Gaussian to a two-mode target by minimising either
``KL(q ‖ p)`` (reverse, the direction of the RLHF penalty) or ``KL(p ‖ q)`` (forward), to show
mode-seeking against mass-covering; every divergence in it is one batched :func:`full_kl` call.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from klpen import estimate_kl, full_kl

from .checks import check_choice, check_floating, check_positive
from .estimator_study import CLASSIC_ESTIMATORS, sample_estimates
from .figures import FIGURE_DPI, FIGURE_SIZE
from .tables import format_table

__all__ = [
    "UnimodalFit",
    "bimodal_logits",
    "exact_moments",
    "exact_table",
    "fit_unimodal",
    "gaussian_logits",
    "plot_convergence",
    "plot_forward_reverse",
    "running_means",
]


def exact_moments(
    policy_logits: Tensor, reference_logits: Tensor, estimator: str = "k1"
) -> tuple[float, float]:
    r"""Exact mean and standard deviation of a one-token estimator, by enumerating the vocabulary.

    .. math:: \mathbb E_{y\sim\pi}[k] = \sum_v \pi(v)\, k(r_v), \qquad
              \mathrm{sd}(k) = \Big(\sum_v \pi(v)\, k(r_v)^2 - \mathbb E[k]^2\Big)^{1/2}

    with :math:`r_v = \log\pi(v) - \log\pi_\mathrm{ref}(v)`. No sampling: these are the
    values that sample means and standard deviations converge to.

    Args:
        policy_logits, reference_logits: ``(V,)`` logits of π and π_ref, finite.
        estimator: a name accepted by :func:`klpen.estimate_kl`.

    Returns:
        ``(mean, std)`` as Python floats, computed in float64.

    Example:
        >>> z, w = torch.tensor([2.0, 0.0, 0.0]), torch.zeros(3)
        >>> mean, std = exact_moments(z, w, "k1")
        >>> round(mean, 4) == round(float(full_kl(z, w)), 4)
        True
    """
    check_floating("policy_logits", policy_logits, min_ndim=1)
    check_floating("reference_logits", reference_logits, min_ndim=1)
    logp = torch.log_softmax(policy_logits.double(), dim=-1)
    logq = torch.log_softmax(reference_logits.double(), dim=-1)
    k = estimate_kl(logp, logq, check_choice("estimator", estimator, ["k1", "k2", "k3", "abs"]))
    p = logp.exp()
    mean = float((p * k).sum())
    second = float((p * k * k).sum())
    return mean, max(second - mean * mean, 0.0) ** 0.5


def exact_table(
    cases: Mapping[str, tuple[Tensor, Tensor]],
    estimators: Sequence[str] = CLASSIC_ESTIMATORS,
    digits: int = 4,
) -> str:
    """Chapter 1's bias/variance table computed exactly with :func:`exact_moments`.

    Columns: the case, its exact KL (:func:`klpen.full_kl`), the estimator, ``bias/KL`` and
    ``std/KL`` (of a single draw), both exact.

    Args:
        cases: ``{name: (policy_logits, reference_logits)}``, each ``(V,)``.
        estimators: names accepted by :func:`klpen.estimate_kl`.
        digits: decimals shown.

    Example:
        >>> z, w = torch.tensor([2.0, 0.0, 0.0]), torch.zeros(3)
        >>> print(exact_table({"toy": (z, w)}, ["k1", "k3"]))
        case      KL  estimator  bias/KL  std/KL
        ----  ------  ---------  -------  ------
        toy   0.4330  k1          0.0000  1.8910
        toy   0.4330  k3          0.0000  0.6676
    """
    rows: list[list[object]] = []
    for case, (z, w) in cases.items():
        kl = float(full_kl(z.double(), w.double()))
        for name in estimators:
            mean, std = exact_moments(z, w, name)
            rows.append([case, kl, name, (mean - kl) / kl, std / kl])
    return format_table(rows, ["case", "KL", "estimator", "bias/KL", "std/KL"], digits=digits)


def running_means(
    policy_logits: Tensor,
    reference_logits: Tensor,
    n_samples: int,
    *,
    n_runs: int,
    seed: int,
    estimator: str = "k1",
) -> Tensor:
    r"""Running averages of a sampled estimator over ``n_runs`` independent streams of draws.

    .. math:: \bar k_n = \frac1n \sum_{i=1}^{n} k(r_i), \qquad y_i \sim \pi

    Run ``j`` draws with seed ``seed + j`` (:func:`~klpen_book.estimator_study.sample_estimates`).

    Args:
        policy_logits, reference_logits: ``(V,)`` logits of π and π_ref.
        n_samples: draws per run.
        n_runs: independent runs.
        seed: seed of the first run.
        estimator: a name accepted by :func:`klpen.estimate_kl`.

    Returns:
        ``(n_runs, n_samples)`` float64; entry ``[j, n-1]`` is run ``j``'s mean of its first
        ``n`` estimates.

    Example:
        >>> from klpen_book.estimator_study import categorical_pair
        >>> z, w = categorical_pair(50, 0.5, seed=0)
        >>> m = running_means(z, w, 1000, n_runs=2, seed=0)
        >>> tuple(m.shape)
        (2, 1000)
    """
    runs = int(check_positive("n_runs", n_runs))
    counts = torch.arange(1, n_samples + 1, dtype=torch.float64)
    streams = [
        sample_estimates(
            policy_logits, reference_logits, n_samples, seed=seed + j, estimators=(estimator,)
        )[estimator].double()
        for j in range(runs)
    ]
    return torch.stack(streams).cumsum(dim=-1) / counts


def plot_convergence(
    means_by_estimator: dict[str, Tensor], true_kl: float, std_by_estimator: dict[str, float]
) -> Any:
    """Running averages against the number of draws, one panel per estimator.

    Each panel shows every run, the exact KL (dashed) and the band
    ``KL ± 2·std/√n`` that the central limit theorem predicts for an unbiased estimator.

    Args:
        means_by_estimator: ``{name: (n_runs, n) running means}`` from :func:`running_means`.
        true_kl: the exact divergence.
        std_by_estimator: ``{name: standard deviation of one draw}``.

    Returns:
        A :class:`matplotlib.figure.Figure`.

    Example:
        >>> fig = plot_convergence({"k1": torch.ones(2, 10)}, 1.0, {"k1": 0.5})
        >>> len(fig.axes)
        1
    """
    from matplotlib.figure import Figure

    n_panels = len(means_by_estimator)
    if not 1 <= n_panels <= 2:
        raise ValueError(f"means_by_estimator must hold one or two estimators, got {n_panels}")
    fig = Figure(figsize=FIGURE_SIZE, dpi=FIGURE_DPI, layout="constrained")
    axes = fig.subplots(1, n_panels, squeeze=False, sharey=True)[0]
    for ax, (name, means) in zip(axes, means_by_estimator.items(), strict=True):
        n = torch.arange(1, means.shape[-1] + 1, dtype=torch.float64)
        half = 2.0 * std_by_estimator[name] / n.sqrt()
        ax.fill_between(
            n.numpy(),
            (true_kl - half).numpy(),
            (true_kl + half).numpy(),
            color="0.88",
            label=r"KL $\pm$ 2 std/$\sqrt{n}$",
        )
        # The runs are interchangeable: one colour, one legend entry for all of them.
        for index, run in enumerate(means):
            label = f"{len(means)} independent runs" if index == 0 else None
            ax.plot(n.numpy(), run.numpy(), lw=0.9, color="C0", alpha=0.7, label=label)
        ax.axhline(true_kl, color="black", ls="--", lw=1.0, label=f"full KL = {true_kl:.3f}")
        ax.set_xscale("log")
        ax.set_xlabel("sampled tokens n")
        ax.set_title(f"running mean of {name}")
        ax.set_ylim(
            true_kl - 4 * std_by_estimator[name] / 10, true_kl + 4 * std_by_estimator[name] / 10
        )
        ax.legend(loc="upper right", fontsize="small")
    axes[0].set_ylabel("estimate of KL(π ‖ π_ref)")
    return fig


def gaussian_logits(grid: Tensor, mean: Tensor | float, std: Tensor | float) -> Tensor:
    r"""Logits of a Gaussian discretised on ``grid``: a categorical over the grid points.

    .. math:: z_v = -\frac{(x_v - \mu)^2}{2\sigma^2}

    (the normalising constant cancels in the softmax). ``mean`` and ``std`` broadcast: with
    shapes ``(M, 1)`` and ``(1, S)`` the result is ``(M, S, V)``, one candidate per pair.

    Args:
        grid: ``(V,)`` floating grid points.
        mean, std: numbers or tensors of broadcastable shapes; ``std > 0``.

    Returns:
        ``(*broadcast shape, V)`` logits in ``grid``'s dtype.

    Example:
        >>> gaussian_logits(torch.tensor([-1.0, 0.0, 1.0]), 0.0, 1.0)
        tensor([-0.5000, -0.0000, -0.5000])
    """
    check_floating("grid", grid, min_ndim=1)
    m = torch.as_tensor(mean, dtype=grid.dtype)[..., None]
    s = torch.as_tensor(std, dtype=grid.dtype)[..., None]
    return -((grid - m) ** 2) / (2 * s**2)


def bimodal_logits(
    grid: Tensor,
    means: Sequence[float] = (-2.0, 2.0),
    std: float = 0.6,
    weights: Sequence[float] = (0.6, 0.4),
) -> Tensor:
    r"""Logits of a mixture of discretised Gaussians on ``grid``.

    .. math:: z_v = \log \sum_k w_k\, \frac{1}{\sigma}\, e^{-(x_v - \mu_k)^2 / 2\sigma^2}

    Example:
        >>> grid = torch.linspace(-4, 4, 9, dtype=torch.float64)
        >>> p = torch.softmax(bimodal_logits(grid), -1)
        >>> int(p.argmax()), round(float(p.sum()), 6)
        (2, 1.0)
    """
    check_floating("grid", grid, min_ndim=1)
    sd = check_positive("std", std)
    components = torch.stack(
        [
            gaussian_logits(grid, m, sd) + torch.log(torch.tensor(w, dtype=grid.dtype))
            for m, w in zip(means, weights, strict=True)
        ]
    )
    return torch.logsumexp(components, dim=0)


@dataclass(frozen=True)
class UnimodalFit:
    """The best single discretised Gaussian for one direction of the KL.

    Attributes:
        direction: ``"reverse"`` (minimises ``KL(q ‖ p)``) or ``"forward"`` (``KL(p ‖ q)``).
        mean, std: the fitted parameters.
        kl: the minimised divergence.
        logits: ``(V,)`` logits of the fitted ``q`` on the grid.
    """

    direction: str
    mean: float
    std: float
    kl: float
    logits: Tensor


def fit_unimodal(
    target_logits: Tensor, grid: Tensor, direction: str, means: Tensor, stds: Tensor
) -> UnimodalFit:
    r"""Grid search for the discretised Gaussian ``q`` closest to the target ``p``.

    .. math::
        \text{reverse: } \min_{\mu,\sigma} \mathrm{KL}(q_{\mu,\sigma} \,\|\, p), \qquad
        \text{forward: } \min_{\mu,\sigma} \mathrm{KL}(p \,\|\, q_{\mu,\sigma})

    All ``len(means) * len(stds)`` candidates are scored by a single batched
    :func:`klpen.full_kl` call; the search is exhaustive, so the result is deterministic.

    Args:
        target_logits: ``(V,)`` logits of ``p`` on ``grid``.
        grid: ``(V,)`` grid points.
        direction: ``"reverse"`` or ``"forward"``.
        means: ``(M,)`` candidate means.
        stds: ``(S,)`` candidate standard deviations, all positive.

    Returns:
        The best :class:`UnimodalFit`.

    Example:
        >>> grid = torch.linspace(-4, 4, 81, dtype=torch.float64)
        >>> p = gaussian_logits(grid, 1.0, 0.5)
        >>> means, stds = torch.linspace(-2, 2, 41), torch.tensor([0.25, 0.5, 1.0])
        >>> fit = fit_unimodal(p, grid, "forward", means, stds)
        >>> round(fit.mean, 3), round(fit.std, 3), round(fit.kl, 6)
        (1.0, 0.5, 0.0)
    """
    check_floating("target_logits", target_logits, min_ndim=1)
    check_floating("grid", grid, min_ndim=1)
    way = check_choice("direction", direction, ["reverse", "forward"])
    m = check_floating("means", means, min_ndim=1).to(grid.dtype)
    s = check_floating("stds", stds, min_ndim=1).to(grid.dtype)
    if not bool((s > 0).all()):
        raise ValueError(f"stds must all be positive, got a minimum of {float(s.min())}")
    candidates = gaussian_logits(grid, m[:, None], s[None, :])
    target = target_logits.to(grid.dtype).expand_as(candidates)
    kl = full_kl(candidates, target) if way == "reverse" else full_kl(target, candidates)
    best = int(kl.argmin())
    i, j = divmod(best, s.shape[0])
    return UnimodalFit(way, float(m[i]), float(s[j]), float(kl[i, j]), candidates[i, j])


def plot_forward_reverse(grid: Tensor, target_logits: Tensor, fits: Sequence[UnimodalFit]) -> Any:
    """The target distribution and each fitted Gaussian, as probabilities on the grid.

    Returns:
        A :class:`matplotlib.figure.Figure`.

    Example:
        >>> grid = torch.linspace(-4, 4, 81, dtype=torch.float64)
        >>> p = bimodal_logits(grid)
        >>> means, stds = torch.linspace(-2, 2, 5), torch.tensor([1.0, 2.0])
        >>> fit = fit_unimodal(p, grid, "forward", means, stds)
        >>> len(plot_forward_reverse(grid, p, [fit]).axes[0].get_lines())
        2
    """
    from matplotlib.figure import Figure

    fig = Figure(figsize=FIGURE_SIZE, dpi=FIGURE_DPI, layout="constrained")
    ax = fig.add_subplot()
    x = grid.numpy()
    ax.fill_between(x, torch.softmax(target_logits, -1).numpy(), color="0.8", label="target p")
    ax.plot(x, torch.softmax(target_logits, -1).numpy(), color="0.5", lw=1.0)
    names = {
        "reverse": "reverse KL(q ‖ p): mode-seeking",
        "forward": "forward KL(p ‖ q): mass-covering",
    }
    for fit in fits:
        label = f"{names[fit.direction]} (μ={fit.mean:.2f}, σ={fit.std:.2f})"
        ax.plot(x, torch.softmax(fit.logits, -1).numpy(), lw=2.0, label=label)
    ax.set_xlabel("grid point x")
    ax.set_ylabel("probability")
    ax.legend(fontsize="small")
    return fig
