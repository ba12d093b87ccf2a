"""Ahead-of-time compilation of recorded Triton launches for GPU targets, without a GPU.

:func:`~klpen.kernels.triton_launch.recording` gives the launches a backend would make; here
each becomes a :class:`Spec` (the kernel, by module and name, with the signature, constexprs,
integer/pointer specialisations and options that Triton's own launcher would derive from
those arguments for a target) and is compiled by ``triton.compile`` for that target: Triton's
front end, LLVM and the ``ptxas`` that ships in the ``triton`` wheel. No GPU and no driver are
needed. Each result carries ``ptxas``'s resource report (registers, spill bytes, shared
memory) and, on request, the cubin (for ``cuobjdump`` / ``nvdisasm``).

Compilation runs in fresh worker processes (:func:`compile_all`) with ``TRITON_INTERPRET``
unset and a cache directory of the caller's choosing, so that the kernels are the real
``triton.jit`` functions and nothing compiled earlier is reused.

Example:
    >>> TARGETS
    (80, 90)
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import importlib
import io
import multiprocessing
import os
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from .triton_launch import Launch

__all__ = ["TARGETS", "Compiled", "Spec", "compile_all", "compile_one", "sass", "spec_of"]

# The compute capabilities compiled for: the A100 (sm_80) and H100 (sm_90) families.
TARGETS = (80, 90)


@dataclass(frozen=True)
class Spec:
    """One kernel variant for one target: what ``triton.compile`` needs, in plain data."""

    module: str
    name: str
    capability: int
    signature: tuple[tuple[str, str], ...]
    constexprs: tuple[tuple[tuple[int, ...], Any], ...]
    attrs: tuple[tuple[tuple[int, ...], tuple[tuple[str, int], ...]], ...]
    options: tuple[tuple[str, Any], ...]

    @property
    def label(self) -> str:
        """``name[constexpr=value, ...; arg:type, ...]`` for tables and error messages."""
        names = dict(enumerate(n for n, _ in self.signature))
        consts = ", ".join(f"{names[p[0]]}={_show(v)}" for p, v in self.constexprs)
        types = ", ".join(f"{n}:{t}" for n, t in self.signature if t != "constexpr")
        warps = dict(self.options)["num_warps"]
        return f"{self.name}[{consts}; warps={warps}; {types}]"


@dataclass
class Compiled:
    """The compile result of a :class:`Spec`: ``ptxas``'s report, or the error."""

    spec: Spec
    registers: int = -1
    spill_stores: int = -1
    spill_loads: int = -1
    shared: int = -1
    error: str | None = None
    cubin: bytes = field(default=b"", repr=False)


def _show(value: Any) -> str:
    return str(getattr(value, "name", value))


def _plain(value: Any) -> Any:
    """A constexpr value as plain data (a Triton dtype as ``("dtype", name)``)."""
    name = getattr(value, "name", None)
    if name is not None and type(value).__name__ == "dtype":
        return ("dtype", name)
    return value


def _unplain(value: Any) -> Any:
    if isinstance(value, tuple) and len(value) == 2 and value[0] == "dtype":
        import triton.language as tl  # type: ignore[import-untyped]

        name: str = value[1]
        return getattr(tl, _TL_NAMES.get(name, name))
    return value


_TL_NAMES = {"fp32": "float32", "fp64": "float64", "fp16": "float16", "bf16": "bfloat16"}


def _jit_function(kernel: Any) -> Any:
    """The ``JITFunction`` behind ``kernel`` (under the interpreter, one made from its code)."""
    from triton.runtime.jit import JITFunction  # type: ignore[import-untyped]

    if isinstance(kernel, JITFunction):
        return kernel
    return JITFunction(kernel.fn)


