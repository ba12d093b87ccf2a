"""Packed (padding-free) batches: every packed result equals the padded computation.

The reference of each test is the same function on the same sequences padded into a batch
(left or right), values and gradients to 1e-6, over a table of lengths and EOS placements:
a length-1 sequence first, inside and last, one sequence alone, a sequence with no valid
token. Positions where the packed row crosses from one sequence to the next hold NaN or inf
in the logits; they must reach neither value nor gradient.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import pytest
import torch
from public_calls import ThroughKlpenOps
from torch import Tensor

import klpen
from klpen import (
    aggregate,
    next_token_logprobs,
    response_mask,
    sequence_ids,
    shape_rewards,
)
from klpen.masking import AGGREGATION_ALIASES, AGGREGATION_MODES

V, EOS, PAD = 7, 2, 0


@dataclass(frozen=True)
class Case:
    name: str
    lengths: tuple[int, ...]
    #: per sequence, the positions holding EOS
    eos: tuple[tuple[int, ...], ...]


CASES = [
    Case("three", (4, 3, 5), ((2,), (), (1, 3))),
    Case("length-1 first", (1, 4, 3), ((), (0,), (2,))),
    Case("length-1 inside", (3, 1, 4), ((), (0,), ())),
    Case("length-1 last", (3, 2, 1), ((0,), (), (0,))),
    Case("one sequence", (6,), ((3, 4),)),
    Case("all length 1", (1, 1, 1), ((0,), (), ())),
    Case("eos first everywhere", (2, 3, 2), ((0,), (0,), (0, 1))),
]
IDS = [c.name for c in CASES]


def tokens_of(case: Case, seed: int) -> list[Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for length, eos in zip(case.lengths, case.eos, strict=True):
        t = torch.randint(3, V, (length,), generator=g)
        t[list(eos)] = EOS
        out.append(t)
    return out


def pack_layout(case: Case) -> tuple[Tensor, Tensor, list[int]]:
    """(position_ids (1, total), cu_seqlens (S + 1,) int32, offsets)."""
    pos = torch.cat([torch.arange(n) for n in case.lengths])[None]
    cu = torch.tensor([0, *torch.tensor(case.lengths).cumsum(0).tolist()], dtype=torch.int32)
    return pos, cu, cu[:-1].tolist()


def pad(seqs: list[Tensor], side: str, fill: float | int) -> tuple[Tensor, list[int]]:
    """Stack ``seqs`` (each (l, ...)) into (S, Lmax, ...), and each sequence's first column."""
    width = max(s.shape[0] for s in seqs)
    rows, starts = [], []
    for s in seqs:
        extra = s.new_full((width - s.shape[0], *s.shape[1:]), fill)
        rows.append(torch.cat([s, extra]) if side == "right" else torch.cat([extra, s]))
        starts.append(0 if side == "right" else width - s.shape[0])
    return torch.stack(rows), starts


def packing_kwargs(case: Case, form: str) -> dict[str, Tensor]:
    pos, cu, _ = pack_layout(case)
    return {"position_ids": pos} if form == "position_ids" else {"cu_seqlens": cu}


# --- sequence_ids ---------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_sequence_ids_agree_between_the_conventions(case: Case) -> None:
    pos, cu, _ = pack_layout(case)
    expected = torch.cat([torch.full((n,), i) for i, n in enumerate(case.lengths)])[None]
    assert torch.equal(sequence_ids(position_ids=pos), expected)
    assert torch.equal(sequence_ids(position_ids=pos, total=pos.shape[1]), expected)
    for dtype in (torch.int32, torch.int64):
        got = sequence_ids(cu_seqlens=cu.to(dtype), total=sum(case.lengths))
        assert got.dtype == torch.int64
        assert torch.equal(got, expected)


