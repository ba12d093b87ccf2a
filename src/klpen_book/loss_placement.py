"""Chapter 7's experiments: which gradient each estimator gives, and where training goes with it.

Three questions, each answered by one function:

* :func:`gradient_table`: how close is each placement × estimator's exact expected gradient
  (:func:`klpen.gradients.expected_estimator_gradients`) to the reverse- and forward-KL
  gradients?
* :func:`monte_carlo_gradient`: do the gradients of the sampled surrogates average to it?
* :func:`placement_study`: where does a bandit policy end up, under the exact expected
  dynamics and under sampled training (:func:`klpen_book.bandit.train_bandit`), relative to the
  two closed-form optima?
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from klpen import full_kl, get_logprobs_for_tokens
from klpen.estimators import ESTIMATORS
from klpen.gradients import (
    PLACEMENTS,
    expected_estimator_gradients,
    expected_penalty_gradient,
    penalty_surrogate,
)

from .bandit import (
    TRAIN_PLACEMENTS,
    BanditRun,
    _check_bandit,
    _check_int,
    forward_kl_optimal_policy,
    optimal_policy,
    single_threaded,
    train_bandit,
)
from .checks import check_choice, check_coef, check_logit_pair, check_positive

__all__ = [
    "GRADIENT_TABLE_HEADERS",
    "MONTE_CARLO_HEADERS",
    "OPTIMA_HEADERS",
    "STUDY_HEADERS",
    "PlacementStudy",
    "expected_flow",
    "gradient_table",
    "monte_carlo_gradient",
    "monte_carlo_table",
    "optima_rows",
    "placement_study",
]

#: Short, so that the table fits the book's column: "rev" is ∇KL(π‖π_ref), "fwd" ∇KL(π_ref‖π).
GRADIENT_TABLE_HEADERS = (
    "placement",
    "estimator",
    "|g|/|rev|",
    "cos(g, rev)",
    "cos(g, fwd)",
    "max|g-rev|",
    "max|g-fwd|",
)

# A gradient this small relative to the reverse-KL gradient is reported as zero: its
# direction is rounding noise and a cosine of it would be meaningless.
_ZERO = 1e-9


def _cosine(a: Tensor, b: Tensor) -> float:
    return float((a * b).sum() / (a.norm() * b.norm()))


def gradient_table(
    policy_logits: Tensor,
    reference_logits: Tensor,
    estimators: Sequence[str] = tuple(ESTIMATORS),
) -> list[list[object]]:
    """One row per placement × estimator comparing its exact expected gradient with the KLs'.

    Columns (:data:`GRADIENT_TABLE_HEADERS`): the norm of the expected penalty gradient ``g``
    relative to that of :math:`\\nabla\\mathrm{KL}(\\pi\\|\\pi_\\mathrm{ref})`; its cosine
    similarity with the reverse- and forward-KL gradients (``"zero"`` when ``g`` vanishes);
    and the largest absolute difference to each. Gradients are flattened over all rows.

    Args:
        policy_logits: ``(..., V)`` finite policy logits (use fp64 for exact digits).
        reference_logits: ``(..., V)`` finite reference logits, same shape.
        estimators: names of :func:`klpen.estimate_kl`.

    Returns:
        Rows for :func:`klpen_book.format_table`.

    Example:
        >>> z = torch.tensor([1.0, 0.0, -1.0], dtype=torch.float64)
        >>> rows = gradient_table(z, torch.zeros(3, dtype=torch.float64), ["k1", "k3"])
        >>> for placement, name, _, cos_rev, *_ in rows:  # cosine with ∇KL(π‖π_ref)
        ...     print(placement, name, cos_rev if cos_rev == "zero" else f"{cos_rev:.3f}")
        loss k1 zero
        loss k3 0.966
        reward k1 1.000
        reward k3 -0.488
    """
    grads = expected_estimator_gradients(policy_logits, reference_logits, estimators)
    rev, fwd = grads.reverse_kl.flatten(), grads.forward_kl.flatten()
    rows: list[list[object]] = []
    for placement, by_name in (("loss", grads.loss), ("reward", grads.reward)):
        for name, g in by_name.items():
            flat = g.flatten()
            ratio = float(flat.norm() / rev.norm())
            zero = ratio < _ZERO
            rows.append(
                [
                    placement,
                    name,
                    ratio,
                    "zero" if zero else _cosine(flat, rev),
                    "zero" if zero else _cosine(flat, fwd),
                    float((flat - rev).abs().max()),
                    float((flat - fwd).abs().max()),
                ]
            )
    return rows


def monte_carlo_gradient(
    policy_logits: Tensor,
    reference_logits: Tensor,
    *,
    estimator: str,
    placement: str,
    samples: int,
    seed: int = 0,
) -> tuple[Tensor, Tensor]:
    """Mean and standard error of the sampled penalty gradient over ``samples`` draws.

    Draws :math:`y_i \\sim \\pi` and differentiates :func:`klpen.gradients.penalty_surrogate`
    of each sample separately, the way a training step does (the draw is not
    differentiated); the mean estimates
    :func:`~klpen.gradients.expected_estimator_gradients` of that placement.

    Args:
        policy_logits: ``(V,)`` finite policy logits.
        reference_logits: ``(V,)`` finite reference logits.
        estimator: a name of :func:`klpen.estimate_kl`.
        placement: ``"loss"`` or ``"reward"``.
        samples: number of draws (>= 2).
        seed: seed of the sampling generator.

    Returns:
        ``(mean, stderr)``, each ``(V,)``, in the compute dtype of the logits.

    Example:
        >>> z = torch.tensor([1.0, 0.0, -1.0], dtype=torch.float64)
        >>> w = torch.zeros(3, dtype=torch.float64)
        >>> mean, se = monte_carlo_gradient(z, w, estimator="k3", placement="loss", samples=4000)
        >>> exact = expected_estimator_gradients(z, w, ["k3"]).loss["k3"]
        >>> bool(((mean - exact).abs() <= 4 * se).all())  # within 4 standard errors
        True
    """
    z, w = check_logit_pair("policy_logits", policy_logits, "reference_logits", reference_logits)
    if z.dim() != 1:
        raise ValueError(f"policy_logits must have shape (V,), got {tuple(z.shape)}")
    check_choice("estimator", estimator, list(ESTIMATORS))
    check_choice("placement", placement, PLACEMENTS)
    n = _check_int("samples", samples, 2)
    gen = torch.Generator(device=z.device).manual_seed(_check_int("seed", seed, 0))
    vocab = z.shape[0]
    probs = torch.softmax(z.detach(), dim=-1)
    y = torch.multinomial(probs, n, replacement=True, generator=gen)
    # One copy of the logits per sample, so that one backward yields every per-sample gradient.
    rows = z.detach().expand(n, vocab).clone().requires_grad_(True)
    logp = get_logprobs_for_tokens(rows, y)
    logq = get_logprobs_for_tokens(w.detach().expand(n, vocab), y)
    (per_sample,) = torch.autograd.grad(
        penalty_surrogate(logp, logq, estimator, placement).sum(), rows
    )
    return per_sample.mean(0), per_sample.std(0) / n**0.5


MONTE_CARLO_HEADERS = ("placement", "estimator", "max|mean-exact|", "max SE", "max |z|")


def monte_carlo_table(
    policy_logits: Tensor,
    reference_logits: Tensor,
    configs: Sequence[tuple[str, str]],
    *,
    samples: int,
    seed: int = 0,
) -> list[list[object]]:
    """Sampled-gradient means against the exact expectations, one row per configuration.

    For each ``(placement, estimator)``: :func:`monte_carlo_gradient` with ``samples`` draws
    (seed ``seed``), compared with :func:`~klpen.gradients.expected_penalty_gradient`. Columns
    (:data:`MONTE_CARLO_HEADERS`): the largest deviation over the vocabulary, the largest
    standard error, and the largest deviation in standard errors (``|z|``; below about 3
    for an unbiased mean).

    Args:
        policy_logits: ``(V,)`` finite policy logits.
        reference_logits: ``(V,)`` finite reference logits.
        configs: ``(placement, estimator)`` pairs, placement ``"loss"`` or ``"reward"``.
        samples: draws per configuration (>= 2).
        seed: seed of the sampling generator.

    Returns:
        Rows for :func:`klpen_book.format_table`.

    Example:
        >>> z = torch.tensor([1.0, 0.0, -1.0], dtype=torch.float64)
        >>> rows = monte_carlo_table(z, torch.zeros(3, dtype=torch.float64), [("loss", "k3")],
        ...                          samples=4000)
        >>> rows[0][:2], rows[0][4] < 4
        (['loss', 'k3'], True)
    """
    rows: list[list[object]] = []
    for placement, estimator in _check_configs(configs):
        mean, se = monte_carlo_gradient(
            policy_logits,
            reference_logits,
            estimator=estimator,
            placement=placement,
            samples=samples,
            seed=seed,
        )
        exact = expected_penalty_gradient(policy_logits, reference_logits, estimator, placement)
        gap = (mean - exact).abs()
        rows.append(
            [placement, estimator, float(gap.max()), float(se.max()), float((gap / se).max())]
        )
    return rows


def _check_configs(configs: object) -> list[tuple[str, str]]:
    if isinstance(configs, str) or not isinstance(configs, Sequence) or not configs:
        raise ValueError(f"configs must be a non-empty sequence of pairs, got {configs!r}")
    for config in configs:
        if not isinstance(config, tuple) or len(config) != 2:
            raise TypeError(f"configs must hold (placement, estimator) pairs, got {config!r}")
    return list(configs)


OPTIMA_HEADERS = ("y", "π_ref(y)", "s(y)", "π*(y)", "π_fwd(y)")


def optima_rows(reference_logits: Tensor, reward: Tensor, kl_coef: float) -> list[list[object]]:
    """The bandit and its two optima, one row per response (:data:`OPTIMA_HEADERS`).

    Example:
        >>> rows = optima_rows(torch.zeros(2), torch.tensor([1.0, 0.0]), 1.0)
        >>> [round(x, 4) for x in rows[0][1:]]
        [0.5, 1.0, 0.7311, 0.7071]
    """
    star = optimal_policy(reference_logits, reward, kl_coef).double()
    fwd = forward_kl_optimal_policy(reference_logits, reward, kl_coef).double()
    ref = torch.softmax(reference_logits.detach().double(), dim=-1)
    columns = (ref, reward.detach().double(), star, fwd)
    return [[y, *(float(c[y]) for c in columns)] for y in range(ref.shape[0])]


# How far (in nats) below the largest logit the flow lets a logit fall.
_FLOOR = 500.0


def expected_flow(
    reference_logits: Tensor,
    reward: Tensor,
    *,
    kl_coef: float,
    placement: str,
    estimator: str = "k1",
    steps: int = 1000,
    lr: float = 2.0,
) -> Tensor:
    """Final probabilities of the bandit policy trained on the *exact* expected gradients.

    The noise-free counterpart of :func:`klpen_book.bandit.train_bandit`: from the reference,
    plain gradient descent on the logits along :math:`-\\nabla\\mathbb{E}_\\pi[r] + \\beta g`,
    with ``g`` the expected penalty gradient of ``placement`` and ``estimator``
    (:func:`~klpen.gradients.expected_penalty_gradient`; ``g = 0`` for ``"none"``). Where
    it stops is the fixed point the sampled training fluctuates around. Plain descent, not
    Adam: Adam's per-coordinate scaling keeps the fixed points of a field that has them but
    distorts the path of one that has none (k3 in the reward, chapter 7).

    Args:
        reference_logits: ``(V,)`` finite reference logits (the initial policy).
        reward: ``(V,)`` finite reward.
        kl_coef: finite, non-negative coefficient.
        placement: ``"reward"``, ``"loss"`` or ``"none"``.
        estimator: a name of :func:`klpen.estimate_kl`.
        steps: number of descent steps (>= 1).
        lr: step size, finite and positive.

    Returns:
        ``(V,)`` probabilities in fp64.

    Example:
        >>> w, r = torch.zeros(3), torch.tensor([1.0, 0.0, 0.0])
        >>> expected_flow(w, r, kl_coef=1.0, placement="reward", estimator="k1").round(decimals=4)
        tensor([0.5761, 0.2119, 0.2119], dtype=torch.float64)
    """
    w, r = _check_bandit(reference_logits, reward)
    b = check_coef("kl_coef", kl_coef)
    where = check_choice("placement", placement, TRAIN_PLACEMENTS)
    name = check_choice("estimator", estimator, list(ESTIMATORS))
    n_steps = _check_int("steps", steps, 1)
    rate = check_positive("lr", lr)
    ref, r = w.detach().double(), r.detach().double()
    logits = ref.clone()
    with single_threaded():
        for _ in range(n_steps):
            p = torch.softmax(logits, dim=-1)
            # ∇_z E_π[r] = π ⊙ (r - E_π[r]), the softmax policy gradient, in closed form: it saves
            # a backward pass per step.
            grad = p * (p @ r - r)
            if where != "none":
                grad = grad + b * expected_penalty_gradient(logits, ref, name, where)
            logits = logits - rate * grad
            # Where a placement drives a probability to 0 (k3 in the reward does), keep it at
            # e^-_FLOOR of the largest: gone for every purpose, but log π and k stay finite.
            logits = logits.clamp(min=float(logits.max()) - _FLOOR)
    return torch.softmax(logits, dim=-1)


STUDY_HEADERS = (
    "placement",
    "estimator",
    "TV(flow,π*)",
    "TV(flow,π_fwd)",
    "TV(run,π*)",
    "TV(run,π_fwd)",
    "KL(run‖ref)",
    "E_run[s]",
)


@dataclass(frozen=True)
class PlacementStudy:
    """Result of :func:`placement_study`.

    Attributes:
        rows: one row per configuration, columns :data:`STUDY_HEADERS` (total-variation
            distances of the expected-flow limit and of the sampled run's final policy to
            π* and π_fwd, the final exact reverse KL and expected reward).
        runs: ``"placement/estimator"`` -> the sampled :class:`~klpen_book.bandit.BanditRun`.
        optimum: ``(V,)`` π*, the maximiser of the reverse-KL objective.
        forward_optimum: ``(V,)`` π_fwd, the maximiser of the forward-KL objective.
    """

    rows: list[list[object]]
    runs: dict[str, BanditRun]
    optimum: Tensor
    forward_optimum: Tensor


def _tv(p: Tensor, q: Tensor) -> float:
    return 0.5 * float((p - q).abs().sum())


def placement_study(
    reference_logits: Tensor,
    reward: Tensor,
    *,
    kl_coef: float,
    configs: Sequence[tuple[str, str]],
    steps: int = 300,
    batch_size: int = 64,
    lr: float = 0.1,
    seed: int = 0,
    flow_steps: int = 1000,
) -> PlacementStudy:
    """Train the bandit under each ``(placement, estimator)`` and compare with both optima.

    Each configuration is run twice: on the exact expected gradients
    (:func:`expected_flow` with ``flow_steps`` steps) and with sampled
    batches (:func:`~klpen_book.bandit.train_bandit` with ``steps``, ``batch_size``, ``lr``,
    ``seed``). Both are compared with :func:`~klpen_book.bandit.optimal_policy` and
    :func:`~klpen_book.bandit.forward_kl_optimal_policy` in total variation.

    Args:
        reference_logits: ``(V,)`` finite reference logits.
        reward: ``(V,)`` finite reward.
        kl_coef: finite, positive coefficient.
        configs: ``(placement, estimator)`` pairs, placement in ``"reward"``, ``"loss"``,
            ``"none"``.
        steps, batch_size, lr, seed: passed to :func:`~klpen_book.bandit.train_bandit`.
        flow_steps: steps of :func:`expected_flow`.

    Returns:
        A :class:`PlacementStudy`.

    Example:
        >>> study = placement_study(torch.zeros(3), torch.tensor([1.0, 0.0, 0.0]), kl_coef=1.0,
        ...                         configs=[("reward", "k1")], steps=50, flow_steps=300)
        >>> study.rows[0][:2], round(study.rows[0][2], 4)  # the flow reaches π*
        (['reward', 'k1'], 0.0)
    """
    b = check_positive("kl_coef", kl_coef)
    optimum = optimal_policy(reference_logits, reward, b).double()
    forward_optimum = forward_kl_optimal_policy(reference_logits, reward, b).double()
    pairs = _check_configs(configs)
    rows: list[list[object]] = []
    runs: dict[str, BanditRun] = {}
    r = reward.detach().double()
    for placement, estimator in pairs:
        flow = expected_flow(
            reference_logits,
            reward,
            kl_coef=b,
            placement=placement,
            estimator=estimator,
            steps=flow_steps,
        )
        run = train_bandit(
            reference_logits,
            reward,
            kl_coef=b,
            placement=placement,
            estimator=estimator,
            steps=steps,
            batch_size=batch_size,
            lr=lr,
            seed=seed,
        )
        runs[f"{placement}/{estimator}"] = run
        trained = run.probs
        kl = float(full_kl(run.policy_logits, reference_logits.detach().double()))
        rows.append(
            [
                placement,
                estimator,
                _tv(flow, optimum),
                _tv(flow, forward_optimum),
                _tv(trained, optimum),
                _tv(trained, forward_optimum),
                kl,
                float(trained @ r),
            ]
        )
    return PlacementStudy(rows=rows, runs=runs, optimum=optimum, forward_optimum=forward_optimum)


def _bandit_field(
    logits: Tensor, reference_logits: Tensor, reward: Tensor, kl_coef: float
) -> Tensor:
    """Ascent direction of the reward-placed k3 bandit: ∇E_π[r] - β g_reward[k3] (fp64)."""
    p = torch.softmax(logits, dim=-1)
    penalty = expected_penalty_gradient(logits, reference_logits, "k3", "reward")
    return p * (reward - p @ reward) - kl_coef * penalty


def _solve_k3_branch(c: Tensor, upper: bool) -> Tensor:
    """``v = log u`` with ``e^{-v} + v = c`` (``c >= 1``) on the branch ``v >= 0`` or ``v <= 0``."""
    lo = torch.zeros_like(c) if upper else -(c + 1)
    hi = c.clone() if upper else torch.zeros_like(c)
    for _ in range(80):
        mid = 0.5 * (lo + hi)
        f = torch.exp(-mid) + mid - c
        # f increases with v on the upper branch and decreases on the lower one.
        go_up = (f < 0) if upper else (f > 0)
        lo = torch.where(go_up, mid, lo)
        hi = torch.where(go_up, hi, mid)
    return 0.5 * (lo + hi)


STATIONARY_HEADERS = ("point", "π", "max|field|", "largest Re(eigenvalue)", "stable")


def k3_reward_stationary_points(
    reference_logits: Tensor, reward: Tensor, *, kl_coef: float
) -> list[list[object]]:
    r"""Every interior stationary point of the expected-gradient field of k3 in the reward.

    With the penalty placed in the reward, the bandit's expected ascent direction on the
    logits is :math:`\pi_y (A_y - \mathbb{E}_\pi A)` with
    :math:`A_y = r(y) - \beta\,k_3(y)`, :math:`k_3 = 1/u + \log u - 1`,
    :math:`u = \pi(y)/\pi_\mathrm{ref}(y)`. An interior point (every :math:`\pi_y > 0`) is
    stationary exactly when :math:`A_y` is one constant :math:`\lambda` for all :math:`y`,
    i.e. :math:`1/u_y + \log u_y = (r(y) - \lambda)/\beta + 1`: for each :math:`y` one root
    with :math:`u_y < 1` and one with :math:`u_y > 1`. For each of the :math:`2^V` branch
    choices, :math:`\lambda` is found where :math:`\sum_y \pi_\mathrm{ref}(y)\,u_y = 1` (scan,
    then bisection). Each point is then checked with :mod:`klpen.gradients`: the field
    (:func:`~klpen.gradients.expected_penalty_gradient`) must vanish there, and the
    eigenvalues of its Jacobian (central differences, on the logits relative to the last
    one) say whether gradient ascent is attracted (all real parts < 0) or repelled.

    Args:
        reference_logits: ``(V,)`` finite reference logits, ``V <= 12``.
        reward: ``(V,)`` finite reward.
        kl_coef: finite, positive coefficient.

    Returns:
        One row per point (``STATIONARY_HEADERS``), ordered by the probability of response 0.

    Example:
        >>> rows = k3_reward_stationary_points(
        ...     torch.zeros(2), torch.tensor([0.0, 0.1]), kl_coef=1.0
        ... )
        >>> len(rows), rows[0][-1]
        (1, 'no')
    """
    w, r = _check_bandit(reference_logits, reward)
    b = check_positive("kl_coef", kl_coef)
    if w.shape[-1] > 12:
        raise ValueError(f"reference_logits must have at most 12 entries, got {w.shape[-1]}")
    ref = torch.softmax(w.detach().double(), dim=-1)
    r = r.detach().double()
    size = ref.shape[0]
    # λ = min r - β x, x ≥ 0: every right-hand side c_y = (r_y - λ)/β + 1 is then ≥ 1.
    xs = torch.cat(
        [torch.zeros(1, dtype=torch.float64), torch.logspace(-9, 2, 3000, dtype=torch.float64)]
    )

    def branches(x: Tensor) -> tuple[Tensor, Tensor]:
        c = (r - r.min()) / b + x.unsqueeze(-1) + 1
        return _solve_k3_branch(c, upper=False), _solve_k3_branch(c, upper=True)

    low, high = branches(xs)
    points: list[Tensor] = []
    for pattern in range(2**size):
        up = torch.tensor([(pattern >> y) & 1 == 1 for y in range(size)])
        h = (ref * torch.where(up, high, low).clamp(max=700).exp()).sum(-1) - 1
        for i in torch.nonzero(torch.sign(h[:-1]) != torch.sign(h[1:])).flatten().tolist():
            lo, hi = xs[i].clone(), xs[i + 1].clone()
            h_lo = float(h[i])
            for _ in range(80):
                mid = 0.5 * (lo + hi)
                lw, hg = branches(mid.reshape(1))
                h_mid = float((ref * torch.where(up, hg[0], lw[0]).exp()).sum() - 1)
                if (h_mid < 0) == (h_lo < 0):
                    lo, h_lo = mid, h_mid
                else:
                    hi = mid
            lw, hg = branches(lo.reshape(1))
            probs = ref * torch.where(up, hg[0], lw[0]).exp()
            probs = probs / probs.sum()
            if all(float((probs - q).abs().max()) > 1e-7 for q in points):
                points.append(probs)
    rows: list[list[object]] = []
    logw = torch.log(ref)
    for probs in sorted(points, key=lambda q: float(q[0])):
        z = torch.log(probs)
        field = _bandit_field(z, logw, r, b)
        jac = torch.empty(size - 1, size - 1, dtype=torch.float64)
        step = 1e-6
        for j in range(size - 1):
            e = torch.zeros(size, dtype=torch.float64)
            e[j] = step
            plus, minus = _bandit_field(z + e, logw, r, b), _bandit_field(z - e, logw, r, b)
            # Dynamics of the logits relative to the last one (a shift of all logits is no move).
            diff = (plus - minus) / (2 * step)
            jac[:, j] = diff[:-1] - diff[-1]
        top = float(torch.linalg.eigvals(jac).real.max())
        shown = "[" + ", ".join(f"{float(q):.3f}" for q in probs) + "]"
        rows.append(
            [
                len(rows) + 1,
                shown,
                "< 1e-12" if float(field.abs().max()) < 1e-12 else "NO",
                f"{top:.3f}",
                "yes" if top < 0 else "no",
            ]
        )
    return rows


TWO_TOKEN_HEADERS = ("penalty", "max|g - ∇KL|, step-1 logits", "max|g - ∇KL|, step-2 logits")

#: The per-position penalties compared by :func:`two_token_gradient_rows`: label -> (estimator,
#: placement); ``"full"`` is chapter 3's exact KL per position, used as a loss.
TWO_TOKEN_PENALTIES = {
    "k1 in the reward, reward-to-go": ("k1", "reward"),
    "k2 in the loss": ("k2", "loss"),
    "k3+ in the loss": ("k3+", "loss"),
    "exact full KL per position in the loss": ("full", "loss"),
    "k3 in the loss": ("k3", "loss"),
}


def two_token_gradient_rows(
    policy_first: Tensor,
    policy_second: Tensor,
    reference_first: Tensor,
    reference_second: Tensor,
) -> list[list[object]]:
    r"""Exact expected penalty gradients of per-position penalties on two-token sequences.

    A sequence is :math:`y_1 \sim \pi_1 = \mathrm{softmax}(z_1)`, then
    :math:`y_2 \sim \pi_2(\cdot \mid y_1) = \mathrm{softmax}(z_2[y_1])`, and likewise for the
    reference. The divergence the objective contains is the sequence KL

    .. math::

        \mathrm{KL}_\mathrm{seq} = \mathrm{KL}(\pi_1 \| \pi_{\mathrm{ref},1})
            + \mathbb{E}_{y_1 \sim \pi_1}\,\mathrm{KL}\big(\pi_2(\cdot\mid y_1) \,\|\,
              \pi_{\mathrm{ref},2}(\cdot\mid y_1)\big),

    whose gradient on :math:`z_1` has a *future-KL* term,
    :math:`\mathbb{E}_{\pi_1}[\mathrm{KL}_2(y_1)\,\nabla\log\pi_1(y_1)]`. Each penalty's expected
    gradient is computed by enumerating all :math:`V^2` sequences with the weights
    :math:`\pi_1(y_1)\pi_2(y_2\mid y_1)` held constant: a loss penalty sums its per-position
    :func:`~klpen.gradients.penalty_surrogate`; k1 in the reward credits each position with the
    penalties of itself and the later position (reward-to-go); ``"full"`` adds
    :func:`klpen.full_kl` at each position of the sampled prefix. Each row gives the largest
    difference to :math:`\nabla\mathrm{KL}_\mathrm{seq}` (autograd of the enumerated sum) on the
    step-1 and the step-2 logits.

    Args:
        policy_first: ``(V,)`` finite step-1 policy logits.
        policy_second: ``(V, V)`` finite step-2 policy logits, row ``y_1`` for prefix ``y_1``.
        reference_first: ``(V,)`` finite step-1 reference logits.
        reference_second: ``(V, V)`` finite step-2 reference logits.

    Returns:
        One row per entry of ``TWO_TOKEN_PENALTIES`` (``TWO_TOKEN_HEADERS``), in fp64.

    Example:
        >>> z1, z2 = torch.tensor([0.5, 0.0]), torch.tensor([[1.0, 0.0], [0.0, 0.0]])
        >>> rows = two_token_gradient_rows(z1, z2, torch.zeros(2), torch.zeros(2, 2))
        >>> rows[0][1:], rows[1][1:] != [0.0, 0.0]
        ([0.0, 0.0], True)
    """
    z1, w1 = check_logit_pair("policy_first", policy_first, "reference_first", reference_first)
    z2, w2 = check_logit_pair("policy_second", policy_second, "reference_second", reference_second)
    size = z1.shape[-1]
    if z1.dim() != 1:
        raise ValueError(f"policy_first must be 1-D (V,), got shape {tuple(z1.shape)}")
    if tuple(z2.shape) != (size, size):
        raise ValueError(
            f"policy_second must have shape {(size, size)} (one row per first token), "
            f"got {tuple(z2.shape)}"
        )
    z1 = z1.detach().double().requires_grad_(True)
    z2 = z2.detach().double().requires_grad_(True)
    w1, w2 = w1.detach().double(), w2.detach().double()
    lp1, lp2 = torch.log_softmax(z1, -1), torch.log_softmax(z2, -1)
    lq1, lq2 = torch.log_softmax(w1, -1), torch.log_softmax(w2, -1)
    # All V² sequences: position 1 varies along rows, position 2 along columns.
    a1, b1 = lp1.unsqueeze(1).expand(size, size), lq1.unsqueeze(1).expand(size, size)
    weights = (lp1.unsqueeze(1) + lp2).detach().exp()

    def grads(objective: Tensor) -> tuple[Tensor, Tensor]:
        g1, g2 = torch.autograd.grad(objective, (z1, z2), retain_graph=True)
        return g1, g2

    exact = grads(full_kl(z1, w1) + (lp1.exp() * full_kl(z2, w2)).sum())
    rows: list[list[object]] = []
    for label, (name, where) in TWO_TOKEN_PENALTIES.items():
        if name == "full":
            objective = full_kl(z1, w1) + (lp1.detach().exp() * full_kl(z2, w2)).sum()
        elif where == "loss":
            per_position = penalty_surrogate(a1, b1, name) + penalty_surrogate(lp2, lq2, name)
            objective = (weights * per_position).sum()
        else:
            from klpen import estimate_kl

            k1, k2 = estimate_kl(a1, b1, name).detach(), estimate_kl(lp2, lq2, name).detach()
            objective = (weights * ((k1 + k2) * a1 + k2 * lp2)).sum()
        g = grads(objective)
        rows.append(
            [
                label,
                *(round(float((gi - ei).abs().max()), 6) for gi, ei in zip(g, exact, strict=True)),
            ]
        )
    return rows
