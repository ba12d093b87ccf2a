"""Running a script of benchmarks/ at its smallest size, as the benchmark tests do."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def tiny_run(
    script: Path, *args: str, cwd: Path | None = None, timeout: float = 300, **env: str
) -> str:
    """The script's stdout at ``--size tiny``, klpen from src/, one OpenMP thread unless
    ``env`` says otherwise (``env`` adds to the environment); a failed run fails the test
    with the end of its stderr."""
    environ = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT / "src"))
    environ.update(env)
    done = subprocess.run(
        [sys.executable, str(script), "--size", "tiny", *args],
        capture_output=True,
        text=True,
        env=environ,
        cwd=cwd,
        timeout=timeout,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout
