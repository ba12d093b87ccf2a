r"""What gradient a sampled KL estimator really gives, inside the loss or inside the reward.

Chapter 7 of the book. A sampled estimator :math:`k(y)` of
:math:`\mathrm{KL}(\pi \| \pi_\mathrm{ref})` is an unbiased *value* (k1, k3) on samples
:math:`y \sim \pi`, but a training step differentiates it, and the sampling distribution
itself is never differentiated. Two placements of the penalty are in use:

* **in the loss** (GRPO-style): :math:`\beta\, k(y)` is added to the loss and backpropagated;
  its expected gradient is :math:`\mathbb{E}_{y \sim \pi}[\nabla_\theta k(y)]`;
* **in the reward** (PPO-style): :math:`-\beta\, k(y)` is added to the (detached) reward and
  reaches the policy through the score function; its expected gradient is
  :math:`\mathbb{E}_{y \sim \pi}[k(y)\, \nabla_\theta \log \pi(y)]`.

With :math:`r = \log \pi(y) - \log \pi_\mathrm{ref}(y)`, :math:`\nabla r = \nabla \log \pi(y)`
and :math:`\mathbb{E}_\pi[\nabla \log \pi] = 0`, the loss placement gives

.. math::

    \begin{aligned}
    \mathbb{E}_\pi[\nabla k_1] &= 0, \\
    \mathbb{E}_\pi[\nabla k_2] &= \mathbb{E}_\pi[r\, \nabla \log \pi] \\
        &= \nabla \mathrm{KL}(\pi \| \pi_\mathrm{ref}), \\
    \mathbb{E}_\pi[\nabla k_3] &= \mathbb{E}_\pi[(1 - e^{-r})\, \nabla \log \pi] \\
        &= \nabla \mathrm{KL}(\pi_\mathrm{ref} \| \pi),
    \end{aligned}

and the reward placement with k1 gives :math:`\nabla \mathrm{KL}(\pi \| \pi_\mathrm{ref})`. This
module computes all of them exactly, for a categorical policy over an enumerable vocabulary, by
summing over every :math:`y` with the weights :math:`\pi(y)` held constant.

**Off-policy** (chapter 8): when the tokens come from a behavior distribution :math:`\mu \ne \pi`
(a stale policy, an inference engine, a temperature or top-p sampler), the expectation is under
:math:`\mu` and the surrogate can be weighted by :math:`\rho = \pi/\mu` in three ways
(:data:`WEIGHTINGS`): ``"none"``, ``"detached"`` (:math:`\operatorname{sg}[\rho]`, TIS-style)
or ``"differentiated"`` (:math:`\rho` carries a gradient, as a PPO ratio does). In the loss,

.. math::

    \begin{aligned}
    \mathbb{E}_\mu[\nabla k] &= \sum_y \mu\, k'(r)\, \nabla \log \pi, \\
    \mathbb{E}_\mu[\operatorname{sg}[\rho] \nabla k] &= \mathbb{E}_\pi[\nabla k], \\
    \mathbb{E}_\mu[\nabla (\rho k)] &= \nabla\, \mathbb{E}_\pi[k],
    \end{aligned}

so only the differentiated weight gives k1 and k3 the gradient of
:math:`\mathrm{KL}(\pi \| \pi_\mathrm{ref})`; unweighted, even k1 pulls π towards μ
(:math:`\mathbb{E}_\mu[\nabla k_1] = \mu - \pi`). :func:`expected_offpolicy_gradients`
computes the whole table exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ._validation import check_choice, check_floating, check_same_device, check_shape
from .estimators import ESTIMATORS, estimate_kl
from .full_kl import full_kl
from .kernels.blocks import compute_dtype

__all__ = [
    "PLACEMENTS",
    "WEIGHTINGS",
    "EstimatorGradients",
    "OffPolicyGradients",
    "expected_estimator_gradients",
    "expected_offpolicy_gradients",
    "expected_penalty_gradient",
    "penalty_surrogate",
]

#: Where the sampled penalty enters the update: ``"loss"`` (differentiated directly) or
#: ``"reward"`` (detached, through the score function).
PLACEMENTS = ("loss", "reward")
#: How a sample drawn from a behavior distribution μ is weighted: not at all, by a detached
#: π/μ, or by a π/μ that is differentiated.
WEIGHTINGS = ("none", "detached", "differentiated")


def check_logit_pair(
    policy_name: str, policy_logits: object, reference_name: str, reference_logits: object
) -> tuple[Tensor, Tensor]:
    """Require two finite floating ``(..., V)`` logit tensors of one shape, device and ``V >= 1``.

    Shared by the functions of this module: the exact sums over the vocabulary
    here have no meaning for ``-inf`` or NaN logits (``0 * inf`` terms).
    """
    z = check_floating(policy_name, policy_logits, min_ndim=1)
    w = check_floating(reference_name, reference_logits, min_ndim=1)
    check_shape(reference_name, w, z.shape, f"the shape of {policy_name}")
    check_same_device(reference_name, w, policy_name, z)
    if z.shape[-1] == 0:
        raise ValueError(
            f"{policy_name} must have a non-empty last (vocabulary) axis, got {tuple(z.shape)}"
        )
    for name, x in ((policy_name, z), (reference_name, w)):
        if not bool(torch.isfinite(x).all()):
            bad = x[~torch.isfinite(x)].flatten()[0].item()
            raise ValueError(f"{name} must be finite, got a value {bad}")
    return z, w


def penalty_surrogate(
    policy_logprobs: Tensor,
    reference_logprobs: Tensor,
    estimator: str = "k1",
    placement: str = "loss",
    *,
    behavior_logprobs: Tensor | None = None,
    weighting: str = "none",
) -> Tensor:
    r"""Per-sample surrogate whose gradient is what the penalty contributes to one update.

    For a sample :math:`y \sim \pi` with log-probs :math:`\log \pi(y)` and
    :math:`\log \pi_\mathrm{ref}(y)`:

    .. math::

        \begin{aligned}
        s_\mathrm{loss}(y) &= k(y), \\
        s_\mathrm{reward}(y) &= \operatorname{sg}[k(y)]\, \log \pi(y),
        \end{aligned}

    where :math:`\operatorname{sg}` stops the gradient. Averaged over on-policy samples,
    :math:`\nabla s` estimates the penalty gradient of that placement (to be scaled by β and
    *added* to a loss that is minimised). The value of :math:`s_\mathrm{reward}` is not a
    divergence, only its gradient is meaningful; a baseline, which a trainer would subtract
    from the shaped reward, leaves its expectation unchanged and is omitted here.

    Off-policy, for a sample :math:`y \sim \mu` with :math:`\rho = \pi(y)/\mu(y)`:
    ``weighting="detached"`` multiplies either surrogate by :math:`\operatorname{sg}[\rho]`;
    ``weighting="differentiated"`` gives :math:`\rho\, k(y)` in the loss and
    :math:`\rho\, \operatorname{sg}[k(y)]` in the reward (the PPO ratio carries the score
    function there, so :math:`\log \pi` is not multiplied in); ``"none"`` ignores μ.

    Args:
        policy_logprobs: ``(...)`` log π of the sampled tokens (differentiable).
        reference_logprobs: ``(...)`` log π_ref of the same tokens, same shape.
        estimator: a name of :func:`klpen.estimate_kl` (``"k1"``, ``"k2"``, ``"k3"``,
            ``"abs"``, ``"k1+"``, ``"k3+"``).
        placement: ``"loss"`` or ``"reward"``.
        behavior_logprobs: ``(...)`` log μ of the same tokens (never differentiated); needed
            by the two weightings other than ``"none"``.
        weighting: ``"none"``, ``"detached"`` or ``"differentiated"`` (:data:`WEIGHTINGS`).

    Returns:
        ``(...)`` tensor in the promoted dtype of the inputs.

    Example:
        >>> lp = torch.tensor([-1.0, -2.0], requires_grad=True)
        >>> lr = torch.tensor([-1.5, -1.0])
        >>> penalty_surrogate(lp, lr, "k1", "reward").sum().backward()
        >>> lp.grad  # the k1 value 0.5 and -1.0 scales the score of each sample
        tensor([ 0.5000, -1.0000])
    """
    where = check_choice("placement", placement, PLACEMENTS)
    how = check_choice("weighting", weighting, WEIGHTINGS)
    k = estimate_kl(policy_logprobs, reference_logprobs, estimator)
    if how == "none":
        return k if where == "loss" else k.detach() * policy_logprobs
    if behavior_logprobs is None:
        raise ValueError(f"weighting={how!r} needs behavior_logprobs, got None")
    mu = check_floating("behavior_logprobs", behavior_logprobs).detach()
    if where == "loss" and how == "differentiated":
        # estimate_kl's own importance weighting: the weight π/μ is not detached.
        return estimate_kl(policy_logprobs, reference_logprobs, estimator, behavior_logprobs=mu)
    check_shape("behavior_logprobs", mu, policy_logprobs.shape, "the shape of policy_logprobs")
    check_same_device("behavior_logprobs", mu, "policy_logprobs", policy_logprobs)
    ratio = torch.exp(policy_logprobs - mu)
    if how == "detached":
        return ratio.detach() * (k if where == "loss" else k.detach() * policy_logprobs)
    return ratio * k.detach()  # the reward placement: the ratio carries the score function


@dataclass(frozen=True)
class EstimatorGradients:
    """Exact expected gradients w.r.t. the policy logits, each of shape ``(..., V)``.

    Attributes:
        reverse_kl: :math:`\\nabla \\mathrm{KL}(\\pi \\| \\pi_\\mathrm{ref})`, the divergence
            the RLHF penalty is meant to descend.
        forward_kl: :math:`\\nabla \\mathrm{KL}(\\pi_\\mathrm{ref} \\| \\pi)`.
        loss: per estimator, :math:`\\mathbb{E}_\\pi[\\nabla k(y)]` (penalty in the loss).
        reward: per estimator, :math:`\\mathbb{E}_\\pi[k(y) \\nabla \\log \\pi(y)]` (penalty in
            the reward). ``loss[k] + reward[k]`` is the full gradient of
            :math:`\\mathbb{E}_\\pi[k(y)]`, sampling distribution included.
    """

    reverse_kl: Tensor
    forward_kl: Tensor
    loss: dict[str, Tensor]
    reward: dict[str, Tensor]


def expected_estimator_gradients(
    policy_logits: Tensor,
    reference_logits: Tensor,
    estimators: Sequence[str] = tuple(ESTIMATORS),
    placements: Sequence[str] = PLACEMENTS,
) -> EstimatorGradients:
    r"""Exact on-policy expected gradient of each KL estimator, in the loss and in the reward.

    Enumerates the vocabulary: with :math:`\pi = \mathrm{softmax}(z)` and the weights
    :math:`\pi(y)` held constant (a loss on sampled tokens never differentiates the sampling),

    .. math::

        \begin{aligned}
        g_\mathrm{loss}[k] &= \sum_y \pi(y)\, \nabla_z k(y), \\
        g_\mathrm{reward}[k] &= \sum_y \pi(y)\, k(y) \\
        &\qquad \cdot \nabla_z \log \pi(y),
        \end{aligned}

    computed by autograd through :func:`penalty_surrogate` (hence through
    :func:`klpen.estimate_kl`), next to the exact
    :math:`\nabla_z \mathrm{KL}(\pi\|\pi_\mathrm{ref})` and
    :math:`\nabla_z \mathrm{KL}(\pi_\mathrm{ref}\|\pi)` from :func:`klpen.full_kl`.

    Args:
        policy_logits: ``(..., V)`` finite logits of the policy π (any leading shape; each row
            is an independent categorical).
        reference_logits: ``(..., V)`` finite logits of π_ref, same shape.
        estimators: names accepted by :func:`klpen.estimate_kl`; all of them by default.
        placements: which of ``"loss"`` and ``"reward"`` to compute (both by default); the
            dict of a placement left out is empty.

    Returns:
        An :class:`EstimatorGradients` of ``(..., V)`` tensors in the compute dtype of the
        inputs (fp32 for half precision, else the promoted dtype). Use fp64 for exact
        comparisons.

    Raises:
        TypeError, ValueError: non-tensors, integer dtypes, mismatched shapes or devices,
            non-finite logits, an unknown estimator name; or a probability so small that a
            term overflows (logits spread beyond the dtype's range).

    Example:
        >>> z = torch.tensor([1.0, 0.0, -1.0], dtype=torch.float64)
        >>> w = torch.zeros(3, dtype=torch.float64)
        >>> g = expected_estimator_gradients(z, w, ["k1", "k2", "k3"])
        >>> g.loss["k1"].abs().max().item() < 1e-15  # k1 in the loss: no gradient at all
        True
        >>> torch.allclose(g.loss["k2"], g.reverse_kl), torch.allclose(g.loss["k3"], g.forward_kl)
        (True, True)
        >>> torch.allclose(g.reward["k1"], g.reverse_kl)
        True
    """
    z0, w0 = check_logit_pair("policy_logits", policy_logits, "reference_logits", reference_logits)
    if isinstance(estimators, str):
        raise TypeError(f"estimators must be a sequence of names, got the string {estimators!r}")
    names = [check_choice("estimators", name, list(ESTIMATORS)) for name in estimators]
    if isinstance(placements, str):
        raise TypeError(f"placements must be a sequence of names, got the string {placements!r}")
    wanted = {check_choice("placements", where, PLACEMENTS) for where in placements}
    pairs = [(where, name) for where in PLACEMENTS if where in wanted for name in names]
    grads = _enumerated_gradients(z0, w0, pairs, with_kl=True)
    return EstimatorGradients(
        reverse_kl=grads["reverse_kl"],
        forward_kl=grads["forward_kl"],
        loss={name: grads[f"loss/{name}"] for where, name in pairs if where == "loss"},
        reward={name: grads[f"reward/{name}"] for where, name in pairs if where == "reward"},
    )


def expected_penalty_gradient(
    policy_logits: Tensor,
    reference_logits: Tensor,
    estimator: str = "k1",
    placement: str = "loss",
    *,
    behavior_logits: Tensor | None = None,
    weighting: str = "none",
) -> Tensor:
    r"""Exact on-policy expected gradient of one estimator in one placement.

    The single entry ``expected_estimator_gradients(...).loss[estimator]`` (or ``.reward``),
    computed alone: one backward pass, for loops that need it at every step.

    .. math:: g = \sum_y \pi(y)\, \nabla_z s(y)

    with :math:`s` the :func:`penalty_surrogate` of ``estimator`` and ``placement`` and the
    weights :math:`\pi(y)` held constant.

    With ``behavior_logits``, the samples come from :math:`\mu = \mathrm{softmax}(b)` instead:
    :math:`g = \sum_y \mu(y)\, \nabla_z s(y)` with the ``weighting`` of
    :func:`penalty_surrogate`.

    Args:
        policy_logits: ``(..., V)`` finite policy logits.
        reference_logits: ``(..., V)`` finite reference logits, same shape.
        estimator: a name of :func:`klpen.estimate_kl`.
        placement: ``"loss"`` or ``"reward"``.
        behavior_logits: ``None`` (on-policy) or ``(..., V)`` finite logits of μ, same shape.
        weighting: one of :data:`WEIGHTINGS`; only ``"none"`` without ``behavior_logits``.

    Returns:
        ``(..., V)`` gradient in the compute dtype of the inputs.

    Example:
        >>> z = torch.tensor([1.0, 0.0, -1.0], dtype=torch.float64)
        >>> w = torch.zeros(3, dtype=torch.float64)
        >>> g = expected_penalty_gradient(z, w, "k3", "loss")  # = ∇KL(π_ref‖π) = π - π_ref
        >>> torch.allclose(g, torch.softmax(z, -1) - torch.softmax(w, -1))
        True
    """
    z, w = check_logit_pair("policy_logits", policy_logits, "reference_logits", reference_logits)
    name = check_choice("estimator", estimator, list(ESTIMATORS))
    where = check_choice("placement", placement, PLACEMENTS)
    how = check_choice("weighting", weighting, WEIGHTINGS)
    if behavior_logits is None:
        if how != "none":
            raise ValueError(f"weighting={how!r} needs behavior_logits, got None")
        return _enumerated_gradients(z, w, [(where, name)], with_kl=False)[f"{where}/{name}"]
    _, b = check_logit_pair("policy_logits", z, "behavior_logits", behavior_logits)
    grads = _enumerated_gradients(
        z, w, [(where, name)], with_kl=False, behavior=b, weightings=(how,)
    )
    return grads[f"{where}/{how}/{name}"]


@dataclass(frozen=True)
class OffPolicyGradients:
    r"""Exact expected gradients for samples drawn from μ, each of shape ``(..., V)``.

    Attributes:
        reverse_kl: :math:`\nabla \mathrm{KL}(\pi \| \pi_\mathrm{ref})`.
        forward_kl: :math:`\nabla \mathrm{KL}(\pi_\mathrm{ref} \| \pi)`.
        gradients: ``(placement, weighting, estimator)`` ->
            :math:`\mathbb{E}_{y \sim \mu}[\nabla s(y)]` for the :func:`penalty_surrogate`
            of that placement and weighting.
    """

    reverse_kl: Tensor
    forward_kl: Tensor
    gradients: dict[tuple[str, str, str], Tensor]


def expected_offpolicy_gradients(
    policy_logits: Tensor,
    reference_logits: Tensor,
    behavior_logits: Tensor,
    estimators: Sequence[str] = tuple(ESTIMATORS),
    placements: Sequence[str] = PLACEMENTS,
    weightings: Sequence[str] = WEIGHTINGS,
) -> OffPolicyGradients:
    r"""Exact expected gradient of each estimator × placement × weighting for samples from μ.

    With :math:`\mu = \mathrm{softmax}(b)` held constant and :math:`\rho = \pi/\mu`:

    .. math::

        \begin{aligned}
        &g[\text{place}, \text{weight}, k] \\
        &\quad = \sum_y \mu(y)\, \nabla_z s(y)
        \end{aligned}

    where :math:`s` is the :func:`penalty_surrogate`. In closed form, with
    :math:`J_y = \nabla \log \pi(y)` and :math:`r` the log-ratio to :math:`\pi_\mathrm{ref}`:

    ========= ============================ ======================================
    weighting loss                         reward
    ========= ============================ ======================================
    none      :math:`\sum \mu k'(r) J`     :math:`\sum \mu k(r) J`
    detached  :math:`\sum \pi k'(r) J`     :math:`\sum \pi k(r) J`
    diff.     :math:`\sum \pi (k + k') J`  :math:`\sum \pi k(r) J`
    ========= ============================ ======================================

    so the loss with a differentiated weight gives :math:`\nabla \mathbb{E}_\pi[k]`, which
    is :math:`\nabla \mathrm{KL}(\pi\|\pi_\mathrm{ref})` for the unbiased k1 and k3.

    Args:
        policy_logits: ``(..., V)`` finite logits of π.
        reference_logits: ``(..., V)`` finite logits of π_ref, same shape.
        behavior_logits: ``(..., V)`` finite logits of the sampling distribution μ.
        estimators: names accepted by :func:`klpen.estimate_kl`; all by default.
        placements: a subset of :data:`PLACEMENTS`.
        weightings: a subset of :data:`WEIGHTINGS`.

    Returns:
        An :class:`OffPolicyGradients` in the compute dtype of the inputs (use fp64 for exact
        comparisons).

    Raises:
        TypeError, ValueError: as :func:`expected_estimator_gradients`, for each of the three
            logit tensors and the three name lists.

    Example:
        >>> z = torch.tensor([1.0, 0.0, -1.0], dtype=torch.float64)
        >>> w = torch.zeros(3, dtype=torch.float64)
        >>> b = torch.tensor([0.0, 0.0, 1.0], dtype=torch.float64)
        >>> g = expected_offpolicy_gradients(z, w, b, ["k1", "k3"], ["loss"])
        >>> torch.allclose(g.gradients["loss", "differentiated", "k3"], g.reverse_kl)
        True
        >>> torch.allclose(g.gradients["loss", "detached", "k3"], g.forward_kl)
        True
        >>> torch.allclose(g.gradients["loss", "none", "k1"], b.softmax(-1) - z.softmax(-1))
        True
    """
    z, w = check_logit_pair("policy_logits", policy_logits, "reference_logits", reference_logits)
    _, b = check_logit_pair("policy_logits", z, "behavior_logits", behavior_logits)
    lists = {}
    for label, given, valid in (
        ("estimators", estimators, list(ESTIMATORS)),
        ("placements", placements, PLACEMENTS),
        ("weightings", weightings, WEIGHTINGS),
    ):
        if isinstance(given, str):
            raise TypeError(f"{label} must be a sequence of names, got the string {given!r}")
        lists[label] = [check_choice(label, item, valid) for item in given]
    pairs = [
        (where, name)
        for where in PLACEMENTS
        if where in lists["placements"]
        for name in lists["estimators"]
    ]
    hows = [how for how in WEIGHTINGS if how in lists["weightings"]]
    grads = _enumerated_gradients(z, w, pairs, with_kl=True, behavior=b, weightings=hows)
    return OffPolicyGradients(
        reverse_kl=grads["reverse_kl"],
        forward_kl=grads["forward_kl"],
        gradients={
            (where, how, name): grads[f"{where}/{how}/{name}"]
            for where, name in pairs
            for how in hows
        },
    )


def _enumerated_gradients(
    z0: Tensor,
    w0: Tensor,
    pairs: Sequence[tuple[str, str]],
    *,
    with_kl: bool,
    behavior: Tensor | None = None,
    weightings: Sequence[str] = ("none",),
) -> dict[str, Tensor]:
    """``"placement/estimator"`` (``"placement/weighting/estimator"`` with a ``behavior``; and
    ``"reverse_kl"``, ``"forward_kl"``) -> exact gradient."""
    dtype = compute_dtype(torch.promote_types(z0.dtype, w0.dtype))
    if behavior is not None:
        dtype = compute_dtype(torch.promote_types(dtype, behavior.dtype))
    z = z0.detach().to(dtype).requires_grad_(True)
    w = w0.detach().to(dtype)
    names = "policy_logits and reference_logits"
    if behavior is not None:
        names += " and behavior_logits"

    def grad(objective: Tensor) -> Tensor:
        # Rows are independent categoricals: the gradient of the sum is every row's gradient.
        (g,) = torch.autograd.grad(objective.sum(), z, retain_graph=True)
        if not bool(torch.isfinite(g).all()):
            hint = "" if dtype == torch.float64 else " or float64"
            raise ValueError(
                f"{names} are spread so far that a probability "
                f"underflows in {dtype} and a term overflows; use logits closer together{hint}"
            )
        return g

    logp = torch.log_softmax(z, dim=-1)
    logq = torch.log_softmax(w, dim=-1)
    logmu = None if behavior is None else torch.log_softmax(behavior.detach().to(dtype), dim=-1)
    # The sampling weights π(y) (or μ(y)) are constants: sampling is never differentiated.
    weights = (logp if logmu is None else logmu).detach().exp()
    out = {}
    for where, name in pairs:
        for how in weightings:
            key = f"{where}/{name}" if logmu is None else f"{where}/{how}/{name}"
            surrogate = penalty_surrogate(
                logp, logq, name, where, behavior_logprobs=logmu, weighting=how
            )
            out[key] = grad(weights * surrogate)
    if with_kl:
        out["reverse_kl"] = grad(full_kl(z, w))
        out["forward_kl"] = grad(full_kl(w, z))
    return out
