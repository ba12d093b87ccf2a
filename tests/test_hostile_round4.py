"""Issue 45, hostile input round four: each case failed before its fix.

1. The float checks (``check_positive``, ``check_coef``) trace with a symbolic float (the
   compile suite calls every public function with a new float each time; here: eager still
   refuses what it refused).
2. Packed ``grpo`` / ``dr_grpo`` count the sequences as the padded batch has rows: an empty
   sequence of ``cu_seqlens`` (middle, leading), a trailing one (``num_sequences``), one whose
   only position the next-token shift drops; single-process and across ranks.
3. Every temperature check of ``klpen.distributed`` is the single-process one.
4. The hidden-state path at 1 and 2 threads: equal to rounding (bitwise equality across thread
   counts is no longer promised, and no docstring says it is).
5. The custom operators, called directly, refuse tensors on different devices and shapes that
   disagree with what their fake implementations promise; their docs say they are internal.
6. ``vocab_parallel_full_kl`` with one extreme logit is as exact as ``full_kl`` (``1e4``: 7e-5
   relative before, ``3e38``: 16 %); out-of-range ids with the value checks off fail loudly in
   ``linear_logprobs`` and the vocab-parallel log-probs, as in ``get_logprobs_for_tokens`` (they
   returned ``-lse``).
"""

from __future__ import annotations

import importlib
import itertools
import math
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import klpen
from klpen import aggregate, sequence_ids
from klpen._validation import check_coef, check_positive
from klpen_book.distributed_demo import launch_gloo

G = torch.Generator().manual_seed(45)


# --- 1. float checks: eager refuses, as before -------------------------------------------------


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, -1.0, 0.0])
def test_eager_float_checks_still_refuse(value: float) -> None:
    with pytest.raises(ValueError, match="temperature must be finite and positive"):
        check_positive("temperature", value)
    if value != 0.0:
        with pytest.raises(ValueError, match="kl_coef must be finite and non-negative"):
            check_coef("kl_coef", value)
    assert check_coef("kl_coef", 0.0) == 0.0 and check_positive("t", 1e-300) == 1e-300


# --- 2. packed GRPO counts empty sequences -----------------------------------------------------


def _trl_grpo(loss: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """TRL's ``grpo`` loss reduction (``GRPOTrainer._compute_loss``)."""
    return ((loss * mask).sum(-1) / mask.sum(-1).clamp(min=1)).mean()


def _trl_dr_grpo(loss: torch.Tensor, mask: torch.Tensor, length: int) -> torch.Tensor:
    return (loss * mask).sum() / (loss.shape[0] * length)


def _padded(lengths: list[int], values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(max(lengths), 1)
    rows, masks, start = [], [], 0
    for n in lengths:
        rows.append(F.pad(values[start : start + n], (0, width - n)))
        masks.append(F.pad(torch.ones(n, dtype=torch.bool), (0, width - n)))
        start += n
    return torch.stack(rows), torch.stack(masks)


def _lengths(cu: list[int]) -> list[int]:
    return [b - a for a, b in itertools.pairwise(cu)]


# cu_seqlens: an empty sequence in the middle, at the start, at the end, two at the end
PACKINGS = [[0, 2, 2, 5], [0, 0, 2, 5], [0, 2, 5, 5], [0, 3, 3, 5, 5, 5]]


@pytest.mark.parametrize("mode", ["grpo", "dr_grpo"])
@pytest.mark.parametrize("cu", PACKINGS, ids=str)
def test_packed_grpo_counts_empty_sequences_as_padded_and_trl(mode: str, cu: list[int]) -> None:
    total = cu[-1]
    lengths = _lengths(cu)
    values = torch.randn(total, generator=G, dtype=torch.float64, requires_grad=True)
    ids = sequence_ids(cu_seqlens=torch.tensor(cu), total=total)
    kwargs: dict[str, Any] = {"max_length": 8} if mode == "dr_grpo" else {}
    got = aggregate(
        values[None], torch.ones(1, total), mode, sequence_ids=ids, num_sequences=len(lengths),
        **kwargs,
    )  # fmt: skip
    padded, mask = _padded(lengths, values)
    want = aggregate(padded, mask, mode, **kwargs)
    trl = _trl_grpo(padded, mask) if mode == "grpo" else _trl_dr_grpo(padded, mask, 8)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
    torch.testing.assert_close(got, trl, rtol=1e-12, atol=0)
    (g_got,) = torch.autograd.grad(got, values)
    (g_want,) = torch.autograd.grad(want, values)
    torch.testing.assert_close(g_got, g_want, rtol=1e-12, atol=0)


def test_the_issue_example_without_num_sequences() -> None:
    """``cu_seqlens = [0, 2, 2, 5]``: 1.8333 as padded and TRL (packed gave 2.75); an index
    that no position holds is an empty sequence, with or without ``num_sequences``."""
    ids = sequence_ids(cu_seqlens=torch.tensor([0, 2, 2, 5]), total=5)
    values = torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0]])
    got = aggregate(values, torch.ones(1, 5), "grpo", sequence_ids=ids)
    assert got.item() == pytest.approx(1.5 / 3 + 4.0 / 3)


