"""klpen_book.show_source: whole listings, marked excerpts, and their notebook renderings."""

from __future__ import annotations

import ast
import importlib
import inspect
import json
import re
import textwrap
import types
from pathlib import Path

import pytest

import klpen
from klpen_book import source as source_module
from klpen_book.source import SourceListing, show_source


@pytest.fixture
def demo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    path = tmp_path / "demo_module.py"
    path.write_text(
        textwrap.dedent(
            '''\
            def scaled(x, factor):
                """Scale x.

                A docstring line.
                """
                if factor < 0:
                    raise ValueError("factor")
                # excerpt: core
                y = x * factor
                # excerpt: inner
                z = y + 1
                # end excerpt
                # end excerpt
                w = z - 1
                # excerpt: core
                return w
                # end excerpt


            def unbalanced():
                # excerpt: never-ended
                return 1


            def stray_end():
                return 1
                # end excerpt
            '''
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    return importlib.import_module("demo_module")


def test_whole_listing_is_the_source_without_markers(demo: types.ModuleType) -> None:
    listing = show_source(demo.scaled)
    expected = "".join(
        line
        for line in inspect.getsource(demo.scaled).splitlines(keepends=True)
        if "excerpt" not in line
    )
    assert listing.source == expected
    assert listing.full == expected
    assert repr(listing) == "# demo_module.scaled\n" + expected
    assert listing.excerpt is None
    assert "<details" not in listing._repr_markdown_()


def test_excerpt_shows_only_the_marked_lines_in_order(demo: types.ModuleType) -> None:
    listing = show_source(demo.scaled, excerpt="core")
    # Two blocks named "core", joined by "...", nested markers dropped, dedented to column 0.
    assert listing.source == "y = x * factor\nz = y + 1\n...\nreturn w\n"
    assert repr(listing).splitlines()[0] == "# demo_module.scaled (excerpt)"
    inner = show_source(demo.scaled, excerpt="inner")
    assert inner.source == "z = y + 1\n"


def test_excerpt_lines_are_verbatim_lines_of_the_function(demo: types.ModuleType) -> None:
    full = inspect.getsource(demo.scaled)
    for line in show_source(demo.scaled, excerpt="core").source.splitlines():
        if line != "...":
            assert any(candidate.strip() == line for candidate in full.splitlines())


def test_markdown_has_excerpt_then_collapsed_full_source(demo: types.ModuleType) -> None:
    listing = show_source(demo.scaled, excerpt="core", docstring=False)
    markdown = listing._repr_markdown_()
    first, _, rest = markdown.partition("<details")
    assert first.startswith("```python\n# demo_module.scaled (excerpt)\ny = x * factor\n")
    assert "<summary>Full source of demo_module.scaled</summary>" in rest
    # The collapsed block is the whole function, docstring kept, markers dropped.
    assert "A docstring line." in rest and "raise ValueError" in rest
    assert "# excerpt:" not in markdown and "# end excerpt" not in markdown
    assert rest.rstrip().endswith("</details>")
    # Blank lines around the fenced block, so that CommonMark ends the HTML blocks.
    assert "</summary>\n\n```python" in rest and "```\n\n</details>" in rest


def test_docstring_false_strips_docstrings_of_whole_listing(demo: types.ModuleType) -> None:
    listing = show_source(demo.scaled, docstring=False)
    assert "A docstring line." not in listing.source
    assert "raise ValueError" in listing.source
    ast.parse(listing.source)  # still valid Python


def test_unknown_excerpt_names_the_argument_and_the_known_names(demo: types.ModuleType) -> None:
    with pytest.raises(ValueError, match=r"excerpt='nope'.*'core', 'inner'"):
        show_source(demo.scaled, excerpt="nope")


def _no_excerpts() -> int:
    return 1


def test_unknown_excerpt_on_object_without_markers() -> None:
    with pytest.raises(ValueError, match=r"excerpt='x'.*\(it has: none\)"):
        show_source(_no_excerpts, excerpt="x")


def test_excerpt_must_be_a_string(demo: types.ModuleType) -> None:
    with pytest.raises(TypeError, match="excerpt must be a str or None, got int"):
        show_source(demo.scaled, excerpt=3)  # type: ignore[arg-type]


def test_unbalanced_markers_are_reported(demo: types.ModuleType) -> None:
    with pytest.raises(ValueError, match="'never-ended' is never ended"):
        show_source(demo.unbalanced)
    with pytest.raises(ValueError, match="without a start at line 3"):
        show_source(demo.stray_end)


def test_every_marker_in_the_package_is_balanced_and_named() -> None:
    """Every source file of klpen parses into balanced excerpt blocks (a broken marker fails).

    The files are read, not imported: some private modules only import through their parent.
    """
    package = Path(klpen.__file__).resolve().parent
    files = sorted(package.rglob("*.py"))
    assert len(files) > 10
    marked = 0
    for path in files:
        text = path.read_text()
        for line in text.splitlines():
            if re.match(r"^\s*# excerpt:", line):
                assert source_module._START.match(line), f"{path.name}: malformed marker {line!r}"
                marked += 1
        source_module._excerpt_blocks(text, path.name)
    assert marked > 0


def test_listing_roundtrip_without_excerpt_keeps_old_behaviour() -> None:
    from klpen.masking import masked_sum

    listing = show_source(masked_sum, docstring=False)
    assert isinstance(listing, SourceListing)
    assert repr(listing).splitlines()[0] == "# klpen.masking.masked_sum"
    assert "Example:" not in listing.source


def test_a_dotted_name_resolves_to_the_object_it_names(demo: types.ModuleType) -> None:
    assert source_module.resolve("demo_module.scaled") is demo.scaled
    # klpen's package attribute ``full_kl`` (the function) shadows the module of that name;
    # past it, the module is used.
    assert source_module.resolve("klpen.full_kl") is klpen.full_kl
    module = importlib.import_module("klpen.full_kl")
    assert source_module.resolve("klpen.full_kl.full_kl") is module.full_kl
    # A method, through its class.
    assert source_module.resolve("klpen.DoublingKLController.update") is (
        klpen.DoublingKLController.update
    )
    by_name = show_source("demo_module.scaled", excerpt="core")
    by_object = show_source(demo.scaled, excerpt="core")
    assert repr(by_name) == repr(by_object)


@pytest.mark.parametrize(
    "name, message",
    [
        ("klpen.no_such_function", "klpen has no attribute or submodule 'no_such_function'"),
        ("no_such_package_xyz.f", "cannot import 'no_such_package_xyz'"),
        ("klpen..full_kl", "must be a dotted name"),
        ("klpen.full kl", "must be a dotted name"),
    ],
)
def test_a_name_that_names_nothing_is_a_value_error(name: str, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        show_source(name)


def test_a_name_must_be_a_string() -> None:
    with pytest.raises(TypeError, match="must be a dotted name"):
        source_module.resolve(3)  # type: ignore[arg-type]


def test_comments_false_drops_only_comment_lines() -> None:
    listing = show_source("klpen.estimators.k3", excerpt="series", comments=False)
    kept = show_source("klpen.estimators.k3", excerpt="series")
    code = [line for line in kept.source.splitlines() if not line.lstrip().startswith("#")]
    assert listing.source.splitlines() == code
    assert len(code) < len(kept.source.splitlines())
    assert listing.full == kept.full  # the collapsed full source keeps every comment


def test_collapsed_listing_renders_as_one_closed_block(demo: types.ModuleType) -> None:
    listing = show_source("demo_module.scaled", docstring=False, collapsed=True)
    markdown = listing._repr_markdown_()
    assert markdown.startswith('<details class="klpen-full-source">\n<summary>Source of ')
    assert markdown.rstrip().endswith("</details>")
    assert markdown.count("```python") == 1 and "raise ValueError" in markdown
    # nbval compares the plain text: it is still the code shown.
    assert repr(listing) == "# demo_module.scaled\n" + listing.source


def _stored_listings() -> list[tuple[str, int, str, dict[str, str]]]:
    """Every `show_source(...)` cell of the book with the outputs stored in its notebook."""
    book = Path(__file__).resolve().parents[1] / "book"
    cells = []
    for path in sorted(book.glob("*.ipynb")):
        notebook = json.loads(path.read_text())
        for index, cell in enumerate(notebook["cells"]):
            code = "".join(cell["source"])
            if cell["cell_type"] == "code" and code.startswith("show_source("):
                (result,) = (o for o in cell["outputs"] if o["output_type"] == "execute_result")
                data = {kind: "".join(text) for kind, text in result["data"].items()}
                cells.append((path.name, index, code, data))
    return cells


_LISTINGS = _stored_listings()


def test_the_book_shows_source_in_many_cells() -> None:
    assert len(_LISTINGS) >= 30
    book = Path(__file__).resolve().parents[1] / "book"
    chapters = {path.name for path in book.glob("[0-9][0-9]_*.ipynb")}
    assert {name for name, *_ in _LISTINGS} == chapters


@pytest.mark.parametrize(
    ("notebook", "index", "code", "stored"), _LISTINGS, ids=[f"{n}:{i}" for n, i, *_ in _LISTINGS]
)
def test_stored_listing_is_the_current_source(
    notebook: str, index: int, code: str, stored: dict[str, str]
) -> None:
    # nbval fails the notebook stage on a stale listing minutes into CI; this fails in seconds,
    # naming the cell to refresh after a change to the code it shows.
    listing = eval(code, {"show_source": show_source})  # a single show_source(...) call
    assert stored["text/markdown"] == listing._repr_markdown_(), f"{notebook} cell {index}"
    assert stored["text/plain"] == repr(listing).rstrip("\n"), f"{notebook} cell {index}"
