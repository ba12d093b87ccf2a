"""Log-probs, entropy and the full KL from hidden states, never building the logits.

Chapter 11 of the book. A language model's last step is ``logits = hidden @ weight.T (+ bias)``:
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

from ._autograd import owned
from ._ops import KernelOp, expect, expect_ndim, expect_shape, kernel_op
from ._validation import (
    check_floating,
    check_no_nan,
    check_same_device,
    check_shape,
    check_temperature,
    check_token_ids,
    check_tokens,
    promoted_dtype,
    validation,
    value_checks_enabled,
)
from .kernels import select_backend
from .kernels.blocks import row_mask, sync_free
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
    backend: str = "torch",
) -> Layer:
    """The :class:`Layer` of validated inputs: ``hidden`` as ``(N, H)`` in the compute dtype.

    ``temperature``: already checked (:func:`~klpen._validation.check_temperature`); the
    layer holds its inverse. ``dtype``: the compute dtype, if wider than this layer's own (the
    KL's two layers share it, and its caller combines their ``narrow`` dtypes). ``backend``: the
    kernel backend whose per-tile reductions the passes use
    (:func:`~klpen.kernels.select_backend`'s choice for the public call).
    """
    own = layer_dtype(hidden, weight, bias)
    narrow = narrow_dtype(hidden, weight, bias)
    dtype = own if dtype is None else torch.promote_types(own, dtype)
    n = math.prod(hidden.shape[:-1])
    flat = hidden.detach().reshape(n, hidden.shape[-1]).to(dtype).contiguous()
    bias = None if bias is None else bias.detach()
    return Layer(flat, weight.detach(), bias, 1.0 / temperature, dtype, backend, narrow)


def narrow_dtype(*tensors: Tensor | None) -> torch.dtype | None:
    """The half-precision dtype every tensor given shares (``None``: an absent bias), else
    ``None``: a call whose products may take half operands on CUDA
    (:func:`~klpen.kernels.torch_linear.product_dtype`)."""
    dtypes = {x.dtype for x in tensors if x is not None}
    (only,) = dtypes if len(dtypes) == 1 else (None,)
    return only if only in (torch.bfloat16, torch.float16) else None


def _kl_layers(
    policy: tuple[Tensor, Tensor, Tensor | None],
    reference: tuple[Tensor, Tensor, Tensor | None],
    temperature: float,
    backend: str,
) -> tuple[Layer, Layer]:
    """Both layers of a KL, in their common compute dtype."""
    dtype = torch.promote_types(layer_dtype(*policy), layer_dtype(*reference))
    p = flat_layer(*policy, temperature, dtype, backend)
    r = flat_layer(*reference, temperature, dtype, backend)
    # half operands only where the whole call shares one half dtype
    narrow = p.narrow if p.narrow == r.narrow else None
    return p._replace(narrow=narrow), r._replace(narrow=narrow)


_INVALID = (
    "hidden, weight or bias contain NaN or inf, or give a row whose logits are all -inf; "
    "got a NaN {what} in those rows"
)


def _input_grads(
    hidden: Tensor, layer: Layer, tile_grad: TileGrad, needs: list[bool]
) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`backprop` for ``hidden``, ``weight`` and ``bias``, the hidden gradient back in
    ``hidden``'s shape and dtype; an empty placeholder where ``needs`` leaves one out (the
    outputs of a custom operator are tensors)."""
    gx, gw, gb = backprop(layer, tile_grad, (needs[0], needs[1], needs[2]))
    empty = hidden.new_empty(0)
    return (
        empty if gx is None else gx.view(hidden.shape).to(hidden.dtype),
        empty.clone() if gw is None else gw,
        empty.clone() if gb is None else gb,
    )


def _input_grads_like(
    hidden: Tensor, weight: Tensor, bias: Tensor | None, needs: list[bool]
) -> tuple[Tensor, Tensor, Tensor]:
    """Fake :func:`_input_grads`: empty tensors of the gradients' shapes and dtypes."""
    return (
        hidden.new_empty(hidden.shape if needs[0] else (0,)),
        torch.empty_like(weight) if needs[1] else hidden.new_empty(0),
        bias.new_empty(bias.shape) if needs[2] and bias is not None else hidden.new_empty(0),
    )


def _grads_or_none(
    grads: tuple[Tensor, Tensor, Tensor], needs: list[bool]
) -> tuple[Tensor | None, ...]:
    return tuple(g if need else None for g, need in zip(grads, needs, strict=True))


def _layer_needs(ctx: Any) -> list[bool]:
    return [bool(ctx.needs_input_grad[i]) for i in range(3)]


def _linear_logprobs_forward(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    tokens: Tensor,
    temperature: float,
    entropy: bool,
    row_grads: bool,
    checks: bool,
    name: str,
    backend: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Log-probs (and entropy, else an empty placeholder) of ``tokens`` under
    ``softmax((x W^T + b) / T)``, tile by tile, the per-row log-sum-exp for backward, and
    with ``row_grads`` (no entropy) each row's ``∂ log π(y)/∂x = (W_y - Σ_v π(v) W_v) / T``
    ``(N, H)`` in the compute dtype (else an empty placeholder), from the same pass.

    An id outside ``[0, V)`` fails loudly also with the value checks off, as the gather of
    :func:`~klpen.get_logprobs_for_tokens` does (where the tiles would simply never meet it
    and return ``-lse``): a ``RuntimeError``, on CUDA a device-side assert (no host sync)."""
    vocab = weight.shape[0]
    torch._assert_async(
        ((tokens >= 0) & (tokens < vocab)).all(),
        f"{name}: tokens must lie in [0, {vocab}) for a vocabulary of {vocab} (value checks off)",
    )
    with validation(checks):
        layer = flat_layer(hidden, weight, bias, temperature, backend=backend)
        ids = tokens.reshape(-1)
        mean = layer.hidden.new_empty(layer.hidden.shape) if row_grads else None
        stats = logprob_stats(layer, ids, entropy, mean_weight=mean)
    grads = stats.lse.new_empty(0)
    if mean is not None:
        grads = torch.sub(layer.weight.index_select(0, ids).to(layer.dtype), mean, out=mean)
        grads.mul_(layer.scale)
    shape = tokens.shape
    ent = stats.lse.new_empty(0) if stats.entropy is None else stats.entropy.view(shape)
    logp, ent, lse, grads = owned(
        (stats.logprob.view(shape), ent, stats.lse, grads), (hidden, weight, bias)
    )
    return logp, ent, lse, grads


def _linear_logprobs_fake(
    hidden: Tensor, weight: Tensor, bias: Tensor | None, tokens: Tensor, *args: Any
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    entropy, row_grads = args[1], args[2]  # after the temperature
    dtype = layer_dtype(hidden, weight, bias)
    ent = hidden.new_empty(tokens.shape if entropy else (0,), dtype=dtype)
    lse = hidden.new_empty(tokens.numel(), dtype=dtype)
    grads = hidden.new_empty((tokens.numel(), hidden.shape[-1]) if row_grads else (0,), dtype=dtype)
    return hidden.new_empty(tokens.shape, dtype=dtype), ent, lse, grads


def _linear_logprobs_backward_kernel(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    tokens: Tensor,
    lse: Tensor,
    ent: Tensor,
    row_grads: Tensor,
    grad_logprob: Tensor,
    grad_entropy: Tensor | None,
    temperature: float,
    needs: list[bool],
    checks: bool,
    backend: str,
    name: str,
) -> tuple[Tensor, Tensor, Tensor]:
    """The gradients w.r.t. ``hidden``, ``weight`` and ``bias`` (empty where not ``needs``):
    from the forward's ``row_grads`` where it kept them (only ``hidden``'s needed, no
    entropy term), else by a pass over the recomputed tiles."""
    if row_grads.numel() and needs == [True, False, False] and grad_entropy is None:
        g = grad_logprob.reshape(-1, 1).to(row_grads.dtype)
        gx = torch.mul(row_grads, g).view(hidden.shape).to(hidden.dtype)
        return gx, hidden.new_empty(0), hidden.new_empty(0)
    with validation(checks):
        layer = flat_layer(hidden, weight, bias, temperature, backend=backend)
        ent_term = None if grad_entropy is None else (ent.reshape(-1), grad_entropy)
        tile_grad = logprob_grad(layer, tokens.reshape(-1), lse, grad_logprob, ent_term)
        return _input_grads(hidden, layer, tile_grad, needs)


def _linear_logprobs_backward_fake(
    hidden: Tensor, weight: Tensor, bias: Tensor | None, *args: Any
) -> tuple[Tensor, Tensor, Tensor]:
    needs = args[7]  # after tokens, lse, ent, row_grads, the upstream gradients, temperature
    return _input_grads_like(hidden, weight, bias, needs)


def _setup_linear_logprobs(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    hidden, weight, bias, tokens, temperature, entropy, _, checks, name, backend = inputs
    _, ent, lse, row_grads = output
    ctx.save_for_backward(hidden, weight, bias, tokens, lse, ent, row_grads)
    ctx.temperature, ctx.entropy, ctx.checks, ctx.name = temperature, entropy, checks, name
    ctx.backend = backend
    ctx.set_materialize_grads(False)
    ctx.mark_non_differentiable(lse, row_grads, *([] if entropy else [ent]))


def _linear_logprobs_gradients(
    ctx: Any, grad_logprob: Tensor | None, grad_entropy: Tensor | None, _lse: Any, _grads: Any
) -> tuple[Tensor | None, ...]:
    hidden, weight, bias, tokens, lse, ent, row_grads = ctx.saved_tensors
    needs = _layer_needs(ctx)
    if not any(needs) or (grad_logprob is None and grad_entropy is None):
        return (None,) * 10
    if grad_logprob is None:
        grad_logprob = torch.zeros_like(lse).view(tokens.shape)
    if not ctx.entropy:
        grad_entropy = None
    grads = _linear_logprobs_backward(
        hidden,
        weight,
        bias,
        tokens,
        lse,
        ent,
        row_grads,
        grad_logprob,
        grad_entropy,
        ctx.temperature,
        needs,
        ctx.checks,
        ctx.backend,
        ctx.name,
    )
    return (*_grads_or_none(grads, needs), None, None, None, None, None, None, None)


def _check_layer_op(
    op: str, prefix: str, hidden: Tensor, weight: Tensor, bias: Tensor | None, vocab: int
) -> None:
    # what the fake implementations promise: hidden (..., H), weight (V, H), bias (V,)
    expect_ndim(op, f"{prefix}hidden", hidden, 1)
    expect_shape(op, f"{prefix}weight", weight, (vocab, hidden.shape[-1]))
    expect_shape(op, f"{prefix}bias", bias, (vocab,))


def _check_linear_logprobs(
    hidden: Tensor, weight: Tensor, bias: Tensor | None, tokens: Tensor, *args: Any
) -> None:
    op = "klpen::linear_logprobs"
    expect_ndim(op, "weight", weight, 2)
    _check_layer_op(op, "", hidden, weight, bias, weight.shape[0])
    expect_shape(op, "tokens", tokens, hidden.shape[:-1])


def _check_linear_logprobs_backward(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    tokens: Tensor,
    lse: Tensor,
    ent: Tensor,
    row_grads: Tensor,
    grad_logprob: Tensor,
    grad_entropy: Tensor | None,
    *args: Any,
) -> None:
    op = "klpen::linear_logprobs_backward"
    _check_linear_logprobs(hidden, weight, bias, tokens)
    expect_shape(op, "lse", lse, (tokens.numel(),))
    expect_shape(op, "grad_logprob", grad_logprob, tokens.shape)
    expect_shape(op, "grad_entropy", grad_entropy, tokens.shape)
    needs = args[1]  # after temperature
    expect(op, len(needs) == 3, f"needs must have 3 entries, got {len(needs)}")


_linear_logprobs, _linear_logprobs_backward = kernel_op(
    KernelOp(
        "linear_logprobs",
        "(Tensor hidden, Tensor weight, Tensor? bias, Tensor tokens, float temperature, "
        "bool entropy, bool row_grads, bool checks, str name, str backend) "
        "-> (Tensor, Tensor, Tensor, Tensor)",
        _linear_logprobs_forward,
        _linear_logprobs_fake,
        "(Tensor hidden, Tensor weight, Tensor? bias, Tensor tokens, Tensor lse, Tensor ent, "
        "Tensor row_grads, Tensor grad_logprob, Tensor? grad_entropy, float temperature, "
        "bool[] needs, bool checks, str backend, str name) -> (Tensor, Tensor, Tensor)",
        _linear_logprobs_backward_kernel,
        _linear_logprobs_backward_fake,
        _setup_linear_logprobs,
        _linear_logprobs_gradients,
        check=_check_linear_logprobs,
        backward_check=_check_linear_logprobs_backward,
    )
)


def _row_grads_ahead(hidden: Tensor, weight: Tensor, bias: Tensor | None, entropy: bool) -> bool:
    """Whether the forward keeps each row's log-prob gradient w.r.t. its hidden state: only
    ``hidden`` will be differentiated (a frozen output layer, as under LoRA) and no entropy is
    asked. Then backward is one multiply, not a pass of two products per tile over the
    recomputed logits; the forward does one more product per tile (the mean weight row)."""
    frozen = not weight.requires_grad and (bias is None or not bias.requires_grad)
    return torch.is_grad_enabled() and hidden.requires_grad and frozen and not entropy


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
        for half-precision inputs (widened exactly per tile, products with fp32 accumulation
        and fp32 results: the logits are not rounded to the inputs' dtype), else in the
        promoted dtype. Differentiable w.r.t. ``hidden``, ``weight`` and ``bias`` (backward
        recomputes each tile: one more matrix product).

    A frozen output layer (only ``hidden`` requires grad, as under LoRA; no entropy asked):
    the forward also forms each row's gradient

    .. math:: \frac{\partial \log \pi(y)}{\partial x} = \Big(W_y - \textstyle\sum_v \pi(v)
        W_v\Big) \big/ T

    from the same tiles (one more product per tile, of the probabilities by the weight tile),
    and backward multiplies it by the upstream gradient: two products in all, as the unfused
    path's two, where recomputing the tiles would take three. The log-probs are the same bits
    either way.

    Half precision: where ``hidden``, ``weight`` and ``bias`` share one half dtype, the
    logits' products on CUDA take half operands with fp32 accumulation and fp32 results (the
    tensor cores; ``klpen.kernels.torch_linear.product_dtype``); on the CPU they are IEEE fp32
    products of the exactly widened values. No logit is rounded to half precision, and no
    setting of the process is changed.

    Memory: one ``(rows, tile)`` block of scratch (16 MiB on the CPU, 4 MiB for a
    half-precision weight, plus its tile widened to fp32; two blocks with entropy) and a few
    numbers per position and vocabulary group, besides the inputs and the returned
    gradients. A frozen output layer's forward keeps the ``(N, H)`` row gradients for
    backward, which then allocates only the hidden gradient.

    Threads: one sequential loop over the tiles in the calling thread; its products and
    reductions use torch's intra-op threads. The results are the same bits at a given thread
    count.

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
    logprob, ent, _, _ = _linear_logprobs(
        h,
        w,
        b,
        ids,
        t,
        bool(return_entropy),
        _row_grads_ahead(h, w, b, bool(return_entropy)),
        value_checks_enabled(),
        "linear_logprobs",
        select_backend(h).name,
    )
    check_no_nan(logprob, _INVALID.format(what="log-prob"))
    return (logprob, ent) if return_entropy else logprob


def _linear_full_kl_forward(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    ref_hidden: Tensor,
    ref_weight: Tensor,
    ref_bias: Tensor | None,
    temperature: float,
    checks: bool,
    name: str,
    backend: str,
) -> tuple[Tensor, list[Tensor]]:
    """``KL(softmax(z) ‖ softmax(w))`` per row of two output layers, tile by tile, and the
    statistics of backward (:class:`KLStats` and the rows redone exactly)."""
    with validation(checks):
        policy, reference = _kl_layers(
            (hidden, weight, bias), (ref_hidden, ref_weight, ref_bias), temperature, backend
        )
        stats, redo = kl_stats(policy, reference)
        # The rows redone exactly, as a mask; every row in the sync-free path (none saved).
        n = stats.kl.shape[0]
        mask = redo.new_empty(0, dtype=torch.bool) if sync_free(hidden) else row_mask(redo, n)
    kl = stats.kl.clamp(min=0.0).view(hidden.shape[:-1])
    kl, *saved = owned((kl, *stats, mask), (hidden, weight, bias, ref_hidden, ref_weight, ref_bias))
    return kl, saved


def _linear_full_kl_fake(*args: Any) -> tuple[Tensor, list[Tensor]]:
    hidden, weight, bias, ref_hidden, ref_weight, ref_bias, _temperature, checks = args[:8]
    dtype = torch.promote_types(
        layer_dtype(hidden, weight, bias), layer_dtype(ref_hidden, ref_weight, ref_bias)
    )
    n = hidden.numel() // hidden.shape[-1]
    with validation(checks):
        mask = 0 if sync_free(hidden) else n
    stats = [hidden.new_empty(n, dtype=dtype) for _ in KLStats._fields]
    kl = hidden.new_empty(hidden.shape[:-1], dtype=dtype)
    return kl, [*stats, hidden.new_empty(mask, dtype=torch.bool)]


def _linear_full_kl_backward_kernel(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    ref_hidden: Tensor,
    ref_weight: Tensor,
    ref_bias: Tensor | None,
    saved: list[Tensor],
    grad_kl: Tensor,
    temperature: float,
    needs: list[bool],
    checks: bool,
    backend: str,
    name: str,
) -> tuple[Tensor, Tensor, Tensor]:
    """The gradients w.r.t. the policy's ``hidden``, ``weight`` and ``bias``."""
    *stats, mask = saved
    with validation(checks):
        policy, reference = _kl_layers(
            (hidden, weight, bias), (ref_hidden, ref_weight, ref_bias), temperature, backend
        )
        # rows with -inf logits need 0 · log 0 = 0 (in the sync-free path: all rows redone)
        masked = sync_free(hidden) or bool(mask.any())
        tile_grad = kl_grad(policy, reference, KLStats(*stats), grad_kl, masked)
        return _input_grads(hidden, policy, tile_grad, needs)


def _linear_full_kl_backward_fake(
    hidden: Tensor, weight: Tensor, bias: Tensor | None, *args: Any
) -> tuple[Tensor, Tensor, Tensor]:
    needs = args[6]  # after the reference's three, saved, the upstream gradient, temperature
    return _input_grads_like(hidden, weight, bias, needs)


def _setup_linear_full_kl(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    *tensors, temperature, checks, name, backend = inputs
    _, saved = output
    ctx.save_for_backward(*tensors, *saved)
    ctx.temperature, ctx.checks, ctx.name, ctx.backend = temperature, checks, name, backend
    ctx.mark_non_differentiable(*saved)


def _linear_full_kl_gradients(ctx: Any, grad_kl: Tensor, _saved: Any) -> tuple[Tensor | None, ...]:
    needs = _layer_needs(ctx)
    if not any(needs):
        return (None,) * 10
    layers = ctx.saved_tensors[:6]
    saved = list(ctx.saved_tensors[6:])
    grads = _linear_full_kl_backward(
        *layers, saved, grad_kl, ctx.temperature, needs, ctx.checks, ctx.backend, ctx.name
    )
    return (*_grads_or_none(grads, needs), None, None, None, None, None, None, None)


def _check_linear_full_kl(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    ref_hidden: Tensor,
    ref_weight: Tensor,
    ref_bias: Tensor | None,
    *args: Any,
) -> None:
    op = "klpen::linear_full_kl"
    expect_ndim(op, "weight", weight, 2)
    _check_layer_op(op, "", hidden, weight, bias, weight.shape[0])
    expect_ndim(op, "ref_hidden", ref_hidden, 1)
    expect_shape(op, "ref_hidden", ref_hidden, (*hidden.shape[:-1], ref_hidden.shape[-1]))
    _check_layer_op(op, "ref_", ref_hidden, ref_weight, ref_bias, weight.shape[0])


def _check_linear_full_kl_backward(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    ref_hidden: Tensor,
    ref_weight: Tensor,
    ref_bias: Tensor | None,
    saved: list[Tensor],
    grad_kl: Tensor,
    *args: Any,
) -> None:
    op = "klpen::linear_full_kl_backward"
    _check_linear_full_kl(hidden, weight, bias, ref_hidden, ref_weight, ref_bias)
    expect_shape(op, "grad_kl", grad_kl, hidden.shape[:-1])
    needs = args[1]  # after temperature
    expect(op, len(needs) == 3, f"needs must have 3 entries, got {len(needs)}")


_linear_full_kl, _linear_full_kl_backward = kernel_op(
    KernelOp(
        "linear_full_kl",
        "(Tensor hidden, Tensor weight, Tensor? bias, Tensor ref_hidden, Tensor ref_weight, "
        "Tensor? ref_bias, float temperature, bool checks, str name, str backend) "
        "-> (Tensor, Tensor[])",
        _linear_full_kl_forward,
        _linear_full_kl_fake,
        "(Tensor hidden, Tensor weight, Tensor? bias, Tensor ref_hidden, Tensor ref_weight, "
        "Tensor? ref_bias, Tensor[] saved, Tensor grad_kl, float temperature, bool[] needs, "
        "bool checks, str backend, str name) -> (Tensor, Tensor, Tensor)",
        _linear_full_kl_backward_kernel,
        _linear_full_kl_backward_fake,
        _setup_linear_full_kl,
        _linear_full_kl_gradients,
        check=_check_linear_full_kl,
        backward_check=_check_linear_full_kl_backward,
    )
)


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
        fp32 for half-precision inputs (fp32 logits, as in :func:`linear_logprobs`; half
        operands on CUDA where all six inputs share one half dtype), else the promoted dtype.
        Gradients flow to the policy side only (``hidden``, ``weight``, ``bias``); the
        reference is detached.

    Memory: on the CPU, three tiles of 2M entries in the forward pass
    (24 MiB in fp32; a quarter of that for half-precision weights), 32 MiB when rows are
    redone with float64 terms, three 16 MiB tiles in backward; a few numbers per position and
    vocabulary group. Threads as in :func:`linear_logprobs`.

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
    checks, backend = value_checks_enabled(), select_backend(h).name
    kl, _ = _linear_full_kl(h, w, b, *ref, t, checks, "linear_full_kl", backend)
    return check_no_nan(
        kl, _INVALID.format(what="divergence").replace("hidden", "hidden (or ref_)", 1)
    )
