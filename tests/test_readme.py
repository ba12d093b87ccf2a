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
_TORCH = tuple(int(p) for p in __import__("torch").__version__.split("+")[0].split(".")[:2])
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

    elapsed = []
    with contextlib.redirect_stdout(out):
        for number, block in enumerate(PYTHON_BLOCKS, start=1):
            if "torch.compile" in block and _TORCH < (2, 13):
                continue  # compilation is tested with torch >= 2.13 (tests/test_compile.py)
            start = time.perf_counter()
            try:
                exec(compile(block, f"README.md python block {number}", "exec"), namespace)
            except Exception as err:  # pragma: no cover - the message is the point
                pytest.fail(f"README.md python block {number} failed: {err!r}")
            elapsed.append(time.perf_counter() - start)
    # The PPO example prints one line per step, with a finite KL and a positive kl_coef.
    lines = [line for line in out.getvalue().splitlines() if line.startswith("step ")]
    assert len(lines) == 3
    for line in lines:
        match = re.search(r"KL ([-+]\d+\.\d+)  kl_coef (\d+\.\d+)$", line)
        assert match, line
        assert math.isfinite(float(match.group(1))) and float(match.group(2)) > 0
    # The PPO example "runs in well under 2 s on a CPU"; generous, since CI's two cores are
    # shared. (The compiled step's time is torch.compile's.)
    assert elapsed[0] < 10.0
    # The compiled packed step ran, and its loss is finite.
    if _TORCH < (2, 13):
        return
    match = re.search(r"^compiled packed GRPO loss ([-+]\d+\.\d+)$", out.getvalue(), re.MULTILINE)
    assert match and math.isfinite(float(match.group(1)))


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


SUPPORT = README.split("\n## Versions and what runs where\n", 1)[-1].split("\n## ", 1)[0]


def _support_rows() -> dict[str, tuple[str, str]]:
    rows = {}
    for line in SUPPORT.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0] not in ("what", "---"):
            rows[cells[0]] = (cells[1], cells[2])
    return rows


def test_support_table_covers_every_setting() -> None:
    rows = _support_rows()
    for needle in (
        "CPU",
        "CUDA",
        "`torch.compile`, default mode",
        "`torch.compile`, `fullgraph=True`",
        "autocast",
        "DDP",
        "FSDP",
        "vocab-parallel tensor parallelism",
        "packed",
    ):
        assert any(needle in what for what in rows), needle
    assert "untested" in rows["CUDA"][0]  # until it runs on a GPU


def test_support_table_names_tests_that_exist() -> None:
    """Every test a row names exists, down to the function; "tested" rows name at least one."""
    for what, (status, backed) in _support_rows().items():
        names = re.findall(r"`(tests/[\w/]+\.py)((?:::\w+)?)`", backed)
        names += [(f"tests/{m[0]}", m[1]) for m in re.findall(r"`(\w+\.py)?(::\w+)`", backed)]
        tested = "tested" in status.replace("untested", "")
        assert names or "make " in backed or not tested, what
        path = None
        for file, function in names:
            path = ROOT / file if file != "tests/" else path
            assert path is not None and path.is_file(), (what, file)
            if function:
                assert re.search(rf"^def {function[2:]}\(", path.read_text(), re.M), (
                    what,
                    function,
                )
        for target in re.findall(r"`make ([\w-]+)", backed):
            assert re.search(rf"^{target}:", (ROOT / "Makefile").read_text(), re.M), target


def test_versions_are_stated_and_agree() -> None:
    namespace: dict[str, str] = {}
    exec((ROOT / "src" / "klpen" / "_version.py").read_text(), namespace)
    version = namespace["__version__"]
    assert f"(now: {version})" in README and "[CHANGELOG.md](CHANGELOG.md)" in README
    for word in ("**minor**", "**patch**", "**major**", "semantic versioning"):
        assert word in README, word
    floor = re.search(r'"torch>=([\d.]+)"', (ROOT / "pyproject.toml").read_text())
    assert floor and f"PyTorch ≥ {floor.group(1)}" in README
    make_floor = re.search(r"^TORCH_FLOOR := ([\d.]+)$", (ROOT / "Makefile").read_text(), re.M)
    assert make_floor and make_floor.group(1).startswith(floor.group(1) + ".")
    assert f"{make_floor.group(1)} (`make torch-floor`)" in README
