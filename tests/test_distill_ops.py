"""The internal operators of klpen.distill (``torch.ops.klpen.*``), called directly.

Their arguments are the validated inputs of the kernels; what they can check without reading a
value (devices, the shapes their fake implementations promise) they check, raising a
``ValueError`` that names the operator and the argument (as the other operators do:
tests/test_hostile_round4.py).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

import pytest
import torch

import klpen

OPS = torch.ops.klpen
META = torch.device("meta")
Z = torch.randn(3, 5)
W = torch.randn(3, 5)
SH, SW = torch.randn(3, 4), torch.randn(5, 4)
TH, TW = torch.randn(3, 6), torch.randn(5, 6)
IDS = torch.tensor([[0, 1], [2, 3], [4, 0]])
T_MIN, TAIL = torch.full((3,), 0.1), torch.full((3,), 0.3)


def _linear(**change: torch.Tensor | None) -> object:
    args: dict[str, torch.Tensor | None] = {
        "sh": SH,
        "sw": SW,
        "th": TH,
        "tw": TW,
        "sb": None,
        "tb": None,
    }
    args.update(change)
    return OPS.linear_generalized_jsd(*args.values(), 1.0, 0.5, True, "x")


def _linear_backward(
    grad: torch.Tensor, needs: list[bool], saved: list[torch.Tensor] | None = None
) -> object:
    saved = [torch.zeros(3, 6)] if saved is None else saved
    return OPS.linear_generalized_jsd_backward(
        SH, SW, TH, TW, None, None, saved, grad, 1.0, 0.5, True, needs, "x"
    )


def _tail(logits: torch.Tensor = Z, ids: torch.Tensor = IDS, **change: torch.Tensor) -> object:
    t_min, tail = change.get("t_min", T_MIN), change.get("tail_t", TAIL)
    return OPS.topk_tail_bound(logits, ids, t_min, tail, 1.0, True, "x")


DIRECT_CALLS: list[tuple[str, Callable[[], object], str]] = [
    (
        "jsd meta",
        lambda: OPS.generalized_jsd(Z, W.to(META), 1.0, 0.5, "torch", True, "x"),
        "generalized_jsd: every tensor must be on one device",
    ),
    (
        "jsd teacher shape",
        lambda: OPS.generalized_jsd(Z, W[:2], 1.0, 0.5, "torch", True, "x"),
        "generalized_jsd: teacher must have shape",
    ),
    (
        "jsd teacher vocabulary",
        lambda: OPS.generalized_jsd(Z, W[:, :4], 1.0, 0.5, "torch", True, "x"),
        "generalized_jsd: teacher must have shape",
    ),
    (
        "jsd 0-d",
        lambda: OPS.generalized_jsd(Z[0, 0], W[0, 0], 1.0, 0.5, "torch", True, "x"),
        "generalized_jsd: student must have at least 1 dimension",
    ),
    (
        "jsd backward grad",
        lambda: OPS.generalized_jsd_backward(
            Z, W, [], torch.ones(2), 1.0, 0.5, "torch", True, [True, False], "x"
        ),
        "generalized_jsd_backward: grad must have shape",
    ),
    (
        "jsd backward teacher",
        lambda: OPS.generalized_jsd_backward(
            Z, W[:, :2], [], torch.ones(3), 1.0, 0.5, "torch", True, [True, False], "x"
        ),
        "generalized_jsd_backward: teacher must have shape",
    ),
    (
        "jsd backward needs",
        lambda: OPS.generalized_jsd_backward(
            Z, W, [], torch.ones(3), 1.0, 0.5, "torch", True, [True], "x"
        ),
        "generalized_jsd_backward: needs must have 2 entries",
    ),
    (
        "jsd backward meta grad",
        lambda: OPS.generalized_jsd_backward(
            Z, W, [], torch.ones(3, device=META), 1.0, 0.5, "torch", True, [True, False], "x"
        ),
        "generalized_jsd_backward: every tensor must be on one device",
    ),
    (
        "linear meta",
        lambda: _linear(th=TH.to(META)),
        "linear_generalized_jsd: every tensor must be on one device",
    ),
    ("linear sh 1-d", lambda: _linear(sh=SH[0]), "linear_generalized_jsd: sh must have 2"),
    ("linear sw", lambda: _linear(sw=SW[:, :3]), "linear_generalized_jsd: sw must have shape"),
    ("linear th rows", lambda: _linear(th=TH[:2]), "linear_generalized_jsd: th must have shape"),
    ("linear tw vocab", lambda: _linear(tw=TW[:4]), "linear_generalized_jsd: tw must have shape"),
    ("linear tw hidden", lambda: _linear(tw=SW), "linear_generalized_jsd: tw must have shape"),
    (
        "linear sb",
        lambda: _linear(sb=torch.zeros(4)),
        "linear_generalized_jsd: sb must have shape",
    ),
    (
        "linear tb",
        lambda: _linear(tb=torch.zeros(6)),
        "linear_generalized_jsd: tb must have shape",
    ),
    (
        "linear backward grad",
        lambda: _linear_backward(torch.ones(2), [True] * 6),
        "linear_generalized_jsd_backward: grad must have shape",
    ),
    (
        "linear backward needs",
        lambda: _linear_backward(torch.ones(3), [True] * 4),
        "linear_generalized_jsd_backward: needs must have 6 entries",
    ),
    (
        "linear backward saved",
        lambda: _linear_backward(torch.ones(3), [True] * 6, []),
        "linear_generalized_jsd_backward: saved must hold 1 tensor",
    ),
    (
        "linear backward saved shape",
        lambda: _linear_backward(torch.ones(3), [True] * 6, [torch.zeros(2, 6)]),
        r"linear_generalized_jsd_backward: saved\[0\] must have shape",
    ),
    (
        "topk meta",
        lambda: OPS.topk_logprobs(Z, IDS.to(META), 1.0, "x"),
        "topk_logprobs: every tensor must be on one device",
    ),
    (
        "topk ids rows",
        lambda: OPS.topk_logprobs(Z, IDS[:2], 1.0, "x"),
        "topk_logprobs: ids must have shape",
    ),
    (
        "topk ids 1-d",
        lambda: OPS.topk_logprobs(Z, IDS[0], 1.0, "x"),
        "topk_logprobs: ids must have shape",
    ),
    (
        "topk ids dtype",
        lambda: OPS.topk_logprobs(Z, IDS.int(), 1.0, "x"),
        "topk_logprobs: ids must be int64",
    ),
    (
        "topk backward grad",
        lambda: OPS.topk_logprobs_backward(Z, IDS, torch.ones(3, 2), 1.0, "x"),
        "topk_logprobs_backward: grad must have shape",
    ),
    (
        "topk backward meta",
        lambda: OPS.topk_logprobs_backward(Z.to(META), IDS, torch.ones(3, 3), 1.0, "x"),
        "topk_logprobs_backward: every tensor must be on one device",
    ),
    (
        "tail meta",
        lambda: _tail(t_min=T_MIN.to(META)),
        "topk_tail_bound: every tensor must be on one device",
    ),
    ("tail ids rows", lambda: _tail(ids=IDS[:2]), "topk_tail_bound: ids must have shape"),
    (
        "tail ids wider than the vocabulary",
        lambda: _tail(ids=torch.zeros(3, 6, dtype=torch.long)),
        "topk_tail_bound: ids must give at most 5",
    ),
    ("tail t_min", lambda: _tail(t_min=T_MIN[:2]), "topk_tail_bound: t_min must have shape"),
    ("tail tail_t", lambda: _tail(tail_t=TAIL[:1]), "topk_tail_bound: tail_t must have shape"),
    (
        "tail backward grad",
        lambda: OPS.topk_tail_bound_backward(Z, torch.ones(2), "x"),
        "topk_tail_bound_backward: grad must have shape",
    ),
]


@pytest.mark.parametrize(("call", "match"), [pytest.param(c, m, id=i) for i, c, m in DIRECT_CALLS])
def test_distill_operators_refuse_disagreeing_arguments(
    call: Callable[[], object], match: str
) -> None:
    with pytest.raises(ValueError, match=f"klpen's internal operator klpen::{match}"):
        call()


def test_distill_operators_say_they_are_internal() -> None:
    distill = importlib.import_module("klpen.distill")
    ops = [
        distill._jsd_op, distill._jsd_backward_op, distill._linear_jsd_op,
        distill._linear_jsd_backward_op, distill._topk_logprobs_op,
        distill._topk_logprobs_backward_op, distill._tail_bounds_op,
    ]  # fmt: skip
    for op in ops:
        assert op.__doc__.startswith("Internal operator of klpen (klpen::"), op
        assert "not a public API" in op.__doc__


def test_distill_operators_agree_with_the_public_functions() -> None:
    """Called directly with agreeing arguments, the operators give the public values."""
    out, saved = OPS.generalized_jsd(Z, W, 1.0, 0.5, "torch", True, "x")
    torch.testing.assert_close(out, klpen.generalized_jsd(Z, W))
    grad = OPS.generalized_jsd_backward(
        Z, W, saved, torch.ones(3), 1.0, 0.5, "torch", True, [True, False], "x"
    )[0]
    z = Z.clone().requires_grad_()
    klpen.generalized_jsd(z, W).sum().backward()  # type: ignore[no-untyped-call]
    torch.testing.assert_close(grad, z.grad)
    out, _ = OPS.linear_generalized_jsd(SH, SW, TH, TW, None, None, 1.0, 0.5, True, "x")
    torch.testing.assert_close(out, klpen.linear_generalized_jsd(SH, SW, TH, TW))
    logp = OPS.topk_logprobs(Z, IDS, 1.0, "x")  # the ids' log-probs, then the tail's log-mass
    log_s = torch.log_softmax(Z, -1)
    tail = torch.logsumexp(log_s.scatter(-1, IDS, -torch.inf), -1, keepdim=True)
    torch.testing.assert_close(logp, torch.cat((log_s.gather(-1, IDS), tail), -1))
    assert _tail().shape == (3,)  # type: ignore[attr-defined]
