"""Compiled vs eager and validation off vs on, round by round: klpen's GRPO step, interleaved.

Usage::

    python benchmarks/rounds.py                 # (B, T, V) = (8, 512, 32000) fp32, 21 rounds
    python benchmarks/rounds.py --size tiny     # (2, 16, 256), 3 rounds: seconds, for the test

``benchmarks/trainer.py`` compares medians; on a noisy machine the ratio of two medians moves
by more than the difference it measures when both variants run the same kernels (compiled and
eager klpen, validation on and off on the CPU). This script runs the three variants in turn,
round after round, and prints the median time of each, and for each variant the median of
its per-round ratios to eager (a round's variants saw about the same machine) and the ratio
of the minima. The loss and its inputs are ``benchmarks/trainer.py``'s (``next_token_logprobs``
of the policy and the reference, k3, the clipped PPO term, ``"token-mean"``), forward and
backward to the policy logits.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from trainer import SIZES, grpo_inputs, klpen_eager, klpen_fullgraph

import klpen

ROUNDS = {"full": 21, "tiny": 3}


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
        "compiled, fullgraph=True": step(compiled),
        "eager, validation off": step(klpen_eager, checks=False),
    }
    for run in variants.values():  # warm-up: the compilation, then one more call each
        run()
        run()
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, run in variants.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    shape = (size.batch, size.seq, size.vocab)
    print(f"(B, T, V) = {shape} fp32, {torch.get_num_threads()} threads, {rounds} rounds")
    print("| variant | median ms | min ms | median of per-round ratios to eager | ratio of mins |")
    print("|---|---:|---:|---:|---:|")
    eager = times["eager"]
    for name, ts in times.items():
        ratios = (
            "-"
            if name == "eager"
            else f"{statistics.median(a / e for a, e in zip(ts, eager, strict=True)):.3f}"
        )
        mins = "-" if name == "eager" else f"{min(ts) / min(eager):.3f}"
        median, least = statistics.median(ts) * 1e3, min(ts) * 1e3
        print(f"| {name} | {median:.1f} | {least:.1f} | {ratios} | {mins} |")


if __name__ == "__main__":
    main()
