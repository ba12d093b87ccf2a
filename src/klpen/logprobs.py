"""Log-probabilities of chosen tokens, extracted from logits without a full log-softmax copy.

Chapter 2 of the book. The naive ``log_softmax(logits).gather(-1, tokens)`` builds a second
``(B, T, V)`` tensor only to read one entry per row. Here each row needs two numbers, its
log-sum-exp and the logit of its token, so the rows are processed in cache-sized blocks, and the
backward pass recomputes the softmax per block from the saved logits and per-row log-sum-exp.
"""

from __future__ import annotations

from typing import Any, Literal, overload

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
    check_token_ids,
    check_tokens,
    inverse_temperature,
    promoted_dtype,
    validation,
    value_checks_enabled,
)
from .kernels import backend_named, select_backend
from .kernels.blocks import compute_dtype, rows_of, sync_free
from .packing import next_token_keep

__all__ = ["calculate_kl_penalty", "get_logprobs_for_tokens", "next_token_logprobs"]


def _next_tokens(ids: Tensor | None, logits: Tensor) -> Tensor | None:
    # Position t scores ids[..., t + 1]; the last position, which scores nothing, takes a
    # stand-in (the last id): the kernel then reads and writes the whole logits at once (the
    # last row's gradient 0), where a slice of them would leave autograd to copy the gradient
    # into a zero (..., T, V) tensor. Done inside the operators, not before them: a compiled
    # caller would run the shift as a kernel of its own, in a parallel region whose idle
    # threads spin on the cores that the pass right after needs.
    if ids is None:
        return None
    return torch.cat([ids[..., 1:], ids[..., -1:]], dim=-1)


def _token_logprobs_forward(
    logits: Tensor,
    tokens: Tensor | None,
    keep: Tensor | None,
    shifted: bool,
    scale: float,
    entropy: bool,
    backend: str,
    checks: bool,
    name: str,
) -> tuple[Tensor, Tensor, list[Tensor]]:
    """Per row, ``log softmax(k z)[token]`` and/or the entropy of ``softmax(k z)``, in one read.

    ``k`` = ``scale``, the inverse temperature; ``keep`` (bool, the log-probs' shape, or
    ``None``): the rows that are log-probs at all (a packed row's sequence boundaries are not;
    there the log-prob is 0 and the gradient 0, whatever the logits hold); ``shifted``:
    ``tokens`` are the sequences' own ids and position ``t`` scores ``tokens[..., t + 1]``
    (``next_token_logprobs`` on the whole logits), so the last position scores none: its
    outputs are dropped and its gradient is 0;
    ``backend``: the kernels' (see :mod:`klpen.kernels`), chosen by the caller; ``checks``:
    the value-check switch the call was made under (the kernels choose their sync-free paths
    by it);
    ``name``: the public function. Returns ``(log-probs, entropies, saved)``, an output not
    asked for an empty placeholder, ``saved`` what the backward operator needs.
    """
    targets = _next_tokens(tokens, logits) if shifted else tokens
    with validation(checks):
        logp, ent, saved = backend_named(backend).logprobs_forward(logits, targets, scale, entropy)
    if keep is not None:
        logp = logp if tokens is None else torch.where(keep, logp, 0.0)
        ent = ent if not entropy else torch.where(keep, ent, 0.0)
    logp, ent, *rest = owned((logp, ent, *saved), (logits, tokens))
    return logp, ent, rest


def _token_logprobs_fake(
    logits: Tensor, tokens: Tensor | None, *args: Any
) -> tuple[Tensor, Tensor, list[Tensor]]:
    # the operator's arguments after the tokens
    _keep, _shifted, _scale, entropy, backend, checks, _name = args
    dtype = compute_dtype(logits.dtype)
    rows = logits.shape[:-1]
    logp = logits.new_empty(rows if tokens is not None else (0,), dtype=dtype)
    ent = logits.new_empty(rows if entropy else (0,), dtype=dtype)
    with validation(checks):
        saved = backend_named(backend).logprobs_saved_like(logits, tokens, entropy)
    return logp, ent, list(saved)


