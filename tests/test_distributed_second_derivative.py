"""Every vocab-parallel call refuses a second derivative by name, on every rank.

The single-process kernels' table is tests/test_second_derivatives.py; the vocab-parallel
Functions sit on the same base (klpen._autograd.KernelFunction), checked here on a real gloo
group: the first derivative under ``create_graph=True`` still equals the plain one, and
differentiating it again raises a RuntimeError naming the public function.
"""

from __future__ import annotations

from typing import Any

import torch

import klpen.distributed as kd
from klpen_book.distributed_demo import launch_gloo

V, SLICES = 12, (5, 7)


def _rank(rank: int, world: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, V, generator=g, dtype=torch.float64)
    ref = torch.randn(3, V, generator=g, dtype=torch.float64)
    hidden = torch.randn(3, 4, generator=g, dtype=torch.float64)
    weight = torch.randn(V, 4, generator=g, dtype=torch.float64)
    tokens = torch.tensor([0, 6, 11])
    lo = sum(SLICES[:rank])
    cut = slice(lo, lo + SLICES[rank])
    calls = {
        "vocab_parallel_logprobs": lambda x: kd.vocab_parallel_logprobs(x[:, cut], tokens),
        "vocab_parallel_full_kl": lambda x: kd.vocab_parallel_full_kl(x[:, cut], ref[:, cut]),
        "vocab_parallel_linear_logprobs": lambda x: kd.vocab_parallel_linear_logprobs(
            hidden + x[:, :4], weight[cut], tokens
        ),
    }
    out: dict[str, Any] = {}
    for name, call in calls.items():
        x = logits.clone().requires_grad_()
        (plain,) = torch.autograd.grad(call(x).sum(), x)
        (first,) = torch.autograd.grad(call(x).sum(), x, create_graph=True)
        try:
            torch.autograd.grad(first.sum(), x)
            refused = ""
        except RuntimeError as err:
            refused = str(err)
        out[name] = (torch.equal(plain, first.detach()), refused)
    return out


def test_every_vocab_parallel_call_refuses_a_second_derivative_by_name() -> None:
    for result in launch_gloo(_rank, 2, join_timeout_s=120):
        for name, (same_first, refused) in result.items():
            assert same_first, name
            assert f"klpen's {name} has no second derivative" in refused, (name, refused)
