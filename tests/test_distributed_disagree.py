"""Ranks that disagree: every vocab-parallel call raises a ValueError on every rank.

Each case makes one rank (each rank in turn) differ from the others in one thing that must
agree: temperature, a dtype (logits, hidden states, weight, bias), the hidden size, the leading
shape, the announced vocabulary size, the token ids. Every rank must raise a ``ValueError``
whose message names what differs and the two values, within seconds (never a gloo abort, a
hang, or a value returned), and the group must still work afterwards. Live gloo groups of
three ranks; workers return (kind, message, seconds) and the assertions are made here.
"""

from __future__ import annotations

import ast
import inspect
import time
from collections.abc import Callable
from typing import Any

import torch

import klpen
import klpen.distributed as kd
from klpen.distributed import _protocol
from klpen_book.distributed_demo import launch_gloo

WORLD = 3
SIZES = [3, 4, 2]  # uneven slices of a vocabulary of 9
VOCAB = sum(SIZES)
CASE_LIMIT_S = 10.0  # far below the group timeout: a case that waits on a peer fails this


def _data(rank: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    z = torch.randn(2, 3, VOCAB, generator=g)
    w = torch.randn(2, 3, VOCAB, generator=g)
    hidden = torch.randn(2, 3, 8, generator=g)
    weight = torch.randn(VOCAB, 8, generator=g)
    bias = torch.randn(VOCAB, generator=g)
    tokens = torch.randint(0, VOCAB, (2, 3), generator=g)
    start = sum(SIZES[:rank])
    cols = slice(start, start + SIZES[rank])
    return dict(z=z[..., cols], w=w[..., cols], hidden=hidden, weight=weight[cols],
                bias=bias[cols], tokens=tokens, full_z=z, full_w=w, full_weight=weight,
                full_bias=bias)  # fmt: skip


Call = Callable[[dict[str, torch.Tensor], bool], Any]


def _logprobs(d: dict[str, torch.Tensor], odd: bool, **kw: Any) -> Any:
    return kd.vocab_parallel_logprobs(d["z"], d["tokens"], **kw)


def _kl(d: dict[str, torch.Tensor], odd: bool, **kw: Any) -> Any:
    return kd.vocab_parallel_full_kl(d["z"], d["w"], **kw)


def _linear(d: dict[str, torch.Tensor], odd: bool, **kw: Any) -> Any:
    kw.setdefault("local_bias", d["bias"])
    return kd.vocab_parallel_linear_logprobs(d["hidden"], d["weight"], d["tokens"], **kw)


def _with(call: Call, change: Callable[[dict[str, torch.Tensor]], None], **kw: Any) -> Call:
    """``call`` on this rank's data, with ``change`` applied on the odd rank only."""

    def run(d: dict[str, torch.Tensor], odd: bool) -> Any:
        d = dict(d)
        if odd:
            change(d)
        return call(d, odd, **kw)

    return run


def _temperature(call: Call) -> Call:
    return lambda d, odd: call(d, odd, temperature=2.0 if odd else 1.0)


def _set(**values: Callable[[dict[str, torch.Tensor]], Any]) -> Callable[[dict[str, Any]], None]:
    def change(d: dict[str, Any]) -> None:
        d.update({k: f(d) for k, f in values.items()})

    return change


def _swap_token(d: dict[str, torch.Tensor]) -> torch.Tensor:
    t = d["tokens"].clone()
    t[1, 2] = (t[1, 2] + 1) % VOCAB
    return t


F32, F64 = "torch.float32", "torch.float64"
# (case, call, words every rank's message must hold)
CASES: list[tuple[str, Call, list[str]]] = [
    ("logprobs: temperature", _temperature(_logprobs), ["temperature", "1.0", "2.0"]),
    ("logprobs: logits dtype", _with(_logprobs, _set(z=lambda d: d["z"].double())),
     ["local_logits", "same dtype", F32, F64]),
    ("logprobs: leading shape", _with(_logprobs, _set(z=lambda d: d["z"].reshape(3, 2, -1),
     tokens=lambda d: d["tokens"].reshape(3, 2))), ["leading shape", "(2, 3)", "(3, 2)"]),
    ("logprobs: vocab_size", lambda d, odd: _logprobs(d, odd, vocab_size=10 if odd else 9),
     ["vocab_size", "9", "10"]),
    ("logprobs: tokens", _with(_logprobs, _set(tokens=_swap_token)),
     ["tokens must be identical", "1 of 6", "(1, 2)"]),
    ("full_kl: temperature", _temperature(_kl), ["temperature", "1.0", "2.0"]),
    ("full_kl: policy dtype", _with(_kl, _set(z=lambda d: d["z"].double())),
     ["local_policy_logits", "same dtype", F32, F64]),
    ("full_kl: reference dtype", _with(_kl, _set(w=lambda d: d["w"].double())),
     ["local_reference_logits", "same dtype", F32, F64]),
    ("full_kl: leading shape", _with(_kl, _set(z=lambda d: d["z"].reshape(3, 2, -1),
     w=lambda d: d["w"].reshape(3, 2, -1))), ["leading shape", "(2, 3)", "(3, 2)"]),
    ("full_kl: vocab_size", lambda d, odd: _kl(d, odd, vocab_size=10 if odd else 9),
     ["vocab_size", "9", "10"]),
    ("linear: temperature", _temperature(_linear), ["temperature", "1.0", "2.0"]),
    ("linear: hidden dtype", _with(_linear, _set(hidden=lambda d: d["hidden"].double())),
     ["hidden", "same dtype", F32, F64]),
    ("linear: weight dtype", _with(_linear, _set(weight=lambda d: d["weight"].double())),
     ["local_weight", "same dtype", F32, F64]),
    ("linear: bias dtype", _with(_linear, _set(bias=lambda d: d["bias"].double())),
     ["local_bias", "same dtype", F32, F64]),
    ("linear: bias on some ranks only", lambda d, odd: _linear(d, odd,
     local_bias=None if odd else d["bias"]), ["local_bias", "none (not given)", F32]),
    ("linear: hidden size 8 vs 6", _with(_linear, _set(hidden=lambda d: d["hidden"][..., :6],
     weight=lambda d: d["weight"][:, :6])), ["hidden size", "8", "6"]),
    ("linear: leading shape", _with(_linear, _set(hidden=lambda d: d["hidden"].reshape(3, 2, 8),
     tokens=lambda d: d["tokens"].reshape(3, 2))), ["leading shape", "(2, 3)", "(3, 2)"]),
    ("linear: tokens", _with(_linear, _set(tokens=_swap_token)),
     ["tokens must be identical", "(1, 2)"]),
]  # fmt: skip


def _two_fields(d: dict[str, torch.Tensor], odd: bool) -> Any:
    """Temperature and dtype differ at once: the message names both."""
    z = d["z"].double() if odd else d["z"]
    return kd.vocab_parallel_full_kl(z, d["w"], temperature=2.0 if odd else 1.0)


CASES.append(("full_kl: two fields", _two_fields, ["same dtype", "temperature", "2.0", F64]))


def _worker(rank: int, world: int) -> dict[Any, Any]:
    torch.set_num_threads(1)
    data = _data(rank)
    out: dict[Any, Any] = {}
    for odd_rank in range(world):
        for name, call, _ in CASES:
            start = time.monotonic()
            try:
                value = call(data, rank == odd_rank)
                out[(name, odd_rank)] = ("none", repr(value), time.monotonic() - start)
            except Exception as exc:  # any outcome is recorded; the test decides
                out[(name, odd_rank)] = (type(exc).__name__, str(exc), time.monotonic() - start)
    # The group still works, and gives the single-process values.
    t = data["tokens"]
    out["after"] = [
        float((kd.vocab_parallel_logprobs(data["z"], t) -
               klpen.get_logprobs_for_tokens(data["full_z"], t)).abs().max()),
        float((kd.vocab_parallel_full_kl(data["z"], data["w"]) -
               klpen.full_kl(data["full_z"], data["full_w"])).abs().max()),
        float((kd.vocab_parallel_linear_logprobs(data["hidden"], data["weight"], t,
               local_bias=data["bias"]) - klpen.linear_logprobs(data["hidden"],
               data["full_weight"], t, bias=data["full_bias"])).abs().max()),
    ]  # fmt: skip
    return out


def test_ranks_that_disagree_raise_on_every_rank_naming_what_differs() -> None:
    results = launch_gloo(_worker, WORLD, timeout_s=30.0, join_timeout_s=600.0)
    for odd_rank in range(WORLD):
        for name, _, words in CASES:
            messages = set()
            for rank in range(WORLD):
                kind, message, seconds = results[rank][(name, odd_rank)]
                where = (name, "differing rank", odd_rank, "this rank", rank, kind, message)
                assert kind == "ValueError", where
                assert seconds < CASE_LIMIT_S, (*where, seconds)
                for word in words:
                    assert word in message, (*where, word)
                messages.add(message)
            # Decided from the gathered data alone: the same message on every rank, naming
            # the rank that differs (or rank 0 against rank 1 when rank 0 is the odd one).
            assert len(messages) == 1, (name, odd_rank, messages)
            if "tokens" not in name:
                (message,) = messages
                assert f"on rank {max(odd_rank, 1)}" in message, (name, odd_rank, message)
    for rank in range(WORLD):
        assert max(results[rank]["after"]) < 1e-5, results[rank]["after"]


def test_protocol_is_a_leaf_importing_only_validation() -> None:
    tree = ast.parse(inspect.getsource(_protocol))
    relative = {
        node.module
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.level > 0
    }
    absolute = {
        alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
    } | {node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
         and node.level == 0}  # fmt: skip
    assert relative == {"_validation"}, relative
    assert not any(name.startswith("klpen") for name in absolute), absolute


def test_metadata_record_has_no_defaults() -> None:
    # A field left out is an error at the call site, never a default.
    assert _protocol.Metadata._field_defaults == {}
    fields = set(_protocol.Metadata._fields)
    assert {
        "vocab",
        "vocab_size",
        "leading_shape",
        "hidden_size",
        "temperature",
        "dtypes",
    } <= fields
    try:
        _protocol.Metadata(vocab=3, vocab_size=None, leading_shape=(2,), temperature=1.0,
                           dtypes=())  # type: ignore[call-arg]  # fmt: skip
    except TypeError as exc:
        assert "hidden_size" in str(exc)
    else:
        raise AssertionError("Metadata accepted a record without hidden_size")


def test_distributed_package_exports_the_contract_names() -> None:
    # A plain import: an import failure fails here (it is not turned into a skip).
    import klpen.distributed as package

    names = ["aggregate", "mismatch_metrics", "vocab_parallel_full_kl",
             "vocab_parallel_linear_logprobs", "vocab_parallel_logprobs"]  # fmt: skip
    assert sorted(package.__all__) == names
    for name in names:
        assert callable(getattr(package, name)), name
        assert getattr(package, name).__module__.startswith("klpen.distributed."), name
