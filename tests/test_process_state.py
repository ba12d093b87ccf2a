"""Contract section 9: a klpen call leaves the process as it found it.

- every process setting of section 9, snapshotted around each public call of
  ``tests/public_calls.py`` (and around a call that raises), and from a polling thread
  while larger calls run;
- another thread's fp32 matrix products stay at fp32 error while all-bf16 hidden-state calls
  run in two threads, whose results are those of a sequential call;
- a user thread started during a call sees the caller's thread count, and keeps it;
- three fresh processes give the same bytes (values and gradients);
- a freed gradient is ordinary torch memory: it resizes, and the resident set shrinks back;
- ``fork`` after a call: the child computes the same bits.
"""

from __future__ import annotations

import gc
import hashlib
import os
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from probes import threads
from public_calls import CASES, LEAVES, sum_of
from torch import Tensor

import klpen

TESTS = Path(__file__).resolve().parent


def _precision_flags() -> dict[str, object]:
    """Every per-backend ``fp32_precision`` flag torch has (``torch.backends.*``)."""
    flags: dict[str, object] = {}
    for path in (
        "",
        "mkldnn",
        "mkldnn.matmul",
        "mkldnn.conv",
        "mkldnn.rnn",
        "cuda.matmul",
        "cudnn",
        "cudnn.conv",
        "cudnn.rnn",
    ):
        node: Any = torch.backends
        for part in filter(None, path.split(".")):
            node = getattr(node, part, None)
        value = getattr(node, "fp32_precision", None) if node is not None else None
        if value is not None:
            flags[f"torch.backends.{path}.fp32_precision".replace("..", ".")] = value
    return flags


def snapshot() -> dict[str, object]:
    """The settings of contract section 9, as the calling thread sees them."""
    return {
        "num_threads": torch.get_num_threads(),
        "num_interop_threads": torch.get_num_interop_threads(),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "cuda.matmul.allow_tf32": torch.backends.cuda.matmul.allow_tf32,
        "cudnn.allow_tf32": torch.backends.cudnn.allow_tf32,
        **_precision_flags(),
        "default_dtype": torch.get_default_dtype(),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "deterministic_warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
        "grad": torch.is_grad_enabled(),
        "inference": torch.is_inference_mode_enabled(),
        "anomaly": torch.is_anomaly_enabled(),
        "profiler": torch.autograd.profiler._is_profiler_enabled,
    }


def test_the_snapshot_sees_a_change() -> None:
    """The check itself: a changed setting shows (else every test below passes vacuously)."""
    before = snapshot()
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        assert snapshot() != before
    finally:
        torch.set_num_threads(threads)
    with torch.no_grad():
        assert snapshot() != before
    # the per-backend flags are newer than the oldest torch tested (2.4 has none)
    if hasattr(torch.backends.cuda.matmul, "fp32_precision"):
        assert any(key.endswith("fp32_precision") for key in before)
    assert snapshot() == before


def _run_case(call: Callable[[], object]) -> None:
    for x in LEAVES:
        x.grad = None
    out = call()
    loss = sum_of(out)
    if loss.requires_grad:
        loss.backward()


@pytest.mark.parametrize(("name", "call"), CASES, ids=[c[0] for c in CASES])
def test_no_public_call_changes_a_setting(name: str, call: Callable[[], object]) -> None:
    before = snapshot()
    _run_case(call)
    assert snapshot() == before


def test_a_call_that_raises_changes_no_setting() -> None:
    before = snapshot()
    with pytest.raises(ValueError):
        klpen.get_logprobs_for_tokens(torch.randn(2, 3, 8), torch.full((2, 3), 8))
    with pytest.raises(ValueError):
        klpen.full_kl(torch.randn(4, 8), torch.randn(4, 8).fill_(float("nan")))
    assert snapshot() == before


