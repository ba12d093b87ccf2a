"""README.md is tested like code: its Python examples run, its promises hold.

Every ```python block is executed, in order, in one namespace (a later block may use what an
earlier one defined), exactly as a reader would paste them. Snippets that are not meant to run
belong in other fences (```bash, ```text).
"""

from __future__ import annotations

import contextlib
import io
import math
import re
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
PYTHON_BLOCKS = re.findall(r"^```python\n(.*?)^```", README, flags=re.DOTALL | re.MULTILINE)


def test_readme_has_a_python_example() -> None:
    assert PYTHON_BLOCKS, "no ```python block found in README.md"
    # The fence regex must see every python block: count the opening fences independently.
    assert len(PYTHON_BLOCKS) == README.count("\n```python\n")


def test_readme_python_blocks_run_in_order() -> None:
    namespace: dict[str, object] = {"__name__": "__readme__"}
    out = io.StringIO()
    # Imports of torch and klpen are not what the example's speed claim is about.
    import torch  # noqa: F401

    import klpen  # noqa: F401

    start = time.perf_counter()
    with contextlib.redirect_stdout(out):
        for number, block in enumerate(PYTHON_BLOCKS, start=1):
            try:
                exec(compile(block, f"README.md python block {number}", "exec"), namespace)
            except Exception as err:  # pragma: no cover - the message is the point
                pytest.fail(f"README.md python block {number} failed: {err!r}")
    elapsed = time.perf_counter() - start
    # The PPO example prints one line per step, with a finite KL and a positive kl_coef.
    lines = [line for line in out.getvalue().splitlines() if line.startswith("step ")]
    assert len(lines) == 3
    for line in lines:
        match = re.search(r"KL ([-+]\d+\.\d+)  kl_coef (\d+\.\d+)$", line)
        assert match, line
        assert math.isfinite(float(match.group(1))) and float(match.group(2)) > 0
    # "Runs in well under 2 s on a CPU"; generous, since CI's two cores are shared.
    assert elapsed < 10.0


def test_readme_links_binder_to_an_existing_chapter() -> None:
    match = re.search(r"^\[binder\]: (\S+)$", README, flags=re.MULTILINE)
    assert match
    url = match.group(1)
    assert url.startswith("https://mybinder.org/v2/gh/klpen/klpen/main?urlpath=lab/tree/")
    assert (ROOT / url.split("urlpath=lab/tree/", 1)[1]).is_file()


def test_readme_covers_every_audience() -> None:
    for needle in (
        "https://klpen.github.io/klpen/",  # the book's address
        "make book",
        "make test",
        "pip install -e .",
        "[API reference][api]",
        "\n## Performance\n",
    ):
        assert needle in README, needle
    # The five names the README recommends exist in klpen.
    import klpen

    for name in (
        "get_logprobs_for_tokens",
        "estimate_kl",
        "shape_rewards",
        "aggregate",
        "AdaptiveKLController",
    ):
        assert f"`{name}(" in README and hasattr(klpen, name), name
