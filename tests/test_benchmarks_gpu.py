"""benchmarks/gpu.py runs at --size tiny on a CPU under Triton's interpreter, before any GPU."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch
from benchmark_runs import tiny_run

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "gpu.py"


def _supported_triton() -> bool:
    if importlib.util.find_spec("triton") is None:
        return False
    from klpen.kernels.triton_backend import version_supported

    return version_supported()


pytestmark = pytest.mark.skipif(not _supported_triton(), reason="Triton >= 3.9 is not installed")


def test_tiny_run_prints_the_table_with_the_triton_backend(tmp_path: Path) -> None:
    out = tiny_run(SCRIPT, cwd=tmp_path, TRITON_INTERPRET="1")
    rows = [line for line in out.splitlines() if line.startswith("| ")]
    assert rows[0].startswith("| N | V | case | implementation |")
    cases = {(r.split("|")[3].strip(), r.split("|")[4].strip()) for r in rows[1:]}
    for mode in ("fwd", "fwd+bwd"):
        for case in (
            f"logprobs {mode}",
            f"logprobs+entropy {mode}",
            f"full_kl {mode} (random)",
            f"full_kl {mode} (near)",
            f"hidden logprobs {mode}",
        ):
            assert any(c[0] == case and c[1].startswith("naive") for c in cases), case
            assert any(c[0] == case and "klpen" in c[1] for c in cases), case
    # a failing implementation is reported by name, never as a silently missing row
    assert "failed" not in out.lower(), out[-3000:]
    # every peer is either timed or named with the reason it is skipped
    for peer in ("trl.selective_log_softmax", "liger.KLDIVLoss", "verl.linear_cross_entropy"):
        timed = any(c[1] == peer for c in cases)
        assert timed or f"peer skipped: {peer} (" in out, peer


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs the interpreter")
def test_each_call_starts_from_no_gradient() -> None:
    """Two calls of a fwd+bwd case leave the gradient of one call (reset, not accumulated),
    and the near reference is near: per-token KL between 1e-4 and 1e-2 on peaked rows."""
    spec = importlib.util.spec_from_file_location("gpu_bench", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    inputs = module._inputs(16, 300, 32, torch.device("cpu"))
    cases = module._cases(16, 300, 32, torch.device("cpu"), inputs)
    for quantity, leaf in (("logprobs fwd+bwd", "logits"), ("hidden logprobs fwd+bwd", "hidden")):
        case = next(c for c in cases if c.quantity == quantity and c.implementation != "naive")
        case.call()
        once = inputs[leaf].grad.clone()
        case.call()
        torch.testing.assert_close(inputs[leaf].grad, once, rtol=0, atol=0)
    p = torch.log_softmax(inputs["peaked"].double(), -1)
    q = torch.log_softmax(inputs["near"].double(), -1)
    kl = (p.exp() * (p - q)).sum(-1)
    assert (p.exp().amax(-1) > 0.5).all()
    assert 1e-4 <= kl.median() <= 1e-2, kl


def test_gpu_model_prints_the_predicted_table(tmp_path: Path) -> None:
    """benchmarks/gpu_model.py compiles the paths' kernels for sm_90, reads their SASS and
    prints one row per path with its instructions per element and predicted ratio."""
    out = tiny_run(ROOT / "benchmarks" / "gpu_model.py", cwd=tmp_path, timeout=900)
    rows = [line for line in out.splitlines() if line.startswith("| ")]
    assert rows[0].startswith("| path | kernel (registers) |")
    paths = {r.split("|")[1].strip(): r for r in rows[1:]}
    for path in (
        "logprobs fwd+bwd",
        "entropy fwd+bwd",
        "logprobs+entropy fwd+bwd",
        "full_kl fwd+bwd (ordinary)",
        "full_kl fwd+bwd (peaked, +3)",
        "hidden tiles: kl",
        "jsd β=0.5 fwd+bwd",
        "jsd β=1 fwd+bwd, both grads",
    ):
        cells = [c.strip() for c in paths[path].split("|")[1:-1]]
        assert float(cells[3]) >= 1.0 - 1e-9  # bytes: never below the minimum
        assert float(cells[6]) >= 1.0 - 1e-9  # time: never below the bandwidth time
    assert "predictions from the compiled code, not measured" in out
