r"""On-policy distillation: divergences between a student (the policy) and a teacher.

Contract section 10. "Forward" is ``KL(teacher ‖ student)``, "reverse" ``KL(student ‖
teacher)``. Four names:

* :func:`generalized_jsd`: TRL's generalized Jensen-Shannon divergence (GKD), exact per
  position over the vocabulary, memory-bounded, both gradients;
* :func:`linear_generalized_jsd`: the same from the two models' hidden states and output
  layers (hidden sizes may differ), never building either ``(N, V)`` logits tensor;
* :func:`topk_kl`: a teacher known only by its top-k log-probs, with an estimate and bounds
  that contain the full-vocabulary divergence for every teacher consistent with them;
* :func:`distillation_rewards`: the per-token reverse-KL reward on the student's samples.

Teacher and student must share a tokenizer (the same token ids); different tokenizers are
out of scope. A teacher whose embedding is padded (Qwen's 152,064 rows for a 151,936-token
vocabulary) is handled by the explicit ``vocab_size=`` argument, never by a silent slice.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, NamedTuple

import torch
from torch import Tensor

from ._autograd import owned
from ._ops import KernelOp, expect, expect_ndim, expect_shape, kernel_op
from ._validation import (
    check_all,
    check_choice,
    check_coef,
    check_coef_fits,
    check_floating,
    check_mask,
    check_no_nan,
    check_no_nan_at,
    check_same_device,
    check_shape,
    check_token_ids,
    inverse_temperature,
    promoted_dtype,
    scaled_penalty,
    validation,
    value_checks_enabled,
)
from .kernels import backend_named, select_backend
from .kernels.blocks import compute_dtype, row_blocks
from .kernels.torch_jsd import (
    JSD_SAVED_COLUMNS,
    JSD_WORK_BLOCKS,
    jsd_backward_saved,
    jsd_block_rows,
    jsd_forward_saved,
)
from .linear import check_layer, layer_dtype
from .masking import AGGREGATION_MODES, aggregation_weights
from .packing import check_sequence_ids

__all__ = [
    "TopKKL",
    "distillation_rewards",
    "generalized_jsd",
    "linear_generalized_jsd",
    "topk_kl",
]


# --- generalized_jsd: the custom operator -------------------------------------------------


def _jsd_forward(
    student: Tensor,
    teacher: Tensor,
    scale: float,
    beta: float,
    backend: str,
    checks: bool,
    name: str,
) -> tuple[Tensor, list[Tensor]]:
    """``J_β`` per row of the ``(..., V)`` logits by the backend's kernels (the backend
    protocol's ``jsd_forward``), and the per-row statistics its backward reads (``O(N)``)."""
    with validation(checks):
        out, saved = backend_named(backend).jsd_forward(student, teacher, scale, beta)
    out, *rest = owned((out, *saved), (student, teacher))
    return out, rest


def _jsd_fake(
    student: Tensor,
    teacher: Tensor,
    scale: float,
    beta: float,
    backend: str,
    checks: bool,
    name: str,
) -> tuple[Tensor, list[Tensor]]:
    dtype = compute_dtype(torch.promote_types(student.dtype, teacher.dtype))
    with validation(checks):
        saved = backend_named(backend).jsd_saved_like(student, teacher)
    return student.new_empty(student.shape[:-1], dtype=dtype), list(saved)


def _jsd_backward_kernel(
    student: Tensor,
    teacher: Tensor,
    saved: list[Tensor],
    grad: Tensor,
    scale: float,
    beta: float,
    backend: str,
    checks: bool,
    needs: list[bool],
    name: str,
) -> tuple[Tensor, Tensor]:
    """``(d/dstudent, d/dteacher)`` of ``sum(grad * J)`` (the backend protocol's
    ``jsd_backward``); an empty placeholder for a side that ``needs`` leaves out."""
    with validation(checks):
        gz, gw = backend_named(backend).jsd_backward(
            student, teacher, tuple(saved), grad, scale, beta, (needs[0], needs[1])
        )
    empty = student.new_empty(0)
    return (empty if gz is None else gz, empty.clone() if gw is None else gw)


def _jsd_backward_fake(student: Tensor, teacher: Tensor, *args: Any) -> tuple[Tensor, Tensor]:
    needs = args[6]  # after saved, grad, scale, beta, backend, checks
    return (
        student.new_empty(student.shape if needs[0] else (0,)),
        teacher.new_empty(teacher.shape) if needs[1] else student.new_empty(0),
    )


def _jsd_setup(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    student, teacher, scale, beta, backend, checks, name = inputs
    _, saved = output
    ctx.save_for_backward(student, teacher, *saved)
    ctx.args = (scale, beta, backend, checks)
    ctx.name = name
    ctx.mark_non_differentiable(*saved)


def _jsd_gradients(ctx: Any, grad: Tensor, _saved: Any) -> tuple[Tensor | None, ...]:
    student, teacher, *saved = ctx.saved_tensors
    needs = [bool(ctx.needs_input_grad[0]), bool(ctx.needs_input_grad[1])]
    gz = gw = None
    if any(needs):
        gz, gw = _jsd_backward_op(student, teacher, saved, grad, *ctx.args, needs, ctx.name)
    return (gz if needs[0] else None, gw if needs[1] else None, None, None, None, None, None)


def _check_jsd(student: Tensor, teacher: Tensor, *args: Any) -> None:
    # what the fake implementations promise: (..., V) logits of one shape
    expect_ndim("klpen::generalized_jsd", "student", student, 1)
    expect_shape("klpen::generalized_jsd", "teacher", teacher, student.shape)


def _check_jsd_backward(
    student: Tensor, teacher: Tensor, saved: list[Tensor], grad: Tensor, *args: Any
) -> None:
    op = "klpen::generalized_jsd_backward"
    expect_ndim(op, "student", student, 1)
    expect_shape(op, "teacher", teacher, student.shape)
    expect_shape(op, "grad", grad, student.shape[:-1])
    needs = args[4]  # after scale, beta, backend, checks
    expect(op, len(needs) == 2, f"needs must have 2 entries, got {len(needs)}")


_jsd_op, _jsd_backward_op = kernel_op(
    KernelOp(
        "generalized_jsd",
        "(Tensor student, Tensor teacher, float scale, float beta, str backend, bool checks, "
        "str name) -> (Tensor, Tensor[])",
        _jsd_forward,
        _jsd_fake,
        "(Tensor student, Tensor teacher, Tensor[] saved, Tensor grad, float scale, float beta, "
        "str backend, bool checks, bool[] needs, str name) -> (Tensor, Tensor)",
        _jsd_backward_kernel,
        _jsd_backward_fake,
        _jsd_setup,
        _jsd_gradients,
        check=_check_jsd,
        backward_check=_check_jsd_backward,
    )
)


def _check_beta(beta: object) -> float:
    """``beta`` in ``[0, 1]`` (comparisons only: traceable with a symbolic float)."""
    b = check_coef("beta", beta)
    if b > 1.0:
        raise ValueError(f"beta must lie in [0, 1] (the teacher's weight in the mixture), got {b}")
    return b


def _vocab_rows(names: tuple[str, str], sizes: tuple[int, int], vocab_size: object) -> int | None:
    """The number of leading vocabulary entries to use: ``None`` (all) when the two sizes
    agree and no ``vocab_size`` is given; refuses a mismatch without ``vocab_size``."""
    if vocab_size is None:
        if sizes[0] != sizes[1]:
            raise ValueError(
                f"{names[0]} has a vocabulary of {sizes[0]} entries but {names[1]} has "
                f"{sizes[1]}; if one is padded (e.g. an embedding of 152,064 rows for a "
                "151,936-token vocabulary), pass vocab_size= the real vocabulary size (the "
                "leading entries of both); different tokenizers are not supported"
            )
        return None
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int):
        raise TypeError(f"vocab_size must be an int or None, got {type(vocab_size).__name__}")
    if not 1 <= vocab_size <= min(sizes):
        raise ValueError(
            f"vocab_size must lie in [1, {min(sizes)}] (at most the vocabulary of {names[0]}, "
            f"{sizes[0]}, and of {names[1]}, {sizes[1]}), got {vocab_size}"
        )
    return vocab_size


