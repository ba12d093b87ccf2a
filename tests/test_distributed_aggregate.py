"""klpen.distributed.aggregate on live gloo groups against the single-process aggregate.

The batch is split unevenly: the ranks hold different numbers of rows and of positions, one of
them only masked rows, and the masked slots hold NaN, ±inf and 1e30. The values depend on a
parameter vector that every rank holds (as under DDP); after ``backward`` the parameter
gradients are averaged with an explicit all-reduce, as DDP does, and must equal the gradient of
the single-process ``klpen.aggregate`` of the concatenated batch.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from klpen import aggregate as single_aggregate
from klpen.distributed import aggregate
from klpen.masking import AGGREGATION_MODES
from klpen_book.distributed_demo import (
    DataParallelAggregateDemo,
    _aggregate_demo_rank,
    launch_gloo,
    record_collectives,
    run_data_parallel_aggregate_demo,
)

HIDDEN = 3
JUNK = [float("nan"), float("inf"), float("-inf"), 1e30]

# Per world size: the rows and positions of each rank, and the ranks whose rows are all masked.
LAYOUTS: dict[int, tuple[list[int], list[int], list[int]]] = {
    2: ([1, 4], [6, 2], []),
    3: ([3, 2, 4], [5, 7, 3], [1]),
}


def _batch(world: int, dtype: torch.dtype) -> list[dict[str, torch.Tensor]]:
    """Every rank's features, mask and masked-slot junk (the same on every rank: seeded)."""
    rows, cols, empty = LAYOUTS[world]
    gen = torch.Generator().manual_seed(world)
    parts = []
    for r in range(world):
        features = torch.randn(rows[r], cols[r], HIDDEN, generator=gen, dtype=torch.float64)
        mask = torch.rand(rows[r], cols[r], generator=gen) < 0.6
        mask[:, 0] = r not in empty  # every row of a non-empty rank has a valid token
        if r in empty:
            mask[:] = False
        junk_index = torch.randint(0, len(JUNK), (rows[r], cols[r]), generator=gen)
        junk = torch.tensor(JUNK, dtype=torch.float64)[junk_index]
        junk = torch.where(mask, 0.0, junk)
        parts.append({"features": features.to(dtype), "mask": mask, "junk": junk.to(dtype)})
    return parts


def _values(part: dict[str, torch.Tensor], p: torch.Tensor) -> torch.Tensor:
    """``(B, T)`` values depending on ``p``; junk (NaN, ±inf, 1e30) in the masked slots."""
    return torch.tanh(part["features"] @ p) * 2 + part["junk"]


def _parameter(dtype: torch.dtype) -> torch.Tensor:
    return torch.tensor([0.5, -1.0, 2.0], dtype=dtype, requires_grad=True)


def _aggregate_worker(rank: int, world: int) -> dict[str, Any]:
    warnings.simplefilter("error")
    out: dict[str, Any] = {}
    for dtype in (torch.float64, torch.float32):
        part = _batch(world, dtype)[rank]
        for mode in AGGREGATION_MODES:
            p = _parameter(dtype)
            values = _values(part, p)
            values.retain_grad()
            with record_collectives() as forward:
                result = aggregate(values, part["mask"], mode)
            with record_collectives() as backward:
                result.backward()
            assert p.grad is not None and values.grad is not None
            averaged = p.grad.clone()
            dist.all_reduce(averaged)  # what DDP does with the parameter gradients ...
            averaged /= world  # ... it averages them
            # A rank that aggregates only its own rows (the mistake this function prevents).
            local = single_aggregate(values.detach(), part["mask"], mode)
            out[(str(dtype), mode)] = {
                "value": result.item(),
                "dtype": result.dtype,
                "averaged_grad": averaged.tolist(),
                "values_grad": values.grad,
                "local_value": local.item(),
                "collectives": [[str(c) for c in calls] for calls in (forward, backward)],
            }
    # Every row of every rank masked: 0 and a zero gradient, as in one process.
    p = _parameter(torch.float64)
    part = _batch(world, torch.float64)[rank]
    values = _values(part, p)
    result = aggregate(values, torch.zeros_like(part["mask"]), "token-mean")
    result.backward()
    assert p.grad is not None
    out["all masked"] = (result.item(), p.grad.tolist())
    if world == 2:  # the lab's demo (chapter material), on the same processes
        out["demo"] = _aggregate_demo_rank(rank, world, DEMO_LENGTHS, "token-mean", 4, 0)
    return out