def test_zero_length_sequences_in_cu_seqlens_keep_their_index() -> None:
    cu = torch.tensor([0, 0, 2, 2, 3, 3])
    assert sequence_ids(cu_seqlens=cu, total=3).tolist() == [[1, 1, 3]]
    assert sequence_ids(cu_seqlens=torch.tensor([0]), total=0).shape == (1, 0)
    assert sequence_ids(position_ids=torch.zeros(1, 0, dtype=torch.long)).shape == (1, 0)


BAD_LAYOUTS: list[tuple[dict[str, object], type[Exception], str]] = [
    ({}, ValueError, "exactly one of position_ids and cu_seqlens, got neither"),
    (
        {"position_ids": torch.tensor([[0, 1]]), "cu_seqlens": torch.tensor([0, 2]), "total": 2},
        ValueError,
        "got both",
    ),
    ({"position_ids": torch.tensor([[1, 2, 0]])}, ValueError, r"position_ids must start at 0"),
    (
        {"position_ids": torch.tensor([[0, 1, 3, 0]])},
        ValueError,
        r"restart at 0 or increase by 1 .* 1 then 3 at index \(0, 2\)",
    ),
    ({"position_ids": torch.tensor([[0, -1]])}, ValueError, "1 then -1|-1"),
    ({"position_ids": torch.tensor([0, 1, 2])}, ValueError, r"shape \(1, total\).*\(3,\)"),
    ({"position_ids": torch.zeros(2, 3, dtype=torch.long)}, ValueError, r"\(2, 3\)"),
    ({"position_ids": torch.tensor([[0.0, 1.0]])}, TypeError, "position_ids must be an int64"),
    ({"position_ids": torch.tensor([[True, False]])}, TypeError, "torch.bool"),
    ({"position_ids": [[0, 1]]}, TypeError, "position_ids must be a torch.Tensor"),
    ({"position_ids": torch.tensor([[0, 1]]), "total": 3}, ValueError, r"shape \(1, 3\)"),
    ({"cu_seqlens": torch.tensor([0, 2, 4])}, ValueError, "total .* is required with cu_seqlens"),
    ({"cu_seqlens": torch.tensor([1, 2, 4]), "total": 4}, ValueError, "must start at 0, got 1"),
    (
        {"cu_seqlens": torch.tensor([0, 3, 2, 4]), "total": 4},
        ValueError,
        "non-decreasing .* 3 then 2 at index 2",
    ),
    ({"cu_seqlens": torch.tensor([0, 2, 3]), "total": 4}, ValueError, "end at the packed length 4"),
    ({"cu_seqlens": torch.tensor([0, 2, 5]), "total": 4}, ValueError, "end at the packed length 4"),
    ({"cu_seqlens": torch.tensor([[0, 2]]), "total": 2}, ValueError, "1-D tensor"),
    ({"cu_seqlens": torch.tensor([], dtype=torch.long), "total": 0}, ValueError, "1-D tensor"),
    ({"cu_seqlens": torch.tensor([0.0, 2.0]), "total": 2}, TypeError, "cu_seqlens must be an int"),
    ({"cu_seqlens": torch.tensor([0, 2]), "total": -1}, ValueError, "total must be non-negative"),
    ({"cu_seqlens": torch.tensor([0, 2]), "total": True}, TypeError, "total must be a Python int"),
    ({"cu_seqlens": torch.tensor([0, 2]), "total": 2.0}, TypeError, "total must be a Python int"),
    (
        {"cu_seqlens": torch.tensor([0, 2]), "total": torch.tensor(2)},
        TypeError,
        "total must be a Python int",
    ),
    (
        {"cu_seqlens": torch.tensor([0, 2], dtype=torch.uint16), "total": 2},
        TypeError,
        "uint16",
    ),
    ({"cu_seqlens": torch.empty(2, device="meta"), "total": 2}, TypeError, "meta"),
]


