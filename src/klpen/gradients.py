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

    \mathbb{E}_\pi[\nabla k_1] = 0, \qquad
    \mathbb{E}_\pi[\nabla k_2] = \mathbb{E}_\pi[r\, \nabla \log \pi]
        = \nabla \mathrm{KL}(\pi \| \pi_\mathrm{ref}), \qquad
    \mathbb{E}_\pi[\nabla k_3] = \mathbb{E}_\pi[(1 - e^{-r})\, \nabla \log \pi]
        = \nabla \mathrm{KL}(\pi_\mathrm{ref} \| \pi),

and the reward placement with k1 gives :math:`\nabla \mathrm{KL}(\pi \| \pi_\mathrm{ref})`. This
module computes all of them exactly, for a categorical policy over an enumerable vocabulary, by
summing over every :math:`y` with the weights :math:`\pi(y)` held constant.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ._chunks import compute_dtype
from ._validation import check_choice, check_floating, check_same_device, check_shape
from .estimators import ESTIMATORS, estimate_kl
from .full_kl import full_kl

__all__ = [
    "PLACEMENTS",
    "EstimatorGradients",
    "expected_estimator_gradients",
    "expected_penalty_gradient",
    "penalty_surrogate",
]

#: Where the sampled penalty enters the update: ``"loss"`` (differentiated directly) or
#: ``"reward"`` (detached, through the score function).
PLACEMENTS = ("loss", "reward")


def check_logit_pair(
    policy_name: str, policy_logits: object, reference_name: str, reference_logits: object
) -> tuple[Tensor, Tensor]:
    """Require two finite floating ``(..., V)`` logit tensors of one shape, device and ``V >= 1``.

    Shared by this module and :mod:`klpen.lab.bandit`: the exact sums over the vocabulary
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
) -> Tensor:
    r"""Per-sample surrogate whose gradient is what the penalty contributes to one update.

    For a sample :math:`y \sim \pi` with log-probs :math:`\log \pi(y)` and
    :math:`\log \pi_\mathrm{ref}(y)`:

    .. math::

        s_\mathrm{loss}(y) = k(y), \qquad
        s_\mathrm{reward}(y) = \operatorname{sg}[k(y)]\, \log \pi(y),

    where :math:`\operatorname{sg}` stops the gradient. Averaged over on-policy samples,
    :math:`\nabla s` estimates the penalty gradient of that placement (to be scaled by β and
    *added* to a loss that is minimised). The value of :math:`s_\mathrm{reward}` is not a
    divergence, only its gradient is meaningful; a baseline, which a trainer would subtract
    from the shaped reward, leaves its expectation unchanged and is omitted here.

    Args:
        policy_logprobs: ``(...)`` log π of the sampled tokens (differentiable).
        reference_logprobs: ``(...)`` log π_ref of the same tokens, same shape.
        estimator: a name of :func:`klpen.estimate_kl` (``"k1"``, ``"k2"``, ``"k3"``,
            ``"abs"``, ``"k1+"``, ``"k3+"``).
        placement: ``"loss"`` or ``"reward"``.

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
    k = estimate_kl(policy_logprobs, reference_logprobs, estimator)
    if where == "loss":
        return k
    return k.detach() * policy_logprobs


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

        g_\mathrm{loss}[k] = \sum_y \pi(y)\, \nabla_z k(y), \qquad
        g_\mathrm{reward}[k] = \sum_y \pi(y)\, k(y)\, \nabla_z \log \pi(y),

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
) -> Tensor:
    r"""Exact on-policy expected gradient of one estimator in one placement.

    The single entry ``expected_estimator_gradients(...).loss[estimator]`` (or ``.reward``),
    computed alone: one backward pass, for loops that need it at every step.

    .. math:: g = \sum_y \pi(y)\, \nabla_z s(y)

    with :math:`s` the :func:`penalty_surrogate` of ``estimator`` and ``placement`` and the
    weights :math:`\pi(y)` held constant.

    Args:
        policy_logits: ``(..., V)`` finite policy logits.
        reference_logits: ``(..., V)`` finite reference logits, same shape.
        estimator: a name of :func:`klpen.estimate_kl`.
        placement: ``"loss"`` or ``"reward"``.

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
    return _enumerated_gradients(z, w, [(where, name)], with_kl=False)[f"{where}/{name}"]


def _enumerated_gradients(
    z0: Tensor, w0: Tensor, pairs: Sequence[tuple[str, str]], *, with_kl: bool
) -> dict[str, Tensor]:
    """``"placement/estimator"`` (and ``"reverse_kl"``, ``"forward_kl"``) -> exact gradient."""
    dtype = compute_dtype(torch.promote_types(z0.dtype, w0.dtype))
    z = z0.detach().to(dtype).requires_grad_(True)
    w = w0.detach().to(dtype)

    def grad(objective: Tensor) -> Tensor:
        # Rows are independent categoricals: the gradient of the sum is every row's gradient.
        (g,) = torch.autograd.grad(objective.sum(), z, retain_graph=True)
        if not bool(torch.isfinite(g).all()):
            hint = "" if dtype == torch.float64 else " or float64"
            raise ValueError(
                "policy_logits and reference_logits are spread so far that a probability "
                f"underflows in {dtype} and a term overflows; use logits closer together{hint}"
            )
        return g

    logp = torch.log_softmax(z, dim=-1)
    logq = torch.log_softmax(w, dim=-1)
    # π(y) as constants: the sampling distribution is not differentiated.
    weights = logp.detach().exp()
    out = {
        f"{where}/{name}": grad(weights * penalty_surrogate(logp, logq, name, where))
        for where, name in pairs
    }
    if with_kl:
        out["reverse_kl"] = grad(full_kl(z, w))
        out["forward_kl"] = grad(full_kl(w, z))
    return out
