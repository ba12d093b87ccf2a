"""GPU benchmark: klpen's Triton backend against the naive code and the peers, one process.

Cases: log-probs, log-probs + entropy, full KL, and log-probs from hidden states, forward and
forward + backward, at (N, V) in {(16k, 128k), (64k, 152k)} bf16, H = 4096. Reports the time,
the ratio to the naive code, the achieved bandwidth (bytes of logits read / time) against the
device's peak, and the peak memory per case. Peers that do not import are skipped by name;
a case that fails is reported by name, not raised.

    python benchmarks/gpu.py                 # one GPU, under 8 minutes
    TRITON_INTERPRET=1 python benchmarks/gpu.py --size tiny   # CPU, under the interpreter
"""

from __future__ import annotations

import argparse
import time
import traceback
from collections.abc import Callable

import torch

from klpen.kernels.triton_backend import TritonBackend

# Peak memory bandwidth (bytes/s) by device name; unknown devices print "n/a".
PEAK_BW = {"H200": 4.8e12, "H100": 3.35e12, "A100": 2.0e12, "L40S": 0.864e12, "A10": 0.6e12}
SIZES = {"tiny": [(16, 300, 32)], "full": [(16384, 131072, 4096), (65536, 151936, 4096)]}


def _peak(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, value in PEAK_BW.items():
        if key in name:
            return value
    return None


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


def _peers() -> dict[str, Callable[..., object]]:
    found: dict[str, Callable[..., object]] = {}
    try:
        from trl.trainer.utils import selective_log_softmax

        found["trl.selective_log_softmax"] = selective_log_softmax
    except Exception:
        pass
    try:
        from trl.kernels.logprob_entropy import selective_log_softmax_and_entropy

        found["trl.kernels.selective_log_softmax_and_entropy"] = selective_log_softmax_and_entropy
    except Exception:
        pass
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        found["liger.FusedLinearCrossEntropyLoss"] = LigerFusedLinearCrossEntropyLoss()
    except Exception:
        pass
    try:
        from verl.utils.kernel.linear_cross_entropy import linear_cross_entropy

        found["verl.linear_cross_entropy"] = linear_cross_entropy
    except Exception:
        pass
    return found


def _cases(
    n: int, v: int, h: int, device: torch.device
) -> list[tuple[str, str, Callable[[], object], int]]:
    """``(quantity, implementation, call, bytes of logits read)``; backward cases include fwd."""
    dtype = torch.bfloat16
    gen = torch.Generator(device=device).manual_seed(0)
    logits = torch.randn(n, v, device=device, dtype=dtype, generator=gen).requires_grad_()
    ref = torch.randn(n, v, device=device, dtype=dtype, generator=gen)
    tok = torch.randint(0, v, (n,), device=device, generator=gen)
    hidden = torch.randn(n, h, device=device, dtype=dtype, generator=gen).requires_grad_()
    weight = (
        torch.randn(v, h, device=device, dtype=dtype, generator=gen) / h**0.5
    ).requires_grad_()
    b = TritonBackend()
    nbytes = logits.numel() * logits.element_size()
    z = logits.detach()
    cases: list[tuple[str, str, Callable[[], object], int]] = []

    def naive_lp(back: bool) -> Callable[[], object]:
        def run() -> object:
            lp = torch.log_softmax(logits.float(), -1).gather(-1, tok[:, None])
            if back:
                lp.sum().backward()
            return lp

        return run

    def naive_ent(back: bool) -> Callable[[], object]:
        def run() -> object:
            ls = torch.log_softmax(logits.float(), -1)
            out = ls.gather(-1, tok[:, None]).sum() - (ls.exp() * ls).sum()
            if back:
                out.backward()
            return out

        return run

    def naive_kl(back: bool) -> Callable[[], object]:
        def run() -> object:
            lp, lq = torch.log_softmax(logits.float(), -1), torch.log_softmax(ref.float(), -1)
            out = (lp.exp() * (lp - lq)).sum()
            if back:
                out.backward()
            return out

        return run

    def klpen_lp(entropy: bool, back: bool) -> Callable[[], object]:
        def run() -> object:
            lp, _, saved = b.logprobs_forward(z, tok, 1.0, entropy)
            if back:
                ones = torch.ones_like(lp)
                return b.logprobs_backward(z, tok, saved, ones, ones if entropy else None, 1.0)
            return lp

        return run

    def klpen_kl(back: bool) -> Callable[[], object]:
        def run() -> object:
            kl, saved = b.full_kl_forward(z, ref, 1.0)
            if back:
                return b.full_kl_backward(z, ref, saved, torch.ones_like(kl), 1.0)
            return kl

        return run

    def matmul_lp(back: bool) -> Callable[[], object]:
        def run() -> object:
            out = torch.log_softmax((hidden @ weight.T).float(), -1).gather(-1, tok[:, None])
            if back:
                out.sum().backward()
            return out

        return run

    for back in (False, True):
        mode = "fwd+bwd" if back else "fwd"
        reads = nbytes * (2 if back else 1)
        cases += [
            (f"logprobs {mode}", "naive", naive_lp(back), reads),
            (f"logprobs {mode}", "klpen.triton", klpen_lp(False, back), reads),
            (f"logprobs+entropy {mode}", "naive", naive_ent(back), reads),
            (f"logprobs+entropy {mode}", "klpen.triton", klpen_lp(True, back), reads),
            (f"full_kl {mode}", "naive", naive_kl(back), 2 * reads),
            (f"full_kl {mode}", "klpen.triton", klpen_kl(back), 2 * reads),
            (f"hidden logprobs {mode}", "naive (matmul + log_softmax)", matmul_lp(back), 0),
        ]
        import klpen

        if hasattr(klpen, "use_backend"):

            def public_lp(back: bool = back) -> object:
                with klpen.use_backend("triton"):
                    out = klpen.get_logprobs_for_tokens(logits, tok)
                if back:
                    out.sum().backward()
                return out

            def public_hidden(back: bool = back) -> object:
                with klpen.use_backend("triton"):
                    out = klpen.linear_logprobs(hidden, weight, tok)
                if back:
                    out.sum().backward()
                return out

            cases += [
                (f"logprobs {mode}", "klpen public (triton)", public_lp, reads),
                (f"hidden logprobs {mode}", "klpen.linear_logprobs (triton)", public_hidden, 0),
            ]
        for name, fn in _peers().items():
            if name == "trl.selective_log_softmax":

                def peer(fn: Callable[..., object] = fn, back: bool = back) -> object:
                    out = fn(logits, tok)
                    if back:
                        out.sum().backward()  # type: ignore[union-attr]
                    return out

                cases.append((f"logprobs {mode}", name, peer, reads))
            elif name.startswith("trl.kernels"):

                def peer_e(fn: Callable[..., object] = fn, back: bool = back) -> object:
                    lp, ent = fn(logits, tok)  # type: ignore[misc]
                    if back:
                        (lp.sum() + ent.sum()).backward()
                    return lp

                cases.append((f"logprobs+entropy {mode}", name, peer_e, reads))
            elif name.startswith("liger"):

                def peer_l(fn: Callable[..., object] = fn, back: bool = back) -> object:
                    out = fn(weight, hidden, tok)
                    if back:
                        out.backward()  # type: ignore[union-attr]
                    return out

                cases.append((f"hidden logprobs {mode}", name, peer_l, 0))
            elif name.startswith("verl"):

                def peer_v(fn: Callable[..., object] = fn, back: bool = back) -> object:
                    out = fn(hidden, weight, tok)
                    lp = out[0] if isinstance(out, tuple) else out
                    if back:
                        lp.sum().backward()  # type: ignore[union-attr]
                    return lp

                cases.append((f"hidden logprobs {mode}", name, peer_v, 0))
    return cases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="full")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    peak = _peak(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (interpreter)"
    print(f"device: {name}; peak bandwidth: {peak / 1e12:.2f} TB/s" if peak else f"device: {name}")
    print("| N | V | case | implementation | ms | × naive | GB/s | % peak | peak MiB |")
    print("|---|---|---|---|---|---|---|---|---|")
    for n, v, h in SIZES[args.size]:
        try:
            cases = _cases(n, v, h, device)
        except Exception as error:
            print(f"| {n} | {v} | setup | - | failed: {type(error).__name__}: {error} |")
            continue
        naive: dict[str, float] = {}
        for case, impl, fn, nbytes in cases:
            try:
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats(device)
                seconds = _time(fn, device, args.repeats)
                mem = (
                    torch.cuda.max_memory_allocated(device) / 2**20
                    if device.type == "cuda"
                    else 0.0
                )
            except Exception as error:
                msg = str(error).splitlines()[0][:80] if str(error) else ""
                print(f"| {n} | {v} | {case} | {impl} | failed: {type(error).__name__} {msg} |")
                if args.size == "tiny":
                    traceback.print_exc()
                continue
            if impl.startswith("naive"):
                naive[case] = seconds
            ratio = f"{naive[case] / seconds:.2f}" if case in naive else "-"
            bw = nbytes / seconds / 1e9 if nbytes else 0.0
            share = f"{100 * bw * 1e9 / peak:.0f}" if peak and nbytes else "-"
            print(
                f"| {n} | {v} | {case} | {impl} | {seconds * 1e3:.2f} | {ratio} | "
                f"{bw:.0f} | {share} | {mem:.0f} |"
            )


if __name__ == "__main__":
    main()
