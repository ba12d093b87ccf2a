"""Log-probs, entropy and the full KL from hidden states, never building the logits.

Chapter 8 of the book. A language model's last step is ``logits = hidden @ weight.T (+ bias)``:
a ``(N, V)`` tensor of 16 GB in fp32 at 32k tokens and a 128k vocabulary, built only to read a
few numbers per row. Here the output layer and the reduction are fused: the vocabulary is walked
in tiles of ``weight``'s rows, each tile's logits ``(rows, tile)`` are computed by one matrix
product into a reused scratch buffer, reduced at once, and forgotten. Backward recomputes each
tile (one more product) and accumulates the three gradients tile by tile. Extra memory: a tile
or three of scratch (16 MiB each on the CPU) and a few numbers per row, however large N or V.

The tile kernels are :mod:`klpen.kernels.torch_linear`'s; this module validates the inputs
and holds the two autograd Functions.
"""

from __future__ import annotations

import math
from typing import Any, Literal, overload

import torch
from torch import Tensor

from ._autograd import KernelFunction
from ._validation import (
    check_floating,
    check_no_nan,
    check_same_device,
    check_shape,
    check_temperature,
    check_token_ids,
    check_tokens,
    promoted_dtype,
)
from .kernels.torch_linear import (
    KLStats,
    Layer,
    TileGrad,
    backprop,
    kl_grad,
    kl_stats,
    logprob_grad,
    logprob_stats,
)

__all__ = ["linear_full_kl", "linear_logprobs"]


def check_layer(
    names: tuple[str, str, str], hidden: object, weight: object, bias: object
) -> tuple[Tensor, Tensor, Tensor | None]:
    """Validate an output layer's ``hidden (..., H)``, ``weight (V, H)``, ``bias (V,)``.

    ``names``: the argument names, for the messages. Returns the three as tensors.
    """
    h = check_floating(names[0], hidden, min_ndim=1)
    w = check_floating(names[1], weight, min_ndim=2)
    if w.dim() != 2 or w.shape[0] == 0:
        raise ValueError(
            f"{names[1]} must have shape (V, H) with V >= 1 (one row per vocabulary entry), "
            f"got {tuple(w.shape)}"
        )
    if w.shape[1] != h.shape[-1]:
        raise ValueError(
            f"{names[1]} must have shape (V, H) with H = {h.shape[-1]}, the last dimension of "
            f"{names[0]} {tuple(h.shape)}; got {tuple(w.shape)}"
        )
    check_same_device(names[1], w, names[0], h)
    b = None
    if bias is not None:
        b = check_floating(names[2], bias, min_ndim=1)
        check_shape(names[2], b, (w.shape[0],), f"one entry per row of {names[1]}")
        check_same_device(names[2], b, names[0], h)
    return h, w, b


def layer_dtype(*tensors: Tensor | None) -> torch.dtype:
    """The compute dtype of an output layer's tensors (``None`` for an absent bias)."""
    return promoted_dtype(*(x for x in tensors if x is not None))


def flat_layer(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    temperature: float,
    dtype: torch.dtype | None = None,
) -> Layer:
    """The :class:`Layer` of validated inputs: ``hidden`` as ``(N, H)`` in the compute dtype.

    ``temperature``: already checked (:func:`~klpen._validation.check_temperature`); the
    layer holds its inverse. ``dtype``: the compute dtype, if wider than this layer's own (the
    KL's two layers share it).
    """
    own = layer_dtype(hidden, weight, bias)
    dtype = own if dtype is None else torch.promote_types(own, dtype)
    n = math.prod(hidden.shape[:-1])
    flat = hidden.detach().reshape(n, hidden.shape[-1]).to(dtype).contiguous()
    bias = None if bias is None else bias.detach()
    return Layer(flat, weight.detach(), bias, 1.0 / temperature, dtype)


def _kl_layers(
    policy: tuple[Tensor, Tensor, Tensor | None],
    reference: tuple[Tensor, Tensor, Tensor | None],
    temperature: float,
) -> tuple[Layer, Layer]:
    """Both layers of a KL, in their common compute dtype."""
    dtype = torch.promote_types(layer_dtype(*policy), layer_dtype(*reference))
    return flat_layer(*policy, temperature, dtype), flat_layer(*reference, temperature, dtype)


_INVALID = (
    "hidden, weight or bias contain NaN or inf, or give a row whose logits are all -inf; "
    "got a NaN {what} in those rows"
)


