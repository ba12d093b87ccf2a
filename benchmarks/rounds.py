"""Compiled vs eager and validation off vs on, round by round: klpen's GRPO step, interleaved.

Usage::

    python benchmarks/rounds.py                 # (B, T, V) = (8, 512, 32000) fp32, 21 rounds
    python benchmarks/rounds.py --size tiny     # (2, 16, 256), 3 rounds: seconds, for the test

``benchmarks/trainer.py`` compares medians; on a noisy machine the ratio of two medians moves
by more than the difference it measures when both variants run the same kernels (compiled and
eager klpen, validation on and off on the CPU). This script runs the variants round after
round, in an order drawn afresh for each round (seeded). Each timed call follows an untimed
call of the same variant, as a training step follows a step of the same loop: what one variant
leaves behind (an OpenMP team still spinning after a compiled kernel, say) is then not charged
to the next. It prints the median time of each and, for each variant, the
median of its per-round ratios to eager (a round's variants saw about the same machine) with a
95 % interval for that median, and the ratio of the minima. The interval is distribution-free:
the order statistics of the ratios between which the median lies with probability at least
0.95 (a binomial count of ratios on either side); an interval that holds 1 means the rounds
cannot tell the variant from eager. The loss and its inputs are ``benchmarks/trainer.py``'s
(``next_token_logprobs`` of the policy and the reference, k3, the clipped PPO term,
``"token-mean"``), forward and backward to the policy logits.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import time
from collections.abc import Callable

import torch
from trainer import SEED, SIZES, grpo_inputs, klpen_compiled, klpen_eager, klpen_fullgraph

import klpen

ROUNDS = {"full": 21, "tiny": 3}


def median_interval(values: list[float], level: float = 0.95) -> tuple[float, float]:
    """The order statistics ``(x_(j), x_(n+1-j))`` of ``values`` between which their median
    lies with probability at least ``level``: ``j`` the largest with ``P(B < j) <= (1 -
    level) / 2`` for ``B ~ Binomial(n, 1/2)``; the whole range where ``n`` is too small.

    Example:
        >>> median_interval([float(i) for i in range(1, 101)])
        (40.0, 61.0)
    """
    xs, n = sorted(values), len(values)
    tail, below, j = (1.0 - level) / 2, 0.0, 0
    while below + math.comb(n, j) / 2**n <= tail:
        below += math.comb(n, j) / 2**n
        j += 1
    return (xs[0], xs[-1]) if j == 0 else (xs[j - 1], xs[n - j])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(ROUNDS), default="full")
    parser.add_argument("--rounds", type=int, default=None)
    args = parser.parse_args()
    size = SIZES[args.size]
    rounds = args.rounds or ROUNDS[args.size]
    inputs = grpo_inputs(size, "cpu")
    logits = inputs[0]
    compiled = torch.compile(klpen_fullgraph, fullgraph=True)

    def step(loss: Callable[..., torch.Tensor], checks: bool = True) -> Callable[[], None]:
        def run() -> None:
            with klpen.validation(checks):
                loss(*inputs).backward()
            logits.grad = None

        return run

    variants = {
        "eager": step(klpen_eager),
        "compiled, default mode": step(torch.compile(klpen_compiled)),
        "compiled, fullgraph=True": step(compiled),
        "eager, validation off": step(klpen_eager, checks=False),
    }
    for run in variants.values():  # warm-up: the compilation, then one more call each
        run()
        run()
    names = list(variants)
    times: dict[str, list[float]] = {name: [] for name in names}
    order = random.Random(SEED)
    for _ in range(rounds):
        for name in order.sample(names, len(names)):
            variants[name]()  # the step before, of the same loop: untimed
            start = time.perf_counter()
            variants[name]()
            times[name].append(time.perf_counter() - start)
    shape = (size.batch, size.seq, size.vocab)
    print(f"(B, T, V) = {shape} fp32, {torch.get_num_threads()} threads, {rounds} rounds")
    print(
        "| variant | median ms | min ms | median of per-round ratios to eager "
        "| 95 % interval | ratio of mins |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    eager = times["eager"]
    for name, ts in times.items():
        median, least = statistics.median(ts) * 1e3, min(ts) * 1e3
        if name == "eager":
            print(f"| {name} | {median:.1f} | {least:.1f} | - | - | - |")
            continue
        ratios = [a / e for a, e in zip(ts, eager, strict=True)]
        low, high = median_interval(ratios)
        print(
            f"| {name} | {median:.1f} | {least:.1f} | {statistics.median(ratios):.3f} "
            f"| {low:.3f}–{high:.3f} | {min(ts) / min(eager):.3f} |"
        )


if __name__ == "__main__":
    main()
