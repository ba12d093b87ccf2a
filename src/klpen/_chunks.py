"""Temporary alias: ``klpen._chunks`` is :mod:`klpen.kernels.blocks` (moved there).

Kept while other modules, tests and notebooks still import ``klpen._chunks``. Every attribute
is read from and written to :mod:`klpen.kernels.blocks`, so that patching
``klpen._chunks.CHUNK_ELEMENTS`` still reaches the block loops. New code imports from
:mod:`klpen.kernels.blocks`.
"""

import sys
import types
from typing import TYPE_CHECKING

from .kernels import blocks

if TYPE_CHECKING:
    from .kernels.blocks import *  # noqa: F403
else:

    def _forward(name: str) -> property:
        # A data descriptor per name: reads, writes and deletes reach klpen.kernels.blocks
        # (pytest's monkeypatch and unittest.mock then restore the original there).
        return property(
            lambda self: getattr(blocks, name),
            lambda self, value: setattr(blocks, name, value),
            lambda self: delattr(blocks, name),
        )

    _names = [n for n in vars(blocks) if not n.startswith("__")]
    _Alias = type("_Alias", (types.ModuleType,), {n: _forward(n) for n in _names})
    sys.modules[__name__].__class__ = _Alias