def test_next_token_shift_keeps_a_length_one_first_sequence_counted() -> None:
    """The packed next-token log-probs drop position 0: a first sequence of one token has no
    entry left, and its index 0 is still counted (the padded row has no valid token)."""
    lengths = [1, 3, 2]
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    ids = sequence_ids(position_ids=position_ids)[:, 1:]
    keep = ids == sequence_ids(position_ids=position_ids)[:, :-1]  # not a boundary
    values = torch.randn(1, 5, generator=G, dtype=torch.float64)
    got = aggregate(values, keep, "grpo", sequence_ids=ids)
    rows = [values[0, 0:0], values[0, 1:3], values[0, 4:5]]  # each sequence's next tokens
    padded = torch.stack([F.pad(r, (0, 2 - len(r))) for r in rows])
    mask = torch.tensor([[0, 0], [1, 1], [1, 0]], dtype=torch.bool)
    torch.testing.assert_close(got, _trl_grpo(padded, mask), rtol=1e-12, atol=0)


@pytest.mark.parametrize(
    ("num_sequences", "error", "match"),
    [
        (1, ValueError, r"num_sequences must be at least .* \(.*: 3\), got 1"),
        (-1, ValueError, "num_sequences must be non-negative"),
        (2.0, TypeError, "num_sequences must be a Python int"),
        (True, TypeError, "num_sequences must be a Python int"),
    ],
)
def test_num_sequences_is_checked(num_sequences: object, error: type, match: str) -> None:
    ids = torch.tensor([[0, 0, 2, 2]])
    with pytest.raises(error, match=match):
        aggregate(torch.ones(1, 4), torch.ones(1, 4), "grpo", sequence_ids=ids,
                  num_sequences=num_sequences)  # type: ignore[arg-type]  # fmt: skip
    with pytest.raises(ValueError, match="num_sequences is used only with sequence_ids"):
        aggregate(torch.ones(1, 4), torch.ones(1, 4), "grpo", num_sequences=3)
    with pytest.raises(ValueError, match="sequence_ids must be non-negative"):
        aggregate(torch.ones(1, 4), torch.ones(1, 4), "grpo", sequence_ids=ids - 1)


# --- 3 and 6, and 2 across ranks: one launch of three gloo ranks ------------------------------

SIZES = [3, 4, 2]  # uneven vocabulary slices
VOCAB = sum(SIZES)
# (rank's cu_seqlens, num_sequences): an empty sequence in the middle on rank 0, a trailing
# one on rank 1 (given by num_sequences), none on rank 2
RANK_PACKING = {0: ([0, 2, 2, 4], None), 1: ([0, 3, 3, 3], 3), 2: ([0, 1, 3], None)}
EXTREMES = [1e4, 1e30, 3e38, -1e4, 80.0]


def _rank_values(rank: int) -> torch.Tensor:
    return torch.randn(RANK_PACKING[rank][0][-1], generator=torch.Generator().manual_seed(rank))


def _extreme_logits(value: float) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(int(abs(value)) % 1000)
    z = torch.randn(4, VOCAB, generator=g) * 2
    w = z + torch.randn(4, VOCAB, generator=g) * 0.5
    z[0, 1] = value  # in rank 0's slice
    z[1, 5] = value  # in rank 1's slice
    z[2, 8] = value  # in rank 2's slice
    w[3, 4] = value  # the reference's
    return z, w


def _outcome(call: Callable[[], object]) -> tuple[str, str]:
    try:
        call()
    except Exception as exc:  # every kind is recorded; the parent asserts which
        return type(exc).__name__, str(exc)
    return "no error", ""