def generalized_jsd(
    student_logits: Tensor,
    teacher_logits: Tensor,
    *,
    beta: float = 0.5,
    temperature: float = 1.0,
    vocab_size: int | None = None,
) -> Tensor:
    r"""The generalized Jensen-Shannon divergence of GKD, exact per position.

    With ``p = softmax(z / T)`` (student), ``q = softmax(w / T)`` (teacher) and the mixture
    ``m = β q + (1 - β) p``, TRL's ``GKDTrainer.generalized_jsd_loss`` before masking and
    reduction:

    .. math:: J_0 = \mathrm{KL}(q \,\|\, p), \qquad J_1 = \mathrm{KL}(p \,\|\, q),

    .. math::

        J_\beta = {} & \beta\,\mathrm{KL}(q \,\|\, m) \\
            & + (1 - \beta)\,\mathrm{KL}(p \,\|\, m)

    (β = 0 forward, β = 1 reverse, the mixture for 0 < β < 1; in between, ``J_β → 0`` as
    β → 0 or 1: the ends are TRL's, not limits). Computed without cancellation (see
    ``klpen.kernels.torch_jsd``: a sum of non-negative per-token terms where the
    divergence is small): exact to rounding for near-identical distributions, at any
    common offset of the logits and for β within ``1e-12`` of an end (where the value is of
    the size of ``min(β, 1 - β)``), exactly 0 for identical rows.

    Args:
        student_logits: ``(..., V)`` floating logits ``z`` of the student.
        teacher_logits: ``(..., V')`` floating logits ``w`` of the teacher, same leading shape.
        beta: the teacher's weight β in the mixture, in ``[0, 1]``.
        temperature: ``T``, finite and > 0, dividing both logits.
        vocab_size: ``None`` (``V`` and ``V'`` must be equal), or the real vocabulary size
            when one of the two is padded: the leading ``vocab_size`` entries of both are used
            (views, no copy). The two models must share a tokenizer.

    Returns:
        ``(...)`` divergences in the promoted dtype (fp32 for half input), never negative.
        Differentiable once w.r.t. both logits (the teacher's where it requires grad). Memory:
        no ``(..., V)`` temporary beyond a block of rows.

    Edge cases: ``-inf`` logits are tokens of probability 0; for ``0 < β < 1`` the value is
    then finite; at β = 0 (β = 1) it is ``+inf`` where the student (teacher) has probability
    0 and the other has mass.

    Raises:
        TypeError, ValueError: non-tensors, integer dtypes, mismatched leading shapes or
            devices, vocabularies that differ without ``vocab_size``, a ``beta`` outside
            ``[0, 1]``, a temperature that is not finite and positive; NaN or ``+inf``
            logits, or a row of ``-inf`` only (a value check on the result, skipped under
            ``klpen.validation(False)`` and inside ``torch.compile``).

    Example:
        >>> z = torch.tensor([[2.0, 0.0, 0.0]])
        >>> generalized_jsd(z, z)
        tensor([0.])
        >>> generalized_jsd(z, torch.zeros(1, 3), beta=1.0)  # KL(student || teacher)
        tensor([0.4330])
        >>> generalized_jsd(z, torch.zeros(1, 3), beta=0.5)
        tensor([0.1087])
    """
    z = check_floating("student_logits", student_logits, min_ndim=1)
    w = check_floating("teacher_logits", teacher_logits, min_ndim=1)
    check_shape(
        "teacher_logits",
        w,
        (*z.shape[:-1], w.shape[-1]),
        "the leading shape of student_logits",
    )
    check_same_device("teacher_logits", w, "student_logits", z)
    rows = _vocab_rows(("student_logits", "teacher_logits"), (z.shape[-1], w.shape[-1]), vocab_size)
    if rows is not None:
        z, w = z[..., :rows], w[..., :rows]
    if z.shape[-1] == 0:
        raise ValueError(
            f"student_logits must have a non-empty last (vocabulary) axis, got {tuple(z.shape)}"
        )
    b = _check_beta(beta)
    dtype = compute_dtype(torch.promote_types(z.dtype, w.dtype))
    scale = inverse_temperature("temperature", temperature, dtype)
    backend = select_backend(z).name
    out, _ = _jsd_op(z, w, scale, b, backend, value_checks_enabled(), "generalized_jsd")
    return check_no_nan(
        out,
        "student_logits or teacher_logits contain NaN or +inf, or a row whose logits are all "
        "-inf; got a NaN divergence in those rows",
    )


# --- linear_generalized_jsd ---------------------------------------------------------------

# Elements of one chunk of logits, per model (16 MiB in fp32): each call builds (rows, V)
# logits of both models into two buffers reused by every chunk, and the backward writes the
# student's gradient over its logits. Large enough for the matrix products to run about as
# fast as whole-tensor ones, small enough that the call's scratch stays below a tenth of one
# (8, 512, 32000) fp32 logits tensor.
LINEAR_CHUNK_ELEMENTS = 1 << 22


