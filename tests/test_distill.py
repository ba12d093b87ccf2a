"""On-policy distillation (contract section 10): generalized_jsd, linear_generalized_jsd and
distillation_rewards, against TRL's own ``generalized_jsd_loss`` and float64 formulas."""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable

import pytest
import torch
from jsd_references import jsd_gradient_floor, reference_terms
from public_calls import ThroughKlpenOps
from torch import Tensor

import klpen

BETAS = (0.0, 0.1, 0.5, 0.9, 1.0)
# torch.compile is tested with torch >= 2.13, as in tests/test_compile.py
COMPILER = pytest.mark.skipif(
    tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) < (2, 13),
    reason="torch.compile is tested with torch >= 2.13 (torch 2.4's compiler fails itself)",
)
BACKENDS = klpen.available_backends()
INF = float("inf")


def reference_jsd(z: Tensor, w: Tensor, beta: float, temperature: float = 1.0) -> Tensor:
    """The definition in float64: TRL's convention, with 0 log 0 = 0."""
    log_p = torch.log_softmax(z.double() / temperature, -1)
    log_q = torch.log_softmax(w.double() / temperature, -1)
    p, q = log_p.exp(), log_q.exp()

    def kl(a: Tensor, log_a: Tensor, log_b: Tensor) -> Tensor:
        return torch.where(a > 0, a * (log_a - log_b), 0.0).sum(-1)

    if beta == 0.0:
        return kl(q, log_q, log_p)
    if beta == 1.0:
        return kl(p, log_p, log_q)
    log_m = torch.log((beta * q + (1 - beta) * p).clamp(min=1e-300))  # 0 only where p = q = 0
    return beta * kl(q, log_q, log_m) + (1 - beta) * kl(p, log_p, log_m)