@pytest.mark.parametrize(("kwargs", "error", "match"), BAD_LAYOUTS)
def test_bad_layouts_are_refused_by_name(
    kwargs: dict[str, object], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        sequence_ids(**kwargs)  # type: ignore[arg-type]


def test_packed_functions_refuse_a_row_that_is_not_one_packed_row() -> None:
    pos = torch.tensor([[0, 1], [0, 1]])
    with pytest.raises(ValueError, match=r"tokens must have shape \(1, total\)"):
        response_mask(torch.ones(2, 2, dtype=torch.long), EOS, position_ids=pos)
    with pytest.raises(ValueError, match=r"input_ids must have shape \(1, total\)"):
        next_token_logprobs(
            torch.zeros(2, 2, V), torch.zeros(2, 2, dtype=torch.long), position_ids=pos
        )
    with pytest.raises(ValueError, match=r"position_ids must have shape \(1, 3\)"):
        response_mask(torch.ones(1, 3, dtype=torch.long), EOS, position_ids=torch.tensor([[0, 1]]))
    with pytest.raises(ValueError, match="end at the packed length 3"):
        response_mask(torch.ones(1, 3, dtype=torch.long), EOS, cu_seqlens=torch.tensor([0, 2]))


# --- next_token_logprobs ------------------------------------------------------------------


POISONS = [math.nan, math.inf, -math.inf, 3e38]


@pytest.mark.parametrize("case", CASES, ids=IDS)
@pytest.mark.parametrize("form", ["position_ids", "cu_seqlens"])
@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_next_token_logprobs_packed_equals_padded(
    case: Case, form: str, side: str, dtype: torch.dtype
) -> None:
    seed = sum(case.lengths) + len(form) + len(side)
    g = torch.Generator().manual_seed(seed)
    toks = tokens_of(case, seed)
    leaves = [
        torch.randn(n, V, generator=g, dtype=dtype).mul_(3).requires_grad_() for n in case.lengths
    ]
    weights = [torch.randn(max(n - 1, 0), generator=g, dtype=torch.float64) for n in case.lengths]
    # The last row of each sequence predicts the next sequence's first token: poison it.
    rows = []
    for i, leaf in enumerate(leaves):
        poison = torch.full((1, V), POISONS[i % len(POISONS)], dtype=dtype)
        rows.append(torch.cat([leaf[:-1], poison + 0 * leaf[-1:]]))
    packed_logits = torch.cat(rows)[None]
    packed_ids = torch.cat(toks)[None]
    out = next_token_logprobs(packed_logits, packed_ids, **packing_kwargs(case, form))
    assert out.shape == (1, sum(case.lengths) - 1)
    assert out.dtype == dtype
    assert torch.isfinite(out).all()
    _, _, offsets = pack_layout(case)
    for off in offsets[1:]:
        assert out[0, off - 1] == 0  # the boundary entry
    wpacked = torch.zeros(out.shape, dtype=torch.float64)
    for off, n, w in zip(offsets, case.lengths, weights, strict=True):
        wpacked[0, off : off + n - 1] = w
    (grads_packed) = torch.autograd.grad((out.double() * wpacked).sum(), leaves, allow_unused=True)

    # The reference: the same sequences padded (pad logits 0, pad token PAD).
    padded_logits, starts = pad([leaf for leaf in leaves], side, 0.0)
    padded_ids, _ = pad(toks, side, PAD)
    ref = next_token_logprobs(padded_logits, padded_ids)
    loss = torch.zeros((), dtype=torch.float64)
    for s, (st, n, w) in enumerate(zip(starts, case.lengths, weights, strict=True)):
        got = out[0, offsets[s] : offsets[s] + n - 1]
        want = ref[s, st : st + n - 1]
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
        loss = loss + (want.double() * w).sum()
    grads_ref = torch.autograd.grad(loss, leaves, allow_unused=True)
    for gp, gr in zip(grads_packed, grads_ref, strict=True):
        gp = torch.zeros_like(gr) if gp is None else gp
        assert torch.isfinite(gp).all()
        torch.testing.assert_close(gp, gr, atol=1e-6, rtol=0)


def test_next_token_logprobs_nan_at_a_valid_row_still_raises() -> None:
    logits = torch.zeros(1, 4, V)
    logits[0, 1, 3] = math.nan  # row 1 predicts token 2, inside the first sequence
    pos = torch.tensor([[0, 1, 2, 0]])
    with pytest.raises(ValueError, match="logits contain NaN"):
        next_token_logprobs(logits, torch.zeros(1, 4, dtype=torch.long), position_ids=pos)
    logits[0, 1, 3] = 0.0
    logits[0, 2] = math.nan  # the boundary row: allowed
    got = next_token_logprobs(logits, torch.zeros(1, 4, dtype=torch.long), position_ids=pos)
    assert got[0, 2] == 0 and torch.isfinite(got).all()


def test_unpacked_next_token_logprobs_is_unchanged() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, V, generator=g, dtype=torch.float64)
    ids = torch.randint(0, V, (2, 5), generator=g)
    ref = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    torch.testing.assert_close(next_token_logprobs(logits, ids), ref)
    # one sequence, packed, is the unpacked computation
    one = next_token_logprobs(logits[:1], ids[:1], position_ids=torch.arange(5)[None])
    torch.testing.assert_close(one, ref[:1])


