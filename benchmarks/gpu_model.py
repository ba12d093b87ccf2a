"""Predicted H100 times of klpen's Triton paths, from the compiled code (no GPU needed).

For each public path (log-probs fwd / fwd+bwd, entropy, ``logprobs_and_entropy``, the full KL
fwd / fwd+bwd on ordinary rows and on peaked near-identical rows with a +3 offset between the
models, the hidden-state tiles, the generalized JSD of :mod:`klpen.distill` at β = 0.5, at
β = 1e-3 (a mixture near an end) and at β = 1, with the student's gradient or both), the
launches the Triton backend makes are recorded (``klpen.kernels.triton_launch.recording``) at
the real vocabulary, compiled for sm_90 by ``triton.compile``
(``klpen.kernels.triton_compile``), and each kernel's SASS (``cuobjdump -sass`` from the
``triton`` wheel) is read: the instructions of each vocabulary loop (a backward branch's body),
per element (the body over the entries each thread handles per iteration), and of them the MUFU
(``exp``, ``log``) and float64 ones. A conditional block inside a loop body (a forward branch
over it: the kernels' only ``if`` inside a vocabulary loop is the move to a new running maximum
of the logits, in the full KL and entropy forwards) is counted at the share of blocks that
bring a new maximum, ``H_n / n`` for ``n`` blocks of exchangeable logits (``H_n`` the harmonic
number: 0.11 at the full size), and shown apart.

The model, per kernel: time = max(bytes / 3.35 TB/s, issue, MUFU, float64), with
issue = Σ over its loops of elements · instructions per element / (132 SMs · 128 lanes ·
1.755 GHz), MUFU at 16 per SM per clock and float64 at 64 per SM per clock; the kernels of a
path run one after the other. Bytes: each vocabulary loop reads the
logits it loads once (bf16), a gradient is written once. The rows of the full KL that the
one-pass form cannot promise are redone in float64: their share is measured here by running
the forward under Triton's interpreter on rows of the real vocabulary. These are predictions
from the compiled code, not measurements.

    python benchmarks/gpu_model.py               # N = 16,384, V = 151,936, bf16 (minutes)
    python benchmarks/gpu_model.py --size tiny   # V = 5,003 (CI)
    python benchmarks/gpu_model.py --only jsd    # the paths whose name starts with "jsd"
"""

from __future__ import annotations

import os

if __name__ == "__main__":  # not in compile workers (spawned: __mp_main__), which compile
    os.environ.setdefault("TRITON_INTERPRET", "1")  # the redo share is measured on CPU tensors

import argparse
import math
import re
import tempfile
from dataclasses import dataclass

import torch

import klpen
from klpen.kernels import triton_compile
from klpen.kernels.blocks import sync_free_on_cpu
from klpen.kernels.triton_backend import TritonBackend
from klpen.kernels.triton_launch import Launch, recording

BANDWIDTH = 3.35e12  # H100 SXM HBM3, bytes/s
SMS, CLOCK = 132, 1.755e9  # H100 SXM: SMs, sustained clock (Hz)
LANES, MUFU, FP64 = 128, 16, 64  # per SM per clock: issued instructions, MUFU, float64 ops
SIZES = {"full": (16384, 151936), "tiny": (16384, 5003)}
# (path, target ratio to the bandwidth time) of issue 42
TARGETS = {
    "logprobs fwd+bwd": 1.1,
    "entropy fwd+bwd": 1.1,
    "logprobs+entropy fwd+bwd": 1.1,
    "full_kl fwd+bwd (ordinary)": 1.3,
    "full_kl fwd+bwd (peaked, +3)": 1.5,
    # issue 44: the generalized JSD's kernels
    "jsd β=0.5 fwd+bwd": 1.5,
    "jsd β=0.5 fwd+bwd, both grads": 1.5,
    "jsd β=1 fwd+bwd": 1.5,
    "jsd β=1 fwd+bwd, both grads": 1.5,
}


