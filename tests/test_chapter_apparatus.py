"""The chapters' apparatus, checked on the notebooks themselves (no browser needed: unit stage).

Figure convention (issue 14): every code cell whose output is an image carries the cell metadata

    {"mystnb": {"figure": {"caption": "...", "name": "fig-<chapter>-<slug>"},
                "image": {"alt": "..."}}}

so that MyST-NB renders a numbered figure with its caption, alt text and a label that the prose
can reference with {numref}`fig-<chapter>-<slug>`. <chapter> is the notebook's two-digit number.
Every numbered chapter ends with a "Summary" and an "Exercises" section.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

BOOK = Path(__file__).resolve().parents[1] / "book"
CHAPTERS = sorted(BOOK.glob("[0-9][0-9]_*.ipynb"))


def _cells(path: Path) -> list[dict[str, Any]]:
    cells: list[dict[str, Any]] = json.loads(path.read_text())["cells"]
    return cells


def _markdown_texts(path: Path) -> list[str]:
    """The text of each markdown cell of the notebook at ``path``."""
    return ["".join(c["source"]) for c in _cells(path) if c["cell_type"] == "markdown"]


def _has_image(cell: dict[str, Any]) -> bool:
    return any(
        "image/png" in output.get("data", {}) or "image/svg+xml" in output.get("data", {})
        for output in cell.get("outputs", [])
    )


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.name)
def test_every_figure_has_caption_name_and_alt_text(path: Path) -> None:
    chapter = path.name[:2]
    for index, cell in enumerate(_cells(path)):
        if cell["cell_type"] != "code" or not _has_image(cell):
            continue
        where = f"{path.name} cell {index}"
        mystnb = cell["metadata"].get("mystnb", {})
        figure = mystnb.get("figure", {})
        assert len(figure.get("caption", "")) > 20, f"{where}: no caption"
        assert re.fullmatch(rf"fig-{chapter}-[a-z0-9-]+", figure.get("name", "")), where
        assert len(mystnb.get("image", {}).get("alt", "")) > 20, f"{where}: no alt text"


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.name)
def test_chapter_ends_with_summary_and_exercises(path: Path) -> None:
    headings = [
        line.strip()
        for text in _markdown_texts(path)
        for line in text.splitlines()
        if line.startswith("## ")
    ]
    assert headings[-2:] == ["## Summary", "## Exercises"], f"{path.name}: {headings[-3:]}"


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.name)
def test_no_display_math_line_wider_than_80_characters(path: Path) -> None:
    for text in _markdown_texts(path):
        for block in re.findall(r"\$\$(.*?)\$\$", text, flags=re.S):
            for line in block.splitlines():
                assert len(line) <= 80, f"{path.name}: {line.strip()[:60]}..."


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.name)
def test_no_plain_text_chapter_references(path: Path) -> None:
    """ "chapter 3" in prose is a link ({doc} role or a MyST link), not plain text."""
    for text in _markdown_texts(path):
        # Drop links and roles, then look for what is left.
        stripped = re.sub(r"\[[^\]]*\]\([^)]*\)|\{doc\}`[^`]*`|\{ref\}`[^`]*`", "", text)
        found = re.findall(r"\b[Cc]hapters? \d", stripped)
        assert not found, f"{path.name}: plain-text reference {found[0]!r} in {text[:80]!r}"
