"""Speed and memory of klpen's hidden-state entry points against the unfused output layer.

Usage::

    python benchmarks/linear.py --size full      # N = 2048 rows, H = 1024, V = 128,256 (issue 25)
    python benchmarks/linear.py --size full --loaded   # the same, one busy process per core
    python benchmarks/linear.py --size quick     # N = 128 and 1/16 tiles: the same tile count
    python benchmarks/linear.py --size tiny      # seconds: that the script works (tested)

What is compared, for each case:

* **unfused**: ``logits = hidden @ weight.T`` then klpen's logits function
  (:func:`klpen.get_logprobs_for_tokens` or :func:`klpen.full_kl`): the ``(N, V)`` logits exist.
* **fused**: :func:`klpen.linear.linear_logprobs` / :func:`klpen.linear.linear_full_kl`.

Cases, in fp32 and in bf16: the log-prob forward without grad (the reference and rollout case),
the log-prob forward + backward to ``hidden`` and ``weight``, the same to ``hidden`` alone (a
frozen output layer, as under LoRA: two products on either side, since the fused forward then
forms each row's gradient and its backward is one multiply), and the full-KL forward. In bf16 the
unfused product rounds every logit to bf16; the fused one widens the inputs per tile and
multiplies them with bf16 operands and fp32 results (the logits are not rounded).

Every case is timed at one thread and at the machine's thread count (``--threads``), interleaved
repeats after a warm-up, in one process: the median ratio and the ratio of the best repeats.
With each thread count and dtype comes the matrix products' speed: one large
``hidden @ weight.T`` against the same product in tiles of the fused path's shape and against
the fused path's tile products (the logits tile, the hidden gradient's ``addmm_``, the weight
gradient's tile) in GFLOP/s, and the fused calls' own GFLOP/s (their products' flops over their
time). A fused forward + backward does four products of
``2 N H V`` flops where the unfused path does three, so it can only meet its target if its
tiles run faster than the large products.

Memory (not under ``--loaded``): extra peak resident memory of one call in a fresh process, as a
share of one logits tensor, minus the returned gradients in the backward case.

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
from klpen.kernels import torch_linear

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run import _status_kib, load_average, release_free_memory, start_load, stop_load


@dataclass(frozen=True)
class Size:
    rows: int
    hidden: int
    vocab: int
    shrink: int  # tiles hold 1/shrink of the default logits: as many tiles as the full size
    repeats: int


SIZES = {
    "full": Size(2048, 1024, 128_256, 1, 5),
    "quick": Size(128, 1024, 128_256, 16, 3),
    "tiny": Size(32, 64, 4096, 256, 2),
}


@dataclass(frozen=True)
class Case:
    name: str
    dtype: torch.dtype
    backward: bool
    kl: bool
    time_target: float
    mem_target: float
    frozen: bool = False  # only hidden requires grad (a frozen output layer, as under LoRA)

    @property
    def products(self) -> tuple[int, int]:
        """Matrix products of ``2 N H V`` flops: (fused, unfused). A frozen head's fused
        forward also forms the mean weight rows, and its backward does no product."""
        if self.kl or self.frozen:
            return 2, 2
        return (4, 3) if self.backward else (1, 1)


CASES = [
    Case(f"{kind} {name}", dtype, backward, kl, target, mem, frozen)
    for kind, backward, kl, target, mem, frozen in (
        ("logprobs fwd", False, False, 1.0, 0.05, False),
        ("logprobs fwd+bwd", True, False, 1.2, 0.10, False),
        ("logprobs fwd+bwd frozen-head", True, False, 1.0, 0.10, True),
        ("full_kl fwd", False, True, 0.9, 0.05, False),
    )
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16))
]


def make_inputs(case: Case, size: Size) -> dict[str, Tensor]:
    n, h, v = size.rows, size.hidden, size.vocab
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
    x = {k: t.to(case.dtype) if t.is_floating_point() else t for k, t in out.items()}
    if case.backward:
        x["hidden"].requires_grad_(True)
        x["weight"].requires_grad_(not case.frozen)
    return x


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


Times = dict[str, dict[str, list[float]]]


def time_cases(size: Size, repeats: int, cases: list[Case]) -> Times:
    times: Times = {}
    for case in cases:
        inputs = make_inputs(case, size)
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


def _best(call: Callable[[], object], repeats: int) -> float:
    call()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - t0)
    return best


def product_speeds(size: Size, repeats: int, dtype: torch.dtype) -> dict[str, float | str]:
    """GFLOP/s of one large ``hidden @ weight.T`` in ``dtype`` and of the fused path's tile
    products over the whole vocabulary, at the tile shape the fused path uses, as it runs them
    (best of ``repeats``). In bf16 the large product is torch's bf16 one (bf16 results); the
    tiles are the fused path's: bf16 values widened to fp32, multiplied in IEEE fp32. The row
    "torch's product at the tile shape" is ``x @ w.T`` in ``dtype`` over the same tiles: against the
    large product it shows what the tile shape costs, against the logits tiles what fp32
    results cost (in fp32 the two are one product, timed once)."""
    n, h, v = size.rows, size.hidden, size.vocab
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(n, h, generator=g), torch.randn(v, h, generator=g) / h**0.5
    narrow = dtype != torch.float32
    x, w = x.to(dtype), w.to(dtype)
    wide_x, wide_w = x.float(), w.float()
    rows, cols = torch_linear.tile_shape(n, v, torch_linear.CHUNK_ELEMENTS, narrow=narrow)
    tile, grad = torch.empty(rows, cols), torch.randn(rows, cols, generator=g)
    own_tile = torch.empty(rows, cols, dtype=dtype)
    grad_x, grad_w = torch.zeros(n, h), torch.empty(v, h)
    starts = [(r0, v0) for v0 in range(0, v, cols) for r0 in range(0, n, rows)]

    def each(product: Callable[[slice, slice], None]) -> Callable[[], None]:
        def run() -> None:
            for r0, v0 in starts:
                product(slice(r0, min(r0 + rows, n)), slice(v0, min(v0 + cols, v)))

        return run

    def logits(r: slice, c: slice) -> None:
        torch.mm(wide_x[r], wide_w[c].T, out=tile[: r.stop - r.start, : c.stop - c.start])

    def hidden_grad(r: slice, c: slice) -> None:
        grad_x[r].addmm_(grad[: r.stop - r.start, : c.stop - c.start], wide_w[c])

    def weight_grad(r: slice, c: slice) -> None:
        torch.mm(grad[: r.stop - r.start, : c.stop - c.start].T, wide_x[r], out=grad_w[c])

    flops = 2 * n * h * v / 1e9
    speeds: dict[str, float | str] = {
        "one large hidden @ weight.T": flops / _best(lambda: x @ w.T, repeats)
    }
    speeds["tile shape (rows x columns)"] = f"{rows} x {cols}"

    def native(r: slice, c: slice) -> None:
        torch.mm(x[r], w[c].T, out=own_tile[: r.stop - r.start, : c.stop - c.start])

    # in fp32 the fused path's logits tiles are torch's own product: timed once
    timed: dict[Callable[[slice, slice], None], float] = {}
    for name, product in (
        ("torch's product at the tile shape", native if narrow else logits),
        ("logits tiles", logits),
        ("hidden-gradient tiles (addmm_)", hidden_grad),
        ("weight-gradient tiles", weight_grad),
    ):
        if product not in timed:
            timed[product] = flops / _best(each(product), repeats)
        speeds[name] = timed[product]
    return speeds


def _cell(value: float | str) -> str:
    return value if isinstance(value, str) else f"{value:.0f}"


def measure_one(case_name: str, impl: str, size: Size) -> float:
    """In a fresh process: the extra peak resident memory of one call, share of the logits."""
    case = next(c for c in CASES if c.name == case_name)
    inputs = make_inputs(case, size)
    call = make_call(case, impl, inputs)
    logits_bytes = size.rows * size.vocab * inputs["hidden"].element_size()
    grads = 0
    if case.backward:
        grads = sum(
            t.numel() * t.element_size()
            for t in (inputs["hidden"], inputs["weight"])
            if t.requires_grad
        )
    with torch.set_grad_enabled(case.backward):
        call()  # warm-up; its gradients are freed by the call itself
        release_free_memory()
        before = _status_kib("VmRSS") * 1024
        Path("/proc/self/clear_refs").write_text("5")
        call()
        extra = _status_kib("VmHWM") * 1024 - before
    return (extra - grads) / logits_bytes


def measure_all(size_name: str, cases: list[Case]) -> dict[str, dict[str, float]]:
    shares: dict[str, dict[str, float]] = {}
    for case in cases:
        shares[case.name] = {}
        for impl in ("unfused", "fused"):
            cmd = [sys.executable, __file__, "--size", size_name, "--measure", case.name, impl]
            done = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                raise RuntimeError(f"memory run {case.name}/{impl} failed:\n{done.stderr}")
            shares[case.name][impl] = json.loads(done.stdout.strip().splitlines()[-1])
        print(f"  measured memory of {case.name}", file=sys.stderr, flush=True)
    return shares


def times_table(
    size: Size, times: Times, mem: dict[str, dict[str, float]], cases: list[Case]
) -> list[str]:
    flops = 2 * size.rows * size.hidden * size.vocab / 1e9
    lines = [
        "| case | unfused s | fused s | ratio (median) | best ratio | target | met "
        "| fused GFLOP/s | extra memory fused | unfused |",
        "|---|---:|---:|---:|---:|---:|---|---:|---:|---:|",
    ]
    for case in cases:
        t = times[case.name]
        mu, mf = statistics.median(t["unfused"]), statistics.median(t["fused"])
        m = mem.get(case.name)
        shares = f"{m['fused']:.1%} | {m['unfused']:.1%}" if m else "- | -"
        lines.append(
            f"| {case.name} | {mu:.3f} | {mf:.3f} | {mf / mu:.2f}x "
            f"| {min(t['fused']) / min(t['unfused']):.2f}x | <= {case.time_target:.1f}x "
            f"| {'yes' if mf / mu <= case.time_target else 'NO'} "
            f"| {case.products[0] * flops / mf:.0f} | {shares} |"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="quick")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument(
        "--threads", default=None, help="comma-separated thread counts (default: 1 and all cores)"
    )
    parser.add_argument(
        "--loaded", action="store_true", help="time with one busy process per core; no memory"
    )
    parser.add_argument(
        "--cases", default="", help="only the cases whose name contains this (e.g. bf16)"
    )
    parser.add_argument("--measure", nargs=2, metavar=("CASE", "IMPL"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    size = SIZES[args.size]
    torch_linear.CHUNK_ELEMENTS //= size.shrink
    cores = os.cpu_count() or 1
    if args.measure:
        torch.set_num_threads(cores)
        print(json.dumps(measure_one(args.measure[0], args.measure[1], size)))
        return
    threads = sorted({int(t) for t in (args.threads or f"1,{cores}").split(",")})
    repeats = args.repeats or size.repeats
    cases = [c for c in CASES if args.cases in c.name]
    lines = [
        f"hidden-state entry points, N = {size.rows}, H = {size.hidden}, V = {size.vocab}, "
        f"{repeats} interleaved repeats, load average before: {load_average()}"
        + (f"; {cores} competing busy processes (--loaded)" if args.loaded else "")
    ]
    load = start_load(cores, 3600.0) if args.loaded else []
    try:
        results = []
        for count in threads:
            torch.set_num_threads(count)
            speeds = {
                name: product_speeds(size, repeats, dtype)
                for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16))
                if any(c.dtype == dtype for c in cases)
            }
            results.append((count, speeds, time_cases(size, repeats, cases)))
    finally:
        stop_load(load)
    mem = {} if args.loaded else measure_all(args.size, cases)
    for count, speeds, times in results:
        names = list(speeds)
        lines += ["", f"**{count} thread(s)**: matrix products, GFLOP/s", ""]
        lines += ["| product | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
        for product in next(iter(speeds.values())):
            values = " | ".join(_cell(speeds[name][product]) for name in names)
            lines.append(f"| {product} | {values} |")
        lines += ["", *times_table(size, times, mem if count == cores else {}, cases)]
    if not args.loaded:
        lines += ["", f"Memory measured at {cores} thread(s), each call in a fresh process."]
    print("\n".join(lines))


if __name__ == "__main__":
    main()