def trl_jsd(z: Tensor, w: Tensor, beta: float, temperature: float) -> Tensor:
    """TRL's own ``GKDTrainer.generalized_jsd_loss`` (skipped where TRL is not installed: the
    oldest-torch run installs no TRL)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
        gkd = pytest.importorskip("trl.experimental.gkd.gkd_trainer")
    loss = gkd.GKDTrainer.generalized_jsd_loss(
        z, w, beta=beta, temperature=temperature, reduction="none"
    )
    return loss.sum(-1)  # type: ignore[no-any-return]


def pair(*shape: int, scale: float = 3.0, seed: int = 0) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g) * scale, torch.randn(*shape, generator=g) * scale


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("beta", BETAS)
def test_values_and_gradients_equal_trl_in_float64(beta: float, backend: str) -> None:
    z, w = pair(2, 3, 37)
    z, w = z.double(), w.double()
    zt, wt = z.clone().requires_grad_(), w.clone().requires_grad_()
    expected = trl_jsd(zt, wt, beta, 0.8)
    g = torch.randn(expected.shape, generator=torch.Generator().manual_seed(1), dtype=z.dtype)
    (expected * g).sum().backward()
    zk, wk = z.clone().requires_grad_(), w.clone().requires_grad_()
    with klpen.use_backend(backend):
        got = klpen.generalized_jsd(zk, wk, beta=beta, temperature=0.8)
        (got * g).sum().backward()
    torch.testing.assert_close(got, expected.detach(), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(zk.grad, zt.grad, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(wk.grad, wt.grad, rtol=1e-9, atol=1e-12)


# mixtures near an end (min(β, 1 - β) down to 1e-12) and in the middle
NEAR_END = (1e-6, 1 - 1e-6, 1 - 1e-12)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("beta", (*NEAR_END, 0.1, 0.5))
def test_mixtures_near_an_end_keep_their_digits(beta: float, backend: str) -> None:
    """With ``β`` or ``1 - β`` as small as ``1e-12`` the divergence is of that size, and in
    fp32 it keeps fp32's precision relative to itself, as do both gradients relative to
    theirs; so at any β on rows whose log-ratios pass fp32's ``expm1`` range (±88). Rows:
    near-identical, random, log-ratios from -120 to 120, and at a common offset of 1e3.
    The first forms lost this: an infinite value at every β where a log-ratio passed 88 and
    a relative error of 9e-4 at ``β = 1e-6`` (torch), 5e-2 at ``β = 1e-6`` and 2e4 at
    ``1 - 1e-12`` (Triton)."""
    gen = torch.Generator().manual_seed(7)
    z, w = torch.randn(4, 300, generator=gen) * 3, torch.randn(4, 300, generator=gen) * 3
    w[0] = z[0] + 0.01 * torch.randn(300, generator=gen)
    w[2] = z[2] + torch.linspace(-120.0, 120.0, 300)
    z[3] = z[3] + 1e3
    w[3] = z[3] + 0.1 * torch.randn(300, generator=gen)
    g = torch.randn(4, generator=gen)
    zk, wk = z.clone().requires_grad_(), w.clone().requires_grad_()
    with klpen.use_backend(backend):
        got = klpen.generalized_jsd(zk, wk, beta=beta)
        (got * g).sum().backward()
    zz, ww = z.double().requires_grad_(), w.double().requires_grad_()
    expected = reference_terms(zz, ww, beta)
    (expected * g.double()).sum().backward()
    torch.testing.assert_close(got.double(), expected.detach(), rtol=3e-6, atol=0)
    floor = jsd_gradient_floor(g, 1.0, beta)
    for mine, want in ((zk.grad, zz.grad), (wk.grad, ww.grad)):
        assert mine is not None and want is not None
        scale = torch.maximum(want.abs().amax(-1, keepdim=True), floor)
        assert ((mine.double() - want).abs() / scale).amax() <= 1e-4


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("beta", [0.0, 1e-3, 0.5, 1.0])
def test_probabilities_that_underflow_beside_minus_inf(beta: float, backend: str) -> None:
    """At temperature 0.05 a finite logit 20 below its row's top has probability 0 in fp32:
    beside the other model's ``-inf`` the token adds nothing, as if both were ``-inf``. (A
    NaN there, ``0 · inf`` in the per-token terms of an intermediate version of this stop's
    fix, made the public function raise on valid input.)"""
    gen = torch.Generator().manual_seed(8)
    z, w = torch.randn(3, 50, generator=gen) * 3, torch.randn(3, 50, generator=gen) * 3
    z[:, :3] = w[:, 3:6] = -INF
    w[:, :3] = w.amax(-1, keepdim=True) - 20.0
    z[:, 3:6] = z.amax(-1, keepdim=True) - 20.0
    both_z, both_w = z.clone(), w.clone()
    both_z[:, 3:6] = both_w[:, :3] = -INF
    with klpen.use_backend(backend):
        got = klpen.generalized_jsd(z, w, beta=beta, temperature=0.05)
        want = klpen.generalized_jsd(both_z, both_w, beta=beta, temperature=0.05)
    assert torch.isfinite(want).all()
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("beta", BETAS)
def test_fp32_within_contract_tolerance_of_float64(beta: float) -> None:
    z, w = pair(4, 5, 301, scale=4.0, seed=2)
    got = klpen.generalized_jsd(z, w, beta=beta, temperature=1.3)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), reference_jsd(z, w, beta, 1.3), rtol=1e-4, atol=0)
    half = klpen.generalized_jsd(z.bfloat16(), w.bfloat16(), beta=beta)
    assert half.dtype == torch.float32
    torch.testing.assert_close(
        half.double(), reference_jsd(z.bfloat16(), w.bfloat16(), beta), rtol=1e-4, atol=0
    )


@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("offset", [0.0, 30.0, -1e3, 1e4])
@pytest.mark.parametrize("spread", [1e-1, 1e-3, 1e-5])
def test_near_identical_rows_at_common_offsets(beta: float, offset: float, spread: float) -> None:
    g = torch.Generator().manual_seed(3)
    base = torch.randn(3, 2000, generator=g) * 2
    z = base + offset
    w = base + torch.randn(3, 2000, generator=g) * spread + offset
    expected = reference_jsd(z, w, beta)  # of the rounded fp32 logits
    got = klpen.generalized_jsd(z, w, beta=beta)
    assert (expected > 0).all()
    torch.testing.assert_close(
        got.double(), expected, rtol=1e-4, atol=1e-10 if spread < 1e-4 else 0
    )


@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("offset", [0.0, 1e4, -3e4])
def test_identical_rows_give_exactly_zero(beta: float, offset: float) -> None:
    z = torch.randn(4, 1000, generator=torch.Generator().manual_seed(4)) * 5 + offset
    z[0, :10] = -INF
    assert torch.equal(klpen.generalized_jsd(z, z.clone(), beta=beta), torch.zeros(4))


@pytest.mark.parametrize("beta", BETAS)
def test_minus_inf_entries(beta: float) -> None:
    z, w = pair(4, 9, seed=5)
    z[0, 1] = w[0, 2] = -INF  # each side has a token the other cannot emit
    z[1, 3] = w[1, 3] = -INF  # a token neither can emit
    z[2, :] = torch.tensor([0.0, 1.0, -INF, -INF, -INF, -INF, -INF, -INF, -INF])
    w[3, 4:] = -INF
    z64, w64 = z.double().requires_grad_(), w.double().requires_grad_()
    got = klpen.generalized_jsd(z64, w64, beta=beta)
    expected = reference_jsd(z, w, beta)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-14)
    if 0 < beta < 1:
        assert torch.isfinite(got).all()
        got.sum().backward()
        assert torch.isfinite(z64.grad).all() and torch.isfinite(w64.grad).all()
        # -inf as -800: exp underflows to exactly 0 in float64, and autograd stays finite
        zr, wr = (x.double().clamp(min=-800.0).requires_grad_() for x in (z, w))
        reference_jsd(zr, wr, beta).sum().backward()
        torch.testing.assert_close(z64.grad, zr.grad, rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(w64.grad, wr.grad, rtol=1e-9, atol=1e-12)
    else:
        # the student (beta = 0) or the teacher (beta = 1) without mass where the other has it
        assert torch.isinf(got[0])


def test_teacher_without_grad_and_second_derivative() -> None:
    z, w = pair(2, 11, seed=6)
    z.requires_grad_()
    out = klpen.generalized_jsd(z, w, beta=0.3)
    (g,) = torch.autograd.grad(out.sum(), z, create_graph=True)
    with pytest.raises(RuntimeError, match="generalized_jsd has no second derivative"):
        g.sum().backward()


def test_leading_shapes_and_strided_views() -> None:
    z, w = pair(2, 6, 13, seed=7)
    zs, ws = z[:, :-1], w[:, 1:]  # non-contiguous, as next-token slices are
    torch.testing.assert_close(
        klpen.generalized_jsd(zs, ws), reference_jsd(zs, ws, 0.5).float(), rtol=1e-5, atol=1e-7
    )
    assert klpen.generalized_jsd(z[0, 0], w[0, 0]).shape == ()


def test_padded_teacher_vocabulary_needs_vocab_size() -> None:
    z, w = pair(2, 3, 10, seed=8)
    padded = torch.cat((w, torch.randn(2, 3, 6)), dim=-1)
    with pytest.raises(ValueError, match=r"10 entries but teacher_logits has 16.*vocab_size"):
        klpen.generalized_jsd(z, padded)
    got = klpen.generalized_jsd(z, padded, vocab_size=10)
    torch.testing.assert_close(got, klpen.generalized_jsd(z, w))
    with pytest.raises(ValueError, match="vocab_size must lie in"):
        klpen.generalized_jsd(z, padded, vocab_size=11)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"beta": 1.5}, "beta must lie in"),
        ({"beta": -0.1}, "beta must be finite and non-negative"),
        ({"beta": float("nan")}, "beta"),
        ({"temperature": 0.0}, "temperature"),
    ],
)
def test_bad_arguments(kwargs: dict[str, float], match: str) -> None:
    z, w = pair(2, 5)
    with pytest.raises(ValueError, match=match):
        klpen.generalized_jsd(z, w, **kwargs)  # type: ignore[arg-type]


def test_bad_tensors() -> None:
    z, w = pair(2, 5)
    with pytest.raises(ValueError, match="teacher_logits must have shape"):
        klpen.generalized_jsd(z, w[:1])
    with pytest.raises(TypeError, match="student_logits"):
        klpen.generalized_jsd(z.long(), w)
    bad = w.clone()
    bad[1, 2] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        klpen.generalized_jsd(z, bad)
    with klpen.validation(False):
        assert torch.isnan(klpen.generalized_jsd(z, bad)[1])


@COMPILER
def test_compiled_equals_eager_with_changing_floats() -> None:
    z, w = pair(2, 3, 29, seed=9)
    z.requires_grad_()

    def loss(beta: float, temperature: float) -> Tensor:
        return klpen.generalized_jsd(z, w, beta=beta, temperature=temperature).sum()

    compiled = torch.compile(loss, fullgraph=True)
    for beta, temperature in ((0.5, 1.0), (0.25, 0.7), (0.9, 1.3), (1.0, 1.0), (0.0, 0.8)):
        z.grad = None
        eager = loss(beta, temperature)
        eager.backward()
        eager_grad = z.grad.clone()
        z.grad = None
        got = compiled(beta, temperature)
        got.backward()
        torch.testing.assert_close(got, eager)
        torch.testing.assert_close(z.grad, eager_grad)


# --- linear_generalized_jsd ---------------------------------------------------------------


def _layers(seed: int, bias: bool) -> tuple[Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    n, v, hs, ht = 7, 23, 5, 9  # different hidden sizes

    def r(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    sb, tb = (r(v), r(v)) if bias else (None, None)
    return (r(2, n, hs), r(v, hs), r(2, n, ht), r(v, ht) * 0.7, sb, tb)  # type: ignore[return-value]


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("beta", BETAS)
def test_linear_equals_explicit_logits(beta: float, bias: bool) -> None:
    tensors = [None if x is None else x.clone().requires_grad_() for x in _layers(10, bias)]
    sh, sw, th, tw, sb, tb = tensors
    got = klpen.linear_generalized_jsd(
        sh, sw, th, tw, beta=beta, temperature=0.9, student_bias=sb, teacher_bias=tb
    )
    leaves = [x for x in tensors if x is not None]
    g = torch.randn(got.shape, generator=torch.Generator().manual_seed(11), dtype=got.dtype)
    grads = torch.autograd.grad((got * g).sum(), leaves)
    refs = [None if x is None else x.detach().clone().requires_grad_() for x in tensors]
    rsh, rsw, rth, rtw, rsb, rtb = refs
    z = rsh @ rsw.T + (0 if rsb is None else rsb)
    w = rth @ rtw.T + (0 if rtb is None else rtb)
    expected = trl_jsd(z, w, beta, 0.9)
    ref_leaves = [x for x in refs if x is not None]
    expected_grads = torch.autograd.grad((expected * g).sum(), ref_leaves)
    torch.testing.assert_close(got, expected.detach(), rtol=1e-10, atol=1e-12)
    for a, b in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


def test_linear_chunks_and_float32(monkeypatch: pytest.MonkeyPatch) -> None:
    import klpen.distill as distill

    monkeypatch.setattr(distill, "LINEAR_CHUNK_ELEMENTS", 40)  # a row or two per chunk
    sh, sw, th, tw, _, _ = (x if x is None else x.float() for x in _layers(12, False))
    got = klpen.linear_generalized_jsd(sh, sw, th, tw, beta=0.3)
    expected = reference_jsd(sh @ sw.T, th @ tw.T, 0.3)
    torch.testing.assert_close(got.double(), expected, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("teacher_grad", [False, True])
@pytest.mark.parametrize("beta", BETAS)
def test_linear_chunk_boundaries_equal_unfused(
    beta: float, teacher_grad: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    import klpen.distill as distill
    import klpen.kernels.torch_jsd as torch_jsd

    # 14 rows in chunks of 3 (the last one 2), each chunk in blocks of 2 rows (the last 1):
    # the reused buffers, the gradient written over the logits, the accumulated weights
    monkeypatch.setattr(distill, "LINEAR_CHUNK_ELEMENTS", 3 * 23)
    monkeypatch.setattr(torch_jsd, "JSD_BLOCK_ELEMENTS", 2 * 23)
    layers = _layers(15, True)
    leaves = [i for i in range(6) if i < 2 or i == 4 or teacher_grad]

    def run(fused: bool) -> tuple[Tensor, ...]:
        xs = [x.clone() for x in layers]  # type: ignore[union-attr]
        for i in leaves:
            xs[i].requires_grad_()
        sh, sw, th, tw, sb, tb = xs
        if fused:
            got = klpen.linear_generalized_jsd(
                sh, sw, th, tw, beta=beta, temperature=0.8, student_bias=sb, teacher_bias=tb
            )
        else:
            got = klpen.generalized_jsd(sh @ sw.T + sb, th @ tw.T + tb, beta=beta, temperature=0.8)
        g = torch.randn(got.shape, generator=torch.Generator().manual_seed(16), dtype=got.dtype)
        return (got, *torch.autograd.grad((got * g).sum(), [xs[i] for i in leaves]))

    for a, b in zip(run(True), run(False), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_linear_vocabulary_mismatch_and_padding() -> None:
    sh, sw, th, tw, _, _ = _layers(13, False)
    padded = torch.cat((tw, torch.randn(5, tw.shape[1], dtype=tw.dtype)))
    with pytest.raises(ValueError, match=r"student_weight has a vocabulary of 23 .* 28"):
        klpen.linear_generalized_jsd(sh, sw, th, padded)
    torch.testing.assert_close(
        klpen.linear_generalized_jsd(sh, sw, th, padded, vocab_size=23),
        klpen.linear_generalized_jsd(sh, sw, th, tw),
    )
    with pytest.raises(ValueError, match="teacher_hidden must have shape"):
        klpen.linear_generalized_jsd(sh, sw, th[:1], tw)
    with pytest.raises(ValueError, match="teacher_weight must have shape"):
        klpen.linear_generalized_jsd(sh, sw, th, tw[:, :3])


@COMPILER
def test_linear_compiled_equals_eager() -> None:
    sh, sw, th, tw, _, _ = (x if x is None else x.float() for x in _layers(14, False))
    sw.requires_grad_()

    def loss(beta: float) -> Tensor:
        return klpen.linear_generalized_jsd(sh, sw, th, tw, beta=beta).sum()

    compiled = torch.compile(loss, fullgraph=True)
    for beta in (0.5, 0.2):
        eager = loss(beta)
        (eg,) = torch.autograd.grad(eager, sw)
        got = compiled(beta)
        (cg,) = torch.autograd.grad(got, sw)
        torch.testing.assert_close(got, eager)
        torch.testing.assert_close(cg, eg)


# --- linear_generalized_jsd, aggregated ---------------------------------------------------

MODES = ("token-mean", "token-sum", "seq-mean-token-mean", "seq-mean-token-sum")
# row 1: sequence 2 has no position (a zero-length sequence), sequence 3 only masked ones
PACKED_IDS = torch.tensor([[0, 0, 0, 1, 1, 2, 2], [0, 0, 1, 1, 1, 3, 3]])
AGG_MASK = torch.tensor([[1, 1, 0, 1, 1, 0, 1], [1, 0, 1, 1, 1, 0, 0]], dtype=torch.bool)


def reference_aggregate(values: Tensor, mask: Tensor, mode: str, ids: Tensor | None) -> Tensor:
    """The mode from its definition, sequence by sequence in Python (not klpen's code)."""
    seqs = []  # (masked sum, valid tokens) of each sequence
    for b in range(values.shape[0]):
        row = torch.zeros(values.shape[1], dtype=torch.long) if ids is None else ids[b]
        for sid in row.unique():
            sel = (row == sid) & mask[b]
            seqs.append((values[b][sel].sum(), int(sel.sum())))
    total = sum((v for v, _ in seqs), values.new_zeros(()))
    if mode == "token-sum":
        return total
    if mode == "token-mean":
        return total / max(1, sum(c for _, c in seqs))
    kept = [(v, c) for v, c in seqs if c > 0]
    per = [v / c if mode == "seq-mean-token-mean" else v for v, c in kept]
    return sum(per, values.new_zeros(())) / max(1, len(kept))


@pytest.mark.parametrize("teacher_grad", [False, True])
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("mode", MODES)
def test_linear_aggregated_equals_the_aggregate_of_explicit_logits(
    mode: str, beta: float, packed: bool, teacher_grad: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    import klpen.distill as distill

    # 14 rows in chunks of 3: each chunk's gradients taken in the forward, rows of both
    # kinds in one chunk; NaN and inf in the masked positions' hidden states
    monkeypatch.setattr(distill, "LINEAR_CHUNK_ELEMENTS", 3 * 23)
    layers = [None if x is None else x.clone() for x in _layers(21, True)]
    leaves = [i for i in range(6) if i < 2 or i == 4 or teacher_grad]
    ids = PACKED_IDS if packed else None
    refs = [x if x is None else x.clone().requires_grad_(i in leaves) for i, x in enumerate(layers)]
    dirty = [None if x is None else x.clone() for x in layers]
    dirty[0][~AGG_MASK] = float("nan")  # type: ignore[index]
    dirty[2][~AGG_MASK] = INF  # type: ignore[index]
    for i in leaves:
        dirty[i].requires_grad_()  # type: ignore[union-attr]
    sh, sw, th, tw, sb, tb = dirty
    got = klpen.linear_generalized_jsd(
        sh,
        sw,
        th,
        tw,
        beta=beta,
        temperature=0.8,
        student_bias=sb,
        teacher_bias=tb,  # type: ignore[arg-type]
        aggregation=mode,
        mask=AGG_MASK,
        sequence_ids=ids,
    )
    assert got.shape == ()
    grads = torch.autograd.grad(1.7 * got, [dirty[i] for i in leaves])  # type: ignore[misc]
    rsh, rsw, rth, rtw, rsb, rtb = refs
    z = rsh @ rsw.T + rsb  # type: ignore[operator]
    w = rth @ rtw.T + rtb  # type: ignore[operator]
    expected = reference_aggregate(reference_jsd(z, w, beta, 0.8), AGG_MASK, mode, ids)
    expected_grads = torch.autograd.grad(1.7 * expected, [refs[i] for i in leaves])  # type: ignore[misc]
    torch.testing.assert_close(got, expected.detach(), rtol=1e-10, atol=1e-12)
    for a, b in zip(grads, expected_grads, strict=True):
        assert a.isfinite().all()
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_aggregated_in_low_precision(dtype: torch.dtype) -> None:
    # float32 computes in float32, bfloat16 in float32 too: the error of the value and of the
    # gradients (returned in the inputs' dtype) is the unfused same-dtype computation's
    sh, sw, th, tw = (x.to(dtype) for x in _layers(22, False) if x is not None)
    sw.requires_grad_()
    got = klpen.linear_generalized_jsd(sh, sw, th, tw, beta=0.3, aggregation="token-mean")
    (grad,) = torch.autograd.grad(got, sw)
    assert got.dtype == torch.float32 and grad.dtype == dtype
    ref_w = sw.detach().double().requires_grad_()
    expected = reference_jsd(sh.double() @ ref_w.T, th.double() @ tw.double().T, 0.3).mean()
    (ref_grad,) = torch.autograd.grad(expected, ref_w)
    unfused_w = sw.detach().clone().requires_grad_()
    unfused = klpen.generalized_jsd(sh @ unfused_w.T, th @ tw.T, beta=0.3).mean()
    (unfused_grad,) = torch.autograd.grad(unfused, unfused_w)
    value_floor = (unfused.double() - expected).abs().item()
    grad_floor = (unfused_grad.double() - ref_grad).abs().max().item()
    assert (got.double() - expected).abs().item() <= 2 * value_floor + 1e-6 * expected.item()
    assert (grad.double() - ref_grad).abs().max().item() <= 2 * grad_floor + 1e-6


def test_linear_aggregated_without_gradients_and_twice() -> None:
    sh, sw, th, tw = (x.float() for x in _layers(23, False) if x is not None)
    sw.requires_grad_()

    def call() -> Tensor:
        return klpen.linear_generalized_jsd(
            sh, sw, th, tw, aggregation="seq-mean-token-sum", mask=AGG_MASK
        )

    with torch.no_grad():
        frozen = call()
    got = call()
    assert torch.equal(got, frozen)  # the gradients taken beside it leave the value alone
    got.backward(retain_graph=True)  # type: ignore[no-untyped-call]
    first = sw.grad.clone()  # type: ignore[union-attr]
    (2.0 * got).backward()  # type: ignore[no-untyped-call]
    torch.testing.assert_close(sw.grad, 3.0 * first)  # the stored gradients are not scaled in place
    (g,) = torch.autograd.grad(call(), sw, create_graph=True)
    with pytest.raises(RuntimeError, match="no second derivative"):
        torch.autograd.grad(g.sum(), sw)
    empty = klpen.linear_generalized_jsd(sh[:, :0], sw, th[:, :0], tw, aggregation="token-mean")
    (grad,) = torch.autograd.grad(empty, sw)
    assert empty.item() == 0.0 and torch.equal(grad, torch.zeros_like(sw))


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("mode", MODES)
def test_aggregation_weights_are_the_gradient_of_aggregate(mode: str, packed: bool) -> None:
    from klpen.masking import aggregation_weights

    g = torch.Generator().manual_seed(25)
    values = torch.randn(2, 7, generator=g, dtype=torch.float64, requires_grad=True)
    ids = PACKED_IDS if packed else None
    mask = AGG_MASK.clone()
    mask[1] = False  # a row without a valid token
    weights = aggregation_weights(mask, mode, ids, torch.float64)
    expected = reference_aggregate(values, mask, mode, ids)
    (grad,) = torch.autograd.grad(expected, values)
    # to a few units of float64 rounding: 1 / (n R) against (1 / n) / R, two summation orders
    torch.testing.assert_close(weights, grad, rtol=1e-15, atol=1e-17)
    torch.testing.assert_close((weights * values).sum(), expected, rtol=1e-14, atol=1e-15)


@COMPILER
def test_linear_aggregated_compiled_equals_eager() -> None:
    sh, sw, th, tw = (x.float() for x in _layers(24, False) if x is not None)
    sw.requires_grad_()

    def loss(beta: float) -> Tensor:
        return klpen.linear_generalized_jsd(
            sh,
            sw,
            th,
            tw,
            beta=beta,
            aggregation="seq-mean-token-mean",
            mask=AGG_MASK,
            sequence_ids=PACKED_IDS,
        )

    compiled = torch.compile(loss, fullgraph=True)
    for beta in (0.5, 0.2):
        eager = loss(beta)
        (eg,) = torch.autograd.grad(eager * 1.5, sw)
        got = compiled(beta)
        (cg,) = torch.autograd.grad(got * 1.5, sw)
        torch.testing.assert_close(got, eager)
        torch.testing.assert_close(cg, eg)


# --- distillation_rewards -----------------------------------------------------------------


def test_rewards_values_and_masked_slots_never_leak() -> None:
    s = torch.tensor([[-1.0, -2.0, float("nan")], [INF, -0.5, -0.25]], requires_grad=True)
    t = torch.tensor([[-1.5, -1.0, -INF], [float("nan"), -0.5, -1.25]], requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [0, 1, 1]])
    got = klpen.distillation_rewards(s, t, mask, kl_coef=0.5)
    expected = torch.tensor([[-0.25, 0.5, 0.0], [0.0, 0.0, -0.5]])
    torch.testing.assert_close(got, expected)
    got.sum().backward()
    m = mask.bool()
    torch.testing.assert_close(s.grad, torch.where(m, -0.5, 0.0))
    torch.testing.assert_close(t.grad, torch.where(m, 0.5, 0.0))


def test_rewards_zero_coefficient_and_bad_input() -> None:
    s, t = torch.tensor([[0.0, -1.0]]), torch.tensor([[-INF, -1.0]])
    assert torch.equal(
        klpen.distillation_rewards(s, t, torch.ones(1, 2), kl_coef=0.0), torch.zeros(1, 2)
    )
    with pytest.raises(ValueError, match="kl_coef"):
        klpen.distillation_rewards(s, t, torch.ones(1, 2), kl_coef=-1.0)
    with pytest.raises(ValueError, match="student_logprobs must not be NaN"):
        klpen.distillation_rewards(torch.tensor([[float("nan"), 0.0]]), t, torch.ones(1, 2))
    with pytest.raises(ValueError, match="teacher_logprobs must have shape"):
        klpen.distillation_rewards(s, t[:, :1], torch.ones(1, 2))
    with pytest.raises(ValueError, match="mask"):
        klpen.distillation_rewards(s, t, torch.ones(1, 3))


def test_rewards_packed_equal_padded() -> None:
    g = torch.Generator().manual_seed(15)
    lengths = (3, 5, 2)
    s = [torch.randn(n, generator=g, dtype=torch.float64) for n in lengths]
    t = [torch.randn(n, generator=g, dtype=torch.float64) for n in lengths]
    width = max(lengths)
    pad_s = torch.zeros(3, width, dtype=torch.float64)
    pad_t = torch.zeros(3, width, dtype=torch.float64)
    pad_m = torch.zeros(3, width, dtype=torch.bool)
    for i, n in enumerate(lengths):
        pad_s[i, :n], pad_t[i, :n], pad_m[i, :n] = s[i], t[i], True
    padded = klpen.distillation_rewards(pad_s, pad_t, pad_m, kl_coef=0.3)
    ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None]
    packed = klpen.distillation_rewards(
        torch.cat(s)[None],
        torch.cat(t)[None],
        torch.ones(1, sum(lengths)),
        kl_coef=0.3,
        sequence_ids=ids,
    )
    torch.testing.assert_close(packed[0], padded[pad_m], rtol=1e-6, atol=1e-6)


