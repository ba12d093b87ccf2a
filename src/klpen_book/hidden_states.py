"""Chapter 11's section on hidden states: what the logits cost, and what the fused path keeps.

The memory arithmetic is exact bookkeeping (bytes of tensors of given shapes); the measured
table replays torch's own allocation record (:func:`~klpen_book.memory.peak_extra_bytes`), so
both print the same numbers on every run.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from klpen import full_kl, get_logprobs_for_tokens, linear_full_kl, linear_logprobs

from .blocks import GROUPS, tile_shape
from .figures import FIGURE_DPI, FIGURE_SIZE, size_ticks
from .memory import peak_extra_bytes
from .tables import format_table

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = [
    "HIDDEN_PATHS",
    "MODELS",
    "fused_scratch_bytes",
    "hidden_memory_sweep",
    "hidden_state_memory_table",
    "measured_memory_table",
    "plot_hidden_memory",
]

# (hidden size H, vocabulary V) of the models' published configurations (config.json).
MODELS: dict[str, tuple[int, int]] = {
    "Gemma-2-2B": (2304, 256_000),
    "Llama-3-8B": (4096, 128_256),
    "Llama-3-70B": (8192, 128_256),
}

GB, MB = 1e9, 1e6


def fused_scratch_bytes(tokens: int, hidden: int, vocab: int, half: bool, workers: int = 1) -> int:
    """Bytes :func:`~klpen.linear.linear_logprobs` allocates besides its inputs and result.

    One fp32 logits tile per worker thread (a quarter of the size for half-precision inputs),
    the per-row partial sums of the vocabulary groups, and for half-precision inputs the fp32
    copies of the hidden states and of one tile of the weight per worker.

    Example:
        >>> fused_scratch_bytes(2048, 1024, 128_256, half=False) / 2**20
        16.15625
    """
    rows, cols = tile_shape(tokens, vocab, narrow=half)
    groups = min(GROUPS, -(-vocab // cols))
    total = workers * 4 * rows * cols + 4 * (2 * groups + 4) * tokens
    if half:
        total += 4 * tokens * hidden + workers * 4 * cols * hidden
    return total


def hidden_state_memory_table(tokens: Sequence[int] = (8192, 16_384, 32_768)) -> str:
    """What one forward pass's logits take, against the hidden states and the fused scratch.

    Columns: bf16 hidden states (what the fused path reads), the logits in bf16 and in fp32
    (what the unfused path builds, per model: twice with a reference), and the fused path's
    scratch for bf16 inputs.

    Example:
        >>> print(hidden_state_memory_table([8192]).splitlines()[2])
        Gemma-2-2B   8192  ...
    """
    rows = []
    for name, (h, v) in MODELS.items():
        for n in tokens:
            rows.append(
                [
                    name,
                    n,
                    2 * n * h / MB,
                    2 * n * v / GB,
                    4 * n * v / GB,
                    fused_scratch_bytes(n, h, v, half=True) / MB,
                ]
            )
    headers = ["model", "tokens", "hidden bf16 MB", "logits bf16 GB", "logits fp32 GB", "fused MB"]
    return format_table(rows, headers, digits=1)


def measured_memory_table(
    tokens: int = 1024, hidden: int = 256, vocab: int = 32_000, seed: int = 0
) -> str:
    """Peak extra bytes (torch's allocation record) of unfused and fused calls, fp32.

    Unfused: ``hidden @ weight.T`` then :func:`~klpen.get_logprobs_for_tokens` or
    :func:`~klpen.full_kl`; fused: :func:`~klpen.linear.linear_logprobs` /
    :func:`~klpen.linear.linear_full_kl`. The forward + backward rows count the gradients of
    ``hidden`` and ``weight`` too, which both return.

    Example:
        >>> print(measured_memory_table(64, 8, 1000).splitlines()[0])
        N = 64, H = 8, V = 1000: one fp32 logits tensor = 0.3 MB
    """
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g)
    w = torch.randn(vocab, hidden, generator=g) / math.sqrt(hidden)
    ref_x = x + 0.1 * torch.randn(tokens, hidden, generator=g)
    ids = torch.randint(0, vocab, (tokens,), generator=g)

    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()

    def fwd_bwd(f: Callable[[Tensor, Tensor], Tensor]) -> Callable[[], None]:
        def run() -> None:
            torch.autograd.backward(f(xg, wg).sum())

        return run

    def unfused_lp(a: Tensor, b: Tensor) -> Tensor:
        return get_logprobs_for_tokens(a @ b.T, ids)

    def fused_lp(a: Tensor, b: Tensor) -> Tensor:
        return linear_logprobs(a, b, ids)

    cases: list[tuple[str, Callable[[], object], Callable[[], object]]] = [
        ("log-probs, forward", lambda: unfused_lp(x, w), lambda: fused_lp(x, w)),
        ("log-probs, forward + backward", fwd_bwd(unfused_lp), fwd_bwd(fused_lp)),
        (
            "full KL, forward",
            lambda: full_kl(x @ w.T, ref_x @ w.T),
            lambda: linear_full_kl(x, w, ref_x, w),
        ),
    ]
    logits_mb = 4 * tokens * vocab / MB
    rows = []
    with torch.no_grad():
        for name, unfused, fused in cases[:1] + cases[2:]:
            rows.append([name, peak_extra_bytes(unfused) / MB, peak_extra_bytes(fused) / MB])
    name, *calls = cases[1]
    peaks = []
    for call in calls:
        xg.grad = wg.grad = None  # freed outside the measurement
        peaks.append(peak_extra_bytes(call) / MB)
    rows.insert(1, [name, *peaks])
    headers = ["case", "unfused MB", "fused MB"]
    title = f"N = {tokens}, H = {hidden}, V = {vocab}: one fp32 logits tensor = {logits_mb:.1f} MB"
    return title + "\n" + format_table(rows, headers, digits=1)


#: The three paths of :func:`hidden_memory_sweep`, from hidden states to token log-probs.
HIDDEN_PATHS = ("logits + log_softmax", "logits + klpen", "fused (linear_logprobs)")


def hidden_memory_sweep(
    vocabs: Sequence[int], tokens: int = 256, hidden: int = 64, seed: int = 0
) -> dict[str, list[int]]:
    """Peak extra bytes (forward, fp32) of three paths from hidden states, at each ``V``.

    ``logits + log_softmax``: ``hidden @ weight.T``, then the naive full log-softmax and a
    gather (:func:`~klpen_book.memory.naive_token_logprobs`); ``logits + klpen``: the same
    logits, then :func:`klpen.get_logprobs_for_tokens`; fused: :func:`klpen.linear_logprobs`,
    which never holds the logits. Measured with :func:`~klpen_book.memory.peak_extra_bytes`.

    Example:
        >>> sweep = hidden_memory_sweep([1000], tokens=16, hidden=8)
        >>> sweep["logits + log_softmax"][0] >= 2 * 4 * 16 * 1000
        True
    """
    from .memory import naive_token_logprobs

    out: dict[str, list[int]] = {name: [] for name in HIDDEN_PATHS}
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g)
    for vocab in vocabs:
        w = torch.randn(vocab, hidden, generator=g) / math.sqrt(hidden)
        ids = torch.randint(0, vocab, (tokens,), generator=g)
        calls: list[Callable[[Tensor, Tensor, Tensor], object]] = [
            lambda a, b, t: naive_token_logprobs(a @ b.T, t),
            lambda a, b, t: get_logprobs_for_tokens(a @ b.T, t),
            linear_logprobs,
        ]
        with torch.no_grad():
            for name, call in zip(HIDDEN_PATHS, calls, strict=True):
                out[name].append(peak_extra_bytes(call, x, w, ids))
    return out


def plot_hidden_memory(vocabs: Sequence[int], sweep: dict[str, list[int]], tokens: int) -> Figure:
    """Peak extra memory (MB, log-log) of :func:`hidden_memory_sweep`'s paths against ``V``.

    The grey line is one fp32 logits tensor, ``4 N V`` bytes.

    Example:
        >>> fig = plot_hidden_memory([10, 20], {"a": [400, 800]}, tokens=10)
        >>> fig.axes[0].get_xlabel()
        'vocabulary V'
    """
    from matplotlib.figure import Figure

    fig = Figure(figsize=FIGURE_SIZE, dpi=FIGURE_DPI, layout="constrained")
    ax = fig.add_subplot()
    v = list(vocabs)
    ax.plot(v, [4 * tokens * n / MB for n in v], color="0.6", lw=3, label="one fp32 logits tensor")
    for index, (name, values) in enumerate(sweep.items()):
        ax.plot(v, [b / MB for b in values], marker="o", ms=4, color=f"C{index}", label=name)
    ax.set_xscale("log")
    ax.set_yscale("log")
    size_ticks(ax, v)
    ax.set_xlabel("vocabulary V")
    ax.set_ylabel("peak extra memory (MB)")
    ax.set_title(f"N = {tokens} positions, forward, fp32", fontsize="medium")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small", loc="upper left")
    return fig
