"""benchmarks/gpu.py runs at --size tiny on a CPU under Triton's interpreter, before any GPU."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
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
    for case in ("logprobs fwd", "logprobs+entropy fwd", "full_kl fwd", "full_kl fwd+bwd"):
        assert (case, "naive") in cases, case
        assert (case, "klpen.triton") in cases, case
    # a failing implementation is reported by name, never as a silently missing row
    assert "failed" not in out.lower(), out[-3000:]
