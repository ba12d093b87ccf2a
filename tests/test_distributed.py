"""klpen.distributed against the single-process functions, on live gloo process groups.

Each test spawns its processes once (spawning costs seconds) and runs many checks inside; the
workers return plain numbers and messages, and the assertions are made here in the parent.
References: the single-process klpen functions on the concatenated logits, and, independently,
float64 ``log_softmax`` and the float64 formula ``Σ p (log p - log q)``.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import klpen.kernels.blocks
from klpen import full_kl, get_logprobs_for_tokens
from klpen.distributed import vocab_parallel_full_kl, vocab_parallel_logprobs
from klpen_book.distributed_demo import (
    VocabParallelDemo,
    _demo_rank,
    launch_gloo,
    record_collectives,
    run_vocab_parallel_demo,
)
from klpen_book.memory import peak_extra_bytes

NEG_INF = float("-inf")


def _inputs(
    shape: tuple[int, ...], seed: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(shape, generator=gen, dtype=torch.float64) * 3
    w = z + torch.randn(shape, generator=gen, dtype=torch.float64)
    tokens = torch.randint(0, shape[-1], shape[:-1], generator=gen)
    return z.to(dtype), w.to(dtype), tokens


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """Max |a - b| over finite entries; inf unless both have the same infinities and NaNs.

    (A divergence of +inf has NaN gradients in one process too: they must match.)
    """
    a, b = a.detach().double(), b.detach().double()
    finite = a.isfinite()
    if not torch.equal(finite, b.isfinite()) or not torch.equal(a.isnan(), b.isnan()):
        return float("inf")
    if not torch.equal(a[a.isinf()], b[b.isinf()]):
        return float("inf")
    return float((a[finite] - b[finite]).abs().max()) if bool(finite.any()) else 0.0


def _compare(
    rank: int,
    z: torch.Tensor,
    w: torch.Tensor,
    tokens: torch.Tensor,
    sizes: list[int],
    group: Any = None,
    position: int | None = None,
    temperature: float = 1.0,
) -> dict[str, Any]:
    """Vocab-parallel values and gradients on this rank vs single-process ones on the full logits.

    ``position`` is this process's index in ``group`` (its rank there); ``z[..., :-?]`` views
    are kept as views so that non-contiguous input is exercised.
    """
    r = rank if position is None else position
    start = sum(sizes[:r])
    cols = slice(start, start + sizes[r])
    full_z = z.detach().clone().requires_grad_()
    full_w = w.detach().clone().requires_grad_()
    t = temperature
    logp = get_logprobs_for_tokens(full_z, tokens, temperature=t)
    kl = full_kl(full_z, full_w, temperature=t)
    # Independent float64 references.
    ref_logp = F.log_softmax(z.double() / t, -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    # (torch.distributions.kl_divergence works with probabilities, which underflow for the
    # extreme logits below; the float64 log-domain formula does not.)
    lz, lw = F.log_softmax(z.double() / t, -1), F.log_softmax(w.double() / t, -1)
    ref_kl = torch.where(lz.exp() == 0, 0.0, lz.exp() * (lz - lw)).sum(-1)

    # Upstream gradients that differ per row (the same on every rank), not just ones.
    weights = torch.linspace(0.5, 1.5, max(logp.numel(), 1), dtype=torch.float64)[: logp.numel()]
    weights = weights.reshape(logp.shape)
    local_z = z[..., cols].detach().requires_grad_()
    local_w = w[..., cols].detach().requires_grad_()
    with record_collectives() as fwd_logp:
        par_logp = vocab_parallel_logprobs(local_z, tokens, group, temperature=t)
    with record_collectives() as bwd_logp:
        par_logp.backward(weights.to(par_logp.dtype))
    (g_logp_w,) = torch.autograd.grad((logp * weights.to(logp.dtype)).sum(), full_z)
    par_g_logp = local_z.grad
    local_z.grad = None
    with record_collectives() as fwd_kl:
        par_kl = vocab_parallel_full_kl(local_z, local_w, group, temperature=t)
    with record_collectives() as bwd_kl:
        par_kl.backward(weights.to(par_kl.dtype))
    (g_kl_z_w, g_kl_w_w) = torch.autograd.grad((kl * weights.to(kl.dtype)).sum(), (full_z, full_w))
    assert par_g_logp is not None and local_z.grad is not None and local_w.grad is not None
    finite = torch.cat([logp.detach().flatten(), kl.detach().flatten()]).double()
    finite = finite[finite.isfinite()]
    return {
        # Values are compared relative to their magnitude (absolute below 1).
        "scale": max(1.0, float(finite.abs().max())) if finite.numel() else 1.0,
        "logp": _diff(par_logp, logp),
        "logp_ref": _diff(par_logp, ref_logp),
        "grad_logp": _diff(par_g_logp, g_logp_w[..., cols]),
        "kl": _diff(par_kl, kl),
        "kl_ref": _diff(par_kl, ref_kl),
        "grad_kl_z": _diff(local_z.grad, g_kl_z_w[..., cols]),
        "grad_kl_w": _diff(local_w.grad, g_kl_w_w[..., cols]),
        "logp_dtype": par_logp.dtype,
        "kl_dtype": par_kl.dtype,
        "grad_dtype": local_z.grad.dtype,
        "shape": tuple(par_logp.shape),
        "kl_inf_rows": par_kl.isinf().nonzero().flatten().tolist(),
        "logp_inf_rows": par_logp.isinf().nonzero().flatten().tolist(),
        "kl_shape": tuple(par_kl.shape),
        "collectives": [
            [(c.name, c.op, c.shape, c.dtype) for c in calls]
            for calls in (fwd_logp, bwd_logp, fwd_kl, bwd_kl)
        ],
    }


# (name, world sizes allowed, leading shape, slice sizes, dtype, seed); every world size runs
# the cases whose slice list has its length.
CASES: list[tuple[str, tuple[int, ...], list[int], torch.dtype, int]] = [
    ("even fp64", (2, 3), [4, 4, 4], torch.float64, 0),
    ("uneven fp64 with a 1-column slice", (2, 5), [1, 6, 3], torch.float64, 1),
    ("1-column last slice fp32", (3, 4), [7, 5, 1], torch.float32, 2),
    ("bf16", (2, 3), [16, 8, 8], torch.bfloat16, 3),
    ("no leading dims", (), [2, 2, 3], torch.float64, 4),
    ("empty batch", (0, 3), [2, 2, 2], torch.float32, 5),
    ("even fp32, two ranks", (2, 3), [5, 5], torch.float32, 6),
    ("uneven, two ranks", (4, 2), [9, 1], torch.float64, 7),
]


def _values_worker(rank: int, world_size: int) -> dict[str, Any]:
    warnings.simplefilter("error")  # as pytest does in this process
    out: dict[str, Any] = {}
    for name, leading, sizes, dtype, seed in CASES:
        if len(sizes) != world_size:
            continue
        z, w, tokens = _inputs((*leading, sum(sizes)), seed, dtype)
        out[name] = _compare(rank, z, w, tokens, sizes)

    # Non-contiguous slices: the shifted logits[:, :-1] of a language model.
    z, w, tokens = _inputs((2, 5, 3 * world_size), 10, torch.float64)
    sizes = [3] * world_size
    out["shifted view"] = _compare(rank, z[:, :-1], w[:, :-1], tokens[:, 1:], sizes)
    # Logits in the hundreds: exp overflows or underflows in some rows and slices, which take
    # the exact max-shifted path (fp32: beyond about ±88; here up to about ±1000 in fp64 too).
    for dtype in (torch.float32, torch.float64):
        zx, wx, tx = _inputs((3, 4, 3 * world_size), 13, torch.float64)
        zx, wx = (zx * 100).to(dtype), (wx * 100).to(dtype)
        out[f"extreme logits {dtype}"] = _compare(rank, zx, wx, tx, sizes)
    # Only the reference is a non-contiguous view: the blocks of both must still match.
    z_contiguous = z[:, :-1].contiguous()
    out["mixed strides"] = _compare(rank, z_contiguous, w[:, :-1], tokens[:, 1:], sizes)

    # -inf entries: rank 0's whole slice of row 0 (a masked slice of the vocabulary), a
    # reference -inf where the policy has mass (KL = +inf) in row 1, a -inf target logit.
    z, w, tokens = _inputs((3, 2 * world_size), 11, torch.float64)
    z[0, :2] = NEG_INF
    w[1, -1] = NEG_INF
    z[2, 1] = NEG_INF
    tokens[2] = 1
    z_ok, w_ok = z.clone(), w.clone()
    out["-inf"] = _compare(rank, z_ok, w_ok, tokens, [2] * world_size)
    # The reference's whole slice on the last rank is -inf where the policy has mass there.
    w2 = w_ok.clone()
    w2[0, -2:] = NEG_INF
    out["-inf reference slice"] = _compare(rank, z_ok, w2, tokens, [2] * world_size)

    # A sampling temperature: plain, with extreme logits, and with the -inf entries above
    # (rows that the backward redoes, with the logits scaled by 1/T).
    for t in (0.7, 1.6):
        zt, wt, tt = _inputs((3, 4, 3 * world_size), 14, torch.float64)
        out[f"temperature {t}"] = _compare(rank, zt, wt, tt, sizes, temperature=t)
    zx, wx, tx = _inputs((3, 4, 3 * world_size), 15, torch.float64)
    # (fp64: in fp32 the global log-sum-exps near 1e3 / T carry 1e-4 of rounding, which the
    # KL gradient of the slices inherits.)
    zx, wx = zx * 100, wx * 100
    out["temperature 0.6, extreme logits"] = _compare(rank, zx, wx, tx, sizes, temperature=0.6)
    out["temperature 0.5, -inf"] = _compare(
        rank, z_ok, w2, tokens, [2] * world_size, temperature=0.5
    )

    # A subgroup: ranks 0 and world_size - 1 split the vocabulary; the others are not members.
    members = [0, world_size - 1]
    sub = dist.new_group(members)
    z, w, tokens = _inputs((2, 3, 7), 12, torch.float64)
    if rank in members:
        out["subgroup"] = _compare(rank, z, w, tokens, [4, 3], sub, members.index(rank))
    else:
        try:
            vocab_parallel_logprobs(z[..., :3], tokens, sub)
        except ValueError as exc:
            out["subgroup"] = str(exc)
    dist.barrier()
    return out


def _check_values(results: list[dict[str, Any]]) -> int:
    checked = 0
    for rank, result in enumerate(results):
        for name, r in result.items():
            if isinstance(r, str):
                assert "not a member" in r, (rank, name, r)
                continue
            dtype = r["logp_dtype"]
            tol = {torch.float64: 1e-12, torch.float32: 2e-5}[dtype]
            # bf16 gradients are rounded to bf16: one unit in the last place at |g| <= 1.
            grad_tol = 2.0**-8 if "bf16" in name else tol
            ref_tol = 1e-12 if dtype == torch.float64 else 1e-4
            for key in ("logp", "kl"):
                assert r[key] <= tol * r["scale"], (rank, name, key, r[key], r["scale"])
            for key in ("grad_logp", "grad_kl_z", "grad_kl_w"):
                assert r[key] <= grad_tol, (rank, name, key, r[key])
            for key in ("logp_ref", "kl_ref"):
                assert r[key] <= ref_tol * r["scale"], (rank, name, key, r[key], r["scale"])
            if "bf16" in name:
                assert r["logp_dtype"] == r["kl_dtype"] == torch.float32
                assert r["grad_dtype"] == torch.bfloat16
            n = 1
            for d in r["shape"]:
                n *= d
            assert r["kl_shape"] == r["shape"]
            ct = "float64" if dtype == torch.float64 else "float32"
            fwd_logp, bwd_logp, fwd_kl, bwd_kl = r["collectives"]
            # One metadata all-gather, then max of 3N + 1 (the local lse, the ids and their
            # negatives, the failure flag) and sum of 2N + 1 (log-probs), an all-gather of
            # 4N + 1 float64 (full KL: each slice's statistics, combined alike on every rank);
            # nothing in backward; never a tensor of V numbers per row.
            assert fwd_logp == [
                ("all_gather", "", (16,), "int64"),
                ("all_reduce", "max", (3 * n + 1,), ct),
                ("all_reduce", "sum", (2 * n + 1,), ct),
            ], (rank, name, fwd_logp)
            assert fwd_kl == [
                ("all_gather", "", (16,), "int64"),
                ("all_gather", "", (4 * n + 1,), "float64"),
            ], (rank, name, fwd_kl)
            assert bwd_logp == [] and bwd_kl == []
            checked += 1
    return checked


def test_values_and_gradients_match_single_process_on_three_ranks() -> None:
    results = launch_gloo(_values_worker, 3)
    # 6 three-rank cases + 2 views + 2 extreme + 2 -inf + 4 temperature cases + subgroup (a
    # string on rank 1).
    assert all(len(r) == 17 for r in results)
    assert _check_values(results) == 3 * 16 + 2
    # The -inf cases really hold infinities (matched position by position above).
    for name in ("-inf", "-inf reference slice"):
        assert results[0][name]["kl_inf_rows"] == ([1] if name == "-inf" else [0, 1])
        assert results[0][name]["logp_inf_rows"] == [2]


def _misuse_worker(rank: int, world_size: int) -> dict[str, tuple[str, str]]:
    warnings.simplefilter("error")
    z, w, tokens = _inputs((2, 3, 10), 0, torch.float32)
    sizes = [7, 3]
    cols = slice(0, 7) if rank == 0 else slice(7, 10)
    lz, lw = z[..., cols], w[..., cols]
    other = rank == 1
    cases: dict[str, Any] = {
        "tokens differ": lambda: vocab_parallel_logprobs(lz, (tokens + other) % 10),
        # Same ids, two of them swapped: the same sum, caught by the exact comparison.
        "tokens permuted": lambda: vocab_parallel_logprobs(
            lz, torch.tensor([[2, 1, 3], [4, 5, 6]] if other else [[1, 2, 3], [4, 5, 6]])
        ),
        "leading shape differs": lambda: vocab_parallel_logprobs(
            lz[:, :2] if other else lz, tokens[:, :2] if other else tokens
        ),
        "dtype differs": lambda: vocab_parallel_logprobs(lz.double() if other else lz, tokens),
        "float tokens on rank 1": lambda: vocab_parallel_logprobs(
            lz, tokens.float() if other else tokens
        ),
        "token out of range": lambda: vocab_parallel_logprobs(lz, torch.full_like(tokens, 10)),
        "negative token": lambda: vocab_parallel_logprobs(lz, torch.full_like(tokens, -1)),
        "vocab_size does not add up": lambda: vocab_parallel_logprobs(lz, tokens, vocab_size=12),
        "vocab_size differs": lambda: vocab_parallel_full_kl(lz, lw, vocab_size=10 + other),
        "empty slice": lambda: vocab_parallel_full_kl(
            lz[..., :0] if other else lz, lw[..., :0] if other else lw
        ),
        "reference shape": lambda: vocab_parallel_full_kl(lz, lw[:, :2] if rank == 0 else lw),
        "reference dtype differs": lambda: vocab_parallel_full_kl(lz, lw.double() if other else lw),
        "NaN on rank 1": lambda: vocab_parallel_full_kl(
            lz, lw.clone().fill_(float("nan")) if other else lw
        ),
        "row all -inf": lambda: vocab_parallel_logprobs(
            torch.where(torch.arange(2)[:, None, None] == 0, NEG_INF, lz), tokens
        ),
        "group type": lambda: vocab_parallel_logprobs(lz, tokens, group="world"),  # type: ignore[arg-type]
        "float8 logits on rank 1": lambda: vocab_parallel_full_kl(
            lz.to(torch.float8_e4m3fn) if other else lz, lw
        ),
        "logits type": lambda: vocab_parallel_logprobs(lz.tolist() if other else lz, tokens),  # type: ignore[arg-type]
        "temperature differs": lambda: vocab_parallel_full_kl(lz, lw, temperature=1.0 + other),
        "temperature 0 on rank 1": lambda: vocab_parallel_logprobs(
            lz, tokens, temperature=0.0 if other else 1.0
        ),
    }
    out: dict[str, tuple[str, str]] = {}
    for name, call in cases.items():
        try:
            call()
            out[name] = ("no error", "")
        except (TypeError, ValueError) as exc:
            out[name] = (type(exc).__name__, str(exc))
    # The group is still usable after every error: no rank was left inside a collective.
    ok = vocab_parallel_logprobs(lz, tokens, vocab_size=sum(sizes))
    expected = get_logprobs_for_tokens(z, tokens)
    out["after errors"] = ("ok", f"{float((ok - expected).abs().max()):.1e}")
    return {
        "errors": out,
        "offsets": _offset_worker(rank),
        "values": _values_worker(rank, world_size),
        "demo": _demo_rank(rank, world_size, [5, 1], (2, 3, 6), 0, torch.float32),
    }


OFFSETS = (0.0, 1e2, 1e4, -1e4)


def _offset_worker(rank: int) -> dict[float, tuple[float, float]]:
    """fp32 log-probs and gradients at a large common offset of the logits, against float64
    ``log_softmax`` of the same fp32 logits: (max |value error|, max |gradient error|)."""
    gen = torch.Generator().manual_seed(30)
    z = torch.randn(16, 300, generator=gen, dtype=torch.float64) * 3
    tokens = torch.randint(0, 300, (16,), generator=gen)
    cols = slice(0, 170) if rank == 0 else slice(170, 300)
    out = {}
    for offset in OFFSETS:
        logits = (z + offset).float()
        exact = logits.double().requires_grad_()
        ref = F.log_softmax(exact, -1).gather(-1, tokens[:, None]).squeeze(-1)
        (ref_grad,) = torch.autograd.grad(ref.sum(), exact)
        local = logits[:, cols].clone().requires_grad_()
        got = vocab_parallel_logprobs(local, tokens)
        got.sum().backward()
        assert local.grad is not None
        out[offset] = (
            float((got.detach().double() - ref.detach()).abs().max()),
            float((local.grad.double() - ref_grad[:, cols]).abs().max()),
        )
    return out


EXPECTED_ERRORS = {
    # name: (type on rank 0, type on rank 1, words in the message on each rank)
    "tokens differ": ("ValueError", "ValueError", ["tokens", "identical", "6 of 6", "(0, 0)"]),
    "tokens permuted": ("ValueError", "ValueError", ["tokens", "identical"]),
    "leading shape differs": ("ValueError", "ValueError", ["leading shape", "(2, 3)", "(2, 2)"]),
    "dtype differs": ("ValueError", "ValueError", ["same dtype", "torch.float64", "rank 1"]),
    "token out of range": ("ValueError", "ValueError", ["tokens", "[0, 10)", "10"]),
    "negative token": ("ValueError", "ValueError", ["tokens", "-1"]),
    "vocab_size does not add up": ("ValueError", "ValueError", ["vocab_size", "[7, 3]", "12"]),
    "vocab_size differs": ("ValueError", "ValueError", ["vocab_size", "11"]),
    "reference dtype differs": ("ValueError", "ValueError", ["local_reference_logits", "dtype"]),
    "NaN on rank 1": ("ValueError", "ValueError", ["NaN"]),
    "row all -inf": ("ValueError", "ValueError", ["-inf"]),
    "group type": ("TypeError", "TypeError", ["group", "str"]),
    "temperature differs": ("ValueError", "ValueError", ["temperature", "1.0 on rank 0", "2.0"]),
}


def test_two_ranks_misuse_raises_everywhere_and_values_match() -> None:
    both = launch_gloo(_misuse_worker, 2)
    # 2 two-rank cases + 2 views + 2 extreme + 2 -inf + 4 temperature cases + subgroup (both
    # are members).
    assert _check_values([r["values"] for r in both]) == 2 * 13
    _check_demo(VocabParallelDemo(2, 2, 3, 6, [5, 1], "float32", 1e-6, [r["demo"] for r in both]))
    # A common offset of 1e4 costs no digits (log_softmax's own fp32 error here is 8e-7): the
    # log-sum-exp stays split as max + log S, and z_y - max is formed before anything else.
    for r in both:
        for offset in OFFSETS:
            value_error, grad_error = r["offsets"][offset]
            assert value_error < 2e-6, (offset, value_error)
            assert grad_error < 1e-6, (offset, grad_error)
    results = [r["errors"] for r in both]
    for name, (t0, t1, words) in EXPECTED_ERRORS.items():
        for rank, expected_type in ((0, t0), (1, t1)):
            kind, message = results[rank][name]
            assert kind == expected_type, (name, rank, kind, message)
            for word in words:
                assert word in message, (name, rank, word, message)
    # A local error raises its own message on the rank that made it; the others name that rank.
    for name, bad, kind, words in [
        ("float tokens on rank 1", 1, "TypeError", ["tokens", "torch.float32"]),
        ("empty slice", 1, "ValueError", ["local_policy_logits", "at least one", "(2, 3, 0)"]),
        ("reference shape", 0, "ValueError", ["local_reference_logits", "(2, 2, 7)"]),
        ("logits type", 1, "TypeError", ["local_logits", "list"]),
        ("float8 logits on rank 1", 1, "TypeError", ["local_policy_logits", "float8_e4m3fn"]),
        ("temperature 0 on rank 1", 1, "ValueError", ["temperature", "0.0"]),
    ]:
        got_kind, message = results[bad][name]
        assert got_kind == kind, (name, got_kind, message)
        assert all(word in message for word in words), (name, message)
        got_kind, message = results[1 - bad][name]
        assert got_kind == "ValueError", (name, got_kind, message)
        assert f"rank(s) [{bad}]" in message and "rejected" in message, (name, message)
    for rank in (0, 1):
        assert results[rank]["after errors"][0] == "ok"
        assert float(results[rank]["after errors"][1]) < 1e-5


def _check_demo(demo: VocabParallelDemo) -> None:
    assert demo.max_difference < demo.tolerance == 1e-6
    assert [r["slice"] for r in demo.ranks] == [(0, 5), (5, 6)]
    table = demo.table().splitlines()
    assert table[0].split() == ["rank", "vocab", "slice", "log-probs", "their", "grad", "full",
                                "KL", "its", "grad"]  # fmt: skip
    assert table[2].startswith("0     [0, 5)") and table[2].count("< 1e-06") == 4
    assert demo.collectives(1).splitlines() == [
        "vocab_parallel_logprobs: all_gather of 16 int64; all_reduce max of 19 float32; "
        "all_reduce sum of 13 float32",
        "vocab_parallel_logprobs backward: none",
        "vocab_parallel_full_kl: all_gather of 16 int64; all_gather of 25 float64",
        "vocab_parallel_full_kl backward: none",
    ]
    values = demo.values().splitlines()
    assert len(values) == 2 + 4
    # Rank 1's log-prob column equals the single-process one, to the 4 decimals shown.
    cells = [line.split() for line in values[2:]]
    assert all(row[1] == row[2] == row[3] and row[4] == row[5] == row[6] for row in cells)


def test_demo_rejects_bad_sizes() -> None:
    # The live run itself is exercised by test_two_ranks_... (same worker) and by chapter 11.
    with pytest.raises(ValueError, match=r"sizes must give 2 positive slice sizes .* got \[5, 2\]"):
        run_vocab_parallel_demo(world_size=2, vocab=6, sizes=[5, 2])


def test_without_a_process_group() -> None:
    assert not dist.is_initialized()
    z = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="init_process_group"):
        vocab_parallel_logprobs(z, torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match=r"no default torch\.distributed process group"):
        vocab_parallel_full_kl(z, z)
    with pytest.raises(TypeError, match=r"group must be a torch\.distributed\.ProcessGroup"):
        vocab_parallel_full_kl(z, z, group=3)  # type: ignore[arg-type]


def test_world_of_one_matches_single_process(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    # A one-process group through a FileStore, in this process, on the loopback interface.
    from klpen_book.distributed_demo import _loopback_interface

    loopback = _loopback_interface()
    if loopback is not None:
        monkeypatch.setenv("GLOO_SOCKET_IFNAME", loopback)
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        result = _compare(0, *_inputs((3, 4, 9), 20, torch.float64), [9])
        # Memory-bounded: forward and backward allocate far less than one copy of the logits
        # (33 MB here): the result, per-row numbers, a few blocks, and the gradient in backward.
        # Blocks of 2**15 elements (one row here) keep the bound independent of the tuning of
        # the default block size.
        monkeypatch.setattr(klpen.kernels.blocks, "CHUNK_ELEMENTS", 1 << 15)
        z, w, tokens = _inputs((256, 32000), 21, torch.float32)
        logits_bytes = z.numel() * 4
        fwd_logp = peak_extra_bytes(vocab_parallel_logprobs, z, tokens)
        fwd_kl = peak_extra_bytes(vocab_parallel_full_kl, z, w)
        z.requires_grad_()
        out = vocab_parallel_full_kl(z, w)
        bwd_kl = peak_extra_bytes(out.sum().backward)
    finally:
        dist.destroy_process_group()
    for key in ("logp", "kl", "grad_logp", "grad_kl_z", "grad_kl_w", "logp_ref", "kl_ref"):
        assert result[key] <= 1e-12, (key, result[key])
    assert fwd_logp < logits_bytes / 8 and fwd_kl < logits_bytes / 8, (fwd_logp, fwd_kl)
    # Backward returns the gradient (one logits-sized tensor) and adds a few blocks to it.
    assert bwd_kl < logits_bytes * 1.125, bwd_kl
