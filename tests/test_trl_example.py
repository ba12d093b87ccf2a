"""examples/trl_grpo.py: klpen's terms inside TRL's GRPOTrainer give TRL's own numbers.

Stock TRL and the klpen subclass train the same tiny model for 3 steps on the same seed, in
fp32; every logged loss and KL (and the entropy, the clip ratios) must agree to 1e-6, and the
loss each step returns to the optimizer too. The KL must really be exercised: from step 2 on
the policy has moved, so the logged KL is positive.
"""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("trl")
pytest.importorskip("datasets")

ROOT = Path(__file__).resolve().parents[1]

# transformers 5.24 deprecates names that TRL 1.16 still calls; not klpen's warnings.
pytestmark = pytest.mark.filterwarnings(
    "ignore:.*gradient_checkpointing.*:FutureWarning",
    "ignore:.*is_gradient_checkpointing.*:FutureWarning",
)


def _example() -> Any:
    spec = importlib.util.spec_from_file_location("trl_grpo", ROOT / "examples" / "trl_grpo.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["trl_grpo"] = module
    spec.loader.exec_module(module)
    return module


def _recording(base: type) -> tuple[type, list[float]]:
    """``base`` with the loss each step returns recorded (TRL's behaviour otherwise unchanged)."""
    losses: list[float] = []

    class Recording(base):  # type: ignore[misc, valid-type]
        def compute_loss(self, *args: Any, **kwargs: Any) -> Any:
            loss = super().compute_loss(*args, **kwargs)
            losses.append(float(loss.detach()))
            return loss

    return Recording, losses


@pytest.fixture(scope="module")
def runs() -> dict[str, Any]:
    import torch
    from trl import GRPOTrainer

    example = _example()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        stock, stock_losses = _recording(GRPOTrainer)
        ours, our_losses = _recording(example.KLPenGRPOTrainer)
        return {
            "stock": example.train(trainer_class=stock),
            "klpen": example.train(trainer_class=ours),
            "stock_losses": stock_losses,
            "klpen_losses": our_losses,
        }
    finally:
        torch.set_num_threads(threads)


def test_three_steps_logged(runs: dict[str, Any]) -> None:
    assert len(runs["stock"]) == len(runs["klpen"]) == 3
    assert len(runs["stock_losses"]) == len(runs["klpen_losses"]) == 3
    kls = [row["kl"] for row in runs["stock"]]
    assert kls[0] == 0.0  # step 1: the policy is the reference
    assert all(kl > 1e-3 for kl in kls[1:]), kls  # then it has moved: the KL term is exercised


@pytest.mark.parametrize(
    "key",
    [
        "loss",
        "kl",
        "entropy",
        "clip_ratio/low_mean",
        "clip_ratio/high_mean",
        "clip_ratio/region_mean",
        "reward",
    ],
)
def test_logged_metrics_equal_stock_trl_in_fp32(runs: dict[str, Any], key: str) -> None:
    for step, (theirs, ours) in enumerate(zip(runs["stock"], runs["klpen"], strict=True)):
        assert math.isfinite(ours[key]), (step, key)
        assert abs(ours[key] - theirs[key]) <= 1e-6, (step, key, ours[key], theirs[key])


def test_returned_losses_equal_stock_trl_in_fp32(runs: dict[str, Any]) -> None:
    for theirs, ours in zip(runs["stock_losses"], runs["klpen_losses"], strict=True):
        assert abs(ours - theirs) <= 1e-6, (ours, theirs)


def test_unsupported_configurations_fall_back_to_trl() -> None:
    example = _example()
    trainer = example.KLPenGRPOTrainer.__new__(example.KLPenGRPOTrainer)
    trainer.loss_type = "cispo"
    assert not trainer._klpen_handles_loss()


def test_the_script_prints_one_json_line_per_step() -> None:
    import json
    import os
    import subprocess

    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "trl_grpo.py"), "--steps", "2"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith('{"')]
    assert len(rows) == 2 and all({"loss", "kl", "entropy"} <= set(row) for row in rows)
