"""What a trainer imports: the version, and ``klpen.distributed`` reachable from ``import klpen``.

Both are lines of ``klpen/__init__.py``: the version imported from ``klpen/_version.py``, and a
module ``__getattr__`` that imports ``klpen.distributed`` on first use.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _fresh(code: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )


def test_version_comes_from_the_one_place() -> None:
    import klpen
    from klpen import _version

    assert klpen.__version__ is _version.__version__


def test_import_klpen_reaches_distributed_in_a_fresh_process() -> None:
    done = _fresh(
        "import sys, klpen\n"
        "assert 'klpen.distributed' not in sys.modules  # lazy: not loaded by import klpen\n"
        "f = klpen.distributed.aggregate\n"
        "assert callable(f) and 'klpen.distributed' in sys.modules\n"
        "assert 'distributed' in dir(klpen)\n"
    )
    assert done.returncode == 0, done.stderr[-2000:]


def test_an_unknown_attribute_is_still_an_attribute_error() -> None:
    done = _fresh(
        "import klpen\n"
        "try:\n    klpen.no_such_name\nexcept AttributeError as e:\n    print('ok', e)\n"
    )
    assert done.returncode == 0 and done.stdout.startswith("ok"), done.stderr[-2000:]
    assert "no_such_name" in done.stdout