def spec_of(launch: Launch, capability: int) -> Spec:
    """The :class:`Spec` Triton's launcher would compile for ``launch`` on a device of
    compute capability ``capability // 10 . capability % 10`` (its binder and argument
    packing, run against that target's backend instead of the active device's).

    Example:
        >>> import torch
        >>> from klpen.kernels.triton_launch import recording
        >>> from klpen.kernels.triton_backend import TritonBackend, version_supported
        >>> with recording() as launches:
        ...     _ = TritonBackend().logprobs_forward(torch.zeros(2, 32), None, 1.0, True)
        >>> launches[0].kwargs["num_warps"]
        4
        >>> if version_supported():  # the binder of Triton >= 3.9
        ...     assert spec_of(launches[0], 90).name == "_logprobs_fwd_kernel"
    """
    from triton.backends.compiler import GPUTarget  # type: ignore[import-untyped]
    from triton.compiler import make_backend  # type: ignore[import-untyped]
    from triton.runtime.jit import create_function_from_signature  # type: ignore[import-untyped]

    fn = _jit_function(launch.kernel)
    backend = make_backend(GPUTarget("cuda", capability, 32))
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*launch.args, **launch.kwargs)
    options, signature, constexprs, attrs = fn._pack_args(
        backend, launch.kwargs, bound, specialization, options
    )
    return Spec(
        module=fn.fn.__module__,
        name=fn.fn.__name__,
        capability=capability,
        signature=tuple(signature.items()),
        constexprs=tuple(sorted((tuple(k), _plain(v)) for k, v in constexprs.items())),
        attrs=tuple(
            sorted((tuple(k), tuple((str(a), int(b)) for a, b in v)) for k, v in attrs.items())
        ),
        options=tuple(sorted((k, _freeze(v)) for k, v in options.__dict__.items())),
    )


def _freeze(value: Any) -> Any:
    if isinstance(value, list | tuple):
        return tuple(_freeze(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in value.items()))
    return value


