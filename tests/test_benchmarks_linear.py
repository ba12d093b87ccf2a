"""benchmarks/linear.py runs at its smallest size and reports every case at each thread count."""

from __future__ import annotations

import re
from pathlib import Path

from benchmark_runs import tiny_run

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "linear.py"
CASES = [
    f"{kind} {dtype}"
    for kind in ("logprobs fwd", "logprobs fwd+bwd", "full_kl fwd")
    for dtype in ("fp32", "bf16")
]


def test_tiny_run_reports_each_case_and_product_speed_per_thread_count() -> None:
    out = tiny_run(SCRIPT, "--threads", "1,2", "--repeats", "1", timeout=600)
    assert out.count("matrix products, fp32, GFLOP/s") == 2
    assert "**1 thread(s)**" in out and "**2 thread(s)**" in out
    for case in CASES:
        rows = [line for line in out.splitlines() if line.startswith(f"| {case} |")]
        assert len(rows) == 2, case
        # ratio, best ratio and the fused GFLOP/s are numbers; memory only at the machine's count
        for row in rows:
            cells = [c.strip() for c in row.strip("|").split("|")]
            assert re.fullmatch(r"\d+\.\d\dx", cells[3]) and re.fullmatch(r"\d+", cells[7])
    for name in ("one large hidden @ weight.T", "logits tiles", "weight-gradient tiles"):
        assert out.count(f"| {name}") == 2