@dataclass
class Loop:
    """One vocabulary loop of a kernel's SASS: instructions per element, of them MUFU and
    float64."""

    per_element: float
    mufu: float
    fp64: float
    rare: float = 0.0  # instructions per element of its conditional blocks, all counted


_INSTR = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")


def loops(sass: str, per_thread: int, rare: float = 1.0) -> list[Loop]:
    """The loops of one kernel's SASS (the bodies of its backward branches: the vocabulary
    loops, since every other loop is unrolled), per element for ``per_thread`` entries per
    thread per iteration, in code order; the instructions of a conditional block inside a
    body (skipped by a forward branch) count ``rare`` times."""
    code = [(int(m.group(1), 16), m.group(3), m.group(4)) for m in _INSTR.finditer(sass)]
    found = []
    for i, (addr, op, rest) in enumerate(code):
        target = re.search(r"0x([0-9a-f]+)", rest)
        if op.startswith("BRA") and target and int(target.group(1), 16) < addr:
            body = [(a, o, r) for a, o, r in code[: i + 1] if a >= int(target.group(1), 16)]
            skipped: set[int] = set()
            for a, o, r in body[:-1]:
                jump = re.search(r"0x([0-9a-f]+)", r)
                if o.startswith("BRA") and jump and a < int(jump.group(1), 16) <= addr:
                    skipped.update(b for b, _, _ in body if a < b < int(jump.group(1), 16))
            weights = [(rare if a in skipped else 1.0, o) for a, o, _ in body]
            found.append(
                Loop(
                    sum(x for x, _ in weights) / per_thread,
                    sum(x for x, o in weights if o.startswith("MUFU")) / per_thread,
                    sum(x for x, o in weights if o[:4] in _FP64) / per_thread,
                    len(skipped) / per_thread,
                )
            )
    return found


_FP64 = ("DADD", "DMUL", "DFMA", "DSET", "DSETP", "DMNMX")


def _record(n: int, vocab: int) -> dict[str, list[Launch]]:
    """The launches of each path at ``n`` rows of ``vocab`` bf16 logits (recorded, not run)."""
    b = TritonBackend()
    z = torch.zeros(n, vocab, dtype=torch.bfloat16)
    tok = torch.zeros(n, dtype=torch.int64)
    g = torch.ones(n)
    paths: dict[str, list[Launch]] = {}

    def record(name: str, fn: object) -> None:
        with recording() as launches:
            fn()  # type: ignore[operator]
        paths[name] = launches

    def lp(tokens: torch.Tensor | None, ent: bool, back: bool) -> None:
        _, _, saved = b.logprobs_forward(z, tokens, 1.0, ent)
        if back:
            b.logprobs_backward(
                z, tokens, saved, g if tokens is not None else None, g if ent else None, 1.0
            )

    def kl(back: bool) -> None:
        with klpen.validation(False), sync_free_on_cpu():
            _, saved = b.full_kl_forward(z, z, 1.0)
            if back:
                b.full_kl_backward(z, z, saved, g, 1.0)

    def jsd(beta: float, needs: tuple[bool, bool] | None) -> None:
        _, saved = b.jsd_forward(z, z, 1.0, beta)
        if needs is not None:
            b.jsd_backward(z, z, saved, g, 1.0, beta, needs)

    for beta, label in ((0.5, "0.5"), (1e-3, "0.001"), (1.0, "1")):
        record(f"jsd β={label} fwd", lambda beta=beta: jsd(beta, None))
        record(f"jsd β={label} fwd+bwd", lambda beta=beta: jsd(beta, (True, False)))
        record(f"jsd β={label} fwd+bwd, both grads", lambda beta=beta: jsd(beta, (True, True)))
    for back in (False, True):
        mode = "fwd+bwd" if back else "fwd"
        record(f"logprobs {mode}", lambda back=back: lp(tok, False, back))
        record(f"entropy {mode}", lambda back=back: lp(None, True, back))
        record(f"logprobs+entropy {mode}", lambda back=back: lp(tok, True, back))
        record(f"full_kl {mode}", lambda back=back: kl(back))
    tile = torch.zeros(64, 4096)
    col = torch.zeros(64, dtype=torch.int64)
    vec = torch.zeros(64)
    record(
        "hidden tiles: logprob+entropy", lambda: b.linear_logprob_tile(tile, col, vec, True, True)
    )
    record(
        "hidden tiles: logprob grad",
        lambda: b.linear_logprob_tile_grad(tile, col, vec, vec, vec, vec),
    )
    record("hidden tiles: kl", lambda: b.linear_kl_tile(tile, tile, vec))
    record("hidden tiles: kl grad", lambda: b.linear_kl_tile_grad(tile, tile, vec, vec, vec, True))
    return paths


