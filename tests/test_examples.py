"""The standalone example runs as a reader would run it, and shows what it promises."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str) -> tuple[dict[str, float], str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "tiny_rlhf.py"), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.strip().splitlines()
    return json.loads(lines[-1]), done.stdout


@pytest.mark.slow
def test_tiny_rlhf_penalty_keeps_text_fluent_and_no_penalty_hacks() -> None:
    penalised, log = _run("--steps", "25")  # k1 in the reward, β = 0.5
    assert "samples:" in log
    assert penalised["well_formed"] >= 0.7
    assert penalised["exact_kl"] < 5.0
    # The sampled k1 and the exact KL agree to within the batch's noise.
    assert abs(penalised["sampled_kl"] - penalised["exact_kl"]) < 1.0
    hacked, _ = _run("--steps", "25", "--kl-coef", "0")
    assert hacked["proxy_reward"] > 2 * penalised["proxy_reward"]
    assert hacked["well_formed"] <= 0.1
    assert hacked["exact_kl"] > 5 * penalised["exact_kl"]


def test_distill_example_lowers_the_kl_and_bounds_hold() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "distill.py"), "--steps", "60"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["on_policy_kl"] < 0.5 * summary["start_kl"]
    assert summary["gkd_kl"] < 0.5 * summary["start_kl"]
    for k in (1, 5, 20):
        assert summary[f"top{k}_lower"] <= summary["exact_forward_kl"] <= summary[f"top{k}_upper"]
    assert (
        summary["top20_upper"] - summary["top20_lower"]
        < summary["top1_upper"] - summary["top1_lower"]
    )
