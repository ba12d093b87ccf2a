"""No distributed call hangs: a failure on any one rank raises on every rank, promptly.

Table-driven, on live gloo groups of two and three ranks: every case is run once with each rank
in turn as the one that fails (a tensor kind klpen refuses, a bad value, an error injected into
the local kernel on that rank only, tokens that differ from the other ranks'). Every rank must
raise, within a few seconds: the group's own timeout (``GROUP_TIMEOUT_S``) would turn a hang
into a gloo timeout error that takes far longer, and the parent's watchdog
(``join_timeout_s``) kills and fails a run that still does not finish. After each case the
group must still be in step: a correct call made next returns the single-process value.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import klpen.distributed as kd
from klpen import aggregate as single_aggregate
from klpen import full_kl, get_logprobs_for_tokens
from klpen.distributed import _aggregate as data_parallel
from klpen.distributed import _protocol as protocol
from klpen.distributed import _vocab_parallel as vocab_parallel
from klpen_book.distributed_demo import launch_gloo

GROUP_TIMEOUT_S = 30.0  # a collective waiting this long fails (gloo) instead of hanging
CASE_LIMIT_S = 10.0  # every rank must have raised well before that
JOIN_TIMEOUT_S = 300.0  # the watchdog: processes still alive then are killed, the test fails

ROWS, VOCAB = 4, 6


def _inputs(world: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    z = torch.randn(ROWS, VOCAB * world, generator=gen)
    return {
        "z": z,
        "w": z + torch.randn(ROWS, VOCAB * world, generator=gen),
        "tokens": torch.randint(0, VOCAB * world, (ROWS,), generator=gen),
        "values": torch.randn(3, 5, generator=gen, dtype=torch.float64),
        "mask": torch.rand(3, 5, generator=gen) < 0.6,
    }


def _nested(x: torch.Tensor) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "nested tensors are a prototype"
        return torch.nested.nested_tensor([x, x])


def _csr(x: torch.Tensor) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "sparse CSR support is in beta"
        return x.to_sparse_csr()


# Kinds of input refused before the first collective: (name, argument, transform). The
# transform is applied on the failing rank only.
KINDS: list[tuple[str, Callable[[torch.Tensor], Any]]] = [
    ("meta", lambda x: x.to("meta")),
    ("sparse_coo", lambda x: x.to_sparse()),
    ("nested", _nested),
    ("list", lambda x: x.tolist()),
]
FLOAT_KINDS = [
    *KINDS,
    ("sparse_csr", _csr),
    ("mkldnn", lambda x: x.float().to_mkldnn()),
    ("complex", lambda x: x.to(torch.complex64)),
    ("float8_e4m3fn", lambda x: x.to(torch.float8_e4m3fn)),
    ("float8_e5m2", lambda x: x.to(torch.float8_e5m2)),
]
TOKEN_KINDS = [
    *KINDS,
    ("uint16", lambda x: x.to(torch.uint16)),
    ("uint32", lambda x: x.to(torch.uint32)),
    ("uint64", lambda x: x.to(torch.uint64)),
    ("float", lambda x: x.float()),
    ("bool", lambda x: x.bool()),
]


class Injected(RuntimeError):
    """The error a patched kernel raises on the failing rank."""


def _call(function: str, world: int, rank: int, data: dict[str, Any], **kw: Any) -> Any:
    """Call ``function`` with this rank's slice of the inputs in ``data``."""
    cols = slice(VOCAB * rank, VOCAB * (rank + 1))
    z = data.get("z_local", lambda x: x)(data["z"][:, cols])
    if function == "logprobs":
        return kd.vocab_parallel_logprobs(z, data["tokens"], **kw)
    if function == "full_kl":
        w = data.get("w_local", lambda x: x)(data["w"][:, cols])
        return kd.vocab_parallel_full_kl(z, w, **kw)
    return kd.aggregate(data["values"], data["mask"], data.get("mode", "token-mean"), **kw)


# (case name, function, what the failing rank changes, expected type on the failing rank,
#  expected type on the others, a word in every message). "same" in the last-but-one slot:
# the failure is seen alike by every rank (a disagreement), so every rank raises that type.
Change = Callable[[dict[str, Any]], None]
CASES: list[tuple[str, str, Change, str, str, str]] = []