def redo_share(vocab: int, rows: int = 8) -> dict[str, float]:
    """The share of rows the full KL redoes in float64, on ordinary rows (random policy and
    reference) and on peaked near-identical rows (+3 offset), run under the interpreter."""
    gen = torch.Generator().manual_seed(0)
    z = torch.randn(rows, vocab, generator=gen)
    tok = torch.randint(0, vocab, (rows,), generator=gen)
    peaked = z.clone()
    peaked[torch.arange(rows), tok] += math.log(vocab) + 2.7
    near = peaked + 3.0 + 0.1 * torch.randn(rows, vocab, generator=gen)
    out = {}
    b = TritonBackend()
    for name, p, q in (
        ("ordinary", z, torch.randn(rows, vocab, generator=gen)),
        ("peaked, +3", peaked, near),
    ):
        with recording(run=True):
            _, saved = b.full_kl_forward(p.bfloat16(), q.bfloat16(), 1.0)
        out[name] = float(saved[-1].float().mean())
    return out


# Bytes per vocabulary loop, in logits-sized passes: (reads, writes) of each kernel's loops.
PASSES = {
    "_logprobs_fwd_kernel": (1, 0),
    "_logprobs_bwd_kernel": (1, 1),
    "_kl_fwd_kernel": (2, 0),
    "_kl_exact_fwd_kernel": (2, 0),
    "_kl_bwd_kernel": (2, 1),
    "_logprob_tile_kernel": (1, 0),
    "_logprob_tile_grad_kernel": (1, 1),
    "_kl_tile_kernel": (2, 0),
    "_kl_tile_grad_kernel": (2, 1),
    # two loops (the statistics, then the terms), each reading both rows
    "_jsd_fwd_kernel": (2, 0),
    # one loop reading both rows; writes: one per gradient asked for (see _passes)
    "_jsd_bwd_kernel": (2, 1),
}


