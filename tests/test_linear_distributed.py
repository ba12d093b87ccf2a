"""vocab_parallel_linear_logprobs on live gloo groups against single-process linear_logprobs.

Workers return plain numbers and messages; the assertions are made here. References: the
single-process :func:`klpen.linear.linear_logprobs` of the whole layer and, independently,
float64 ``log_softmax`` of ``hidden @ weight.T + bias``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from klpen.distributed import vocab_parallel_linear_logprobs
from klpen.linear import linear_logprobs
from klpen_book.distributed_demo import launch_gloo

SIZES = {2: [7, 2], 3: [1, 9, 5]}  # uneven slices


def _inputs(seed: int, v: int, extreme: bool) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(2, 3, 4, generator=g, dtype=torch.float64)
    weight = torch.randn(v, 4, generator=g, dtype=torch.float64)
    bias = torch.randn(v, generator=g, dtype=torch.float64)
    tokens = torch.randint(0, v, (2, 3), generator=g)
    if extreme:
        bias[::4] = -math.inf  # masked entries on several ranks
        hidden[0, 1] *= 1e4  # forces the redo path, with its collectives
        tokens[1, 2] = 0  # a masked token: -inf
    return hidden, weight, bias, tokens


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    if not torch.equal(a.isinf(), b.isinf()) or not torch.equal(a[a.isinf()], b[b.isinf()]):
        return math.inf
    finite = a.isfinite()
    return float((a[finite] - b[finite]).abs().max()) if bool(finite.any()) else 0.0


def _values_worker(rank: int, world: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    sizes = SIZES[world]
    start = sum(sizes[:rank])
    rows = slice(start, start + sizes[rank])
    out: dict[str, Any] = {}
    for name, dtype, extreme, t in [
        ("fp64", torch.float64, False, 1.0),
        ("fp32 T=0.7", torch.float32, False, 0.7),
        ("extreme", torch.float64, True, 1.0),
    ]:
        hidden, weight, bias, tokens = (
            x.to(dtype) if x.is_floating_point() else x for x in _inputs(world, sum(sizes), extreme)
        )
        h = hidden.clone().requires_grad_()
        w = weight[rows].clone().requires_grad_()
        b = bias[rows].clone().requires_grad_()
        lp = vocab_parallel_linear_logprobs(h, w, tokens, local_bias=b, temperature=t)
        gout = torch.randn(lp.shape, generator=torch.Generator().manual_seed(1), dtype=lp.dtype)
        gout = torch.where(lp.isinf(), 0.0, gout)
        gh, gw, gb = torch.autograd.grad((lp * gout).sum(), (h, w, b))
        # single process
        h1, w1, b1 = (x.clone().requires_grad_() for x in (hidden, weight, bias))
        ref = linear_logprobs(h1, w1, tokens, bias=b1, temperature=t)
        rh, rw, rb = torch.autograd.grad((ref * gout).sum(), (h1, w1, b1))
        exact = F.log_softmax((hidden.double() @ weight.double().T + bias.double()) / t, -1)
        exact = exact.gather(-1, tokens[..., None]).squeeze(-1)
        out[name] = {
            "value": _diff(lp, ref),
            "exact": _diff(lp, exact),
            "grads": [_diff(gh, rh), _diff(gw, rw[rows]), _diff(gb, rb[rows])],
            "finite_grads": all(bool(g.isfinite().all()) for g in (gh, gw, gb)),
            "inf": lp.isinf().nonzero().tolist(),
            "masked": (bias[tokens] == -math.inf).nonzero().tolist(),
        }
    return out


def _check(results: list[dict[str, Any]]) -> None:
    for rank, res in enumerate(results):
        for name, r in res.items():
            tol = 1e-5 if name.startswith("fp32") else 1e-9
            assert r["value"] <= tol, (rank, name, r)
            assert r["exact"] <= tol, (rank, name, r)
            assert max(r["grads"]) <= 10 * tol, (rank, name, r)
            assert r["finite_grads"], (rank, name)
        # -inf exactly at the tokens the bias masks (every fourth id), among them (1, 2)
        assert [1, 2] in res["extreme"]["inf"]
        assert res["extreme"]["inf"] == res["extreme"]["masked"]


def test_three_uneven_ranks_match_single_process() -> None:
    _check(launch_gloo(_values_worker, 3))


def _misuse_worker(rank: int, world: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    out: dict[str, Any] = {"values": _values_worker(rank, world)}
    hidden, weight, _, tokens = _inputs(0, 9, False)
    rows = slice(0, 7) if rank == 0 else slice(7, 9)
    cases = {
        "tokens differ": dict(tokens=(tokens + rank) % 9),
        "bad weight on rank 1": dict(local_weight=weight[rows, :3] if rank == 1 else weight[rows]),
        "token out of range": dict(tokens=torch.full_like(tokens, 9)),
        "dtype differs": dict(local_weight=weight[rows].float() if rank == 1 else weight[rows]),
        "NaN hidden": dict(hidden=torch.full_like(hidden, math.nan)),
    }
    errors = {}
    for name, change in cases.items():
        args: dict[str, Any] = dict(hidden=hidden, local_weight=weight[rows], tokens=tokens)
        args.update(change)
        try:
            vocab_parallel_linear_logprobs(args["hidden"], args["local_weight"], args["tokens"])
            errors[name] = ("none", "")
        except (TypeError, ValueError) as exc:
            errors[name] = (type(exc).__name__, str(exc))
    out["errors"] = errors
    return out


def test_two_ranks_values_and_misuse_raise_on_every_rank() -> None:
    both = launch_gloo(_misuse_worker, 2)
    _check([r["values"] for r in both])
    for name in ("tokens differ", "token out of range", "dtype differs", "NaN hidden"):
        for r in both:
            kind, message = r["errors"][name]
            assert kind == "ValueError", (name, message)
    assert "tokens must be identical" in both[0]["errors"]["tokens differ"][1]
    assert "H = 4" in both[1]["errors"]["bad weight on rank 1"][1]
    assert "rank(s) [1]" in both[0]["errors"]["bad weight on rank 1"][1]
    assert "H = 4" in both[0]["errors"]["bad weight on rank 1"][1]  # repeated on rank 0
    assert "must have the same dtype" in both[0]["errors"]["dtype differs"][1]
