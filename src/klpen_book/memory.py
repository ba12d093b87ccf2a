"""Measure the extra memory a computation allocates, deterministically, on the CPU.

Chapter 2 compares the naive ``log_softmax(logits).gather(...)`` with
:func:`klpen.get_logprobs_for_tokens`. Process-level numbers (resident set size) depend on the
allocator, on what was freed before and on sampling time; instead this module replays torch's
own record of every allocation and free made while the computation runs (``torch.profiler``
with ``profile_memory=True``) and reports the peak of the bytes they keep alive. The same
shapes give the same number on every run.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from klpen import get_logprobs_for_tokens

from .checks import check_choice, check_floating, check_tokens
from .figures import FIGURE_DPI, FIGURE_SIZE, size_ticks
from .tables import format_table

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = [
    "LogprobMemory",
    "logprob_memory",
    "memory_sweep",
    "memory_table",
    "naive_token_logprobs",
    "peak_extra_bytes",
    "plot_memory_sweep",
]

MB = 1e6


@contextlib.contextmanager
def _silenced_stderr() -> Iterator[None]:
    # The profiler's C++ backend (kineto) logs "profiler_start/stop" lines with a timestamp
    # straight to file descriptor 2, which a notebook would store as output. Point the
    # descriptor at /dev/null for the duration of the measurement, then restore it.
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(devnull)
        os.close(saved)


def peak_extra_bytes(fn: Callable[..., object], *args: object) -> int:
    r"""Peak bytes allocated by ``fn(*args)`` on the CPU and alive at the same time.

    Replays the allocation (``+n``) and free (``-n``) events that ``torch.profiler`` records
    during the call, in order, and returns the largest running sum:

    .. math:: \mathrm{peak} = \max_k \textstyle\sum_{i \le k} \Delta_i

    Tensors that existed before the call (its inputs) are not counted; what the call returns
    is, since it is alive at the end. The result is deterministic for given shapes, dtypes and
    thread count.

    Args:
        fn: the computation; its return value is discarded.
        *args: its arguments.

    Returns:
        Bytes, an ``int`` (0 if nothing was allocated).

    Example:
        >>> x = torch.zeros(1000, dtype=torch.float32)
        >>> peak_extra_bytes(torch.exp, x)  # one new (1000,) fp32 tensor
        4000
    """
    from torch.profiler import ProfilerActivity, profile

    with _silenced_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as p:
        fn(*args)
    events = [e for e in p.profiler.kineto_results.events() if e.name() == "[memory]"]
    events.sort(key=lambda e: e.start_ns())
    live = peak = 0
    for e in events:
        live += e.nbytes()
        peak = max(peak, live)
    return peak


def naive_token_logprobs(logits: Tensor, tokens: Tensor) -> Tensor:
    r"""The textbook extraction, for comparison: a full log-softmax copy, then one gather.

    .. math:: \log \pi(y_t) = \big[\log\mathrm{softmax}(z_t)\big]_{y_t}

    Half-precision logits are first upcast to fp32, as careful naive code does, which adds a
    second ``(..., V)`` copy. Returns ``(...)`` log-probs like
    :func:`klpen.get_logprobs_for_tokens`, but its peak memory grows with ``numel(logits)``.

    Example:
        >>> logits = torch.tensor([[[2.0, 0.0, 0.0], [0.0, 0.0, 0.0]]])
        >>> naive_token_logprobs(logits, torch.tensor([[0, 2]]))
        tensor([[-0.2395, -1.0986]])
    """
    full = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
    return full.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


_METHODS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "naive": naive_token_logprobs,
    "klpen": get_logprobs_for_tokens,
}


def _forward_backward(
    fn: Callable[[Tensor, Tensor], Tensor], logits: Tensor, tokens: Tensor
) -> None:
    torch.autograd.backward(fn(logits, tokens).sum())


@dataclass(frozen=True)
class LogprobMemory:
    """Measured peak extra memory of one log-prob extraction method.

    Attributes:
        method: ``"naive"`` or ``"klpen"``.
        dtype: dtype of the logits, e.g. ``"float32"``.
        logits_bytes: size of the logits tensor itself.
        forward_bytes: peak extra bytes of the forward pass.
        backward_bytes: peak extra bytes of forward plus backward (the gradient w.r.t. the
            logits, one ``(B, T, V)`` tensor in every method, included).
    """

    method: str
    dtype: str
    logits_bytes: int
    forward_bytes: int
    backward_bytes: int


def logprob_memory(
    batch: int,
    seq_len: int,
    vocab: int,
    dtype: torch.dtype = torch.float32,
    methods: Sequence[str] = ("naive", "klpen"),
    *,
    seed: int = 0,
) -> list[LogprobMemory]:
    """Peak extra memory of each extraction method on random ``(batch, seq_len, vocab)`` logits.

    Each method runs twice on the same inputs: forward only, then forward and backward of the
    sum of the log-probs (:func:`peak_extra_bytes` around each).

    Args:
        batch, seq_len, vocab: shape of the logits ``(B, T, V)``.
        dtype: floating dtype of the logits.
        methods: among ``"naive"`` (:func:`naive_token_logprobs`) and ``"klpen"``
            (:func:`klpen.get_logprobs_for_tokens`).
        seed: seed of the logits and tokens.

    Returns:
        One :class:`LogprobMemory` per method.

    Example:
        >>> naive, ours = logprob_memory(2, 256, 32768)  # 67 MB of logits, 4 blocks
        >>> naive.forward_bytes >= naive.logits_bytes > ours.forward_bytes
        True
    """
    names = [check_choice("methods", m, list(_METHODS)) for m in methods]
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, seq_len, vocab, generator=g).to(dtype)
    check_floating("dtype", logits)
    tokens = torch.randint(0, vocab, (batch, seq_len), generator=g)
    check_tokens("tokens", tokens, logits.shape[:-1], vocab)
    out = []
    for name in names:
        fn = _METHODS[name]
        forward = peak_extra_bytes(fn, logits, tokens)
        leaf = logits.detach().requires_grad_()
        backward = peak_extra_bytes(_forward_backward, fn, leaf, tokens)
        out.append(
            LogprobMemory(
                method=name,
                dtype=str(dtype).removeprefix("torch."),
                logits_bytes=logits.numel() * logits.element_size(),
                forward_bytes=forward,
                backward_bytes=backward,
            )
        )
    return out


def memory_table(results: Sequence[LogprobMemory], digits: int = 1) -> str:
    """Plain-text table of :func:`logprob_memory` results, in MB (10⁶ bytes), rounded.

    Example:
        >>> print(memory_table([LogprobMemory("naive", "float32", 4_000_000, 4_000_064, 12e6)]))
        method  logits dtype  logits MB  forward MB  fwd+bwd MB
        ------  ------------  ---------  ----------  ----------
        naive   float32             4.0         4.0        12.0
    """
    rows: list[list[object]] = [
        [r.method, r.dtype, r.logits_bytes / MB, r.forward_bytes / MB, r.backward_bytes / MB]
        for r in results
    ]
    headers = ["method", "logits dtype", "logits MB", "forward MB", "fwd+bwd MB"]
    return format_table(rows, headers, digits=digits)


def memory_sweep(
    shapes: Sequence[tuple[int, int]], dtype: torch.dtype = torch.float32, *, seed: int = 0
) -> list[tuple[LogprobMemory, LogprobMemory]]:
    """:func:`logprob_memory` of one sequence per ``(tokens, vocab)`` shape: (naive, klpen).

    Example:
        >>> (naive, ours), = memory_sweep([(64, 1000)])
        >>> naive.forward_bytes >= naive.logits_bytes
        True
    """
    out = []
    for tokens, vocab in shapes:
        naive, ours = logprob_memory(1, tokens, vocab, dtype, ("naive", "klpen"), seed=seed)
        out.append((naive, ours))
    return out


def plot_memory_sweep(
    by_tokens: Sequence[tuple[int, tuple[LogprobMemory, LogprobMemory]]],
    by_vocab: Sequence[tuple[int, tuple[LogprobMemory, LogprobMemory]]],
    titles: tuple[str, str] = ("", ""),
) -> Figure:
    """Two panels: peak extra memory against the tokens ``N`` (left) and the vocabulary ``V``.

    Each panel draws, on log-log axes in MB, the naive extraction (orange) and klpen (blue),
    forward only (solid) and forward + backward (dashed), and the logits' own size (grey).

    Args:
        by_tokens: ``(N, (naive, klpen))`` pairs at one vocabulary (:func:`memory_sweep`).
        by_vocab: ``(V, (naive, klpen))`` pairs at one number of tokens.
        titles: the panels' titles (what is held fixed in each).

    Example:
        >>> sweep = memory_sweep([(8, 100), (16, 100)])
        >>> fig = plot_memory_sweep(list(zip([8, 16], sweep)), list(zip([100, 100], sweep)))
        >>> [ax.get_xlabel() for ax in fig.axes]
        ['tokens N', 'vocabulary V']
    """
    from matplotlib.figure import Figure

    fig = Figure(figsize=FIGURE_SIZE, dpi=FIGURE_DPI, layout="constrained")
    axes = fig.subplots(1, 2, sharey=True)
    panels = ((axes[0], by_tokens, "tokens N"), (axes[1], by_vocab, "vocabulary V"))
    for ax, series, label in panels:
        x = [size for size, _ in series]
        ax.plot(x, [p[0].logits_bytes / MB for _, p in series], color="0.6", lw=3, label="logits")
        for index, (name, color) in enumerate((("naive", "C1"), ("klpen", "C0"))):
            fwd = [p[index].forward_bytes / MB for _, p in series]
            bwd = [p[index].backward_bytes / MB for _, p in series]
            ax.plot(x, fwd, color=color, marker="o", ms=3, label=f"{name}, forward")
            ax.plot(x, bwd, color=color, ls="--", label=f"{name}, fwd + bwd")
        ax.set_xscale("log")
        ax.set_yscale("log")
        size_ticks(ax, x)
        ax.set_xlabel(label)
        ax.grid(alpha=0.3, which="major")
    axes[0].set_ylabel("peak extra memory (MB)")
    for ax, title in zip(axes, titles, strict=True):
        ax.set_title(title, fontsize="medium")
    axes[1].legend(fontsize="x-small", loc="upper left")
    return fig