def test_rewards_with_a_task_score_through_shape_rewards() -> None:
    s, t = torch.tensor([[-1.0, -2.0, -3.0]]), torch.tensor([[-1.5, -1.0, -3.0]])
    mask = torch.tensor([[1, 1, 0]])
    scores = torch.tensor([2.0])
    combined = klpen.shape_rewards(scores, s - t, mask, 0.4)
    other = klpen.distillation_rewards(s, t, mask, kl_coef=0.4) + klpen.shape_rewards(
        scores, torch.zeros(1, 3), mask, 0.0
    )
    torch.testing.assert_close(combined, other)


# --- memory -------------------------------------------------------------------------------


class _Storages(ThroughKlpenOps):
    """The storages of every tensor the ops return (inside klpen's operators too), by size."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: dict[int, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = self.run(func, args, kwargs)
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, Tensor):
                storage = t.untyped_storage()
                self.sizes[storage.data_ptr()] = storage.nbytes()
        return out


def _big(fn: Callable[[], object], full_bytes: int, *existing: Tensor) -> list[int]:
    """Sizes of the new storages of at least half an ``(N, V)`` tensor that ``fn()`` makes
    (views of ``existing`` tensors, such as blocks of the inputs, are not new)."""
    with _Storages() as log:
        fn()
    old = {t.untyped_storage().data_ptr() for t in existing}
    return [b for ptr, b in log.sizes.items() if b >= full_bytes // 2 and ptr not in old]


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_no_full_size_temporary(beta: float) -> None:
    n, vocab = 256, 4096  # a block of rows is a quarter of the whole here
    z, w = pair(n, vocab, seed=16)
    full = n * vocab * 4
    assert _big(lambda: klpen.generalized_jsd(z, w, beta=beta), full, z, w) == []
    x = z.clone().requires_grad_()
    out = klpen.generalized_jsd(x, w, beta=beta)
    # backward: the student's gradient itself, once, and nothing else of that size
    backward = out.sum().backward
    assert _big(backward, full, x, w) == [full]
