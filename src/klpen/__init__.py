"""klpen: the KL-divergence penalty of RLHF, exact, memory-bounded and tested.

The public names, by chapter of the book:

1. sampled estimators: :func:`kl_penalty`, :func:`estimate_kl`
2. log-prob extraction: :func:`get_logprobs_for_tokens`, :func:`next_token_logprobs`,
   :func:`token_entropy`, :func:`logprobs_and_entropy`, :func:`calculate_kl_penalty`
3. the full categorical KL: :func:`full_kl`, :func:`kl_penalized_reward`
4. masking and aggregation: :func:`compute_token_kl`, :func:`masked_sum`,
   :func:`masked_mean`, :func:`aggregate`, :func:`response_mask`, :func:`sequence_ids`
   (packed batches)
5. control of β: :class:`FixedKLController`, :class:`AdaptiveKLController` (Ziegler's
   proportional rule), :class:`DoublingKLController` (the handbook's doubling rule)
6. the objective: :func:`compute_rlhf_objective`, :func:`shape_rewards`
7. (``klpen.gradients``) the expected gradient of each estimator used in a loss or a reward
8. from hidden states, never building the logits: :func:`linear_logprobs`,
   :func:`linear_full_kl`
9. when the sampler is not the policy: :func:`sampler_logprobs`, :func:`importance_weights`,
   :func:`mismatch_metrics`
10. on-policy distillation: :func:`generalized_jsd`, :func:`linear_generalized_jsd`,
    :func:`topk_kl` (:class:`TopKKL`), :func:`distillation_rewards`

Process-wide switches (contract section 7): :func:`available_backends` and :func:`use_backend`
(the kernel backend), :func:`validation` and :func:`set_validation` (the checks that read tensor
values, off for a training loop that must not synchronise).

``klpen.distributed`` holds the vocab-parallel versions for ``torch.distributed``;
``klpen.gradients`` the exact expected gradients of each estimator used in a loss (chapter 7);
(the experiments and figures of the book are the separate package ``klpen_book``).
"""

from ._validation import set_validation, validation
from ._version import __version__
from .controllers import (
    AdaptiveKLController,
    DoublingKLController,
    FixedKLController,
    KLController,
)
from .distill import (
    TopKKL,
    distillation_rewards,
    generalized_jsd,
    linear_generalized_jsd,
    topk_kl,
)
from .entropy import logprobs_and_entropy, token_entropy
from .estimators import estimate_kl, kl_penalty
from .full_kl import full_kl, kl_penalized_reward
from .kernels import available_backends, use_backend
from .linear import linear_full_kl, linear_logprobs
from .logprobs import calculate_kl_penalty, get_logprobs_for_tokens, next_token_logprobs
from .masking import aggregate, compute_token_kl, masked_mean, masked_sum, response_mask
from .objective import compute_rlhf_objective, shape_rewards
from .packing import sequence_ids
from .sampling import importance_weights, mismatch_metrics, sampler_logprobs

__all__ = [
    "AdaptiveKLController",
    "DoublingKLController",
    "FixedKLController",
    "KLController",
    "TopKKL",
    "__version__",
    "aggregate",
    "available_backends",
    "calculate_kl_penalty",
    "compute_rlhf_objective",
    "compute_token_kl",
    "distillation_rewards",
    "estimate_kl",
    "full_kl",
    "generalized_jsd",
    "get_logprobs_for_tokens",
    "importance_weights",
    "kl_penalized_reward",
    "kl_penalty",
    "linear_full_kl",
    "linear_generalized_jsd",
    "linear_logprobs",
    "logprobs_and_entropy",
    "masked_mean",
    "masked_sum",
    "mismatch_metrics",
    "next_token_logprobs",
    "response_mask",
    "sampler_logprobs",
    "sequence_ids",
    "set_validation",
    "shape_rewards",
    "token_entropy",
    "topk_kl",
    "use_backend",
    "validation",
]


_SUBMODULES = ("distributed", "gradients")


def __getattr__(name: str) -> object:
    """``klpen.distributed`` and ``klpen.gradients``, imported on first use."""
    if name in _SUBMODULES:
        import importlib

        module = importlib.import_module(f".{name}", __name__)
        globals()[name] = module
        return module
    raise AttributeError(f"module 'klpen' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_SUBMODULES})