DEMO_LENGTHS = [[2, 3], [9, 12, 10, 11]]


def _reference(world: int, dtype: torch.dtype, mode: str) -> tuple[float, list[float], Any]:
    """Single-process aggregate of the concatenated batch (padded with masked slots)."""
    parts = _batch(world, dtype)
    width = max(part["mask"].shape[1] for part in parts)
    p = _parameter(dtype)
    values, masks = [], []
    for part in parts:
        # Clean values (no junk) and zero padding: the reference itself never sees a NaN.
        v = torch.tanh(part["features"] @ p) * 2
        pad = width - v.shape[1]
        values.append(torch.nn.functional.pad(v, (0, pad)))
        masks.append(torch.nn.functional.pad(part["mask"], (0, pad)))
    full_values = torch.cat(values)
    full_values.retain_grad()
    result = single_aggregate(full_values, torch.cat(masks), mode)
    result.backward()
    assert p.grad is not None and full_values.grad is not None
    rows = [part["mask"].shape for part in parts]
    starts = [sum(r[0] for r in rows[:k]) for k in range(world)]
    value_grads = [
        full_values.grad[s : s + r[0], : r[1]] for s, r in zip(starts, rows, strict=True)
    ]
    return result.item(), p.grad.tolist(), value_grads


@pytest.mark.parametrize("world", [2, 3])
def test_aggregate_matches_the_concatenated_batch(world: int) -> None:
    results = launch_gloo(_aggregate_worker, world)
    for dtype, tol in ((torch.float64, 1e-12), (torch.float32, 1e-5)):
        for mode in AGGREGATION_MODES:
            value, grad, value_grads = _reference(world, dtype, mode)
            got = [r[(str(dtype), mode)] for r in results]
            where = (world, dtype, mode)
            # The same value on every rank, bit for bit, in the values' dtype.
            assert len({g["value"] for g in got}) == 1, (where, got)
            assert all(g["dtype"] == dtype for g in got)
            assert abs(got[0]["value"] - value) <= tol * max(1.0, abs(value)), (where, value)
            # The DDP average of the parameter gradients is the global gradient.
            for g in got:
                assert torch.allclose(
                    torch.tensor(g["averaged_grad"]), torch.tensor(grad), rtol=tol, atol=tol
                ), (where, g["averaged_grad"], grad)
            # Per rank: W times its slice of the global gradient; exactly 0 at masked slots.
            for rank, g in enumerate(got):
                local_grad = g["values_grad"]
                assert bool(local_grad.isfinite().all()), where
                mask = _batch(world, dtype)[rank]["mask"]
                assert bool((local_grad[~mask] == 0).all()), where
                torch.testing.assert_close(
                    local_grad, world * value_grads[rank], rtol=tol, atol=tol
                )
            assert got[0]["collectives"] == [["all_gather of 6 float64"], []], where
            # The data are uneven enough that aggregating rank by rank and averaging is wrong
            # (token-sum: the average of local sums is the global sum divided by W).
            naive = sum(g["local_value"] for g in got) / world
            assert abs(naive - value) > 1e-3 * max(1.0, abs(value)), (where, naive, value)
    for r in results:
        assert r["all masked"] == (0.0, [0.0] * HIDDEN)
    if world == 2:
        _check_demo(
            DataParallelAggregateDemo(2, "token-mean", DEMO_LENGTHS, [r["demo"] for r in results])
        )


def _check_demo(demo: DataParallelAggregateDemo) -> None:
    first, second = demo.ranks
    assert (first["rows"], first["tokens"], second["rows"], second["tokens"]) == (2, 5, 4, 42)
    assert first["value"] == second["value"]
    assert abs(first["value"] - first["single"]) < 1e-12
    # The mean of the per-rank token-means weighs rank 0's 5 tokens like rank 1's 42.
    naive = (first["local"] + second["local"]) / 2
    assert abs(first["naive"] - naive) < 1e-12 and abs(naive - first["single"]) > 0.1
    assert first["grad_error"] < 1e-12 and first["naive_grad_error"] > 0.1
    table = demo.table().splitlines()
    assert table[0].split()[:4] == ["rank", "rows", "valid", "tokens"]
    assert len(table) == 4
    summary = demo.summary().splitlines()
    assert summary[0].split()[-1] == summary[1].split()[-1] != summary[2].split()[-1]
    assert summary[4].endswith("< 1e-12")


