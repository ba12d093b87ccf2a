r"""A one-step bandit: the smallest RLHF problem where the KL penalty can be watched at work.

Chapters 6 and 7 of the book. A "policy" is one categorical distribution over ``V`` responses
with learnable logits, initialised at the reference; each response ``y`` has a reward
:math:`r(y)`. The KL-regularised objective

.. math:: J(\pi) = \mathbb{E}_{y \sim \pi}[r(y)] - \beta\, \mathrm{KL}(\pi \,\|\, \pi_\mathrm{ref})

has the closed-form maximiser :math:`\pi^*(y) \propto \pi_\mathrm{ref}(y)\, e^{r(y)/\beta}`
(:func:`optimal_policy`), so where a sampled training run ends up can be compared with where
it should. :func:`train_bandit` trains with REINFORCE and the penalty either in the reward, in
the loss, or nowhere.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from klpen import full_kl, get_logprobs_for_tokens
from klpen.estimators import ESTIMATORS, estimate_kl

from .checks import check_choice, check_coef, check_logit_pair, check_positive, compute_dtype
from .figures import FIGURE_DPI, FIGURE_WIDTH

__all__ = [
    "HISTORY_KEYS",
    "METRIC_LABELS",
    "TRAIN_PLACEMENTS",
    "BanditRun",
    "forward_kl_optimal_policy",
    "optimal_policy",
    "plot_bandit",
    "single_threaded",
    "train_bandit",
]

#: Where :func:`train_bandit` puts the penalty: in the shaped reward, in the loss, or nowhere.
TRAIN_PLACEMENTS = ("reward", "loss", "none")
#: The per-step records of :attr:`BanditRun.history`.
HISTORY_KEYS = ("proxy_reward", "true_reward", "kl", "objective", "kl_estimate")

#: Axis label of each history key in :func:`plot_bandit`.
METRIC_LABELS = {
    "proxy_reward": "proxy score E_π[s]",
    "true_reward": "true score E_π[s_true]",
    "kl": "KL(π ‖ π_ref) (nats)",
    "objective": "E_π[s] − β KL(π ‖ π_ref)",
    "kl_estimate": "sampled KL estimate",
}


def _check_bandit(reference_logits: object, reward: object) -> tuple[Tensor, Tensor]:
    """Require ``(V,)`` finite reference logits and a ``(V,)`` finite reward."""
    w, r = check_logit_pair("reference_logits", reference_logits, "reward", reward)
    if w.dim() != 1:
        raise ValueError(f"reference_logits must have shape (V,), got {tuple(w.shape)}")
    return w, r


@contextmanager
def single_threaded() -> Iterator[None]:
    """Run torch on one intra-op thread inside the block, then restore the previous count.

    The bandit's tensors hold a few thousand numbers at most. Split across threads they gain
    nothing, and on a busy machine an op that waits for a descheduled sibling thread can take
    milliseconds instead of microseconds (measured: 300 training steps went from 0.5 s to 5 s).

    Example:
        >>> n = torch.get_num_threads()
        >>> with single_threaded():
        ...     torch.get_num_threads()
        1
        >>> torch.get_num_threads() == n
        True
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _check_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer, got {type(value).__name__} {value!r}")
    if int(value) < minimum:
        raise ValueError(f"{name} must be at least {minimum}, got {value}")
    return int(value)


def optimal_policy(reference_logits: Tensor, reward: Tensor, kl_coef: float) -> Tensor:
    r"""Probabilities of the maximiser π* of the reverse-KL-regularised bandit objective.

    The objective is :math:`\mathbb{E}_\pi[r] - \beta\,\mathrm{KL}(\pi\|\pi_\mathrm{ref})`, and

    .. math::

        \pi^*(y) = \frac{\pi_\mathrm{ref}(y)\, e^{r(y)/\beta}}
                        {\sum_{y'} \pi_\mathrm{ref}(y')\, e^{r(y')/\beta}}

    Args:
        reference_logits: ``(V,)`` finite logits of π_ref.
        reward: ``(V,)`` finite reward of each response.
        kl_coef: finite, positive coefficient.

    Returns:
        ``(V,)`` probabilities (fp32 for half-precision input, else the promoted dtype).

    Example:
        >>> optimal_policy(torch.zeros(3), torch.tensor([1.0, 0.0, 0.0]), kl_coef=1.0)
        tensor([0.5761, 0.2119, 0.2119])
    """
    w, r = _check_bandit(reference_logits, reward)
    b = check_positive("kl_coef", kl_coef)
    dtype = compute_dtype(torch.promote_types(w.dtype, r.dtype))
    # excerpt: formula
    return torch.softmax(w.to(dtype) + r.to(dtype) / b, dim=-1)
    # end excerpt


