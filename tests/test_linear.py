"""linear_logprobs / linear_full_kl: the fused output layer against the unfused logits path.

References: ``hidden @ weight.T + bias`` then klpen's logits functions and torch's own
``log_softmax`` / ``torch.distributions.Categorical``, in float64. Small tiles (monkeypatched)
make every test walk several row blocks and vocabulary tiles.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import Tensor

import klpen
import klpen.kernels.torch_linear as lin
import klpen.linear
from klpen.linear import linear_full_kl, linear_logprobs


@pytest.fixture(autouse=True)
def small_tiles(monkeypatch: pytest.MonkeyPatch) -> None:
    # 3 rows x 16 vocabulary entries per tile: many tiles, ragged edges, several row blocks.
    monkeypatch.setattr(lin, "CHUNK_ELEMENTS", 48)
    monkeypatch.setattr(lin, "_MAX_TILE_ROWS", 3)
    monkeypatch.setattr(lin, "_MIN_TILE_COLS", 1)


def _layer(
    seed: int, shape: tuple[int, ...], h: int, v: int, dtype: torch.dtype = torch.float64
) -> tuple[Tensor, Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*shape, h, generator=g, dtype=torch.float64)
    weight = torch.randn(v, h, generator=g, dtype=torch.float64) / math.sqrt(h) * 3
    bias = torch.randn(v, generator=g, dtype=torch.float64)
    return hidden.to(dtype), weight.to(dtype), bias.to(dtype)


def _unfused(hidden: Tensor, weight: Tensor, bias: Tensor | None, t: float) -> Tensor:
    logits = hidden @ weight.T
    return (logits if bias is None else logits + bias) / t


def _grads(out: Tensor, inputs: tuple[Tensor, ...], seed: int) -> tuple[Tensor, ...]:
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    g = g.to(out.dtype)
    return torch.autograd.grad((out * g).sum(), inputs, retain_graph=True)


@given(
    seed=st.integers(0, 2**16),
    shape=st.sampled_from([(5,), (2, 7), (1, 1), (3, 1, 4)]),
    h=st.integers(1, 9),
    v=st.integers(1, 40),
    t=st.sampled_from([1.0, 0.7, 2.5]),
    use_bias=st.booleans(),
)
def test_logprobs_and_entropy_match_unfused(
    seed: int, shape: tuple[int, ...], h: int, v: int, t: float, use_bias: bool
) -> None:
    x, w, b = (a.requires_grad_() for a in _layer(seed, shape, h, v))
    bias = b if use_bias else None
    tokens = torch.randint(0, v, shape, generator=torch.Generator().manual_seed(seed))
    lp, ent = linear_logprobs(x, w, tokens, bias=bias, temperature=t, return_entropy=True)
    logits = _unfused(x, w, bias, t)
    ref_lp = klpen.get_logprobs_for_tokens(logits, tokens)
    ref_ent = torch.distributions.Categorical(logits=logits).entropy()
    torch.testing.assert_close(lp, ref_lp, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ent, ref_ent, rtol=1e-12, atol=1e-12)
    assert bool((lp <= 0).all())
    inputs = (x, w, b) if use_bias else (x, w)
    for out, ref in ((lp, ref_lp), (ent, ref_ent), (lp + 2 * ent, ref_lp + 2 * ref_ent)):
        for got, exp in zip(_grads(out, inputs, seed), _grads(ref, inputs, seed), strict=True):
            torch.testing.assert_close(got, exp, rtol=1e-10, atol=1e-10)


def test_fp32_value_and_gradient_within_rounding_of_float64() -> None:
    x, w, b = _layer(1, (4, 9), 16, 50)
    tokens = torch.randint(0, 50, (4, 9), generator=torch.Generator().manual_seed(1))
    x32, w32, b32 = (a.float().requires_grad_() for a in (x, w, b))
    lp = linear_logprobs(x32, w32, tokens, bias=b32)
    assert lp.dtype == torch.float32
    ref = klpen.get_logprobs_for_tokens(_unfused(x, w, b, 1.0), tokens)
    torch.testing.assert_close(lp.double(), ref, rtol=1e-5, atol=1e-5)
    x64, w64, b64 = (a.clone().requires_grad_() for a in (x, w, b))
    ref = klpen.get_logprobs_for_tokens(_unfused(x64, w64, b64, 1.0), tokens)
    for got, exp in zip(
        _grads(lp, (x32, w32, b32), 2), _grads(ref, (x64, w64, b64), 2), strict=True
    ):
        torch.testing.assert_close(got.double(), exp, rtol=1e-4, atol=1e-5)


def test_bf16_is_computed_in_fp32_and_beats_the_unfused_bf16_path() -> None:
    x, w, b = _layer(3, (64,), 32, 200, torch.bfloat16)
    tokens = torch.randint(0, 200, (64,), generator=torch.Generator().manual_seed(3))
    xg, wg, bg = (a.clone().requires_grad_() for a in (x, w, b))
    lp, ent = linear_logprobs(xg, wg, tokens, bias=bg, return_entropy=True)
    assert lp.dtype == ent.dtype == torch.float32
    exact_logits = _unfused(x.double(), w.double(), b.double(), 1.0)
    exact = klpen.get_logprobs_for_tokens(exact_logits, tokens)
    err = (lp.double() - exact).abs().max().item()
    unfused = klpen.get_logprobs_for_tokens(x @ w.T + b, tokens)  # bf16 logits
    err_unfused = (unfused.double() - exact).abs().max().item()
    assert err < 1e-5 < err_unfused
    torch.testing.assert_close(
        ent.double(),
        torch.distributions.Categorical(logits=exact_logits).entropy(),
        rtol=1e-5,
        atol=1e-5,
    )
    gx, gw, gb = _grads(lp, (xg, wg, bg), 4)
    assert gx.dtype == gw.dtype == gb.dtype == torch.bfloat16
    x64, w64, b64 = (a.double().requires_grad_() for a in (x, w, b))
    ref = klpen.get_logprobs_for_tokens(_unfused(x64, w64, b64, 1.0), tokens)
    for got, exp in zip((gx, gw, gb), _grads(ref, (x64, w64, b64), 4), strict=True):
        # one bf16 rounding of the result, nothing more
        torch.testing.assert_close(got.double(), exp, rtol=1e-2, atol=1e-2 * exp.abs().max().item())


def test_masked_vocabulary_and_extreme_rows() -> None:
    x, w, b = _layer(5, (6,), 8, 30)
    b[::3] = -math.inf  # a bias masking every third entry
    x[1] *= 1e4  # logits of size 1e4: the shift-free sums overflow
    x[2] *= 1e-6
    tokens = torch.tensor([0, 1, 2, 4, 5, 7])  # token 0 is masked: log-prob -inf
    xg, wg, bg = (a.clone().requires_grad_() for a in (x, w, b))
    lp, ent = linear_logprobs(xg, wg, tokens, bias=bg, return_entropy=True)
    logits = _unfused(x, w, b, 1.0)
    ref = torch.log_softmax(logits, -1).gather(-1, tokens[:, None]).squeeze(-1)
    assert lp[0].item() == -math.inf
    torch.testing.assert_close(lp[1:], ref[1:], rtol=1e-12, atol=1e-9)
    ref_ent = torch.distributions.Categorical(logits=logits).entropy()  # clamps -inf: finite
    torch.testing.assert_close(ent, ref_ent, rtol=1e-9, atol=1e-9)
    (gx, gw, gb) = torch.autograd.grad((lp[1:].sum() + ent.sum()), (xg, wg, bg))
    assert all(bool(torch.isfinite(g).all()) for g in (gx, gw, gb))
    x64, w64 = x.clone().requires_grad_(), w.clone().requires_grad_()
    logits = _unfused(x64, w64, b, 1.0)
    ref_ent = torch.distributions.Categorical(logits=logits).entropy()
    ref = torch.log_softmax(logits, -1).gather(-1, tokens[:, None]).squeeze(-1)
    rx, rw = torch.autograd.grad(ref[1:].sum() + ref_ent.sum(), (x64, w64))
    torch.testing.assert_close(gx, rx, rtol=1e-8, atol=1e-8)
    torch.testing.assert_close(gw, rw, rtol=1e-8, atol=1e-8)


def test_token_with_all_the_mass_has_log_prob_exactly_zero() -> None:
    w = torch.eye(4) * 200.0
    lp = linear_logprobs(torch.eye(4), w, torch.arange(4))
    assert lp.tolist() == [0.0, 0.0, 0.0, 0.0]


@given(
    seed=st.integers(0, 2**16),
    v=st.integers(2, 40),
    t=st.sampled_from([1.0, 0.6]),
    ref_h=st.integers(1, 6),
)
def test_full_kl_matches_unfused_with_policy_only_gradients(
    seed: int, v: int, t: float, ref_h: int
) -> None:
    x, w, b = (a.requires_grad_() for a in _layer(seed, (2, 5), 7, v))
    rx, rw, rb = (a.requires_grad_() for a in _layer(seed + 1, (2, 5), ref_h, v))
    kl = linear_full_kl(x, w, rx, rw, bias=b, ref_bias=rb, temperature=t)
    ref = klpen.full_kl(_unfused(x, w, b, t), _unfused(rx, rw, rb, t).detach())
    torch.testing.assert_close(kl, ref, rtol=1e-10, atol=1e-12)
    for got, exp in zip(_grads(kl, (x, w, b), seed), _grads(ref, (x, w, b), seed), strict=True):
        torch.testing.assert_close(got, exp, rtol=1e-9, atol=1e-10)
    assert kl.grad_fn is not None
    assert torch.autograd.grad(kl.sum(), (rx, rw, rb), allow_unused=True) == (None, None, None)


def test_full_kl_identical_is_zero_and_near_identical_is_exact_in_fp32() -> None:
    x, w, b = _layer(7, (40,), 16, 300)
    x32, w32, b32 = x.float(), w.float(), b.float()
    assert linear_full_kl(x32, w32, x32, w32, bias=b32, ref_bias=b32).abs().max().item() == 0.0
    # One-hot hidden states make each logit an fp32 weight entry plus the bias, rounded once
    # as the unfused path rounds it: the fp32 logits are known exactly, and the KL of them,
    # computed in float64, is the reference (relative 1e-4 down to KL ~ 1e-8, contract 3).
    eye = torch.eye(16)
    noise = torch.randn(w.shape, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
    for scale, shift in ((1e-2, 0.0), (1e-3, 30.0), (1e-4, -30.0), (1e-5, 1e4)):
        w2 = (w + scale * noise).float()
        kl = linear_full_kl(eye, w32, eye, w2, bias=b32 + shift, ref_bias=b32 + shift)
        z = (eye @ w32.T + (b32 + shift)).double()
        z_ref = (eye @ w2.T + (b32 + shift)).double()
        exact = klpen.full_kl(z, z_ref)
        torch.testing.assert_close(kl.double(), exact, rtol=1e-4, atol=1e-10)
    assert exact.min().item() < 1e-7


@pytest.mark.parametrize(
    ("noise", "offset", "t", "redone"),
    [
        # one fp32 pass for divergences of 6e-2 down to 3e-4 per row, also with the
        # reference's logits offset by a constant (the centre takes it out) and at a
        # temperature; the rows the error estimate cannot promise (an offset rounds w - z,
        # 3e-5 with a peaked p) get float64 terms, and so do divergences below about 1e-6
        # and a reference offset by -57 after the temperature (w - z rounded by 4e-6)
        (0.3, 0.0, 1.0, "none"),
        (0.1, 5.0, 0.7, "none"),
        (3e-2, 0.0, 1.0, "none"),
        (3e-2, 5.0, 1.0, "some"),
        (1e-2, 0.0, 0.7, "some"),
        (3e-3, -40.0, 0.7, "all"),
        (3e-5, 2.0, 1.0, "all"),
    ],
)
def test_full_kl_one_fp32_pass_is_exact_and_float64_only_where_needed(
    monkeypatch: pytest.MonkeyPatch, noise: float, offset: float, t: float, redone: str
) -> None:
    redo_rows: list[int] = []
    float64_pass = lin._kl_sums

    def spy(policy: lin.Layer, reference: lin.Layer, shifts: object) -> object:
        redo_rows.append(policy.hidden.shape[0])
        return float64_pass(policy, reference, shifts)  # type: ignore[arg-type]

    monkeypatch.setattr(lin, "_kl_sums", spy)
    g = torch.Generator().manual_seed(21)
    n, h, v = 30, 8, 200
    _, w, b = _layer(21, (n,), h, v)
    w2 = w + noise * torch.randn(w.shape, generator=g, dtype=torch.float64)
    # one-hot hidden states: each logit is a weight entry plus the bias, rounded once (then
    # divided by the temperature), exactly as below, so the fp32 logits are known exactly
    x = torch.nn.functional.one_hot(torch.randint(0, h, (n,), generator=g), h).float()
    w32, b32, w232, b232 = (a.float() for a in (w, b, w2, b + offset))
    kl = linear_full_kl(x, w32, x, w232, bias=b32, ref_bias=b232, temperature=t)
    z = (torch.addmm(b32, x, w32.T) / t).double()
    z_ref = (torch.addmm(b232, x, w232.T) / t).double()
    torch.testing.assert_close(kl.double(), klpen.full_kl(z, z_ref), rtol=1e-4, atol=0.0)
    count = sum(redo_rows)
    assert {"none": count == 0, "some": 0 < count < n, "all": count == n}[redone]


def test_full_kl_fp32_error_is_that_of_the_fp32_logits() -> None:
    # With a real product, the fp32 rounding of the logits bounds any fp32 path: the fused
    # result is as close to float64 as the unfused fp32 one.
    x, w, b = _layer(12, (40,), 16, 300)
    w2 = w + 1e-3 * torch.randn(w.shape, generator=torch.Generator().manual_seed(13), dtype=w.dtype)
    exact = klpen.full_kl(_unfused(x, w, b, 1.0), _unfused(x, w2, b, 1.0))
    f32 = [a.float() for a in (x, w, b, w2)]
    fused = linear_full_kl(f32[0], f32[1], f32[0], f32[3], bias=f32[2], ref_bias=f32[2])
    unfused = klpen.full_kl(_unfused(*f32[:3], 1.0), _unfused(f32[0], f32[3], f32[2], 1.0))
    err = ((fused.double() - exact).abs() / exact).max().item()
    err_unfused = ((unfused.double() - exact).abs() / exact).max().item()
    assert err < 2 * err_unfused + 1e-5


def test_full_kl_masked_and_extreme_rows() -> None:
    x, w, b = _layer(9, (5,), 6, 20)
    rx, rw, rb = _layer(10, (5,), 6, 20)
    b[:4] = -math.inf  # the policy cannot emit these; the reference can
    x[0] *= 1e3
    rx[1] *= 1e3
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    kl = linear_full_kl(xg, wg, rx, rw, bias=b, ref_bias=rb)
    x64, w64 = x.clone().requires_grad_(), w.clone().requires_grad_()
    ref = klpen.full_kl(_unfused(x64, w64, b, 1.0), _unfused(rx, rw, rb, 1.0))
    torch.testing.assert_close(kl, ref, rtol=1e-10, atol=1e-10)
    for got, exp in zip(_grads(kl, (xg, wg), 1), _grads(ref, (x64, w64), 1), strict=True):
        assert bool(torch.isfinite(got).all())
        torch.testing.assert_close(got, exp, rtol=1e-8, atol=1e-8)


def test_default_tiles_never_hold_the_logits(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.undo()
    x, w, b = _layer(11, (1024,), 8, 5000, torch.float32)
    layer = klpen.linear.flat_layer(x, w, b, 1.0)
    rows, cols = lin._tile_shape(layer, lin.CHUNK_ELEMENTS)
    assert rows * cols <= lin.CHUNK_ELEMENTS and cols < 5000
    tokens = torch.randint(0, 5000, (1024,), generator=torch.Generator().manual_seed(11))
    ref = klpen.get_logprobs_for_tokens(x @ w.T + b, tokens)
    torch.testing.assert_close(linear_logprobs(x, w, tokens, bias=b), ref, rtol=1e-5, atol=1e-5)


BAD_CASES = [
    (dict(hidden=[1.0]), TypeError, "hidden must be a torch.Tensor"),
    (dict(hidden=torch.zeros(2, 3, dtype=torch.int64)), TypeError, "hidden must be a floating"),
    (dict(weight=torch.zeros(4, 5)), ValueError, "weight must have shape \\(V, H\\) with H = 3"),
    (dict(weight=torch.zeros(4, 3, 1)), ValueError, "weight must have shape \\(V, H\\)"),
    (dict(weight=torch.zeros(0, 3)), ValueError, "V >= 1"),
    (dict(bias=torch.zeros(5)), ValueError, "bias must have shape \\(4,\\)"),
    (dict(tokens=torch.tensor([0, 4])), ValueError, "tokens must lie in \\[0, 4\\)"),
    (dict(tokens=torch.tensor([0.0, 1.0])), TypeError, "tokens must hold integer"),
    (dict(tokens=torch.tensor([0, 1, 2])), ValueError, "tokens must have shape \\(2,\\)"),
    (dict(temperature=0.0), ValueError, "temperature must be finite and positive"),
    (dict(temperature=float("nan")), ValueError, "temperature must be finite"),
    (
        dict(hidden=torch.zeros(2, 3, device="meta")),
        TypeError,
        "hidden must hold data, got a meta tensor",
    ),
    (
        dict(weight=torch.zeros(4, 3).to_sparse()),
        TypeError,
        "weight must be a dense \\(strided\\) tensor, got layout torch.sparse",
    ),
    (dict(hidden=torch.tensor([[0.0, math.nan, 0.0], [0.0] * 3])), ValueError, "NaN"),
    (dict(weight=torch.full((4, 3), math.inf)), ValueError, "NaN or inf"),
    (dict(bias=torch.full((4,), -math.inf)), ValueError, "all -inf"),
]


@pytest.mark.parametrize(("change", "error", "match"), BAD_CASES)
def test_bad_input_is_refused_by_name(change: dict[str, object], error: type, match: str) -> None:
    args: dict[str, object] = dict(
        hidden=torch.ones(2, 3),
        weight=torch.ones(4, 3),
        tokens=torch.tensor([0, 1]),
        bias=None,
        temperature=1.0,
    )
    args.update(change)
    with pytest.raises(error, match=match):
        linear_logprobs(
            args["hidden"],
            args["weight"],
            args["tokens"],  # type: ignore[arg-type]
            bias=args["bias"],
            temperature=args["temperature"],  # type: ignore[arg-type]
        )


def test_full_kl_bad_input_names_the_reference() -> None:
    x, w = torch.ones(2, 3), torch.ones(4, 3)
    with pytest.raises(ValueError, match="ref_hidden must have shape \\(2, 5\\)"):
        linear_full_kl(x, w, torch.ones(3, 5), torch.ones(4, 5))
    with pytest.raises(ValueError, match="ref_weight must have shape \\(4, 5\\)"):
        linear_full_kl(x, w, torch.ones(2, 5), torch.ones(6, 5))
    with pytest.raises(ValueError, match="ref_bias must have shape"):
        linear_full_kl(x, w, x, w, ref_bias=torch.zeros(3))
    with pytest.raises(ValueError, match="NaN"):
        linear_full_kl(x, w, torch.full((2, 3), math.nan), w)


def test_fused_forward_allocates_one_tile_not_the_logits(monkeypatch: pytest.MonkeyPatch) -> None:
    from klpen_book.hidden_states import fused_scratch_bytes, measured_memory_table
    from klpen_book.memory import peak_extra_bytes

    monkeypatch.undo()
    n, h, v = 1024, 16, 32_000
    x, w, _ = _layer(14, (n,), h, v, torch.float32)
    tokens = torch.randint(0, v, (n,), generator=torch.Generator().manual_seed(14))
    peak = peak_extra_bytes(lambda: linear_logprobs(x, w, tokens))
    logits = 4 * n * v
    assert peak <= 1.05 * fused_scratch_bytes(n, h, v, half=False) < 0.15 * logits
    assert peak_extra_bytes(lambda: klpen.get_logprobs_for_tokens(x @ w.T, tokens)) > logits
    xb, wb = x.bfloat16(), w.bfloat16()
    peak = peak_extra_bytes(lambda: linear_logprobs(xb, wb, tokens))
    assert peak <= 1.05 * fused_scratch_bytes(n, h, v, half=True)
    assert "fused MB" in measured_memory_table(64, 8, 1000)


def test_empty_batch_and_empty_hidden_size() -> None:
    x = torch.zeros(0, 3, requires_grad=True)
    w, b = torch.ones(4, 3, requires_grad=True), torch.ones(4, requires_grad=True)
    lp = linear_logprobs(x, w, torch.zeros(0, dtype=torch.long), bias=b)
    assert lp.shape == (0,)
    gx, gw, gb = torch.autograd.grad(lp.sum(), (x, w, b))
    assert gx.shape == (0, 3) and gw.abs().sum().item() == 0.0 and gb.abs().sum().item() == 0.0
    assert linear_full_kl(x, w, x, w).shape == (0,)
    # H = 0: every logit is the bias
    bias = torch.tensor([0.0, 1.0, 2.0, 3.0])
    got = linear_logprobs(torch.zeros(2, 0), torch.zeros(4, 0), torch.tensor([1, 3]), bias=bias)
    torch.testing.assert_close(got, torch.log_softmax(bias, 0)[[1, 3]])


def test_memory_table_arithmetic() -> None:
    from klpen_book.hidden_states import hidden_state_memory_table

    lines = hidden_state_memory_table([32_768]).splitlines()
    gemma = next(line for line in lines if line.startswith("Gemma-2-2B")).split()
    # hidden bf16 2·N·H, logits bf16 2·N·V and fp32 4·N·V bytes, in MB / GB
    assert gemma[1:5] == ["32768", "151.0", "16.8", "33.6"]
    llama = next(line for line in lines if line.startswith("Llama-3-8B")).split()
    assert llama[2:5] == [f"{2 * 32768 * 4096 / 1e6:.1f}", "8.4", "16.8"]


@pytest.mark.parametrize("backend", klpen.available_backends())
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_every_backend_matches_the_unfused_float64_path(
    backend: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each backend's per-tile reductions (lin.TileOps) in every pass: the shift-free sums, the
    rows redone with their max (-inf bias entries, logits of 1e3), the entropy, the centred
    KL and its float64 rows (identical rows), and all three gradients of each."""
    x, w, b = _layer(21, (9,), 6, 70)
    b[::4] = -math.inf
    x[2] *= 1e3 / x[2].abs().max()
    rx = x + 0.1 * torch.randn(x.shape, generator=torch.Generator().manual_seed(21), dtype=x.dtype)
    rx[5] = x[5]
    tokens = torch.randint(0, 70, (9,), generator=torch.Generator().manual_seed(22))
    tokens[tokens % 4 == 0] += 1
    used: list[str] = []
    real = lin._tile_ops

    def spy(layer: lin.Layer, p: lin.Plan) -> lin.TileOps:
        ops = real(layer, p)
        used.append(type(ops).__name__)
        return ops

    monkeypatch.setattr(lin, "_tile_ops", spy)
    xg, wg, bg = (a.to(dtype).requires_grad_() for a in (x, w, b))
    with klpen.use_backend(backend):
        lp, ent = linear_logprobs(xg, wg, tokens, bias=bg, return_entropy=True)
        kl = linear_full_kl(xg, wg, rx.to(dtype), w.to(dtype), bias=bg, ref_bias=b.to(dtype))
    assert set(used) == {"TritonBackend" if backend == "triton" else "TorchTiles"}
    x64, w64, b64 = (a.clone().requires_grad_() for a in (x, w, b))
    logits = _unfused(x64, w64, b64, 1.0)
    ref_lp = klpen.get_logprobs_for_tokens(logits, tokens)
    ref_ent = torch.distributions.Categorical(logits=logits).entropy()
    ref_kl = klpen.full_kl(logits, _unfused(rx, w, b, 1.0))
    tol = 1e-10 if dtype == torch.float64 else 2e-4
    for got, want in ((lp, ref_lp), (ent, ref_ent), (kl, ref_kl)):
        torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)
    assert kl[5].item() == 0.0
    total, ref_total = lp.sum() + ent.sum() + kl.sum(), ref_lp.sum() + ref_ent.sum() + ref_kl.sum()
    with klpen.use_backend(backend):
        got_grads = torch.autograd.grad(total, (xg, wg, bg))
    want_grads = torch.autograd.grad(ref_total, (x64, w64, b64))
    for got, want in zip(got_grads, want_grads, strict=True):
        assert bool(torch.isfinite(got).all())
        # fp32: the logits of the 1e3 row carry rounding errors of 1e-4 (relative 1e-7)
        torch.testing.assert_close(got.double(), want, rtol=tol * 5, atol=tol * 10)