# --- response_mask ------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=IDS)
@pytest.mark.parametrize("form", ["position_ids", "cu_seqlens"])
@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("include_eos", [True, False])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8])
def test_response_mask_packed_equals_padded(
    case: Case, form: str, side: str, include_eos: bool, dtype: torch.dtype
) -> None:
    toks = [t.to(dtype) for t in tokens_of(case, 3)]
    packed = response_mask(
        torch.cat(toks)[None], EOS, include_eos=include_eos, **packing_kwargs(case, form)
    )
    padded_ids, starts = pad(toks, side, PAD)
    ref = response_mask(padded_ids, EOS, include_eos=include_eos)
    _, _, offsets = pack_layout(case)
    for s, (st, n) in enumerate(zip(starts, case.lengths, strict=True)):
        assert torch.equal(packed[0, offsets[s] : offsets[s] + n], ref[s, st : st + n]), s
    # every sequence starts unmasked (with include_eos, even on an EOS)
    first = packed[0, offsets]
    if include_eos:
        assert first.all()


def test_response_mask_packed_against_a_loop() -> None:
    tokens = torch.tensor([[2, 5, 2, 5, 5, 2, 2, 5, 5]])
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 0, 1]])
    # sequences: [2 5 2] [5 5] [2 2] [5 5]
    assert response_mask(tokens, 2, position_ids=pos).int().tolist() == [
        [1, 0, 0, 1, 1, 1, 0, 1, 1]
    ]
    assert response_mask(tokens, 2, position_ids=pos, include_eos=False).int().tolist() == [
        [0, 0, 0, 1, 1, 0, 0, 1, 1]
    ]
    # without the layout the row is one sequence: everything after the first EOS is masked
    assert response_mask(tokens, 2).int().tolist() == [[1, 0, 0, 0, 0, 0, 0, 0, 0]]


# --- shape_rewards ------------------------------------------------------------------------


def seq_masks(case: Case, toks: list[Tensor], empty: int | None) -> list[Tensor]:
    masks = [response_mask(t[None], EOS)[0] for t in toks]
    if empty is not None:
        masks[empty] = torch.zeros_like(masks[empty])
    return masks


