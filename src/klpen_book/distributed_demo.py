"""Live multi-process runs of :mod:`klpen.distributed`, and the arithmetic of chapter 11.

:func:`launch_gloo` starts a few fresh processes on this machine, joins them in a ``gloo``
process group (rendezvous through a file, transport on the loopback interface) and returns what
each rank's function returned. :func:`run_vocab_parallel_demo` uses it to split a vocabulary
across ranks and compare the vocab-parallel results with the single-process ones;
:func:`record_collectives` counts the collectives a call issues. The tests use the same tools.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import pickle
import socket
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from .blocks import CPU_BLOCK_ELEMENTS, GPU_BLOCK_ELEMENTS, block_bytes
from .tables import format_table

__all__ = [
    "Collective",
    "DataParallelAggregateDemo",
    "GlooRunError",
    "VocabParallelDemo",
    "communication_table",
    "even_split",
    "kl_memory_table",
    "launch_gloo",
    "logits_memory_table",
    "naive_full_kl",
    "record_collectives",
    "run_data_parallel_aggregate_demo",
    "run_vocab_parallel_demo",
]

GiB = float(1 << 30)
MiB = float(1 << 20)


# --- launching --------------------------------------------------------------------------------


def _loopback_interface() -> str | None:
    """The name of the loopback interface ("lo" on Linux, "lo0" on macOS), if one is found."""
    with contextlib.suppress(OSError, AttributeError):
        for _, name in socket.if_nameindex():
            if name.startswith("lo"):
                return name
    return None


def _entry(
    rank: int,
    world_size: int,
    workdir: str,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    timeout_s: float,
) -> None:
    # Keep gloo's transport on this machine; the rendezvous itself goes through a file.
    loopback = _loopback_interface()
    if loopback is not None:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback)
    torch.set_num_threads(1)
    store = dist.FileStore(os.path.join(workdir, "store"), world_size)  # type: ignore[attr-defined]
    dist.init_process_group(
        "gloo",
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    # Each rank leaves with os._exit once its result or error is on disk: no interpreter
    # teardown and no ProcessGroupGloo destructor, which can deadlock at exit (a gloo thread
    # waiting for the GIL while the destructor joins it; seen on torch 2.4 under load).
    try:
        result = fn(rank, world_size, *args)
        dist.barrier()
        with open(os.path.join(workdir, f"rank{rank}.pkl"), "wb") as f:
            pickle.dump(result, f)
    except BaseException:
        # Saved so that the parent can show every rank's error, not only the first to exit
        # (often a peer's "connection closed" rather than the cause).
        with open(os.path.join(workdir, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        os._exit(1)
    os._exit(0)


class GlooRunError(RuntimeError):
    """A rank of :func:`launch_gloo` raised; the message holds every failing rank's traceback."""


