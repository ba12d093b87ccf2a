r"""When the sampler is not the policy: sampler log-probs, importance weights, mismatch metrics.

Chapter 8 of the book. The tokens of an RLHF batch are drawn by a sampler, not from
:math:`\mathrm{softmax}(z)`: a temperature :math:`T`, a top-k / top-p cut, a policy a few
updates old or another engine's numerics stand between the trainer's logits and the token.

* :func:`sampler_logprobs` gives the log-probs under the distribution really sampled from,
  :math:`\mu(y) = e^{z_y/T} / \sum_{v \in K} e^{z_v/T}` on the kept set :math:`K`, and the log
  kept mass :math:`\log S`, exactly as Hugging Face ``generate`` builds it; with a
  ``generation_config``, everything ``generate(do_sample=True)`` applies under it (its
  defaults, ``top_k=50`` among them, min-p, typical-p, the ε/η cutoffs, the repetition
  penalty), or the kept set an engine recorded (``kept_mask``);
* :func:`importance_weights` gives the (truncated or masked) weights :math:`\pi/\mu` that turn
  an expectation under :math:`\mu` into one under :math:`\pi` (TIS / MIS);
* :func:`mismatch_metrics` gives the numbers a trainer logs to see that :math:`\mu \ne \pi`,
  from the sufficient statistics of ``mismatch_sums`` (sums, counts, max, min: what a
  data-parallel group reduces) through ``metrics_from_sums``.

**Hugging Face semantics** (``transformers`` ``TemperatureLogitsWarper``, ``TopKLogitsWarper``,
``TopPLogitsWarper``, applied in this order by ``generate``): the scores are divided by ``T``;
top-k keeps every token whose score is ``>=`` the k-th largest (ties at the boundary are all
kept, so more than k tokens can survive); top-p sorts the scores ascending, takes the softmax
and its cumulative sum, removes the tokens whose cumulative mass is ``<= 1 - top_p`` and always
keeps the most probable token. The boundary token (the one whose inclusion makes the kept mass
reach ``top_p``) is kept; among tokens tied at the boundary, which ones fall is decided by the
order of ``torch.sort`` (the same call is made here, so the same ones fall).

**vLLM** applies temperature, then top-k and top-p with the same ascending-sort rule in its
PyTorch path, but (i) the log-probs it returns are by default those of the *raw* logits, before
temperature and the cuts (``logprobs_mode="raw_logprobs"``; ``"processed_logprobs"`` returns the
sampler's), and (ii) its FlashInfer sampling kernels draw top-k / top-p by rejection sampling
without sorting, whose kept set can differ at ties. Log-probs reported by an engine are
therefore checked with :func:`mismatch_metrics`, not trusted.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch
from torch import Tensor

from ._ops import KernelOp, concrete, expect, expect_ndim, expect_shape, kernel_op
from ._validation import (
    check_choice,
    check_floating,
    check_floating_like,
    check_mask,
    check_no_nan,
    check_positive,
    check_same_device,
    check_shape,
    check_temperature,
    check_token_ids,
    check_tokens,
)
from .estimators import k3
from .kernels.blocks import (
    block_buffer,
    block_rows_for,
    compute_dtype,
    paired_row_blocks,
    row_blocks,
)
from .logprobs import get_logprobs_for_tokens
from .masking import _zero_masked

__all__ = [
    "IMPORTANCE_LEVELS",
    "IMPORTANCE_MODES",
    "MismatchSums",
    "importance_weights",
    "metrics_from_sums",
    "mismatch_metrics",
    "mismatch_sums",
    "sampler_logprobs",
]

#: Levels of :func:`importance_weights`: per token, per sequence (product), geometric mean.
IMPORTANCE_LEVELS = ("token", "sequence", "geometric")
#: What :func:`importance_weights` does above ``cap``: clip to it (TIS) or drop the weight (MIS).
IMPORTANCE_MODES = ("truncate", "mask")

# Blocks of a top-k / top-p pass are this many times smaller than klpen's usual block.
_CUT_BLOCK_DIVISOR = 4


def _check_top_k(top_k: object) -> int | None:
    if top_k is None:
        return None
    if isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral):
        raise TypeError(f"top_k must be None or an int >= 1, got {type(top_k).__name__} {top_k!r}")
    if int(top_k) < 1:
        raise ValueError(
            f"top_k must be None or an int >= 1, got {int(top_k)} (generate treats top_k=0 as "
            "no cut: pass None for that)"
        )
    return int(top_k)


def _check_top_p(top_p: object) -> float | None:
    if top_p is None:
        return None
    if isinstance(top_p, bool) or not isinstance(top_p, numbers.Real):
        raise TypeError(f"top_p must be None or a float in (0, 1], got {type(top_p).__name__}")
    p = float(top_p)
    if not 0.0 < p <= 1.0:
        raise ValueError(f"top_p must lie in (0, 1], got {p}")
    return p


class _Sampler(NamedTuple):
    """The processors and warpers of one sampler, in ``generate``'s order; ``None``: absent."""

    temperature: float
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    typical_p: float | None = None
    epsilon_cutoff: float | None = None
    eta_cutoff: float | None = None
    repetition_penalty: float | None = None

    def cuts(self, vocab: int) -> bool:
        """Whether any warper can remove a token from a vocabulary of ``vocab``."""
        return (
            (self.top_k is not None and self.top_k < vocab)
            or (self.top_p is not None and self.top_p < 1.0)
            or any(
                x is not None
                for x in (self.min_p, self.typical_p, self.epsilon_cutoff, self.eta_cutoff)
            )
        )


#: What ``generate`` fills in for a field its config leaves ``None`` (transformers'
#: ``GenerationConfig._get_default_generation_params``; tests compare the two).
GENERATE_DEFAULTS: dict[str, object] = {
    "temperature": 1.0,
    "top_k": 50,
    "top_p": 1.0,
    "typical_p": 1.0,
    "repetition_penalty": 1.0,
    "epsilon_cutoff": 0.0,
    "eta_cutoff": 0.0,
}


def _off(*values: object) -> object:
    return lambda v: v is None or v in values


def _non_positive(v: object) -> bool:
    return v is None or (isinstance(v, numbers.Real) and not isinstance(v, bool) and v <= 0)