def _thaw(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


_PTXAS_USED = re.compile(r"Used (\d+) registers")
_PTXAS_SPILL = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_PTXAS_SMEM = re.compile(r"(\d+) bytes smem")


def compile_one(spec: Spec, keep_cubin: bool = False) -> Compiled:
    """Compile ``spec`` with ``triton.compile`` for its target; ``ptxas``'s report parsed.

    Call it where ``TRITON_INTERPRET`` is unset (:func:`compile_all` does). Any exception
    from Triton's compiler is returned in ``error`` (its type and full message).
    """
    import triton  # type: ignore[import-untyped]
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource  # type: ignore[import-untyped]
    from triton.knobs import nvidia  # type: ignore[import-untyped]

    result = Compiled(spec)
    try:
        fn = getattr(importlib.import_module(spec.module), spec.name)
        source = ASTSource(
            fn,
            dict(spec.signature),
            {k: _unplain(v) for k, v in spec.constexprs},
            {k: [list(a) for a in v] for k, v in spec.attrs},
        )
        options = dict(spec.options)
        log = io.StringIO()
        nvidia.dump_ptxas_log = True
        with contextlib.redirect_stdout(log):
            kernel = triton.compile(
                source, target=GPUTarget("cuda", spec.capability, 32), options=options
            )
    except Exception as exc:  # every compiler failure is reported, not raised
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    text = log.getvalue()
    used, spill, smem = (
        _PTXAS_USED.search(text),
        _PTXAS_SPILL.search(text),
        _PTXAS_SMEM.search(text),
    )
    result.registers = int(used.group(1)) if used else -1
    result.spill_stores = int(spill.group(1)) if spill else 0
    result.spill_loads = int(spill.group(2)) if spill else 0
    result.shared = int(kernel.metadata.shared)
    if smem and not result.shared:
        result.shared = int(smem.group(1))
    if keep_cubin:
        result.cubin = bytes(kernel.asm["cubin"])
    return result


def sass(cubin: bytes) -> str:
    """The SASS of a compiled kernel (``Compiled.cubin``), by the ``cuobjdump`` that ships in
    the ``triton`` wheel."""
    import subprocess
    import tempfile
    from pathlib import Path

    import triton  # type: ignore[import-untyped]

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run(
            [str(tool), "-sass", f.name], capture_output=True, text=True, check=True
        ).stdout


@contextlib.contextmanager
def _environ(cache_dir: str) -> Iterator[None]:
    """``TRITON_INTERPRET`` unset and ``TRITON_CACHE_DIR=cache_dir`` in this process's
    environment while the workers are started (they inherit it), then restored."""
    saved = {k: os.environ.get(k) for k in ("TRITON_INTERPRET", "TRITON_CACHE_DIR")}
    os.environ.pop("TRITON_INTERPRET", None)
    os.environ["TRITON_CACHE_DIR"] = cache_dir
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _compile_keep(spec: Spec) -> Compiled:
    return compile_one(spec, keep_cubin=True)


def compile_all(
    specs: Iterable[Spec], cache_dir: str, workers: int = 2, keep_cubin: bool = False
) -> list[Compiled]:
    """Compile each distinct spec once, in ``workers`` fresh processes (``spawn``) with
    ``TRITON_INTERPRET`` unset and ``TRITON_CACHE_DIR=cache_dir``; results in ``specs``'
    order of first appearance."""
    unique: list[Spec] = list(dict.fromkeys(specs))
    context = multiprocessing.get_context("spawn")
    task = _compile_keep if keep_cubin else compile_one
    with (
        _environ(cache_dir),
        concurrent.futures.ProcessPoolExecutor(max_workers=workers, mp_context=context) as pool,
    ):
        return list(pool.map(task, unique, chunksize=1))


def specs_for(launches: Sequence[Launch], targets: Sequence[int] = TARGETS) -> list[Spec]:
    """The distinct :class:`Spec` of ``launches`` for each target, in order."""
    return list(dict.fromkeys(spec_of(launch, cc) for cc in targets for launch in launches))


# The layouts the backend is driven with: (name, leading shape, V, how the logits are laid
# out). With MAIN_LAYOUT (V = 5,003: blocks of 4,096, nothing divisible by 16), every block
# size of GPU_BLOCKS and Triton's integer specialisations: == 1 ("one", "single row"),
# divisible by 16 ("single row"), two leading strides ("sliced"), a vocabulary stride with
# (V - 1) · stride ≥ 2^31 ("wide", a transposed product's layout) and a stride ≥ 2^31, an i64
# argument ("huge").
Layout = tuple[str, tuple[int, ...], int, str]
MAIN_LAYOUT: Layout = ("V=5003", (3,), 5003, "contiguous")
LAYOUTS: tuple[Layout, ...] = (
    ("one", (3,), 1, "contiguous"),
    ("single row", (1,), 8192, "contiguous"),
    ("sliced", (2, 6), 600, "sliced"),
    ("wide", (2,), 300, "wide"),
    ("huge", (2,), 2, "wide"),
)


def _logits(shape: tuple[int, ...], vocab: int, how: str, dtype: Any) -> Any:
    import torch

    if how == "contiguous":
        return torch.zeros((*shape, vocab), dtype=dtype)
    if how == "sliced":  # logits[:, :-1]: two leading strides
        return torch.zeros((shape[0], shape[1] + 1, vocab), dtype=dtype)[:, :-1]
    # wide: vocabulary stride 2^31 // (V - 1) + 1, rows 1 apart (a transposed (V, N) product's
    # layout); the storage is never touched
    stride = (1 << 31) // (vocab - 1) + 1
    storage = torch.empty((vocab - 1) * stride + shape[0], dtype=dtype)
    return storage.as_strided((*shape, vocab), (1, stride))


def backend_launches() -> list[Launch]:
    """Every launch the Triton backend makes when its methods are driven over the dtypes
    (fp32, bf16, fp16, fp64, a mixed pair), the flags (tokens, entropy, the gradients given,
    the two validation modes of the full KL, the generalized JSD's ends and mixture, the
    hidden-state tiles' flags) and the layouts.

    Every product of a dtype (or the mixed pair), a flag and a layout (:data:`MAIN_LAYOUT`,
    an LLM-like one, and :data:`LAYOUTS`): every kernel, flag, dtype, block size and integer
    specialisation the backend launches, together. Recorded, not run
    (:func:`~klpen.kernels.triton_launch.recording`), on CPU tensors that stand for CUDA
    ones: the block sizes are the GPU's.
    """
    import torch

    from .triton_backend import TritonBackend
    from .triton_launch import recording

    backend = TritonBackend()
    dtypes = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
    pairs = [(dtype, dtype) for dtype in dtypes] + [(torch.bfloat16, torch.float32)]
    runs = [(layout, dz, dw) for layout in (MAIN_LAYOUT, *LAYOUTS) for dz, dw in pairs]
    with recording() as launches:
        for (_, shape, vocab, how), dz, dw in runs:
            _drive(backend, _logits(shape, vocab, how, dz), _logits(shape, vocab, how, dw))
        _tile_launches(backend)
    return launches


def _drive(backend: Any, z: Any, w: Any) -> None:
    """Every method of the logits path on policy ``z`` and reference ``w``, with each flag."""
    import torch

    from .. import validation
    from .blocks import sync_free_on_cpu

    shape = z.shape[:-1]
    tok = torch.zeros(shape, dtype=torch.int64)
    g = torch.ones(shape)
    if z.dtype == w.dtype:
        for tokens, entropy in ((tok, False), (tok, True), (None, True)):
            _, _, saved = backend.logprobs_forward(z, tokens, 1.0, entropy)
            for gl, ge in ((g, None), (None, g), (g, g)):
                if (tokens is None and gl is not None) or (ge is not None and not entropy):
                    continue
                backend.logprobs_backward(z, tokens, saved, gl, ge, 1.0)
    for checks in (True, False):
        with validation(checks), sync_free_on_cpu():
            _, saved = backend.full_kl_forward(z, w, 1.0)
            backend.full_kl_backward(z, w, saved, g, 1.0)
    # the generalized JSD: both ends, the mixture and a mixture near an end (MODE 3), each
    # side's gradient alone and both
    for beta in (0.0, 1e-3, 0.5, 1.0):
        _, saved = backend.jsd_forward(z, w, 1.0, beta)
        for needs in ((True, False), (False, True), (True, True)):
            backend.jsd_backward(z, w, saved, g, 1.0, beta, needs)


def _tile_launches(backend: Any) -> None:
    """Drive the hidden-state tile methods: tiles ``(r, c)`` of a wider scratch buffer."""
    import torch

    for dtype in (torch.float32, torch.float64):
        for r, c in ((4, 1), (4, 300), (4, 4096)):
            buf = torch.zeros((r, c + 37), dtype=dtype)
            z, w = buf[:, :c], buf[:, 5 : c + 5] if c > 1 else buf[:, :1]
            col = torch.zeros(r, dtype=torch.int64)
            vec = torch.zeros(r, dtype=dtype)
            for shift in (None, vec):
                for entropy in (False, True):
                    for exact in (False, True):
                        backend.linear_logprob_tile(z, col, shift, entropy, exact)
            backend.linear_logprob_tile_grad(z, col, vec, vec, None, None)
            backend.linear_logprob_tile_grad(z, col, vec, vec, vec, vec)
            backend.linear_kl_tile(z, w, vec)
            for masked in (False, True):
                backend.linear_kl_tile_grad(z, w, vec, vec, vec, masked)


def is_float64(spec: Spec) -> bool:
    """Whether ``spec`` is a float64 variant: a float64 pointer or compute dtype."""
    return any(t == "*fp64" for _, t in spec.signature) or any(
        v == ("dtype", "fp64") for _, v in spec.constexprs
    )


def summary(results: Sequence[Compiled]) -> str:
    """A Markdown table, one row per kernel and target: variants compiled, failures,
    registers (min–max), spill bytes (stores, max) below float64 and in float64 variants, and
    shared memory (max, bytes).

    Example:
        >>> print(summary([]).splitlines()[0])
        | kernel | sm | variants | failed | registers | spills (fp32/16) | spills (fp64) | shared |
    """
    rows: dict[tuple[str, int], list[Compiled]] = {}
    for r in results:
        rows.setdefault((r.spec.name, r.spec.capability), []).append(r)
    lines = [
        "| kernel | sm | variants | failed | registers | spills (fp32/16) | spills (fp64) "
        "| shared |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for (name, cc), group in sorted(rows.items()):
        ok = [r for r in group if r.error is None]
        regs = [r.registers for r in ok]
        low = [r.spill_stores for r in ok if not is_float64(r.spec)] or [0]
        high = [r.spill_stores for r in ok if is_float64(r.spec)] or [0]
        span = f"{min(regs)}–{max(regs)}" if regs else "–"
        shared = max((r.shared for r in ok), default=0)
        lines.append(
            f"| `{name}` | {cc} | {len(group)} | {len(group) - len(ok)} | {span} | {max(low)} "
            f"| {max(high)} | {shared} |"
        )
    return "\n".join(lines)
