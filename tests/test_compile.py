"""Every public tensor function inside ``torch.compile`` (contract section 7).

A loss over each function of ``public_calls.CASES`` is compiled in default mode and with
``fullgraph=True`` (where any graph break is an error), on the CPU with two torch threads,
and run three times, the tensor inputs changing between calls and each call passing a
different Python float (a temperature, a coefficient, a bound; from the second value on, the
compiler traces it as a symbolic float, which every check of klpen must trace too): each
call's value and gradients must equal eager's on the same inputs. The kernels are torch
custom operators, so the compiler traces around them; inside the compiled region the value
checks are off. Then the steps a trainer compiles: a packed GRPO loss built on klpen, and a
PPO loss whose coefficient an ``AdaptiveKLController`` changes at every step.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator

import pytest
import torch
from public_calls import CASES, LEAVES, REF_LOGP, sum_of
from torch import Tensor

import klpen

# Compilation is tested with the pinned torch. The oldest supported torch (2.4.1, `make
# torch-floor`) compiles most of these too, but its own compiler fails on the packed step:
# inductor emits C++ that does not build (a VecMask blend).
pytestmark = pytest.mark.skipif(
    tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) < (2, 13),
    reason="torch.compile is tested with torch >= 2.13 (torch 2.4's compiler fails itself)",
)


@pytest.fixture(autouse=True)
def _two_threads_fresh_compiler() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    torch._dynamo.reset()
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        torch._dynamo.reset()


def _value_and_grads(loss_fn: Callable[[], Tensor], leaves: tuple[Tensor, ...]) -> list[Tensor]:
    for leaf in leaves:
        leaf.grad = None
    loss = loss_fn()
    if loss.requires_grad:
        loss.backward()
    return [loss.detach(), *(torch.zeros(0) if x.grad is None else x.grad for x in leaves)]


def _perturb(step: int) -> None:
    """New input values for the next call (the same shapes: no recompilation needed)."""
    with torch.no_grad():
        for i, leaf in enumerate(LEAVES):
            leaf.add_(torch.sin(torch.arange(leaf.numel()).view(leaf.shape) + step + i) * 0.1)


#: the Python float of each of the three calls: a different one each time (exact binary
#: fractions, so that 8.0 * s is a whole max_length)
FLOATS = (1.0, 1.25, 1.5)


def _three_calls_equal_eager(loss_fn: Callable[[float], Tensor], fullgraph: bool) -> None:
    compiled = torch.compile(loss_fn, fullgraph=fullgraph)
    saved = [leaf.detach().clone() for leaf in LEAVES]
    try:
        for step, s in enumerate(FLOATS):
            expected = _value_and_grads(lambda s=s: loss_fn(s), LEAVES)
            got = _value_and_grads(lambda s=s: compiled(s), LEAVES)
            for a, b in zip(got, expected, strict=True):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
            _perturb(step)
    finally:
        with torch.no_grad():
            for leaf, value in zip(LEAVES, saved, strict=True):
                leaf.copy_(value)


@pytest.mark.parametrize("fullgraph", [False, True], ids=["default", "fullgraph"])
@pytest.mark.parametrize("call", [pytest.param(call, id=name) for name, call in CASES])
def test_compiled_calls_equal_eager(call: Callable[..., object], fullgraph: bool) -> None:
    _three_calls_equal_eager(lambda s: sum_of(call(s)), fullgraph)


@pytest.mark.parametrize("fullgraph", [False, True], ids=["default", "fullgraph"])
@pytest.mark.parametrize("call", [pytest.param(call, id=name) for name, call in CASES])
def test_compiled_calls_equal_eager_with_the_float_used_elsewhere(
    call: Callable[..., object], fullgraph: bool
) -> None:
    """The float of the call is also used by another tensor operation of the graph, which keeps
    it an input of the compiled graph, symbolic also where klpen computes from it (``1 / T``).
    klpen's operators took such a symbolic float, torch specialised it with a guard only, and
    the graph compiled for the second float came back from torch's graph caches for the third,
    computing with the second float, silently: the third call of ``get_logprobs_for_tokens(
    logits, tokens, temperature=0.9 * s)`` beside ``logits / (0.9 * s)`` gave the log-probs of
    the second temperature. The caches are on here, as by default, whatever the environment."""
    with (
        torch._inductor.config.patch(fx_graph_cache=True, force_disable_caches=False),
        torch._functorch.config.patch(enable_autograd_cache=True),
    ):
        _three_calls_equal_eager(lambda s: sum_of(call(s)) + REF_LOGP.sum() / s, fullgraph)


def test_every_case_takes_the_float_of_the_call() -> None:
    """Each case of the table takes the float of the call (``call(s)``, default 1.0)."""
    for name, call in CASES:
        params = list(inspect.signature(call).parameters.values())
        assert len(params) == 1 and params[0].default == 1.0, name


def _packed_grpo_loss(
    logits: Tensor, input_ids: Tensor, position_ids: Tensor, ref_logp: Tensor, mask: Tensor
) -> Tensor:
    """A GRPO step's KL part on a padding-free row: klpen's next-token log-probs, the k3
    estimate and the per-sequence mean (``seq-mean-token-mean``)."""
    logp = klpen.next_token_logprobs(logits, input_ids, position_ids=position_ids)
    kl = klpen.estimate_kl(logp, ref_logp, "k3")
    ids = klpen.sequence_ids(position_ids=position_ids)[:, 1:]
    return klpen.aggregate(kl, mask, "seq-mean-token-mean", sequence_ids=ids)


@pytest.mark.parametrize("fullgraph", [False, True], ids=["default", "fullgraph"])
def test_a_compiled_packed_grpo_step_equals_eager(fullgraph: bool) -> None:
    g = torch.Generator().manual_seed(1)
    lengths = [5, 1, 7, 3]
    total, vocab = sum(lengths), 33
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    input_ids = torch.randint(0, vocab, (1, total), generator=g)
    logits = torch.randn(1, total, vocab, generator=g, requires_grad=True)
    ref_logp = torch.randn(1, total - 1, generator=g) - 3.0
    mask = torch.rand(1, total - 1, generator=g) > 0.2
    step = torch.compile(_packed_grpo_loss, fullgraph=fullgraph)
    for call in range(3):
        with torch.no_grad():
            logits.normal_(generator=g)
            logits[0, 4] = torch.nan  # a boundary row: no next-token log-prob, no gradient
        expected = _value_and_grads(
            lambda: _packed_grpo_loss(logits, input_ids, position_ids, ref_logp, mask), (logits,)
        )
        got = _value_and_grads(
            lambda: step(logits, input_ids, position_ids, ref_logp, mask), (logits,)
        )
        assert torch.isfinite(got[0]) and torch.isfinite(got[1]).all(), call
        for a, b in zip(got, expected, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def _ppo_loss(
    logits: Tensor,
    ref_logits: Tensor,
    tokens: Tensor,
    mask: Tensor,
    scores: Tensor,
    kl_coef: float,
    temperature: float,
) -> tuple[Tensor, Tensor]:
    """A PPO step's policy-gradient loss with KL-shaped rewards: ``(loss, mean sequence KL)``."""
    logp = klpen.get_logprobs_for_tokens(logits, tokens, temperature=temperature)
    ref = klpen.get_logprobs_for_tokens(ref_logits, tokens, temperature=temperature)
    kl = klpen.estimate_kl(logp, ref, "k1")
    rewards = klpen.shape_rewards(scores, kl.detach(), mask, kl_coef)
    returns = rewards.flip(-1).cumsum(-1).flip(-1)
    loss = -klpen.aggregate(logp * returns, mask, "token-mean")
    penalty = klpen.kl_penalized_reward(logits, ref_logits, torch.zeros_like(logp), kl_coef)
    return loss - penalty.mean(), klpen.masked_sum(kl.detach(), mask, dim=-1).mean()


