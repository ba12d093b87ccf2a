"""klpen_book is a package of its own that uses klpen's public API, and so do the notebooks.

The notebooks' code cells and klpen_book's modules are read as Python (``ast``): a private
name of klpen may appear only as a string (a dotted name passed to ``show_source``), never as
an import or an attribute. Every dotted name a chapter passes to ``show_source`` resolves, and
the excerpt it asks for exists.
"""

from __future__ import annotations

import ast
import importlib
import json
import re
from pathlib import Path

import pytest

import klpen
import klpen_book
from klpen_book import blocks, show_source

ROOT = Path(__file__).resolve().parents[1]
BOOK = ROOT / "book"
PACKAGE = ROOT / "src" / "klpen_book"
NOTEBOOKS = sorted(BOOK.glob("[0-9][0-9]_*.ipynb"))


def _code_cells(path: Path) -> list[tuple[int, str]]:
    """(index, source) of each code cell, IPython magics (``%...``) and shell lines dropped."""
    cells = json.loads(path.read_text())["cells"]
    out = []
    for index, cell in enumerate(cells):
        if cell["cell_type"] == "code":
            lines = "".join(cell["source"]).splitlines()
            kept = [x for x in lines if not x.lstrip().startswith(("%", "!"))]
            out.append((index, "\n".join(kept)))
    return out


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_klpen_uses(source: str) -> list[str]:
    """The private klpen names ``source`` imports or reaches as attributes (strings ignored)."""
    found = []
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            parts = node.module.split(".")
            if parts[0] == "klpen":
                if any(_private(p) for p in parts):
                    found.append(f"from {node.module} import ...")
                names = [a.name for a in node.names if _private(a.name)]
                found += [f"from {node.module} import {name}" for name in names]
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "klpen" and any(_private(p) for p in parts):
                    found.append(f"import {alias.name}")
        elif isinstance(node, ast.Attribute) and _private(node.attr):
            found.append(f"attribute .{node.attr}")
    return found


def test_the_scanner_sees_every_form_of_private_use() -> None:
    """The check below can fail: each private form is caught, a dotted-name string is not."""
    hostile = {
        "from klpen._chunks import shifted_log_sums": 1,
        "from klpen.logprobs import _TokenLogProbs": 1,
        "import klpen._validation": 1,
        "klpen.masking._mean": 1,
        "show_source(klpen.DoublingKLController._next_coef)": 1,
        'show_source("klpen.masking._mean")': 0,
        "from klpen.estimators import ESTIMATORS": 0,
    }
    for source, count in hostile.items():
        assert len(private_klpen_uses(source)) == count, source


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name[:2])
def test_notebook_code_uses_no_private_klpen_name(path: Path) -> None:
    for index, source in _code_cells(path):
        assert private_klpen_uses(source) == [], f"{path.name} cell {index}"
        assert "klpen.lab" not in source, f"{path.name} cell {index}"


def _show_source_calls(source: str) -> list[ast.Call]:
    return [
        node
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "show_source"
    ]


def shown_names() -> list[tuple[str, int, str, dict[str, object]]]:
    """(notebook, cell, dotted name, keywords) of every ``show_source`` call of the book."""
    calls = []
    for path in NOTEBOOKS:
        for index, source in _code_cells(path):
            for call in _show_source_calls(source):
                assert len(call.args) == 1 and isinstance(call.args[0], ast.Constant), (
                    f"{path.name} cell {index}: show_source must get one dotted name (a string)"
                )
                keywords = {k.arg: ast.literal_eval(k.value) for k in call.keywords if k.arg}
                calls.append((path.name, index, call.args[0].value, keywords))
    return calls


def test_every_chapter_with_listings_passes_names() -> None:
    chapters = {notebook[:2] for notebook, *_ in shown_names()}
    # Chapter 10 (distillation) is written separately; every chapter of this book's part lists.
    assert chapters >= {f"{n:02d}" for n in range(1, 12) if n != 10}


@pytest.mark.parametrize(
    "notebook, cell, name, keywords", shown_names(), ids=lambda x: x if isinstance(x, str) else ""
)
def test_every_dotted_name_shown_resolves(
    notebook: str, cell: int, name: str, keywords: dict[str, object]
) -> None:
    listing = show_source(name, **keywords)  # type: ignore[arg-type]
    assert listing.source.strip(), f"{notebook} cell {cell}: {name} shows nothing"
    # The heading names where the object lives: the notebook's name leads to it.
    assert listing.qualname.split(".")[-1] == name.split(".")[-1]