def _gloo_worker(rank: int, world: int) -> dict[str, Any]:
    warnings.simplefilter("error")
    from klpen import distributed as kd

    out: dict[str, Any] = {}
    cols = slice(sum(SIZES[:rank]), sum(SIZES[: rank + 1]))
    z = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(0))
    tokens = torch.tensor([0, VOCAB - 1])
    hidden = torch.randn(2, 3, generator=torch.Generator().manual_seed(1))
    weight = torch.randn(VOCAB, 3, generator=torch.Generator().manual_seed(2))
    for t in (1e-40, 1e39, 1e-310):
        out["temperature", t] = {
            "vocab_parallel_logprobs": _outcome(
                lambda t=t: kd.vocab_parallel_logprobs(z[:, cols], tokens, temperature=t)
            ),
            "vocab_parallel_full_kl": _outcome(
                lambda t=t: kd.vocab_parallel_full_kl(z[:, cols], z[:, cols], temperature=t)
            ),
            "vocab_parallel_linear_logprobs": _outcome(
                lambda t=t: kd.vocab_parallel_linear_logprobs(
                    hidden, weight[cols], tokens, temperature=t
                )
            ),
        }
    for bad in (VOCAB, -1):
        ids_bad = torch.tensor([0, bad])
        with klpen.validation(False):
            out["out of range", bad] = {
                "vocab_parallel_logprobs": _outcome(
                    lambda t=ids_bad: kd.vocab_parallel_logprobs(z[:, cols], t)
                ),
                "vocab_parallel_linear_logprobs": _outcome(
                    lambda t=ids_bad: kd.vocab_parallel_linear_logprobs(hidden, weight[cols], t)
                ),
            }
    cu, num = RANK_PACKING[rank]
    ids = klpen.sequence_ids(cu_seqlens=torch.tensor(cu), total=cu[-1])
    for mode in ("grpo", "dr_grpo"):
        values = _rank_values(rank)[None].requires_grad_()
        length = {"max_length": 6} if mode == "dr_grpo" else {}
        result = kd.aggregate(values, torch.ones_like(values), mode, sequence_ids=ids,
                              num_sequences=num, **length)  # fmt: skip
        result.backward()
        assert values.grad is not None
        out["aggregate", mode] = (result.item(), values.grad[0] / world)
    for value in EXTREMES:
        zx, wx = _extreme_logits(value)
        out["extreme", value] = vocab_kl = kd.vocab_parallel_full_kl(zx[:, cols], wx[:, cols])
        assert vocab_kl.dtype == torch.float32
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return launch_gloo(_gloo_worker, len(SIZES), join_timeout_s=300.0)


def test_vocab_parallel_temperatures_are_refused_by_name(ranks: list[dict[str, Any]]) -> None:
    for rank, out in enumerate(ranks):
        for t in (1e-40, 1e39, 1e-310):
            for name, (kind, message) in out["temperature", t].items():
                assert kind == "ValueError", (rank, t, name, kind, message)
                assert message.startswith("temperature must be finite and positive"), message


def test_vocab_parallel_out_of_range_ids_fail_loudly_with_checks_off(
    ranks: list[dict[str, Any]],
) -> None:
    """With the value checks off an id that no rank's slice holds gave ``-logsumexp``; now the
    reduced ids that every rank compares are range-checked too: every rank raises."""
    for rank, out in enumerate(ranks):
        for bad in (VOCAB, -1):
            for name, (kind, message) in out["out of range", bad].items():
                assert kind == "ValueError", (rank, bad, name, kind, message)
                assert message.startswith(f"tokens must lie in [0, {VOCAB})"), message


def test_packed_grpo_across_ranks_counts_empty_sequences(ranks: list[dict[str, Any]]) -> None:
    lengths = [n for r in range(len(SIZES)) for n in _lengths(RANK_PACKING[r][0])]
    values = torch.cat([_rank_values(r) for r in range(len(SIZES))]).requires_grad_()
    padded, mask = _padded(lengths, values)
    for mode in ("grpo", "dr_grpo"):
        want = _trl_grpo(padded, mask) if mode == "grpo" else _trl_dr_grpo(padded, mask, 6)
        (grad,) = torch.autograd.grad(want, values)
        got = [out["aggregate", mode] for out in ranks]
        assert len({v for v, _ in got}) == 1 and got[0][0] == pytest.approx(want.item(), rel=1e-6)
        torch.testing.assert_close(torch.cat([g for _, g in got]), grad, rtol=1e-6, atol=1e-9)


