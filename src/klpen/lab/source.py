"""Show the source of a klpen object in a notebook.

The listing's plain-text form is the source itself, so nbval, which compares stored outputs,
fails as soon as the code shown in a chapter drifts from the package. In Jupyter and in the
HTML book the same listing renders as a highlighted code block.
"""

from __future__ import annotations

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
        docstring: keep the docstring (``True``) or show only the code (``False``).

    Example:
        >>> from klpen.masking import masked_sum
        >>> listing = show_source(masked_sum, docstring=False)
        >>> print(repr(listing).splitlines()[:2])
        ['# klpen.masking.masked_sum', 'def masked_sum(values: Tensor, mask: Tensor, dim: Dim = None) -> Tensor:']
    """
    source = textwrap.dedent(inspect.getsource(obj))
    if not docstring:
        source = _strip_docstring(source, inspect.getdoc(obj))
    name = getattr(obj, "__qualname__", getattr(obj, "__name__", repr(obj)))
    return SourceListing(f"{obj.__module__}.{name}", source)


def _strip_docstring(source: str, doc: str | None) -> str:
    if not doc:
        return source
    lines = source.splitlines(keepends=True)
    for start, line in enumerate(lines):
        stripped = line.lstrip()
        if stripped.startswith(('"""', "r'''", 'r"""', "'''")):
            quote = '"""' if '"""' in stripped else "'''"
            # The docstring may open and close on the same line.
            body = stripped[stripped.index(quote) + 3 :]
            end = start if quote in body else next(
                i for i in range(start + 1, len(lines)) if quote in lines[i]
            )
            return "".join(lines[:start] + lines[end + 1 :])
    return source
