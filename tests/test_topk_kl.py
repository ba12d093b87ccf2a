"""topk_kl (contract section 10): the tail-bucket estimate and certified bounds against exact
full-vocabulary KLs, for random, peaked, evenly spread and adversarial teachers."""

from __future__ import annotations

import decimal

import pytest
import torch
from torch import Tensor

import klpen

V, K = 50, 5


def kl(a: Tensor, b: Tensor) -> Tensor:
    """``KL(a ‖ b)`` over the last axis, float64, ``0 log 0 = 0``."""
    return torch.where(a > 0, a * (a.log() - b.log()), 0.0).sum(-1)


def teacher(kind: str, n: int, seed: int) -> Tensor:
    g = torch.Generator().manual_seed(seed)
    scale = {"random": 2.0, "peaked": 8.0, "even": 0.01}[kind]
    return torch.softmax(torch.randn(n, V, generator=g, dtype=torch.float64) * scale, -1)


def top(t: Tensor, k: int) -> tuple[Tensor, Tensor]:
    values, ids = t.topk(k, dim=-1)
    return ids, values.log()


def student(n: int, seed: int) -> Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, V, generator=g, dtype=torch.float64) * 2.0


def consistent_tail(t: Tensor, ids: Tensor, tail: Tensor) -> Tensor:
    """The teacher with ``t``'s top-k and ``tail`` (``(n, V)``, zero on the ids) elsewhere."""
    out = tail.clone()
    return out.scatter_(-1, ids, t.gather(-1, ids))


def worst_forward_tail(s: Tensor, t: Tensor, ids: Tensor) -> Tensor:
    """The tail that maximises KL(t ‖ s): mass tau on the student's least likely tokens."""
    tau = t.gather(-1, ids).amin(-1)
    rest = 1.0 - t.gather(-1, ids).sum(-1)
    tail = torch.zeros_like(t)
    for row in range(t.shape[0]):
        given = set(ids[row].tolist())
        order = [v for v in s[row].argsort().tolist() if v not in given]
        left = float(rest[row])
        for v in order:
            put = min(float(tau[row]), left)
            tail[row, v] = put
            left -= put
            if left <= 0:
                break
    return tail


def random_tail(t: Tensor, ids: Tensor, seed: int) -> Tensor:
    """A random tail of the right mass with every entry at most tau (mixed with the flat one)."""
    g = torch.Generator().manual_seed(seed)
    given = torch.zeros_like(t, dtype=torch.bool).scatter_(-1, ids, True)
    tau = t.gather(-1, ids).amin(-1, keepdim=True)
    rest = 1.0 - t.gather(-1, ids).sum(-1, keepdim=True)
    raw = torch.where(given, 0.0, torch.rand(t.shape, generator=g, dtype=t.dtype) ** 4)
    raw = raw / raw.sum(-1, keepdim=True) * rest
    flat = torch.where(given, 0.0, rest / (V - ids.shape[-1]))
    return below_tau(raw, flat, tau)


def below_tau(raw: Tensor, flat: Tensor, tau: Tensor) -> Tensor:
    """``λ raw + (1 - λ) flat`` per row with the largest ``λ`` in ``[0, 1]`` that keeps every
    entry at most ``tau`` (``(n, 1)``; ``flat`` is, and holds the same mass as ``raw``)."""
    excess = (raw - flat).amax(-1, keepdim=True)
    lam = torch.where(excess > 0, ((tau - flat.amax(-1, keepdim=True)) / excess).clamp(0, 1), 1.0)
    return lam * raw + (1 - lam) * flat


def check_contains(result: klpen.TopKKL, exact: Tensor, exact_tight: bool = False) -> None:
    slack = 1e-9 + 1e-9 * exact.abs()
    assert (result.lower.double() <= exact + slack).all(), (result.lower, exact)
    assert (exact <= result.upper.double() + slack).all(), (exact, result.upper)
    assert (result.estimate == result.lower).all()


