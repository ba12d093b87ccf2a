"""Chapter 2's laboratory: a toy language model, the next-token shift, half-precision error.

A language model's logits at position ``t`` are its prediction of the token at ``t + 1``. The
toy model here is the smallest model for which that is literally true, a bigram table: the
logits at ``t`` are a fixed row chosen by the token at ``t``. It is enough to show which logits
score which token, and which of them belong to the response that the KL penalty is about.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from klpen import get_logprobs_for_tokens

from .checks import check_floating, check_tokens
from .figures import FIGURE_DPI, FIGURE_SIZE
from .tables import format_table

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = [
    "OFFSET_METHODS",
    "TOY_VOCAB",
    "decode",
    "encode",
    "logprob_errors",
    "next_token_table",
    "offset_errors",
    "order_of_magnitude",
    "plot_offset_errors",
    "precision_table",
    "toy_language_model",
]

#: The toy model's vocabulary; a token id is an index into it.
TOY_VOCAB = ("<bos>", "the", "cat", "dog", "sat", "ran", "on", "a", "mat", "rug", ".", "<eos>")


def encode(text: str, vocab: Sequence[str] = TOY_VOCAB) -> Tensor:
    """Token ids of whitespace-separated words, as a ``(1, T)`` int64 batch.

    Example:
        >>> encode("<bos> the cat")
        tensor([[0, 1, 2]])
    """
    words = text.split()
    unknown = [w for w in words if w not in vocab]
    if unknown:
        raise ValueError(f"text must use words of the vocabulary {list(vocab)}, got {unknown}")
    return torch.tensor([[vocab.index(w) for w in words]])


def decode(tokens: Tensor, vocab: Sequence[str] = TOY_VOCAB) -> list[str]:
    """Words of a ``(T,)`` sequence of token ids.

    Example:
        >>> decode(torch.tensor([0, 1, 2]))
        ['<bos>', 'the', 'cat']
    """
    return [vocab[i] for i in tokens.tolist()]


def toy_language_model(vocab_size: int = len(TOY_VOCAB), *, seed: int = 0) -> torch.nn.Embedding:
    r"""A bigram language model: logits at position ``t`` depend only on token ``t``.

    .. math:: z_t = W_{y_t,\,:}, \qquad W \in \mathbb R^{V \times V},\;
              W_{ij} \sim \mathcal N(0, 2^2)

    Calling it on ``(B, T)`` token ids returns ``(B, T, V)`` float32 logits, the same layout as
    a transformer's output: position ``t`` predicts token ``t + 1``, and the last position
    predicts a token that is not in the sequence.

    Example:
        >>> model = toy_language_model()
        >>> tuple(model(encode("<bos> the cat")).shape)
        (1, 3, 12)
    """
    g = torch.Generator().manual_seed(seed)
    model = torch.nn.Embedding(vocab_size, vocab_size)
    with torch.no_grad():
        model.weight.copy_(2.0 * torch.randn(vocab_size, vocab_size, generator=g))
    return model


def next_token_table(
    tokens: Tensor,
    logprobs: Tensor,
    prompt_length: int,
    vocab: Sequence[str] = TOY_VOCAB,
    digits: int = 3,
) -> str:
    """Which logits score which token: one row per shifted position, as plain text.

    Row ``t`` reads the logits computed at position ``t`` (whose input is ``tokens[t]``),
    the token they score, ``tokens[t + 1]``, whether that token is part of the prompt or of the
    response, and its log-probability ``logprobs[t]``.

    Args:
        tokens: ``(T,)`` token ids of prompt and response.
        logprobs: ``(T - 1,)`` log-probs of ``tokens[1:]``, from the shifted logits.
        prompt_length: number of prompt tokens at the start of ``tokens``.
        vocab: words of the token ids.
        digits: decimals shown.

    Example:
        >>> print(next_token_table(torch.tensor([0, 1, 2]), torch.tensor([-0.5, -1.25]), 2))
        logits at t  input  scores token  part      log π
        -----------  -----  ------------  --------  ------
                  0  <bos>  the           prompt    -0.500
                  1  the    cat           response  -1.250
    """
    check_floating("logprobs", logprobs, min_ndim=1)
    ids = check_tokens("tokens", tokens, (logprobs.shape[0] + 1,), len(vocab))
    words = decode(ids, vocab)
    rows: list[list[object]] = [
        [t, words[t], words[t + 1], "prompt" if t + 1 < prompt_length else "response", lp]
        for t, lp in enumerate(logprobs.tolist())
    ]
    headers = ["logits at t", "input", "scores token", "part", "log π"]
    return format_table(rows, headers, digits=digits)


def logprob_errors(logits: Tensor, tokens: Tensor) -> dict[str, tuple[torch.dtype, float]]:
    r"""Largest error of two extractions from half-precision logits, against float64.

    The reference is :math:`\log\mathrm{softmax}` of the same logits converted exactly to
    float64; the two candidates are klpen's :func:`~klpen.get_logprobs_for_tokens` (computed
    in fp32, returned as fp32) and ``log_softmax`` evaluated in the logits' own dtype.

    Args:
        logits: ``(..., V)`` logits, typically bf16 or fp16.
        tokens: ``(...)`` token ids.

    Returns:
        ``{"klpen": (dtype, max |error|), "log_softmax in <dtype>": (dtype, max |error|)}``.

    Example:
        >>> logits = torch.randn(4, 1000, generator=torch.Generator().manual_seed(0))
        >>> errors = logprob_errors(logits.bfloat16(), torch.zeros(4, dtype=torch.long))
        >>> errors["klpen"][0], errors["klpen"][1] < 1e-5 < errors["log_softmax in bfloat16"][1]
        (torch.float32, True)
    """
    check_floating("logits", logits, min_ndim=1)
    ids = check_tokens("tokens", tokens, logits.shape[:-1], logits.shape[-1])
    index = ids.unsqueeze(-1)
    reference = torch.log_softmax(logits.double(), dim=-1).gather(-1, index).squeeze(-1)
    ours = get_logprobs_for_tokens(logits, ids)
    native = torch.log_softmax(logits, dim=-1).gather(-1, index).squeeze(-1)
    name = str(logits.dtype).removeprefix("torch.")
    return {
        "klpen": (ours.dtype, float((ours.double() - reference).abs().max())),
        f"log_softmax in {name}": (native.dtype, float((native.double() - reference).abs().max())),
    }


def order_of_magnitude(x: float) -> str:
    """``x`` rounded down to a power of ten, as text: stable where the digits are not.

    Example:
        >>> order_of_magnitude(3.2e-7), order_of_magnitude(0.04), order_of_magnitude(0.0)
        ('1e-07', '1e-02', '0')
    """
    if x == 0:
        return "0"
    return f"1e{math.floor(math.log10(abs(x))):+03d}".replace("+", "")


def precision_table(errors: dict[str, tuple[torch.dtype, float]]) -> str:
    """Plain-text table of :func:`logprob_errors`, errors as orders of magnitude.

    Example:
        >>> print(precision_table({"klpen": (torch.float32, 3e-7)}))
        method  result dtype  max |error| vs fp64
        ------  ------------  -------------------
        klpen   float32                     1e-07
    """
    rows: list[list[object]] = [
        [name, str(dtype).removeprefix("torch."), order_of_magnitude(err)]
        for name, (dtype, err) in errors.items()
    ]
    return format_table(rows, ["method", "result dtype", "max |error| vs fp64"])


#: The extractions :func:`offset_errors` compares: (label, logits dtype, method).
OFFSET_METHODS = (
    ("log_softmax, bf16 logits", torch.bfloat16, "native"),
    ("log_softmax, fp32 logits", torch.float32, "native"),
    ("klpen, bf16 logits", torch.bfloat16, "klpen"),
    ("klpen, fp32 logits", torch.float32, "klpen"),
)


def offset_errors(
    offsets: Sequence[float], rows: int = 256, vocab: int = 4096, *, seed: int = 0
) -> dict[str, list[float]]:
    r"""Largest error of each extraction against float64, as a common offset grows.

    The logits are ``3 z + c`` (``z`` standard normal, ``(rows, vocab)``), rounded to the
    method's dtype; that rounding is the model's, so the reference is
    :math:`\log\mathrm{softmax}` of the *rounded* logits in float64. A softmax does not
    change under a common offset ``c``, and neither computation forms numbers of size ``c``
    (``log_softmax`` subtracts the row maximum, klpen the token's logit), so the error stays
    that of the result's dtype: ``log_softmax`` of bf16 logits returns bf16 (spacing 1/16 near
    -12), klpen returns fp32. At large offsets the bf16 logits themselves collapse onto few
    values (spacing 8 near 1000), which makes the log-probs nearly equal and the bf16 error
    smaller.

    Returns:
        ``{label: [max |error| at each offset]}`` for the labels of :data:`OFFSET_METHODS`.

    Example:
        >>> errors = offset_errors([0.0, 1e4], rows=8, vocab=100)
        >>> max(errors["klpen, bf16 logits"]) < 1e-5 < min(errors["log_softmax, bf16 logits"])
        True
    """
    g = torch.Generator().manual_seed(seed)
    base = 3 * torch.randn(rows, vocab, generator=g, dtype=torch.float64)
    ids = torch.randint(0, vocab, (rows,), generator=g)
    out: dict[str, list[float]] = {label: [] for label, _, _ in OFFSET_METHODS}
    for c in offsets:
        for label, dtype, method in OFFSET_METHODS:
            logits = (base + float(c)).to(dtype)
            exact = torch.log_softmax(logits.double(), -1).gather(-1, ids[:, None]).squeeze(-1)
            if method == "klpen":
                got = get_logprobs_for_tokens(logits, ids)
            else:
                got = torch.log_softmax(logits, -1).gather(-1, ids[:, None]).squeeze(-1)
            out[label].append(float((got.double() - exact).abs().max()))
    return out


def plot_offset_errors(
    offsets: Sequence[float], errors: dict[str, list[float]], floor: float = 1e-8
) -> Figure:
    """Max error against float64 (log scale) against the common logit offset (symlog scale).

    Errors below ``floor`` (exact results among them) are drawn at ``floor``.

    Example:
        >>> fig = plot_offset_errors([0.0, 10.0], {"a": [0.0, 1e-3]})
        >>> fig.axes[0].get_xlabel()
        'common offset c of the logits'
    """
    from matplotlib.figure import Figure

    fig = Figure(figsize=FIGURE_SIZE, dpi=FIGURE_DPI, layout="constrained")
    ax = fig.add_subplot()
    styles = {"bf16": "--", "fp32": "-"}
    for index, (label, values) in enumerate(errors.items()):
        style = next((s for key, s in styles.items() if key in label), "-")
        color = "C1" if label.startswith("log_softmax") else "C0"
        ax.plot(
            list(offsets),
            [max(v, floor) for v in values],
            ls=style,
            marker="os^v"[index % 4],
            ms=4,
            color=color,
            label=label,
        )
    ax.set_xscale("symlog", linthresh=1.0)
    ax.set_yscale("log")
    ax.set_xlabel("common offset c of the logits")
    ax.set_ylabel("max |error| vs float64")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small", loc="center right")
    return fig
