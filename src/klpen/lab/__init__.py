"""The book's laboratory: the experiments, simulations and figures its chapters run.

Notebooks never define functions; everything they compute or draw beyond the core API lives
here, tested like the rest of klpen. Modules that draw import matplotlib lazily, so ``import
klpen`` stays torch + numpy only.
"""

from .source import SourceListing, show_source
from .tables import format_table

__all__ = ["SourceListing", "format_table", "show_source"]
