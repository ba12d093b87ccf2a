"""klpen.distributed.aggregate with packed rows and the peers' aliases, on live gloo groups.

Three ranks hold uneven sets of sequences: a length-1 sequence, a sequence with no valid token,
a rank whose sequences are all empty; the masked slots hold NaN, ±inf and 1e30. Each layout
(every rank padded; rank 0 padded and ranks 1-2 packed) and each of the nine mode names is
compared with the single-process ``klpen.aggregate`` of every rank's sequences padded into one
batch: the value, the DDP average of a shared parameter's gradients, and each rank's gradient
w.r.t. its values (``W`` times its slice of the global gradient, exactly 0 at masked slots).
One launch runs every case, then the refusals: bad ``sequence_ids`` on one rank only, modes or
``max_length`` that differ between ranks; every rank raises and the group stays in step.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist

from klpen import aggregate as single_aggregate
from klpen.distributed import aggregate
from klpen.masking import AGGREGATION_ALIASES, AGGREGATION_MODES
from klpen_book.distributed_demo import launch_gloo

WORLD = 3
HIDDEN = 3
JUNK = [float("nan"), float("inf"), float("-inf"), 1e30]
LENGTHS = {0: [3, 5], 1: [1, 4, 2, 6], 2: [2, 3]}
EMPTY = {(1, 2), (2, 0), (2, 1)}  # (rank, sequence): no valid token
PAD = {0: 1, 1: 0, 2: 2}  # extra masked columns of a padded rank: widths 6, 6, 5
LAYOUTS = {"padded": (False, False, False), "mixed": (False, True, True)}
L = 8  # max_length where one is given
NAMES = [*AGGREGATION_MODES, *AGGREGATION_ALIASES]
# (name, max_length): the normalised aliases with L, and verl's default where every rank pads
CASES = [(n, L if n in ("dr_grpo", "seq-mean-token-sum-norm") else None) for n in NAMES]
DEFAULT_NORM = ("seq-mean-token-sum-norm", None)
TOL = 1e-10


def _sequences(rank: int) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(100 + rank)
    out = []
    for s, n in enumerate(LENGTHS[rank]):
        features = torch.randn(n, HIDDEN, generator=gen, dtype=torch.float64)
        mask = torch.rand(n, generator=gen) < 0.7
        mask[0] = True
        if (rank, s) in EMPTY:
            mask[:] = False
        junk = torch.tensor(JUNK, dtype=torch.float64)[
            torch.randint(0, len(JUNK), (n,), generator=gen)
        ]
        out.append({"features": features, "mask": mask, "junk": torch.where(mask, 0.0, junk)})
    return out


def _parameter() -> torch.Tensor:
    return torch.tensor([0.5, -1.0, 2.0], dtype=torch.float64, requires_grad=True)


def _clean(seq: dict[str, torch.Tensor], p: torch.Tensor) -> torch.Tensor:
    return torch.tanh(seq["features"] @ p) * 2


def _rank_batch(rank: int, packed: bool, p: torch.Tensor) -> dict[str, Any]:
    """This rank's (values, mask, sequence_ids) and where each sequence lies in them."""
    seqs = _sequences(rank)
    rows = [_clean(s, p) + s["junk"] for s in seqs]
    if packed:
        values = torch.cat(rows)[None]
        mask = torch.cat([s["mask"] for s in seqs])[None]
        ids = torch.cat([torch.full((len(r),), i) for i, r in enumerate(rows)])[None]
        starts = [sum(LENGTHS[rank][:i]) for i in range(len(rows))]
        where = [(0, a, a + len(r)) for a, r in zip(starts, rows, strict=True)]
        return {"values": values, "mask": mask, "ids": ids, "where": where}
    width = max(LENGTHS[rank]) + PAD[rank]
    junk_pad = torch.tensor([float("nan")] * width, dtype=torch.float64)
    values = torch.stack([torch.cat([r, junk_pad[len(r) :]]) for r in rows])
    mask = torch.stack(
        [torch.cat([s["mask"], torch.zeros(width - len(r), dtype=torch.bool)])
         for s, r in zip(seqs, rows, strict=True)]
    )  # fmt: skip
    return {"values": values, "mask": mask, "ids": None, "where": [(b, 0, len(r))
            for b, r in enumerate(rows)]}  # fmt: skip


def _worker(rank: int, world: int) -> dict[str, Any]:
    warnings.simplefilter("error")
    out: dict[str, Any] = {}
    for layout, packing in LAYOUTS.items():
        cases = CASES + ([DEFAULT_NORM] if not any(packing) else [])
        for name, length in cases:
            p = _parameter()
            batch = _rank_batch(rank, packing[rank], p)
            values = batch["values"]
            values.retain_grad()
            result = aggregate(values, batch["mask"], name, sequence_ids=batch["ids"],
                               max_length=length)  # fmt: skip
            result.backward()
            assert p.grad is not None and values.grad is not None
            averaged = p.grad.clone()
            dist.all_reduce(averaged)
            averaged /= world
            grads = [values.grad[b, a:z] for b, a, z in batch["where"]]
            masked_grad = values.grad[~batch["mask"]]
            out[(layout, name, length)] = (result.item(), averaged, grads, masked_grad)
    out["refusals"] = _refusals(rank)
    return out


def _outcome(call: Any) -> tuple[str, str]:
    try:
        call()
    except Exception as exc:  # every kind is recorded; the parent asserts which
        return type(exc).__name__, str(exc)
    return "no error", ""