def _input_grads(
    ctx: Any, hidden: Tensor, layer: Layer, tile_grad: TileGrad
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """:func:`backprop` for the first three inputs (``hidden``, ``weight``, ``bias``) of an
    autograd function, the hidden gradient back in ``hidden``'s shape and dtype."""
    needs = tuple(ctx.needs_input_grad[:3])
    gx, gw, gb = backprop(layer, tile_grad, needs)
    return (None if gx is None else gx.view(hidden.shape).to(hidden.dtype)), gw, gb


class _LinearLogProbs(KernelFunction):
    """Log-probs (and entropy) of ``tokens`` under ``softmax((x W^T + b) / T)``, tile by tile."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        tokens: Tensor,
        temperature: float,
        entropy: bool,
    ) -> tuple[Tensor, Tensor]:
        KernelFunction.named(ctx, "linear_logprobs")
        layer = flat_layer(hidden, weight, bias, temperature)
        flat_tokens = tokens.reshape(-1)
        stats = logprob_stats(layer, flat_tokens, entropy)
        ent = stats.entropy if stats.entropy is not None else stats.lse.new_empty(0)
        ctx.save_for_backward(hidden, weight, bias, flat_tokens, stats.lse, ent)
        ctx.temperature, ctx.entropy = temperature, entropy
        if not entropy:
            ctx.mark_non_differentiable(ent)
        shape = tokens.shape
        return stats.logprob.view(shape), (ent.view(shape) if entropy else ent)

    @staticmethod
    def gradients(
        ctx: Any, grad_logprob: Tensor, grad_entropy: Tensor | None
    ) -> tuple[Tensor | None, Tensor | None, Tensor | None, None, None, None]:
        hidden, weight, bias, tokens, lse, ent = ctx.saved_tensors
        layer = flat_layer(hidden, weight, bias, ctx.temperature)
        ent_term = None
        if ctx.entropy and grad_entropy is not None:
            ent_term = (ent, grad_entropy)
        tile_grad = logprob_grad(layer, tokens, lse, grad_logprob, ent_term)
        return (*_input_grads(ctx, hidden, layer, tile_grad), None, None, None)


@overload
def linear_logprobs(
    hidden: Tensor,
    weight: Tensor,
    tokens: Tensor,
    *,
    bias: Tensor | None = ...,
    temperature: float = ...,
    return_entropy: Literal[False] = ...,
) -> Tensor: ...
@overload
def linear_logprobs(
    hidden: Tensor,
    weight: Tensor,
    tokens: Tensor,
    *,
    bias: Tensor | None = ...,
    temperature: float = ...,
    return_entropy: Literal[True],
) -> tuple[Tensor, Tensor]: ...
def linear_logprobs(
    hidden: Tensor,
    weight: Tensor,
    tokens: Tensor,
    *,
    bias: Tensor | None = None,
    temperature: float = 1.0,
    return_entropy: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    r"""Log-probabilities of ``tokens`` under an output layer, without building its logits.

    .. math::

        \begin{aligned}
        z &= (x W^\top + b) / T, \\
        \log \pi(y) &= z_y - \log \textstyle\sum_v e^{z_v}
        \end{aligned}

    The value of ``get_logprobs_for_tokens((hidden @ weight.T + bias) / temperature, tokens)``,
    computed over tiles of the vocabulary: the ``(..., V)`` logits are never held.

    Args:
        hidden: ``(..., H)`` floating hidden states (the last layer's output, already shifted so
            that position ``t`` scores ``tokens[..., t]``).
        weight: ``(V, H)`` floating output-layer weight (``lm_head.weight``).
        tokens: ``(...)`` integer token ids in ``[0, V)``, the leading shape of ``hidden``.
        bias: optional ``(V,)`` floating bias; ``-inf`` entries mask vocabulary entries.
        temperature: finite, positive ``T``.
        return_entropy: also return the entropy of ``softmax(z)`` per position, from the same
            pass (differentiable too).

    Returns:
        ``(...)`` log-probabilities, or ``(logprobs, entropy)``. Computed and returned in fp32
        for half-precision inputs (widened exactly per tile, fp32 products with fp32
        accumulation), else in the promoted dtype. Differentiable w.r.t. ``hidden``,
        ``weight`` and ``bias`` (backward recomputes each tile: one more matrix product).

    Memory: one ``(rows, tile)`` block of scratch (16 MiB on the CPU, 4 MiB for a
    half-precision weight, plus its tile widened to fp32; two blocks with entropy) and a few
    numbers per position, besides the inputs and the returned gradients.

    Raises:
        TypeError, ValueError: wrong types, kinds, shapes or devices, token ids outside
            ``[0, V)``, a non-positive temperature; NaN or inf in the inputs, or a row whose
            logits are all ``-inf``.

    Example:
        >>> hidden, weight = torch.tensor([[1.0, 0.0]]), torch.tensor([[2.0, 0.0], [0.0, 1.0]])
        >>> linear_logprobs(hidden, weight, torch.tensor([0]))
        tensor([-0.1269])
    """
    h, w, b = check_layer(("hidden", "weight", "bias"), hidden, weight, bias)
    check_same_device("tokens", check_token_ids("tokens", tokens), "hidden", h)
    ids = check_tokens("tokens", tokens, h.shape[:-1], w.shape[0])
    t = check_temperature("temperature", temperature, layer_dtype(h, w, b))
    logprob, ent = _LinearLogProbs.apply(h, w, b, ids, t, bool(return_entropy))  # type: ignore[no-untyped-call]
    check_no_nan(logprob, _INVALID.format(what="log-prob"))
    return (logprob, ent) if return_entropy else logprob


class _LinearFullKL(KernelFunction):
    """``KL(softmax(z) ‖ softmax(w))`` per row of two output layers, tile by tile."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        ref: tuple[Tensor, Tensor, Tensor | None],
        temperature: float,
    ) -> Tensor:
        KernelFunction.named(ctx, "linear_full_kl")
        policy, reference = _kl_layers((hidden, weight, bias), ref, temperature)
        stats, redo = kl_stats(policy, reference)
        kl = stats.kl.clamp(min=0.0)
        ctx.save_for_backward(hidden, weight, bias, *stats)
        ctx.ref, ctx.masked = ref, bool(redo.numel())
        ctx.temperature = temperature
        return kl.view(hidden.shape[:-1])

    @staticmethod
    def gradients(
        ctx: Any, grad_kl: Tensor
    ) -> tuple[Tensor | None, Tensor | None, Tensor | None, None, None]:
        hidden, weight, bias, *saved = ctx.saved_tensors
        policy, reference = _kl_layers((hidden, weight, bias), ctx.ref, ctx.temperature)
        tile_grad = kl_grad(policy, reference, KLStats(*saved), grad_kl, ctx.masked)
        return (*_input_grads(ctx, hidden, policy, tile_grad), None, None)