def _passes(spec: triton_compile.Spec) -> tuple[int, int]:
    """:data:`PASSES` of ``spec``'s kernel; the JSD backward writes one gradient per
    ``NEED_Z`` / ``NEED_W`` flag that is set."""
    reads, writes = PASSES[spec.name]
    if spec.name == "_jsd_bwd_kernel":
        names = [nm for nm, _ in spec.signature]
        flags = {names[p[0]]: v for p, v in spec.constexprs}
        writes = int(bool(flags["NEED_Z"])) + int(bool(flags["NEED_W"]))
    return reads, writes


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="full")
    parser.add_argument("--only", default="", help="only the paths whose name starts so")
    args = parser.parse_args()
    n, vocab = SIZES[args.size]
    elements = n * vocab
    paths = {k: v for k, v in _record(4, vocab).items() if k.startswith(args.only)}
    specs = {name: [triton_compile.spec_of(k, 90) for k in ks] for name, ks in paths.items()}
    unique = list(dict.fromkeys(s for ss in specs.values() for s in ss))
    with tempfile.TemporaryDirectory() as cache:
        compiled = triton_compile.compile_all(unique, cache, keep_cubin=True)
    by_spec = {}
    for r in compiled:
        if r.error:
            raise SystemExit(f"{r.spec.label}: {r.error}")
        options = dict(r.spec.options)
        names = [nm for nm, _ in r.spec.signature]
        size = next(v for p, v in r.spec.constexprs if names[p[0]] == "BLOCK")
        per_thread = max(1, size // (32 * options["num_warps"]))
        blocks = -(-vocab // size)
        new_max = sum(1.0 / j for j in range(1, blocks + 1)) / blocks
        by_spec[r.spec] = (loops(triton_compile.sass(r.cubin), per_thread, new_max), r.registers)
    has_kl = any(name.startswith("full_kl") for name in paths)
    share = redo_share(vocab) if has_kl else {}
    print(
        f"N = {n}, V = {vocab}, bf16 logits; H100 SXM model: {BANDWIDTH / 1e12} TB/s, "
        f"{SMS} SMs at {CLOCK / 1e9} GHz; predictions from the compiled code, not measured"
    )
    if share:
        print(
            "rows redone in float64 (measured under the interpreter, 8 rows): "
            + ", ".join(f"{k} {v:.0%}" for k, v in share.items())
        )
    print()
    print(
        "| path | kernel (registers) "
        "| loops: SASS instr/element [in its new-max block] (MUFU, fp64) "
        "| bytes / minimum | predicted ms | bandwidth ms | ratio | target |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, ss in specs.items():
        variants = [("", 0.0)]
        if name.startswith("full_kl"):
            variants = [(" (ordinary)", share["ordinary"]), (" (peaked, +3)", share["peaked, +3"])]
        for suffix, redo in variants:
            _row(name + suffix, ss, by_spec, elements, redo)


def _row(
    name: str, specs: list[triton_compile.Spec], by_spec: dict, elements: int, redo: float
) -> None:
    tile = name.startswith("hidden")
    elem_bytes = 4 if tile else 2
    total_s = 0.0
    moved = 0.0
    cells = []
    for spec in specs:
        found, regs = by_spec[spec]
        reads, writes = _passes(spec)
        # a float64 loop runs on the redone rows only; in a kernel with a float64 branch
        # (the sync-free backward) the other loops run on the rest
        branch = any(x.fp64 for x in found) and spec.name != "_kl_fwd_kernel"
        kernel_bytes = elements * elem_bytes * writes  # the gradient, written once per row
        issue = mufu = fp64 = 0.0
        for loop in found:
            if spec.name == "_kl_exact_fwd_kernel" or loop.fp64:
                weight = redo
            else:
                weight = 1.0 - redo if branch else 1.0
            kernel_bytes += elements * elem_bytes * reads * weight
            issue += weight * elements * loop.per_element / (SMS * LANES * CLOCK)
            mufu += weight * elements * loop.mufu / (SMS * MUFU * CLOCK)
            fp64 += weight * elements * loop.fp64 / (SMS * FP64 * CLOCK)
        total_s += max(kernel_bytes / BANDWIDTH, issue, mufu, fp64)
        moved += kernel_bytes
        loops_text = ", ".join(
            f"{x.per_element:.0f}{f' [{x.rare:.0f} rare]' if x.rare else ''} "
            f"({x.mufu:.1f}, {x.fp64:.0f})"
            for x in found
        )
        cells.append((spec.name, regs, loops_text))
    minimum = _minimum(name) * elements * elem_bytes
    bw = minimum / BANDWIDTH
    ratio = total_s / bw
    target = TARGETS.get(name)
    verdict = "-" if target is None else f"≤ {target} {'met' if ratio <= target else 'NOT met'}"
    kernels = "; ".join(f"`{k}` ({r})" for k, r, _ in cells)
    loops_all = "; ".join(t for _, _, t in cells)
    print(
        f"| {name} | {kernels} | {loops_all} | {moved / minimum:.2f} | {total_s * 1e3:.2f} "
        f"| {bw * 1e3:.2f} | {ratio:.2f} | {verdict} |"
    )


def _minimum(name: str) -> int:
    """Logits-sized passes of the least traffic: reads of each input per call, the gradient
    written once."""
    inputs = 2 if name.startswith(("full_kl", "hidden tiles: kl", "jsd")) else 1
    if "fwd+bwd" in name:
        return 2 * inputs + (2 if "both grads" in name else 1)
    if "grad" in name:
        return inputs + 1
    return inputs


if __name__ == "__main__":
    main()
