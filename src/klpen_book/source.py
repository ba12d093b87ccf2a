"""Show the source of a klpen object in a notebook, by its dotted name, whole or as an excerpt.

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

``show_source("klpen.masked_mean", excerpt="formula")`` then shows only the marked lines (dedented),
headed by the qualname; the rendered listing ends with the full source in a collapsed block, one
click away. Marker lines never appear in any listing. A name may mark several blocks of one
object: they are shown in order, separated by a ``...`` line.
"""

from __future__ import annotations

import ast
import html
import importlib
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
        collapsed: the rendered listing is one collapsed block (its summary names the object);
            the plain text, which nbval compares, is the code shown all the same.
    """

    def __init__(
        self,
        qualname: str,
        source: str,
        *,
        full: str | None = None,
        excerpt: str | None = None,
        collapsed: bool = False,
    ) -> None:
        self.qualname = qualname
        self.source = source
        self.full = source if full is None else full
        self.excerpt = excerpt
        self.collapsed = collapsed

    @property
    def heading(self) -> str:
        """The comment line that heads the listing."""
        if self.excerpt is None:
            return f"# {self.qualname}"
        return f"# {self.qualname} (excerpt)"

    def __repr__(self) -> str:
        return f"{self.heading}\n{self.source}"

    def _repr_markdown_(self) -> str:
        # Raw HTML around a fenced block: Jupyter and MyST-NB (CommonMark outputs) both render a
        # collapsed <details> holding a highlighted listing. The blank lines end the HTML blocks.
        if self.collapsed:
            summary = html.escape(f"Source of {self.qualname}")
            return (
                f'<details class="klpen-full-source">\n<summary>{summary}</summary>\n\n'
                f"```python\n{self.heading}\n{self.source}```\n\n</details>\n"
            )
        shown = f"```python\n{self.heading}\n{self.source}```\n"
        if self.source == self.full:
            return shown
        summary = html.escape(f"Full source of {self.qualname}")
        return (
            f'{shown}\n<details class="klpen-full-source">\n<summary>{summary}</summary>\n\n'
            f"```python\n# {self.qualname}\n{self.full}```\n\n</details>\n"
        )


def resolve(name: str) -> Any:
    """The object a dotted name such as ``"klpen.logprobs.get_logprobs_for_tokens"`` names.

    The first part is imported, then each further part is looked up as an attribute, or,
    where there is none, imported as a submodule of the module named so far. A module's
    attribute wins over a submodule of the same name (``"klpen.full_kl"`` is the function
    that ``klpen`` exports); past such an attribute, the submodule is used
    (``"klpen.full_kl.full_kl"``).

    Raises:
        TypeError: ``name`` is not a string.
        ValueError: ``name`` is not a dotted name, or names nothing importable.

    Example:
        >>> resolve("klpen_book.source.resolve") is resolve
        True
        >>> resolve("klpen.no_such_name")
        Traceback (most recent call last):
        ...
        ValueError: name='klpen.no_such_name': klpen has no attribute or submodule 'no_such_name'
    """
    if not isinstance(name, str):
        raise TypeError(f"name must be a dotted name (str), got {type(name).__name__}")
    parts = name.split(".")
    if not all(part.isidentifier() for part in parts):
        raise ValueError(f"name must be a dotted name like 'klpen.full_kl', got {name!r}")
    try:
        obj: Any = importlib.import_module(parts[0])
    except ImportError as error:
        raise ValueError(f"name={name!r}: cannot import {parts[0]!r} ({error})") from None
    for i, part in enumerate(parts[1:], start=1):
        if hasattr(obj, part):
            obj = getattr(obj, part)
            continue
        module_name = ".".join(parts[: i + 1])
        parent_name = ".".join(parts[:i])
        try:
            parent = importlib.import_module(parent_name)
        except ImportError:
            parent = None
        if parent is not None and parent is not obj and hasattr(parent, part):
            obj = getattr(parent, part)  # a module shadowed by an attribute of its package
            continue
        try:
            obj = importlib.import_module(module_name)
        except ModuleNotFoundError as error:
            if error.name is not None and not module_name.startswith(error.name):
                raise  # the submodule exists but fails to import something else
            raise ValueError(
                f"name={name!r}: {parent_name} has no attribute or submodule {part!r}"
            ) from None
    return obj


def show_source(
    name: str | Any,
    *,
    docstring: bool = True,
    excerpt: str | None = None,
    comments: bool = True,
    collapsed: bool = False,
) -> SourceListing:
    """The source of a function, class or method, named by its dotted name, for a notebook.

    A chapter passes the name, not the object (``show_source("klpen.full_kl")``): it then
    imports nothing to show it, in particular no private name of klpen.

    Args:
        name: the dotted name of the object (see :func:`resolve`), or the object itself
            (anything :func:`inspect.getsource` accepts).
        docstring: keep the docstrings (``True``) or show only the code (``False``; the
            docstrings of methods inside a class are dropped too). The collapsed full source
            of an excerpt always keeps them.
        excerpt: the name of a block marked in the source by a ``# excerpt: NAME`` comment line
            and closed by ``# end excerpt``: show only those lines, dedented. ``None`` (the
            default) shows the whole source. Marker lines are never shown.
        comments: keep the lines that are only a comment (``True``) or drop them from the code
            shown (``False``: the code alone; the collapsed full source keeps them).
        collapsed: render the whole listing as one collapsed block, one click away (for a
            listing a chapter shows for reference, not for reading).

    Raises:
        ValueError: ``name`` names nothing, ``excerpt`` names no block of the object, or the
            markers are unbalanced.

    Example:
        >>> listing = show_source("klpen_book.source.show_source", excerpt="doctest-demo")
        >>> print(repr(listing))
        # klpen_book.source.show_source (excerpt)
        source = textwrap.dedent(inspect.getsource(obj))
        >>> any(line.strip() == "# end excerpt" for line in listing.full.splitlines())
        False
    """
    obj = resolve(name) if isinstance(name, str) else name
    label = getattr(obj, "__qualname__", getattr(obj, "__name__", repr(obj)))
    qualname = f"{obj.__module__}.{label}"
    # excerpt: doctest-demo
    source = textwrap.dedent(inspect.getsource(obj))
    # end excerpt
    blocks = _excerpt_blocks(source, qualname)
    full = _drop_markers(source)
    if excerpt is None:
        shown = full if docstring else _strip_docstrings(full)
        if not comments:
            shown = _strip_comments(shown)
        return SourceListing(qualname, shown, full=full, collapsed=collapsed)
    if not isinstance(excerpt, str):
        raise TypeError(f"excerpt must be a str or None, got {type(excerpt).__name__}")
    if excerpt not in blocks:
        known = ", ".join(repr(key) for key in sorted(blocks)) or "none"
        raise ValueError(f"excerpt={excerpt!r}: {qualname} marks no such excerpt (it has: {known})")
    parts = [textwrap.dedent("".join(lines)) for lines in blocks[excerpt]]
    shown = "...\n".join(parts)
    if not comments:
        shown = _strip_comments(shown)
    return SourceListing(qualname, shown, full=full, excerpt=excerpt, collapsed=collapsed)


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


def _strip_comments(source: str) -> str:
    """``source`` without its comment-only lines (code lines keep their trailing comments)."""
    lines = source.splitlines(keepends=True)
    return "".join(line for line in lines if not line.lstrip().startswith("#"))
