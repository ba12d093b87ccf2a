"""The single-process kernels and helpers that :mod:`klpen.distributed` builds on, in one place.

Every kernel-level name the package uses is imported here and nowhere else, so that moving the
kernels means changing this module only. Each vocab-parallel form runs the single-process
per-row statistics and gradients on its own slice; what it adds is the combination of the
ranks' statistics.
"""

from __future__ import annotations

from .._chunks import block_rows_for, compute_dtype, exp_sums, index_blocks, take_rows
from ..full_kl import EXACT_SHARE, centred_kl
from ..full_kl import _kl_grads as kl_grads
from ..full_kl import _kl_row_stats as kl_row_stats
from ..linear import (
    Layer,
    Reduce,
    backprop,
    check_layer,
    flat_layer,
    layer_dtype,
    logprob_grad,
    logprob_stats,
)
from ..logprobs import _logprob_grad as token_logprob_grad

__all__ = [
    "EXACT_SHARE",
    "Layer",
    "Reduce",
    "backprop",
    "block_rows_for",
    "centred_kl",
    "check_layer",
    "compute_dtype",
    "exp_sums",
    "flat_layer",
    "index_blocks",
    "kl_grads",
    "kl_row_stats",
    "layer_dtype",
    "logprob_grad",
    "logprob_stats",
    "take_rows",
    "token_logprob_grad",
]
