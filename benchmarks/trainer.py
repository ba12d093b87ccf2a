"""klpen inside a training step: compiled vs eager, validation off vs on, packed vs padded.

Usage::

    python benchmarks/trainer.py --size full      # (B, T, V) = (8, 512, 32000) fp32 (issue 20)
    python benchmarks/trainer.py --size tiny      # (2, 16, 256): seconds, for the test
    python benchmarks/trainer.py --device cuda    # the same on a GPU

The step is a GRPO loss, forward and backward to the policy logits::

    logp = next_token_logprobs(policy_logits, input_ids)          # (B, T-1)
    ref  = next_token_logprobs(reference_logits, input_ids)       # no gradient
    kl   = estimate_kl(logp, ref, "k3")
    ratio = exp(logp - old_logp)
    pg   = -min(ratio * A, clip(ratio, 1 - 0.2, 1 + 0.2) * A)
    loss = aggregate(pg + 0.04 * kl, mask, "token-mean")

with fixed old log-probs (the policy's, slightly perturbed) and advantages. The plain-torch
loss computes the same from ``log_softmax(logits).gather(...)`` and a masked mean.

Comparisons (each a ratio of medians, variant over baseline; target = the issue's):

1. klpen compiled (``torch.compile``, default mode) vs klpen eager: <= 1.0;
   klpen compiled with ``fullgraph=True`` vs klpen eager: <= 1.0;
   klpen compiled vs the plain-torch loss compiled: <= 0.5.
   The compilation is in the warm-up (two calls, so that a failure of the second call shows);
   its time, the first call's, is reported separately.
2. Validation off (``klpen.validation(False)``) vs on, klpen eager: <= 1.0.
3. Packed vs padded at equal tokens: ``next_token_logprobs`` + ``aggregate``
   (``"seq-mean-token-mean"``) forward and backward on B sequences of length T, packed into one
   row ``(1, B*T)`` with ``position_ids`` vs as a ``(B, T)`` batch: <= 1.05.

A feature this klpen lacks (``klpen.validation``, packed arguments) makes its row
"unavailable"; a variant that raises (e.g. a function that does not trace) makes its rows
"failed" with the exception. The script itself does not fail on either.

Time: all variants of a comparison group run interleaved in one process for ``--repeats`` rounds
after the warm-up, each round starting one variant later (A, B, C, B, C, A, C, A, B, ...) so
that no variant always runs after the same one; each step frees the gradient it made before it
ends (freeing the plain-torch loss's 500 MiB gradient is part of its step, not of the next
variant's); the table gives the median ratio, the spread of the
variant's repeats (max/min - 1: how noisy the machine was) and the ratio of the fastest repeats
("best"). The results go to stdout and, as markdown, to
``benchmarks/results/trainer-<size>.md``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

import klpen


@dataclass(frozen=True)
class Size:
    batch: int
    seq: int
    vocab: int
    repeats: int


SIZES = {
    "full": Size(8, 512, 32_000, repeats=5),
    "tiny": Size(2, 16, 256, repeats=3),
}
RESULTS = Path(__file__).resolve().parent / "results"
SEED = 0
CLIP = 0.2
KL_COEF = 0.04


# --- the losses ---------------------------------------------------------------------------


def _ppo_term(logp: Tensor, old_logp: Tensor, advantages: Tensor) -> Tensor:
    ratio = torch.exp(logp - old_logp)
    clipped = ratio.clamp(1.0 - CLIP, 1.0 + CLIP)
    return -torch.minimum(ratio * advantages, clipped * advantages)


def _klpen_grpo(
    policy: Tensor, reference: Tensor, ids: Tensor, old: Tensor, adv: Tensor, mask: Tensor
) -> Tensor:
    logp = klpen.next_token_logprobs(policy, ids)
    ref = klpen.next_token_logprobs(reference, ids)
    kl = klpen.estimate_kl(logp, ref, "k3")
    return klpen.aggregate(_ppo_term(logp, old, adv) + KL_COEF * kl, mask, "token-mean")


def _torch_grpo(
    policy: Tensor, reference: Tensor, ids: Tensor, old: Tensor, adv: Tensor, mask: Tensor
) -> Tensor:
    target = ids[:, 1:].unsqueeze(-1)
    logp = torch.log_softmax(policy[:, :-1], dim=-1).gather(-1, target).squeeze(-1)
    ref = torch.log_softmax(reference[:, :-1], dim=-1).gather(-1, target).squeeze(-1)
    r = logp - ref
    kl = torch.exp(-r) + r - 1.0
    per_token = _ppo_term(logp, old, adv) + KL_COEF * kl
    return (per_token * mask).sum() / mask.sum().clamp(min=1.0)


# One wrapper per compiled variant, so that each torch.compile caches on its own code object.
def klpen_eager(*args: Tensor) -> Tensor:
    return _klpen_grpo(*args)


def klpen_compiled(*args: Tensor) -> Tensor:
    return _klpen_grpo(*args)


def klpen_fullgraph(*args: Tensor) -> Tensor:
    return _klpen_grpo(*args)


def torch_compiled(*args: Tensor) -> Tensor:
    return _torch_grpo(*args)


# --- inputs -------------------------------------------------------------------------------


def grpo_inputs(size: Size, device: str) -> tuple[Tensor, ...]:
    """Policy logits (leaf, requires grad), reference logits, ids, old log-probs, A, mask."""
    b, t, v = size.batch, size.seq, size.vocab
    gen = torch.Generator().manual_seed(SEED)
    policy = (torch.randn(b, t, v, generator=gen) * 2.0).to(device)
    reference = policy + 0.3 * torch.randn(b, t, v, generator=gen).to(device)
    ids = torch.randint(v, (b, t), generator=gen).to(device)
    with torch.no_grad():
        target = ids[:, 1:].unsqueeze(-1)
        old = torch.log_softmax(policy[:, :-1], -1).gather(-1, target).squeeze(-1)
    old = old + 0.05 * torch.randn(b, t - 1, generator=gen).to(device)
    adv = torch.randn(b, 1, generator=gen).to(device).expand(b, t - 1).contiguous()
    mask = (torch.rand(b, t - 1, generator=gen) < 0.9).float().to(device)
    policy.requires_grad_(True)
    return policy, reference, ids, old, adv, mask


# --- timing -------------------------------------------------------------------------------


@dataclass
class Variant:
    name: str
    call: Callable[[], object] | None  # None: unavailable
    why: str = ""  # unavailable or failed: the reason
    first_s: float | None = None  # the first call's time (the compilation, if any)
    times: list[float] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.call is not None and not self.why


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _timed(call: Callable[[], object], device: str) -> float:
    sync(device)
    t0 = time.perf_counter()
    call()
    sync(device)
    return time.perf_counter() - t0


def _failure(exc: BaseException) -> str:
    """The exception and its innermost cause (what a fake-tensor failure wraps), shortened."""
    root = exc
    while root.__cause__ is not None:
        root = root.__cause__
    text = f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
    if root is not exc:
        text += f"; cause {type(root).__name__}: {' '.join(str(root).split())[:300]}"
    return f"failed: {text}"


def run_group(variants: list[Variant], device: str, repeats: int) -> None:
    """Two warm-up calls each, then ``repeats`` interleaved rounds in turning order; failures
    are recorded."""
    for var in variants:
        if var.call is None:
            continue
        try:
            var.first_s = _timed(var.call, device)
            _timed(var.call, device)
        except Exception as exc:  # any failure of the variant is a result, not a crash
            var.why = _failure(exc)
        print(f"  warmed up {var.name}: {var.why or f'{var.first_s:.1f} s'}", file=sys.stderr)
    for i in range(repeats):
        start_at = i % len(variants)
        for var in variants[start_at:] + variants[:start_at]:
            if not var.ok:
                continue
            assert var.call is not None
            try:
                var.times.append(_timed(var.call, device))
            except Exception as exc:
                var.why = _failure(exc)


def fwd_bwd(loss: Callable[..., Tensor], args: tuple[Tensor, ...]) -> Callable[[], None]:
    leaf = args[0]

    def step() -> None:
        loss(*args).backward()
        leaf.grad = None  # freed in the step that made it: each variant pays for its own

    return step


def validation_off(step: Callable[[], None]) -> Callable[[], None] | None:
    if not hasattr(klpen, "validation"):
        return None

    def off() -> None:
        with klpen.validation(False):
            step()

    return off


def grpo_group(size: Size, device: str, repeats: int) -> dict[str, Variant]:
    args = grpo_inputs(size, device)
    eager = fwd_bwd(klpen_eager, args)
    variants = {
        "klpen eager": Variant("klpen eager", eager),
        "klpen compiled": Variant("klpen compiled", fwd_bwd(torch.compile(klpen_compiled), args)),
        "klpen compiled fullgraph": Variant(
            "klpen compiled fullgraph",
            fwd_bwd(torch.compile(klpen_fullgraph, fullgraph=True), args),
        ),
        "torch compiled": Variant("torch compiled", fwd_bwd(torch.compile(torch_compiled), args)),
        "klpen eager, validation off": Variant(
            "klpen eager, validation off",
            validation_off(eager),
            "" if hasattr(klpen, "validation") else "unavailable: no klpen.validation",
        ),
    }
    run_group(list(variants.values()), device, repeats)
    return variants


def packed_group(size: Size, device: str, repeats: int) -> dict[str, Variant]:
    b, t, v = size.batch, size.seq, size.vocab
    gen = torch.Generator().manual_seed(SEED + 1)
    logits = (torch.randn(b, t, v, generator=gen) * 2.0).to(device).requires_grad_(True)
    ids = torch.randint(v, (b, t), generator=gen).to(device)
    weights = torch.randn(b, t - 1, generator=gen).to(device)
    position_ids = torch.arange(t, device=device).repeat(b).view(1, b * t)
    mode = "seq-mean-token-mean"

    def padded() -> None:
        logp = klpen.next_token_logprobs(logits, ids)
        klpen.aggregate(logp * weights, torch.ones_like(logp), mode).backward()
        logits.grad = None

    packed_call: Callable[[], None] | None = None
    why = ""
    if hasattr(klpen, "sequence_ids"):
        seq = klpen.sequence_ids(position_ids=position_ids)[:, :-1]
        mask = (position_ids[:, 1:] != 0).float()
        # The packed row's weights: row s's weights, then 0 at the boundary entry.
        packed_weights = torch.cat([weights, torch.zeros(b, 1, device=device)], 1).view(1, -1)
        packed_weights = packed_weights[:, :-1]

        def packed() -> None:
            logp = klpen.next_token_logprobs(
                logits.view(1, b * t, v), ids.view(1, b * t), position_ids=position_ids
            )
            klpen.aggregate(logp * packed_weights, mask, mode, sequence_ids=seq).backward()
            logits.grad = None

        packed_call = packed
    else:
        why = "unavailable: no klpen.sequence_ids"
    variants = {
        "padded": Variant("padded", padded),
        "packed": Variant("packed", packed_call, why),
    }
    run_group(list(variants.values()), device, repeats)
    return variants


# --- report -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    name: str
    variant: str
    baseline: str
    target: float | None  # None: shown for context, no target


GRPO_ROWS = [
    Row("GRPO fwd+bwd: klpen compiled vs klpen eager", "klpen compiled", "klpen eager", 1.0),
    Row(
        "GRPO fwd+bwd: klpen compiled (fullgraph=True) vs klpen eager",
        "klpen compiled fullgraph",
        "klpen eager",
        1.0,
    ),
    Row(
        "GRPO fwd+bwd: klpen compiled vs plain torch compiled",
        "klpen compiled",
        "torch compiled",
        0.5,
    ),
    Row(
        "GRPO fwd+bwd: klpen eager vs plain torch compiled (context)",
        "klpen eager",
        "torch compiled",
        None,
    ),
    Row(
        "GRPO fwd+bwd, eager: validation off vs on",
        "klpen eager, validation off",
        "klpen eager",
        1.0,
    ),
]
PACKED_ROWS = [
    Row(
        "next_token_logprobs + aggregate fwd+bwd: packed (1, B*T) vs padded (B, T)",
        "packed",
        "padded",
        1.05,
    ),
]
ROW_NAMES = [row.name for row in GRPO_ROWS + PACKED_ROWS]


def table_row(row: Row, variants: dict[str, Variant]) -> tuple[str, bool]:
    var, base = variants[row.variant], variants[row.baseline]
    target = "-" if row.target is None else f"<= {row.target}"
    bad = next((x for x in (var, base) if not x.ok), None)
    if bad is not None:
        reason = bad.why or "unavailable"
        return f"| {row.name} | - | - | {reason} ({bad.name}) | - | - | {target} | - |", False
    vm, bm = statistics.median(var.times), statistics.median(base.times)
    ratio = vm / bm
    spread = max(var.times) / min(var.times) - 1
    best = min(var.times) / min(base.times)
    cells = f"{1e3 * vm:.1f} | {1e3 * bm:.1f} | {ratio:.2f} | {spread:.0%} | {best:.2f}"
    if row.target is None:
        return f"| {row.name} | {cells} | - | - |", True
    met = ratio <= row.target
    return f"| {row.name} | {cells} | {target} | {'yes' if met else 'NO'} |", met


def load_average() -> str:
    try:
        return " ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        return "unknown"


def machine(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    return f"{os.cpu_count()}-core CPU"


def backends() -> str:
    if hasattr(klpen, "available_backends"):
        return ", ".join(klpen.available_backends())
    return "unknown (no klpen.available_backends)"


def report(
    size_name: str,
    device: str,
    repeats: int,
    groups: dict[str, Variant],
    load_before: str,
    load_after: str,
) -> str:
    size = SIZES[size_name]
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        f"# klpen trainer benchmark, size {size_name}",
        "",
        f"- date: {now}; machine: {machine(device)}; device: {device}; torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads; klpen from {Path(klpen.__file__).parent.parent.name}"
        f"/; backends: {backends()}",
        f"- load average (1, 5, 15 min) before: {load_before}; after: {load_after}",
        f"- (B, T, V) = ({size.batch}, {size.seq}, {size.vocab}) fp32; one logits tensor is "
        f"{size.batch * size.seq * size.vocab * 4 / 2**20:.0f} MiB",
        f"- time: median of {repeats} interleaved repeats after two warm-up calls; spread = "
        "max/min - 1 of the variant's repeats; best = ratio of the fastest repeats",
        "",
        "| comparison | variant ms | baseline ms | variant/baseline | spread | best | target "
        "| met |",
        "|---|---:|---:|---:|---:|---:|---:|:-:|",
    ]
    all_met = True
    for row in GRPO_ROWS + PACKED_ROWS:
        line, met = table_row(row, groups)
        lines.append(line)
        all_met &= met
    lines += ["", "Compilation (the first call, fwd+bwd, in the warm-up):", ""]
    for name in ("klpen compiled", "klpen compiled fullgraph", "torch compiled"):
        var = groups[name]
        first = "-" if var.first_s is None else f"{var.first_s:.1f} s"
        lines.append(f"- {name}: {var.why or first}")
    lines += ["", f"All targets met: {'yes' if all_met else 'NO'}."]
    if size_name != "full":
        lines.append("The issue's targets are for the full size; here they are indicative.")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="full")
    parser.add_argument("--device", default="cpu", help="cpu (default), cuda, cuda:1, ...")
    parser.add_argument("--repeats", type=int, default=None, help="default: full 5, tiny 3")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    size = SIZES[args.size]
    repeats = args.repeats or size.repeats
    print(f"klpen trainer benchmark, size {args.size}, device {args.device}", file=sys.stderr)
    load_before = load_average()
    groups = grpo_group(size, args.device, repeats)
    groups.update(packed_group(size, args.device, repeats))
    text = report(args.size, args.device, repeats, groups, load_before, load_average())
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"trainer-{args.size}.md"
    out.write_text(text)
    print(text)
    print(f"written to {out}")


if __name__ == "__main__":
    main()