@pytest.mark.parametrize("case", CASES, ids=IDS)
@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_shape_rewards_packed_equals_padded(case: Case, side: str, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(len(case.lengths))
    toks = tokens_of(case, 5)
    masks = seq_masks(case, toks, None)
    kls = [torch.randn(n, generator=g).to(dtype).requires_grad_() for n in case.lengths]
    scores = torch.randn(len(case.lengths), generator=g).to(dtype).requires_grad_()
    ids = sequence_ids(position_ids=pack_layout(case)[0])
    packed_mask = torch.cat(masks)[None]
    # NaN at masked positions of the packed KL: it must reach neither rewards nor gradients
    packed_kl = torch.cat(kls)[None]
    packed_kl = torch.where(packed_mask, packed_kl, math.nan)
    out = shape_rewards(scores, packed_kl, packed_mask, 0.1, sequence_ids=ids)
    w = torch.randn(out.shape, generator=g, dtype=out.dtype)
    gp = torch.autograd.grad((out * w).sum(), [scores, *kls])

    padded_kl, starts = pad([k for k in kls], side, 0.0)
    padded_mask, _ = pad(masks, side, False)
    ref = shape_rewards(scores, padded_kl, padded_mask, 0.1)
    _, _, offsets = pack_layout(case)
    wref = torch.zeros(ref.shape, dtype=ref.dtype)
    for s, (st, n) in enumerate(zip(starts, case.lengths, strict=True)):
        torch.testing.assert_close(
            out[0, offsets[s] : offsets[s] + n], ref[s, st : st + n], atol=1e-6, rtol=0
        )
        wref[s, st : st + n] = w[0, offsets[s] : offsets[s] + n]
    gr = torch.autograd.grad((ref * wref).sum(), [scores, *kls])
    for a, b in zip(gp, gr, strict=True):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_shape_rewards_a_sequence_with_no_valid_token_raises_as_padded_does(case: Case) -> None:
    empty = len(case.lengths) - 1
    toks = tokens_of(case, 5)
    masks = seq_masks(case, toks, empty)
    scores = torch.arange(len(case.lengths), dtype=torch.float32)
    kl = torch.zeros(1, sum(case.lengths))
    ids = sequence_ids(position_ids=pack_layout(case)[0])
    with pytest.raises(ValueError, match=rf"no valid token in sequence {empty} "):
        shape_rewards(scores, kl, torch.cat(masks)[None], 0.1, sequence_ids=ids)
    padded, _ = pad(masks, "right", False)
    with pytest.raises(ValueError, match=rf"no valid token in row {empty} "):
        shape_rewards(scores, torch.zeros(padded.shape), padded, 0.1)


def test_shape_rewards_packed_refuses_ids_beyond_the_scores() -> None:
    ids = torch.tensor([[0, 0, 1, 2]])
    with pytest.raises(ValueError, match=r"must lie in \[0, 2\) .* got 2 at index \(0, 3\)"):
        shape_rewards(torch.zeros(2), torch.zeros(1, 4), torch.ones(1, 4), 0.1, sequence_ids=ids)
    with pytest.raises(ValueError, match=r"scores must have shape \(S,\)"):
        shape_rewards(torch.zeros(2, 1), torch.zeros(1, 4), torch.ones(1, 4), 0.1, sequence_ids=ids)
    with pytest.raises(ValueError, match="sequence_ids must have the shape of"):
        shape_rewards(
            torch.zeros(3), torch.zeros(1, 4), torch.ones(1, 4), 0.1, sequence_ids=ids[:, :3]
        )


# --- aggregate ----------------------------------------------------------------------------

ALL_MODES = (*AGGREGATION_MODES, *AGGREGATION_ALIASES)


def length_for(mode: str) -> dict[str, float]:
    return {"max_length": 8.0} if mode in ("dr_grpo", "seq-mean-token-sum-norm") else {}


@pytest.mark.parametrize("case", CASES, ids=IDS)
@pytest.mark.parametrize("mode", ALL_MODES)
@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("empty", [None, 0])
def test_aggregate_packed_equals_padded(
    case: Case, mode: str, side: str, empty: int | None
) -> None:
    g = torch.Generator().manual_seed(len(mode) + sum(case.lengths))
    toks = tokens_of(case, 7)
    masks = seq_masks(case, toks, empty)
    vals = [torch.randn(n, generator=g, dtype=torch.float64).requires_grad_() for n in case.lengths]
    ids = sequence_ids(cu_seqlens=pack_layout(case)[1], total=sum(case.lengths))
    packed_mask = torch.cat(masks)[None]
    packed = torch.where(packed_mask, torch.cat(vals)[None], math.inf)  # inf at masked slots
    got = aggregate(packed, packed_mask, mode, sequence_ids=ids, **length_for(mode))
    padded, _ = pad([v for v in vals], side, 0.0)
    padded_mask, _ = pad(masks, side, False)
    want = aggregate(padded, padded_mask, mode, **length_for(mode))
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    gp = torch.autograd.grad(got, vals)
    gr = torch.autograd.grad(want, vals)
    for a, b in zip(gp, gr, strict=True):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


def test_aggregate_packed_issue_example() -> None:
    """Issue 20's case: seq-mean over the packed row as one sequence gave 2.167, not 2.0."""
    values = torch.tensor([[1.0, 1.0, 1.0, 3.0, 3.0, 3.0]])
    values[0, :3] = torch.tensor([1.0, 2.0, 3.0])  # sequence means 2 and 3... made explicit:
    values = torch.tensor([[1.0, 1.0, 3.0, 3.0, 3.0, 1.0]])
    ids = sequence_ids(position_ids=torch.tensor([[0, 1, 0, 1, 2, 3]]))
    mask = torch.ones(1, 6)
    # sequences [1, 1] (mean 1) and [3, 3, 3, 1] (mean 2.5): seq-mean 1.75
    assert aggregate(values, mask, "seq-mean-token-mean", sequence_ids=ids).item() == 1.75
    assert aggregate(values, mask, "seq-mean-token-mean").item() == pytest.approx(2.0)
    assert aggregate(values, mask, "seq-mean-token-sum", sequence_ids=ids).item() == 6.0


def test_per_sequence_handles_ids_that_repeat_across_rows_and_skip_values() -> None:
    from klpen.packing import per_sequence

    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True, False], [True, True, True]])
    ids = torch.tensor([[0, 5, 5], [5, 5, 9]])  # a run per row: row 1's 5s are a new sequence
    s = per_sequence(torch.where(mask, values, 0.0), mask, ids, torch.float64)
    assert s.sums[:4].tolist() == [1.0, 2.0, 9.0, 6.0]
    assert s.counts[:4].tolist() == [1.0, 1.0, 2.0, 1.0]
    assert s.sequences.item() == 6 + 10  # each row's last id + 1: the ids index sequences
    assert s.slot is not None and s.slot.tolist() == [[0, 1, 1], [2, 2, 3]]