def test_klpen_book_uses_no_private_klpen_name() -> None:
    files = sorted(PACKAGE.glob("*.py"))
    assert len(files) > 10
    for path in files:
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                parts = node.module.split(".")
                if parts[0] == "klpen":
                    assert not any(_private(p) for p in parts), f"{path.name}: {node.module}"
                    for alias in node.names:
                        assert not _private(alias.name), f"{path.name}: {alias.name}"
                        public = getattr(importlib.import_module(node.module), "__all__", None)
                        assert public is not None and alias.name in public, (
                            f"{path.name}: {node.module}.{alias.name} is not in its __all__"
                        )
            assert not (isinstance(node, ast.ImportFrom) and node.level >= 2), path.name


def test_klpen_book_is_not_inside_klpen() -> None:
    assert Path(klpen_book.__file__).resolve().parent == PACKAGE
    assert not (Path(klpen.__file__).resolve().parent / "lab").exists()
    project = (PACKAGE / "pyproject.toml").read_text()
    assert 'packages = ["klpen_book"]' in project


def test_block_sizes_are_klpen_s_own() -> None:
    """klpen_book restates klpen's block rule; this pins it to klpen's internals."""
    from klpen.kernels import blocks as _chunks
    from klpen.kernels import torch_linear as linear

    assert blocks.BLOCK_ELEMENTS == _chunks.CHUNK_ELEMENTS
    # The logits functions' blocks, as chapter 11's table prints them.
    assert blocks.CPU_BLOCK_ELEMENTS == _chunks.CHUNK_ELEMENTS  # the CPU's blocks
    assert blocks.GPU_BLOCK_ELEMENTS == _chunks.CHUNK_ELEMENTS * _chunks.ACCELERATOR_SCALE
    assert blocks.GROUPS == linear.GROUPS
    for vocab in (1, 7, 1000, 50_257, 128_256, 256_000, 1 << 23):
        assert blocks.rows_per_block(vocab) == _chunks.rows_per_chunk(vocab)
    for rows in (1, 100, 2048, 5000, 32_768):
        for vocab in (50, 1000, 128_256):
            for narrow in (False, True):
                expected = linear.tile_shape(rows, vocab, _chunks.CHUNK_ELEMENTS, narrow=narrow)
                assert blocks.tile_shape(rows, vocab, narrow) == expected


_DETAILS = re.compile(r"<details.*?</details>", re.S)


def visible_lines(output: dict[str, object]) -> int:
    """Non-blank text lines a reader sees of one stored output: a collapsed ``<details>``
    block shows only its toggle (no line of source), an image no text line."""
    if output.get("output_type") == "stream":
        text = "".join(output.get("text", []))  # type: ignore[arg-type]
        return len(text.rstrip("\n").splitlines())
    data: dict[str, list[str]] = output.get("data", {})  # type: ignore[assignment]
    if any(kind.startswith("image/") for kind in data):
        return 0
    if "text/markdown" in data:
        shown = _DETAILS.sub("", "".join(data["text/markdown"])).splitlines()
        return sum(1 for line in shown if line.strip() and not line.startswith("```"))
    return len("".join(data.get("text/plain", [])).rstrip("\n").splitlines())


def _markdown_output(markdown: str) -> dict[str, object]:
    return {"output_type": "execute_result", "data": {"text/markdown": [markdown]}}


def test_visible_lines_counts_what_renders() -> None:
    collapsed = show_source("klpen_book.checks.check_coef", collapsed=True)
    assert visible_lines(_markdown_output(collapsed._repr_markdown_())) == 0
    whole = show_source("klpen_book.checks.check_coef")
    code = [line for line in repr(whole).splitlines() if line.strip()]
    assert visible_lines(_markdown_output(whole._repr_markdown_())) == len(code) > 10
    excerpt = show_source("klpen_book.source.show_source", excerpt="doctest-demo")
    assert visible_lines(_markdown_output(excerpt._repr_markdown_())) == 2  # heading, one line


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name[:2])
def test_printed_source_is_at_most_a_third_of_the_output(path: Path) -> None:
    """Issue 23: the lines that do the mathematics, the rest one click away."""
    source = total = 0
    for cell in json.loads(path.read_text())["cells"]:
        if cell["cell_type"] != "code":
            continue
        lines = sum(visible_lines(output) for output in cell.get("outputs", []))
        total += lines
        if "show_source(" in "".join(cell["source"]):
            source += lines
    assert total > 0 and source <= total / 3, f"{path.name}: {source} of {total} lines"
