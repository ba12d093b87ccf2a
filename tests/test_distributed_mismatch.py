"""klpen.distributed.mismatch_metrics on a live gloo group against the single-process metrics.

Three ranks hold tokens of different shapes (a ``(2, 5)`` batch, a ``(7,)`` row, a rank with no
valid token), NaN and ±inf in their masked slots. Every rank must return the single-process
``klpen.mismatch_metrics`` of every rank's valid tokens concatenated, to 1e-12 in float64, as
floats and as tensors; then the refusals (a NaN at a valid position, a bad ``as_tensors``, bands
that differ) raise on every rank, and the group stays in step. One launch runs it all.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from klpen import mismatch_metrics as single_metrics
from klpen.distributed import mismatch_metrics
from klpen.distributed._mismatch import _FIELDS
from klpen.sampling import MismatchSums
from klpen_book.distributed_demo import launch_gloo, record_collectives

WORLD = 3
SHAPES = {0: (2, 5), 1: (7,), 2: (3, 2)}
EMPTY_RANK = 2
JUNK = [float("nan"), float("inf"), float("-inf"), 1e30]
BANDS = [(0.8, 1.25), (0.95, 1.05)]
TOL = 1e-12


def _inputs(rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This rank's (trainer, rollout, mask); junk in the masked slots."""
    gen = torch.Generator().manual_seed(7 + rank)
    shape = SHAPES[rank]
    rollout = -torch.rand(shape, generator=gen, dtype=torch.float64) * 4
    trainer = rollout + torch.randn(shape, generator=gen, dtype=torch.float64) * 0.2
    mask = torch.rand(shape, generator=gen) < 0.7
    if rank == EMPTY_RANK:
        mask[:] = False
    junk = torch.tensor(JUNK, dtype=torch.float64)[torch.randint(0, 4, shape, generator=gen)]
    return torch.where(mask, trainer, junk), torch.where(mask, rollout, junk.flip(-1)), mask


class _HostReads(TorchDispatchMode):
    """Counts the operations that read a tensor on the host (a sync on an accelerator)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func.overloadpacket in (torch.ops.aten._local_scalar_dense, torch.ops.aten.nonzero):
            self.count += 1
        return func(*args, **(kwargs or {}))


def _outcome(call: Any) -> tuple[str, str]:
    try:
        call()
    except Exception as exc:  # every kind is recorded; the parent asserts which
        return type(exc).__name__, str(exc)
    return "no error", ""


def _worker(rank: int, world: int) -> dict[str, Any]:
    warnings.simplefilter("error")
    x, y, m = _inputs(rank)
    out: dict[str, Any] = {}
    for band in BANDS:
        with record_collectives() as calls:
            out[("floats", band)] = mismatch_metrics(x, y, m, band=band)
        out[("collectives", band)] = [str(c) for c in calls]
        tensors = mismatch_metrics(x, y, m, band=band, as_tensors=True)
        out[("tensors", band)] = {k: (v.dtype, v.shape, v.item()) for k, v in tensors.items()}
    out["no token anywhere"] = mismatch_metrics(x, y, torch.zeros_like(m))
    # Host reads: those of the local value checks, plus the failure flag and the band agreement.
    with _HostReads() as distributed:
        mismatch_metrics(x, y, m, as_tensors=True)
    with _HostReads() as local:
        single_metrics(x, y, m, as_tensors=True)
    out["host reads"] = (distributed.count, local.count)
    nan_x = x.clone()
    if rank == 1:
        nan_x[m.nonzero()[0].tolist()] = float("nan")
    out["NaN at a valid position"] = _outcome(lambda: mismatch_metrics(nan_x, y, m))
    flag: Any = "yes" if rank == 0 else True
    out["as_tensors not a bool"] = _outcome(lambda: mismatch_metrics(x, y, m, as_tensors=flag))
    band = (0.5, 2.0) if rank == 2 else (0.8, 1.25)
    out["band differs"] = _outcome(lambda: mismatch_metrics(x, y, m, band=band))
    out["after"] = mismatch_metrics(x, y, m)  # in step after the refusals
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return launch_gloo(_worker, WORLD)


def _concatenated(band: tuple[float, float]) -> dict[str, float]:
    parts = [_inputs(r) for r in range(WORLD)]
    x = torch.cat([p[0][p[2]] for p in parts])
    y = torch.cat([p[1][p[2]] for p in parts])
    result = single_metrics(x, y, torch.ones_like(x), band=band)
    assert isinstance(result, dict)
    return {k: float(v) for k, v in result.items()}


def _close(got: dict[str, Any], want: dict[str, float], where: Any) -> None:
    assert got.keys() == want.keys(), where
    for k, v in want.items():
        assert abs(got[k] - v) <= TOL * max(1.0, abs(v)), (where, k, got[k], v)


def test_metrics_match_the_concatenated_tokens(results: list[dict[str, Any]]) -> None:
    for band in BANDS:
        want = _concatenated(band)
        assert want["tokens"] > 5 and 0 < want["outside_band"] < 1  # the data test something
        for rank, r in enumerate(results):
            floats = r[("floats", band)]
            assert all(type(v) is float for v in floats.values())
            _close(floats, want, (rank, band))
            assert floats == results[0][("floats", band)]  # bit for bit on every rank
            tensors = r[("tensors", band)]
            assert all(d == torch.float64 and s == () for d, s, _ in tensors.values())
            _close({k: v for k, (_, _, v) in tensors.items()}, want, (rank, band, "tensors"))
            assert r[("collectives", band)] == ["all_gather of 12 float64"]
    # The rank without a valid token changes nothing; no token anywhere: every metric 0.
    empty = single_metrics(torch.zeros(0), torch.zeros(0), torch.zeros(0))
    assert isinstance(empty, dict) and set(empty.values()) == {0.0}
    for r in results:
        assert r["no token anywhere"] == empty


def test_host_reads_beyond_the_local_checks(results: list[dict[str, Any]]) -> None:
    # The failure flag of the guard and the band agreement; the statistics are never read.
    for r in results:
        distributed, local = r["host reads"]
        assert distributed == local + 2, r["host reads"]


def test_refusals_raise_on_every_rank(results: list[dict[str, Any]]) -> None:
    for rank, r in enumerate(results):
        kind, message = r["NaN at a valid position"]
        assert kind == "ValueError", (rank, message)
        if rank == 1:
            assert "trainer_logprobs must not be NaN or +inf at a valid position" in message
        else:
            assert "rank(s) [1]" in message and "NaN" in message
        kind, message = r["as_tensors not a bool"]
        assert kind == ("TypeError" if rank == 0 else "ValueError"), (rank, kind)
        assert "as_tensors must be a bool" in message
        assert (rank == 0) != ("rank(s) [0]" in message)
        kind, message = r["band differs"]
        assert kind == "ValueError" and "band must be the same on every rank" in message
        assert message == results[0]["band differs"][1]
        assert "(0.5, 2.0) on rank 2" in message
        _close(r["after"], _concatenated(BANDS[0]), (rank, "after"))


def test_the_fields_are_reduced_once_each() -> None:
    assert sorted(_FIELDS) == sorted(MismatchSums._fields)
    assert len(set(_FIELDS)) == len(_FIELDS)
