"""Argument checks of the book's laboratory.

The laboratory's functions check their arguments as klpen's public functions do (a
``ValueError`` or ``TypeError`` naming the argument and what was received), but with these
few functions of its own: klpen's checks are internal to klpen, and the laboratory uses
klpen's public API only. They check experiment parameters (names, coefficients, counts) and
the inputs of the studies, not the tensors of a training run: where a study passes tensors on
to klpen, klpen's own checks apply too.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = [
    "check_choice",
    "check_coef",
    "check_floating",
    "check_logit_pair",
    "check_positive",
    "check_shape",
    "check_token_ids",
    "check_tokens",
    "compute_dtype",
]


def _describe(x: object) -> str:
    if isinstance(x, Tensor):
        return f"a tensor of shape {tuple(x.shape)} and dtype {x.dtype}"
    return f"{type(x).__name__} {x!r}"


def _as_real(name: str, value: object) -> float:
    if isinstance(value, Tensor):
        if value.is_complex() or value.numel() != 1:
            raise TypeError(f"{name} must be a real number, got {_describe(value)}")
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {_describe(value)}")
    try:
        return float(value)
    except OverflowError:  # an int beyond float64's range, such as 10**400
        raise ValueError(f"{name} must fit a float (|x| < 1.8e308), got a larger int") from None


def check_coef(name: str, value: object) -> float:
    """Require a finite, non-negative real number (a coefficient); return it as float.

    Example:
        >>> check_coef("kl_coef", 0)
        0.0
        >>> check_coef("kl_coef", -1.0)
        Traceback (most recent call last):
        ...
        ValueError: kl_coef must be finite and non-negative, got -1.0
    """
    v = _as_real(name, value)
    if not math.isfinite(v) or v < 0:
        raise ValueError(f"{name} must be finite and non-negative, got {v}")
    return v


def check_positive(name: str, value: object) -> float:
    """Require a finite, strictly positive real number; return it as float.

    Example:
        >>> check_positive("horizon", 10)
        10.0
        >>> check_positive("horizon", float("inf"))
        Traceback (most recent call last):
        ...
        ValueError: horizon must be finite and positive, got inf
    """
    v = _as_real(name, value)
    if not math.isfinite(v) or v <= 0:
        raise ValueError(f"{name} must be finite and positive, got {v}")
    return v


def check_choice(name: str, value: object, choices: Sequence[str]) -> str:
    """Require one of ``choices``; the message lists them.

    Example:
        >>> check_choice("method", "naive", ["naive", "klpen"])
        'naive'
        >>> check_choice("method", "fast", ["naive", "klpen"])
        Traceback (most recent call last):
        ...
        ValueError: method must be one of 'naive', 'klpen'; got 'fast'
    """
    if not isinstance(value, str) or value not in choices:
        valid = ", ".join(repr(c) for c in choices)
        raise ValueError(f"{name} must be one of {valid}; got {value!r}")
    return value


def _tensor(name: str, x: object, what: str = "a torch.Tensor") -> Tensor:
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be {what}, got {type(x).__name__}")
    if x.is_nested or x.layout != torch.strided or x.is_meta:
        raise TypeError(f"{name} must be a dense tensor holding data, got {x.layout} {x.device}")
    return x


def check_floating(name: str, x: object, *, min_ndim: int = 0) -> Tensor:
    """Require a floating-point tensor with at least ``min_ndim`` dimensions; return it.

    Example:
        >>> check_floating("logits", torch.zeros(2, 3), min_ndim=1).shape
        torch.Size([2, 3])
        >>> check_floating("logits", torch.zeros(2, dtype=torch.long))
        Traceback (most recent call last):
        ...
        TypeError: logits must be a floating-point tensor, got dtype torch.int64
    """
    t = _tensor(name, x)
    if not t.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {t.dtype}")
    if t.dim() < min_ndim:
        raise ValueError(
            f"{name} must have at least {min_ndim} dimension(s), got shape {tuple(t.shape)}"
        )
    return t


def check_shape(name: str, x: Tensor, shape: Sequence[int], what: str = "") -> None:
    """Require ``x.shape == shape``; ``what`` says where the expected shape comes from.

    Example:
        >>> check_shape("reward", torch.zeros(3), (4,), "the vocabulary of the logits")
        Traceback (most recent call last):
        ...
        ValueError: reward must have shape (4,) (the vocabulary of the logits), got (3,)
    """
    if tuple(x.shape) != tuple(shape):
        origin = f" ({what})" if what else ""
        raise ValueError(f"{name} must have shape {tuple(shape)}{origin}, got {tuple(x.shape)}")


def check_token_ids(name: str, tokens: object) -> Tensor:
    """Require a tensor of integer token ids (any shape; values unchecked); return it.

    Example:
        >>> check_token_ids("tokens", torch.tensor([0.5]))
        Traceback (most recent call last):
        ...
        TypeError: tokens must hold integer token ids, got dtype torch.float32
    """
    t = _tensor(name, tokens, "a torch.Tensor of token ids")
    if t.dtype == torch.bool or t.is_floating_point() or t.is_complex():
        raise TypeError(f"{name} must hold integer token ids, got dtype {t.dtype}")
    return t


def check_tokens(name: str, tokens: object, shape: Sequence[int], vocab_size: int) -> Tensor:
    """Require integer token ids of the given shape, each in ``[0, vocab_size)``; as int64.

    Example:
        >>> check_tokens("tokens", torch.tensor([0, 2]), (2,), 3)
        tensor([0, 2])
        >>> check_tokens("tokens", torch.tensor([0, 3]), (2,), 3)
        Traceback (most recent call last):
        ...
        ValueError: tokens must lie in [0, 3) for a vocabulary of 3, got a token id 3
    """
    t = check_token_ids(name, tokens)
    check_shape(name, t, shape, "the leading shape of the logits")
    if t.numel():
        lo, hi = int(t.min()), int(t.max())
        if lo < 0 or hi >= vocab_size:
            bad = lo if lo < 0 else hi
            raise ValueError(
                f"{name} must lie in [0, {vocab_size}) for a vocabulary of {vocab_size}, "
                f"got a token id {bad}"
            )
    return t.long()


def check_logit_pair(
    policy_name: str, policy_logits: object, reference_name: str, reference_logits: object
) -> tuple[Tensor, Tensor]:
    """Require two finite floating ``(..., V)`` logit tensors of one shape, device and ``V >= 1``.

    The exact sums over the vocabulary of the studies have no meaning for ``-inf`` or NaN
    logits (``0 * inf`` terms).

    Example:
        >>> z, w = check_logit_pair("z", torch.zeros(3), "w", torch.ones(3))
        >>> check_logit_pair("z", torch.zeros(3), "w", torch.tensor([0.0, float("nan"), 0.0]))
        Traceback (most recent call last):
        ...
        ValueError: w must be finite, got a value nan
    """
    z = check_floating(policy_name, policy_logits, min_ndim=1)
    w = check_floating(reference_name, reference_logits, min_ndim=1)
    check_shape(reference_name, w, z.shape, f"the shape of {policy_name}")
    if w.device != z.device:
        raise ValueError(
            f"{reference_name} is on device {w.device} but {policy_name} is on {z.device}"
        )
    if z.shape[-1] == 0:
        raise ValueError(
            f"{policy_name} must have a non-empty last (vocabulary) axis, got {tuple(z.shape)}"
        )
    for name, x in ((policy_name, z), (reference_name, w)):
        finite = torch.isfinite(x)
        if not bool(finite.all()):
            raise ValueError(f"{name} must be finite, got a value {x[~finite][0].item()}")
    return z, w


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype klpen computes in: fp32 for half-precision input, the input's dtype otherwise.

    Example:
        >>> compute_dtype(torch.bfloat16), compute_dtype(torch.float64)
        (torch.float32, torch.float64)
    """
    return torch.promote_types(dtype, torch.float32)
