"""vocab_parallel_full_kl is exact down to the smallest divergences, at any common offset.

Contract section 3 for full_kl, held by its vocab-parallel form: in fp32, relative error at
most 1e-4 against float64 for common shifts of the logits up to ±1e4 and KL down to 1e-7,
absolute at most 1e-10 below. The table spans KL from about 1e-10 to 1, temperatures 1, 0.7 and
1e4 (logits in units of T, and plain unit logits at T = 1e4: divergences near 1e-8, where the
former combination of the ranks' statistics returned 0), on three uneven slices. The reference
is the float64 definition on the same (fp32-rounded) logits; single-process full_kl is held to
the same bounds on the same inputs.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
import torch.nn.functional as F

from klpen import full_kl
from klpen.distributed import vocab_parallel_full_kl
from klpen_book.distributed_demo import launch_gloo

SIZES = [20, 30, 14]  # uneven slices of a vocabulary of 64
TEMPERATURES = (1.0, 0.7, 1e4)
UNITS = ("T", "1")  # logits spread in units of T, or of 1 (tiny divergences at T = 1e4)
OFFSETS = (0.0, 1e2, -1e3, 1e4, -1e4)
PERTURBATIONS = (1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0)  # KL from about 1e-10 to 1
REL_TOL, ABS_TOL, SMALL = 1e-4, 1e-10, 1e-7


def _inputs(seed: int, t: float, unit: str, offset: float, eps: float) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    scale = t if unit == "T" else 1.0
    base = torch.randn(6, sum(SIZES), generator=g, dtype=torch.float64) * 2
    noise = torch.randn(6, sum(SIZES), generator=g, dtype=torch.float64) * eps
    z = (offset + scale * base).float()
    w = (offset + scale * (base + noise)).float()
    return z, w


def _cases() -> list[tuple[int, float, str, float, float]]:
    grid = itertools.product(TEMPERATURES, UNITS, OFFSETS, PERTURBATIONS)
    return [(i, *case) for i, case in enumerate(grid)]


def _worker(rank: int, world: int) -> list[list[float]]:
    torch.set_num_threads(1)
    start = sum(SIZES[:rank])
    cols = slice(start, start + SIZES[rank])
    out = []
    for seed, t, unit, offset, eps in _cases():
        z, w = _inputs(seed, t, unit, offset, eps)
        out.append(vocab_parallel_full_kl(z[:, cols], w[:, cols], temperature=t).tolist())
    return out


def _reference(z: torch.Tensor, w: torch.Tensor, t: float) -> torch.Tensor:
    lz, lw = F.log_softmax(z.double() / t, -1), F.log_softmax(w.double() / t, -1)
    return torch.where(lz.exp() == 0, 0.0, lz.exp() * (lz - lw)).sum(-1)


def _errors(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    """(worst relative error where KL >= 1e-7, worst absolute error below)."""
    err = (got.double() - want).abs()
    big = want >= SMALL
    rel = float((err[big] / want[big]).max()) if bool(big.any()) else 0.0
    small = float(err[~big].max()) if bool((~big).any()) else 0.0
    return rel, small


def test_vocab_parallel_full_kl_is_exact_for_small_kl_and_large_offsets() -> None:
    results = launch_gloo(_worker, len(SIZES), join_timeout_s=600.0)
    worst: dict[str, list[Any]] = {"vocab-parallel": [0.0, 0.0], "single-process": [0.0, 0.0]}
    spanned = []
    for (seed, t, unit, offset, eps), *per_rank in zip(_cases(), *results, strict=True):
        z, w = _inputs(seed, t, unit, offset, eps)
        want = _reference(z, w, t)
        spanned.append(want)
        for rank, got in enumerate(per_rank):
            assert got == per_rank[0], ("ranks disagree", rank, seed)  # bitwise, every rank
        for name, got_t in (
            ("vocab-parallel", torch.tensor(per_rank[0], dtype=torch.float64)),
            ("single-process", full_kl(z, w, temperature=t)),
        ):
            rel, small = _errors(got_t, want)
            case = (name, t, unit, offset, eps)
            assert rel <= REL_TOL, (*case, "relative", rel)
            assert small <= ABS_TOL, (*case, "absolute", small)
            worst[name][0] = max(worst[name][0], rel)
            worst[name][1] = max(worst[name][1], small)
    every = torch.cat(spanned)
    # The table really spans the range the contract speaks of.
    assert float(every.min()) < 1e-9 and float(every.max()) > 0.5
    print(f"worst errors against float64 (relative for KL >= 1e-7, absolute below): {worst}")
