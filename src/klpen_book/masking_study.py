"""Chapter 4's experiments: padded batches, and how each aggregation mode weighs a token.

The batch here mimics what a trainer sees: responses of unequal length padded to one ``T``,
with logits at the padded positions that are not zero but whatever the models output there
(a fine-tuned policy typically rates the pad/end token far higher than its reference does).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from klpen.masking import AGGREGATION_MODES, aggregate

from .checks import check_choice, check_coef
from .figures import FIGURE_DPI, FIGURE_WIDTH
from .tables import format_table

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["PaddedBatch", "length_bias_table", "padded_batch", "plot_length_bias", "token_weights"]

PADDING_SIDES = ("right", "left")


@dataclass(frozen=True)
class PaddedBatch:
    """A padded batch of sampled responses with the logits of a policy and its reference.

    Attributes:
        policy_logits: ``(B, T, V)`` float32, position ``t`` scoring ``tokens[:, t]``.
        reference_logits: ``(B, T, V)`` float32.
        tokens: ``(B, T)`` int64; ``pad_id`` at padded positions.
        mask: ``(B, T)`` bool, True at the response tokens.
    """

    policy_logits: Tensor
    reference_logits: Tensor
    tokens: Tensor
    mask: Tensor


def _check_lengths(lengths: Sequence[int], total_length: int) -> list[int]:
    values = list(lengths)
    if not values or any(isinstance(n, bool) or not isinstance(n, int) for n in values):
        raise TypeError(f"lengths must be a non-empty sequence of ints, got {lengths!r}")
    if min(values) < 0 or max(values) > total_length:
        raise ValueError(f"lengths must lie in [0, {total_length}], got {values}")
    return values


def padded_batch(
    lengths: Sequence[int],
    *,
    total_length: int | None = None,
    vocab_size: int = 32,
    padding: str = "right",
    pad_boost: float = 4.0,
    seed: int = 0,
) -> PaddedBatch:
    r"""A seeded batch of responses of the given lengths, right- or left-padded.

    The reference logits are standard normal scaled by 2; the policy adds a normal
    perturbation of scale 0.5 (a lightly fine-tuned model). Response tokens are sampled from
    the policy among the ids ``1..V-1``; padded positions hold the pad id 0, on which the
    policy's logit is raised by ``pad_boost`` (it has learned to stop), so that the log-ratio
    there is large and positive: exactly what an unmasked sum would add to the KL.

    The same ``seed`` gives the same responses whatever the ``padding``: a left-padded batch is
    the right-padded one with each row rotated right by its number of pads.

    Args:
        lengths: ``B`` response lengths, each in ``[0, total_length]``.
        total_length: ``T``; defaults to ``max(lengths)``.
        vocab_size: ``V`` >= 2; id 0 is the pad token.
        padding: ``"right"`` or ``"left"``.
        pad_boost: added to the policy's pad logit at padded positions, finite and >= 0.
        seed: seed of the private ``torch.Generator``.

    Example:
        >>> batch = padded_batch([3, 1], padding="left")
        >>> batch.mask.int()
        tensor([[1, 1, 1],
                [0, 0, 1]], dtype=torch.int32)
        >>> batch.tokens[1, :2]
        tensor([0, 0])
    """
    side = check_choice("padding", padding, PADDING_SIDES)
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 2:
        raise ValueError(f"vocab_size must be an int >= 2, got {vocab_size!r}")
    boost = check_coef("pad_boost", pad_boost)
    n = _check_lengths(lengths, max(lengths) if total_length is None else total_length)
    batch, steps = len(n), max(n) if total_length is None else total_length
    gen = torch.Generator().manual_seed(seed)
    reference = 2.0 * torch.randn(batch, steps, vocab_size, generator=gen)
    policy = reference + 0.5 * torch.randn(batch, steps, vocab_size, generator=gen)
    valid = torch.arange(steps)[None, :] < torch.tensor(n)[:, None]
    # Sample real tokens among 1..V-1 from the policy; id 0 is reserved for padding.
    probs = torch.softmax(policy[..., 1:], dim=-1).reshape(-1, vocab_size - 1)
    sampled = torch.multinomial(probs, 1, generator=gen).view(batch, steps) + 1
    tokens = torch.where(valid, sampled, 0)
    policy[..., 0] += torch.where(valid, 0.0, boost)
    if side == "left":
        # Rotating each row by its number of pads keeps every response's content identical.
        index = (torch.arange(steps)[None, :] - (steps - torch.tensor(n))[:, None]) % steps
        policy = policy.gather(1, index[..., None].expand_as(policy))
        reference = reference.gather(1, index[..., None].expand_as(reference))
        tokens, valid = tokens.gather(1, index), valid.gather(1, index)
    return PaddedBatch(policy, reference, tokens, valid)


def token_weights(mask: Tensor, mode: str) -> Tensor:
    r"""The weight each token gets in :func:`klpen.aggregate`: its gradient w.r.t. the values.

    Every mode is linear in the per-token values, ``aggregate(x) = sum_{b,t} c_{b,t} x_{b,t}``,
    so the weights are the gradient. For a row of length :math:`L_b` in a batch of :math:`B`
    rows and :math:`N = \sum_b L_b` tokens: token-mean :math:`1/N`, token-sum 1,
    seq-mean-token-mean :math:`1/(B L_b)`, seq-mean-token-sum :math:`1/B`.

    Args:
        mask: ``(B, T)`` 0/1 mask.
        mode: an aggregation mode of :func:`klpen.aggregate`.

    Returns:
        ``(B, T)`` float64 weights, zero where the mask is 0.

    Example:
        >>> token_weights(torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0]]), "seq-mean-token-mean")
        tensor([[0.1250, 0.1250, 0.1250, 0.1250],
                [0.5000, 0.0000, 0.0000, 0.0000]], dtype=torch.float64)
    """
    # excerpt: gradient
    values = torch.zeros(tuple(mask.shape), dtype=torch.float64, requires_grad=True)
    (grad,) = torch.autograd.grad(aggregate(values, mask, mode), values)
    return grad
    # end excerpt


def _length_mask(lengths: Sequence[int]) -> Tensor:
    n = _check_lengths(lengths, max(lengths, default=0))
    return torch.arange(max(n))[None, :] < torch.tensor(n)[:, None]


def length_bias_table(lengths: Sequence[int]) -> str:
    """A table of how much a token, and a whole row, weighs in each aggregation mode.

    Args:
        lengths: the response lengths of one batch.

    Returns:
        Plain text: one line per mode, a "per token" and a "row total" column per length.

    Example:
        >>> print(length_bias_table([1, 3]).splitlines()[2])
        token-mean           0.250  0.250  0.250  0.750
    """
    mask = _length_mask(lengths)
    headers = ["mode"]
    for n in lengths:
        headers += [f"token (L={n})", f"row (L={n})"]
    rows: list[list[object]] = []
    for mode in AGGREGATION_MODES:
        w = token_weights(mask, mode)
        row: list[object] = [mode]
        for b in range(len(lengths)):
            row += [float(w[b, 0]) if lengths[b] else 0.0, float(w[b].sum())]
        rows.append(row)
    return format_table(rows, headers)


def plot_length_bias(lengths: Sequence[int]) -> Figure:
    """Bar charts of the per-token and per-row weight of each length in each mode (log scale).

    Example:
        >>> fig = plot_length_bias([4, 16, 64])
        >>> len(fig.axes)
        2
    """
    from matplotlib.figure import Figure

    mask = _length_mask(lengths)
    fig = Figure(figsize=(FIGURE_WIDTH, 5.6), dpi=FIGURE_DPI, layout="constrained")
    token_ax, row_ax = fig.subplots(2, 1, sharex=True)
    width = 0.8 / len(lengths)
    for b, n in enumerate(lengths):
        weights = [token_weights(mask, mode)[b] for mode in AGGREGATION_MODES]
        x = [i + (b - (len(lengths) - 1) / 2) * width for i in range(len(AGGREGATION_MODES))]
        token_ax.bar(x, [float(w[0]) for w in weights], width, label=f"L = {n}")
        row_ax.bar(x, [float(w.sum()) for w in weights], width, label=f"L = {n}")
    for ax, label in ((token_ax, "weight of one token"), (row_ax, "weight of the whole row")):
        ax.set_yscale("log")
        ax.set_ylabel(label)
        ax.grid(axis="y", alpha=0.3)
    # Two-line tick labels: the four mode names side by side would overlap.
    labels = [mode.replace("seq-mean-", "seq-mean-\n") for mode in AGGREGATION_MODES]
    row_ax.set_xticks(range(len(AGGREGATION_MODES)), labels)
    row_ax.set_xlabel("aggregation mode")
    fig.legend(
        *token_ax.get_legend_handles_labels(),
        title="response length",
        loc="outside upper center",
        ncols=len(lengths),
    )
    return fig