def _large_calls() -> list[Callable[[], object]]:
    """Calls of several blocks and tiles each, fp32 and all-bf16, forward and backward."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 64, 8192, generator=g).requires_grad_()
    ref = torch.randn(4, 64, 8192, generator=g)
    tokens = torch.randint(0, 8192, (4, 64), generator=g)
    hidden = torch.randn(256, 128, generator=g, dtype=torch.bfloat16).requires_grad_()
    weight = torch.randn(8192, 128, generator=g, dtype=torch.bfloat16)
    rows = tokens.reshape(-1)[:256]
    return [
        lambda: klpen.get_logprobs_for_tokens(logits, tokens),
        lambda: klpen.logprobs_and_entropy(logits, tokens),
        lambda: klpen.full_kl(logits, ref),
        lambda: klpen.linear_logprobs(hidden, weight, rows),
        lambda: klpen.linear_full_kl(hidden, weight, hidden.detach(), weight),
    ]


def _run_large(call: Callable[[], object]) -> None:
    loss = sum_of(call())
    if loss.requires_grad:
        loss.backward()


class _Poller(threading.Thread):
    """Snapshots the settings from another thread until stopped; records every one that
    differs from its first, and whether the thread's torch thread count ever changed."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.stop = threading.Event()
        self.seen = 0
        self.changed: list[dict[str, object]] = []
        self.first: dict[str, object] = {}

    def run(self) -> None:
        self.first = snapshot()
        while not self.stop.is_set():
            now = snapshot()
            self.seen += 1
            if now != self.first:
                self.changed.append(now)


def test_a_polling_thread_sees_no_setting_change_during_calls() -> None:
    poller = _Poller()
    poller.start()
    try:
        for call in _large_calls():
            _run_large(call)
    finally:
        poller.stop.set()
        poller.join()
    assert poller.seen > 10  # it polled while the calls ran
    assert poller.changed == []
    assert poller.first["num_threads"] == torch.get_num_threads()


def test_threads_started_during_calls_see_the_caller_s_thread_count() -> None:
    """A user thread whose first torch op runs during a klpen call gets the thread count the
    process has, and it never changes in that thread."""
    expected = torch.get_num_threads()
    seen: list[list[int]] = []
    stop = threading.Event()

    def user() -> None:
        counts = [torch.get_num_threads()]
        a = torch.randn(64, 64)
        for _ in range(20):
            a = (a @ a).tanh_()
            counts.append(torch.get_num_threads())
        seen.append(counts)

    def spawner() -> None:
        while not stop.is_set():
            thread = threading.Thread(target=user)
            thread.start()
            thread.join()

    spawn = threading.Thread(target=spawner, daemon=True)
    spawn.start()
    try:
        for call in _large_calls():
            _run_large(call)
    finally:
        stop.set()
        spawn.join()
    assert len(seen) > 2
    assert all(count == expected for counts in seen for count in counts)


def _fp32_product_errors(stop: threading.Event, errors: list[float]) -> None:
    g = torch.Generator().manual_seed(2)
    a, b = torch.randn(256, 512, generator=g), torch.randn(512, 256, generator=g)
    truth = a.double() @ b.double()
    while not stop.is_set():
        errors.append(((a @ b).double() - truth).abs().max().item())


def test_other_threads_fp32_products_stay_fp32_while_bf16_calls_run_in_two_threads() -> None:
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(512, 256, generator=g, dtype=torch.bfloat16)
    weight = torch.randn(8192, 256, generator=g, dtype=torch.bfloat16)
    tokens = torch.randint(0, 8192, (512,), generator=g)
    sequential = klpen.linear_logprobs(hidden, weight, tokens)
    stop = threading.Event()
    errors: list[float] = []
    checker = threading.Thread(target=_fp32_product_errors, args=(stop, errors), daemon=True)
    results: list[Tensor] = []
    before = snapshot()

    def caller() -> None:
        for _ in range(3):
            results.append(klpen.linear_logprobs(hidden, weight, tokens))

    callers = [threading.Thread(target=caller) for _ in range(2)]
    checker.start()
    deadline = time.monotonic() + 60
    while not errors and time.monotonic() < deadline:
        time.sleep(0.01)
    for thread in callers:
        thread.start()
    for thread in callers:
        thread.join()
    stop.set()
    checker.join()
    assert snapshot() == before
    assert len(errors) > 2
    # fp32 error of these products is about 5e-5; bf16 operands would give about 1e-1
    assert max(errors) < 1e-3, max(errors)
    assert len(results) == 6
    for result in results:
        assert torch.equal(result, sequential)