def forward_kl_optimal_policy(reference_logits: Tensor, reward: Tensor, kl_coef: float) -> Tensor:
    r"""Probabilities of the maximiser of the forward-KL-regularised bandit objective.

    The objective is :math:`\mathbb{E}_\pi[r] - \beta\,\mathrm{KL}(\pi_\mathrm{ref}\|\pi)`. The
    forward KL is what k3 *in the loss* descends (chapter 7). Setting the derivative of the
    Lagrangian to zero gives :math:`r(y) + \beta\, \pi_\mathrm{ref}(y)/\pi(y) = \lambda`, so

    .. math::

        \pi(y) = \frac{\beta\, \pi_\mathrm{ref}(y)}{\lambda - r(y)}, \qquad
        \lambda \in \big(\max_y r(y),\, \max_y r(y) + \beta\big]
        \text{ with } \textstyle\sum_y \pi(y) = 1,

    and :math:`\lambda` is found by bisection (the sum decreases in :math:`\lambda`). Unlike
    :math:`\pi^*`, this policy shrinks each response's probability only by a factor
    :math:`\beta / (\lambda - r(y))`, never exponentially: the forward KL forbids dropping
    any response the reference can emit.

    Args:
        reference_logits: ``(V,)`` finite logits of π_ref.
        reward: ``(V,)`` finite reward of each response.
        kl_coef: finite, positive coefficient.

    Returns:
        ``(V,)`` probabilities, computed in fp64 and returned in the dtype
        :func:`optimal_policy` returns.

    Example:
        >>> p = forward_kl_optimal_policy(torch.zeros(2), torch.tensor([1.0, 0.0]), kl_coef=1.0)
        >>> p  # here λ = 1 + 1/√2, so π = (1/√2, 1 - 1/√2)
        tensor([0.7071, 0.2929])
    """
    w, r = _check_bandit(reference_logits, reward)
    b = check_positive("kl_coef", kl_coef)
    dtype = compute_dtype(torch.promote_types(w.dtype, r.dtype))
    q = torch.softmax(w.double(), dim=-1)
    r64 = r.double()
    lo = r64.max()
    hi = lo + b
    # 200 halvings of an interval of width β reach the fp64 resolution of λ.
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        # At lo the sum is +inf; a mid that rounds onto max r would divide by zero.
        if bool(mid <= r64.max()):
            break
        total = (b * q / (mid - r64)).sum()
        lo, hi = (mid, hi) if bool(total > 1) else (lo, mid)
    p = b * q / (hi - r64)
    return (p / p.sum()).to(dtype)


@dataclass
class BanditRun:
    """The result of :func:`train_bandit`.

    Attributes:
        policy_logits: ``(V,)`` final logits (detached).
        history: for each key of :data:`HISTORY_KEYS`, one float per step, measured on the
            policy that drew that step's batch (entry 0 is the reference):
            ``"proxy_reward"`` :math:`\\mathbb{E}_\\pi[r]`, ``"true_reward"``
            :math:`\\mathbb{E}_\\pi[r_\\mathrm{true}]`
            (the proxy when no true reward is given), ``"kl"`` the exact
            :math:`\\mathrm{KL}(\\pi\\|\\pi_\\mathrm{ref})`, ``"objective"``
            :math:`\\mathbb{E}_\\pi[r] - \\beta\\,\\mathrm{KL}` (all exact, by enumeration) and
            ``"kl_estimate"`` the batch mean of the sampled estimator.
    """

    policy_logits: Tensor
    history: dict[str, list[float]] = field(default_factory=dict)

    @property
    def probs(self) -> Tensor:
        """``(V,)`` final probabilities."""
        return torch.softmax(self.policy_logits, dim=-1)