def test_vocab_parallel_full_kl_with_one_extreme_logit(ranks: list[dict[str, Any]]) -> None:
    for value in EXTREMES:
        z, w = _extreme_logits(value)
        lz, lw = F.log_softmax(z.double(), -1), F.log_softmax(w.double(), -1)
        want = torch.where(lz.exp() == 0, 0.0, lz.exp() * (lz - lw)).sum(-1)
        single = klpen.full_kl(z, w).double()
        for out in ranks:
            got = out["extreme", value].double()
            assert torch.equal(got, ranks[0]["extreme", value])
            rel = ((got - want).abs() / want).max().item()
            assert rel <= 1e-6, (value, rel, ((single - want).abs() / want).max().item())


# --- 4. threads ----------------------------------------------------------------------------


def test_a_single_task_hidden_state_pass_at_one_and_two_threads() -> None:
    """One pass of one task (a few rows, a vocabulary of one tile): equal to rounding at 1
    and 2 threads (bitwise equality across thread counts is not promised)."""
    hidden = torch.randn(64, 256, generator=G)
    weight = torch.randn(3000, 256, generator=G) * 0.05
    tokens = torch.randint(0, 3000, (64,), generator=G)
    threads = torch.get_num_threads()
    results = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            results.append(klpen.linear_logprobs(hidden, weight, tokens))
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(results[0], results[1], rtol=1e-6, atol=1e-6)
    want = torch.log_softmax(hidden.double() @ weight.double().T, -1).gather(-1, tokens[:, None])
    torch.testing.assert_close(results[1].double(), want[:, 0], rtol=1e-5, atol=1e-5)


CLAIMS = (
    "the same at any thread count",
    "the same bits at any thread count",
    "bitwise the one-thread result",
)


@pytest.mark.parametrize(
    "function",
    [
        klpen.linear_logprobs,
        klpen.linear_full_kl,
        klpen.get_logprobs_for_tokens,
        klpen.full_kl,
        klpen.token_entropy,
    ],
)
def test_no_docstring_promises_the_same_bits_at_any_thread_count(function: Any) -> None:
    doc = " ".join((function.__doc__ or "").split())
    for claim in CLAIMS:
        assert claim not in doc, (function.__name__, claim)


def test_the_readme_and_unreleased_changelog_promise_no_such_bits() -> None:
    root = Path(__file__).resolve().parents[1]
    readme = " ".join((root / "README.md").read_text().split())
    changelog = (root / "CHANGELOG.md").read_text()
    unreleased = " ".join(changelog.split("## [Unreleased]")[1].split("\n## [")[0].split())
    for claim in CLAIMS:
        assert claim not in readme and claim not in unreleased, claim


# --- 5. the custom operators, called directly ---------------------------------------------

OPS = torch.ops.klpen
LOGITS, TOKENS = torch.randn(3, 5, generator=G), torch.randint(0, 5, (3,), generator=G)
HIDDEN, WEIGHT = torch.randn(3, 4, generator=G), torch.randn(5, 4, generator=G)
META = "meta"
BOOL = torch.bool
SAMPLER = (1.0, None, None, None, None, None, None, None)


def _token_logprobs(logits: Any, tokens: Any, keep: Any = None) -> Any:
    return OPS.token_logprobs(logits, tokens, keep, False, 1.0, False, "torch", True, "x")


def _sampler(logits: Any, tokens: Any, rows: int = 3, steps: int = 1) -> Any:
    return OPS.sampler_logprobs(logits, tokens, None, None, *SAMPLER, rows, steps, 0)