def _refusals(rank: int) -> dict[str, tuple[str, str]]:
    p = _parameter()
    batch = _rank_batch(rank, True, p)
    v, m, ids = batch["values"], batch["mask"], batch["ids"]
    bad_ids = ids.flip(-1) if rank == 1 else ids  # decreasing: refused as a value check
    got = {
        "bad ids": _outcome(lambda: aggregate(v, m, "grpo", sequence_ids=bad_ids)),
        "ids of another shape": _outcome(
            lambda: aggregate(v, m, "grpo", sequence_ids=ids[:, :-1] if rank == 2 else ids)
        ),
        "alias against its mode": _outcome(
            lambda: aggregate(v, m, "dapo" if rank == 0 else "token-mean", sequence_ids=ids)
        ),
        "max_length differs": _outcome(
            lambda: aggregate(v, m, "dr_grpo", sequence_ids=ids, max_length=L + (rank == 2))
        ),
        "max_length on one rank only": _outcome(
            lambda: aggregate(
                v, m, "dr_grpo", sequence_ids=ids, max_length=None if rank == 0 else L
            )
        ),
    }
    # In step afterwards: a correct call returns the global value on every rank.
    got["after"] = ("value", repr(aggregate(v, m, "token-sum", sequence_ids=ids).item()))
    return got


def _reference(layout: str, name: str, length: int | None) -> tuple[float, Any, list[Any]]:
    """Single-process aggregate of every rank's sequences, padded into one batch."""
    p = _parameter()
    packing = LAYOUTS[layout]
    # The padded width of the concatenation: the widest padded rank's (every rank pads), else
    # the longest sequence.
    width = max(max(LENGTHS[r]) + (0 if packing[r] else PAD[r]) for r in range(WORLD))
    rows, masks = [], []
    for r in range(WORLD):
        for s in _sequences(r):
            v = _clean(s, p)
            rows.append(torch.nn.functional.pad(v, (0, width - len(v))))
            masks.append(torch.nn.functional.pad(s["mask"], (0, width - len(v))))
    values = torch.stack(rows)
    values.retain_grad()
    result = single_aggregate(values, torch.stack(masks), name, max_length=length)
    result.backward()
    assert p.grad is not None and values.grad is not None
    grads = [values.grad[i, :n] for i, n in enumerate(n for r in range(WORLD) for n in LENGTHS[r])]
    return result.item(), p.grad, grads


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    """One launch of the three ranks for every test of this file."""
    return launch_gloo(_worker, WORLD)


def test_packed_and_aliases_match_the_concatenated_batch(results: list[dict[str, Any]]) -> None:
    checked = 0
    for layout, packing in LAYOUTS.items():
        cases = CASES + ([DEFAULT_NORM] if not any(packing) else [])
        for name, length in cases:
            value, grad, grads = _reference(layout, name, length)
            got = [r[(layout, name, length)] for r in results]
            where = (layout, name, length)
            assert len({g[0] for g in got}) == 1, (where, got)  # bit for bit on every rank
            assert abs(got[0][0] - value) <= TOL * max(1.0, abs(value)), (where, got[0][0], value)
            k = 0
            for _, averaged, rank_grads, masked_grad in got:
                torch.testing.assert_close(averaged, grad, rtol=TOL, atol=TOL)
                assert bool((masked_grad == 0).all()), where
                for g in rank_grads:
                    torch.testing.assert_close(g, WORLD * grads[k], rtol=TOL, atol=TOL)
                    k += 1
            checked += 1
    assert checked == 2 * len(CASES) + 1
    # The aliases differ from their klpen modes on this batch (the cases test something).
    by = {n: results[0][("mixed", n, ln)][0] for n, ln in CASES}
    assert by["grpo"] != by["seq-mean-token-mean"]
    assert by["dr_grpo"] != by["seq-mean-token-sum"]
    assert by["dapo"] == by["bnpo"] == by["token-mean"]
    padded_default = results[0][("padded", *DEFAULT_NORM)][0]
    assert padded_default == results[0][("padded", "token-sum", None)][0] / 6  # max_r T_r


def test_refusals_raise_on_every_rank(results: list[dict[str, Any]]) -> None:
    refusals = [r["refusals"] for r in results]
    for rank, got in enumerate(refusals):
        kind, message = got["bad ids"]
        assert kind == "ValueError", (rank, got)
        if rank == 1:
            assert "sequence_ids must be non-decreasing" in message
        else:
            assert "rank(s) [1]" in message and "sequence_ids" in message
        kind, message = got["ids of another shape"]
        assert kind == "ValueError" and "sequence_ids" in message
        assert (rank == 2) != ("rank(s) [2]" in message)
        for case, word in (("alias against its mode", "mode must be the same"),
                           ("max_length differs", "max_length must be the same"),
                           ("max_length on one rank only", "max_length")):  # fmt: skip
            kind, message = got[case]
            assert kind == "ValueError" and word in message, (rank, case, got[case])
    # dr_grpo without max_length is refused locally on rank 0, and the others say so.
    assert "needs max_length" in refusals[0]["max_length on one rank only"][1]
    assert "rank(s) [0]" in refusals[1]["max_length on one rank only"][1]
    # Disagreements are seen alike: the same message on every rank.
    for case in ("alias against its mode", "max_length differs"):
        assert len({r[case] for r in refusals}) == 1, case
    want = sum(
        float(_clean(s, _parameter().detach())[s["mask"]].sum()) for r in range(WORLD) for s in
        _sequences(r)
    )  # fmt: skip
    for got in refusals:
        assert abs(float(got["after"][1]) - want) < 1e-12
