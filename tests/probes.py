"""What the tests watch while klpen runs: host synchronisations and thread counts.

- :data:`SYNC_OPS` and :class:`CountSyncs`: the ops that read a tensor value on the host
  (``.item()``, ``int()``, ``bool()``, ``.tolist()``, ``nonzero``), counted by a dispatch mode
  (:class:`CountOps`, which counts any ops).
- :func:`threads`: torch's intra-op thread count inside a ``with`` block, restored after.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

SYNC_OPS = {"aten._local_scalar_dense", "aten.nonzero", "aten.is_nonzero", "aten.item"}


class CountOps(TorchDispatchMode):
    """Counts the ops that reach the dispatcher by name in ``count``: those of ``names``, or
    every op where ``names`` is ``None``."""

    def __init__(self, names: set[str] | None = None) -> None:
        super().__init__()
        self.names = names
        self.count: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = str(func.overloadpacket)
        if self.names is None or name in self.names:
            self.count[name] = self.count.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


class CountSyncs(CountOps):
    """Counts the ops of :data:`SYNC_OPS` by name in ``count``."""

    def __init__(self) -> None:
        super().__init__(SYNC_OPS)


@contextlib.contextmanager
def threads(n: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
