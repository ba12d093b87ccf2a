"""The CPU block pool under concurrent callers, resizes and fork (issue 22 item 13).

Before the fix, one caller could replace (shut down) the pool between another caller's taking
it and submitting to it: ``RuntimeError: cannot schedule new futures after shutdown``.
"""

from __future__ import annotations

import os
import sys
import threading
from unittest.mock import patch

import pytest
import torch
from torch import Tensor

from klpen.kernels import blocks


def test_resizing_while_others_submit_never_fails() -> None:
    errors: list[BaseException] = []
    stop = threading.Event()
    x = torch.arange(64.0).view(32, 2)

    def submitter() -> None:
        try:
            while not stop.is_set():
                out = torch.empty(32)

                def body(
                    start: int, views: tuple[Tensor, ...], work: None, out: Tensor = out
                ) -> None:
                    out[start : start + views[0].shape[0]] = views[0].sum(-1)

                # the pooled loop itself, with two workers, as the kernels call it
                futures = blocks._submit(2, lambda: None, 2)
                for f in futures:
                    f.result()
                blocks.for_each_block((x,), 1, body, lambda rows: None)
                assert torch.equal(out, x.sum(-1))
        except BaseException as exc:
            errors.append(exc)

    def resizer() -> None:
        try:
            for size in range(3, 40):
                with blocks._POOL_LOCK:  # force a regrowth on the next submit
                    blocks._POOL_SIZE[0] = 0
                for f in blocks._submit(size % 4 + 1, lambda: None, 1):
                    f.result()
        except BaseException as exc:
            errors.append(exc)

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        workers = [threading.Thread(target=submitter) for _ in range(3)]
        grower = threading.Thread(target=resizer)
        for t in workers:
            t.start()
        grower.start()
        grower.join(timeout=60)
        stop.set()
        for t in workers:
            t.join(timeout=60)
    finally:
        torch.set_num_threads(before)
    assert not errors, errors


def test_the_old_race_is_what_the_lock_prevents() -> None:
    """The failure mode itself: submitting to a pool another caller has shut down raises, so
    the test above could fail if _submit took the pool and submitted outside the lock."""
    pool = blocks._submit(1, lambda: None, 0)
    assert pool == []
    with blocks._POOL_LOCK:
        old = blocks._POOL[0]
    old.shutdown(wait=False)
    with pytest.raises(RuntimeError, match="after shutdown"):
        old.submit(lambda: None)
    with blocks._POOL_LOCK:  # leave a live pool for the other tests
        blocks._POOL.clear()
        blocks._POOL_SIZE[0] = 0


@pytest.mark.skipif(sys.platform == "win32", reason="fork")
def test_a_forked_child_makes_its_own_pool() -> None:
    x = torch.randn(40, 3)
    expected = torch.logsumexp(x, -1)

    def body(start: int, views: tuple[Tensor, ...], work: None, out: Tensor) -> None:
        out[start : start + views[0].shape[0]] = torch.logsumexp(views[0], -1)

    def run() -> Tensor:
        out = torch.empty(40)
        blocks.for_each_block((x,), 1, lambda s, v, w: body(s, v, w, out), lambda rows: None)
        return out

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        run()  # the parent's pool exists now
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: a pool of its own, the same result
            ok = torch.allclose(run(), expected)
            os.write(write, b"1" if ok else b"0")
            os._exit(0)
        os.close(write)
        status = os.read(read, 1)
        os.waitpid(pid, 0)
    finally:
        torch.set_num_threads(before)
    assert status == b"1"


def test_compiling_takes_the_sequential_loop() -> None:
    calls: list[int] = []
    real = blocks._submit

    def spy(workers: int, task: object, count: int) -> object:
        calls.append(workers)
        return real(workers, task, count)  # type: ignore[arg-type]

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with (
            patch.object(blocks, "_submit", spy),
            patch.object(torch.compiler, "is_compiling", lambda: True),
        ):
            blocks.for_each_block((torch.zeros(8, 2),), 1, lambda s, v, w: None, lambda r: None)
    finally:
        torch.set_num_threads(before)
    assert calls == []