DIRECT_CALLS = [
    ("token_logprobs meta logits", lambda: _token_logprobs(LOGITS.to(META), TOKENS), "device"),
    ("token_logprobs meta tokens", lambda: _token_logprobs(LOGITS, TOKENS.to(META)), "device"),
    (
        "token_logprobs keep (N, 1)",
        lambda: _token_logprobs(LOGITS, TOKENS, torch.ones(3, 1, dtype=BOOL)),
        "keep must have shape",
    ),
    (
        "token_logprobs keep not bool",
        lambda: _token_logprobs(LOGITS, TOKENS, torch.ones(3)),
        "keep must be a bool",
    ),
    (
        "token_logprobs tokens",
        lambda: _token_logprobs(LOGITS, TOKENS[:2]),
        "tokens must have shape",
    ),
    (
        "full_kl meta",
        lambda: OPS.full_kl(LOGITS.to(META), LOGITS, 1.0, "torch", True, "x"),
        "device",
    ),
    (
        "full_kl shape",
        lambda: OPS.full_kl(LOGITS, LOGITS[:2], 1.0, "torch", True, "x"),
        "reference must have shape",
    ),
    (
        "full_kl 0-d",
        lambda: OPS.full_kl(LOGITS[0, 0], LOGITS[0, 0], 1.0, "torch", True, "x"),
        "at least 1 dimension",
    ),
    (
        "linear_logprobs meta",
        lambda: OPS.linear_logprobs(
            HIDDEN.to(META), WEIGHT, None, TOKENS, 1.0, False, False, True, "x", "torch"
        ),
        "device",
    ),
    (
        "linear_logprobs weight",
        lambda: OPS.linear_logprobs(
            HIDDEN, WEIGHT[:, :3], None, TOKENS, 1.0, False, False, True, "x", "torch"
        ),
        "weight must have shape",
    ),
    (
        "linear_logprobs bias",
        lambda: OPS.linear_logprobs(
            HIDDEN, WEIGHT, torch.zeros(4), TOKENS, 1.0, False, False, True, "x", "torch"
        ),
        "bias must have shape",
    ),
    (
        "linear_full_kl meta",
        lambda: OPS.linear_full_kl(
            HIDDEN, WEIGHT, None, HIDDEN.to(META), WEIGHT, None, 1.0, True, "x", "torch"
        ),
        "device",
    ),
    (
        "linear_full_kl ref rows",
        lambda: OPS.linear_full_kl(
            HIDDEN, WEIGHT, None, HIDDEN[:2], WEIGHT, None, 1.0, True, "x", "torch"
        ),
        "ref_hidden must have shape",
    ),
    ("sampler rows -1", lambda: _sampler(LOGITS, TOKENS, rows=-1), "rows and steps must be >= 1"),
    ("sampler steps 2", lambda: _sampler(LOGITS, TOKENS, steps=2), "steps=2 must divide"),
    ("sampler meta", lambda: _sampler(LOGITS.to(META), TOKENS), "device"),
    (
        "full_kl_backward grad",
        lambda: OPS.full_kl_backward(
            LOGITS, LOGITS, [], torch.ones(2), 1.0, "torch", True, [True, False], "x"
        ),
        "grad must have shape",
    ),
]


@pytest.mark.parametrize(("call", "match"), [pytest.param(c, m, id=i) for i, c, m in DIRECT_CALLS])
def test_custom_operators_refuse_disagreeing_arguments(
    call: Callable[[], object], match: str
) -> None:
    with pytest.raises(ValueError, match=f"klpen's internal operator klpen::.*{match}"):
        call()


def test_custom_operators_say_they_are_internal() -> None:
    full_kl, linear, logprobs, sampling = (
        importlib.import_module(f"klpen.{m}") for m in ("full_kl", "linear", "logprobs", "sampling")
    )
    ops = [
        logprobs._token_logprobs, logprobs._token_logprobs_backward, full_kl._full_kl,
        full_kl._full_kl_backward, linear._linear_logprobs, linear._linear_logprobs_backward,
        linear._linear_full_kl, linear._linear_full_kl_backward, sampling._sampler_logprobs,
        sampling._sampler_logprobs_backward,
    ]  # fmt: skip
    for op in ops:
        assert op.__doc__.startswith("Internal operator of klpen (klpen::"), op
        assert "not a public API" in op.__doc__


# --- 6. out-of-range ids with the value checks off ------------------------------------------


@pytest.mark.parametrize("bad", [5, -1, 100])
def test_out_of_range_ids_fail_loudly_with_checks_off(bad: int) -> None:
    tokens = torch.tensor([0, bad, 1])
    with klpen.validation(False):
        with pytest.raises(RuntimeError, match="out of bounds"):
            klpen.get_logprobs_for_tokens(LOGITS, tokens)
        with pytest.raises(RuntimeError, match=r"tokens must lie in \[0, 5\)"):
            klpen.linear_logprobs(HIDDEN, WEIGHT, tokens)
    with pytest.raises(ValueError, match=r"tokens must lie in \[0, 5\)"):  # checks on
        klpen.linear_logprobs(HIDDEN, WEIGHT, tokens)