_SCRIPT = textwrap.dedent(
    """
    import hashlib, sys
    sys.path.insert(0, sys.argv[1])
    import torch
    from public_calls import CASES, LEAVES, sum_of
    digest = hashlib.sha256()

    def feed(out):
        if isinstance(out, torch.Tensor):
            flat = out.detach().reshape(-1).contiguous()
            digest.update(flat.view(torch.uint8).numpy().tobytes())
        elif isinstance(out, dict):
            for value in out.values():
                feed(value)
        elif isinstance(out, (tuple, list)):
            for value in out:
                feed(value)

    for name, call in CASES:
        for x in LEAVES:
            x.grad = None
        out = call()
        feed(out)
        loss = sum_of(out)
        if loss.requires_grad:
            loss.backward()
            for x in LEAVES:
                feed(x.grad)
    print(digest.hexdigest())
    """
)


def test_three_fresh_processes_give_the_same_bytes() -> None:
    digests = set()
    for _ in range(3):
        done = subprocess.run(
            [sys.executable, "-c", _SCRIPT, str(TESTS)],
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        digests.add(done.stdout.strip())
    assert len(digests) == 1


def _rss() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="reads /proc/self/statm")
def test_a_freed_gradient_returns_its_memory_and_resizes() -> None:
    """A 256 MiB gradient of the logits: an ordinary tensor (``resize_`` works), whose memory
    is given back once the caller frees it."""
    logits = torch.randn(16, 4096, 1024).requires_grad_()  # 256 MiB of fp32
    tokens = torch.randint(0, 1024, (16, 4096))
    small = logits.detach()[:1, :64].clone().requires_grad_()
    klpen.get_logprobs_for_tokens(small, tokens[:1, :64]).sum().backward()  # a warm-up
    gc.collect()
    before = _rss()
    klpen.get_logprobs_for_tokens(logits, tokens).sum().backward()
    grad = logits.grad
    assert grad is not None and grad.nbytes == 256 << 20
    assert grad.untyped_storage().resizable()
    logits.grad = None
    grad.resize_(grad.numel() + 1)  # grows its storage, like any tensor's
    del grad
    gc.collect()
    assert _rss() - before <= 16 << 20


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_fork_after_a_call_computes_the_same_in_the_child() -> None:
    """klpen holds nothing a forked child cannot use. The child runs torch at one thread, as
    torch's own data-loader workers do: GNU OpenMP's thread pool does not survive ``fork``
    (a plain ``torch.exp`` hangs in such a child at two threads, with or without klpen)."""
    calls = _large_calls()[:3] + _large_calls()[3:4]

    def digest() -> str:
        h = hashlib.sha256()
        for call in calls:
            out = call()
            for part in out if isinstance(out, tuple) else (out,):
                h.update(part.detach().float().contiguous().view(torch.uint8).numpy().tobytes())
        return h.hexdigest()

    digest()  # a call at the process's thread count first
    with threads(1):
        parent = digest()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: compute, report, exit without running the parent's cleanup
        try:
            torch.set_num_threads(1)
            os.write(write, digest().encode())
        finally:
            os._exit(0)
    os.close(write)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.05)
    else:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        pytest.fail("the forked child did not finish")
    child = os.read(read, 200).decode()
    os.close(read)
    assert os.waitstatus_to_exitcode(status) == 0
    assert child == parent
