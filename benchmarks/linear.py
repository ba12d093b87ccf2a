"""Speed and memory of klpen's hidden-state entry points against the unfused output layer.

Usage::

    python benchmarks/linear.py --size full    # N = 2048 rows, H = 1024, V = 128,256 (issue 12)
    python benchmarks/linear.py --size quick   # N = 128 and 1/16 tiles: the same tile count

What is compared, for each case:

* **unfused**: ``logits = hidden @ weight.T`` then klpen's logits function
  (:func:`klpen.get_logprobs_for_tokens` or :func:`klpen.full_kl`): the ``(N, V)`` logits exist.
* **fused**: :func:`klpen.linear.linear_logprobs` / :func:`klpen.linear.linear_full_kl`.

Cases: the log-prob forward without grad (the reference and rollout case) in fp32 and in bf16
(the unfused bf16 product rounds every logit to bf16; the fused one widens the inputs per tile
and multiplies in fp32), the log-prob forward + backward to ``hidden`` and ``weight`` (fp32),
and the full-KL forward (fp32). Timing and memory follow ``benchmarks/run.py``: interleaved
repeats after a warm-up, the median ratio and the ratio of the best repeats; extra peak resident
memory of one call in a fresh process, as a share of one logits tensor, minus the returned
gradients in the backward case.

The quick size keeps H: a bf16 tile of ``weight`` widened to fp32 (``512 × H``, 2 MiB) does
not shrink with N, so its share of the 16-fold smaller logits reads 16 times too large there
(about 6 % quick, 0.4 % at the full size).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

import klpen
import klpen.linear as lin

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run import _status_kib, release_free_memory

SIZES = {"full": (2048, 1024, 128_256, 1, 5), "quick": (128, 1024, 128_256, 16, 3)}


@dataclass(frozen=True)
class Case:
    name: str
    dtype: torch.dtype
    backward: bool
    kl: bool
    time_target: float
    mem_target: float


CASES = [
    Case("logprobs fwd fp32", torch.float32, False, False, 1.0, 0.05),
    Case("logprobs fwd bf16", torch.bfloat16, False, False, 1.0, 0.05),
    Case("logprobs fwd+bwd fp32", torch.float32, True, False, 1.3, 0.10),
    Case("full_kl fwd fp32", torch.float32, False, True, 1.0, 0.05),
]


def make_inputs(case: Case, size: str) -> dict[str, Tensor]:
    n, h, v, _, _ = SIZES[size]
    g = torch.Generator().manual_seed(0)
    out = {
        "hidden": torch.randn(n, h, generator=g),
        "weight": torch.randn(v, h, generator=g) / h**0.5 * 2,
        "tokens": torch.randint(0, v, (n,), generator=g),
        "grad": torch.randn(n, generator=g),
    }
    if case.kl:
        out["ref_hidden"] = out["hidden"] + 0.1 * torch.randn(n, h, generator=g)
        out["ref_weight"] = out["weight"] + 0.01 * torch.randn(v, h, generator=g)
    return {k: x.to(case.dtype) if x.is_floating_point() else x for k, x in out.items()}


def make_call(case: Case, impl: str, x: dict[str, Tensor]) -> Callable[[], object]:
    hidden, weight, tokens = x["hidden"], x["weight"], x["tokens"]
    if case.kl:
        if impl == "fused":
            return lambda: lin.linear_full_kl(hidden, weight, x["ref_hidden"], x["ref_weight"])
        return lambda: klpen.full_kl(hidden @ weight.T, x["ref_hidden"] @ x["ref_weight"].T)

    def forward() -> Tensor:
        if impl == "fused":
            return lin.linear_logprobs(hidden, weight, tokens)
        return klpen.get_logprobs_for_tokens(hidden @ weight.T, tokens)

    if not case.backward:
        return forward

    def fwd_bwd() -> None:
        (forward() * x["grad"]).sum().backward()
        hidden.grad = weight.grad = None

    return fwd_bwd


def shrink_tiles(size: str) -> None:
    """The quick size shrinks the tiles as much as the rows: a call walks as many tiles."""
    lin.CHUNK_ELEMENTS //= SIZES[size][3]


def time_all(size: str, repeats: int) -> dict[str, dict[str, list[float]]]:
    times: dict[str, dict[str, list[float]]] = {}
    for case in CASES:
        inputs = make_inputs(case, size)
        if case.backward:
            inputs["hidden"].requires_grad_(True)
            inputs["weight"].requires_grad_(True)
        calls = {impl: make_call(case, impl, inputs) for impl in ("unfused", "fused")}
        times[case.name] = {impl: [] for impl in calls}
        with torch.set_grad_enabled(case.backward):
            for call in calls.values():
                call()
            for _ in range(repeats):
                for impl, call in calls.items():
                    t0 = time.perf_counter()
                    call()
                    times[case.name][impl].append(time.perf_counter() - t0)
        print(f"  timed {case.name}", file=sys.stderr, flush=True)
        del inputs, calls
    return times


def measure_one(case_name: str, impl: str, size: str) -> float:
    """In a fresh process: the extra peak resident memory of one call, share of the logits."""
    case = next(c for c in CASES if c.name == case_name)
    inputs = make_inputs(case, size)
    if case.backward:
        inputs["hidden"].requires_grad_(True)
        inputs["weight"].requires_grad_(True)
    call = make_call(case, impl, inputs)
    n, v = inputs["hidden"].shape[0], inputs["weight"].shape[0]
    logits_bytes = n * v * inputs["hidden"].element_size()
    grads = 0
    if case.backward:
        grads = sum(inputs[k].numel() * inputs[k].element_size() for k in ("hidden", "weight"))
    with torch.set_grad_enabled(case.backward):
        call()  # warm-up; its gradients are freed by the call itself
        release_free_memory()
        before = _status_kib("VmRSS") * 1024
        Path("/proc/self/clear_refs").write_text("5")
        call()
        extra = _status_kib("VmHWM") * 1024 - before
    return (extra - grads) / logits_bytes


def measure_all(size: str) -> dict[str, dict[str, float]]:
    shares: dict[str, dict[str, float]] = {}
    for case in CASES:
        shares[case.name] = {}
        for impl in ("unfused", "fused"):
            cmd = [sys.executable, __file__, "--size", size, "--measure", case.name, impl]
            done = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                raise RuntimeError(f"memory run {case.name}/{impl} failed:\n{done.stderr}")
            shares[case.name][impl] = json.loads(done.stdout.strip().splitlines()[-1])
        print(f"  measured memory of {case.name}", file=sys.stderr, flush=True)
    return shares


def report(
    size: str, times: dict[str, dict[str, list[float]]], mem: dict[str, dict[str, float]]
) -> str:
    n, h, v, _, _ = SIZES[size]
    repeats = len(next(iter(times.values()))["fused"])
    lines = [
        f"hidden-state entry points, N = {n}, H = {h}, V = {v}, "
        f"{torch.get_num_threads()} thread(s), {repeats} interleaved repeats",
        "",
        "| case | unfused s (median) | fused s (median) | time ratio (median) | best ratio "
        "| target | extra memory fused | unfused | target |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for case in CASES:
        t = times[case.name]
        mu, mf = statistics.median(t["unfused"]), statistics.median(t["fused"])
        best = min(t["fused"]) / min(t["unfused"])
        m = mem[case.name]
        lines.append(
            f"| {case.name} | {mu:.3f} | {mf:.3f} | {mf / mu:.2f}x | {best:.2f}x "
            f"| <= {case.time_target:.1f}x | {m['fused']:.1%} | {m['unfused']:.1%} "
            f"| <= {case.mem_target:.0%} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="quick")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--measure", nargs=2, metavar=("CASE", "IMPL"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    shrink_tiles(args.size)
    if args.measure:
        print(json.dumps(measure_one(args.measure[0], args.measure[1], args.size)))
        return
    repeats = args.repeats or SIZES[args.size][4]
    times = time_all(args.size, repeats)
    mem = measure_all(args.size)
    print(report(args.size, times, mem))


if __name__ == "__main__":
    main()
