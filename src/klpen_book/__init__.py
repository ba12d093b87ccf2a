"""klpen_book: the laboratory of the klpen book (experiments, simulations, figures, tables).

Notebooks never define functions; everything they compute or draw beyond klpen's API lives
here, tested like klpen itself. It is a package of its own, installed next to klpen (``make
env``, Binder) but not part of klpen's wheel: a trainer that installs klpen gets none of it.
It uses klpen's public API only (its argument checks are :mod:`klpen_book.checks`), and a
chapter shows klpen's source by dotted name (:func:`show_source`), so no notebook imports a
private name of klpen. Modules that draw import matplotlib lazily.
"""

from .source import SourceListing, resolve, show_source
from .tables import format_table

__all__ = ["SourceListing", "format_table", "resolve", "show_source"]
