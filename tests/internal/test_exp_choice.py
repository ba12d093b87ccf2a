"""Both CPU exponentials, whichever this CPU measured as the cheaper (``blocks.EXP2_FASTER``).

The block loops compute fp32 exponentials on the CPU as ``exp2(y · log2 e)`` where this CPU's
``exp2`` is clearly the faster, else as ``exp``; the choice is measured once per process. The
rest of the suite runs the kernels with the choice of the machine it runs on; here each
kernel runs with both, against float64 references that use neither.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import pytest
import torch
from probes import CountOps
from torch import Tensor

import klpen
from klpen.kernels import blocks

CHOICES = [pytest.param(False, id="exp"), pytest.param(True, id="exp2")]


@pytest.fixture(params=CHOICES)
def exp2(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[bool]:
    monkeypatch.setattr(blocks, "EXP2_FASTER", request.param)
    yield request.param


def _rel(a: Tensor, b: Tensor) -> float:
    return float(((a.double() - b) / b.abs().clamp(min=1e-300)).abs().max())


def test_exp_helpers_follow_the_choice(exp2: bool) -> None:
    y = torch.linspace(-40.0, 40.0, 4001)
    truth = torch.exp(y.double())
    # exp: correctly rounded to about half an ulp; exp2: the argument's rounding, |y| eps / 2
    tol = 2e-7 + (40 * 6e-8 if exp2 else 0.0)
    assert _rel(blocks.exp_(y.clone()), truth) < tol
    out = torch.empty_like(y)
    shift = torch.full((1,), 3.0)
    # with a shift and a scale, the argument 0.5 (y - 3) (|.| <= 21.5) is rounded twice first
    expected = torch.exp(0.5 * (y.double() - 3))
    assert _rel(blocks.exp_into(y, out, shift, 0.5), expected) < tol + 21.5 * 1.2e-7
    unit = blocks.exp_unit(y)
    assert unit == (blocks.LOG2E if exp2 else 1.0)
    assert _rel(blocks.exp_in_unit(y * unit, out), truth) < tol
    # float64 never takes exp2
    assert blocks.exp_unit(y.double()) == 1.0


def test_kernels_exact_with_either_exponential(exp2: bool) -> None:
    g = torch.Generator().manual_seed(0)
    z = torch.randn(6, 7, 300, generator=g) * 3 + 1e3
    w = z + 0.5 * torch.randn(6, 7, 300, generator=g)
    tokens = torch.randint(300, (6, 7), generator=g)
    zd, wd = z.double(), w.double()
    log_p = torch.log_softmax(zd, -1)
    ref_lp = log_p.gather(-1, tokens[..., None]).squeeze(-1)
    ref_ent = -(log_p.exp() * log_p).sum(-1)
    ref_kl = (log_p.exp() * (log_p - torch.log_softmax(wd, -1))).sum(-1)
    lp, ent = klpen.logprobs_and_entropy(z, tokens)
    assert (lp.double() - ref_lp).abs().max() < 1e-5
    assert (ent.double() - ref_ent).abs().max() < 1e-5
    assert _rel(klpen.full_kl(z, w), ref_kl) < 1e-4
    hidden = torch.randn(40, 16, generator=g)
    weight = torch.randn(300, 16, generator=g)
    ids = torch.randint(300, (40,), generator=g)
    lin_ref = torch.log_softmax(hidden.double() @ weight.double().T, -1)
    lin = klpen.linear_logprobs(hidden, weight, ids)
    assert (lin.double() - lin_ref.gather(-1, ids[:, None]).squeeze(-1)).abs().max() < 1e-5
    ref_hidden = hidden + 0.3 * torch.randn(40, 16, generator=g)
    q_ref = torch.log_softmax(ref_hidden.double() @ weight.double().T, -1)
    kl_ref = (lin_ref.exp() * (lin_ref - q_ref)).sum(-1)
    assert _rel(klpen.linear_full_kl(hidden, weight, ref_hidden, weight), kl_ref) < 1e-4


def test_gradients_exact_with_either_exponential(exp2: bool) -> None:
    g = torch.Generator().manual_seed(1)
    z = (torch.randn(5, 9, 200, generator=g) * 3 - 500).requires_grad_()
    w = z.detach() + 0.5 * torch.randn(5, 9, 200, generator=g)
    tokens = torch.randint(200, (5, 9), generator=g)
    up = torch.randn(2, 5, 9, generator=g)
    loss = (up[0] * klpen.get_logprobs_for_tokens(z, tokens, temperature=0.7)).sum()
    loss = loss + (up[1] * klpen.full_kl(z, w)).sum()
    (got,) = torch.autograd.grad(loss, z)
    zd = z.detach().double().requires_grad_()
    lp = torch.log_softmax(zd / 0.7, -1).gather(-1, tokens[..., None]).squeeze(-1)
    log_p = torch.log_softmax(zd, -1)
    kl = (log_p.exp() * (log_p - torch.log_softmax(w.double(), -1))).sum(-1)
    (want,) = torch.autograd.grad((up[0] * lp).sum() + (up[1] * kl).sum(), zd)
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-6)


def _import_pinned(pin: str, code: str) -> subprocess.CompletedProcess[str]:
    """``code`` run by a fresh Python with ``KLPEN_CPU_EXP=pin``."""
    env = {**os.environ, "KLPEN_CPU_EXP": pin}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)


@pytest.mark.parametrize("pinned", ["exp", "exp2"])
def test_the_environment_pins_the_choice(pinned: str) -> None:
    out = _import_pinned(pinned, "import klpen.kernels.blocks as b; print(b.EXP2_FASTER)")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(pinned == "exp2")


def test_the_measurement_times_fp32_on_the_cpu_whatever_the_defaults(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: set[tuple[str, torch.dtype]] = set()

    def spy(real):  # type: ignore[no-untyped-def]
        def call(x: Tensor, *, out: Tensor) -> Tensor:
            seen.add((x.device.type, x.dtype))
            return real(x, out=out)

        return call

    monkeypatch.setattr(torch, "exp", spy(torch.exp))
    monkeypatch.setattr(torch, "exp2", spy(torch.exp2))
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        with torch.device("meta"):
            blocks.exp2_measured_faster()
    finally:
        torch.set_default_dtype(before)
    assert seen == {("cpu", torch.float32)}


def test_a_bad_pin_names_the_variable() -> None:
    out = _import_pinned("exp10", "import klpen")
    assert out.returncode != 0
    assert "KLPEN_CPU_EXP must be 'exp' or 'exp2'" in out.stderr and "'exp10'" in out.stderr


def test_the_measurement_is_invisible_to_dispatch_modes() -> None:
    with CountOps() as ops:
        choice = blocks.exp2_measured_faster()
    assert isinstance(choice, bool)
    assert ops.count == {}
    assert isinstance(blocks.EXP2_FASTER, bool)