def _set(key: str, transform: Callable[[Any], Any]) -> Change:
    """On the failing rank: ``data[key]`` transformed; for ``z_local`` / ``w_local``, the
    transform is applied to the rank's slice of the logits."""

    def change(data: dict[str, Any]) -> None:
        data[key] = transform if key.endswith("_local") else transform(data[key])

    return change


for kind, transform in FLOAT_KINDS:
    CASES.append((f"logits {kind}", "logprobs", _set("z_local", transform), "TypeError",
                  "ValueError", "local_logits"))  # fmt: skip
    CASES.append((f"policy {kind}", "full_kl", _set("z_local", transform), "TypeError",
                  "ValueError", "local_policy_logits"))  # fmt: skip
    CASES.append((f"reference {kind}", "full_kl", _set("w_local", transform), "TypeError",
                  "ValueError", "local_reference_logits"))  # fmt: skip
    if kind not in ("float8_e4m3fn", "float8_e5m2"):
        CASES.append((f"values {kind}", "aggregate", _set("values", transform), "TypeError",
                      "ValueError", "values"))  # fmt: skip
for kind, transform in TOKEN_KINDS:
    CASES.append((f"tokens {kind}", "logprobs", _set("tokens", transform), "TypeError",
                   "ValueError", "tokens"))  # fmt: skip
# (A meta mask is refused by kind, or as being on another device than the values: either is
# a named error.)
CASES.append(("mask meta", "aggregate", _set("mask", KINDS[0][1]), "TypeError|ValueError",
              "ValueError", "meta"))  # fmt: skip
CASES.append(("mask sparse_coo", "aggregate", _set("mask", KINDS[1][1]), "TypeError",
              "ValueError", "mask"))  # fmt: skip


def _row_nan(x: torch.Tensor) -> torch.Tensor:
    x = x.clone()
    x[0] = float("nan")
    return x