def test_aggregate_refuses_bad_sequence_ids() -> None:
    x, m = torch.zeros(1, 4), torch.ones(1, 4)
    with pytest.raises(ValueError, match=r"non-decreasing .* got 1 then 0 at index \(0, 2\)"):
        aggregate(x, m, "seq-mean-token-mean", sequence_ids=torch.tensor([[0, 1, 0, 0]]))
    with pytest.raises(ValueError, match="sequence_ids must have the shape of"):
        aggregate(x, m, "token-mean", sequence_ids=torch.tensor([[0, 1, 1]]))
    with pytest.raises(TypeError, match="sequence_ids must be an int64"):
        aggregate(x, m, "token-mean", sequence_ids=torch.zeros(1, 4))
    with pytest.raises(ValueError, match=r"needs max_length=.*packed"):
        aggregate(x, m, "seq-mean-token-sum-norm", sequence_ids=torch.zeros(1, 4, dtype=torch.long))


# --- no host synchronisation in the packed paths, with the value checks off -----------------


class _SyncCounter(ThroughKlpenOps):
    SYNCS: ClassVar[set[str]] = {"_local_scalar_dense", "nonzero", "item", "equal", "is_nonzero"}

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def see(self, func: Any) -> None:
        name = func.overloadpacket.__name__
        if name in self.SYNCS:
            self.seen.append(name)


