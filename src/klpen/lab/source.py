"""Show the source of a klpen object in a notebook.

The listing's plain-text form is the source itself, so nbval, which compares stored outputs,
fails as soon as the code shown in a chapter drifts from the package. In Jupyter and in the
HTML book the same listing renders as a highlighted code block.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from typing import Any


class SourceListing:
    """The source code of one object, displayable in a notebook.

    Attributes:
        qualname: ``module.name`` of the object.
        source: its source text, dedented.
    """

    def __init__(self, qualname: str, source: str) -> None:
        self.qualname = qualname
        self.source = source

    def __repr__(self) -> str:
        return f"# {self.qualname}\n{self.source}"

    def _repr_markdown_(self) -> str:
        return f"```python\n# {self.qualname}\n{self.source}```\n"


def show_source(obj: Any, *, docstring: bool = True) -> SourceListing:
    """The source of a klpen function, class or method, for display in a notebook.

    Args:
        obj: the object whose source to show (anything :func:`inspect.getsource` accepts).
        docstring: keep the docstrings (``True``) or show only the code (``False``; the
            docstrings of methods inside a class are dropped too).

    Example:
        >>> from klpen.masking import masked_sum
        >>> listing = show_source(masked_sum, docstring=False)
        >>> print(repr(listing).splitlines()[0])
        # klpen.masking.masked_sum
        >>> "Example:" in listing.source
        False
    """
    source = textwrap.dedent(inspect.getsource(obj))
    if not docstring:
        source = _strip_docstrings(source)
    name = getattr(obj, "__qualname__", getattr(obj, "__name__", repr(obj)))
    return SourceListing(f"{obj.__module__}.{name}", source)


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