def _token_logprobs_backward_kernel(
    logits: Tensor,
    tokens: Tensor | None,
    keep: Tensor | None,
    shifted: bool,
    saved: list[Tensor],
    grad_logp: Tensor | None,
    grad_ent: Tensor | None,
    scale: float,
    backend: str,
    checks: bool,
    name: str,
) -> Tensor:
    """``d/dlogits`` of ``sum(g * logp + h * ent)``, ``(..., V)`` in the logits' dtype; 0 in
    the rows that ``keep`` leaves out."""
    targets = _next_tokens(tokens, logits) if shifted else tokens
    with validation(checks):
        grad = backend_named(backend).logprobs_backward(
            logits, targets, tuple(saved), grad_logp, grad_ent, scale
        )
        if shifted:
            grad[..., -1, :] = 0.0
        if keep is None:
            return grad
        if sync_free(grad):
            return grad.masked_fill_(~keep[..., None], 0.0)
        # On the CPU only the rows cut (one per sequence) are written, not the whole gradient.
        cut = rows_of(~keep.reshape(-1))
        grad.view(-1, grad.shape[-1]).index_fill_(0, cut, 0.0)
        return grad


def _token_logprobs_backward_fake(logits: Tensor, *args: Any) -> Tensor:
    return logits.new_empty(logits.shape)


