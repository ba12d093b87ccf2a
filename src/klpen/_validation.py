"""Input checks shared by every public function.

Each public function validates its arguments here, once, at the boundary; the numerical code
behind it trusts its inputs. Every message names the argument and what was received, so a
misuse surfaces as a ``ValueError``/``TypeError`` that can be read, never as an ``IndexError``
from deep inside torch or a silent NaN.

The checks that read tensor *values* (NaN scans, token ranges, mask values: each one a host
synchronisation on an accelerator) can be switched off: :func:`validation` /
:func:`set_validation`, and always inside ``torch.compile`` and under functorch transforms
(``vmap``, ``grad``). They all go through :func:`value_checks_enabled`; the shape, dtype and
device checks always run. The kernels use the same switch to choose their sync-free paths.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import numbers
import operator
import sys
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import Tensor

__all__ = [
    "check_all",
    "check_choice",
    "check_coef",
    "check_coef_fits",
    "check_dim",
    "check_floating",
    "check_floating_like",
    "check_mask",
    "check_no_nan",
    "check_no_nan_at",
    "check_positive",
    "check_same_device",
    "check_shape",
    "check_temperature",
    "check_tensor_kind",
    "check_token_ids",
    "check_tokens",
    "inverse_temperature",
    "promoted_dtype",
    "scaled_penalty",
    "set_validation",
    "validation",
    "value_checks_enabled",
]

_DEFAULT = [True]  # set_validation's process-wide setting
_SCOPED: contextvars.ContextVar[bool | None] = contextvars.ContextVar(
    "klpen_validation", default=None
)


def _as_flag(enabled: object) -> bool:
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled must be True or False, got {type(enabled).__name__} {enabled!r}")
    return enabled


def set_validation(enabled: bool) -> None:
    """Turn klpen's value checks on or off for the whole process (default: on).

    Off, public functions skip every check that reads tensor values (NaN scans, token-id
    ranges, mask values); shape, dtype and device checks stay. A call on finite inputs on an
    accelerator then makes no host-device synchronisation: the kernels take paths without a
    data-dependent step (on the CPU, where reading a value stalls no device, they keep
    their faster data-dependent paths). Invalid values are then not reported by name: a NaN
    logit gives a NaN result, an out-of-range token id an error (torch's index error, on CUDA
    a device-side assert; a ``ValueError`` across ranks), never a plausible number.
    :func:`validation` overrides it inside a ``with`` block.

    Example:
        >>> set_validation(False); value_checks_enabled()
        False
        >>> set_validation(True); value_checks_enabled()
        True
    """
    _DEFAULT[0] = _as_flag(enabled)


@contextlib.contextmanager
def validation(enabled: bool) -> Iterator[None]:
    """Context manager: klpen's value checks on (``True``) or off (``False``) inside it.

    See :func:`set_validation`; this one is scoped to the ``with`` block (and the current
    thread or asyncio task), and restores the previous state on exit.

    Example:
        >>> with validation(False):
        ...     value_checks_enabled()
        False
    """
    token = _SCOPED.set(_as_flag(enabled))
    try:
        yield
    finally:
        _SCOPED.reset(token)


def value_checks_enabled() -> bool:
    """Whether the checks that read tensor values run now.

    False under :func:`validation` ``(False)`` / :func:`set_validation` ``(False)``, while
    ``torch.compile`` traces (``torch.compiler.is_compiling()``) and under functorch
    transforms (``vmap``, ``grad``), where a data-dependent check cannot run.

    Example:
        >>> value_checks_enabled()
        True
    """
    if torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active():
        return False
    scoped = _SCOPED.get()
    return _DEFAULT[0] if scoped is None else scoped


#: dtypes torch stores but cannot compute with (no arithmetic kernels): refused by name
_STORAGE_ONLY = frozenset(
    getattr(torch, n)
    for n in (
        "float8_e4m3fn",
        "float8_e4m3fnuz",
        "float8_e5m2",
        "float8_e5m2fnuz",
        "float8_e8m0fnu",
        "float4_e2m1fn_x2",
    )
    if hasattr(torch, n)
)
#: unsigned integers wider than 8 bits: most reductions and ``gather`` lack kernels for them
_WIDE_UNSIGNED = frozenset(
    getattr(torch, n) for n in ("uint16", "uint32", "uint64") if hasattr(torch, n)
)


def _describe(x: object) -> str:
    if isinstance(x, Tensor):
        if x.is_nested:
            return f"a nested tensor of dtype {x.dtype}"
        return f"a tensor of shape {tuple(x.shape)} and dtype {x.dtype}"
    return f"{type(x).__name__} {x!r}"


def check_tensor_kind(name: str, x: Tensor) -> Tensor:
    """Refuse, by name, the tensor kinds klpen does not compute with; return ``x``.

    Meta tensors (no data), sparse layouts (COO, CSR, CSC, BSR, BSC), mkldnn tensors, nested
    tensors, and the storage-only float8/float4 dtypes each raise a ``TypeError`` that names the
    argument and the kind, instead of an error from deep inside torch (or a wrong result).
    """
    if x.is_nested:
        raise TypeError(
            f"{name} must be a regular (strided) tensor, got a nested tensor; pad it to a "
            "dense tensor and pass a mask"
        )
    if x.is_meta:
        raise TypeError(f"{name} must hold data, got a meta tensor (device 'meta')")
    if x.is_mkldnn:
        raise TypeError(f"{name} must be a strided tensor, got an mkldnn tensor; use .to_dense()")
    if x.layout != torch.strided:
        raise TypeError(
            f"{name} must be a dense (strided) tensor, got layout {x.layout}; use .to_dense()"
        )
    if x.dtype in _STORAGE_ONLY:
        raise TypeError(
            f"{name} has dtype {x.dtype}, which torch only stores (no arithmetic); cast it to "
            "bfloat16, float16 or float32"
        )
    return x


def _tensor(name: str, x: object, what: str = "a torch.Tensor") -> Tensor:
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be {what}, got {type(x).__name__}")
    return check_tensor_kind(name, x)


def promoted_dtype(*tensors: Tensor) -> torch.dtype:
    """The dtype results are computed in: the promoted dtype of the floating ``tensors``, at
    least float32 (half-precision inputs are computed in fp32, as the logit functions do).

    Example:
        >>> promoted_dtype(torch.ones(1, dtype=torch.bfloat16), torch.ones(1, dtype=torch.float16))
        torch.float32
    """
    dtype = torch.float32
    for t in tensors:
        if t.is_floating_point():
            dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def check_floating(name: str, x: object, *, min_ndim: int = 0) -> Tensor:
    """Require a floating-point tensor with at least ``min_ndim`` dimensions."""
    x = _tensor(name, x)
    if not x.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {x.dtype}")
    if x.dim() < min_ndim:
        raise ValueError(
            f"{name} must have at least {min_ndim} dimension(s), got shape {tuple(x.shape)}"
        )
    return x


def check_shape(name: str, x: Tensor, shape: Sequence[int], what: str = "") -> None:
    """Require ``x.shape == shape``; ``what`` says where the expected shape comes from."""
    if tuple(x.shape) != tuple(shape):
        origin = f" ({what})" if what else ""
        raise ValueError(f"{name} must have shape {tuple(shape)}{origin}, got {tuple(x.shape)}")


def check_same_device(name: str, x: Tensor, other_name: str, other: Tensor) -> None:
    """Require ``x`` on ``other``'s device (and of a supported kind: a meta ``x`` is refused
    as a meta tensor, not reported as a device mismatch)."""
    check_tensor_kind(name, x)
    if x.device != other.device:
        raise ValueError(
            f"{name} is on device {x.device} but {other_name} is on {other.device}; "
            "move them to the same device"
        )


def check_floating_like(name: str, x: object, other_name: str, other: Tensor, what: str) -> Tensor:
    """Require a floating tensor of ``other``'s shape and device; return it.

    :func:`check_floating`, :func:`check_shape` (``what`` names the expected shape's origin)
    and :func:`check_same_device`, in that order.

    Example:
        >>> check_floating_like("q", torch.zeros(2), "p", torch.ones(2), "the shape of p")
        tensor([0., 0.])
    """
    t = check_floating(name, x)
    check_shape(name, t, other.shape, what)
    check_same_device(name, t, other_name, other)
    return t


def check_token_ids(name: str, tokens: object) -> Tensor:
    """Require a tensor of integer token ids (any shape; values unchecked); return it."""
    tokens = _tensor(name, tokens, "a torch.Tensor of token ids")
    if tokens.dtype == torch.bool or tokens.is_floating_point() or tokens.is_complex():
        raise TypeError(f"{name} must hold integer token ids, got dtype {tokens.dtype}")
    if tokens.dtype in _WIDE_UNSIGNED:
        raise TypeError(
            f"{name} must be int64, int32, int16, int8 or uint8 token ids, got dtype "
            f"{tokens.dtype} (torch has few kernels for it); cast it with .long()"
        )
    return tokens


def check_tokens(name: str, tokens: object, shape: Sequence[int], vocab_size: int) -> Tensor:
    """Require integer token ids of the given shape, each in ``[0, vocab_size)``.

    Returns the ids as ``int64`` (what ``gather`` needs); a no-op for ``int64`` input. The
    range is a value check (skipped when :func:`value_checks_enabled` is false).
    """
    tokens = check_token_ids(name, tokens)
    check_shape(name, tokens, shape, "the leading shape of the logits")
    if tokens.numel() and value_checks_enabled():
        lo, hi = int(tokens.min()), int(tokens.max())
        if lo < 0 or hi >= vocab_size:
            bad = lo if lo < 0 else hi
            raise ValueError(
                f"{name} must lie in [0, {vocab_size}) for a vocabulary of {vocab_size}, "
                f"got a token id {bad}"
            )
    return tokens.long()


def check_mask(
    name: str,
    mask: object,
    shape: Sequence[int],
    *,
    same_device_as: tuple[str, Tensor] | None = None,
) -> Tensor:
    """Require a 0/1 mask (bool, integer or floating) of the given shape; return it as bool.

    ``same_device_as``: ``(other_name, other)``, also require a tensor ``mask`` on ``other``'s
    device (checked first, as :func:`check_same_device`).

    Example:
        >>> check_mask("mask", torch.tensor([1, 0]), (2,), same_device_as=("x", torch.zeros(2)))
        tensor([ True, False])
    """
    if same_device_as is not None and isinstance(mask, Tensor):
        check_same_device(name, mask, *same_device_as)
    mask = _tensor(name, mask)
    check_shape(name, mask, shape, "the shape of the values it masks")
    if mask.dtype == torch.bool:
        return mask
    if mask.is_complex() or mask.dtype in _WIDE_UNSIGNED:
        raise TypeError(f"{name} must be bool, integer or floating 0/1, got dtype {mask.dtype}")
    if mask.numel() and value_checks_enabled() and not bool(((mask == 0) | (mask == 1)).all()):
        bad = mask[(mask != 0) & (mask != 1)].flatten()[0].item()
        raise ValueError(f"{name} must contain only 0 and 1, got a value {bad}")
    return mask != 0


def check_dim(name: str, dim: object, ndim: int) -> int | tuple[int, ...] | None:
    """Require ``None``, a dimension index or a non-empty tuple of distinct ones for ``ndim`` dims.

    Returns the dimension(s) as given (negative indices kept), so that torch reduces as asked.
    """
    if dim is None:
        return None
    items = dim if isinstance(dim, (tuple, list)) else (dim,)
    try:
        # operator.index: ints, NumPy and 0-d tensor integers; never floats. bool is an int
        # to Python, but dim=True is a mistake, not dimension 1.
        if any(isinstance(d, bool) for d in items):
            raise TypeError
        dims = tuple(operator.index(d) for d in items)
    except TypeError:
        dims = ()
    if not dims:
        raise TypeError(f"{name} must be None, an int or a non-empty tuple of ints, got {dim!r}")
    size = max(ndim, 1)  # torch accepts dim 0 / -1 of a 0-d tensor
    if not all(-size <= d < size for d in dims):
        raise ValueError(
            f"{name} must lie in [{-size}, {size - 1}] for a tensor of {ndim} dimension(s), "
            f"got {dim!r}"
        )
    if len({d % size for d in dims}) != len(dims):
        raise ValueError(f"{name} must not name a dimension twice, got {dim!r}")
    return dims if isinstance(dim, (tuple, list)) else dims[0]


def _as_real(name: str, value: object) -> float:
    if isinstance(value, Tensor):
        check_tensor_kind(name, value)
        if value.is_complex():
            raise TypeError(f"{name} must be a real number, got {_describe(value)}")
        if value.numel() != 1:
            raise ValueError(f"{name} must be a number, got {_describe(value)}")
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {_describe(value)}")
    try:
        return float(value)
    except OverflowError:  # an int (or Fraction) beyond float64's range, such as 10**400
        shown = str(value)
        if len(shown) > 24:
            shown = f"{shown[:12]}... ({len(shown)} characters)"
        raise ValueError(f"{name} must fit a float (|x| < 1.8e308), got {shown}") from None


def _finite(v: float) -> bool:
    # Comparisons, not math.isfinite: torch.compile traces them on a symbolic float (a Python
    # float argument that changed between calls), where math.isfinite breaks the graph. NaN
    # fails both comparisons.
    return -sys.float_info.max <= v <= sys.float_info.max


def check_coef(name: str, value: object) -> float:
    """Require a finite, non-negative real number (a penalty coefficient); return it as float.

    Traceable by ``torch.compile`` with a Python float that changes between calls (a symbolic
    float): the checks are comparisons, which the compiled code guards on.
    """
    v = _as_real(name, value)
    if not _finite(v) or v < 0:
        raise ValueError(f"{name} must be finite and non-negative, got {v}")
    return v


def check_coef_fits(name: str, value: float, dtype: torch.dtype) -> float:
    """Require a coefficient (already a float) to be finite in ``dtype``, the compute dtype.

    ``1e39`` is a finite float64 but ``inf`` in float32, where ``inf * 0`` would then be NaN.
    """
    limit = torch.finfo(dtype).max
    if abs(value) > limit:
        raise ValueError(
            f"{name} must fit the compute dtype {dtype} (|{name}| <= {limit:.4g}), got {value}"
        )
    return value


def scaled_penalty(kl_coef: float, kl: Tensor) -> Tensor:
    """``kl_coef * kl``, where a zero coefficient means no penalty, exactly.

    With ``kl_coef == 0`` the result is 0 even where ``kl`` is ``±inf`` (not ``0 * inf = NaN``),
    and so is the gradient, while the graph to ``kl`` is kept (a ``backward`` through it works).
    """
    if kl_coef != 0.0:
        return kl_coef * kl
    return torch.where(torch.isfinite(kl), kl, 0.0) * 0.0


def check_positive(name: str, value: object) -> float:
    """Require a finite, strictly positive real number; return it as float (traceable as
    :func:`check_coef`)."""
    v = _as_real(name, value)
    if not _finite(v) or v <= 0:
        raise ValueError(f"{name} must be finite and positive, got {v}")
    return v


def check_choice(name: str, value: object, choices: Sequence[str]) -> str:
    """Require one of ``choices``; the message lists them."""
    if not isinstance(value, str) or value not in choices:
        valid = ", ".join(repr(c) for c in choices)
        raise ValueError(f"{name} must be one of {valid}; got {value!r}")
    return value


def check_no_nan_at(name: str, x: Tensor, mask: Tensor | None = None) -> Tensor:
    """Raise ``ValueError`` naming ``name`` if ``x`` holds a NaN where ``mask`` (bool, same
    shape; ``None``: everywhere) is True. Whatever sits at masked positions is allowed. A value
    check (skipped when :func:`value_checks_enabled` is false)."""
    if x.numel() == 0 or not value_checks_enabled():
        return x
    nan = torch.isnan(x.detach())
    if mask is not None:
        nan = nan & mask
    if bool(nan.any()):
        where = tuple(int(i) for i in nan.nonzero()[0])
        valid = "valid (unmasked) " if mask is not None else ""
        raise ValueError(f"{name} must not be NaN at a {valid}position, got NaN at index {where}")
    return x


def check_all(ok: Tensor, describe: Callable[[tuple[int, ...]], str]) -> None:
    """Raise ``ValueError(describe(index))`` unless the bool tensor ``ok`` is True everywhere.

    A value check (it reads ``ok``, a host synchronisation; skipped when
    :func:`value_checks_enabled` is false): ``index`` is the first position where ``ok`` is
    False, and ``describe`` (called only then) writes the message, naming the argument and what
    it received there.

    Example:
        >>> check_all(torch.tensor([True, True]), lambda i: f"bad at {i}")
    """
    if ok.numel() and value_checks_enabled() and not bool(ok.all()):
        raise ValueError(describe(tuple(int(i) for i in (~ok).nonzero()[0])))


def check_no_nan(result: Tensor, message: str) -> Tensor:
    """Return a kernel's ``result``, or raise ``ValueError(message)`` if it holds a NaN.

    The log-prob and KL kernels turn every invalid row (NaN or ``+inf`` logits, a row of
    ``-inf`` only) into NaN; checking the ``(N,)`` result once is far cheaper than scanning the
    ``(N, V)`` logits beforehand. A value check (skipped when :func:`value_checks_enabled` is
    false).
    """
    if result.numel() and value_checks_enabled() and bool(torch.isnan(result).any()):
        raise ValueError(message)
    return result


def check_temperature(name: str, value: object, dtype: torch.dtype = torch.float64) -> float:
    """Require a sampling temperature usable in the compute ``dtype``; return it as float.

    The one temperature rule of klpen: ``T`` must be finite and > 0, and both ``T`` and
    ``1 / T`` must be normal numbers of ``dtype`` (in ``[tiny, max]`` of its ``finfo``), the
    dtype the logits are divided by ``T`` in. So ``1e-40`` is refused in float32 (its inverse
    overflows to ``inf``) and ``1e-310`` in float64 (a subnormal). The message names ``name``.

    Example:
        >>> check_temperature("temperature", 0.7, torch.float32)
        0.7
    """
    t = check_positive(name, value)
    info = torch.finfo(dtype)
    inverse = 1.0 / t if t > 0 else math.inf
    if not (info.tiny <= t <= info.max and info.tiny <= inverse <= info.max):
        raise ValueError(
            f"{name} must be finite and positive, a normal number of the compute dtype {dtype} "
            f"([{info.tiny:.4g}, {info.max:.4g}]) with a finite inverse, got {t}"
        )
    return t


def inverse_temperature(name: str, value: object, dtype: torch.dtype) -> float:
    """``1 / T`` for a temperature that passes :func:`check_temperature` in ``dtype``.

    klpen applies a temperature one way: the logits (or a block of them) are multiplied by
    this inverse, in the compute dtype.

    Example:
        >>> inverse_temperature("temperature", 2.0, torch.float32)
        0.5
    """
    return 1.0 / check_temperature(name, value, dtype)
