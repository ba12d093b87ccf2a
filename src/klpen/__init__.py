"""klpen: the KL-divergence penalty of RLHF, exact, memory-bounded and tested.

The public names, by chapter of the book:

1. sampled estimators: :func:`kl_penalty`, :func:`estimate_kl`
2. log-prob extraction: :func:`get_logprobs_for_tokens`, :func:`calculate_kl_penalty`
3. the full categorical KL: :func:`full_kl`, :func:`kl_penalized_reward`
4. masking and aggregation: :func:`compute_token_kl`, :func:`masked_sum`,
   :func:`masked_mean`, :func:`aggregate`, :func:`response_mask`
5. control of β: :class:`FixedKLController`, :class:`AdaptiveKLController` (Ziegler's
   proportional rule), :class:`DoublingKLController` (the handbook's doubling rule)
6. the objective: :func:`compute_rlhf_objective`, :func:`shape_rewards`

``klpen.distributed`` holds the vocab-parallel versions for ``torch.distributed``;
``klpen.gradients`` the exact expected gradients of each estimator used in a loss (chapter 7);
``klpen.lab`` the experiments and figures of the book (it needs matplotlib).
"""

from .controllers import (
    AdaptiveKLController,
    DoublingKLController,
    FixedKLController,
    KLController,
)
from .estimators import estimate_kl, kl_penalty
from .full_kl import full_kl, kl_penalized_reward
from .logprobs import calculate_kl_penalty, get_logprobs_for_tokens
from .masking import aggregate, compute_token_kl, masked_mean, masked_sum, response_mask
from .objective import compute_rlhf_objective, shape_rewards

__version__ = "0.1.0"

__all__ = [
    "AdaptiveKLController",
    "DoublingKLController",
    "FixedKLController",
    "KLController",
    "__version__",
    "aggregate",
    "calculate_kl_penalty",
    "compute_rlhf_objective",
    "compute_token_kl",
    "estimate_kl",
    "full_kl",
    "get_logprobs_for_tokens",
    "kl_penalized_reward",
    "kl_penalty",
    "masked_mean",
    "masked_sum",
    "response_mask",
    "shape_rewards",
]
