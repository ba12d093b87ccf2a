"""benchmarks/trainer.py runs at its smallest size and prints a table with every comparison."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from benchmark_runs import tiny_run

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "trainer.py"


def _row_names() -> list[str]:
    spec = importlib.util.spec_from_file_location("_bench_trainer", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
    return list(module.ROW_NAMES)


def test_tiny_run_prints_every_row() -> None:
    out = tiny_run(SCRIPT, "--repeats", "1")
    names = _row_names()
    assert len(names) == 6
    table = [line for line in out.splitlines() if line.startswith("| ")]
    assert table[0].startswith("| comparison |")
    for name in names:
        rows = [line for line in table if line.startswith(f"| {name} |")]
        assert len(rows) == 1, name
        cells = [c.strip() for c in rows[0].strip("|").split("|")]
        assert len(cells) == 8, rows[0]
        # Either measured (a ratio and a verdict) or a stated reason, never an empty row.
        if cells[-1] in ("yes", "NO") or cells[-2] == "-":  # measured (with or without target)
            assert float(cells[3]) > 0
        else:
            assert cells[-1] == "-"
            assert cells[3].startswith(("failed:", "unavailable")), cells[3]
    # klpen eager against compiled plain torch needs nothing new from klpen: always measured.
    context = next(line for line in table if line.startswith(f"| {names[3]} |"))
    assert "failed" not in context and "unavailable" not in context, context
    assert "Compilation (the first call" in out
    written = ROOT / "benchmarks" / "results" / "trainer-tiny.md"
    assert written.read_text() in out


@pytest.mark.skipif(
    tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) < (2, 13),
    reason="torch.compile is tested with torch >= 2.13 (torch 2.4's compiler fails itself)",
)
def test_rounds_script_prints_its_variants_with_an_interval_around_each_ratio() -> None:
    out = tiny_run(ROOT / "benchmarks" / "rounds.py")
    rows = [line for line in out.splitlines() if line.startswith("| ") and "ms" not in line]
    assert [row.split(" | ")[0] for row in rows] == [
        "| eager",
        "| compiled, default mode",
        "| compiled, fullgraph=True",
        "| eager, validation off",
    ]
    for row in rows[1:]:
        cells = row.strip("| ").split(" | ")
        low, high = (float(c) for c in cells[4].split("–"))
        assert low <= float(cells[3]) <= high, row
        assert all(float(c) > 0 for c in cells[1:4] + cells[5:]), row


def test_the_median_interval_is_the_binomial_one(monkeypatch: pytest.MonkeyPatch) -> None:
    # n = 100: the 40th and 61st of the sorted values (the classic table's ranks for 95 %);
    # 3 values are too few for 95 %: the whole range
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from rounds import median_interval  # type: ignore[import-not-found]

    values = [float(v) for v in range(100, 0, -1)]
    assert median_interval(values) == (40.0, 61.0)
    assert median_interval([3.0, 1.0, 2.0]) == (1.0, 3.0)
    # P(B <= 5) for B ~ Binomial(20, 1/2) is 0.0207 and P(B <= 6) is 0.0577: ranks 6 and 15
    assert median_interval([float(v) for v in range(1, 21)]) == (6.0, 15.0)