#: Fields of a generation config that reshape the sampled distribution in ways
#: :func:`sampler_logprobs` does not reproduce, each with the test of its inactive value.
UNSUPPORTED_FIELDS: dict[str, Any] = {
    "guidance_scale": _off(1, 1.0),
    "sequence_bias": _off(),
    "encoder_repetition_penalty": _off(1, 1.0),
    "no_repeat_ngram_size": _non_positive,
    "encoder_no_repeat_ngram_size": _non_positive,
    "bad_words_ids": _off(),
    "min_length": _non_positive,
    "min_new_tokens": _non_positive,
    "forced_bos_token_id": _off(),
    "forced_eos_token_id": _off(),
    "remove_invalid_values": _off(False),
    "exponential_decay_length_penalty": _off(),
    "suppress_tokens": _off(),
    "begin_suppress_tokens": _off(),
    "top_h": _off(),
    "watermarking_config": _off(),
    "num_beams": _off(1),
    "penalty_alpha": _off(),
    "dola_layers": _off(),
    "logits_processor": _off(),
    "prefix_allowed_tokens_fn": _off(),
}


def _config_real(name: str, value: object, lo: float, hi: float) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"generation_config.{name} must be a real number, got {type(value).__name__}"
        )
    v = float(value)
    if not lo <= v <= hi:
        raise ValueError(f"generation_config.{name} must lie in [{lo}, {hi}], got {v}")
    return v


def _sampler_from_config(config: object) -> _Sampler:
    """The sampler ``generate(do_sample=True)`` builds from ``config``, defaults included.

    Mirrors transformers' ``_get_logits_processor``: the repetition penalty when ``!= 1``,
    then temperature, top-k when ``!= 0``, top-p when ``< 1``, min-p when set, typical-p when
    ``< 1``, the ε- and η-cutoffs when in ``(0, 1)``; the rest refused by name.
    """
    if isinstance(config, Mapping):
        fields = dict(config)
    elif callable(getattr(config, "to_dict", None)):
        fields = dict(config.to_dict())  # type: ignore[attr-defined]
    else:
        raise TypeError(
            "generation_config must be a transformers.GenerationConfig or a dict of its "
            f"fields, got {type(config).__name__}"
        )
    used = sorted(n for n, inactive in UNSUPPORTED_FIELDS.items() if not inactive(fields.get(n)))
    if used:
        shown = ", ".join(f"{n}={fields[n]!r}" for n in used)
        raise ValueError(
            f"generation_config sets {shown}, which change the sampled distribution in a way "
            "sampler_logprobs does not reproduce (supported: temperature, top_k, top_p, min_p, "
            "typical_p, epsilon_cutoff, eta_cutoff, repetition_penalty)"
        )
    for n, default in GENERATE_DEFAULTS.items():
        if fields.get(n) is None:
            fields[n] = default
    t = check_temperature("generation_config.temperature", fields["temperature"])
    top_k = fields["top_k"]
    if isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral) or top_k < 0:
        raise ValueError(f"generation_config.top_k must be an int >= 0, got {top_k!r}")
    top_p = _config_real("top_p", fields["top_p"], 0.0, 1.0)
    min_p = fields.get("min_p")
    typical = _config_real("typical_p", fields["typical_p"], 0.0, 1.0)
    if typical == 0.0:
        raise ValueError("generation_config.typical_p must lie in (0, 1], got 0.0")
    eps = _config_real("epsilon_cutoff", fields["epsilon_cutoff"], 0.0, 1.0)
    eta = _config_real("eta_cutoff", fields["eta_cutoff"], 0.0, 1.0)
    penalty = check_positive("generation_config.repetition_penalty", fields["repetition_penalty"])
    return _Sampler(
        temperature=t,
        top_k=int(top_k) if top_k != 0 else None,
        top_p=top_p if top_p < 1.0 else None,
        min_p=None if min_p is None else _config_real("min_p", min_p, 0.0, 1.0),
        typical_p=typical if typical < 1.0 else None,
        epsilon_cutoff=eps if 0.0 < eps < 1.0 else None,
        eta_cutoff=eta if 0.0 < eta < 1.0 else None,
        repetition_penalty=penalty if penalty != 1.0 else None,
    )


def _further_cuts(kept: Tensor, sampler: _Sampler) -> Tensor:
    """min-p, typical-p, ε- and η-cutoff on a ``(r, V)`` block, as transformers' warpers do
    (``min_tokens_to_keep = 1``)."""
    if sampler.min_p is not None:  # MinPLogitsWarper
        probs = kept.softmax(-1)
        # the most probable token is never below min_p * its own probability (min_p <= 1)
        kept = kept.masked_fill(probs < sampler.min_p * probs.amax(-1, keepdim=True), -math.inf)
    if sampler.typical_p is not None:  # TypicalLogitsWarper
        normalized = kept.log_softmax(-1)
        ent = -(normalized * normalized.exp()).nansum(-1, keepdim=True)
        shifted, order = torch.sort((-normalized - ent).abs(), descending=False)
        cumulative = kept.gather(-1, order).softmax(-1).cumsum(-1)
        last = (cumulative < sampler.typical_p).sum(-1, keepdim=True).clamp_(max=kept.shape[-1] - 1)
        cut = shifted > shifted.gather(-1, last)
        cut[..., :1] = False
        kept = kept.masked_fill(cut.scatter(-1, order, cut), -math.inf)
    for eps, entropic in ((sampler.epsilon_cutoff, False), (sampler.eta_cutoff, True)):
        if eps is None:
            continue
        # EpsilonLogitsWarper / EtaLogitsWarper: eta = min(ε, sqrt(ε) e^{-H})
        lse = kept.logsumexp(-1, keepdim=True)
        probs = (kept - lse).exp()
        threshold: Tensor | float = eps
        if entropic:
            logp = (kept - lse).clamp(min=torch.finfo(kept.dtype).min)
            entropy = -(logp * probs).sum(-1, keepdim=True)
            e = torch.tensor(eps, dtype=torch.float32).to(kept)
            threshold = torch.minimum(e, e.sqrt() * torch.exp(-entropy))
        top = kept.amax(-1, keepdim=True)
        kept = kept.masked_fill((probs < threshold) & (kept < top), -math.inf)
    return kept