def linear_full_kl(
    hidden: Tensor,
    weight: Tensor,
    ref_hidden: Tensor,
    ref_weight: Tensor,
    *,
    bias: Tensor | None = None,
    ref_bias: Tensor | None = None,
    temperature: float = 1.0,
) -> Tensor:
    r"""Exact ``KL(π ‖ π_ref)`` per position from two output layers, never building the logits.

    .. math::

        \begin{aligned}
        \pi &= \mathrm{softmax}\big((x W^\top + b) / T\big), \\
        \pi_\mathrm{ref} &= \mathrm{softmax}\big((x' W'^\top + b') / T\big)
        \end{aligned}

    The value of ``full_kl`` on the two logits tensors, computed over tiles of the vocabulary.

    Args:
        hidden, weight, bias: the policy's ``(..., H)`` hidden states, ``(V, H)`` output weight
            and optional ``(V,)`` bias.
        ref_hidden, ref_weight, ref_bias: the reference's, ``(..., H')``, ``(V, H')``,
            ``(V,)``: same leading shape and vocabulary, any hidden size.
        temperature: finite, positive ``T``, applied to both.

    Returns:
        ``(...)`` divergences, never negative; exactly 0 for identical layers and inputs. In
        fp32 for half-precision inputs, else the promoted dtype. Gradients flow to the policy
        side only (``hidden``, ``weight``, ``bias``); the reference is detached.

    Memory: on the CPU, three tiles of 2M entries in the forward pass (24 MiB in fp32; a
    quarter of that for half-precision weights), 32 MiB when rows are redone with float64
    terms, three 16 MiB tiles in backward, and a few numbers per position.

    Accuracy: as exact as the fp32 logits allow (relative 1e-4 against float64 down to
    KL ~ 1e-8 for exactly known logits): a centred one-pass form, and float64 terms for the
    rows below about 1e-6.

    Raises:
        TypeError, ValueError: as :func:`linear_logprobs`, for either side, and mismatched
            leading shapes or vocabularies.

    Example:
        >>> x, w = torch.tensor([[1.0, 0.0]]), torch.tensor([[2.0, 0.0], [0.0, 1.0]])
        >>> linear_full_kl(x, w, x, w)
        tensor([0.])
        >>> linear_full_kl(x, w, x, torch.zeros(2, 2))
        tensor([0.3278])
    """
    h, w, b = check_layer(("hidden", "weight", "bias"), hidden, weight, bias)
    names = ("ref_hidden", "ref_weight", "ref_bias")
    rh, rw, rb = check_layer(names, ref_hidden, ref_weight, ref_bias)
    check_shape("ref_hidden", rh, (*h.shape[:-1], rh.shape[-1]), "the leading shape of hidden")
    check_shape("ref_weight", rw, (w.shape[0], rw.shape[1]), "the vocabulary size of weight")
    check_same_device("ref_hidden", rh, "hidden", h)
    dtype = torch.promote_types(layer_dtype(h, w, b), layer_dtype(rh, rw, rb))
    t = check_temperature("temperature", temperature, dtype)
    ref = (rh.detach(), rw.detach(), None if rb is None else rb.detach())
    kl: Tensor = _LinearFullKL.apply(h, w, b, ref, t)  # type: ignore[no-untyped-call]
    return check_no_nan(
        kl, _INVALID.format(what="divergence").replace("hidden", "hidden (or ref_)", 1)
    )
