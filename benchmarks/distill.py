"""Speed and memory of klpen's distillation divergences on the CPU (issue 44).

Two comparisons, forward and backward (the student requires grad, the teacher does not):

1. ``generalized_jsd`` against TRL's ``GKDTrainer.generalized_jsd_loss`` (which builds both
   log-softmaxes, the stacked mixture and two ``kl_div`` outputs), on ``(B, T, V)`` fp32
   logits, ``reduction="sum"`` for both;
2. ``linear_generalized_jsd`` against building both logits tensors (``hidden @ weight.T``)
   and calling ``generalized_jsd``, for a student and a teacher of different hidden sizes:
   per position, then summed (``"linear"``), and aggregated by the call itself
   (``aggregation="token-sum"``, ``"linear-sum"``: its gradients taken in the forward pass).

Time: after one warm-up call of each, one call of each interleaved (A, B, A, B, ...),
``--repeats`` rounds, the best of each.
Memory: in a fresh process per implementation, the extra peak resident memory of one call
after a warm-up (``VmHWM`` after resetting it, minus ``VmRSS`` before), less the gradients
the call must return, as a share of one ``(B, T, V)`` logits tensor.

    python benchmarks/distill.py                 # (8, 512, 32000), as in the issue
    python benchmarks/distill.py --size quick    # (2, 256, 32000)

Targets (issue 44): (1) time <= 0.5x TRL's, extra memory <= 5 % of one logits tensor;
(2) time <= 1.3x the unfused pair, extra memory <= 10 %.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import re
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

import klpen

SIZES = {"full": (8, 512, 32000), "quick": (2, 256, 32000)}
HIDDEN = (256, 512)  # student, teacher
BETA = 0.5


def _trl_loss() -> Callable[..., torch.Tensor]:
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from trl.experimental.gkd.gkd_trainer import GKDTrainer
    return GKDTrainer.generalized_jsd_loss  # type: ignore[no-any-return]


def make_call(
    impl: str, size: tuple[int, int, int]
) -> tuple[Callable[[], None], int, list[torch.Tensor]]:
    """``(call, bytes of the gradients it returns, the leaves)`` for one implementation."""
    b, t, v = size
    g = torch.Generator().manual_seed(0)
    if impl in ("klpen", "trl"):
        z = (torch.randn(b, t, v, generator=g) * 2).requires_grad_()
        w = torch.randn(b, t, v, generator=g) * 2
        trl = _trl_loss() if impl == "trl" else None

        def jsd() -> None:
            z.grad = None
            if trl is None:
                loss = klpen.generalized_jsd(z, w, beta=BETA).sum()
            else:
                loss = trl(z, w, beta=BETA, reduction="sum")
            loss.backward()  # type: ignore[no-untyped-call]

        return jsd, z.numel() * 4, [z]
    hs, ht = HIDDEN
    sh = torch.randn(b, t, hs, generator=g).requires_grad_()
    sw = (torch.randn(v, hs, generator=g) / hs**0.5).requires_grad_()
    th = torch.randn(b, t, ht, generator=g)
    tw = torch.randn(v, ht, generator=g) / ht**0.5

    def linear() -> None:
        sh.grad = sw.grad = None
        if impl == "linear":
            loss = klpen.linear_generalized_jsd(sh, sw, th, tw, beta=BETA).sum()
        elif impl == "linear-sum":
            loss = klpen.linear_generalized_jsd(sh, sw, th, tw, beta=BETA, aggregation="token-sum")
        else:
            loss = klpen.generalized_jsd(sh @ sw.T, th @ tw.T, beta=BETA).sum()
        loss.backward()  # type: ignore[no-untyped-call]

    return linear, (sh.numel() + sw.numel()) * 4, [sh, sw]


def _status_kib(field: str) -> int:
    match = re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M)
    if match is None:
        raise RuntimeError(f"no {field} in /proc/self/status")
    return int(match.group(1))


def _trim() -> None:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def measure_one(impl: str, size: tuple[int, int, int]) -> float:
    """In this (fresh) process: extra peak memory of one call, share of one logits tensor."""
    call, grads, leaves = make_call(impl, size)
    call()  # warm-up
    for leaf in leaves:  # its gradients freed before the measured call
        leaf.grad = None
    _trim()
    before = _status_kib("VmRSS") * 1024
    Path("/proc/self/clear_refs").write_text("5")
    call()
    extra = _status_kib("VmHWM") * 1024 - before
    b, t, v = size
    return (extra - grads) / (b * t * v * 4)


def measure(impl: str, size_name: str) -> float:
    done = subprocess.run(
        [sys.executable, __file__, "--measure", impl, "--size", size_name],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"memory run {impl} failed:\n{done.stderr[-2000:]}")
    return float(json.loads(done.stdout.strip().splitlines()[-1]))


def interleaved(pairs: list[str], size: tuple[int, int, int], repeats: int) -> dict[str, float]:
    calls = {impl: make_call(impl, size)[0] for impl in pairs}
    for call in calls.values():  # warm-up: first calls are not timed
        call()
    best = dict.fromkeys(pairs, float("inf"))
    for _ in range(repeats):
        for impl, call in calls.items():
            start = time.perf_counter()
            call()
            best[impl] = min(best[impl], time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="full")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--measure", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    size = SIZES[args.size]
    if args.measure is not None:
        print(json.dumps(measure_one(args.measure, size)))
        return
    print(f"size {size}, {torch.get_num_threads()} threads, load {os.getloadavg()}")
    for *ours, theirs in (("klpen", "trl"), ("linear", "linear-sum", "unfused")):
        times = interleaved([*ours, theirs], size, args.repeats)
        mem = {impl: measure(impl, args.size) for impl in (*ours, theirs)}
        for impl in ours:
            print(
                f"{impl:>10} {times[impl]:7.2f} s, extra memory {mem[impl]:6.1%} | "
                f"{theirs:>7} {times[theirs]:7.2f} s, extra memory {mem[theirs]:6.1%} | "
                f"time ratio {times[impl] / times[theirs]:.2f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
