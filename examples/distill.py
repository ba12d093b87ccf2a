"""On-policy distillation with klpen, in a few seconds on a CPU.

A teacher and a smaller student (different hidden sizes, one vocabulary) map each of a few
contexts to a distribution over the vocabulary. The student learns the teacher two ways:

1. on-policy, by policy gradient: it samples its own tokens, and the reward of each is
   ``distillation_rewards`` (the negative per-token log-ratio to the teacher, whose
   expectation is minus the reverse KL);
2. by the exact GKD loss ``linear_generalized_jsd`` at β = 0.5 (from hidden states, never
   building either logits tensor).

Both drive the exact reverse KL down. Then the teacher is cut to its top-k log-probs, as a
served teacher returns them, and ``topk_kl`` gives the tail-bucket estimate with an interval
that certainly holds the full-vocabulary forward KL.

    python examples/distill.py               # both students, then the top-k bounds
    python examples/distill.py --steps 300

The last line printed is a JSON summary.
"""

from __future__ import annotations

import argparse
import json

import torch
from torch import nn

from klpen import distillation_rewards, generalized_jsd, linear_generalized_jsd, topk_kl

CONTEXTS, VOCAB, TEACHER_HIDDEN, STUDENT_HIDDEN = 16, 200, 32, 8


class Head(nn.Module):
    """A context embedding and an output layer: the hidden states and logits of one model."""

    def __init__(self, hidden: int, scale: float, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.embed = nn.Parameter(torch.randn(CONTEXTS, hidden, generator=g) * scale)
        self.out = nn.Parameter(torch.randn(VOCAB, hidden, generator=g) * scale)

    def logits(self) -> torch.Tensor:
        return self.embed @ self.out.T


def reverse_kl(student: Head, teacher: Head) -> float:
    """The exact mean KL(student ‖ teacher) over the contexts (β = 1 of generalized_jsd)."""
    with torch.no_grad():
        return float(generalized_jsd(student.logits(), teacher.logits(), beta=1.0).mean())


def on_policy(teacher: Head, steps: int, samples: int) -> list[float]:
    """Policy gradient with the per-token distillation reward on the student's own samples."""
    student = Head(STUDENT_HIDDEN, 0.3, seed=1)
    opt = torch.optim.Adam(student.parameters(), lr=0.05)
    teacher_logp = teacher.logits().detach().log_softmax(-1)
    history = []
    for _ in range(steps):
        logp = student.logits().log_softmax(-1)
        tokens = torch.multinomial(logp.exp().detach(), samples, replacement=True)
        student_lp = logp.gather(-1, tokens)  # (CONTEXTS, samples): one "sequence" per row
        teacher_lp = teacher_logp.gather(-1, tokens)
        rewards = distillation_rewards(
            student_lp.detach(), teacher_lp, torch.ones_like(tokens, dtype=torch.bool)
        )
        advantage = rewards - rewards.mean(dim=1, keepdim=True)
        loss = -(advantage * student_lp).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        history.append(reverse_kl(student, teacher))
    return history


def exact_gkd(teacher: Head, steps: int) -> list[float]:
    """The exact generalized JSD at β = 0.5, from hidden states of two sizes."""
    student = Head(STUDENT_HIDDEN, 0.3, seed=1)
    opt = torch.optim.Adam(student.parameters(), lr=0.05)
    history = []
    for _ in range(steps):
        loss = linear_generalized_jsd(
            student.embed, student.out, teacher.embed.detach(), teacher.out.detach(), beta=0.5
        ).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        history.append(reverse_kl(student, teacher))
    return history


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--samples", type=int, default=64)
    args = parser.parse_args()
    torch.manual_seed(0)
    teacher = Head(TEACHER_HIDDEN, 0.5, seed=0)
    start = reverse_kl(Head(STUDENT_HIDDEN, 0.3, seed=1), teacher)
    rl = on_policy(teacher, args.steps, args.samples)
    gkd = exact_gkd(teacher, args.steps)
    print(f"reverse KL(student || teacher) at start {start:.3f}")
    print(f"  on-policy, distillation_rewards: {rl[-1]:.3f} after {args.steps} steps")
    print(f"  exact GKD, linear_generalized_jsd (beta = 0.5): {gkd[-1]:.3f}")
    # the teacher as a served one: its top-k log-probs only
    student_logits = Head(STUDENT_HIDDEN, 0.3, seed=1).logits().detach()
    teacher_logp = teacher.logits().detach().log_softmax(-1)
    exact = generalized_jsd(student_logits, teacher.logits().detach(), beta=0.0).mean()
    bounds = {}
    for k in (1, 5, 20):
        values, ids = teacher_logp.topk(k, dim=-1)
        r = topk_kl(student_logits, ids, values)
        bounds[k] = (float(r.lower.mean()), float(r.upper.mean()))
        print(
            f"  top-{k:<2} forward KL in [{bounds[k][0]:.3f}, {bounds[k][1]:.3f}] "
            f"(exact {float(exact):.3f})"
        )
    summary = {
        "start_kl": start,
        "on_policy_kl": rl[-1],
        "gkd_kl": gkd[-1],
        "exact_forward_kl": float(exact),
        **{f"top{k}_lower": lo for k, (lo, _) in bounds.items()},
        **{f"top{k}_upper": hi for k, (_, hi) in bounds.items()},
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
