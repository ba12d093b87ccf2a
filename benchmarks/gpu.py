"""GPU benchmark: klpen's Triton backend against the naive code and the peers, one process.

Cases, forward and forward + backward, bf16 logits: log-probs, log-probs + entropy, the full
KL against a random reference (KL about 1) and against a reference near the policy (peaked
rows, one token near probability 1, the reference = policy + a common offset of 3 + noise:
per-token KL 1e-4 to 1e-2, the rows RLHF data gives), and log-probs from hidden states
(H = 4096). Reports the time (median of ``--repeats`` after a warm-up, CUDA events), the
ratio to the naive code, the achieved bandwidth (the minimum bytes: each logits tensor read
once per pass, the gradient written once) against the device's peak, and the peak memory.

Peers: TRL's ``selective_log_softmax`` and ``selective_log_softmax_and_entropy``, Liger's
fused linear cross-entropy (hidden states) and KL-divergence loss (logits), verl's fused
linear log-probs; each that does not import is named with the reason. Every case's gradients
are reset (``.grad = None``) before each call, so that no implementation pays for
accumulating into another's gradient. A case whose naive form would not fit the device's
free memory is skipped with its estimate; a case that fails is printed with its cause.

    python benchmarks/gpu.py                 # one GPU (80 GB), a few minutes
    TRITON_INTERPRET=1 python benchmarks/gpu.py --size tiny   # CPU, under the interpreter
"""

from __future__ import annotations

import argparse
import math
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

import torch

import klpen

# Peak memory bandwidth (bytes/s) by device name; unknown devices print "n/a".
PEAK_BW = {"H200": 4.8e12, "H100": 3.35e12, "A100": 2.0e12, "L40S": 0.864e12, "A10": 0.6e12}
# (N, V, H): rows, vocabulary, hidden size.
SIZES = {"tiny": [(16, 300, 32)], "full": [(8192, 151936, 4096), (16384, 151936, 4096)]}
# fp32 temporaries of the naive forms, each N·V floats, at their peak (log_softmax of the
# policy and the reference, their exp and difference, the gradients): the memory estimate.
NAIVE_COPIES = {"logprobs": 3, "logprobs+entropy": 5, "full_kl": 7, "hidden logprobs": 3}


@dataclass
class Case:
    """One timed call: ``quantity`` (e.g. ``"full_kl fwd+bwd (near)"``), the implementation,
    the call, the minimum bytes it moves, and the fp32 ``N·V`` copies it needs beyond the
    inputs (0 for memory-bounded implementations)."""

    quantity: str
    implementation: str
    call: Callable[[], object]
    nbytes: int
    copies: int = 0


def _peak(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BW.items() if k in name), None)


def _time(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Median seconds of ``fn`` after one warm-up, by CUDA events (wall clock on the CPU)."""
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            stop.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(stop) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def _import_peers() -> tuple[dict[str, Callable[..., object]], dict[str, str]]:
    """``(found, skipped)``: each peer's callable by name, or why it is missing."""
    found: dict[str, Callable[..., object]] = {}
    skipped: dict[str, str] = {}

    def attempt(name: str, load: Callable[[], Callable[..., object]]) -> None:
        try:
            found[name] = load()
        except Exception as error:
            skipped[name] = f"{type(error).__name__}: {error}"

    def trl_lp() -> Callable[..., object]:
        from trl.trainer.utils import selective_log_softmax

        return selective_log_softmax  # type: ignore[no-any-return]

    def trl_lpe() -> Callable[..., object]:
        from trl.trainer.utils import selective_log_softmax_and_entropy

        return selective_log_softmax_and_entropy  # type: ignore[no-any-return]

    def liger_flce() -> Callable[..., object]:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        return LigerFusedLinearCrossEntropyLoss(reduction="sum")  # type: ignore[no-any-return]

    def liger_kl() -> Callable[..., object]:
        from liger_kernel.transformers import LigerKLDIVLoss

        return LigerKLDIVLoss(reduction="sum", log_target=True)  # type: ignore[no-any-return]

    def verl_lp() -> Callable[..., object]:
        from verl.utils.kernel.linear_cross_entropy import linear_cross_entropy

        return linear_cross_entropy  # type: ignore[no-any-return]

    attempt("trl.selective_log_softmax", trl_lp)
    attempt("trl.selective_log_softmax_and_entropy", trl_lpe)
    attempt("liger.FusedLinearCrossEntropyLoss", liger_flce)
    attempt("liger.KLDIVLoss", liger_kl)
    attempt("verl.linear_cross_entropy", verl_lp)
    return found, skipped


def _inputs(n: int, v: int, h: int, device: torch.device) -> dict[str, torch.Tensor]:
    """Random logits and reference; peaked policy rows (top token near probability 0.9) and a
    near reference (+3 offset, noise of 0.1); hidden states and an output layer; tokens."""
    gen = torch.Generator(device=device).manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=device, generator=gen)

    dtype = torch.bfloat16
    tok = torch.randint(0, v, (n,), device=device, generator=gen)
    peaked = randn(n, v)
    peaked[torch.arange(n, device=device), tok] += math.log(v) + 2.7
    near = peaked + 3.0 + 0.1 * randn(n, v)
    return {
        "logits": randn(n, v).to(dtype),
        "ref": randn(n, v).to(dtype),
        "peaked": peaked.to(dtype),
        "near": near.to(dtype),
        "tok": tok,
        "hidden": randn(n, h).to(dtype),
        "weight": (randn(v, h) / h**0.5).to(dtype),
    }


