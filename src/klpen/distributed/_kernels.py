"""The single-process kernels and helpers that :mod:`klpen.distributed` builds on, in one place.

Every kernel-level name the package uses is imported here and nowhere else, so that moving the
kernels means changing this module only. Each vocab-parallel form runs the single-process
per-row statistics and gradients on its own slice; what it adds is the combination of the
ranks' statistics.
"""

from __future__ import annotations

from ..kernels.blocks import block_rows_for, compute_dtype, exp_sums, index_blocks, take_rows
from ..kernels.torch_kl import EXACT_SHARE, centred_kl, exact_rows, kl_row_stats
from ..kernels.torch_kl import kl_grads_from as kl_grads
from ..kernels.torch_linear import Layer, Reduce, backprop, logprob_grad, logprob_stats
from ..kernels.torch_logprobs import LogProbGrad, LogProbRows
from ..kernels.torch_logprobs import logprob_grad as token_logprob_grad
from ..linear import check_layer, flat_layer, layer_dtype

__all__ = [
    "EXACT_SHARE",
    "Layer",
    "LogProbGrad",
    "LogProbRows",
    "Reduce",
    "backprop",
    "block_rows_for",
    "centred_kl",
    "check_layer",
    "compute_dtype",
    "exact_rows",
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