@pytest.mark.parametrize("fullgraph", [False, True], ids=["default", "fullgraph"])
def test_a_compiled_ppo_step_follows_an_adaptive_controller(fullgraph: bool) -> None:
    """Issue 45: the controller's new coefficient at step 2 broke ``fullgraph=True``."""
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(3, 6, 17, generator=g, requires_grad=True)
    ref_logits = torch.randn(3, 6, 17, generator=g)
    tokens = torch.randint(0, 17, (3, 6), generator=g)
    mask = torch.ones(3, 6, dtype=torch.bool)
    mask[1, 4:] = False
    scores = torch.randn(3, generator=g)
    controller = klpen.AdaptiveKLController(init_kl_coef=0.2, target_kl=1.0, horizon=10)
    step = torch.compile(_ppo_loss, fullgraph=fullgraph)
    coefs = []
    for n in range(5):
        coef, temperature = controller.kl_coef, 1.0 + 0.1 * n
        args = (logits, ref_logits, tokens, mask, scores, coef, temperature)
        expected = _value_and_grads(lambda args=args: _ppo_loss(*args)[0], (logits,))
        loss, kl = step(*args)
        got = _value_and_grads(lambda loss=loss: loss, (logits,))
        for a, b in zip(got, expected, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        coefs.append(coef)
        controller.update(float(kl))
    assert len(set(coefs)) == 5  # a new Python float at every step


def test_inside_a_compiled_region_value_checks_are_off() -> None:
    """A NaN that eager reports comes back as a NaN from a compiled call (as under
    ``klpen.validation(False)``): no host read in the compiled graph."""
    z = torch.zeros(2, 5)
    z[1, 2] = torch.nan
    with pytest.raises(ValueError, match="NaN"):
        klpen.full_kl(z, torch.zeros(2, 5))
    kl = torch.compile(klpen.full_kl, fullgraph=True)(z, torch.zeros(2, 5))
    assert kl[0] == 0 and torch.isnan(kl[1])


def test_a_second_derivative_is_refused_by_name_through_the_operators() -> None:
    x = torch.randn(3, 7, requires_grad=True)
    (g,) = torch.autograd.grad(klpen.token_entropy(x).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="klpen's token_entropy has no second derivative"):
        g.sum().backward()