def _kept_scores(
    block: Tensor,
    dtype: torch.dtype,
    sampler: _Sampler,
    penalized: Tensor | None = None,
    kept_mask: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """``(scaled, kept)``: the block's processed scores ``s / T`` in ``dtype`` and the same
    with the cut tokens at ``-inf``.

    The operations of ``transformers``' processors and warpers, in ``generate``'s order, on a
    ``(r, V)`` block: the repetition penalty (where ``penalized``, ``(r, V)`` bool), the
    temperature, then the cut (``kept_mask`` in place of it when given).
    """
    s = block.to(dtype)
    if penalized is not None:  # RepetitionPenaltyLogitsProcessor, before every warper
        pen = sampler.repetition_penalty
        s = torch.where(penalized, torch.where(s < 0, s * pen, s / pen), s)  # type: ignore[operator]
    top_k, top_p = sampler.top_k, sampler.top_p
    # excerpt: cut
    scaled = s / sampler.temperature  # division, as TemperatureLogitsWarper does
    kept = scaled
    if kept_mask is not None:  # the set an engine recorded replaces the recomputed cut
        return scaled, kept.masked_fill(~kept_mask, -math.inf)
    if top_k is not None and top_k < scaled.shape[-1]:
        boundary = torch.topk(kept, top_k).values[..., -1:]
        kept = kept.masked_fill(kept < boundary, -math.inf)
    if top_p is not None and top_p < 1.0:
        ordered, order = torch.sort(kept, descending=False)
        cumulative = ordered.softmax(dim=-1).cumsum(dim=-1)
        cut = cumulative <= (1 - top_p)
        cut[..., -1:] = False  # min_tokens_to_keep = 1: the most probable token stays
        kept = kept.masked_fill(cut.scatter(1, order, cut), -math.inf)
    # end excerpt
    return scaled, _further_cuts(kept, sampler)


class _Context(NamedTuple):
    """Per-call data of :class:`_SamplerLogProbs` besides the logits and tokens."""

    sampler: _Sampler
    rows: int
    steps: int  # T: positions per sequence (row n is step n % T of sequence n // T)
    prompt: int  # P: input_ids[..., :P + t] is step t's context
    first: Tensor | None  # (N / T, V) int64: first position of each id in input_ids, or L
    kept_mask: Tensor | None  # (..., V) bool


def _penalized(ctx: _Context, start: int, stop: int) -> Tensor | None:
    """``(r, V)`` bool: which ids of rows ``start:stop`` the repetition penalty touches."""
    if ctx.first is None:
        return None
    n = torch.arange(start, stop, device=ctx.first.device)
    return ctx.first[n // ctx.steps] < (ctx.prompt + n % ctx.steps)[:, None]


def _blocks(logits: Tensor, ctx: _Context) -> Any:
    """``(start, block, kept_mask block or None)`` over the rows of the logits."""
    if ctx.kept_mask is None:
        for start, block in row_blocks(logits, ctx.rows):
            yield start, block, None
    else:
        yield from paired_row_blocks(logits, ctx.kept_mask, ctx.rows)


# The per-call data of the two sampler operators after their tensors: the sampler's fields
# (in _Sampler's order), then rows, steps and prompt (see _Context).
_SAMPLER_ARGS = (
    "float temperature, int? top_k, float? top_p, float? min_p, float? typical_p, "
    "float? epsilon_cutoff, float? eta_cutoff, float? repetition_penalty, int rows, int steps, "
    "int prompt"
)


def _context(first: Tensor | None, kept_mask: Tensor | None, fields: tuple[Any, ...]) -> _Context:
    """The :class:`_Context` of an operator call from its tensors and scalar fields."""
    *sampler, rows, steps, prompt = fields
    return _Context(_Sampler(*sampler), rows, steps, prompt, first, kept_mask)


def _fields(c: _Context) -> tuple[Any, ...]:
    return (*c.sampler, c.rows, c.steps, c.prompt)


def _sampler_logprobs_forward(
    logits: Tensor, tokens: Tensor, first: Tensor | None, kept_mask: Tensor | None, *fields: Any
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per row: ``log μ(y)`` on the kept set and ``log S``, and the two log-sum-exps that
    backward needs (``(N,)`` each)."""
    c = _context(first, kept_mask, fields)
    dtype = compute_dtype(logits.dtype)
    n = tokens.numel()
    flat_tokens = tokens.reshape(-1, 1)
    logp = torch.empty(n, dtype=dtype, device=logits.device)
    lse_kept = torch.empty_like(logp)
    lse_all = torch.empty_like(logp)
    for start, block, mask in _blocks(logits, c):
        stop = start + block.shape[0]
        scaled, kept = _kept_scores(block, dtype, c.sampler, _penalized(c, start, stop), mask)
        torch.logsumexp(kept, dim=-1, out=lse_kept[start:stop])
        torch.logsumexp(scaled, dim=-1, out=lse_all[start:stop])
        taken = kept.gather(-1, flat_tokens[start:stop]).squeeze(-1)
        torch.sub(taken, lse_kept[start:stop], out=logp[start:stop])
    shape = tokens.shape
    return logp.view(shape), (lse_kept - lse_all).view(shape), lse_kept, lse_all


def _sampler_logprobs_fake(
    logits: Tensor, tokens: Tensor, first: Tensor | None, kept_mask: Tensor | None, *fields: Any
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    dtype = compute_dtype(logits.dtype)
    n = tokens.numel()
    return (
        logits.new_empty(tokens.shape, dtype=dtype),
        logits.new_empty(tokens.shape, dtype=dtype),
        logits.new_empty(n, dtype=dtype),
        logits.new_empty(n, dtype=dtype),
    )


def _sampler_logprobs_backward_kernel(
    logits: Tensor,
    tokens: Tensor,
    first: Tensor | None,
    kept_mask: Tensor | None,
    lse_kept: Tensor,
    lse_all: Tensor,
    grad_logp: Tensor,
    grad_log_kept: Tensor,
    *fields: Any,
) -> Tensor:
    """The gradient of ``g log μ(y) + h log S`` w.r.t. the logits (``fields`` ends with
    ``name``, the public function)."""
    c = _context(first, kept_mask, fields[:-1])
    return _sampler_grad(logits, tokens, lse_kept, lse_all, grad_logp, grad_log_kept, c)


def _sampler_logprobs_backward_fake(logits: Tensor, *rest: Any) -> Tensor:
    return logits.new_empty(logits.shape)


def _setup_sampler(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    logits, tokens, first, kept_mask, *fields = inputs
    _, _, lse_kept, lse_all = output
    ctx.save_for_backward(logits, tokens, first, kept_mask, lse_kept, lse_all)
    ctx.fields = tuple(fields)
    ctx.set_materialize_grads(False)
    ctx.mark_non_differentiable(lse_kept, lse_all)


def _sampler_gradients(
    ctx: Any, grad_logp: Tensor | None, grad_log_kept: Tensor | None, *_: Any
) -> tuple[Tensor | None, ...]:
    logits, tokens, first, kept_mask, lse_kept, lse_all = ctx.saved_tensors
    none = (None,) * (4 + len(ctx.fields))
    if not ctx.needs_input_grad[0] or (grad_logp is None and grad_log_kept is None):
        return none
    zero = torch.zeros(tokens.shape, dtype=lse_kept.dtype, device=lse_kept.device)
    grad = _sampler_logprobs_backward(
        logits,
        tokens,
        first,
        kept_mask,
        lse_kept,
        lse_all,
        zero if grad_logp is None else grad_logp,
        zero if grad_log_kept is None else grad_log_kept,
        *ctx.fields,
        "sampler_logprobs",
    )
    return (grad, *none[1:])


def _check_sampler(
    logits: Tensor, tokens: Tensor, first: Tensor | None, kept_mask: Tensor | None, *fields: Any
) -> None:
    # what the fake implementations and the block loops rely on (see _Context)
    op = "klpen::sampler_logprobs"
    rows, steps, prompt = fields[8:11]
    expect_ndim(op, "logits", logits, 1)
    expect_shape(op, "tokens", tokens, logits.shape[:-1])
    expect_shape(op, "kept_mask", kept_mask, logits.shape)
    expect(op, kept_mask is None or kept_mask.dtype == torch.bool, "kept_mask must be bool")
    expect(op, rows >= 1 and steps >= 1 and prompt >= 0, f"rows and steps must be >= 1 and "
           f"prompt >= 0, got rows={rows}, steps={steps}, prompt={prompt}")  # fmt: skip
    n = tokens.numel()
    expect(op, n % steps == 0, f"steps={steps} must divide the {n} rows")
    expect_shape(op, "first", first, (n // steps, logits.shape[-1]))


def _check_sampler_backward(
    logits: Tensor,
    tokens: Tensor,
    first: Tensor | None,
    kept_mask: Tensor | None,
    lse_kept: Tensor,
    lse_all: Tensor,
    grad_logp: Tensor,
    grad_log_kept: Tensor,
    *fields: Any,
) -> None:
    op = "klpen::sampler_logprobs_backward"
    _check_sampler(logits, tokens, first, kept_mask, *fields)
    for name, x in (("lse_kept", lse_kept), ("lse_all", lse_all)):
        expect_shape(op, name, x, (tokens.numel(),))
    for name, x in (("grad_logp", grad_logp), ("grad_log_kept", grad_log_kept)):
        expect_shape(op, name, x, tokens.shape)


_sampler_logprobs, _sampler_logprobs_backward = kernel_op(
    KernelOp(
        "sampler_logprobs",
        "(Tensor logits, Tensor tokens, Tensor? first, Tensor? kept_mask, "
        + _SAMPLER_ARGS
        + ") -> (Tensor, Tensor, Tensor, Tensor)",
        _sampler_logprobs_forward,
        _sampler_logprobs_fake,
        "(Tensor logits, Tensor tokens, Tensor? first, Tensor? kept_mask, Tensor lse_kept, "
        "Tensor lse_all, Tensor grad_logp, Tensor grad_log_kept, "
        + _SAMPLER_ARGS
        + ", str name) -> Tensor",
        _sampler_logprobs_backward_kernel,
        _sampler_logprobs_backward_fake,
        _setup_sampler,
        _sampler_gradients,
        check=_check_sampler,
        backward_check=_check_sampler_backward,
    )
)


def _sampler_grad(
    logits: Tensor,
    tokens: Tensor,
    lse_kept: Tensor,
    lse_all: Tensor,
    grad_logp: Tensor,
    grad_log_kept: Tensor,
    c: _Context,
) -> Tensor:
    """The gradient of ``g log μ(y) + h log S`` w.r.t. the logits, block by block."""
    dtype = lse_kept.dtype
    temperature = c.sampler.temperature
    index = tokens.reshape(-1, 1)
    g = grad_logp.reshape(-1, 1).to(dtype)
    h = grad_log_kept.reshape(-1, 1).to(dtype)
    zero = torch.zeros((), dtype=dtype, device=g.device)
    grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
    flat_grad = grad.view(-1, logits.shape[-1])
    buf = block_buffer(logits, c.rows, dtype)
    for start, block, mask in _blocks(logits, c):
        stop = start + block.shape[0]
        penalized = _penalized(c, start, stop)
        scaled, kept = _kept_scores(block, dtype, c.sampler, penalized, mask)
        rows_index = index[start:stop]
        # A token outside the kept set has log-prob -inf for all nearby logits: no gradient.
        hit = torch.isfinite(kept.gather(-1, rows_index))
        gs, hs = torch.where(hit, g[start:stop], zero), h[start:stop]
        # d/ds_j [g log mu(y) + h log S] = (g (1[j=y] - mu_j) + h (mu_j - p_j)) / T, with
        # mu the kept-set softmax and p the full softmax of s / T.
        work = torch.sub(kept, lse_kept[start:stop, None], out=buf[: block.shape[0]]).exp_()
        p = scaled.sub_(lse_all[start:stop, None]).exp_()
        work.mul_(hs - gs).sub_(p.mul_(hs))
        work.scatter_add_(-1, rows_index, gs)
        if penalized is not None:  # ds/dz: the penalty's slope, pen below 0 and 1/pen above
            pen = float(c.sampler.repetition_penalty or 1.0)
            slope = torch.full_like(work, 1 / pen).masked_fill_(block < 0, pen)
            work.mul_(slope.masked_fill_(~penalized, 1.0))
        flat_grad[start:stop].copy_(work.div_(temperature))
    return grad


def _first_positions(
    input_ids: Tensor, vocab: int, attention_mask: Tensor | None, prompt: int
) -> Tensor:
    """``(N, V)`` int64: the first position of each id in each row of ``input_ids (..., L)``,
    ``L`` where it does not occur; positions before a row's first non-zero prompt mask entry
    (left padding, as ``generate`` skips it) do not count."""
    ids = input_ids.reshape(-1, input_ids.shape[-1])
    length = ids.shape[-1]
    positions = torch.arange(length, device=ids.device).expand_as(ids)
    if attention_mask is not None:
        prompt_mask = attention_mask.reshape(ids.shape)[:, :prompt]
        padding = (prompt_mask != 0).int().argmax(-1, keepdim=True) if prompt else None
        if padding is not None:
            ids = ids.masked_fill(positions < padding, vocab)
    first = torch.full((ids.shape[0], vocab + 1), length, dtype=torch.int64, device=ids.device)
    first.scatter_reduce_(1, ids, positions, reduce="amin")
    return first[:, :vocab]


def sampler_logprobs(
    logits: Tensor,
    tokens: Tensor,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generation_config: object = None,
    input_ids: Tensor | None = None,
    mask: Tensor | None = None,
    kept_mask: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    r"""Log-probs of ``tokens`` under the distribution that the sampler drew them from.

    With processed scores :math:`s = \mathrm{pen}(z) / T` (the repetition penalty, when a
    generation config sets one, then the temperature) and the kept set :math:`K` (top-k, then
    top-p, min-p, typical-p, ε- and η-cutoff, in ``generate``'s order; or ``kept_mask``):

    .. math::

        \begin{aligned}
        \log \mu(y) &= s_y - \log \textstyle\sum_{v \in K} e^{s_v}, \\
        \log S &= \log \textstyle\sum_{v \in K} e^{s_v} \\
        &\quad - \log \textstyle\sum_v e^{s_v}
        \end{aligned}

    so that :math:`\log \mu(y) = \log \mathrm{softmax}(s)_y - \log S` for :math:`y \in K`,
    and :math:`-\infty` for a token outside :math:`K`. The kept set follows ``transformers``
    exactly, ties and the boundary token of top-p included (see the module docstring, which
    also says what vLLM does differently).

    **The keywords are not generate's defaults.** ``generate(do_sample=True, top_p=0.9)``
    also cuts to the 50 most probable tokens: a config that leaves ``top_k`` unset gets
    ``top_k=50``. ``sampler_logprobs(..., top_p=0.9)`` does not: pass ``top_k=50`` too, or
    better the ``generation_config`` that ``generate`` used. ``generate`` treats ``top_k=0``
    as "no cut"; the keyword refuses 0 by name (``None`` means no cut), while a
    ``generation_config`` keeps generate's meaning.

    **generation_config** (a ``transformers.GenerationConfig``, or a dict of its fields):
    the distribution ``generate(do_sample=True)`` samples from under it, defaults included
    (``GENERATE_DEFAULTS``: ``top_k`` 50 when unset), for ``temperature``, ``top_k``,
    ``top_p``, ``min_p``, ``typical_p``, ``epsilon_cutoff``, ``eta_cutoff`` and
    ``repetition_penalty``; ``do_sample`` is read as True. A field that reshapes the
    distribution otherwise (``UNSUPPORTED_FIELDS``: ``no_repeat_ngram_size``,
    ``bad_words_ids``, ``suppress_tokens``, ``min_new_tokens``, beams, guidance, ...) raises
    ``ValueError`` naming it. Fields a model's own ``generation_config`` would fill in
    ``generate`` must be in the config passed (pass the one ``generate`` used). ``generate``
    processes the scores in fp32 whatever the model's dtype; klpen in the compute dtype (fp32
    for half-precision logits, fp64 for fp64 ones).

    **Alignment with input_ids** (needed by the repetition penalty): ``logits (..., T, V)``
    score the response ``tokens (..., T)``; ``input_ids (..., L)`` is the whole sequence, the
    prompt of ``P = L - T`` tokens followed by the response (``tokens`` is
    ``input_ids[..., P:]``, not checked). Position ``t`` is scored with the context
    ``input_ids[..., :P + t]``, as ``generate`` sees it at step ``t``: an id is penalised
    there iff it occurs in that context (:math:`z \mapsto z \cdot \mathrm{pen}` below 0,
    :math:`z / \mathrm{pen}` otherwise). ``mask (..., L)``, optional, the 0/1 mask of
    ``input_ids`` (generate's ``attention_mask``, extended over the response): positions
    before a row's first non-zero entry of its prompt part are left padding and are not
    context, as ``generate`` skips them.

    **kept_mask** (bool, ``logits``' shape): the kept set an inference engine recorded at
    sampling time; it replaces the recomputed cut (the temperature and the repetition
    penalty still apply; a config's cut fields are then superseded). Not combinable with the
    ``top_k`` / ``top_p`` keywords.

    Args:
        logits: ``(..., V)`` floating logits; position ``t`` scores ``tokens[..., t]``.
            ``-inf`` entries (a masked vocabulary) are allowed.
        tokens: ``(...)`` integer token ids in ``[0, V)``.
        temperature: finite and ``> 0`` (0, greedy decoding, has no log-probs).
        top_k: ``None`` (no cut) or an int ``>= 1``; ``top_k >= V`` keeps everything.
        top_p: ``None`` or a float in ``(0, 1]``; 1 keeps everything.
        generation_config: see above; not combinable with the three keywords above.
        input_ids: ``(..., L)`` integer ids in ``[0, V)``, ``L >= T``, see above.
        mask: ``(..., L)`` 0/1 mask of ``input_ids``, see above.
        kept_mask: ``(..., V)`` bool, see above.

    Returns:
        ``(logprobs, log_kept_mass)``, both ``(...)`` in the compute dtype (fp32 for
        half-precision logits, else the logits' dtype). Both are differentiable w.r.t.
        ``logits`` through the kept set (the set itself is piecewise constant); a token outside
        it gets ``-inf`` and no gradient. A second derivative is refused with a
        ``RuntimeError`` naming ``sampler_logprobs``.

    Without a cut, a penalty or a ``kept_mask`` (no ``top_k``, or ``top_k >= V``; no
    ``top_p``, or 1) this is :func:`klpen.get_logprobs_for_tokens` with ``temperature`` and a
    kept mass of exactly 1.

    Memory: the rows are processed in blocks (sort and cumulative sum of one block at a time,
    a quarter of klpen's usual block when there is a cut); the forward keeps two numbers per
    row, the backward recomputes the kept set per block. The extra memory is a fixed amount
    of temporaries whatever the batch (plus, with a repetition penalty, one ``(..., V)``
    int64 table of first positions per sequence), never a copy of the logits.

    Raises:
        TypeError, ValueError: wrong types, shapes, devices or token ids; a temperature that is
            not finite and positive; ``top_k < 1``; ``top_p`` outside ``(0, 1]``; keywords and
            a config together; an unsupported config field; a repetition penalty without
            ``input_ids``; NaN or ``+inf`` logits, or a row whose kept set is empty.

    Example:
        >>> z = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))
        >>> logp, log_s = sampler_logprobs(z, torch.tensor([0]), top_p=0.7)  # keeps 0.5, 0.3
        >>> logp.exp(), log_s.exp()
        (tensor([0.6250]), tensor([0.8000]))
        >>> cfg = {"top_k": None, "top_p": 0.7}  # generate fills top_k = 50: no cut at V = 3
        >>> sampler_logprobs(z, torch.tensor([0]), generation_config=cfg)[0].exp()
        tensor([0.6250])
    """
    check_floating("logits", logits, min_ndim=1)
    check_same_device("tokens", check_token_ids("tokens", tokens), "logits", logits)
    vocab = logits.shape[-1]
    if vocab == 0:
        raise ValueError(
            f"logits must have a non-empty last (vocabulary) axis, got {tuple(logits.shape)}"
        )
    ids = check_tokens("tokens", tokens, logits.shape[:-1], vocab)
    if generation_config is not None:
        given = [
            n
            for n, v in (("temperature", temperature != 1.0), ("top_k", top_k), ("top_p", top_p))
            if v not in (None, False)
        ]
        if given:
            raise ValueError(
                f"pass either generation_config or the keywords {', '.join(given)}, not both"
            )
        sampler = _sampler_from_config(generation_config)
    else:
        sampler = _Sampler(
            check_temperature("temperature", temperature), _check_top_k(top_k), _check_top_p(top_p)
        )
    kept = None
    if kept_mask is not None:
        if top_k is not None or top_p is not None:
            raise ValueError("kept_mask replaces the top_k / top_p cut: pass one or the other")
        check_same_device("kept_mask", kept_mask, "logits", logits)
        if kept_mask.dtype != torch.bool:
            raise TypeError(f"kept_mask must be a bool tensor, got dtype {kept_mask.dtype}")
        check_shape("kept_mask", kept_mask, logits.shape, "the shape of the logits")
        kept = kept_mask
    first, prompt, steps = None, 0, max(1, logits.shape[-2] if logits.dim() > 1 else 1)
    if input_ids is not None or mask is not None:
        if input_ids is None:
            raise ValueError("mask needs input_ids (the whole sequence) with it")
        if logits.dim() < 2:
            raise ValueError(
                f"input_ids needs logits of shape (..., T, V), got {tuple(logits.shape)}"
            )
        check_same_device("input_ids", check_token_ids("input_ids", input_ids), "logits", logits)
        lead, length = tuple(logits.shape[:-2]), input_ids.shape[-1] if input_ids.dim() else -1
        if input_ids.dim() != len(lead) + 1 or length < steps:
            raise ValueError(
                f"input_ids must have shape {(*lead, 'L')} with L >= T = {steps} (the prompt "
                f"and the response), got {tuple(input_ids.shape)}"
            )
        full = check_tokens("input_ids", input_ids, (*lead, length), vocab)
        valid = None
        if mask is not None:
            valid = check_mask("mask", mask, full.shape, same_device_as=("logits", logits))
        prompt = length - steps
        if sampler.repetition_penalty is not None:
            first = _first_positions(full, vocab, valid, prompt)
    elif sampler.repetition_penalty is not None:
        raise ValueError(
            "generation_config sets repetition_penalty: pass input_ids (the prompt and the "
            "response), so that each position sees its own context"
        )
    t = sampler.temperature
    if first is None and kept is None and not sampler.cuts(vocab):
        # Nothing is cut: the sampler is softmax(z / T), S = 1, and the one-pass log-prob
        # kernel computes it (to rounding: it multiplies by 1/T where transformers divides).
        logp = get_logprobs_for_tokens(logits, ids, temperature=t)
        return logp, torch.zeros_like(logp)
    # A cut holds about ten block-sized temporaries at once (the sort's values and int64
    # indices, softmax, cumulative sum, masks): a quarter block keeps them near 2.5 blocks.
    rows = max(1, block_rows_for(logits) // _CUT_BLOCK_DIVISOR)
    c = _Context(sampler, rows, steps, prompt, first, kept)
    logp, log_kept, _, _ = _sampler_logprobs(logits, ids, first, kept, *_fields(c))
    check_no_nan(
        torch.where(torch.isfinite(log_kept), log_kept, math.nan),
        "logits contain NaN or +inf, or a row whose kept set is empty (all its logits -inf, "
        "an empty kept_mask row, or a temperature so small that they overflow); got a "
        "non-finite kept mass",
    )
    return logp, log_kept


def _refuse_minus_inf(values: Tensor, mask: Tensor, message: str) -> None:
    """Raise ``ValueError(message)`` where ``values`` is ``-inf`` at a valid position (a value
    check through ``_validation``)."""
    check_no_nan(torch.where(mask & (values == -math.inf), math.nan, 0.0), message)


def _check_pair(
    name: str, values: object, other_name: str, other: object, mask: object
) -> tuple[Tensor, Tensor, Tensor]:
    """Two floating ``(...)`` log-prob tensors of one shape and a mask; NaN/+inf at valid slots
    raise. Returns the pair in the compute dtype and the mask as bool."""
    x = check_floating(name, values)
    y = check_floating_like(other_name, other, name, x, f"the shape of {name}")
    m = check_mask("mask", mask, x.shape, same_device_as=(name, x))
    dtype = compute_dtype(torch.promote_types(x.dtype, y.dtype))
    out = []
    for n, v in ((name, x), (other_name, y)):
        v = _zero_masked(v.detach().to(dtype), m)
        check_no_nan(
            torch.where(v == math.inf, math.nan, v),
            f"{n} must not be NaN or +inf at a valid position",
        )
        out.append(v)
    return out[0], out[1], m


def importance_weights(
    logprobs: Tensor,
    behavior_logprobs: Tensor,
    mask: Tensor,
    *,
    level: str = "token",
    cap: float | None = None,
    mode: str = "truncate",
) -> Tensor:
    r"""Importance weights :math:`\pi/\mu` for tokens drawn from a behavior policy :math:`\mu`.

    With the valid log-ratios :math:`\delta_t = \log \pi(y_t) - \log \mu(y_t)` of a row:

    .. math::

        w_t = \begin{cases}
            e^{\delta_t} & \text{token} \\
            e^{\sum_s \delta_s} & \text{sequence} \\
            e^{\frac{1}{n}\sum_s \delta_s} & \text{geometric}
        \end{cases}

    the sequence and geometric weights repeated at every valid token of the row. With ``cap``:
    ``mode="truncate"`` returns :math:`\min(w, c)` (truncated importance sampling, TIS);
    ``mode="mask"`` returns 0 where :math:`w > c` (masked importance sampling, MIS).

    Args:
        logprobs: ``(..., T)`` log π of the sampled tokens (the trainer's; detached here).
        behavior_logprobs: ``(..., T)`` log μ of the same tokens (the sampler's), same shape.
            ``-inf`` at a valid position (a token μ could not draw) is refused.
        mask: ``(..., T)`` 0/1 mask of the valid tokens.
        level: ``"token"``, ``"sequence"`` or ``"geometric"``.
        cap: ``None`` or a finite positive upper bound.
        mode: ``"truncate"`` or ``"mask"``.

    Returns:
        ``(..., T)`` weights in the compute dtype, detached, 0 at masked positions. Without a
        cap a weight can overflow to ``inf`` (a sequence weight does quickly); with one it
        never does.

    Raises:
        TypeError, ValueError: wrong types or shapes; NaN or ``+inf`` log-probs, or a ``-inf``
            behavior log-prob, at a valid position; an unknown level or mode; a bad cap.

    Example:
        >>> lp = torch.log(torch.tensor([[0.5, 0.2, 0.9]]))
        >>> mu = torch.log(torch.tensor([[0.25, 0.4, 0.9]]))
        >>> importance_weights(lp, mu, torch.tensor([[1, 1, 0]]), cap=1.5)
        tensor([[1.5000, 0.5000, 0.0000]])
    """
    x, y, m = _check_pair("logprobs", logprobs, "behavior_logprobs", behavior_logprobs, mask)
    _refuse_minus_inf(
        y,
        m,
        "behavior_logprobs must not be -inf at a valid position: the behavior policy "
        "could not have drawn that token",
    )
    which = check_choice("level", level, IMPORTANCE_LEVELS)
    how = check_choice("mode", mode, IMPORTANCE_MODES)
    # concrete: the cap is an argument of torch.clamp, never a symbolic float
    c = None if cap is None else concrete(check_positive("cap", cap))
    if x.dim() == 0 and which != "token":
        raise ValueError(f"level={which!r} needs a (..., T) tensor, got a 0-d logprobs")
    # excerpt: weights
    delta = _zero_masked(x - y, m)
    if which != "token":
        # The mean as a sum of x/n - y/n: no partial sum overflows, so a token with π = 0
        # (-inf) never meets an overflowed +inf (NaN); the sum is n times the mean.
        count = m.sum(-1, keepdim=True).clamp(min=1).to(delta.dtype)
        mean = _zero_masked(x / count - y / count, m).sum(-1, keepdim=True)
        delta = (mean * count if which == "sequence" else mean).expand_as(delta)
    w = delta.exp()
    if c is not None:
        w = w.clamp(max=c) if how == "truncate" else torch.where(w > c, 0.0, w)
    return _zero_masked(w, m)
    # end excerpt


class MismatchSums(NamedTuple):
    """Sufficient statistics of :func:`mismatch_metrics`, 0-d float64 tensors.

    Over a data-parallel group, the fields of :data:`SUM_FIELDS` are all-reduced with a sum,
    ``max_abs_log_ratio`` and ``max_ratio`` with a max, ``min_ratio`` with a min; then
    ``metrics_from_sums`` gives the global metrics.
    """

    tokens: Tensor  # number of valid tokens
    sum_abs_log_ratio: Tensor  # Σ |δ|
    sum_ratio: Tensor  # Σ e^δ
    sum_k3: Tensor  # Σ (e^δ - 1 - δ)
    sum_log_ratio: Tensor  # Σ δ
    outside_band: Tensor  # number of tokens with e^δ outside the band
    max_abs_log_ratio: Tensor  # max |δ| (0 without tokens)
    max_ratio: Tensor  # max e^δ (0 without tokens)
    min_ratio: Tensor  # min e^δ (+inf without tokens)


#: Fields of :class:`MismatchSums` reduced by a sum, a max and a min across ranks.
SUM_FIELDS = ("tokens", "sum_abs_log_ratio", "sum_ratio", "sum_k3", "sum_log_ratio", "outside_band")
MAX_FIELDS = ("max_abs_log_ratio", "max_ratio")
MIN_FIELDS = ("min_ratio",)


def _check_band(band: object) -> tuple[float, float]:
    if not isinstance(band, (tuple, list)) or len(band) != 2:
        raise TypeError(f"band must be a pair (lo, hi), got {band!r}")
    lo, hi = check_positive("band[0]", band[0]), check_positive("band[1]", band[1])
    if not lo < hi:
        raise ValueError(f"band must satisfy lo < hi, got {(lo, hi)}")
    return lo, hi


def _reduced(values: Tensor, mask: Tensor, neutral: float, op: str) -> Tensor:
    """``max``/``min`` of ``values`` over ``mask``; ``neutral`` where nothing is valid."""
    flat = torch.where(mask, values, neutral).flatten()
    padded = torch.cat([flat, flat.new_full((1,), neutral)])
    return padded.amax() if op == "max" else padded.amin()


def mismatch_sums(
    trainer_logprobs: Tensor,
    rollout_logprobs: Tensor,
    mask: Tensor,
    *,
    band: tuple[float, float] = (0.8, 1.25),
) -> MismatchSums:
    r"""The sufficient statistics of :func:`mismatch_metrics`: counts, sums, max and min.

    With :math:`\delta = \log \pi_\mathrm{trainer}(y) - \log \mu(y)` over the valid tokens,
    in float64 (so that no sum of fp32 values overflows: :math:`|\delta| = 3.4 \cdot 10^{38}`
    keeps a finite mean), see :class:`MismatchSums`. No host synchronisation beyond the
    value checks of the inputs.

    Args:
        trainer_logprobs, rollout_logprobs, mask, band: as for :func:`mismatch_metrics`.

    Returns:
        A :class:`MismatchSums` of 0-d float64 tensors on the inputs' device.

    Example:
        >>> s = mismatch_sums(torch.tensor([-1.0, -2.0]), torch.tensor([-1.0, -1.5]),
        ...                   torch.tensor([1, 1]))
        >>> float(s.tokens), float(s.sum_abs_log_ratio), float(s.outside_band)
        (2.0, 0.5, 1.0)
    """
    x, y, m = _check_pair(
        "trainer_logprobs", trainer_logprobs, "rollout_logprobs", rollout_logprobs, mask
    )
    lo, hi = _check_band(band)
    _refuse_minus_inf(y, m, "rollout_logprobs must not be -inf at a valid position")
    f64 = torch.float64
    # excerpt: metrics
    delta = torch.where(m, x.to(f64) - y.to(f64), 0.0)
    ratio = delta.exp()
    outside = (ratio < lo) | (ratio > hi)
    valid = m.to(f64)
    return MismatchSums(
        tokens=valid.sum(),
        sum_abs_log_ratio=delta.abs().sum(),
        sum_ratio=torch.where(m, ratio, 0.0).sum(),
        sum_k3=torch.where(m, k3(-delta), 0.0).sum(),
        sum_log_ratio=delta.sum(),
        outside_band=(outside & m).to(f64).sum(),
        max_abs_log_ratio=_reduced(delta.abs(), m, 0.0, "max"),
        max_ratio=_reduced(ratio, m, 0.0, "max"),
        min_ratio=_reduced(ratio, m, math.inf, "min"),
    )
    # end excerpt


def metrics_from_sums(sums: MismatchSums) -> dict[str, Tensor]:
    r"""The metrics of :func:`mismatch_metrics` from its sufficient statistics, as 0-d tensors.

    Means are sums over ``tokens``; every metric is 0 where ``tokens`` is 0. No host
    synchronisation.

    Example:
        >>> s = mismatch_sums(torch.tensor([-1.0]), torch.tensor([-1.5]), torch.tensor([1]))
        >>> round(float(metrics_from_sums(s)["kl_k1"]), 4)
        -0.5
    """
    n = sums.tokens
    some = n > 0
    per = n.clamp(min=1)

    def mean(total: Tensor) -> Tensor:
        return torch.where(some, total / per, 0.0)

    return {
        "mean_abs_log_ratio": mean(sums.sum_abs_log_ratio),
        "max_abs_log_ratio": torch.where(some, sums.max_abs_log_ratio, 0.0),
        "mean_ratio": mean(sums.sum_ratio),
        "min_ratio": torch.where(some, sums.min_ratio, 0.0),
        "max_ratio": torch.where(some, sums.max_ratio, 0.0),
        "kl_k3": mean(sums.sum_k3),
        "kl_k1": mean(-sums.sum_log_ratio),
        "outside_band": mean(sums.outside_band),
        "tokens": n.clone(),
    }


def mismatch_metrics(
    trainer_logprobs: Tensor,
    rollout_logprobs: Tensor,
    mask: Tensor,
    *,
    band: tuple[float, float] = (0.8, 1.25),
    as_tensors: bool = False,
) -> dict[str, float] | dict[str, Tensor]:
    r"""What a trainer logs to see that the sampler's log-probs are not the trainer's.

    Over the valid tokens, drawn by the rollout engine :math:`\mu`, with
    :math:`\delta = \log \pi_\mathrm{trainer}(y) - \log \mu(y)` and ratio :math:`\rho = e^\delta`:

    * ``"mean_abs_log_ratio"``, ``"max_abs_log_ratio"``: mean and max of :math:`|\delta|`;
    * ``"mean_ratio"``, ``"min_ratio"``, ``"max_ratio"``: of :math:`\rho`; the mean estimates
      the trainer's mass on the sampler's support, 1 when nothing is cut;
    * ``"kl_k3"``: the k3 estimate of :math:`\mathrm{KL}(\mu \| \pi_\mathrm{trainer})`,
      :math:`\frac{1}{n}\sum (\rho - 1 - \delta)`, never negative;
    * ``"kl_k1"``: the k1 estimate :math:`-\frac{1}{n}\sum \delta` of the same KL;
    * ``"outside_band"``: the share of tokens with :math:`\rho \notin [\mathrm{lo}, \mathrm{hi}]`;
    * ``"tokens"``: the number of valid tokens.

    With no valid token every metric is 0. Computed in float64 as
    ``metrics_from_sums`` of ``mismatch_sums`` (the form a data-parallel reduction
    uses: sums and counts added, max and min reduced).

    Args:
        trainer_logprobs: ``(...)`` log-probs the trainer computes for the sampled tokens.
        rollout_logprobs: ``(...)`` log-probs the sampler reported, same shape.
        mask: ``(...)`` 0/1 mask of the valid tokens.
        band: ``(lo, hi)`` with ``0 < lo < hi`` finite.
        as_tensors: return 0-d float64 tensors (no host synchronisation) instead of floats.

    Returns:
        A dict of Python floats, rounded to nothing (format them when printing), or of 0-d
        tensors with ``as_tensors=True``.

    Example:
        >>> m = mismatch_metrics(torch.tensor([-1.0, -2.0]), torch.tensor([-1.0, -1.5]),
        ...                      torch.tensor([1, 1]))
        >>> round(m["max_abs_log_ratio"], 3), m["outside_band"], round(m["kl_k3"], 4)
        (0.5, 0.5, 0.0533)
    """
    if not isinstance(as_tensors, bool):
        raise TypeError(f"as_tensors must be a bool, got {type(as_tensors).__name__}")
    sums = mismatch_sums(trainer_logprobs, rollout_logprobs, mask, band=band)
    metrics = metrics_from_sums(sums)
    if as_tensors:
        return metrics
    return {k: float(v) for k, v in metrics.items()}