def _cases(
    n: int, v: int, h: int, device: torch.device, x: dict[str, torch.Tensor] | None = None
) -> list[Case]:
    """Every case at ``(n, v, h)`` on the inputs ``x`` (default :func:`_inputs`), whose
    differentiable ones are made leaves that require grad; backward cases include the
    forward."""
    x = _inputs(n, v, h, device) if x is None else x
    tok = x["tok"]
    leaves = {k: x[k].requires_grad_() for k in ("logits", "peaked", "hidden", "weight")}
    found, _ = _import_peers()
    nbytes = n * v * 2

    def reset() -> None:
        for t in leaves.values():
            t.grad = None

    def timed(
        body: Callable[[], torch.Tensor], back: bool, backend: str | None = None
    ) -> Callable[[], object]:
        def run() -> object:
            reset()
            if backend is None:
                out = body()
            else:
                with klpen.use_backend(backend):
                    out = body()
            if back:
                out.sum().backward()
            return out

        return run

    def naive_lp(z: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(z.float(), -1).gather(-1, tok[:, None])

    def naive_lpe(z: torch.Tensor) -> torch.Tensor:
        ls = torch.log_softmax(z.float(), -1)
        return ls.gather(-1, tok[:, None])[:, 0] - (ls.exp() * ls).sum(-1)

    def naive_kl(z: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        lp, lq = torch.log_softmax(z.float(), -1), torch.log_softmax(w.float(), -1)
        return (lp.exp() * (lp - lq)).sum(-1)

    def klpen_lpe(z: torch.Tensor) -> torch.Tensor:
        lp, ent = klpen.logprobs_and_entropy(z, tok)
        return lp + ent

    z, w = leaves["logits"], x["ref"]
    hid, wt = leaves["hidden"], leaves["weight"]
    cases: list[Case] = []
    for back in (False, True):
        mode = "fwd+bwd" if back else "fwd"
        one = nbytes * (3 if back else 1)  # read; read again and write the gradient
        two = nbytes * (5 if back else 2)
        cases += [
            Case(f"logprobs {mode}", "naive", timed(lambda: naive_lp(z), back), one, 3),
            Case(
                f"logprobs {mode}",
                "klpen (triton)",
                timed(lambda: klpen.get_logprobs_for_tokens(z, tok), back, "triton"),
                one,
            ),
            Case(f"logprobs+entropy {mode}", "naive", timed(lambda: naive_lpe(z), back), one, 5),
            Case(
                f"logprobs+entropy {mode}",
                "klpen (triton)",
                timed(lambda: klpen_lpe(z), back, "triton"),
                one,
            ),
        ]
        for label, p, q in (("random", z, w), ("near", leaves["peaked"], x["near"])):
            quantity = f"full_kl {mode} ({label})"
            cases += [
                Case(quantity, "naive", timed(lambda p=p, q=q: naive_kl(p, q), back), two, 7),
                Case(
                    quantity,
                    "klpen (triton)",
                    timed(lambda p=p, q=q: klpen.full_kl(p, q), back, "triton"),
                    two,
                ),
            ]
            if "liger.KLDIVLoss" in found:
                loss = found["liger.KLDIVLoss"]

                def liger(
                    p: torch.Tensor = p, q: torch.Tensor = q, loss: Callable[..., object] = loss
                ) -> torch.Tensor:
                    lp = torch.log_softmax(p.float(), -1)
                    lq = torch.log_softmax(q.float(), -1)
                    return loss(lq, lp)  # type: ignore[return-value]

                cases.append(Case(quantity, "liger.KLDIVLoss", timed(liger, back), two, 4))
        if "trl.selective_log_softmax" in found:
            fn = found["trl.selective_log_softmax"]
            cases.append(
                Case(
                    f"logprobs {mode}",
                    "trl.selective_log_softmax",
                    timed(lambda fn=fn: fn(z, tok), back),
                    one,
                )  # type: ignore[misc]
            )
        if "trl.selective_log_softmax_and_entropy" in found:
            fn = found["trl.selective_log_softmax_and_entropy"]

            def trl_lpe(fn: Callable[..., object] = fn) -> torch.Tensor:
                lp, ent = fn(z, tok)  # type: ignore[misc]
                return lp + ent  # type: ignore[no-any-return]

            name = "trl.selective_log_softmax_and_entropy"
            cases.append(Case(f"logprobs+entropy {mode}", name, timed(trl_lpe, back), one))
        hidden_cases = [
            (
                "naive (matmul + log_softmax)",
                lambda: torch.log_softmax((hid @ wt.T).float(), -1).gather(-1, tok[:, None]),
                None,
                3,
            ),
            (
                "klpen.linear_logprobs (triton)",
                lambda: klpen.linear_logprobs(hid, wt, tok),
                "triton",
                0,
            ),
        ]
        if "liger.FusedLinearCrossEntropyLoss" in found:
            flce = found["liger.FusedLinearCrossEntropyLoss"]
            hidden_cases.append(
                (
                    "liger.FusedLinearCrossEntropyLoss",
                    lambda flce=flce: -flce(wt, hid, tok),
                    None,
                    0,
                )
            )
        if "verl.linear_cross_entropy" in found:
            fused = found["verl.linear_cross_entropy"]

            def verl(fused: Callable[..., object] = fused) -> torch.Tensor:
                out = fused(hid, wt, tok)
                return out[0] if isinstance(out, tuple) else out  # type: ignore[return-value]

            hidden_cases.append(("verl.linear_cross_entropy", verl, None, 0))
        for impl, body, backend, copies in hidden_cases:
            cases.append(
                Case(f"hidden logprobs {mode}", impl, timed(body, back, backend), 0, copies)
            )
    return cases


def _cause(error: BaseException) -> str:
    """The error's type and its last non-empty message line (a Triton CompilationError's
    first line is only its position), with its ``__cause__`` where there is one."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    text = f"{type(error).__name__}: {lines[-1] if lines else ''}"
    if error.__cause__ is not None:
        text += f" (caused by {_cause(error.__cause__)})"
    return text.replace("|", "/")


def _fits(n: int, v: int, copies: int, device: torch.device) -> str | None:
    """``None``, or why a case needing ``copies`` fp32 ``(n, v)`` temporaries is skipped."""
    if device.type != "cuda" or not copies:
        return None
    need = copies * n * v * 4
    free, _ = torch.cuda.mem_get_info(device)
    if need < 0.9 * free:
        return None
    return f"skipped: needs about {need / 2**30:.0f} GiB, {free / 2**30:.0f} GiB free"


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="full")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    peak = _peak(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (interpreter)"
    print(f"device: {name}; peak bandwidth: {peak / 1e12:.2f} TB/s" if peak else f"device: {name}")
    _, skipped = _import_peers()
    for peer, why in skipped.items():
        print(f"peer skipped: {peer} ({why})")
    failures: list[str] = []
    print("| N | V | case | implementation | ms | × naive | GB/s | % peak | peak MiB |")
    print("|---|---|---|---|---|---|---|---|---|")
    for n, v, h in SIZES[args.size]:
        try:
            cases = _cases(n, v, h, device)
        except Exception as error:
            print(f"| {n} | {v} | setup | - | failed: {_cause(error)} |")
            failures.append(traceback.format_exc())
            continue
        naive: dict[str, float] = {}
        for case in cases:
            head = f"| {n} | {v} | {case.quantity} | {case.implementation} |"
            why = _fits(n, v, case.copies, device)
            if why:
                print(f"{head} {why} |")
                continue
            try:
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats(device)
                seconds = _time(case.call, device, args.repeats)
                mem = (
                    torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else 0
                )
            except Exception as error:
                print(f"{head} failed: {_cause(error)} |")
                failures.append(
                    f"{case.quantity} / {case.implementation}:\n" + traceback.format_exc()
                )
                continue
            if case.implementation.startswith("naive"):
                naive[case.quantity] = seconds
            ratio = f"{naive[case.quantity] / seconds:.2f}" if case.quantity in naive else "-"
            bw = case.nbytes / seconds / 1e9 if case.nbytes else 0.0
            share = f"{100 * bw * 1e9 / peak:.0f}" if peak and case.nbytes else "-"
            print(f"{head} {seconds * 1e3:.2f} | {ratio} | {bw:.0f} | {share} | {mem:.0f} |")
    for text in failures:
        print("\n" + text)


if __name__ == "__main__":
    main()