def _first_valid_nan(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    x = x.clone()
    x[mask.nonzero()[0].unbind()] = float("nan")
    return x


CASES += [
    # Bad values that only this rank can see, found after the metadata exchange.
    ("token out of range", "logprobs", _set("tokens", lambda t: t + 10_000), "ValueError",
     "ValueError", "tokens"),
    ("negative token", "logprobs", _set("tokens", lambda t: t - 10_000), "ValueError",
     "ValueError", "tokens"),
    ("tokens on another shape", "logprobs", _set("tokens", lambda t: t[:2]), "ValueError",
     "ValueError", "tokens"),
    ("mask not 0/1", "aggregate", _set("mask", lambda m: m.long() * 2), "ValueError",
     "ValueError", "mask"),
    ("mask shape", "aggregate", _set("mask", lambda m: m[:, :2]), "ValueError", "ValueError",
     "mask"),
    ("values 1-d", "aggregate", _set("values", lambda v: v[0]), "ValueError", "ValueError",
     "values"),
    ("NaN at a valid position", "aggregate",
     lambda d: d.update(values=_first_valid_nan(d["values"], d["mask"])), "ValueError",
     "ValueError", "NaN"),
    ("unknown mode", "aggregate", lambda d: d.update(mode="mean"), "ValueError", "ValueError",
     "mode"),
    # Disagreements: every rank sees the same gathered data and raises the same error.
    ("NaN logits", "logprobs", _set("z_local", _row_nan), "ValueError", "same", "NaN"),
    ("another mode", "aggregate", lambda d: d.update(mode="token-sum"), "ValueError", "same",
     "mode"),
    ("leading shape", "full_kl", _set("z_local", lambda z: z[:2]), "ValueError", "same",
     "shape"),
    ("dtype", "logprobs", _set("z_local", lambda z: z.double()), "ValueError", "same",
     "dtype"),
    # Token disagreements that the former fingerprint (sum, position-weighted sum) let through
    # or that only an exact comparison sees: every rank raises.
    ("rows swapped", "logprobs", _set("tokens", lambda t: t[[1, 0, 2, 3]]), "ValueError",
     "same", "identical"),
    ("one token differs", "logprobs", _set("tokens", lambda t: t.clone().index_fill_(0,
     torch.tensor([2]), int(t[2]) ^ 1)), "ValueError", "same", "identical"),
]  # fmt: skip


def _with_tokens(tokens: list[int]) -> Change:
    return lambda d: d.update(tokens=torch.tensor(tokens))


# Both rows of [1, 3, 1] against [2, 1, 2]: the same sum and the same position-weighted sum
# with weights (1, 2, 3); rows are 3 here, so the tokens are set on every rank (below).
TOKEN_PAIRS = [([1, 3, 1, 0], [2, 1, 2, 0])]

# Errors injected into the local computation on the failing rank only: (case, function,
# name of the attribute patched in the klpen.distributed module that calls it).
INJECTED = [
    ("kernel raises before the max", "logprobs", "exp_sums"),
    ("kernel raises before the sum", "logprobs", "_shifted_exp"),
    ("KL kernel raises before the gather", "full_kl", "kl_row_stats"),
    ("KL slice sums raise before the gather", "full_kl", "_precise_rows"),
    ("aggregate raises in its local sums", "aggregate", "_checked"),
]
PATCHED = {"logprobs": vocab_parallel, "full_kl": vocab_parallel, "aggregate": data_parallel}


def _raising(*args: Any, **kwargs: Any) -> Any:
    raise Injected("injected failure in the local computation")


def _outcome(call: Callable[[], Any]) -> tuple[str, str, float]:
    start = time.monotonic()
    try:
        call()
        kind, message = "no error", ""
    except Exception as exc:  # every kind is recorded; the parent asserts which
        kind, message = type(exc).__name__, str(exc)
    return kind, message, time.monotonic() - start


def _in_step(world: int, rank: int) -> bool:
    """A correct call after a failure returns the single-process value: the group is in step."""
    data = _inputs(world)
    got = _call("logprobs", world, rank, data)
    return bool(torch.allclose(got, get_logprobs_for_tokens(data["z"], data["tokens"])))


def _failures_worker(rank: int, world: int) -> dict[str, Any]:
    warnings.simplefilter("error")  # as pytest does in this process
    results: dict[str, Any] = {}
    for bad in range(world):
        for name, function, change, *_ in CASES:
            data = _inputs(world)
            if rank == bad:
                change(data)
            outcome = _outcome(lambda: _call(function, world, rank, data))  # noqa: B023
            results[(name, bad)] = (*outcome, _in_step(world, rank))
        for first, second in TOKEN_PAIRS:
            data = _inputs(world)
            data["tokens"] = torch.tensor(second if rank == bad else first)
            outcome = _outcome(lambda: _call("logprobs", world, rank, data))  # noqa: B023
            results[("[1, 3, 1] vs [2, 1, 2]", bad)] = (*outcome, _in_step(world, rank))
        for name, function, attribute in INJECTED:
            module = PATCHED[function]
            original = getattr(module, attribute)
            if rank == bad:
                setattr(module, attribute, _raising)
            try:
                data = _inputs(world)
                outcome = _outcome(lambda: _call(function, world, rank, data))  # noqa: B023
            finally:
                setattr(module, attribute, original)
            results[(name, bad)] = (*outcome, _in_step(world, rank))
    # A correct aggregate and full KL after all of it, against the single-process values.
    data = _inputs(world)
    kl = _call("full_kl", world, rank, data)
    results["final full_kl"] = float((kl - full_kl(data["z"], data["w"])).abs().max())
    agg = _call("aggregate", world, rank, data)
    results["final aggregate"] = (float(agg), float(single_aggregate(data["values"],
                                  data["mask"], "token-mean")))  # fmt: skip
    return results


def _check(results: list[dict[str, Any]], world: int) -> int:
    checked = 0
    expected: dict[str, tuple[str, str, str]] = {c[0]: (c[3], c[4], c[5]) for c in CASES}
    expected["[1, 3, 1] vs [2, 1, 2]"] = ("ValueError", "same", "identical")
    for name, _, _ in INJECTED:
        expected[name] = ("Injected", "RuntimeError", "injected failure")
    for bad in range(world):
        for name, (bad_type, other_type, word) in expected.items():
            for rank in range(world):
                kind, message, seconds, in_step = results[rank][(name, bad)]
                where = (name, "failing rank", bad, "this rank", rank, kind, message)
                assert seconds < CASE_LIMIT_S, (*where, seconds)
                assert in_step, where
                assert word in message, where
                if rank == bad or other_type == "same":
                    assert kind in bad_type.split("|"), where
                else:
                    assert kind == other_type, where
                    assert f"rank(s) [{bad}]" in message, where
                checked += 1
    for rank in range(world):
        assert results[rank]["final full_kl"] < 1e-5
        got, want = results[rank]["final aggregate"]
        assert abs(got - want) < 1e-12
    return checked


@pytest.mark.parametrize("world", [2, 3])
def test_every_rank_raises_promptly_whichever_rank_fails(world: int) -> None:
    results = launch_gloo(
        _failures_worker, world, timeout_s=GROUP_TIMEOUT_S, join_timeout_s=JOIN_TIMEOUT_S
    )
    cases = len(CASES) + len(TOKEN_PAIRS) + len(INJECTED)
    assert _check(results, world) == cases * world * world


# --- the exact token comparison, without processes ----------------------------------------------


def _reduce_ids(per_rank: list[torch.Tensor], vocab: int, dtype: torch.dtype) -> torch.Tensor:
    """What the all-reduce (max) of the vocab-parallel forward gives for these ranks' ids."""
    digits, bits = protocol.id_digits(vocab, dtype)
    parts = []
    for ids in per_rank:
        out = torch.empty(2 * digits, ids.numel(), dtype=dtype)
        protocol.write_ids(out, ids, bits)
        parts.append(out)
    return torch.stack(parts).amax(0)


@settings(max_examples=60, deadline=None)
@given(
    vocab=st.sampled_from([2, 1000, 2**24, 2**24 + 3, 2**31, 2**53 + 7]),
    dtype=st.sampled_from([torch.float32, torch.float64]),
    ranks=st.integers(2, 4),
    data=st.data(),
)
def test_exact_token_comparison_raises_iff_ids_differ(
    vocab: int, dtype: torch.dtype, ranks: int, data: st.DataObject
) -> None:
    n = data.draw(st.integers(1, 6))
    ids = st.lists(st.integers(0, vocab - 1), min_size=n, max_size=n)
    first = data.draw(ids)
    per_rank = [torch.tensor(first)]
    for _ in range(ranks - 1):
        same = data.draw(st.booleans())
        per_rank.append(torch.tensor(first if same else data.draw(ids)))
    identical = all(torch.equal(p, per_rank[0]) for p in per_rank)
    reduced = _reduce_ids(per_rank, vocab, dtype)
    if identical:
        protocol.check_same_ids(reduced, torch.Size([n]))
    else:
        with pytest.raises(ValueError, match="tokens must be identical on every rank"):
            protocol.check_same_ids(reduced, torch.Size([n]))


def test_exact_token_comparison_beyond_the_float_mantissa() -> None:
    # 2**24 and 2**24 + 1 are the same fp32 number: a single fp32 digit could not tell them
    # apart; with a vocabulary that large the ids travel as two exact digits.
    vocab = 2**25
    assert protocol.id_digits(vocab, torch.float32) == (2, 24)
    assert protocol.id_digits(2**24, torch.float32) == (1, 24)
    assert protocol.id_digits(2**25, torch.float64) == (1, 53)
    a, b = torch.tensor([2**24]), torch.tensor([2**24 + 1])
    with pytest.raises(ValueError, match=r"ids from 16777216 to 16777217"):
        protocol.check_same_ids(_reduce_ids([a, b], vocab, torch.float32), torch.Size([1]))
    protocol.check_same_ids(_reduce_ids([b, b], vocab, torch.float32), torch.Size([1]))
    # The same pair as one fp32 digit would compare equal: the digits are what makes it exact.
    assert float(torch.tensor(2**24, dtype=torch.float32)) == float(
        torch.tensor(2**24 + 1, dtype=torch.float32)
    )