@pytest.mark.parametrize("kind", ["random", "peaked", "even"])
@pytest.mark.parametrize("k", [1, 5, 20])
def test_forward_bounds_contain_the_exact_value(kind: str, k: int) -> None:
    t = teacher(kind, 6, seed=k)
    z = student(6, seed=100 + k)
    s = torch.softmax(z, -1)
    ids, lp = top(t, k)
    result = klpen.topk_kl(z, ids, lp)
    check_contains(result, kl(t, s))
    for seed in range(3):  # other teachers consistent with the same top-k
        other = consistent_tail(t, ids, random_tail(t, ids, seed))
        check_contains(result, kl(other, s))


@pytest.mark.parametrize("kind", ["random", "peaked", "even"])
@pytest.mark.parametrize("k", [1, 5, 20])
def test_forward_upper_bound_is_attained_by_the_adversarial_teacher(kind: str, k: int) -> None:
    t = teacher(kind, 4, seed=7 * k)
    z = student(4, seed=200 + k)
    s = torch.softmax(z, -1)
    ids, lp = top(t, k)
    worst = consistent_tail(t, ids, worst_forward_tail(s, t, ids))
    assert torch.allclose(worst.sum(-1), torch.ones(4, dtype=torch.float64))
    assert (worst.topk(k, -1).values[:, -1] >= worst.gather(-1, ids).amin(-1) - 1e-15).all()
    result = klpen.topk_kl(z, ids, lp)
    torch.testing.assert_close(result.upper, kl(worst, s), rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("kind", ["random", "peaked", "even"])
def test_reverse_lower_bound_and_no_finite_upper_bound(kind: str) -> None:
    t = teacher(kind, 5, seed=3)
    z = student(5, seed=4)
    s = torch.softmax(z, -1)
    ids, lp = top(t, K)
    result = klpen.topk_kl(z, ids, lp, direction="reverse")
    # a consistent teacher may put 0 on a student token, unless the tail is nearly full (an
    # evenly spread teacher: 45 omitted tokens of at most tau hold more than 44 tau)
    assert (torch.isfinite(result.upper) if kind == "even" else torch.isinf(result.upper)).all()
    for seed in range(3):
        other = consistent_tail(t, ids, random_tail(t, ids, seed))
        check_contains(result, kl(s, other))
    check_contains(result, kl(s, t))


def test_reverse_upper_bound_is_finite_when_the_tail_must_be_full() -> None:
    # two omitted tokens of at most tau = 0.1 holding R = 0.15: each holds at least 0.05
    t = torch.tensor([[0.3, 0.25, 0.2, 0.1, 0.08, 0.07]], dtype=torch.float64)
    z = torch.tensor([[0.0, 1.0, -1.0, 0.5, 2.0, -0.5]], dtype=torch.float64)
    s = torch.softmax(z, -1)
    ids, lp = torch.tensor([[0, 1, 2, 3]]), t[:, :4].log()
    result = klpen.topk_kl(z, ids, lp, direction="reverse")
    assert torch.isfinite(result.upper).all()
    check_contains(result, kl(s, t))
    # the worst teacher: the least allowed mass (0.05) on the student's likelier tail token
    worst = torch.tensor([[0.3, 0.25, 0.2, 0.1, 0.05, 0.1]], dtype=torch.float64)
    torch.testing.assert_close(result.upper, kl(s, worst), rtol=1e-9, atol=1e-12)
    forward = klpen.topk_kl(z, ids, lp)
    check_contains(forward, kl(t, s))


def test_whole_vocabulary_given_is_exact() -> None:
    t = teacher("random", 3, seed=9)
    z = student(3, seed=10)
    s = torch.softmax(z, -1)
    ids, lp = top(t, V)
    for direction, exact in (("forward", kl(t, s)), ("reverse", kl(s, t))):
        result = klpen.topk_kl(z, ids, lp, direction=direction)
        for value in result:
            torch.testing.assert_close(value, exact, rtol=1e-9, atol=1e-12)


def test_student_without_mass_on_a_tail_token_has_no_finite_forward_upper_bound() -> None:
    t = teacher("even", 2, seed=11)
    z = student(2, seed=12)
    ids, lp = top(t, K)
    tail_token = next(v for v in range(V) if v not in set(ids[0].tolist()))
    z[0, tail_token] = -float("inf")
    result = klpen.topk_kl(z, ids, lp)
    assert torch.isinf(result.upper[0]) and torch.isfinite(result.upper[1])
    assert torch.isfinite(result.estimate).all()


@pytest.mark.parametrize("direction", ["forward", "reverse"])
def test_estimate_gradient_and_temperature(direction: str) -> None:
    t = teacher("random", 4, seed=13)
    ids, lp = top(t, K)
    z = student(4, seed=14).requires_grad_()
    got = klpen.topk_kl(z, ids, lp, direction=direction, temperature=0.7).estimate
    (grad,) = torch.autograd.grad(got.sum(), z)
    zr = z.detach().clone().requires_grad_()
    s = torch.softmax(zr / 0.7, -1)
    s_k, t_k = s.gather(-1, ids), lp.exp()
    coarse_s = torch.cat((s_k, 1 - s_k.sum(-1, keepdim=True)), -1)
    coarse_t = torch.cat((t_k, 1 - t_k.sum(-1, keepdim=True)), -1)
    expected = kl(coarse_t, coarse_s) if direction == "forward" else kl(coarse_s, coarse_t)
    (expected_grad,) = torch.autograd.grad(expected.sum(), zr)
    torch.testing.assert_close(got, expected.detach(), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-8, atol=1e-12)


def test_float32_student_and_leading_shape() -> None:
    t = teacher("random", 6, seed=15)
    z = student(6, seed=16)
    ids, lp = top(t, K)
    result = klpen.topk_kl(z.float().view(2, 3, V), ids.view(2, 3, K), lp.float().view(2, 3, K))
    assert result.estimate.shape == (2, 3) and result.estimate.dtype == torch.float32
    exact = kl(t, torch.softmax(z.float().double(), -1)).view(2, 3)
    slack = 1e-5 * (1 + exact)
    assert (result.lower.double() <= exact + slack).all()
    assert (exact <= result.upper.double() + slack).all()


@pytest.mark.parametrize(
    ("ids", "logprobs", "match"),
    [
        ([[0, 50]], [-1.0, -2.0], "teacher_topk_ids must lie in"),
        ([[0, -1]], [-1.0, -2.0], "teacher_topk_ids must lie in"),
        ([[3, 3]], [-1.0, -2.0], "teacher_topk_ids must not repeat"),
        ([[0, 1]], [0.1, -2.0], "teacher_topk_logprobs must be <= 0"),
        ([[0, 1]], [-0.1, -0.2], "teacher_topk_logprobs must be log-probs of one distribution"),
        ([[0, 1]], [float("nan"), -2.0], "teacher_topk_logprobs must not be NaN"),
        ([[0, 1]], [-0.01, -12.0], "teacher_topk_logprobs leave a teacher mass"),
    ],
)
def test_bad_input_names_the_argument(
    ids: list[list[int]], logprobs: list[float], match: str
) -> None:
    z = torch.zeros(1, V)
    with pytest.raises(ValueError, match=match):
        klpen.topk_kl(z, torch.tensor(ids), torch.tensor([logprobs]))


def test_bad_shapes_and_direction() -> None:
    z = torch.zeros(2, V)
    ids, lp = torch.zeros(2, 2, dtype=torch.long) + torch.arange(2), torch.full((2, 2), -1.0)
    with pytest.raises(ValueError, match="direction must be one of"):
        klpen.topk_kl(z, ids, lp, direction="sideways")
    with pytest.raises(ValueError, match="teacher_topk_logprobs must have shape"):
        klpen.topk_kl(z, ids, lp[:, :1])
    with pytest.raises(ValueError, match="teacher_topk_ids must have shape"):
        klpen.topk_kl(z, ids[:1], lp[:1])
    with pytest.raises(TypeError, match="teacher_topk_ids"):
        klpen.topk_kl(z, ids.float(), lp)
    with klpen.validation(False):  # value checks off: no error, no host synchronisation
        klpen.topk_kl(z, torch.tensor([[3, 3], [0, 1]]), lp)


def _float32_case(gen: torch.Generator, confident: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(z, ids, lp, t)``: an fp32 student row, a teacher's top-k ids and fp32 log-probs, and
    a float64 teacher consistent with exactly those numbers: the mass they leave spread over
    the tail in the shape of the original teacher's, mixed with the flat spread as far as
    needed to keep every tail entry at most the smallest given probability
    (:func:`below_tau`); over a small vocabulary. ``confident``: a teacher whose
    top-k hold all but about 1e-9 of its mass or less."""
    vocab = int(torch.randint(4, 40, (), generator=gen))
    k = int(torch.randint(1, vocab, (), generator=gen))
    z = torch.randn(vocab, generator=gen) * float(torch.rand((), generator=gen) * 6)
    spread = 40.0 if confident else float(torch.rand((), generator=gen) * 3)
    t = torch.softmax(torch.randn(vocab, generator=gen, dtype=torch.float64) * spread, -1)
    values, ids = t.sort(descending=True)
    lp = values[:k].log().float()
    given = lp.double().exp()
    # the mass the fp32 log-probs leave, to 40 digits (float64's 1 - Σ t is off by 1e-16)
    with decimal.localcontext() as ctx:
        ctx.prec = 40
        left = 1 - sum(decimal.Decimal(float(x)).exp() for x in lp)
    rest, tau = torch.tensor(max(float(left), 0.0), dtype=torch.float64), given.min()
    raw = values[None, k:] / values[k:].sum() * rest
    flat = torch.full_like(raw, float(rest) / (vocab - k))
    full = torch.zeros(vocab, dtype=torch.float64)
    full[ids[:k]], full[ids[k:]] = given, below_tau(raw, flat, tau.reshape(1, 1))[0]
    return z, ids[:k], lp, full


@pytest.mark.parametrize("direction", ["forward", "reverse"])
def test_bounds_hold_for_float32_logprobs(direction: str) -> None:
    """Random fp32 students and teachers given by fp32 log-probs, among them confident
    teachers (top-k mass 1 - 1e-9 and beyond), confident students and nearly flat tails:
    every teacher consistent with the given numbers has its KL within ``[lower, upper]``, to
    fp32's rounding. The bugs this caught: each side's omitted mass taken as ``1 - Σ`` in
    fp32, 0 below about 1e-7 (estimate and lower bound ``inf`` for a finite KL: forward
    where the student's top-k held nearly all its mass, reverse where the teacher's did),
    and the reverse upper bound's ``R - (V - k - 1) τ``, a difference, from fp32-rounded
    numbers (a bound below a consistent teacher's KL)."""
    gen = torch.Generator().manual_seed(11)
    checked = 0
    for trial in range(300):
        z, ids, lp, t = _float32_case(gen, confident=trial % 3 == 0)
        given = lp.double().exp()
        tail = t.clone().index_fill_(0, ids, 0.0)
        if given.sum() > 1.0 or (tail > given.min() * (1 + 1e-12)).any():
            continue  # the rounded log-probs leave no consistent teacher
        result = klpen.topk_kl(z[None], ids[None], lp[None], direction=direction)
        log_s = torch.log_softmax(z.double(), -1)
        s = log_s.exp()
        exact = kl(t, s) if direction == "forward" else kl(s, t)
        slack = 1e-5 * (1.0 + exact.abs())
        assert result.lower.double() <= exact + slack, (trial, result, exact)
        assert exact <= result.upper.double() + slack, (trial, result, exact)
        checked += 1
    assert checked > 150
