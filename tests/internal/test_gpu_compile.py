"""Every Triton kernel variant klpen launches compiles for sm_80 and sm_90, without a GPU.

The launches come from the backends themselves: their methods are driven over dtypes, flags
and layouts (:func:`~klpen.kernels.triton_compile.backend_launches`) and the public functions
are called with the Triton backend forced, inside :func:`~klpen.kernels.triton_launch.recording`,
so that the kernels of every ``klpen.kernels.triton_*`` module that a public function reaches
are among them. Each distinct variant (Triton's own specialisation of the arguments, per
target) is compiled by ``triton.compile`` for ``GPUTarget("cuda", 80 | 90, 32)`` into a fresh
cache, in processes without ``TRITON_INTERPRET``: Triton's front end, LLVM and the wheel's
``ptxas``. Fails on any compile error and on any register spill outside float64 variants;
``KLPEN_COMPILE_TABLE=path`` writes the per-kernel table (registers, spills, shared memory).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import pkgutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import klpen

pytestmark = pytest.mark.skipif(
    "triton" not in klpen.available_backends(),
    reason="needs Triton >= 3.9 and TRITON_INTERPRET=1 (to drive the public functions)",
)

if "triton" in klpen.available_backends():
    from klpen.kernels import triton_compile
    from klpen.kernels.triton_launch import Launch, recording
else:  # pragma: no cover
    triton_compile = None  # type: ignore[assignment]


def _triton_modules() -> list[Any]:
    import klpen.kernels as kernels

    names = [m.name for m in pkgutil.iter_modules(kernels.__path__) if m.name.startswith("triton_")]
    return [importlib.import_module(f"klpen.kernels.{name}") for name in sorted(names)]


def _kernels() -> set[tuple[str, str]]:
    """Every ``triton.jit`` kernel (a name ending in ``_kernel``) of the Triton modules."""
    found = set()
    for module in _triton_modules():
        for name, obj in vars(module).items():
            if name.endswith("_kernel") and hasattr(obj, "fn") and hasattr(obj, "arg_names"):
                found.add((module.__name__, name))
    return found


def _public_calls() -> list[Callable[[], Any]]:
    """Public functions, forward and backward, on small CPU tensors (run by the interpreter)."""
    torch.manual_seed(0)
    n, vocab, hidden = 3, 100, 8
    z = torch.randn(2, n, vocab, requires_grad=True)
    w = torch.randn(2, n, vocab)
    tok = torch.randint(0, vocab, (2, n))
    h = torch.randn(2, n, hidden, requires_grad=True)
    weight = torch.randn(vocab, hidden, requires_grad=True)

    def backward(out: Any) -> None:
        total = sum(o.sum() for o in (out if isinstance(out, tuple) else (out,)))
        total.backward()

    calls: list[Callable[[], Any]] = [
        lambda: backward(klpen.get_logprobs_for_tokens(z, tok)),
        lambda: backward(klpen.logprobs_and_entropy(z, tok)),
        lambda: backward(klpen.token_entropy(z)),
        lambda: backward(klpen.full_kl(z, w)),
        lambda: backward(klpen.linear_logprobs(h, weight, tok)),
        lambda: backward(klpen.linear_full_kl(h, weight, h.detach(), weight.detach())),
    ]
    if hasattr(klpen, "generalized_jsd"):
        calls.append(lambda: backward(klpen.generalized_jsd(z, w.requires_grad_())))
    if hasattr(klpen, "linear_generalized_jsd"):
        calls.append(
            lambda: backward(klpen.linear_generalized_jsd(h, weight, h.detach(), weight.detach()))
        )
    return calls


@pytest.fixture(scope="module")
def launches() -> list[Launch]:
    recorded = triton_compile.backend_launches()
    with klpen.use_backend("triton"), recording(run=True) as public:
        for call in _public_calls():
            call()
    return recorded + public


@pytest.fixture(scope="module")
def compiled(
    launches: list[Launch], tmp_path_factory: pytest.TempPathFactory
) -> list[triton_compile.Compiled]:
    specs = triton_compile.specs_for(launches)
    cache = tmp_path_factory.mktemp("triton-cache")
    results = triton_compile.compile_all(specs, str(cache), workers=2)
    table = os.environ.get("KLPEN_COMPILE_TABLE")
    if table:
        Path(table).write_text(triton_compile.summary(results) + "\n")
    return results


def test_every_kernel_is_launched(launches: list[Launch]) -> None:
    launched = {(k.kernel.fn.__module__, k.kernel.fn.__name__) for k in launches}
    missing = _kernels() - launched
    assert not missing, f"kernels no backend call launched (so never compiled): {missing}"


def test_every_variant_compiles_for_both_targets(compiled: list[triton_compile.Compiled]) -> None:
    failed = [f"{r.spec.label} sm_{r.spec.capability}: {r.error}" for r in compiled if r.error]
    assert not failed, "\n\n".join(failed[:5]) + f"\n\n({len(failed)} of {len(compiled)} failed)"
    targets = {r.spec.capability for r in compiled}
    assert targets == set(triton_compile.TARGETS)
    # each variant was compiled for each target
    per_target = {
        cc: {(r.spec.name, r.spec.signature) for r in compiled if r.spec.capability == cc}
        for cc in targets
    }
    assert per_target[80] == per_target[90]
    assert all(r.registers > 0 for r in compiled)


def test_no_spill_outside_float64(compiled: list[triton_compile.Compiled]) -> None:
    spilled = [
        f"{r.spec.label} sm_{r.spec.capability}: {r.spill_stores} B stored, {r.registers} regs"
        for r in compiled
        if r.error is None and not triton_compile.is_float64(r.spec) and r.spill_stores
    ]
    assert not spilled, "\n".join(spilled)


def test_the_wide_layouts_reach_the_kernels(launches: list[Launch]) -> None:
    """Vocabulary offsets past 2^31 (``(V - 1) · stride_v``) and an i64 stride argument."""
    strides = {
        (n, a.shape[-1], a.stride(-1))
        for k in launches
        for n, a in enumerate(k.args)
        if isinstance(a, torch.Tensor) and a.dim() == 2 and n < 2
    }
    assert any((v - 1) * s >= 1 << 31 and s < 1 << 31 for _, v, s in strides)
    specs = triton_compile.specs_for(launches, targets=(90,))
    assert any(t == "i64" and n.endswith("_v") for s in specs for n, t in s.signature)


def test_the_inverse_temperature_is_a_float64_argument(launches: list[Launch]) -> None:
    """``scale`` (``1/T``) and the JSD's ``beta`` and ``cbeta`` (``1 - β``) reach every kernel as
    float64 arguments (a ``tl.float64`` annotation; a Python float would be passed as fp32),
    so that float64 logits at any temperature use ``1/T`` unrounded and ``1 - β`` near an end
    keeps its digits; each kernel casts it once to its compute dtype."""
    specs = triton_compile.specs_for(launches, targets=(90,))
    names = ("scale", "beta", "cbeta")
    typed = {(s.name, n, t) for s in specs for n, t in s.signature if n in names}
    assert typed, "no kernel takes a scale argument"
    wrong = sorted(x for x in typed if x[2] != "fp64")
    assert not wrong, f"float arguments not passed as float64: {wrong}"


def test_the_mixture_takes_its_logarithm_from_the_sfu(
    launches: list[Launch], tmp_path: Path
) -> None:
    """In float32 between ``β = 1/16`` and ``15/16`` (``MODE`` 2) the compiled JSD kernels take
    the mixture's logarithm from the special-function unit, one ``MUFU.LG2`` per entry in
    the SASS (the interpreter only models its error: ``triton_jsd._lg2_sfu``); nearer an end
    (``MODE`` 3), where its absolute error would cost the digits of a divergence of the size
    of ``min(β, 1 - β)``, and in float64, they keep an accurate logarithm without it."""
    chosen: dict[tuple[str, int, bool], Any] = {}
    for spec in triton_compile.specs_for(launches, targets=(90,)):
        names = dict(enumerate(n for n, _ in spec.signature))
        consts = {names[p[0]]: v for p, v in spec.constexprs}
        if spec.name.startswith("_jsd_") and consts.get("BLOCK", 0) >= 1024:
            key = (spec.name, consts["MODE"], "fp64" in str(consts["DT"]))
            chosen.setdefault(key, spec)
    wanted = [
        (name, mode, wide)
        for name in ("_jsd_fwd_kernel", "_jsd_bwd_kernel")
        for mode, wide in ((2, False), (3, False), (2, True))
    ]
    assert all(key in chosen for key in wanted), sorted(chosen)
    results = triton_compile.compile_all(
        [chosen[key] for key in wanted], str(tmp_path), keep_cubin=True
    )
    for key, result in zip(wanted, results, strict=True):
        assert result.error is None and result.cubin is not None, result.error
        uses_sfu = "MUFU.LG2" in triton_compile.sass(result.cubin)
        assert uses_sfu == (key[1:] == (2, False)), key