def train_bandit(
    reference_logits: Tensor,
    reward: Tensor,
    *,
    kl_coef: float,
    placement: str = "reward",
    estimator: str = "k1",
    true_reward: Tensor | None = None,
    steps: int = 300,
    batch_size: int = 64,
    lr: float = 0.1,
    seed: int = 0,
) -> BanditRun:
    r"""Train a categorical policy on a bandit with REINFORCE and a sampled KL penalty.

    Each step draws ``batch_size`` responses :math:`y_i \sim \pi` (a ``torch.Generator``
    seeded with ``seed``: same arguments, same run) and minimises, with Adam at learning
    rate ``lr``,

    .. math::

        \mathcal{L} = -\frac{1}{B} \sum_i A_i \log \pi(y_i)
            \;+\; \Big[\frac{\beta}{B} \sum_i k(y_i)\Big]_\text{placement = loss},
        \qquad A_i = \tilde r_i - \frac{1}{B-1} \sum_{j \ne i} \tilde r_j,

    where the shaped reward is :math:`\tilde r_i = r(y_i) - \beta\, \operatorname{sg}[k(y_i)]`
    for ``placement="reward"`` (KL in the reward, PPO-style) and :math:`\tilde r_i = r(y_i)`
    otherwise (``"loss"``: KL as a differentiable loss term, GRPO-style; ``"none"``: no
    penalty, β ignored). The baseline is the mean of the *other* samples, so it leaves the
    gradient unbiased. :math:`k` is :func:`klpen.estimate_kl` with ``estimator``.

    Args:
        reference_logits: ``(V,)`` finite logits of π_ref; also the initial policy.
        reward: ``(V,)`` the (proxy) reward the policy is trained on.
        kl_coef: finite, non-negative penalty coefficient.
        placement: ``"reward"``, ``"loss"`` or ``"none"``.
        estimator: a name of :func:`klpen.estimate_kl`.
        true_reward: optional ``(V,)`` reward that is only measured, never trained on.
        steps: number of updates (>= 1).
        batch_size: samples per update (>= 2, for the baseline).
        lr: Adam's learning rate, finite and positive.
        seed: seed of the sampling generator.

    Returns:
        A :class:`BanditRun`; the computation is in fp64.

    Example:
        >>> run = train_bandit(torch.zeros(3), torch.tensor([1.0, 0.0, 0.0]), kl_coef=1.0,
        ...                    steps=200, batch_size=32)
        >>> run.probs.round(decimals=1)  # near the optimum [0.58, 0.21, 0.21]
        tensor([0.6000, 0.2000, 0.2000], dtype=torch.float64)
        >>> sorted(run.history) == sorted(HISTORY_KEYS), len(run.history["kl"])
        (True, 200)
    """
    w, r = _check_bandit(reference_logits, reward)
    b = check_coef("kl_coef", kl_coef)
    where = check_choice("placement", placement, TRAIN_PLACEMENTS)
    name = check_choice("estimator", estimator, list(ESTIMATORS))
    if true_reward is None:
        t = r
    else:
        _, t = check_logit_pair("reference_logits", w, "true_reward", true_reward)
    n_steps = _check_int("steps", steps, 1)
    n = _check_int("batch_size", batch_size, 2)
    rate = check_positive("lr", lr)
    gen = torch.Generator(device=w.device).manual_seed(_check_int("seed", seed, 0))

    ref, r, t = w.detach().double(), r.detach().double(), t.detach().double()
    ref_logprobs = torch.log_softmax(ref, dim=-1)
    logits = ref.clone().requires_grad_(True)
    optimiser = torch.optim.Adam([logits], lr=rate)
    history: dict[str, list[float]] = {key: [] for key in HISTORY_KEYS}
    vocab = ref.shape[0]
    with single_threaded():
        for _ in range(n_steps):
            with torch.no_grad():
                probs = torch.softmax(logits, dim=-1)
                proxy = float(probs @ r)
                kl = float(full_kl(logits, ref))
            history["proxy_reward"].append(proxy)
            history["true_reward"].append(float(probs @ t))
            history["kl"].append(kl)
            history["objective"].append(proxy - b * kl)

            # excerpt: update
            y = torch.multinomial(probs, n, replacement=True, generator=gen)
            logp = get_logprobs_for_tokens(logits.expand(n, vocab), y)
            k = estimate_kl(logp, ref_logprobs[y], name)
            # end excerpt
            history["kl_estimate"].append(float(k.detach().mean()))
            # excerpt: update
            shaped = r[y] - b * k.detach() if where == "reward" else r[y]
            baseline = (shaped.sum() - shaped) / (n - 1)
            loss = -((shaped - baseline) * logp).mean()
            if where == "loss":
                loss = loss + b * k.mean()
            (logits.grad,) = torch.autograd.grad(loss, logits)
            optimiser.step()
            # end excerpt
    return BanditRun(policy_logits=logits.detach(), history=history)