def _values_unchecked(monkeypatch: pytest.MonkeyPatch) -> None:
    """Stand-in for ``klpen.validation(False)``: the value checks of these modules skipped."""
    import klpen.masking
    import klpen.objective
    import klpen.packing

    for module in (klpen.masking, klpen.objective, klpen.packing):
        for name in ("check_all", "check_no_nan_at"):
            if hasattr(module, name):
                monkeypatch.setattr(module, name, lambda *a, **k: None)


PACKED_CALLS: dict[str, Callable[[], object]] = {
    "sequence_ids(position_ids)": lambda: sequence_ids(
        position_ids=torch.tensor([[0, 1, 0, 1, 2]])
    ),
    "sequence_ids(cu_seqlens)": lambda: sequence_ids(cu_seqlens=torch.tensor([0, 2, 5]), total=5),
    "response_mask(position_ids)": lambda: response_mask(
        torch.tensor([[5, 2, 5, 2, 5]]), 2, position_ids=torch.tensor([[0, 1, 0, 1, 2]])
    ),
    "response_mask(cu_seqlens)": lambda: response_mask(
        torch.tensor([[5, 2, 5, 2, 5]]), 2, cu_seqlens=torch.tensor([0, 2, 5])
    ),
    "shape_rewards": lambda: shape_rewards(
        torch.ones(2, requires_grad=True),
        torch.ones(1, 5, requires_grad=True),
        torch.ones(1, 5, dtype=torch.bool),
        0.1,
        sequence_ids=torch.tensor([[0, 0, 1, 1, 1]]),
    ),
    **{
        f"aggregate {mode}": (
            lambda mode=mode: aggregate(
                torch.ones(1, 5, requires_grad=True),
                torch.ones(1, 5, dtype=torch.bool),
                mode,
                sequence_ids=torch.tensor([[0, 0, 1, 1, 1]]),
                **length_for(mode),
            )
        )
        for mode in ALL_MODES
    },
    "next_token_keep": lambda: __import__("klpen.packing").packing.next_token_keep(
        torch.zeros(1, 5, dtype=torch.long), None, torch.tensor([0, 2, 5])
    ),
}


@pytest.mark.parametrize("name", list(PACKED_CALLS))
def test_packed_paths_make_no_host_sync_with_value_checks_off(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    _values_unchecked(monkeypatch)
    counter = _SyncCounter()
    with counter:
        out = PACKED_CALLS[name]()
        result = out[0] if isinstance(out, tuple) else out
        assert isinstance(result, Tensor)
        if result.requires_grad:
            result.sum().backward()
    assert counter.seen == [], counter.seen


def test_the_sync_counter_sees_a_sync() -> None:
    """The counter is not blind: with the checks on, sequence_ids reads values on the host."""
    counter = _SyncCounter()
    with counter:
        sequence_ids(position_ids=torch.tensor([[0, 1, 0]]))
    assert counter.seen


def test_public_name_exported() -> None:
    assert "sequence_ids" in klpen.__all__
    assert klpen.sequence_ids is sequence_ids


def test_packed_gradient_with_create_graph_is_right_and_second_derivative_refused() -> None:
    logits = torch.randn(1, 5, V, dtype=torch.float64, requires_grad=True)
    ids = torch.randint(0, V, (1, 5), generator=torch.Generator().manual_seed(1))
    pos = torch.tensor([[0, 1, 2, 0, 1]])
    out = next_token_logprobs(logits, ids, position_ids=pos)
    (g1,) = torch.autograd.grad(out.sum(), logits, create_graph=True)
    (g2,) = torch.autograd.grad(next_token_logprobs(logits, ids, position_ids=pos).sum(), logits)
    torch.testing.assert_close(g1.detach(), g2)
    assert (g2[0, 2] == 0).all() and (g2[0, 4] == 0).all()
    with pytest.raises(RuntimeError, match="no second derivative"):
        torch.autograd.grad(g1.sum(), logits)
