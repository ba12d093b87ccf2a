r"""Chapter 10's laboratory: a teacher, a smaller student, three ways to distil one into the other.

The language is chapter 9's grammar (:mod:`klpen_book.language`). The *teacher* is its tiny
GPT-2 trained on the grammar's sentences; the *student* is a GPT-2 of another hidden size, too
small to copy the teacher exactly, so that what each objective gives up becomes visible.
:func:`distill` trains a student one of three ways (:data:`METHODS`):

* ``"sft"``: off-policy, maximum likelihood on a fixed set of teacher samples: the forward KL
  ``KL(teacher ‖ student)`` estimated on the teacher's text;
* ``"reverse"``: on-policy, a policy gradient whose per-token reward is
  :func:`klpen.distillation_rewards` on the student's own samples (the reverse KL);
* ``"jsd"``: on-policy too, GKD's generalized JSD at a middle β, exact over the vocabulary
  and computed from the two models' hidden states (:func:`klpen.linear_generalized_jsd`).

Every update records, on a batch the student drew, the exact per-token reverse and forward KL
to the teacher and the share of well-formed texts. Everything runs in float64 on one thread,
as in chapter 9, so a run depends only on its seeds.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from klpen import (
    distillation_rewards,
    full_kl,
    generalized_jsd,
    linear_generalized_jsd,
    masked_mean,
    next_token_logprobs,
    response_mask,
    topk_kl,
)

from . import language as lm
from .bandit import _check_int, single_threaded
from .checks import check_choice, check_coef, check_positive, check_token_ids
from .figures import FIGURE_DPI, FIGURE_WIDTH
from .tables import format_table

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = [
    "CONTEXTS",
    "DISTILL_KEYS",
    "METHODS",
    "TABLE_HEADERS",
    "TOPK_HEADERS",
    "DistillRun",
    "Rollout",
    "distill",
    "distill_table",
    "next_token_distributions",
    "plot_kl_curves",
    "plot_next_token",
    "rollout",
    "tail_mass",
    "teacher_samples",
    "tiny_student",
    "topk_rows",
]

#: The three students: off-policy forward KL, on-policy reverse-KL reward, on-policy GKD JSD.
METHODS = ("sft", "reverse", "jsd")
#: Per-update records of :attr:`DistillRun.history`.
DISTILL_KEYS = ("reverse_kl", "forward_kl", "well_formed")
#: Columns of :func:`topk_rows`: means over the tokens, and the share of tokens inside.
TOPK_HEADERS = ("k", "estimate", "lower", "upper", "width", "exact", "inside")
#: Columns of :func:`distill_table`.
TABLE_HEADERS = ("student", "KL(s‖t)/token", "KL(t‖s)/token", "well-formed", "distinct")
#: The contexts of :func:`next_token_distributions`: every slot of the grammar after ``<bos>``.
CONTEXTS = ("the", "the big", "the cat", "the cat sees", "the cat sleeps", "the cat sleeps .")
#: A token the teacher gives less than this probability counts as ruled out (:func:`tail_mass`).
RULED_OUT = 0.01


def tiny_student(*, seed: int = 1, n_embd: int = 8) -> Any:
    """A one-layer GPT-2 for :data:`klpen_book.language.WORDS`, ``n_embd`` wide (two heads).

    Example:
        >>> student = tiny_student()
        >>> student.config.n_embd, student.config.n_layer
        (8, 1)
    """
    return lm.tiny_gpt2(seed=seed, n_embd=_check_int("n_embd", n_embd, 2), n_layer=1, n_head=2)


def teacher_samples(teacher: Any, n: int, *, seed: int = 0) -> Tensor:
    """``n`` texts sampled from ``teacher`` after ``<bos>``, right-padded to ``(n, 12)``.

    Rows that end early are filled with ``<pad>`` after their ``<eos>`` (``generate``'s pad
    id); the result has the layout of :func:`klpen_book.language.sample_sentences`.

    Example:
        >>> rows = teacher_samples(lm.tiny_gpt2(), 3)
        >>> rows.shape, bool((rows[:, 0] == lm.BOS_ID).all())
        (torch.Size([3, 12]), True)
    """
    count = _check_int("n", n, 1)
    torch.manual_seed(_check_int("seed", seed, 0))
    start = torch.full((count, 1), lm.BOS_ID)
    with torch.no_grad(), single_threaded():
        out = teacher.generate(
            start,
            attention_mask=torch.ones_like(start),
            do_sample=True,
            top_k=0,
            max_new_tokens=lm.MAX_SENTENCE_TOKENS - 1,
        )
    rows: Tensor = torch.full((count, lm.MAX_SENTENCE_TOKENS), lm.PAD_ID)
    rows[:, : out.shape[1]] = out
    return rows


@dataclass(frozen=True)
class Rollout:
    """A batch the student drew, and both models' next-token logits at its response positions.

    ``sequences`` ``(B, P+N)``; ``mask`` ``(B, N)``; ``student_logits`` and
    ``teacher_logits`` ``(B, N, V)``, the logits that predicted each response token (the
    student's with gradient); ``student_hidden`` ``(B, N, H)`` and ``teacher_hidden``
    ``(B, N, H')``, the final hidden states behind them.
    """

    sequences: Tensor
    mask: Tensor
    student_logits: Tensor
    teacher_logits: Tensor
    student_hidden: Tensor
    teacher_hidden: Tensor


def rollout(
    student: Any, teacher: Any, prompt_ids: Tensor, *, seed: int, max_new_tokens: int = 10
) -> Rollout:
    """Sample responses from ``student`` and run both models over them (the teacher without
    gradient): everything an on-policy distillation step needs."""
    prompt = check_token_ids("prompt_ids", prompt_ids)
    n_prompt = prompt.shape[1]
    torch.manual_seed(_check_int("seed", seed, 0))
    with torch.no_grad(), single_threaded():
        sequences = student.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            do_sample=True,
            top_k=0,
            max_new_tokens=_check_int("max_new_tokens", max_new_tokens, 1),
        )
    mask = response_mask(sequences[:, n_prompt:], lm.EOS_ID)
    attention = torch.cat([torch.ones_like(prompt, dtype=torch.bool), mask], dim=1).long()
    with single_threaded():
        s_out = student(sequences, attention_mask=attention, output_hidden_states=True)
        with torch.no_grad():
            t_out = teacher(sequences, attention_mask=attention, output_hidden_states=True)
    span = slice(n_prompt - 1, sequences.shape[1] - 1)  # the logits that predict the response
    return Rollout(
        sequences,
        mask,
        s_out.logits[:, span],
        t_out.logits[:, span],
        s_out.hidden_states[-1][:, span],
        t_out.hidden_states[-1][:, span],
    )


@dataclass
class DistillRun:
    """The result of :func:`distill`: the trained ``student``, one float per update for each
    key of :data:`DISTILL_KEYS` (means over the response tokens, or the texts, of the batch
    the student drew before that update), and the decoded texts of the last batch."""

    student: Any
    history: dict[str, list[float]] = field(default_factory=dict)
    samples: list[str] = field(default_factory=list)

    def final(self, key: str, last: int = 5) -> float:
        """Mean of ``history[key]`` over the last ``last`` updates.

        Example:
            >>> DistillRun(None, {"reverse_kl": [3.0, 1.0, 2.0]}).final("reverse_kl", 2)
            1.5
        """
        values = self.history[check_choice("key", key, DISTILL_KEYS)]
        tail = values[-_check_int("last", last, 1) :]
        return sum(tail) / len(tail)


def _step_loss(
    method: str,
    batch: Rollout,
    student: Any,
    teacher_weight: Tensor,
    data: Tensor | None,
    gen: torch.Generator,
    beta: float,
) -> Tensor:
    """The loss of one update of :func:`distill`."""
    if method == "sft" and data is not None:  # forward KL, off-policy: likelihood of teacher text
        rows = data[torch.randint(len(data), (len(batch.mask),), generator=gen)]
        valid = rows != lm.PAD_ID
        logits = student(rows, attention_mask=valid.long()).logits
        return -masked_mean(next_token_logprobs(logits, rows), valid[:, 1:])
    if method == "reverse":
        # excerpt: reverse
        tokens = batch.sequences[:, -batch.mask.shape[1] :]  # the student's own response
        logp = batch.student_logits.log_softmax(-1).gather(-1, tokens[..., None])[..., 0]
        teacher_logp = batch.teacher_logits.log_softmax(-1).gather(-1, tokens[..., None])[..., 0]
        rewards = distillation_rewards(logp.detach(), teacher_logp, batch.mask)
        advantages = rewards - masked_mean(rewards, batch.mask)  # a baseline: the batch mean
        return masked_mean(-advantages * logp, batch.mask)
        # end excerpt
    # excerpt: jsd
    return linear_generalized_jsd(
        batch.student_hidden,  # (B, N, 8)
        student.lm_head.weight,  # (V, 8)
        batch.teacher_hidden,  # (B, N, 64)
        teacher_weight,  # (V, 64)
        beta=beta,
        aggregation="token-mean",  # the mean over valid tokens, its gradients in one pass
        mask=batch.mask,
    )
    # end excerpt


def distill(
    teacher: Any,
    method: str,
    *,
    data: Tensor | None = None,
    steps: int = 40,
    batch_size: int = 64,
    lr: float = 1e-2,
    beta: float = 0.5,
    seed: int = 0,
    student_seed: int = 1,
    student_width: int = 8,
) -> DistillRun:
    """Train a fresh :func:`tiny_student` towards ``teacher`` by ``method`` (:data:`METHODS`).

    ``data``: the teacher samples of ``"sft"`` (required there, ignored otherwise). ``beta``:
    the JSD's β for ``"jsd"``. ``student_width``: the student's hidden size. Update ``i``
    first draws ``batch_size`` responses from the student after
    :func:`klpen_book.language.prompts` (seed ``seed * 1000 + i``): its records are measured
    there, and the on-policy methods learn from it.

    Example:
        >>> teacher = lm.tiny_gpt2()
        >>> run = distill(teacher, "reverse", steps=2, batch_size=4)
        >>> sorted(run.history) == sorted(DISTILL_KEYS), len(run.history["reverse_kl"])
        (True, 2)
    """
    how = check_choice("method", method, METHODS)
    if how == "sft" and data is None:
        raise ValueError("method='sft' needs data= (teacher samples)")
    b = check_coef("beta", beta)
    if not 0.0 <= b <= 1.0:
        raise ValueError(f"beta must lie in [0, 1], got {b}")
    n_steps = _check_int("steps", steps, 1)
    n = _check_int("batch_size", batch_size, 2)
    start = _check_int("seed", seed, 0)
    student = tiny_student(seed=student_seed, n_embd=student_width)
    student.train()
    teacher.eval()
    optimizer = torch.optim.Adam(student.parameters(), lr=check_positive("lr", lr))
    gen = torch.Generator().manual_seed(start)
    history: dict[str, list[float]] = {key: [] for key in DISTILL_KEYS}
    run = DistillRun(student, history)
    weight = teacher.lm_head.weight.detach()
    with single_threaded():
        for i in range(n_steps):
            batch = rollout(student, teacher, lm.prompts(n), seed=start * 1000 + i)
            s, t = batch.student_logits.detach(), batch.teacher_logits
            history["reverse_kl"].append(float(masked_mean(full_kl(s, t), batch.mask)))
            fwd = generalized_jsd(s, t, beta=0.0)
            history["forward_kl"].append(float(masked_mean(fwd, batch.mask)))
            history["well_formed"].append(float(lm.well_formed(batch.sequences).double().mean()))
            run.samples = [lm.decode(row) for row in batch.sequences]
            loss = _step_loss(how, batch, student, weight, data, gen, b)
            optimizer.zero_grad()
            torch.autograd.backward(loss)
            optimizer.step()
    student.eval()
    return run


def next_token_distributions(model: Any, contexts: Sequence[str] = CONTEXTS) -> Tensor:
    """``(len(contexts), V)`` next-token probabilities of ``model`` after ``<bos>`` and each
    context (words separated by spaces), in float64.

    Example:
        >>> p = next_token_distributions(lm.tiny_gpt2(), ["the", "a dog"])
        >>> p.shape, bool(torch.allclose(p.sum(-1), torch.ones(2, dtype=torch.float64)))
        (torch.Size([2, 30]), True)
    """
    rows = []
    with torch.no_grad(), single_threaded():
        for text in contexts:
            ids = torch.tensor([lm.encode(text)[:-1]])  # <bos> and the words, no <eos>
            rows.append(model(ids).logits[0, -1].double().softmax(-1))
    return torch.stack(rows)


def tail_mass(probs: Tensor, teacher_probs: Tensor, *, below: float = RULED_OUT) -> Tensor:
    """The mass ``probs`` puts on the tokens to which the teacher gives less than ``below``,
    per row: how much a student spends where the teacher says "(almost) never".

    Example:
        >>> teacher = torch.tensor([[0.5, 0.495, 0.005]])
        >>> tail_mass(torch.tensor([[0.4, 0.4, 0.2]]), teacher)
        tensor([0.2000])
    """
    if probs.shape != teacher_probs.shape:
        raise ValueError(
            f"probs and teacher_probs must have one shape, got {tuple(probs.shape)} and "
            f"{tuple(teacher_probs.shape)}"
        )
    return (probs * (teacher_probs < check_positive("below", below))).sum(-1)


def distill_table(runs: Mapping[str, DistillRun], *, last: int = 5) -> str:
    """One row per student: its exact per-token reverse and forward KL to the teacher and its
    well-formed share (means over its last ``last`` updates), and how many distinct texts its
    last batch holds.

    Example:
        >>> run = DistillRun(None, {k: [1.0, 0.5] for k in DISTILL_KEYS}, ["a", "a", "b"])
        >>> print(distill_table({"x": run}, last=1))
        student  KL(s‖t)/token  KL(t‖s)/token  well-formed  distinct
        -------  -------------  -------------  -----------  --------
        x                0.500          0.500        0.500         2
    """
    if not isinstance(runs, Mapping) or not runs:
        raise ValueError(f"runs must be a non-empty mapping of label -> DistillRun, got {runs!r}")
    rows = [
        [name, *(run.final(key, last) for key in DISTILL_KEYS), str(len(set(run.samples)))]
        for name, run in runs.items()
    ]
    return format_table(rows, TABLE_HEADERS, digits=3)


def topk_rows(
    student_logits: Tensor, teacher_logits: Tensor, mask: Tensor, ks: Sequence[int]
) -> list[list[object]]:
    """For each ``k`` of ``ks``: the teacher cut to its top-k log-probs, and
    :func:`klpen.topk_kl`'s forward estimate, lower and upper bound, the interval's width and
    the exact ``KL(teacher ‖ student)`` (:func:`klpen.generalized_jsd` at β = 0), each a mean
    over the valid tokens of ``mask``, and the share of tokens whose exact value lies inside.

    Example:
        >>> z, w = torch.zeros(1, 2, 4), torch.tensor([[[2.0, 1.0, 0.0, 0.0]] * 2])
        >>> rows = topk_rows(z, w, torch.ones(1, 2), [4])
        >>> [round(float(x), 4) for x in rows[0][1:6]], rows[0][6]  # k = V: no tail, exact
        ([0.3376, 0.3376, 0.3376, 0.0, 0.3376], 1.0)
    """
    valid = mask.bool()
    z, w = student_logits.detach().double(), teacher_logits.detach().double()
    exact = generalized_jsd(z, w, beta=0.0)
    teacher_logp = w.log_softmax(-1)
    rows: list[list[object]] = []
    for k in ks:
        logp, ids = teacher_logp.topk(_check_int("k", k, 1), dim=-1)
        r = topk_kl(z, ids, logp)
        slack = 1e-9 * (1.0 + exact.abs())  # rounding of the two computations
        inside = (r.lower <= exact + slack) & (exact <= r.upper + slack)
        means = [float(masked_mean(x, valid)) for x in (r.estimate, r.lower, r.upper)]
        width = float(masked_mean(r.upper - r.lower, valid))
        share = float(inside[valid].double().mean())
        rows.append([k, *means, width, float(masked_mean(exact, valid)), share])
    return rows


def plot_kl_curves(runs: Mapping[str, DistillRun]) -> Figure:
    """The exact per-token reverse and forward KL of each student to the teacher, against the
    update, on log axes: two panels side by side, one legend.

    Example:
        >>> run = DistillRun(None, {k: [1.0, 0.5] for k in DISTILL_KEYS})
        >>> len(plot_kl_curves({"x": run}).axes)
        2
    """
    from matplotlib.figure import Figure

    if not isinstance(runs, Mapping) or not runs:
        raise ValueError(f"runs must be a non-empty mapping of label -> DistillRun, got {runs!r}")
    fig = Figure(figsize=(FIGURE_WIDTH, 3.4), dpi=FIGURE_DPI, layout="constrained")
    axes = fig.subplots(1, 2, sharey=True)
    labels = {"reverse_kl": "KL(student ‖ teacher)", "forward_kl": "KL(teacher ‖ student)"}
    for ax, (key, title) in zip(axes, labels.items(), strict=True):
        for name, run in runs.items():
            ax.plot(run.history[key], label=name, linewidth=1.4)
        ax.set_yscale("log")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("update")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("nats per token")
    axes[0].legend(fontsize=9)
    return fig


def plot_next_token(
    teacher_probs: Tensor,
    student_probs: Mapping[str, Tensor],
    *,
    contexts: Sequence[str] = CONTEXTS,
    focus: int = 1,
) -> Figure:
    """Where each student puts its mass, on the same contexts.

    Left: per context, the mass on the tokens the teacher rules out (:func:`tail_mass`),
    teacher included. Right: the next-token probabilities after ``contexts[focus]``, tokens
    sorted by the teacher's probability, on a log axis.

    Example:
        >>> t = torch.full((2, 3), 1 / 3, dtype=torch.float64)
        >>> len(plot_next_token(t, {"x": t}, contexts=["a", "b"]).axes)
        2
    """
    from matplotlib.figure import Figure

    if teacher_probs.shape[0] != len(contexts):
        raise ValueError(
            f"teacher_probs must have one row per context ({len(contexts)}), got "
            f"{tuple(teacher_probs.shape)}"
        )
    fig = Figure(figsize=(FIGURE_WIDTH, 4.2), dpi=FIGURE_DPI, layout="constrained")
    left, right = fig.subplots(1, 2, width_ratios=(1.1, 1))
    shown = {"teacher": teacher_probs, **student_probs}
    colours = ["black", *(f"C{i}" for i in range(len(student_probs)))]  # as plot_kl_curves
    width = 0.8 / len(shown)
    positions = torch.arange(len(contexts), dtype=torch.float64)
    for i, (probs, colour) in enumerate(zip(shown.values(), colours, strict=True)):
        mass = tail_mass(probs, teacher_probs)
        left.bar((positions + i * width).tolist(), mass.tolist(), width, color=colour)
    left.set_xticks((positions + 0.4 - width / 2).tolist())
    left.set_xticklabels([f"“{c}”" for c in contexts], rotation=35, ha="right", fontsize=8)
    left.set_ylabel(f"mass on tokens with teacher p < {RULED_OUT}")
    left.set_xlabel("context")
    order = teacher_probs[focus].argsort(descending=True)
    for (name, probs), colour in zip(shown.items(), colours, strict=True):
        line = 2.2 if name == "teacher" else 1.2
        right.plot(probs[focus, order].tolist(), label=name, color=colour, linewidth=line)
    fig.legend(*right.get_legend_handles_labels(), loc="outside lower center", ncols=2, fontsize=8)
    right.set_yscale("log")
    right.set_xlabel(f"token after “{contexts[focus]}”, by teacher rank")
    right.set_ylabel("probability")
    right.grid(alpha=0.3)
    return fig