def plot_bandit(
    runs: Mapping[str, BanditRun],
    *,
    optimum: Tensor | Mapping[str, Tensor] | None = None,
    metrics: Sequence[str] = ("objective", "kl"),
) -> Any:
    """Training curves of several runs and their final policies next to the optimum.

    One panel per metric (a key of :data:`HISTORY_KEYS`, against the step), then a panel of
    the final probability of every response, one marker style per run, with the optimum (or
    several named optima) drawn as step lines. Two panels a row, the book's column wide
    (:data:`klpen_book.figures.FIGURE_WIDTH`), every axis labelled, one legend below them.

    Args:
        runs: label -> :class:`BanditRun` (at least one).
        optimum: ``(V,)`` probabilities, or label -> ``(V,)`` probabilities, or ``None``.
        metrics: history keys to plot.

    Returns:
        A ``matplotlib.figure.Figure`` (requires matplotlib).

    Example:
        >>> run = train_bandit(torch.zeros(3), torch.tensor([1.0, 0.0, 0.0]), kl_coef=1.0, steps=5)
        >>> fig = plot_bandit({"k1 in reward": run}, optimum=torch.tensor([0.58, 0.21, 0.21]))
        >>> len(fig.axes)
        3
    """
    from matplotlib.figure import Figure

    if not isinstance(runs, Mapping) or not runs:
        raise ValueError(f"runs must be a non-empty mapping of label -> BanditRun, got {runs!r}")
    for label, run in runs.items():
        if not isinstance(run, BanditRun):
            raise TypeError(f"runs[{label!r}] must be a BanditRun, got {type(run).__name__}")
    keys = [check_choice("metrics", m, HISTORY_KEYS) for m in metrics]
    optima = {"optimum": optimum} if isinstance(optimum, Tensor) else dict(optimum or {})

    # Laid out for the book's column: two panels a row; with an odd number of panels the
    # final-policy panel spans the last row. One legend for the whole figure, below it.
    panels = [*keys, "final"]
    rows = [panels[i : i + 2] for i in range(0, len(panels), 2)]
    mosaic: list[Any] = [row if len(row) == 2 else [row[0], row[0]] for row in rows]
    fig = Figure(
        figsize=(FIGURE_WIDTH, 2.6 * len(mosaic) + 0.6), dpi=FIGURE_DPI, layout="constrained"
    )
    axes = fig.subplot_mosaic(mosaic)
    for key in keys:
        ax = axes[key]
        for label, run in runs.items():
            ax.plot(run.history[key], label=label, linewidth=1.4)
        ax.set_xlabel("training step")
        ax.set_ylabel(METRIC_LABELS[key])
        ax.grid(alpha=0.3)
    ax = axes["final"]
    markers = "osD^vP*X"
    for i, (label, run) in enumerate(runs.items()):
        p = run.probs.numpy()
        ax.plot(range(len(p)), p, markers[i % len(markers)], label=label, alpha=0.8)
    for j, (label, p_opt) in enumerate(optima.items()):
        values = p_opt.detach().double().cpu().numpy()
        ax.step(
            range(len(values)),
            values,
            where="mid",
            color=f"C{j + len(runs)}",
            linestyle="--",
            label=label,
        )
    ax.set_xlabel("response y")
    ax.set_ylabel("final π(y)")
    ax.set_xticks(range(len(next(iter(runs.values())).probs)))
    ax.grid(alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncols=2, fontsize=10, frameon=False)
    return fig