def _chunk_rows(vocab: int, rows: int) -> int:
    """Rows per chunk for a vocabulary of ``vocab`` and ``rows`` rows in all (at least 1)."""
    return max(1, min(rows, LINEAR_CHUNK_ELEMENTS // max(vocab, 1)))


def _logits_into(h: Tensor, w: Tensor, b: Tensor | None, out: Tensor) -> Tensor:
    """``h @ w.T + b`` written into ``out`` (``h``, ``w``, ``b`` already in its dtype)."""
    if b is None:
        return torch.mm(h, w.T, out=out)
    return torch.addmm(b, h, w.T, out=out)


def _chunk_layers(
    layers: tuple[Tensor | None, ...], dtype: torch.dtype
) -> tuple[Tensor | None, ...]:
    """The tensors in the compute dtype, converted once per call (no copy when they are)."""
    return tuple(None if x is None else x.to(dtype) for x in layers)


def _chunk_buffers(
    rows: int, vocab: int, dtype: torch.dtype, device: torch.device
) -> tuple[Tensor, Tensor, tuple[Tensor, ...]]:
    """The scratch of one call, one allocation: two ``(rows, V)`` logits buffers (student,
    teacher) and the ``work`` blocks of :func:`~klpen.kernels.torch_jsd.jsd_forward_saved`
    and :func:`~klpen.kernels.torch_jsd.jsd_backward_saved`."""
    block = min(jsd_block_rows(vocab), rows)
    buf = torch.empty(2 * rows + JSD_WORK_BLOCKS * block, vocab, dtype=dtype, device=device)
    work = tuple(buf[2 * rows + i * block :][:block] for i in range(JSD_WORK_BLOCKS))
    return buf[:rows], buf[rows : 2 * rows], work


class _Chunk(NamedTuple):
    """One chunk of rows of :func:`_logit_chunks`: its rows, hidden states and logits (in
    the compute dtype; the logits valid until the next chunk), the converted weights and the
    JSD scratch."""

    rows: slice
    h_s: Tensor
    h_t: Tensor
    z: Tensor
    w: Tensor
    sw: Tensor
    tw: Tensor
    work: tuple[Tensor, ...]


#: ``(sh, sw, th, tw, sb, tb)``: both models' hidden states, weights and biases
Layers = tuple[Tensor, Tensor, Tensor, Tensor, Tensor | None, Tensor | None]


def _logit_chunks(
    layers: Layers,
    dtype: torch.dtype,
    valid: Tensor | None = None,
) -> Iterator[_Chunk]:
    """The chunks of rows of both models' logits, ``sh @ sw.T + sb`` and ``th @ tw.T + tb``
    for ``layers = (sh, sw, th, tw, sb, tb)``, built in ``dtype`` into one call's buffers
    (:func:`_chunk_buffers`, :func:`_chunk_rows`); the weights converted once. ``valid``:
    an optional ``(N,)`` bool mask; the hidden states of the other rows are taken as zeros
    (whatever they hold, NaN included, reaches neither the logits nor ``h_s``, ``h_t``)."""
    sh, sw, th, tw, sb, tb = layers
    n, vocab = sh.shape[0], sw.shape[0]
    if n == 0:
        return
    sw_, tw_, sb_, tb_ = _chunk_layers((sw, tw, sb, tb), dtype)
    assert sw_ is not None and tw_ is not None
    rows = _chunk_rows(vocab, n)
    z_buf, w_buf, work = _chunk_buffers(rows, vocab, dtype, sh.device)
    for start in range(0, n, rows):
        stop = min(start + rows, n)
        h_s, h_t = sh[start:stop].to(dtype), th[start:stop].to(dtype)
        if valid is not None:
            keep = valid[start:stop, None]
            h_s, h_t = torch.where(keep, h_s, 0), torch.where(keep, h_t, 0)
        z = _logits_into(h_s, sw_, sb_, z_buf[: stop - start])
        w = _logits_into(h_t, tw_, tb_, w_buf[: stop - start])
        yield _Chunk(slice(start, stop), h_s, h_t, z, w, sw_, tw_, work)


def _jsd_pass(
    layers: Layers,
    scale: float,
    beta: float,
    checks: bool,
    weights: Tensor | None = None,
    needs: list[bool] | None = None,
) -> tuple[Tensor, Tensor, list[Tensor | None]]:
    """One pass over the chunks of rows of ``layers = (sh, sw, th, tw, sb, tb)``: ``J_β`` of
    each row of ``sh @ sw.T + sb`` and ``th @ tw.T + tb`` (``(N, H)`` and ``(N, H')`` hidden
    states, ``(V, H)`` and ``(V, H')`` weights) and the ``(N, 6)`` per-row statistics the
    backward reads (:func:`~klpen.kernels.torch_jsd.jsd_forward_saved`).

    With ``(N,)`` ``weights``, also the gradients of ``Σ weights · J`` w.r.t. the layers
    ``needs`` asks for (accumulators in the compute dtype, ``None`` for the others), each
    chunk's taken as soon as its values are (:func:`_chunk_gradients`); rows of weight 0 are
    masked: their hidden states are taken as zeros, so whatever they hold reaches neither a
    value nor a gradient."""
    sh = layers[0]
    dtype = layer_dtype(*layers)
    n = sh.shape[0]
    out = torch.empty(n, dtype=dtype, device=sh.device)
    saved = torch.empty(n, JSD_SAVED_COLUMNS, dtype=dtype, device=sh.device)
    acc = _gradient_buffers(layers, needs or [False] * 6, dtype)
    valid = None if weights is None else weights != 0
    w = None if weights is None else weights.to(dtype)
    with validation(checks):
        for c in _logit_chunks(layers, dtype, valid):
            stats = saved[c.rows]
            jsd_forward_saved(c.z, c.w, scale, beta, out=(out[c.rows], stats), work=c.work)
            if w is not None and any(a is not None for a in acc):
                _chunk_gradients(c, stats, w[c.rows], scale, beta, acc)
    return out, saved, acc


def _linear_jsd_forward(
    sh: Tensor,
    sw: Tensor,
    th: Tensor,
    tw: Tensor,
    sb: Tensor | None,
    tb: Tensor | None,
    scale: float,
    beta: float,
    checks: bool,
    name: str,
) -> tuple[Tensor, list[Tensor]]:
    """``J_β`` per row and the per-row statistics the backward reads (:func:`_jsd_pass`)."""
    out, saved, _ = _jsd_pass((sh, sw, th, tw, sb, tb), scale, beta, checks)
    return out, [saved]


def _linear_jsd_fake(
    sh: Tensor, sw: Tensor, th: Tensor, tw: Tensor, sb: Tensor | None, tb: Tensor | None, *args: Any
) -> tuple[Tensor, list[Tensor]]:
    dtype = layer_dtype(sh, sw, th, tw, sb, tb)
    saved = sh.new_empty((sh.shape[0], JSD_SAVED_COLUMNS), dtype=dtype)
    return sh.new_empty(sh.shape[0], dtype=dtype), [saved]


def _gradient_buffers(
    inputs: tuple[Tensor | None, ...], needs: list[bool], dtype: torch.dtype
) -> list[Tensor | None]:
    """Zeroed accumulators in ``dtype`` for the ``inputs`` whose gradient ``needs`` asks for
    (``None`` for the others)."""
    return [
        torch.zeros(x.shape, dtype=dtype, device=x.device) if need and x is not None else None
        for x, need in zip(inputs, needs, strict=True)
    ]


def _chunk_gradients(
    c: _Chunk,
    saved: Tensor,
    grad: Tensor,
    scale: float,
    beta: float,
    acc: list[Tensor | None],
) -> None:
    """Add to the accumulators ``acc`` (over ``sh, sw, th, tw, sb, tb``) the gradients of
    ``sum(grad · J)`` over the chunk ``c``'s rows: the logits' gradients by
    :func:`~klpen.kernels.torch_jsd.jsd_backward_saved` from the chunk's statistics ``saved``
    (written over the chunk's logits), multiplied back through the layers."""
    side = (any(acc[i] is not None for i in (0, 1, 4)), any(acc[i] is not None for i in (2, 3, 5)))
    gz, gw = jsd_backward_saved(
        c.z,
        c.w,
        saved,
        grad,
        scale,
        beta,
        side,
        out=(c.z if side[0] else None, c.w if side[1] else None),
        work=c.work,
    )
    for g_logits, h, lay, (ih, iw, ib) in (
        (gz, c.h_s, c.sw, (0, 1, 4)),
        (gw, c.h_t, c.tw, (2, 3, 5)),
    ):
        if g_logits is None:
            continue
        out_h, out_w, out_b = acc[ih], acc[iw], acc[ib]
        if out_h is not None:
            torch.mm(g_logits, lay, out=out_h[c.rows])
        if out_w is not None:
            out_w.addmm_(g_logits.T, h)
        if out_b is not None:
            out_b.add_(g_logits.sum(0))


def _linear_jsd_backward_kernel(
    sh: Tensor,
    sw: Tensor,
    th: Tensor,
    tw: Tensor,
    sb: Tensor | None,
    tb: Tensor | None,
    saved: list[Tensor],
    grad: Tensor,
    scale: float,
    beta: float,
    checks: bool,
    needs: list[bool],
    name: str,
) -> list[Tensor]:
    """Gradients w.r.t. ``sh, sw, th, tw, sb, tb`` of ``sum(grad * J)`` (an empty placeholder
    for those ``needs`` leaves out): the chunk's logits are rebuilt, their gradients taken by
    :func:`_chunk_gradients` from the forward's statistics ``saved``. The teacher's logits are
    rebuilt for the student's gradient too (it depends on them token by token); only the
    teacher's gradients are skipped when none is asked for."""
    dtype = layer_dtype(sh, sw, th, tw, sb, tb)
    inputs = (sh, sw, th, tw, sb, tb)
    acc = _gradient_buffers(inputs, needs, dtype)
    if any(a is not None for a in acc):
        with validation(checks):
            for c in _logit_chunks(inputs, dtype):
                _chunk_gradients(c, saved[0][c.rows], grad[c.rows], scale, beta, acc)
    empty = sh.new_empty(0)
    return [
        empty.clone() if a is None else a.to(x.dtype)  # type: ignore[union-attr]
        for a, x in zip(acc, inputs, strict=True)
    ]


def _linear_jsd_backward_fake(*args: Any) -> list[Tensor]:
    inputs, needs = args[:6], args[11]
    empty = args[0].new_empty(0)
    return [
        x.new_empty(x.shape) if need and x is not None else empty.clone()
        for x, need in zip(inputs, needs, strict=True)
    ]


def _linear_setup(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    sh, sw, th, tw, sb, tb, scale, beta, checks, name = inputs
    _, saved = output
    ctx.save_for_backward(sh, sw, th, tw, sb, tb, *saved)
    ctx.args = (scale, beta, checks)
    ctx.name = name
    ctx.mark_non_differentiable(*saved)


def _linear_gradients(ctx: Any, grad: Tensor, _saved: Any) -> tuple[Tensor | None, ...]:
    layers, saved = ctx.saved_tensors[:6], list(ctx.saved_tensors[6:])
    needs = [bool(ctx.needs_input_grad[i]) and layers[i] is not None for i in range(6)]
    grads: list[Tensor | None] = [None] * 6
    if any(needs):
        out = _linear_jsd_backward_op(*layers, saved, grad, *ctx.args, needs, ctx.name)
        grads = [g if need else None for g, need in zip(out, needs, strict=True)]
    return (*grads, None, None, None, None)


def _check_linear_jsd(
    sh: Tensor,
    sw: Tensor,
    th: Tensor,
    tw: Tensor,
    sb: Tensor | None,
    tb: Tensor | None,
    *args: Any,
    op: str = "klpen::linear_generalized_jsd",
) -> None:
    # what the fake implementations promise: (N, H), (V, H), (N, H'), (V, H'), (V,), (V,)
    for name, x in (("sh", sh), ("sw", sw), ("th", th), ("tw", tw)):
        expect(op, x.dim() == 2, f"{name} must have 2 dimensions, got shape {tuple(x.shape)}")
    vocab, rows = sw.shape[0], sh.shape[0]
    expect_shape(op, "sw", sw, (vocab, sh.shape[1]))
    expect_shape(op, "th", th, (rows, th.shape[1]))
    expect_shape(op, "tw", tw, (vocab, th.shape[1]))
    expect_shape(op, "sb", sb, (vocab,))
    expect_shape(op, "tb", tb, (vocab,))


def _check_linear_jsd_backward(
    sh: Tensor,
    sw: Tensor,
    th: Tensor,
    tw: Tensor,
    sb: Tensor | None,
    tb: Tensor | None,
    saved: list[Tensor],
    grad: Tensor,
    *args: Any,
) -> None:
    op = "klpen::linear_generalized_jsd_backward"
    _check_linear_jsd(sh, sw, th, tw, sb, tb, op=op)
    expect_shape(op, "grad", grad, (sh.shape[0],))
    needs = args[3]  # after scale, beta, checks
    expect(op, len(needs) == 6, f"needs must have 6 entries, got {len(needs)}")
    expect(op, len(saved) == 1, f"saved must hold 1 tensor, got {len(saved)}")
    expect_shape(op, "saved[0]", saved[0], (sh.shape[0], JSD_SAVED_COLUMNS))


_linear_jsd_op, _linear_jsd_backward_op = kernel_op(
    KernelOp(
        "linear_generalized_jsd",
        "(Tensor sh, Tensor sw, Tensor th, Tensor tw, Tensor? sb, Tensor? tb, float scale, "
        "float beta, bool checks, str name) -> (Tensor, Tensor[])",
        _linear_jsd_forward,
        _linear_jsd_fake,
        "(Tensor sh, Tensor sw, Tensor th, Tensor tw, Tensor? sb, Tensor? tb, Tensor[] saved, "
        "Tensor grad, float scale, float beta, bool checks, bool[] needs, str name) "
        "-> Tensor[]",
        _linear_jsd_backward_kernel,
        _linear_jsd_backward_fake,
        _linear_setup,
        _linear_gradients,
        check=_check_linear_jsd,
        backward_check=_check_linear_jsd_backward,
    )
)


# --- linear_generalized_jsd, aggregated: the gradients taken in the forward pass ----------


def _linear_jsd_total(*args: Any) -> tuple[Tensor, list[Tensor]]:
    """``Σ weights · J`` over the ``N`` rows (0-d) and its gradients w.r.t. ``sh, sw, th, tw,
    sb, tb`` (those ``needs`` asks for, in the compute dtype; an empty placeholder for the
    others), for the arguments ``(sh, sw, th, tw, sb, tb, weights, scale, beta, checks,
    needs, name)``: one pass (:func:`_jsd_pass`), the ``(N,)`` weights standing for the
    upstream gradient; rows of weight 0 are masked."""
    layers, (weights, scale, beta, checks, needs) = args[:6], args[6:11]
    out, _, acc = _jsd_pass(layers, scale, beta, checks, weights, needs)
    total = torch.where(weights != 0, out * weights.to(out.dtype), 0).sum()
    return total, [out.new_empty(0) if a is None else a for a in acc]


def _linear_jsd_total_fake(
    sh: Tensor, sw: Tensor, th: Tensor, tw: Tensor, sb: Tensor | None, tb: Tensor | None, *args: Any
) -> tuple[Tensor, list[Tensor]]:
    needs = args[4]  # after weights, scale, beta, checks
    dtype = layer_dtype(sh, sw, th, tw, sb, tb)
    inputs = (sh, sw, th, tw, sb, tb)
    grads = [
        sh.new_empty(x.shape if need and x is not None else (0,), dtype=dtype)
        for x, need in zip(inputs, needs, strict=True)
    ]
    return sh.new_empty((), dtype=dtype), grads


def _scaled_gradients(*args: Any) -> list[Tensor]:
    """The forward's gradients ``grads`` times the upstream gradient ``grad`` (0-d), an empty
    placeholder for those ``needs`` leaves out. The layers (the first six arguments) are
    passed only to tie the result to them: its second derivative then raises by name
    (:func:`~klpen._autograd.differentiable_once`), where it would silently be 0."""
    grads, grad, needs = args[6], args[7], args[8]
    return [g * grad if need else g.new_empty(0) for g, need in zip(grads, needs, strict=True)]


def _scaled_gradients_fake(*args: Any) -> list[Tensor]:
    grads, needs = args[6], args[8]
    return [g.new_empty(g.shape if need else (0,)) for g, need in zip(grads, needs, strict=True)]


def _total_setup(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    layers, needs, name = inputs[:6], inputs[10], inputs[11]
    _, grads = output
    ctx.save_for_backward(*layers, *grads)
    ctx.needs = needs
    ctx.dtypes = [None if x is None else x.dtype for x in layers]
    ctx.name = name
    ctx.mark_non_differentiable(*grads)
    # No zero tensors of the gradients' shapes for the (non-differentiable) gradient outputs.
    ctx.set_materialize_grads(False)


def _total_gradients(ctx: Any, grad: Tensor, _grads: Any) -> tuple[Tensor | None, ...]:
    grads: list[Tensor | None] = [None] * 6
    if grad is not None and any(ctx.needs):
        layers, grads_ = ctx.saved_tensors[:6], list(ctx.saved_tensors[6:])
        out = _scaled_gradients_op(*layers, grads_, grad, ctx.needs, ctx.name)
        grads = [
            g.to(dtype) if need else None
            for g, need, dtype in zip(out, ctx.needs, ctx.dtypes, strict=True)
        ]
    return (*grads, None, None, None, None, None, None)


def _check_linear_jsd_total(sh: Tensor, sw: Tensor, th: Tensor, tw: Tensor, *args: Any) -> None:
    op = "klpen::linear_generalized_jsd_total"
    sb, tb, weights, needs = args[0], args[1], args[2], args[6]
    _check_linear_jsd(sh, sw, th, tw, sb, tb, op=op)
    expect_shape(op, "weights", weights, (sh.shape[0],))
    expect(op, len(needs) == 6, f"needs must have 6 entries, got {len(needs)}")


_linear_jsd_total_op, _scaled_gradients_op = kernel_op(
    KernelOp(
        name="linear_generalized_jsd_total",
        schema="(Tensor sh, Tensor sw, Tensor th, Tensor tw, Tensor? sb, Tensor? tb, "
        "Tensor weights, float scale, float beta, bool checks, bool[] needs, str name) "
        "-> (Tensor, Tensor[])",
        forward=_linear_jsd_total,
        fake=_linear_jsd_total_fake,
        backward_schema="(Tensor sh, Tensor sw, Tensor th, Tensor tw, Tensor? sb, Tensor? tb, "
        "Tensor[] grads, Tensor grad, bool[] needs, str name) -> Tensor[]",
        backward=_scaled_gradients,
        backward_fake=_scaled_gradients_fake,
        setup_context=_total_setup,
        gradients=_total_gradients,
        check=_check_linear_jsd_total,
    )
)


def linear_generalized_jsd(
    student_hidden: Tensor,
    student_weight: Tensor,
    teacher_hidden: Tensor,
    teacher_weight: Tensor,
    *,
    beta: float = 0.5,
    temperature: float = 1.0,
    student_bias: Tensor | None = None,
    teacher_bias: Tensor | None = None,
    vocab_size: int | None = None,
    aggregation: str | None = None,
    mask: Tensor | None = None,
    sequence_ids: Tensor | None = None,
) -> Tensor:
    r""":func:`generalized_jsd` of two output layers' logits, never building either.

    What ``generalized_jsd(student_hidden @ student_weight.T + student_bias, teacher_hidden @
    teacher_weight.T + teacher_bias, beta=beta, temperature=temperature)`` returns, computed
    a chunk of rows at a time: each chunk's logits (a few thousandths of the whole for a
    large batch) are built, reduced and freed; the backward pass rebuilds them. The two
    hidden sizes may differ (a teacher of another size).

    **Aggregated** (``aggregation=`` one of :func:`~klpen.aggregate`'s four modes): returns
    ``aggregate(linear_generalized_jsd(...), mask, aggregation, sequence_ids=sequence_ids)``,
    the scalar a trainer minimises, and takes its gradients in the same pass as its value.
    Per position the backward pass must rebuild both logits (the upstream gradient of each
    position is known only then), about ``4 H + 2 H'`` products per token and vocabulary
    entry where the unfused pair spends ``3 H + H'``. The aggregate's gradient w.r.t. each
    position's divergence depends only on ``mask`` and ``sequence_ids``, so here each chunk's
    logits are built once, reduced and differentiated at once, ``3 H + H'`` products as in
    the unfused pair. The gradients are kept from the forward to the backward pass (in the
    compute dtype); the backward pass returns them times the upstream gradient, new tensors
    beside the kept ones until it ends (one more copy of the gradients, where the per-position
    form keeps none). With no input requiring grad none is computed. Whatever the hidden
    states hold at a masked position reaches neither the value nor a gradient.

    Args:
        student_hidden: ``(..., H)`` floating hidden states of the student.
        student_weight: ``(V, H)`` the student's output layer.
        teacher_hidden: ``(..., H')`` the teacher's hidden states, same leading shape.
        teacher_weight: ``(V', H')`` the teacher's output layer.
        beta, temperature: as in :func:`generalized_jsd`.
        student_bias, teacher_bias: optional ``(V,)``, ``(V',)`` biases.
        vocab_size: ``None`` (``V == V'`` required) or the real vocabulary size of a padded
            layer: the leading ``vocab_size`` rows of both layers are used.
        aggregation: ``None`` (per position) or ``"token-mean"``, ``"token-sum"``,
            ``"seq-mean-token-mean"``, ``"seq-mean-token-sum"``: the hidden states are then
            ``(B, T, H)`` and ``(B, T, H')``.
        mask: with ``aggregation`` only: ``(B, T)`` 0/1 valid positions (``None``: all).
        sequence_ids: with ``aggregation`` only: ``(B, T)`` packed sequence ids, as in
            :func:`~klpen.aggregate`.

    Returns:
        ``(...)`` divergences in the promoted dtype of the six tensors (at least fp32),
        differentiable once w.r.t. all of them; with ``aggregation`` a 0-d tensor.

    Raises:
        TypeError, ValueError: what :func:`generalized_jsd` refuses; shapes that do not form
            two layers; vocabularies that differ without ``vocab_size``; an unknown
            ``aggregation``, ``mask`` or ``sequence_ids`` without it, or what
            :func:`~klpen.aggregate` refuses of them. The value checks (NaN at a valid
            position, the mask's and ids' values) are skipped with validation off.

    Example:
        >>> h, w = torch.tensor([[1.0, 0.0]]), torch.tensor([[2.0, 0.0], [0.0, 0.0], [0.0, 1.0]])
        >>> ht, wt = torch.zeros(1, 3), torch.zeros(3, 3)
        >>> linear_generalized_jsd(h, w, ht, wt, beta=1.0)
        tensor([0.4330])
        >>> h = torch.tensor([[[1.0, 0.0], [0.0, 1.0]]])  # (B, T, H) = (1, 2, 2)
        >>> mask = torch.tensor([[1, 0]])
        >>> linear_generalized_jsd(h, w, ht.expand(1, 2, 3), wt, beta=1.0,
        ...                        aggregation="token-mean", mask=mask)
        tensor(0.4330)
    """
    sh, sw, sb = check_layer(
        ("student_hidden", "student_weight", "student_bias"),
        student_hidden,
        student_weight,
        student_bias,
    )
    th, tw, tb = check_layer(
        ("teacher_hidden", "teacher_weight", "teacher_bias"),
        teacher_hidden,
        teacher_weight,
        teacher_bias,
    )
    check_shape(
        "teacher_hidden",
        th,
        (*sh.shape[:-1], th.shape[-1]),
        "the leading shape of student_hidden",
    )
    check_same_device("teacher_hidden", th, "student_hidden", sh)
    rows = _vocab_rows(("student_weight", "teacher_weight"), (sw.shape[0], tw.shape[0]), vocab_size)
    if rows is not None:
        sw, tw = sw[:rows], tw[:rows]
        sb = None if sb is None else sb[:rows]
        tb = None if tb is None else tb[:rows]
    b = _check_beta(beta)
    dtype = layer_dtype(sh, sw, th, tw, sb, tb)
    scale = inverse_temperature("temperature", temperature, dtype)
    aggregated = _aggregated_mask(sh, aggregation, mask, sequence_ids)
    lead, checks = sh.shape[:-1], value_checks_enabled()
    flat = (sh.reshape(-1, sh.shape[-1]), sw, th.reshape(-1, th.shape[-1]), tw, sb, tb)
    inputs = {"student_hidden": sh, "student_weight": sw, "student_bias": sb}
    inputs |= {"teacher_hidden": th, "teacher_weight": tw, "teacher_bias": tb}
    message = (
        "the student's or the teacher's logits contain NaN or +inf (from the hidden states, "
        "weights or biases), or a row of -inf only; got a NaN divergence in those rows"
    )
    if aggregated is None:
        out, _ = _linear_jsd_op(*flat, scale, b, checks, "linear_generalized_jsd")
        return _nan_named(out.view(lead), inputs, message)
    mode, valid, ids = aggregated
    weights = aggregation_weights(valid, mode, ids, dtype)
    grad_on = torch.is_grad_enabled()
    needs = [grad_on and x is not None and x.requires_grad for x in flat]
    total, _ = _linear_jsd_total_op(
        *flat, weights.reshape(-1), scale, b, checks, needs, "linear_generalized_jsd"
    )
    return _nan_named(total, inputs, message, valid[..., None])


def _aggregated_mask(
    sh: Tensor, aggregation: object, mask: object, sequence_ids: object
) -> tuple[str, Tensor, Tensor | None] | None:
    """The checked mode, bool ``(B, T)`` mask (all True for ``mask=None``) and
    ``sequence_ids`` of an aggregated :func:`linear_generalized_jsd`; ``None`` without
    ``aggregation``."""
    if aggregation is None:
        for name, x in (("mask", mask), ("sequence_ids", sequence_ids)):
            if x is not None:
                raise ValueError(
                    f"{name} selects what aggregation= reduces: pass aggregation= (one of "
                    f"{', '.join(map(repr, AGGREGATION_MODES))}) with it, or leave it out"
                )
        return None
    mode = check_choice("aggregation", aggregation, AGGREGATION_MODES)
    if sh.dim() != 3:
        raise ValueError(
            "with aggregation=, student_hidden must have shape (B, T, H) (the positions "
            f"aggregate reduces), got {tuple(sh.shape)}"
        )
    lead = sh.shape[:-1]
    if mask is None:
        valid = torch.ones(lead, dtype=torch.bool, device=sh.device)
    else:
        valid = check_mask("mask", mask, lead, same_device_as=("student_hidden", sh))
    ids = None
    if sequence_ids is not None:
        ids = check_sequence_ids("sequence_ids", sequence_ids, valid, values_name="mask")
    return mode, valid, ids


def _nan_named(
    result: Tensor,
    inputs: dict[str, Tensor | None],
    message: str,
    valid: Tensor | None = None,
) -> Tensor:
    """:func:`check_no_nan` of ``result``, whose error names the first of ``inputs`` holding a
    NaN (scanned only once the result has one), else says ``message``. ``valid``: a bool mask
    of the hidden states' positions (``(..., 1)``) outside which their NaN do not count."""
    try:
        return check_no_nan(result, message)
    except ValueError:
        for name, x in inputs.items():
            if x is not None:
                check_no_nan_at(name, x, valid if name.endswith("hidden") else None)
        raise


# --- topk_kl ------------------------------------------------------------------------------


class TopKKL(NamedTuple):
    """What :func:`topk_kl` returns, three ``(...)`` tensors: ``estimate`` (the tail-bucket
    divergence, differentiable w.r.t. the student), ``lower`` and ``upper`` (certified
    bounds on the full-vocabulary divergence, detached; ``upper`` may be ``inf``)."""

    estimate: torch.Tensor
    lower: torch.Tensor
    upper: torch.Tensor


# Top-k log-probs whose probabilities sum above 1 by more than this (relative) are refused.
TOPK_SUM_TOLERANCE = 1e-4


def _x_log_ratio(a: Tensor, log_a: Tensor, log_b: Tensor) -> Tensor:
    """``a log(a / b)`` from ``a`` and the two logs: 0 where ``a = 0`` (with a zero gradient:
    the logs are masked there too), ``inf`` where ``b = 0 < a``."""
    has = a > 0
    return torch.where(has, a * (log_a.where(has, 0.0) - log_b.where(has, 0.0)), 0.0)


# An absolute margin on ``t_lo = R - (V - k - 1) τ`` (probabilities, at most 1): a few hundred
# units of float64 rounding, above the rounding of R and τ from the teacher's log-probs.
T_LO_MARGIN = 1e-13


def _tail_bounds(
    logits: Tensor,
    ids: Tensor,
    t_min: Tensor,
    tail_t: Tensor,
    scale: float,
    forward: bool,
    name: str,
) -> Tensor:
    """The largest tail contribution any consistent teacher can make, ``(N,)`` in
    ``t_min``'s dtype, a block of rows at a time (see :func:`topk_kl`): ``logits``
    ``(..., V)`` with ``N`` rows, ``ids`` ``(..., k)`` of the same leading shape, ``t_min`` and
    ``tail_t`` ``(N,)`` (the smallest given teacher probability and the omitted mass)."""
    vocab, k = logits.shape[-1], ids.shape[-1]
    flat_ids = ids.reshape(-1, k)
    dtype = t_min.dtype
    out = torch.empty(flat_ids.shape[0], dtype=dtype, device=logits.device)
    n_tail = vocab - k
    for start, block in row_blocks(logits, _block_rows(vocab)):
        stop = start + block.shape[0]
        log_s = torch.log_softmax(block.to(torch.float64) * scale, dim=-1)
        tmin, rest = t_min[start:stop].double(), tail_t[start:stop].double()
        given = torch.zeros_like(log_s, dtype=torch.bool).scatter_(-1, flat_ids[start:stop], True)
        if n_tail == 0:  # the whole vocabulary given: no tail
            value = torch.zeros_like(tmin)
        elif forward:
            # ascending student log-probs of the tail; the given tokens sort last
            ordered = torch.where(given, torch.inf, log_s).sort(-1).values[:, :n_tail]
            whole = torch.where(tmin > 0, torch.floor(rest / tmin), 0.0).clamp_(0, n_tail)
            n = whole.long()
            part = (rest - whole * tmin).clamp_(min=0.0)
            zero = torch.zeros_like(ordered[:, :1])
            csum = torch.cat((zero, ordered.cumsum(-1)), dim=-1)
            sum_n = csum.gather(-1, n[:, None]).squeeze(-1)
            nxt = ordered.gather(-1, n.clamp(max=max(n_tail - 1, 0))[:, None]).squeeze(-1)
            value = torch.where(whole > 0, whole * tmin * tmin.log() - tmin * sum_n, 0.0)
            value = value + torch.where(part > 0, part * (part.log() - nxt), 0.0)
        else:
            s = torch.where(given, 0.0, log_s.exp())
            mass = s.sum(-1)
            s_max = s.amax(-1)
            self_term = torch.where(s > 0, s * log_s, 0.0).sum(-1)
            # the least any tail token can hold, less a bound on its rounding (``rest`` and
            # ``tmin`` are within a few units of float64 rounding of 1): where that leaves
            # nothing certain, a teacher may put 0 there and the bound is inf
            t_lo = rest - (n_tail - 1) * tmin
            t_lo = torch.where(t_lo > T_LO_MARGIN * (1.0 + n_tail * tmin), t_lo, 0.0)
            value = (
                self_term
                - (mass - s_max) * tmin.log()
                - torch.where(s_max > 0, s_max * t_lo.log(), 0.0)
            )
            value = torch.where(t_lo > 0, value, torch.inf)
            value = torch.where(mass > 0, value, 0.0)
        out[start:stop] = value.to(dtype)
    return out


def _tail_bounds_fake(logits: Tensor, ids: Tensor, t_min: Tensor, *args: Any) -> Tensor:
    return t_min.new_empty(t_min.shape)


def _tail_bounds_backward(logits: Tensor, grad: Tensor, name: str) -> Tensor:
    """The bounds are detached (certified values, not a training signal): a zero gradient
    ``(..., V)`` in ``logits``' dtype. Never reached from :func:`topk_kl`, which computes the
    bounds without autograd."""
    return torch.zeros_like(logits)


def _tail_bounds_backward_fake(logits: Tensor, grad: Tensor, name: str) -> Tensor:
    return torch.empty_like(logits)


def _tail_bounds_setup(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    ctx.name = inputs[-1]


def _tail_bounds_gradients(ctx: Any, grad: Tensor) -> tuple[None, ...]:
    return (None,) * 7  # detached: no gradient reaches the logits or the teacher's numbers


def _check_tail_bounds(
    logits: Tensor, ids: Tensor, t_min: Tensor, tail_t: Tensor, *args: Any
) -> None:
    op = "klpen::topk_tail_bound"
    expect_ndim(op, "logits", logits, 1)
    expect_ndim(op, "ids", ids, 1)
    expect_shape(op, "ids", ids, (*logits.shape[:-1], ids.shape[-1]))
    expect(
        op,
        ids.shape[-1] <= logits.shape[-1],
        f"ids must give at most {logits.shape[-1]} (the vocabulary size) ids per row, got "
        f"{ids.shape[-1]}",
    )
    expect(op, ids.dtype == torch.int64, f"ids must be int64, got {ids.dtype}")
    rows = logits.numel() // logits.shape[-1] if logits.shape[-1] else 0
    expect_shape(op, "t_min", t_min, (rows,))
    expect_shape(op, "tail_t", tail_t, (rows,))


def _check_tail_bounds_backward(logits: Tensor, grad: Tensor, name: str) -> None:
    expect_ndim("klpen::topk_tail_bound_backward", "logits", logits, 1)
    rows = logits.numel() // logits.shape[-1] if logits.shape[-1] else 0
    expect_shape("klpen::topk_tail_bound_backward", "grad", grad, (rows,))


_tail_bounds_op, _ = kernel_op(
    KernelOp(
        "topk_tail_bound",
        "(Tensor logits, Tensor ids, Tensor t_min, Tensor tail_t, float scale, bool forward, "
        "str name) -> Tensor",
        _tail_bounds,
        _tail_bounds_fake,
        "(Tensor logits, Tensor grad, str name) -> Tensor",
        _tail_bounds_backward,
        _tail_bounds_backward_fake,
        _tail_bounds_setup,
        _tail_bounds_gradients,
        check=_check_tail_bounds,
        backward_check=_check_tail_bounds_backward,
    )
)


def _block_log_softmax(block: Tensor, scale: float, dtype: torch.dtype) -> Tensor:
    """``log_softmax(scale · block)`` of a ``(r, V)`` block in ``dtype``, the max taken apart
    before scaling (exact at any common offset)."""
    x = block.to(dtype)
    top = x.amax(-1, keepdim=True)
    x = (x - torch.where(torch.isfinite(top), top, 0.0)).mul_(scale)
    return x.sub_(torch.logsumexp(x, -1, keepdim=True))


def _tail_log_mass(log_s: Tensor, ids: Tensor) -> tuple[Tensor, Tensor]:
    """``(tail, log S)`` of a block of log-probs ``(r, V)``: ``tail``, the log-probs with the
    ids' set to ``-inf``, and ``log S = log Σ_(v ∉ ids) s_v`` ``(r, 1)`` (``-inf`` where the
    ids cover every token of positive probability), from the tail's own terms: relative to
    itself however little mass the ids leave."""
    tail = log_s.scatter(-1, ids, -torch.inf)
    return tail, torch.logsumexp(tail, dim=-1, keepdim=True)


def _topk_logprobs(logits: Tensor, ids: Tensor, scale: float, name: str) -> Tensor:
    """``log_softmax(scale · logits)`` gathered at ``ids`` ``(N, k)`` int64, and in a last
    column the log of the mass outside them (:func:`_tail_log_mass`), a block of rows at a
    time (``logits`` ``(..., V)`` with ``N`` rows, any strides): ``(N, k + 1)`` in the
    compute dtype."""
    dtype = compute_dtype(logits.dtype)
    rows, k = ids.shape
    out = torch.empty((rows, k + 1), dtype=dtype, device=logits.device)
    for start, block in row_blocks(logits, _block_rows(logits.shape[-1])):
        stop = start + block.shape[0]
        log_s = _block_log_softmax(block, scale, dtype)
        out[start:stop, :k] = log_s.gather(-1, ids[start:stop])
        out[start:stop, k] = _tail_log_mass(log_s, ids[start:stop])[1].squeeze(-1)
    return out


def _topk_logprobs_fake(logits: Tensor, ids: Tensor, scale: float, name: str) -> Tensor:
    return logits.new_empty((ids.shape[0], ids.shape[1] + 1), dtype=compute_dtype(logits.dtype))


def _topk_logprobs_backward(
    logits: Tensor, ids: Tensor, grad: Tensor, scale: float, name: str
) -> Tensor:
    """``d/dlogits`` of ``sum(grad * out)`` (``grad`` ``(N, k + 1)``: ``g`` on the ids' log-probs,
    ``g_t`` on the tail's log-mass): ``scale (onehot(ids) g + g_t s_tail / S - softmax ·
    (Σ g + g_t))`` with ``s_tail / S`` the softmax of the tail alone (0 on the ids and where
    the tail has no mass), ``(..., V)`` in ``logits``' dtype."""
    dtype = compute_dtype(logits.dtype)
    out = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
    flat = out.view(-1, logits.shape[-1])
    k = ids.shape[-1]
    for start, block in row_blocks(logits, _block_rows(logits.shape[-1])):
        stop = start + block.shape[0]
        g = grad[start:stop].to(dtype)
        g_ids, g_tail = g[:, :k], g[:, k:]
        log_s = _block_log_softmax(block, scale, dtype)
        tail, norm = _tail_log_mass(log_s, ids[start:stop])
        tail = torch.where(torch.isfinite(norm), tail.sub_(norm).exp_(), 0.0).mul_(g_tail)
        p = log_s.exp_().mul_(-g.sum(-1, keepdim=True))
        p.scatter_add_(-1, ids[start:stop], g_ids).add_(tail)
        flat[start:stop] = p.mul_(scale)
    return out


def _topk_logprobs_backward_fake(logits: Tensor, *args: Any) -> Tensor:
    return logits.new_empty(logits.shape)


def _topk_setup(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    logits, ids, scale, name = inputs
    ctx.save_for_backward(logits, ids)
    ctx.scale, ctx.name = scale, name


def _topk_gradients(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
    logits, ids = ctx.saved_tensors
    return (_topk_logprobs_backward_op(logits, ids, grad, ctx.scale, ctx.name), None, None, None)


def _check_topk_logprobs(
    logits: Tensor, ids: Tensor, *args: Any, op: str = "klpen::topk_logprobs"
) -> None:
    # what the fake implementations promise: (..., V) logits with N rows, (N, k) int64 ids
    expect_ndim(op, "logits", logits, 1)
    rows = logits.numel() // logits.shape[-1] if logits.shape[-1] else 0
    expect(op, ids.dim() == 2, f"ids must have shape (N, k), got {tuple(ids.shape)}")
    expect_shape(op, "ids", ids, (rows, ids.shape[-1]))
    expect(op, ids.dtype == torch.int64, f"ids must be int64, got {ids.dtype}")


def _check_topk_logprobs_backward(logits: Tensor, ids: Tensor, grad: Tensor, *args: Any) -> None:
    op = "klpen::topk_logprobs_backward"
    _check_topk_logprobs(logits, ids, op=op)
    expect_shape(op, "grad", grad, (ids.shape[0], ids.shape[1] + 1))


_topk_logprobs_op, _topk_logprobs_backward_op = kernel_op(
    KernelOp(
        "topk_logprobs",
        "(Tensor logits, Tensor ids, float scale, str name) -> Tensor",
        _topk_logprobs,
        _topk_logprobs_fake,
        "(Tensor logits, Tensor ids, Tensor grad, float scale, str name) -> Tensor",
        _topk_logprobs_backward,
        _topk_logprobs_backward_fake,
        _topk_setup,
        _topk_gradients,
        check=_check_topk_logprobs,
        backward_check=_check_topk_logprobs_backward,
    )
)


def _block_rows(vocab: int) -> int:
    return max(1, (1 << 18) // max(vocab, 1))


def topk_kl(
    student_logits: Tensor,
    teacher_topk_ids: Tensor,
    teacher_topk_logprobs: Tensor,
    *,
    direction: str = "forward",
    temperature: float = 1.0,
) -> TopKKL:
    r"""KL between the student's full distribution and a teacher known by its top-k log-probs.

    Per position: the student ``s = softmax(z / T)`` over the whole vocabulary ``V``; the
    teacher ``t`` only on the set ``K`` of the ``k`` given ids, with ``R = 1 - Σ_K t_i`` its
    omitted mass and ``τ = min_K t_i``. A teacher is *consistent* with what was given if it
    has those k probabilities and every other ``t_v ≤ τ`` (top-k means no omitted token is
    more likely than the k-th). ``S = 1 - Σ_K s_i`` is the student's mass outside ``K``.
    ``direction="forward"``: ``KL(t ‖ s)``; ``"reverse"``: ``KL(s ‖ t)``.

    **Estimate** (the tail bucket): the divergence of the two distributions coarsened to the
    ``k + 1`` outcomes ``K ∪ {tail}``:

    .. math::

        \hat D_\mathrm{fwd} = \sum_K t_i \log\frac{t_i}{s_i} + R \log\frac{R}{S},

        \hat D_\mathrm{rev} = \sum_K s_i \log\frac{s_i}{t_i} + S \log\frac{S}{R}

    **Lower bound** = the estimate. Coarsening never increases a KL (the log-sum
    inequality, ``Σ a_v log(a_v / b_v) ≥ (Σ a) log(Σ a / Σ b)``, on the tail), so every
    consistent teacher's full divergence is at least ``\hat D``.

    **Upper bound, forward.** The tail term ``Σ_tail t_v log(t_v / s_v)`` is convex in the
    omitted ``t``, so over the polytope ``{0 ≤ t_v ≤ τ, Σ t_v = R}`` its maximum is at a
    vertex: ``n = ⌊R / τ⌋`` tokens at ``τ``, one at ``ρ = R - n τ``, the rest at 0; and since
    ``-Σ t_v log s_v`` is largest when the largest ``t_v`` sit on the smallest ``s_v``, the
    ``n`` tokens are the student's ``n`` least likely tail tokens and ``ρ`` goes to the next:

    .. math::

        U_\mathrm{fwd} = {} & \sum_K t_i \log\frac{t_i}{s_i} + n \tau \log \tau \\
            & - \tau \sum_{j \le n} \log s_{(j)} + \rho \log\frac{\rho}{s_{(n+1)}}

    (``s_{(j)}`` the student's tail probabilities in ascending order). It is finite unless
    the student gives probability 0 (a ``-inf`` logit) to a tail token that can carry
    teacher mass.

    **Upper bound, reverse.** ``Σ_tail s_v log(s_v / t_v)`` grows without bound as any
    ``t_v → 0`` with ``s_v > 0``. A consistent teacher can set ``t_v = 0`` unless the other
    ``V - k - 1`` tail tokens cannot hold ``R``: the least any tail ``t_v`` can be is
    ``t_lo = R - (V - k - 1) τ``. So ``upper = inf`` whenever ``t_lo ≤ 0`` and the student
    has tail mass — with a real vocabulary, almost always: no finite upper bound on the
    reverse KL exists from top-k alone. Where ``t_lo > 0`` (a nearly full top-k, or a
    teacher that is flat outside ``K``) the maximum of the convex tail term over
    ``{t_lo ≤ t_v ≤ τ, Σ t_v = R}`` is at its one vertex family: ``t_lo`` on the student's
    most likely tail token ``s_max``, ``τ`` on every other:
    ``U_rev = Σ_K s_i log(s_i / t_i) + Σ_tail s_v log s_v - (S - s_max) log τ - s_max log t_lo``.
    Where the student has no tail mass (``S = 0``) the tail adds 0 and both bounds equal the
    estimate.

    **The tail masses.** ``S`` and ``R`` are differences of nearly equal numbers where the
    top-k hold nearly all of a side's mass (most positions of a confident model), so
    neither is taken as ``1 - Σ``: ``log S`` is the log-sum of the student's tail terms
    themselves (relative to itself at any size, also below the dtype's smallest number),
    ``R`` is ``-expm1(log t_max) - Σ_(others) t_i`` in float64 (a tail of ``1e-15`` behind a
    top token of ``1 - 1e-8`` to about nine digits), and the reverse bound's ``t_lo`` must
    clear a margin of ``1e-13`` above float64's rounding of ``R`` and ``τ`` to be used.

    Args:
        student_logits: ``(..., V)`` floating student logits (divided by ``temperature``).
        teacher_topk_ids: ``(..., k)`` integer token ids, distinct per position, in
            ``[0, V)``.
        teacher_topk_logprobs: ``(..., k)`` the teacher's log-probs of those ids (``≤ 0``,
            their probabilities summing to at most 1), as the teacher was sampled (the
            temperature is not applied to them).
        direction: ``"forward"`` (``KL(teacher ‖ student)``) or ``"reverse"``.
        temperature: ``T``, finite and > 0, for the student.

    Returns:
        :class:`TopKKL` ``(estimate, lower, upper)``, each ``(...)`` in the promoted dtype
        (at least fp32). ``estimate`` is differentiable w.r.t. ``student_logits`` (and the
        teacher's log-probs); the bounds are detached. The bounds need a sort of each row of
        the student's log-probs (done a block of rows at a time, in float64).

    Raises:
        TypeError, ValueError: wrong types, shapes or devices; ``k > V``; ids out of range or
            repeated at a position, log-probs above 0 or NaN, probabilities summing above 1,
            a tail that ``V - k`` tokens of at most ``τ`` cannot hold (value checks, skipped
            with validation off).

    Example:
        >>> z = torch.zeros(1, 4)  # a uniform student over 4 tokens
        >>> ids, lp = torch.tensor([[0, 1]]), torch.tensor([[0.5, 0.25]]).log()
        >>> r = topk_kl(z, ids, lp)
        >>> r.estimate, r.lower, r.upper
        (tensor([0.1733]), tensor([0.1733]), tensor([0.3466]))
    """
    z = check_floating("student_logits", student_logits, min_ndim=1)
    ids = check_token_ids("teacher_topk_ids", teacher_topk_ids)
    lp = check_floating("teacher_topk_logprobs", teacher_topk_logprobs, min_ndim=1)
    if ids.dim() != z.dim() or ids.shape[:-1] != z.shape[:-1]:
        raise ValueError(
            f"teacher_topk_ids must have shape (..., k) with the leading shape of "
            f"student_logits {tuple(z.shape[:-1])}, got {tuple(ids.shape)}"
        )
    check_shape("teacher_topk_logprobs", lp, ids.shape, "the shape of teacher_topk_ids")
    check_same_device("teacher_topk_ids", ids, "student_logits", z)
    check_same_device("teacher_topk_logprobs", lp, "student_logits", z)
    vocab, k = z.shape[-1], ids.shape[-1]
    if not 1 <= k <= vocab:
        raise ValueError(
            f"teacher_topk_ids must give 1 to {vocab} (the vocabulary size) ids per position, "
            f"got k = {k}"
        )
    forward = check_choice("direction", direction, ("forward", "reverse")) == "forward"
    dtype = promoted_dtype(z, lp)
    scale = inverse_temperature("temperature", temperature, dtype)
    ids = ids.long()
    check_no_nan_at("teacher_topk_logprobs", lp)
    check_all(
        (ids >= 0) & (ids < vocab),
        lambda i: (
            f"teacher_topk_ids must lie in [0, {vocab}) (the vocabulary of student_logits), "
            f"got {int(ids[i])} at index {i}"
        ),
    )
    ordered = ids.sort(-1).values
    check_all(
        ordered[..., 1:] != ordered[..., :-1],
        lambda i: (
            f"teacher_topk_ids must not repeat an id at a position, got {int(ordered[i])} twice "
            f"at position {i[:-1]}"
        ),
    )
    check_all(
        lp <= 0,
        lambda i: f"teacher_topk_logprobs must be <= 0 (log-probs), got {float(lp[i])} at {i}",
    )
    t = lp.to(dtype).exp()
    given_mass = t.sum(-1)
    check_all(
        given_mass <= 1.0 + TOPK_SUM_TOLERANCE,
        lambda i: (
            "teacher_topk_logprobs must be log-probs of one distribution (their probabilities "
            f"summing to at most 1), got a sum of {float(given_mass[i]):.6g} at position {i}"
        ),
    )
    # the student's log-probs of the k ids, a block of rows at a time
    # the student's log-probs of the k ids and the log of its mass outside them, a block of
    # rows at a time: that mass from its own terms, not as 1 - Σ s (a student whose top-k
    # hold all but 1e-8 of its mass keeps its tail)
    both = _topk_logprobs_op(z, ids.reshape(-1, k), scale, "topk_kl").to(dtype)
    log_s = both[:, :k].reshape(ids.shape)
    log_tail_s = both[:, k].reshape(ids.shape[:-1]).double()
    s = log_s.exp()
    # the teacher's omitted mass 1 - Σ t in float64 from its log-probs, as
    # -expm1(log t_max) - Σ_(others) t: exact to float64's rounding of those two (in fp32,
    # 1 - Σ t rounds to 0 below 6e-8; a teacher whose top token holds 1 - 1e-8 keeps a tail
    # of 1e-15 to nine digits)
    lp64 = lp.double()
    top, where_top = lp64.max(dim=-1, keepdim=True)
    others = lp64.exp().scatter(-1, where_top, 0.0).sum(-1)
    tail_t = torch.expm1(top.squeeze(-1)).neg().sub(others).clamp(min=0.0)
    if k == vocab:  # no tail: what is left of 1 is rounding
        log_tail_s, tail_t = torch.full_like(log_tail_s, -torch.inf), torch.zeros_like(tail_t)
    log_tail_t = tail_t.log()
    tail_s = log_tail_s.exp()
    t_min = t.detach().amin(-1)
    if forward:
        head = torch.where(t > 0, t * (lp.to(dtype) - log_s), 0.0).sum(-1)
        bucket = _x_log_ratio(tail_t, log_tail_t, log_tail_s)
    else:
        head = torch.where(s > 0, s * (log_s - lp.to(dtype)), 0.0).sum(-1)
        bucket = _x_log_ratio(tail_s, log_tail_s, log_tail_t)
    estimate = head + bucket.to(dtype)
    n_tail = vocab - k
    check_all(
        tail_t.detach() <= n_tail * t_min * (1.0 + TOPK_SUM_TOLERANCE) + TOPK_SUM_TOLERANCE,
        lambda i: (
            f"teacher_topk_logprobs leave a teacher mass of {float(tail_t[i]):.6g} outside "
            f"the top-{k} at position {i}, more than the other {n_tail} tokens can hold at "
            f"most {float(t_min[i]):.6g} (the smallest given probability) each"
        ),
    )
    with torch.no_grad():
        # the teacher's numbers in float64: the reverse bound takes a difference of them
        # (``R - (V - k - 1) τ``)
        tail = _tail_bounds_op(
            z.detach(),
            ids,
            lp64.detach().amin(-1).exp().reshape(-1),
            tail_t.detach().reshape(-1),
            scale,
            forward,
            "topk_kl",
        ).view(tail_t.shape)
        tail = tail.to(dtype)
        upper = torch.maximum(head.detach() + tail, estimate.detach())
    estimate = _nan_named(
        estimate,
        {"student_logits": z},
        "student_logits contain +inf, or a row of -inf only; got a NaN divergence there",
    )
    return TopKKL(estimate, estimate.detach().clone(), upper)


# --- distillation_rewards -----------------------------------------------------------------


def distillation_rewards(
    student_logprobs: Tensor,
    teacher_logprobs: Tensor,
    mask: Tensor,
    *,
    kl_coef: float = 1.0,
    sequence_ids: Tensor | None = None,
) -> Tensor:
    r"""Per-token rewards of on-policy distillation: the negative reverse-KL log-ratio.

    .. math::

        R_{b,t} = {} & -\beta\, m_{b,t} \\
            & \cdot \big(\log \pi_s(y_t) - \log \pi_t(y_t)\big)

    at each valid token ``y_t`` of the student's own samples: the per-token k1 estimate of
    ``-KL(π_s ‖ π_t)`` (its expectation over the student's samples is minus the reverse KL
    of the sequence). 0 at masked positions, whatever they hold.

    To add a task reward (scores ``(B,)``, one per sequence, at the last valid token):
    ``shape_rewards(scores, student_logprobs - teacher_logprobs, mask, kl_coef)`` gives the
    same per-token terms plus the scores; or add ``shape_rewards(scores, zeros, mask, 0.0)``
    to these rewards.

    Args:
        student_logprobs: ``(B, T)`` floating ``log π_s(y_t)`` of the sampled tokens.
        teacher_logprobs: ``(B, T)`` floating ``log π_t(y_t)`` of the same tokens (same
            tokenizer).
        mask: ``(B, T)`` 0/1 mask (bool, integer or floating) of the response tokens.
        kl_coef: β, finite and non-negative; ``0`` gives exact zeros.
        sequence_ids: optional ``(B, T)`` integer sequence index of every position (a packed
            batch, contract section 8): the rewards are per token, so packing only has its
            shape checked; the result equals that of the sequences padded into a batch.

    Returns:
        ``(B, T)`` rewards in the promoted dtype (at least float32), differentiable w.r.t.
        both log-probs; masked positions reach neither a value nor a gradient.

    Raises:
        TypeError, ValueError: wrong types, shapes or devices; NaN at a valid position; a
            ``kl_coef`` that is negative, not finite or beyond the compute dtype (the NaN and
            mask checks are value checks, skipped with validation off).

    Example:
        >>> s, t = torch.tensor([[-1.0, -2.0, -9.0]]), torch.tensor([[-1.5, -1.0, 0.0]])
        >>> distillation_rewards(s, t, torch.tensor([[1, 1, 0]]))
        tensor([[-0.5000,  1.0000,  0.0000]])
    """
    ls = check_floating("student_logprobs", student_logprobs)
    if ls.dim() != 2:
        raise ValueError(f"student_logprobs must have shape (B, T), got {tuple(ls.shape)}")
    lt = check_floating("teacher_logprobs", teacher_logprobs)
    check_shape("teacher_logprobs", lt, ls.shape, "the shape of student_logprobs")
    check_same_device("teacher_logprobs", lt, "student_logprobs", ls)
    m = check_mask("mask", mask, ls.shape, same_device_as=("student_logprobs", ls))
    if sequence_ids is not None:
        check_sequence_ids(
            "sequence_ids", sequence_ids, ls, values_name="student_logprobs", ordered=False
        )
    dtype = promoted_dtype(ls, lt)
    coef = check_coef_fits("kl_coef", check_coef("kl_coef", kl_coef), dtype)
    check_no_nan_at("student_logprobs", ls, m)
    check_no_nan_at("teacher_logprobs", lt, m)
    zero = torch.zeros((), dtype=dtype, device=ls.device)
    ratio = torch.where(m, ls.to(dtype), zero) - torch.where(m, lt.to(dtype), zero)
    return torch.where(m, -scaled_penalty(coef, ratio), zero)