def launch_gloo(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 60.0,
    join_timeout_s: float | None = None,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` fresh processes in a gloo group.

    Each process is spawned (not forked), so ``fn`` must be a module-level function and
    ``args`` picklable; the default process group is initialised before ``fn`` runs, and
    each process ends with ``os._exit`` once its result is written (gloo's teardown at exit can
    deadlock). A collective that waits longer than ``timeout_s`` fails instead of
    hanging. Returns the values returned by ``fn``, in rank order (they must be picklable).
    An exception on any rank raises :class:`GlooRunError` here, with the traceback of every
    rank that failed in its message. With ``join_timeout_s``, processes still running after
    that many seconds are killed and :class:`GlooRunError` says so (a watchdog for tests).

    Example:
        >>> launch_gloo(_rank_and_size, 2)  # doctest: +SKIP
        [(0, 2), (1, 2)]
    """
    from torch.multiprocessing.spawn import spawn

    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    with tempfile.TemporaryDirectory(prefix="klpen-gloo-") as workdir:
        try:
            context = spawn(  # type: ignore[no-untyped-call]
                _entry,
                args=(world_size, workdir, fn, args, timeout_s),
                nprocs=world_size,
                join=False,
            )
            deadline = None if join_timeout_s is None else time.monotonic() + join_timeout_s
            while not context.join(
                timeout=None if deadline is None else max(deadline - time.monotonic(), 0.0)
            ):
                if deadline is not None and time.monotonic() >= deadline:
                    for process in context.processes:
                        if process.is_alive():
                            process.kill()
                        process.join()
                    raise GlooRunError(
                        f"the ranks did not finish within join_timeout_s={join_timeout_s} s "
                        "and were killed"
                    )
        except GlooRunError:
            raise
        except Exception as exc:
            errors = []
            for rank in range(world_size):
                path = os.path.join(workdir, f"rank{rank}.err")
                if os.path.exists(path):
                    with open(path) as f:
                        errors.append(f"--- rank {rank}:\n{f.read()}")
            raise GlooRunError("\n".join(errors) or str(exc)) from exc
        results = []
        for rank in range(world_size):
            with open(os.path.join(workdir, f"rank{rank}.pkl"), "rb") as f:
                results.append(pickle.load(f))
    return results


def _rank_and_size(rank: int, world_size: int) -> tuple[int, int]:
    return rank, world_size


# --- recording collectives --------------------------------------------------------------------


@dataclass(frozen=True)
class Collective:
    """One collective call: its name, reduce op, shape and dtype of the tensor it moves."""

    name: str
    op: str
    shape: tuple[int, ...]
    dtype: str

    def __str__(self) -> str:
        shape = "×".join(map(str, self.shape))
        op = f" {self.op}" if self.op else ""
        return f"{self.name}{op} of {shape} {self.dtype}"


@contextlib.contextmanager
def record_collectives() -> Iterator[list[Collective]]:
    """Record the ``all_reduce`` / ``all_gather`` calls made through ``torch.distributed``.

    Yields the list the calls are appended to. For ``all_gather`` the recorded tensor is the
    one each rank contributes.

    Example:
        >>> with record_collectives() as calls:
        ...     pass
        >>> calls
        []
    """
    calls: list[Collective] = []
    all_reduce, all_gather = dist.all_reduce, dist.all_gather

    def _dtype(t: torch.Tensor) -> str:
        return str(t.dtype).removeprefix("torch.")

    def recording_all_reduce(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        op = kwargs.get("op", args[0] if args else dist.ReduceOp.SUM)
        name = str(op).rsplit(".", 1)[-1].lower()
        calls.append(Collective("all_reduce", name, tuple(tensor.shape), _dtype(tensor)))
        return all_reduce(tensor, *args, **kwargs)

    def recording_all_gather(
        tensors: list[torch.Tensor], tensor: torch.Tensor, *args: Any, **kwargs: Any
    ) -> Any:
        calls.append(Collective("all_gather", "", tuple(tensor.shape), _dtype(tensor)))
        return all_gather(tensors, tensor, *args, **kwargs)

    dist.all_reduce, dist.all_gather = recording_all_reduce, recording_all_gather  # type: ignore[assignment]
    try:
        yield calls
    finally:
        dist.all_reduce, dist.all_gather = all_reduce, all_gather


# --- the demonstration ------------------------------------------------------------------------


def even_split(vocab: int, world_size: int) -> list[int]:
    """Slice sizes as even as possible, the larger ones first (as ``torch.tensor_split``).

    Example:
        >>> even_split(10, 3)
        [4, 3, 3]
    """
    return [len(part) for part in torch.arange(vocab).tensor_split(world_size)]


def _demo_inputs(
    batch: int, seq: int, vocab: int, seed: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    policy = torch.randn(batch, seq, vocab, generator=gen, dtype=torch.float64) * 2
    reference = policy + torch.randn(batch, seq, vocab, generator=gen, dtype=torch.float64)
    tokens = torch.randint(0, vocab, (batch, seq), generator=gen)
    return policy.to(dtype), reference.to(dtype), tokens


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().double() - b.detach().double()).abs().max())


def _demo_rank(
    rank: int,
    world_size: int,
    sizes: list[int],
    shape: tuple[int, int, int],
    seed: int,
    dtype: torch.dtype,
) -> dict[str, Any]:
    from klpen import full_kl, get_logprobs_for_tokens
    from klpen.distributed import vocab_parallel_full_kl, vocab_parallel_logprobs

    policy, reference, tokens = _demo_inputs(*shape, seed, dtype)
    start = sum(sizes[:rank])
    cols = slice(start, start + sizes[rank])
    # The single-process results on the full logits, for comparison.
    full = policy.clone().requires_grad_()
    logp = get_logprobs_for_tokens(full, tokens)
    (grad_logp,) = torch.autograd.grad(logp.sum(), full)
    kl = full_kl(full, reference)
    (grad_kl,) = torch.autograd.grad(kl.sum(), full)

    local = policy[..., cols].clone().requires_grad_()
    with record_collectives() as calls_logp:
        par_logp = vocab_parallel_logprobs(local, tokens)
    with record_collectives() as calls_logp_bwd:
        (par_grad_logp,) = torch.autograd.grad(par_logp.sum(), local)
    with record_collectives() as calls_kl:
        par_kl = vocab_parallel_full_kl(local, reference[..., cols])
    with record_collectives() as calls_kl_bwd:
        (par_grad_kl,) = torch.autograd.grad(par_kl.sum(), local)
    return {
        "slice": (cols.start, cols.stop),
        "logprobs": _max_diff(par_logp, logp),
        "grad_logprobs": _max_diff(par_grad_logp, grad_logp[..., cols]),
        "kl": _max_diff(par_kl, kl),
        "grad_kl": _max_diff(par_grad_kl, grad_kl[..., cols]),
        "first_logprobs": par_logp.detach().flatten()[:4].tolist(),
        "first_kl": par_kl.detach().flatten()[:4].tolist(),
        "single_first_logprobs": logp.detach().flatten()[:4].tolist(),
        "single_first_kl": kl.detach().flatten()[:4].tolist(),
        "collectives": {
            "vocab_parallel_logprobs": calls_logp,
            "vocab_parallel_logprobs backward": calls_logp_bwd,
            "vocab_parallel_full_kl": calls_kl,
            "vocab_parallel_full_kl backward": calls_kl_bwd,
        },
    }


def _bound(diff: float, tolerance: float) -> str:
    # A bound, not the raw difference: its last digits may change with the CPU and BLAS.
    return f"< {tolerance:.0e}" if diff < tolerance else f"{diff:.1e} (above {tolerance:.0e})"


@dataclass(frozen=True)
class VocabParallelDemo:
    """What :func:`run_vocab_parallel_demo` measured on every rank.

    Attributes:
        world_size, batch, seq, vocab: the run's sizes; ``sizes`` the slice size per rank.
        dtype: the logits' dtype; ``tolerance`` the bound the differences are checked against.
        ranks: one dict per rank: its ``slice`` ``(start, stop)``, the max absolute
            differences from the single-process results (``logprobs``, ``grad_logprobs``,
            ``kl``, ``grad_kl``), the first values of both, and the ``collectives`` issued.
    """

    world_size: int
    batch: int
    seq: int
    vocab: int
    sizes: list[int]
    dtype: str
    tolerance: float
    ranks: list[dict[str, Any]] = field(repr=False)

    @property
    def max_difference(self) -> float:
        """The largest difference over all ranks and all four quantities."""
        keys = ("logprobs", "grad_logprobs", "kl", "grad_kl")
        return max(float(r[k]) for r in self.ranks for k in keys)

    def table(self) -> str:
        """Per rank: its slice and the max |difference| from one process, as bounds."""
        rows = [
            [
                str(rank),
                f"[{r['slice'][0]}, {r['slice'][1]})",
                *(_bound(r[k], self.tolerance) for k in ("logprobs", "grad_logprobs")),
                *(_bound(r[k], self.tolerance) for k in ("kl", "grad_kl")),
            ]
            for rank, r in enumerate(self.ranks)
        ]
        headers = ["rank", "vocab slice", "log-probs", "their grad", "full KL", "its grad"]
        return format_table(rows, headers)

    def values(self, digits: int = 4) -> str:
        """The first log-probs and KLs on every rank next to the single-process ones."""
        rows: list[list[object]] = []
        for i in range(len(self.ranks[0]["first_logprobs"])):
            row: list[object] = [str(i), self.ranks[0]["single_first_logprobs"][i]]
            row += [r["first_logprobs"][i] for r in self.ranks]
            row += [self.ranks[0]["single_first_kl"][i]]
            row += [r["first_kl"][i] for r in self.ranks]
            rows.append(row)
        ranks = range(self.world_size)
        headers = [
            "row",
            "log-prob, 1 process",
            *(f"rank {r}" for r in ranks),
            "KL, 1 process",
            *(f"rank {r} " for r in ranks),
        ]
        return format_table(rows, headers, digits=digits)

    def collectives(self, rank: int = 0) -> str:
        """The collectives ``rank`` issued, per call."""
        lines = []
        for call, issued in self.ranks[rank]["collectives"].items():
            what = "; ".join(map(str, issued)) if issued else "none"
            lines.append(f"{call}: {what}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return (
            f"VocabParallelDemo(world_size={self.world_size}, shape=({self.batch}, {self.seq}, "
            f"{self.vocab}), sizes={self.sizes}, dtype={self.dtype})\n{self.table()}"
        )


def run_vocab_parallel_demo(
    world_size: int = 2,
    batch: int = 2,
    seq: int = 4,
    vocab: int = 10,
    sizes: Sequence[int] | None = None,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> VocabParallelDemo:
    """Split a vocabulary across ``world_size`` live gloo processes and check every rank.

    Every rank draws the same random policy logits ``(batch, seq, vocab)``, reference logits
    and tokens from ``seed``, keeps the columns of its slice, and calls
    :func:`~klpen.distributed.vocab_parallel_logprobs` and
    :func:`~klpen.distributed.vocab_parallel_full_kl` with gradients of their sums; it also
    computes :func:`~klpen.get_logprobs_for_tokens` and :func:`~klpen.full_kl` on the full
    logits and reports the max absolute differences, and the collectives it issued.

    Args:
        world_size: number of processes.
        batch, seq, vocab: the logits' shape.
        sizes: slice size per rank (they must add up to ``vocab``); default
            :func:`even_split`.
        seed: seed of the inputs.
        dtype: dtype of the logits (``torch.float32`` or ``torch.float64``).

    Example:
        >>> demo = run_vocab_parallel_demo(world_size=2, sizes=[9, 1])  # doctest: +SKIP
        >>> demo.max_difference < demo.tolerance  # doctest: +SKIP
        True
    """
    split = even_split(vocab, world_size) if sizes is None else [int(s) for s in sizes]
    if len(split) != world_size or sum(split) != vocab or min(split) < 1:
        raise ValueError(
            f"sizes must give {world_size} positive slice sizes adding up to vocab={vocab}, "
            f"got {split}"
        )
    ranks = launch_gloo(_demo_rank, world_size, split, (batch, seq, vocab), seed, dtype)
    tolerance = 1e-12 if dtype == torch.float64 else 1e-6
    name = str(dtype).removeprefix("torch.")
    return VocabParallelDemo(world_size, batch, seq, vocab, split, name, tolerance, ranks)


# --- data-parallel aggregation -------------------------------------------------------------------


def _aggregate_demo_batch(
    lengths: Sequence[Sequence[int]], hidden: int, seed: int
) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
    """Every rank's features ``(B_r, T, hidden)`` and mask (row ``b`` of rank ``r`` has
    ``lengths[r][b]`` valid tokens), and the shared parameter; the same on every rank."""
    gen = torch.Generator().manual_seed(seed)
    width = max(max(row) for row in lengths)
    features, masks = [], []
    for rows in lengths:
        features.append(torch.randn(len(rows), width, hidden, generator=gen, dtype=torch.float64))
        masks.append(torch.arange(width) < torch.tensor(rows).unsqueeze(-1))
    parameter = torch.randn(hidden, generator=gen, dtype=torch.float64)
    return features, masks, parameter


def _aggregate_demo_rank(
    rank: int, world_size: int, lengths: list[list[int]], mode: str, hidden: int, seed: int
) -> dict[str, Any]:
    from klpen import aggregate as single_process_aggregate
    from klpen.distributed import aggregate

    features, masks, parameter = _aggregate_demo_batch(lengths, hidden, seed)

    def loss_and_grad(fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], r: int) -> Any:
        p = parameter.clone().requires_grad_()
        x, m = (torch.cat(features), torch.cat(masks)) if r < 0 else (features[r], masks[r])
        value = fn(torch.tanh(x @ p), m)
        (grad,) = torch.autograd.grad(value, p)
        return value.detach(), grad

    def averaged(t: torch.Tensor) -> torch.Tensor:
        # What DDP does with gradients (and what a trainer logs as the mean of a loss).
        t = t.clone()
        dist.all_reduce(t)
        return t / world_size

    with record_collectives() as calls:
        value, grad = loss_and_grad(lambda x, m: aggregate(x, m, mode), rank)
    local_value, local_grad = loss_and_grad(lambda x, m: single_process_aggregate(x, m, mode), rank)
    single_value, single_grad = loss_and_grad(lambda x, m: single_process_aggregate(x, m, mode), -1)
    scale = float(single_grad.abs().max())
    return {
        "rows": len(lengths[rank]),
        "tokens": sum(lengths[rank]),
        "local": float(local_value),
        "value": float(value),
        "naive": float(averaged(local_value)),
        "single": float(single_value),
        "grad_error": float((averaged(grad) - single_grad).abs().max()) / scale,
        "naive_grad_error": float((averaged(local_grad) - single_grad).abs().max()) / scale,
        "collectives": [str(c) for c in calls],
    }


@dataclass(frozen=True)
class DataParallelAggregateDemo:
    """What :func:`run_data_parallel_aggregate_demo` measured on every rank.

    Attributes:
        world_size, mode: the run's group size and aggregation mode.
        lengths: the valid tokens of each row, per rank.
        ranks: one dict per rank: ``rows``, ``tokens``, ``local`` (its own
            ``klpen.aggregate``), ``value`` (``klpen.distributed.aggregate``), ``naive`` (the
            mean over ranks of ``local``), ``single`` (one process, the whole batch),
            ``grad_error`` and ``naive_grad_error`` (max |DDP-averaged gradient - one-process
            gradient| relative to the largest one-process gradient) and ``collectives``.
    """

    world_size: int
    mode: str
    lengths: list[list[int]]
    ranks: list[dict[str, Any]] = field(repr=False)

    def table(self) -> str:
        """Per rank: its rows, its valid tokens, its own aggregate, and what it returns."""
        rows = [
            [str(rank), str(r["rows"]), str(r["tokens"]), r["local"], r["value"]]
            for rank, r in enumerate(self.ranks)
        ]
        headers = ["rank", "rows", "valid tokens", "its own aggregate", "distributed.aggregate"]
        return format_table(rows, headers, digits=4)

    def summary(self) -> str:
        """The global value three ways, and how far each DDP-averaged gradient is off."""
        r = self.ranks[0]
        lines = [
            f"one process, whole batch:          {r['single']:.4f}",
            f"klpen.distributed.aggregate:       {r['value']:.4f}",
            f"mean of the per-rank aggregates:   {r['naive']:.4f}",
            "DDP-averaged gradient vs one process (max error / max |gradient|):",
            f"  klpen.distributed.aggregate:     {_bound(r['grad_error'], 1e-12)}",
            f"  per-rank aggregate:              {r['naive_grad_error']:.3f}",
        ]
        return "\n".join(lines)

    def __repr__(self) -> str:
        return (
            f"DataParallelAggregateDemo(world_size={self.world_size}, mode={self.mode!r}, "
            f"lengths={self.lengths})\n{self.table()}"
        )


def run_data_parallel_aggregate_demo(
    lengths: Sequence[Sequence[int]] = ((2, 3), (9, 12, 10, 11)),
    mode: str = "token-mean",
    hidden: int = 4,
    seed: int = 0,
) -> DataParallelAggregateDemo:
    """Split a batch unevenly across live gloo processes and aggregate it three ways.

    Rank ``r`` holds the rows ``lengths[r]`` (each number: the valid tokens of one row, padded
    to the longest), with values ``tanh(x @ p)`` for a parameter ``p`` that every rank holds,
    as under DDP. Every rank computes :func:`klpen.distributed.aggregate`, its own
    :func:`klpen.aggregate` (what a trainer that forgets the other ranks computes), and the
    single-process aggregate of the whole batch; the gradients w.r.t. ``p`` are averaged over
    the ranks, as DDP does, and compared with the single-process one.

    Args:
        lengths: per rank, the valid tokens of each of its rows (at least one row each).
        mode: an aggregation mode of :func:`klpen.aggregate`.
        hidden: size of ``p``.
        seed: seeds the features and ``p`` (the same on every rank).

    Example:
        >>> demo = run_data_parallel_aggregate_demo()  # doctest: +SKIP
        >>> demo.ranks[0]["grad_error"] < 1e-12  # doctest: +SKIP
        True
    """
    rows = [[int(n) for n in r] for r in lengths]
    if len(rows) < 1 or any(not r or min(r) < 0 for r in rows):
        raise ValueError(
            f"lengths must give, per rank, the non-negative token counts of at least one row, "
            f"got {rows}"
        )
    ranks = launch_gloo(_aggregate_demo_rank, len(rows), rows, mode, hidden, seed)
    return DataParallelAggregateDemo(len(rows), mode, rows, ranks)


# --- the arithmetic of the chapter ------------------------------------------------------------


def logits_memory_table(
    configs: Sequence[tuple[str, int, int, int]], naive_temporaries: int = 5
) -> str:
    """Memory of one fp32 ``(B, T, V)`` tensor, of a naive full KL and of klpen's working block.

    Args:
        configs: rows ``(name, B, T, V)``.
        naive_temporaries: ``(B, T, V)`` temporaries of the naive full KL
            ``(exp(lz) * (lz - lw)).sum(-1)`` with ``lz, lw = log_softmax(z), log_softmax(w)``:
            ``lz``, ``lw``, ``exp(lz)``, ``lz - lw`` and the product make five.

    klpen's block holds whole rows, as many as fit in :data:`~klpen_book.blocks.CPU_BLOCK_ELEMENTS`
    entries on a CPU and :data:`~klpen_book.blocks.GPU_BLOCK_ELEMENTS` on a GPU (at least one
    row): :func:`~klpen_book.blocks.block_bytes`.

    Example:
        >>> print(logits_memory_table([("toy", 1, 2, 4)]))
        model  B  T  V  logits fp32 (GiB)  naive full KL (GiB)  CPU block (MiB)  GPU block (MiB)
        -----  -  -  -  -----------------  -------------------  ---------------  ---------------
        toy    1  2  4              0.000                0.000            0.000            0.000
    """
    rows = []
    for name, b, t, v in configs:
        one = b * t * v * 4
        cpu = block_bytes(b * t, v, CPU_BLOCK_ELEMENTS)
        gpu = block_bytes(b * t, v, GPU_BLOCK_ELEMENTS)
        rows.append([name, str(b), str(t), str(v), one / GiB, naive_temporaries * one / GiB,
                     cpu / MiB, gpu / MiB])  # fmt: skip
    headers = ["model", "B", "T", "V", "logits fp32 (GiB)", "naive full KL (GiB)"]
    return format_table(rows, [*headers, "CPU block (MiB)", "GPU block (MiB)"])


def communication_table(batch: int, seq: int, vocab: int, world_sizes: Sequence[int]) -> str:
    """Bytes each rank sends per call: all-gathering the logits vs klpen's collectives.

    Computed from the collectives the functions issue (``VocabParallelDemo.collectives``
    lists them). A ring all-reduce of ``S`` bytes sends ``2 (R-1)/R · S`` bytes from each of
    ``R`` ranks; a ring all-gather of ``S`` bytes per rank sends ``(R-1) · S``. Gathering the
    logits sends ``(R-1)/R · B·T·V·4`` (each rank's slice to the ``R-1`` others). klpen's
    log-probs all-reduce ``(3N + 1)`` then ``(2N + 1)`` fp32 numbers (the max carries the token
    ids and their negatives, an exact check that every rank has the same tokens; each ``+ 1`` a
    failure flag); its full KL all-gathers ``4N + 1`` float64 per rank (``N = B·T``). The
    metadata all-gather of 16 int64 per rank (128 bytes) is left out.

    Example:
        >>> print(communication_table(1, 1024, 32000, [2]))
        R  gather logits (MiB)  klpen log-probs (KiB)  klpen full KL (KiB)  logits / KL
        -  -------------------  ---------------------  -------------------  -----------
        2               62.500                 20.008               32.008     1999.512
    """
    n = batch * seq
    rows = []
    for r in world_sizes:
        logits = (r - 1) / r * n * vocab * 4
        logprobs = 2 * (r - 1) / r * (5 * n + 2) * 4
        kl = (r - 1) * (4 * n + 1) * 8
        rows.append([str(r), logits / MiB, logprobs / 1024, kl / 1024, logits / kl])
    headers = ["R", "gather logits (MiB)", "klpen log-probs (KiB)", "klpen full KL (KiB)"]
    return format_table(rows, [*headers, "logits / KL"])


def naive_full_kl(policy_logits: torch.Tensor, reference_logits: torch.Tensor) -> torch.Tensor:
    r"""The textbook full KL, for comparison: two log-softmax copies and three more temporaries.

    .. math:: \mathrm{KL} = \textstyle\sum_v e^{l_v} (l_v - m_v),
        \quad l = \log\mathrm{softmax}(z), \; m = \log\mathrm{softmax}(w)

    Same values as :func:`klpen.full_kl` (up to rounding) wherever both are finite; its peak
    memory is five ``(..., V)`` tensors.

    Example:
        >>> naive_full_kl(torch.tensor([[2.0, 0.0, 0.0]]), torch.zeros(1, 3))
        tensor([0.4330])
    """
    lz = torch.log_softmax(policy_logits, dim=-1)
    lw = torch.log_softmax(reference_logits, dim=-1)
    return (torch.exp(lz) * (lz - lw)).sum(-1)


def kl_memory_table(shapes: Sequence[tuple[int, int, int]], seed: int = 0) -> str:
    """Measured peak extra memory of :func:`naive_full_kl` and :func:`klpen.full_kl` (forward).

    For each ``(B, T, V)``, random fp32 logits are drawn and each computation is measured with
    :func:`klpen_book.memory.peak_extra_bytes` (torch's own allocation record: deterministic).
    Also prints the size of one ``(B, T, V)`` fp32 tensor and the largest difference of the two
    results.

    Example:
        >>> print(kl_memory_table([(1, 2, 8)]).splitlines()[0])
        B  T  V  one (B,T,V) fp32 (MB)  naive (MB)  klpen (MB)  max |difference|
    """
    from klpen import full_kl

    from .memory import peak_extra_bytes

    gen = torch.Generator().manual_seed(seed)
    rows = []
    for b, t, v in shapes:
        z = torch.randn(b, t, v, generator=gen)
        w = z + torch.randn(b, t, v, generator=gen)
        naive = peak_extra_bytes(naive_full_kl, z, w)
        ours = peak_extra_bytes(full_kl, z, w)
        diff = float((naive_full_kl(z, w) - full_kl(z, w)).abs().max())
        rows.append(
            [
                str(b),
                str(t),
                str(v),
                z.numel() * 4 / 1e6,
                naive / 1e6,
                ours / 1e6,
                _bound(diff, 1e-5),
            ]
        )
    headers = ["B", "T", "V", "one (B,T,V) fp32 (MB)", "naive (MB)", "klpen (MB)"]
    return format_table(rows, [*headers, "max |difference|"], digits=1)
