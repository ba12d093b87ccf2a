"""Show the source of a klpen object in a notebook, whole or as a marked excerpt.

The listing's plain-text form is the code shown, so nbval, which compares stored outputs, fails
as soon as the code shown in a chapter drifts from the package. In Jupyter and in the HTML book
the same listing renders as a highlighted code block.

A chapter rarely needs a whole function: input checks and docstrings teach nothing there. The
lines that do teach are marked in the package source with two comment lines::

    def masked_mean(values, mask):
        ...checks...
        # excerpt: formula
        total = masked_sum(values, mask)
        return total / mask.sum()
        # end excerpt

``show_source(masked_mean, excerpt="formula")`` then shows only the marked lines (dedented),
headed by the qualname; the rendered listing ends with the full source in a collapsed block, one
click away. Marker lines never appear in any listing. A name may mark several blocks of one
object: they are shown in order, separated by a ``...`` line.
"""

from __future__ import annotations

import ast
import html
import inspect
import re
import textwrap
from typing import Any

_START = re.compile(r"^\s*# excerpt: (?P<name>[A-Za-z0-9_.-]+)\s*$")
_END = re.compile(r"^\s*# end excerpt\s*$")


class SourceListing:
    """The source code of one object, or an excerpt of it, displayable in a notebook.

    Attributes:
        qualname: ``module.name`` of the object.
        source: the code shown: the excerpt, or the whole source; dedented, no marker lines.
        full: the whole source of the object (docstrings kept), without marker lines.
        excerpt: the name of the excerpt shown, or ``None`` for the whole source.
    """

    def __init__(
        self, qualname: str, source: str, *, full: str | None = None, excerpt: str | None = None
    ) -> None:
        self.qualname = qualname
        self.source = source
        self.full = source if full is None else full
        self.excerpt = excerpt

    @property
    def heading(self) -> str:
        """The comment line that heads the listing."""
        if self.excerpt is None:
            return f"# {self.qualname}"
        return f"# {self.qualname} (excerpt)"

    def __repr__(self) -> str:
        return f"{self.heading}\n{self.source}"

    def _repr_markdown_(self) -> str:
        shown = f"```python\n{self.heading}\n{self.source}```\n"
        if self.excerpt is None:
            return shown
        # Raw HTML around a fenced block: Jupyter and MyST-NB (CommonMark outputs) both render a
        # collapsed <details> holding a highlighted listing. The blank lines end the HTML blocks.
        summary = html.escape(f"Full source of {self.qualname}")
        return (
            f'{shown}\n<details class="klpen-full-source">\n<summary>{summary}</summary>\n\n'
            f"```python\n# {self.qualname}\n{self.full}```\n\n</details>\n"
        )


def show_source(obj: Any, *, docstring: bool = True, excerpt: str | None = None) -> SourceListing:
    """The source of a klpen function, class or method, for display in a notebook.

    Args:
        obj: the object whose source to show (anything :func:`inspect.getsource` accepts).
        docstring: keep the docstrings (``True``) or show only the code (``False``; the
            docstrings of methods inside a class are dropped too). The collapsed full source
            of an excerpt always keeps them.
        excerpt: the name of a block marked in the source by a ``# excerpt: NAME`` comment line
            and closed by ``# end excerpt``: show only those lines, dedented. ``None`` (the
            default) shows the whole source. Marker lines are never shown.

    Raises:
        ValueError: ``excerpt`` names no block of ``obj``, or the markers are unbalanced.

    Example:
        >>> from klpen.lab.source import show_source
        >>> listing = show_source(show_source, excerpt="doctest-demo")
        >>> print(repr(listing))
        # klpen.lab.source.show_source (excerpt)
        source = textwrap.dedent(inspect.getsource(obj))
        >>> any(line.strip() == "# end excerpt" for line in listing.full.splitlines())
        False
    """
    name = getattr(obj, "__qualname__", getattr(obj, "__name__", repr(obj)))
    qualname = f"{obj.__module__}.{name}"
    # excerpt: doctest-demo
    source = textwrap.dedent(inspect.getsource(obj))
    # end excerpt
    blocks = _excerpt_blocks(source, qualname)
    full = _drop_markers(source)
    if excerpt is None:
        return SourceListing(qualname, full if docstring else _strip_docstrings(full))
    if not isinstance(excerpt, str):
        raise TypeError(f"excerpt must be a str or None, got {type(excerpt).__name__}")
    if excerpt not in blocks:
        known = ", ".join(repr(key) for key in sorted(blocks)) or "none"
        raise ValueError(f"excerpt={excerpt!r}: {qualname} marks no such excerpt (it has: {known})")
    parts = [textwrap.dedent("".join(lines)) for lines in blocks[excerpt]]
    return SourceListing(qualname, "...\n".join(parts), full=full, excerpt=excerpt)


def _excerpt_blocks(source: str, qualname: str) -> dict[str, list[list[str]]]:
    """The marked blocks of ``source`` by name, each a list of its lines (markers dropped)."""
    blocks: dict[str, list[list[str]]] = {}
    open_blocks: list[tuple[str, list[str]]] = []
    for number, line in enumerate(source.splitlines(keepends=True), start=1):
        start = _START.match(line)
        if start:
            open_blocks.append((start["name"], []))
        elif _END.match(line):
            if not open_blocks:
                raise ValueError(f"{qualname}: '# end excerpt' without a start at line {number}")
            name, lines = open_blocks.pop()
            blocks.setdefault(name, []).append(lines)
        else:
            for _, lines in open_blocks:
                lines.append(line)
    if open_blocks:
        raise ValueError(f"{qualname}: excerpt {open_blocks[-1][0]!r} is never ended")
    return blocks


def _drop_markers(source: str) -> str:
    """``source`` without its excerpt marker lines."""
    lines = source.splitlines(keepends=True)
    return "".join(line for line in lines if not (_START.match(line) or _END.match(line)))


def _strip_docstrings(source: str) -> str:
    """Remove the lines of every function and class docstring in ``source``."""
    drop: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            first = node.body[0]
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
                and first.end_lineno is not None
            ):
                drop.update(range(first.lineno, first.end_lineno + 1))
    lines = source.splitlines(keepends=True)
    return "".join(line for number, line in enumerate(lines, start=1) if number not in drop)