def _setup_logprobs(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    logits, tokens, keep, shifted, scale, entropy, backend, checks, name = inputs
    logp, ent, saved = output
    ctx.save_for_backward(logits, tokens, keep, *saved)
    ctx.scale, ctx.backend, ctx.checks, ctx.name = scale, backend, checks, name
    ctx.shifted = shifted
    ctx.set_materialize_grads(False)
    # the saved statistics, and an output not asked for (an empty placeholder)
    ctx.mark_non_differentiable(
        *saved, *([] if entropy else [ent]), *([logp] if tokens is None else [])
    )


def _logprobs_gradients(
    ctx: Any, grad_logp: Tensor | None, grad_ent: Tensor | None, _saved: Any
) -> tuple[Tensor | None, ...]:
    logits, tokens, keep, *saved = ctx.saved_tensors
    grad = None
    if ctx.needs_input_grad[0] and (grad_logp is not None or grad_ent is not None):
        grad = _token_logprobs_backward(
            logits,
            tokens,
            keep,
            ctx.shifted,
            saved,
            grad_logp,
            grad_ent,
            ctx.scale,
            ctx.backend,
            ctx.checks,
            ctx.name,
        )
    return grad, None, None, None, None, None, None, None, None


def _check_rows(
    op: str, logits: Tensor, tokens: Tensor | None, keep: Tensor | None, shifted: bool
) -> None:
    # what the fake implementations promise: one row of (..., V) logits per token and keep
    expect_ndim(op, "logits", logits, 2 if shifted else 1)
    expect_shape(op, "tokens", tokens, logits.shape[:-1])
    expect_shape(op, "keep", keep, logits.shape[:-1])
    expect(op, keep is None or keep.dtype == torch.bool, "keep must be a bool tensor")


def _check_logprobs(
    logits: Tensor, tokens: Tensor | None, keep: Tensor | None, shifted: bool, *args: Any
) -> None:
    _check_rows("klpen::token_logprobs", logits, tokens, keep, shifted)


def _check_logprobs_backward(
    logits: Tensor,
    tokens: Tensor | None,
    keep: Tensor | None,
    shifted: bool,
    saved: list[Tensor],
    grad_logp: Tensor | None,
    grad_ent: Tensor | None,
    *args: Any,
) -> None:
    op = "klpen::token_logprobs_backward"
    _check_rows(op, logits, tokens, keep, shifted)
    expect_shape(op, "grad_logp", grad_logp, logits.shape[:-1])
    expect_shape(op, "grad_ent", grad_ent, logits.shape[:-1])


_token_logprobs, _token_logprobs_backward = kernel_op(
    KernelOp(
        "token_logprobs",
        "(Tensor logits, Tensor? tokens, Tensor? keep, bool shifted, float scale, bool entropy, "
        "str backend, bool checks, str name) -> (Tensor, Tensor, Tensor[])",
        _token_logprobs_forward,
        _token_logprobs_fake,
        "(Tensor logits, Tensor? tokens, Tensor? keep, bool shifted, Tensor[] saved, "
        "Tensor? grad_logp, Tensor? grad_ent, float scale, str backend, bool checks, str name)"
        " -> Tensor",
        _token_logprobs_backward_kernel,
        _token_logprobs_backward_fake,
        _setup_logprobs,
        _logprobs_gradients,
        check=_check_logprobs,
        backward_check=_check_logprobs_backward,
    )
)


def _logprobs(
    logits: Tensor,
    tokens: Tensor | None,
    temperature: object,
    entropy: bool,
    name: str,
    tokens_name: str = "tokens",
    keep: Tensor | None = None,
    shifted: bool = False,
) -> tuple[Tensor, Tensor]:
    """The validated entry to :func:`_token_logprobs_forward` for the public function ``name``.

    Returns ``(log-probs, entropies)``; an output not asked for is an empty placeholder.
    ``keep`` and ``shifted`` as :func:`_token_logprobs_forward`'s; with ``shifted`` the outputs lack
    the last position (``(..., T - 1)``).
    """
    logits_name = "logits"
    check_floating(logits_name, logits, min_ndim=1)
    scale = inverse_temperature("temperature", temperature, compute_dtype(logits.dtype))
    vocab = logits.shape[-1]
    if vocab == 0:
        raise ValueError(
            f"{logits_name} must have a non-empty last (vocabulary) axis, got {tuple(logits.shape)}"
        )
    ids = None
    if tokens is not None:
        check_same_device(tokens_name, check_token_ids(tokens_name, tokens), logits_name, logits)
        ids = check_tokens(tokens_name, tokens, logits.shape[:-1], vocab)
    logp: Tensor
    ent: Tensor
    backend = select_backend(logits).name
    logp, ent, _ = _token_logprobs(
        logits, ids, keep, shifted, scale, entropy, backend, value_checks_enabled(), name
    )
    if shifted:
        logp = logp if tokens is None else logp[..., :-1]
        ent = ent[..., :-1] if entropy else ent
    for result in (logp, ent):
        check_no_nan(
            result,
            f"{logits_name} contain NaN or +inf, or a row whose logits are all -inf; "
            "got a NaN log-prob or entropy in those rows",
        )
    return logp, ent


def get_logprobs_for_tokens(logits: Tensor, tokens: Tensor, *, temperature: float = 1.0) -> Tensor:
    r"""Log-probability of each chosen token under the softmax of its logits.

    .. math::

        \begin{aligned}
        \log \pi(y_t) &= z_{t, y_t} / T \\
        &\quad - \log \textstyle\sum_v e^{z_{t, v} / T}
        \end{aligned}

    Args:
        logits: ``(..., V)`` floating tensor; ``(B, T, V)`` in a language model. Position ``t``
            must already score ``tokens[..., t]`` (apply the next-token shift first, see
            chapter 2, or call :func:`next_token_logprobs`). ``-inf`` entries (masked
            vocabulary) are allowed.
        tokens: ``(...)`` integer token ids in ``[0, V)``, the leading shape of ``logits``.
        temperature: the sampling temperature ``T`` (finite, > 0): the distribution is
            ``softmax(logits / T)``. ``1/T`` is folded into the per-block arithmetic: the
            logits are not copied.

    Returns:
        ``(...)`` log-probabilities. Half-precision (bf16/fp16) logits are computed in fp32 and
        returned as fp32; fp32 and fp64 keep their dtype. Differentiable w.r.t. ``logits``
        (once: a second derivative raises a ``RuntimeError`` saying so).

    Memory: never builds a full ``(..., V)`` log-prob tensor. Forward and backward work over
    blocks of rows and keep one fp32 block and two numbers per row besides the
    inputs (and, in backward, the gradient itself). A token whose logit is ``-inf`` has
    log-prob ``-inf``.
    Threads: one sequential loop over the blocks in the calling thread, whose ops use
    torch's intra-op threads; no setting of the process is changed.
    Accuracy: the log-prob is ``-log s`` with ``s`` the sum of ``exp((z - z_y) / T)``, so a
    common offset of the logits (``1e4``, say) costs no digits, as with ``log_softmax``.

    Raises:
        TypeError, ValueError: wrong types, shapes, devices, token ids outside ``[0, V)``, a
            temperature that is not finite and positive; NaN or ``+inf`` logits, or a row
            whose logits are all ``-inf``.

    Example:
        >>> logits = torch.tensor([[[2.0, 0.0, 0.0], [0.0, 0.0, 0.0]]])
        >>> get_logprobs_for_tokens(logits, torch.tensor([[0, 2]]))
        tensor([[-0.2395, -1.0986]])
        >>> get_logprobs_for_tokens(logits, torch.tensor([[0, 2]]), temperature=2.0)
        tensor([[-0.5514, -1.0986]])
    """
    return _logprobs(logits, tokens, temperature, False, "get_logprobs_for_tokens")[0]


@overload
def next_token_logprobs(
    logits: Tensor,
    input_ids: Tensor,
    *,
    position_ids: Tensor | None = ...,
    cu_seqlens: Tensor | None = ...,
    temperature: float = ...,
    return_entropy: Literal[False] = ...,
) -> Tensor: ...
@overload
def next_token_logprobs(
    logits: Tensor,
    input_ids: Tensor,
    *,
    position_ids: Tensor | None = ...,
    cu_seqlens: Tensor | None = ...,
    temperature: float = ...,
    return_entropy: Literal[True],
) -> tuple[Tensor, Tensor]: ...
def next_token_logprobs(
    logits: Tensor,
    input_ids: Tensor,
    *,
    position_ids: Tensor | None = None,
    cu_seqlens: Tensor | None = None,
    temperature: float = 1.0,
    return_entropy: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    r"""Log-probs of ``input_ids[..., 1:]`` under ``logits[..., :-1, :]``: the shift done right.

    A causal language model's logits at position ``t`` score the token at ``t + 1``.

    .. math::

        \begin{aligned}
        &\log \pi(x_{t+1} \mid x_{\le t}) \\
        &\quad = \big[\log\operatorname{softmax}(z_t / T)\big]_{x_{t+1}}, \\
        &t = 0, \dots, T_\text{seq} - 2
        \end{aligned}

    Args:
        logits: ``(..., T, V)`` floating logits of a causal LM for the sequences ``input_ids``.
        input_ids: ``(..., T)`` integer token ids in ``[0, V)``, the leading shape of
            ``logits``.
        position_ids: packed batches (see :func:`~klpen.sequence_ids`): ``(1, total)``
            positions restarting at 0 at each sequence.
        cu_seqlens: packed batches: ``(S + 1,)`` cumulative sequence lengths.
        temperature: finite, > 0, as in :func:`get_logprobs_for_tokens`.
        return_entropy: also return the entropy of each of those next-token distributions,
            ``softmax(logits[..., :-1, :] / T)``, from the same read of the logits (as
            :func:`~klpen.logprobs_and_entropy`; what a GRPO loss with an entropy bonus needs).

    Packed (``position_ids`` or ``cu_seqlens``, with ``(1, total, V)`` logits): an entry whose
    next token starts a new sequence is no next-token log-prob; it is 0 (its entropy too) and
    takes no gradient, and whatever the logits hold at those positions (NaN, ``±inf``)
    reaches neither.

    Returns:
        ``(..., T - 1)`` log-probabilities (fp32 for half-precision logits), or ``(logprobs,
        entropy)``. The logits are read in place: nothing of size ``(..., V)`` is copied.
        Differentiable w.r.t. ``logits`` (the last position gets a zero gradient, written by
        the kernel with the rest: no ``(..., T, V)`` copy in backward either).

    Raises:
        TypeError, ValueError: as :func:`get_logprobs_for_tokens`, naming ``logits`` and
            ``input_ids``; logits with fewer than 2 dimensions.

    Example:
        >>> logits = torch.tensor([[[0.0, 0.0], [2.0, 0.0], [9.0, 9.0]]])
        >>> next_token_logprobs(logits, torch.tensor([[1, 0, 1]]))
        tensor([[-0.6931, -2.1269]])
        >>> packed = torch.zeros(1, 4, 2)  # two sequences of two tokens, one row
        >>> next_token_logprobs(packed, torch.tensor([[0, 1, 0, 1]]),
        ...                     position_ids=torch.tensor([[0, 1, 0, 1]]))
        tensor([[-0.6931,  0.0000, -0.6931]])
        >>> next_token_logprobs(logits, torch.tensor([[1, 0, 1]]), return_entropy=True)[1]
        tensor([[0.6931, 0.3653]])
    """
    check_floating("logits", logits, min_ndim=2)
    ids = check_token_ids("input_ids", input_ids)
    if tuple(ids.shape) != tuple(logits.shape[:-1]):
        raise ValueError(
            f"input_ids must have shape {tuple(logits.shape[:-1])} (the leading shape of "
            f"logits), got {tuple(ids.shape)}"
        )
    keep = None
    if position_ids is not None or cu_seqlens is not None:
        boundary = next_token_keep(ids, position_ids, cu_seqlens)
        keep = torch.cat([boundary, boundary.new_ones((*boundary.shape[:-1], 1))], dim=-1)
    logp, ent = _logprobs(
        logits,
        ids,
        temperature,
        bool(return_entropy),
        "next_token_logprobs",
        tokens_name="input_ids",
        keep=keep,
        shifted=True,
    )
    return (logp, ent) if return_entropy else logp


def calculate_kl_penalty(
    log_probs_rl: Tensor, log_probs_sft: Tensor, actions: Tensor, beta: float
) -> Tensor:
    r"""Per-token sampled KL penalty ``beta * (log π_rl(a) - log π_sft(a))`` (the k1 estimate).

    Args:
        log_probs_rl: ``(B, T, V)`` log-probabilities of the policy being trained.
        log_probs_sft: ``(B, T, V)`` log-probabilities of the frozen reference (SFT) model.
            No gradient ever reaches it: it is detached.
        actions: ``(B, T)`` integer ids of the tokens taken, in ``[0, V)``.
        beta: finite, non-negative penalty coefficient, within the range of the compute dtype
            (the promoted dtype of the inputs: ``1e39`` is refused in float32).

    Returns:
        ``(B, T)`` tensor in the promoted dtype of the two inputs; differentiable w.r.t.
        ``log_probs_rl``.

    Example:
        >>> rl = torch.log(torch.tensor([[[0.5, 0.25, 0.25]]]))
        >>> sft = torch.log(torch.tensor([[[0.25, 0.5, 0.25]]]))
        >>> calculate_kl_penalty(rl, sft, torch.tensor([[0]]), beta=0.1)
        tensor([[0.0693]])
    """
    check_floating("log_probs_rl", log_probs_rl, min_ndim=3)
    check_floating("log_probs_sft", log_probs_sft, min_ndim=3)
    if log_probs_rl.dim() != 3:
        raise ValueError(f"log_probs_rl must have shape (B, T, V), got {tuple(log_probs_rl.shape)}")
    if log_probs_sft.shape != log_probs_rl.shape:
        raise ValueError(
            f"log_probs_sft must have the shape of log_probs_rl {tuple(log_probs_rl.shape)}, "
            f"got {tuple(log_probs_sft.shape)}"
        )
    check_same_device("log_probs_sft", log_probs_sft, "log_probs_rl", log_probs_rl)
    check_same_device("actions", check_token_ids("actions", actions), "log_probs_rl", log_probs_rl)
    ids = check_tokens("actions", actions, log_probs_rl.shape[:-1], log_probs_rl.shape[-1])
    b = check_coef("beta", beta)
    check_coef_fits("beta", b, promoted_dtype(log_probs_rl, log_probs_sft))
    index = ids.unsqueeze(-1)
    taken_rl = log_probs_rl.gather(-1, index).squeeze(-1)
    taken_sft = log_probs_sft.detach().gather(-1, index).squeeze(-1)
    # Only the taken entries reach the result: a NaN there would come back silently.
    check_no_nan_at("log_probs_rl", taken_rl)
    check_no_nan_at("log_probs_sft", taken_sft)
    return b * (taken_rl - taken_sft)