def test_aggregate_demo_rejects_bad_lengths() -> None:
    with pytest.raises(ValueError, match=r"lengths must give.* got \[\[2\], \[\]\]"):
        run_data_parallel_aggregate_demo(lengths=[[2], []])


# --- in this process: a group of one -------------------------------------------------------------


@pytest.fixture
def world_of_one(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> Any:
    """A one-process gloo group through a FileStore, on the loopback interface."""
    from klpen_book.distributed_demo import _loopback_interface

    loopback = _loopback_interface()
    if loopback is not None:
        monkeypatch.setenv("GLOO_SOCKET_IFNAME", loopback)
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0,
                            world_size=1)  # fmt: skip
    try:
        yield
    finally:
        dist.destroy_process_group()


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    shape=st.tuples(st.integers(0, 4), st.integers(0, 5)),
    dtype=st.sampled_from([torch.float64, torch.float32, torch.bfloat16]),
    mode=st.sampled_from(AGGREGATION_MODES),
    seed=st.integers(0, 2**16),
)
def test_group_of_one_is_the_single_process_aggregate(
    world_of_one: None, shape: tuple[int, int], dtype: torch.dtype, mode: str, seed: int
) -> None:
    gen = torch.Generator().manual_seed(seed)
    mask = torch.rand(shape, generator=gen) < 0.5
    clean = torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)
    junk = torch.tensor(JUNK, dtype=dtype)[torch.randint(0, len(JUNK), shape, generator=gen)]
    values = torch.where(mask, clean, junk).requires_grad_()
    got = aggregate(values, mask, mode)
    (grad,) = torch.autograd.grad(got, values)
    reference_values = clean.clone().requires_grad_()
    want = single_aggregate(reference_values, mask, mode)
    (want_grad,) = torch.autograd.grad(want, reference_values)
    assert got.dtype == want.dtype == dtype
    # klpen.distributed sums in float64; the single-process aggregate in the values' dtype.
    tol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    got_value, want_value = got.item(), want.item()
    assert abs(got_value - want_value) <= tol * max(1.0, abs(want_value))
    assert grad.dtype == dtype and bool(grad.isfinite().all())
    assert bool((grad[~mask] == 0).all())
    torch.testing.assert_close(grad, want_grad, rtol=tol, atol=tol)


def test_group_of_one_edge_cases(world_of_one: None) -> None:
    values = torch.tensor([[1.0, 2.0, float("nan")]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0]])
    # No gradient asked: a plain tensor, no graph.
    out = aggregate(values, mask, "token-sum")
    assert not out.requires_grad and float(out) == 3.0
    # +inf at a valid position is a value like any other (the gradient stays finite).
    inf_values = torch.tensor([[1.0, float("inf")]], requires_grad=True)
    out = aggregate(inf_values, torch.ones(1, 2), "token-mean")
    out.backward()
    assert out.item() == float("inf")
    assert inf_values.grad is not None and inf_values.grad.tolist() == [[0.5, 0.5]]
    # Bad input in a group of one raises as in one process, naming the argument.
    with pytest.raises(ValueError, match=r"values must not be NaN at a valid .* \(0, 2\)"):
        aggregate(values, torch.ones(1, 3), "token-mean")
    with pytest.raises(ValueError, match="mode must be one of"):
        aggregate(values, mask, "mean")
    with pytest.raises(TypeError, match=r"group must be a torch\.distributed\.ProcessGroup"):
        aggregate(values, mask, "token-mean", group="world")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"values must be a dense \(strided\) tensor"):
        aggregate(values.to_sparse(), mask, "token-mean")


def test_aggregate_without_a_process_group() -> None:
    assert not dist.is_initialized()
    with pytest.raises(ValueError, match="init_process_group"):
        aggregate(torch.zeros(1, 2), torch.ones(1, 2), "token-mean")
