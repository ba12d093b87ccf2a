"""benchmarks/linear.py runs at its smallest size and reports every case at each thread count."""

from __future__ import annotations

import math
import re
from pathlib import Path

from benchmark_runs import tiny_run

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "linear.py"
CASES = [
    f"{kind} {dtype}"
    for kind in ("logprobs fwd", "logprobs fwd+bwd", "logprobs fwd+bwd frozen-head", "full_kl fwd")
    for dtype in ("fp32", "bf16")
]


def test_tiny_run_reports_each_case_and_product_speed_per_thread_count() -> None:
    out = tiny_run(SCRIPT, "--threads", "1,2", "--repeats", "1", timeout=600)
    assert out.count("matrix products, GFLOP/s") == 2
    assert out.count("| product | fp32 | bf16 |") == 2
    assert "**1 thread(s)**" in out and "**2 thread(s)**" in out
    for case in CASES:
        rows = [line for line in out.splitlines() if line.startswith(f"| {case} |")]
        assert len(rows) == 2, case
        # ratio, best ratio and the fused GFLOP/s are numbers; memory only at the machine's count
        for row in rows:
            cells = [c.strip() for c in row.strip("|").split("|")]
            assert re.fullmatch(r"\d+\.\d\dx", cells[3]) and re.fullmatch(r"\d+", cells[7])
    products = (
        "one large hidden @ weight.T",
        "torch's product at the tile shape",
        "logits tiles",
        "weight-gradient tiles",
    )
    for name in products:
        rows = [line for line in out.splitlines() if line.startswith(f"| {name} |")]
        assert len(rows) == 2, name
        for row in rows:  # a speed per dtype
            cells = [c.strip() for c in row.strip("|").split("|")]
            assert len(cells) == 3 and all(re.fullmatch(r"\d+", c) for c in cells[1:]), row
    # the same tiles at both thread counts; a bf16 tile holds a quarter of the logits
    shapes = [line for line in out.splitlines() if line.startswith("| tile shape")]
    assert len(shapes) == 2 and shapes[0] == shapes[1]
    fp32, bf16 = (
        math.prod(int(n) for n in cell.split(" x ")) for cell in shapes[0].strip("|").split("|")[1:]
    )
    assert fp32 == 4 * bf16


def test_cases_selects_the_rows_and_the_products_dtypes() -> None:
    out = tiny_run(SCRIPT, "--threads", "1", "--repeats", "1", "--cases", "bf16", timeout=600)
    assert "| product | bf16 |" in out and "fp32" not in out
    assert sum(line.startswith("| logprobs fwd") for line in out.splitlines()) == 3
