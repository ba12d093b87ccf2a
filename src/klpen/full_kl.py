"""The exact categorical KL divergence over the vocabulary, block by block.

Chapter 3 of the book. For policy logits ``z`` and reference logits ``w`` at one position,
with ``p = softmax(z)`` and ``q = softmax(w)``:

.. math::

    \\begin{aligned}
    \\mathrm{KL}(p \\,\\|\\, q)
    &= \\sum_v p_v \\big[(z_v - \\mathrm{lse}(z)) \\\\
    &\\qquad - (w_v - \\mathrm{lse}(w))\\big]
    \\end{aligned}

The naive code materialises ``log_softmax`` of both, ``exp`` of one and their product: four or
five ``(B, T, V)`` tensors. Here every row is reduced inside a cache-sized block, and the
backward pass recomputes what it needs from the saved logits and three numbers per row.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ._autograd import owned
from ._ops import KernelOp, expect, expect_ndim, expect_shape, kernel_op
from ._validation import (
    check_coef,
    check_coef_fits,
    check_floating,
    check_no_nan,
    check_no_nan_at,
    check_same_device,
    check_shape,
    inverse_temperature,
    promoted_dtype,
    scaled_penalty,
    validation,
    value_checks_enabled,
)
from .kernels import backend_named, select_backend
from .kernels.blocks import compute_dtype

__all__ = ["full_kl", "kl_penalized_reward"]


def _full_kl_forward(
    policy: Tensor, reference: Tensor, scale: float, backend: str, checks: bool, name: str
) -> tuple[Tensor, list[Tensor]]:
    """``KL(softmax(k z) ‖ softmax(k w))`` per row by the backend's kernels, and what the
    backward operator needs (arguments as :func:`klpen.logprobs._token_logprobs_forward`'s)."""
    with validation(checks):
        kl, saved = backend_named(backend).full_kl_forward(policy, reference, scale)
    kl, *rest = owned((kl, *saved), (policy, reference))
    return kl, rest


def _full_kl_fake(
    policy: Tensor, reference: Tensor, scale: float, backend: str, checks: bool, name: str
) -> tuple[Tensor, list[Tensor]]:
    dtype = compute_dtype(torch.promote_types(policy.dtype, reference.dtype))
    with validation(checks):
        saved = backend_named(backend).full_kl_saved_like(policy, reference)
    return policy.new_empty(policy.shape[:-1], dtype=dtype), list(saved)


def _full_kl_backward_kernel(
    policy: Tensor,
    reference: Tensor,
    saved: list[Tensor],
    grad: Tensor,
    scale: float,
    backend: str,
    checks: bool,
    needs: list[bool],
    name: str,
) -> tuple[Tensor, Tensor]:
    """``(d/dpolicy, d/dreference)`` of ``sum(grad * kl)``; an empty placeholder for a side
    that ``needs`` leaves out."""
    with validation(checks):
        grad_z, grad_w = _kl_gradients(
            backend_named(backend), policy, reference, tuple(saved), grad, scale, needs
        )
    empty = policy.new_empty(0)
    return (
        empty if grad_z is None else grad_z,
        empty.clone() if grad_w is None else grad_w,
    )


def _full_kl_backward_fake(policy: Tensor, reference: Tensor, *args: Any) -> tuple[Tensor, Tensor]:
    needs = args[5]  # after saved, grad, scale, backend, checks
    return (
        policy.new_empty(policy.shape if needs[0] else (0,)),
        reference.new_empty(reference.shape) if needs[1] else policy.new_empty(0),
    )


def _kl_gradients(
    backend: Any,
    policy: Tensor,
    reference: Tensor,
    saved: tuple[Tensor, ...],
    grad: Tensor,
    scale: float,
    needs: list[bool],
) -> tuple[Tensor | None, Tensor | None]:
    both = getattr(backend, "full_kl_backward_both", None)
    if both is not None:
        return both(policy, reference, saved, grad, scale, tuple(needs))  # type: ignore[no-any-return]
    grad_z = backend.full_kl_backward(policy, reference, saved, grad, scale) if needs[0] else None
    grad_w = None
    if needs[1]:  # the reference side from the torch backend's own statistics
        torch_backend = backend_named("torch")
        _, own = torch_backend.full_kl_forward(policy, reference, scale)
        _, grad_w = torch_backend.full_kl_backward_both(  # type: ignore[attr-defined]
            policy, reference, own, grad, scale, (False, True)
        )
    return grad_z, grad_w


def _setup_full_kl(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    policy, reference, scale, backend, checks, name = inputs
    _, saved = output
    ctx.save_for_backward(policy, reference, *saved)
    ctx.scale, ctx.backend, ctx.checks, ctx.name = scale, backend, checks, name
    ctx.mark_non_differentiable(*saved)


def _full_kl_gradients(ctx: Any, grad: Tensor, _saved: Any) -> tuple[Tensor | None, ...]:
    policy, reference, *saved = ctx.saved_tensors
    needs = [bool(ctx.needs_input_grad[0]), bool(ctx.needs_input_grad[1])]
    grad_z = grad_w = None
    if any(needs):
        grad_z, grad_w = _full_kl_backward(
            policy, reference, saved, grad, ctx.scale, ctx.backend, ctx.checks, needs, ctx.name
        )
    return (
        grad_z if needs[0] else None,
        grad_w if needs[1] else None,
        None,
        None,
        None,
        None,
    )


def _check_full_kl(policy: Tensor, reference: Tensor, *args: Any) -> None:
    # what the fake implementations promise: (..., V) logits of one shape
    expect_ndim("klpen::full_kl", "policy", policy, 1)
    expect_shape("klpen::full_kl", "reference", reference, policy.shape)


def _check_full_kl_backward(
    policy: Tensor, reference: Tensor, saved: list[Tensor], grad: Tensor, *args: Any
) -> None:
    _check_full_kl(policy, reference)
    expect_shape("klpen::full_kl_backward", "grad", grad, policy.shape[:-1])
    needs = args[3]  # after scale, backend, checks
    expect(
        "klpen::full_kl_backward", len(needs) == 2, f"needs must have 2 entries, got {len(needs)}"
    )


_full_kl, _full_kl_backward = kernel_op(
    KernelOp(
        "full_kl",
        "(Tensor policy, Tensor reference, float scale, str backend, bool checks, str name) "
        "-> (Tensor, Tensor[])",
        _full_kl_forward,
        _full_kl_fake,
        "(Tensor policy, Tensor reference, Tensor[] saved, Tensor grad, float scale, "
        "str backend, bool checks, bool[] needs, str name) -> (Tensor, Tensor)",
        _full_kl_backward_kernel,
        _full_kl_backward_fake,
        _setup_full_kl,
        _full_kl_gradients,
        check=_check_full_kl,
        backward_check=_check_full_kl_backward,
    )
)


def full_kl(policy_logits: Tensor, reference_logits: Tensor, *, temperature: float = 1.0) -> Tensor:
    r"""Exact ``KL(π ‖ π_ref)`` over the last axis, for any leading shape.

    .. math::

        \begin{aligned}
        \mathrm{KL}(\pi \,\|\, \pi_\mathrm{ref})
            &= \sum_v \pi(v) \log \frac{\pi(v)}{\pi_\mathrm{ref}(v)}, \\
        \pi &= \operatorname{softmax}(z / T), \\
        \pi_\mathrm{ref} &= \operatorname{softmax}(w / T)
        \end{aligned}

    Args:
        policy_logits: ``(..., V)`` floating logits ``z`` of the policy π.
        reference_logits: ``(..., V)`` floating logits ``w`` of the reference π_ref, same shape.
        temperature: ``T``, finite and > 0, applied to both (folded into the per-block
            arithmetic: the logits are not copied).

    Returns:
        ``(...)`` divergences, never negative, exactly 0 for identical rows. Half-precision
        inputs are computed in fp32 and returned as fp32; otherwise the promoted dtype of the
        two inputs. Differentiable w.r.t. both inputs (usually only the policy requires grad),
        once: a second derivative raises a ``RuntimeError`` saying so.

    Accuracy: relative error within about ``1e-5`` of the exact divergence of the given
    (rounded) logits, at any common offset of both (``±1e4`` in fp32) and down to the smallest
    divergences; rows where the fast one-pass formula cannot promise that are recomputed in
    float64 (see ``klpen.kernels.torch_kl.kl_row_stats``).

    Edge cases: a ``-inf`` policy logit (a token the policy cannot emit, as after top-k or
    vocabulary masking) contributes 0; a ``-inf`` reference logit where the policy has mass
    gives ``+inf``, the true value. Memory and threads as in
    :func:`~klpen.get_logprobs_for_tokens`: no ``(..., V)`` temporary is built.

    Raises:
        TypeError, ValueError: non-tensors, integer dtypes, mismatched shapes or devices, an
            empty vocabulary, a temperature that is not finite and positive; NaN or ``+inf``
            logits, or a row whose logits are all ``-inf``.

    Example:
        >>> z = torch.tensor([[2.0, 0.0, 0.0]])
        >>> full_kl(z, z)
        tensor([0.])
        >>> full_kl(z, torch.zeros(1, 3))
        tensor([0.4330])
        >>> full_kl(z, torch.zeros(1, 3), temperature=2.0)
        tensor([0.1233])
    """
    return _checked_kl(
        policy_logits, reference_logits, "policy_logits", "reference_logits", temperature
    )


def _checked_kl(
    policy: Tensor,
    reference: Tensor,
    policy_name: str,
    reference_name: str,
    temperature: object = 1.0,
    name: str = "full_kl",
) -> Tensor:
    """:func:`full_kl` with its arguments validated under the caller's names for them;
    ``name``: the public function, for the second-derivative error."""
    check_floating(policy_name, policy, min_ndim=1)
    check_floating(reference_name, reference, min_ndim=1)
    check_shape(reference_name, reference, policy.shape, f"the shape of {policy_name}")
    check_same_device(reference_name, reference, policy_name, policy)
    vocab = policy.shape[-1]
    if vocab == 0:
        raise ValueError(
            f"{policy_name} must have a non-empty last (vocabulary) axis, got {tuple(policy.shape)}"
        )
    dtype = compute_dtype(torch.promote_types(policy.dtype, reference.dtype))
    scale = inverse_temperature("temperature", temperature, dtype)
    backend = select_backend(policy).name
    kl, _ = _full_kl(policy, reference, scale, backend, value_checks_enabled(), name)
    return check_no_nan(
        kl,
        f"{policy_name} or {reference_name} contain NaN or +inf, or a row whose logits are "
        "all -inf; got a NaN divergence in those rows",
    )


def kl_penalized_reward(
    policy_logits: Tensor, ref_logits: Tensor, reward: Tensor, beta: float = 0.1
) -> Tensor:
    r"""Reward minus ``beta`` times the full categorical KL at every position.

    .. math:: \tilde r = r - \beta\, \mathrm{KL}(\pi \,\|\, \pi_\mathrm{ref})

    Args:
        policy_logits: ``(..., V)`` policy logits.
        ref_logits: ``(..., V)`` reference logits, same shape.
        reward: ``(...)`` floating rewards, the leading shape of the logits.
        beta: finite, non-negative penalty coefficient; ``0`` means no penalty, exactly (the
            reward comes back unchanged even where the KL is ``+inf``, and no gradient
            reaches the logits).

    Returns:
        A tensor of ``reward``'s shape: ``reward - beta * full_kl(policy_logits, ref_logits)``,
        in the promoted dtype of ``reward`` and the KL (at least float32: an fp16 ``reward`` is
        not a reason to round the KL to fp16). Differentiable w.r.t. the policy logits and the
        reward.

    Raises:
        TypeError, ValueError: what :func:`full_kl` refuses; a ``reward`` of the wrong shape,
            device or kind, or with a NaN; a ``beta`` that is negative, not finite, or beyond
            the compute dtype's range.

    Example:
        >>> logits = torch.tensor([[[2.0, 0.0, 0.0]]])
        >>> kl_penalized_reward(logits, logits, torch.tensor([[1.0]]))
        tensor([[1.]])
    """
    check_floating("policy_logits", policy_logits, min_ndim=1)
    check_floating("reward", reward)
    check_shape("reward", reward, policy_logits.shape[:-1], "the leading shape of policy_logits")
    check_same_device("reward", reward, "policy_logits", policy_logits)
    b = check_coef("beta", beta)
    check_no_nan_at("reward", reward)
    # beta = 0: the penalty is the constant 0 (the logits are still checked); no gradient
    # reaches them, the true one being 0 (a backward through an infinite KL would be NaN).
    # A branch, not set_grad_enabled(... and b != 0.0): torch.compile guards on a symbolic
    # float's comparison in a branch but cannot pass it to set_grad_enabled.
    penalised = False
    if torch.is_grad_enabled() and b != 0.0:
        penalised = True
    with torch.set_grad_enabled(penalised):
        # excerpt: reward
        kl = _checked_kl(
            policy_logits, ref_logits, "policy_logits", "ref_logits", name="kl_penalized_reward"
        )
        # end excerpt
    dtype = promoted_dtype(reward, kl)
    check_coef_fits("beta", b, dtype)
    # excerpt: reward
    return reward.to(dtype) - scaled_penalty(b, kl.to(dtype))
    # end excerpt
