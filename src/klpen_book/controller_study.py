r"""Chapter 5's experiment: KL controllers driving a simulated training run.

A real run is too slow for a book, so the policy is replaced by a one-line model of how the
KL of a training run responds to β. At every step the policy drifts toward an equilibrium KL
that falls as β grows,

.. math::
    \mathrm{KL}^\star_t(\beta) = m_t\,\mathrm{KL}_\mathrm{target}\,(\beta_0/\beta)^{\gamma},

where the phase multiplier :math:`m_t` says how hard the reward pulls the policy away from its
reference (``m = 1``: at the initial :math:`\beta_0` the run would sit at the target). The KL
moves only part of the way toward it each step (geometric relaxation at ``rate``): a policy
takes many gradient steps to move, which is what makes a controller overshoot. The controller
sees it through multiplicative log-normal measurement noise of scale ``noise``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from klpen import DoublingKLController, KLController

from .checks import check_coef, check_positive
from .figures import FIGURE_DPI, FIGURE_WIDTH
from .tables import format_table

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = [
    "DEFAULT_PHASES",
    "KLRun",
    "Phase",
    "phase_table",
    "plot_runs",
    "simulate_run",
]


@dataclass(frozen=True)
class Phase:
    """A stretch of the simulated run.

    Attributes:
        name: a label for tables and plots.
        steps: its number of steps.
        pressure: the multiplier :math:`m` of the equilibrium KL (1 = on target at β0).
    """

    name: str
    steps: int
    pressure: float


#: high, near-target, low, near-target: the KL the run would reach at β0 = 0.1 is 20x the
#: target, on target, 1/20 of it, on target again.
DEFAULT_PHASES = (
    Phase("high", 100, 20.0),
    Phase("near", 100, 1.0),
    Phase("low", 100, 0.05),
    Phase("near again", 100, 1.0),
)


@dataclass
class KLRun:
    """What one simulated run recorded, one entry per step.

    Attributes:
        kl: the KL the controller measured (with noise).
        true_kl: the policy's KL before the noise.
        kl_coef: the coefficient β the controller returned after seeing ``kl``.
        phase: the name of the phase of each step.
        next_kl: the policy's KL after the last step; pass it as ``initial_kl`` to resume.
    """

    kl: list[float] = field(default_factory=list)
    true_kl: list[float] = field(default_factory=list)
    kl_coef: list[float] = field(default_factory=list)
    phase: list[str] = field(default_factory=list)
    next_kl: float = math.nan


def simulate_run(
    controller: KLController,
    phases: Sequence[Phase] = DEFAULT_PHASES,
    *,
    target_kl: float = 6.0,
    init_kl_coef: float = 0.1,
    gamma: float = 0.5,
    rate: float = 0.2,
    noise: float = 0.1,
    n_steps: int = 1,
    start: int = 0,
    stop: int | None = None,
    initial_kl: float | None = None,
    seed: int = 0,
) -> KLRun:
    r"""Drive ``controller`` through the simulated run; steps ``start`` to ``stop`` only.

    At step ``t`` the controller measures :math:`\mathrm{KL}_t e^{\sigma\varepsilon_t}` and
    returns :math:`\beta_{t+1}`; the policy then moves in log space a fraction ``rate`` of
    the way to :math:`\mathrm{KL}^\star_t(\beta_{t+1})` (the model in the module docstring).
    The noise :math:`\varepsilon_t` is drawn up-front from ``seed`` for the whole run, so
    every controller sees the same noise, and a run cut at ``stop`` and resumed at
    ``start = stop`` (with ``initial_kl`` set to the cut run's ``next_kl``)
    continues exactly as the uncut run.

    Args:
        controller: any klpen controller; it is updated in place.
        phases: the run's phases, in order.
        target_kl: the target the phases are scaled by, finite and positive.
        init_kl_coef: :math:`\beta_0`, the β at which the phases are calibrated.
        gamma: :math:`\gamma`, how strongly the equilibrium KL responds to β; >= 0.
        rate: fraction of the way to equilibrium covered per step, in (0, 1].
        noise: :math:`\sigma`, scale of the log-normal measurement noise, >= 0.
        n_steps: passed to ``controller.update`` (the samples one update covers).
        start, stop: the steps to run (``stop=None``: to the end).
        initial_kl: the policy's KL at step ``start``; defaults to ``target_kl`` at step 0.
        seed: seed of the noise.

    Returns:
        A :class:`KLRun` of the steps run.

    Example:
        >>> run = simulate_run(DoublingKLController(), [Phase("high", 3, 20.0)], noise=0.0)
        >>> run.kl_coef
        [0.1, 0.2, 0.4]
    """
    target = check_positive("target_kl", target_kl)
    beta0 = check_positive("init_kl_coef", init_kl_coef)
    g = check_coef("gamma", gamma)
    r = check_positive("rate", rate)
    sigma = check_coef("noise", noise)
    if r > 1:
        raise ValueError(f"rate must lie in (0, 1], got {r}")
    schedule = [(p.name, p.pressure) for p in phases for _ in range(p.steps)]
    end = len(schedule) if stop is None else stop
    if not 0 <= start <= end <= len(schedule):
        raise ValueError(f"need 0 <= start <= stop <= {len(schedule)}, got {start} and {stop}")
    eps = np.random.default_rng(seed).standard_normal(len(schedule))
    # The state is the KL itself (not its log), so that a resumed run starts from the very float
    # the cut run ended on.
    kl = target if initial_kl is None else check_positive("initial_kl", initial_kl)
    run = KLRun()
    for t in range(start, end):
        name, pressure = schedule[t]
        # excerpt: step
        measured = kl * math.exp(sigma * float(eps[t]))
        beta = controller.update(measured, n_steps=n_steps)
        # end excerpt
        run.kl.append(measured)
        run.true_kl.append(kl)
        run.kl_coef.append(beta)
        run.phase.append(name)
        # excerpt: step
        equilibrium = math.log(pressure * target) + g * math.log(beta0 / beta)
        kl = math.exp(math.log(kl) + r * (equilibrium - math.log(kl)))
        # end excerpt
    run.next_kl = kl
    return run


def phase_table(runs: Mapping[str, KLRun], target_kl: float = 6.0) -> str:
    """Per controller and phase: median KL, share of steps in the stable zone, β range.

    The stable zone is ``[target/1.5, 1.5*target]``, where the doubling rule leaves β alone.

    Example:
        >>> run = simulate_run(DoublingKLController(), [Phase("near", 4, 1.0)], noise=0.0)
        >>> print(phase_table({"adaptive": run}).splitlines()[2])
        adaptive    near    6.00     100%   0.100   0.100
    """
    lo, hi = target_kl / 1.5, 1.5 * target_kl
    rows: list[list[object]] = []
    for label, run in runs.items():
        names = list(dict.fromkeys(run.phase))
        for name in names:
            idx = [i for i, p in enumerate(run.phase) if p == name]
            kl = np.array([run.kl[i] for i in idx])
            beta = [run.kl_coef[i] for i in idx]
            inside = float(np.mean((kl >= lo) & (kl <= hi)))
            rows.append(
                [label, name, f"{np.median(kl):.2f}", f"{inside:.0%}", min(beta), max(beta)]
            )
    headers = ["controller", "phase", "median KL", "in zone", "min β", "max β"]
    return format_table(rows, headers)


def plot_runs(runs: Mapping[str, KLRun], target_kl: float = 6.0, *, clamps: bool = True) -> Figure:
    """Two panels sharing the step axis: measured KL (stable zone shaded), β on a log scale.

    Args:
        runs: label -> run, all of the same phases.
        target_kl: the target; the zone ``[target/1.5, 1.5*target]`` is shaded.
        clamps: draw the doubling rule's clamps [0.001, 10] on the β panel.

    Example:
        >>> run = simulate_run(DoublingKLController(), [Phase("near", 4, 1.0)])
        >>> [ax.get_yscale() for ax in plot_runs({"adaptive": run}).axes]
        ['log', 'log']
    """
    from matplotlib.figure import Figure

    fig = Figure(figsize=(FIGURE_WIDTH, 5.4), dpi=FIGURE_DPI, layout="constrained")
    kl_ax, beta_ax = fig.subplots(2, 1, sharex=True)
    kl_ax.axhspan(
        target_kl / 1.5, 1.5 * target_kl, color="tab:green", alpha=0.15, label="stable zone"
    )
    kl_ax.axhline(target_kl, color="tab:green", lw=1)
    for label, run in runs.items():
        kl_ax.plot(run.kl, lw=1.2, label=label)
        beta_ax.plot(run.kl_coef, lw=1.2, label=label)
    if clamps:
        for bound in (DoublingKLController.MIN_COEF, DoublingKLController.MAX_COEF):
            beta_ax.axhline(bound, color="grey", ls="--", lw=1)
    first = next(iter(runs.values()), KLRun())
    boundaries = [i for i in range(1, len(first.phase)) if first.phase[i] != first.phase[i - 1]]
    for ax in (kl_ax, beta_ax):
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
        for x in boundaries:
            ax.axvline(x, color="black", ls=":", lw=1)
    starts = [0, *boundaries]
    for s in starts:
        kl_ax.annotate(
            first.phase[s], (s + 2, 1.0), xycoords=("data", "axes fraction"), va="top", fontsize=10
        )
    kl_ax.set_ylabel("measured KL (nats)")
    beta_ax.set_ylabel("β (KL coefficient)")
    beta_ax.set_xlabel("step")
    kl_ax.legend(loc="lower left", fontsize=9, framealpha=0.9)
    return fig
