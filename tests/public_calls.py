"""One call of every public tensor function, on small shared inputs: the table that the
sync-count test (tests/test_syncs.py) and the compilation test (tests/test_compile.py) run.

``CASES`` holds ``(id, call)``: ``call()`` returns what the public function returns.
``LEAVES`` are the inputs that require grad; ``sum_of`` reduces any result (a tensor, a
tuple, a dict of tensors) to one differentiable scalar. ``ThroughKlpenOps`` is a dispatch
mode that also sees the ops inside klpen's custom operators.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch._library.custom_ops import _maybe_get_opdef
from torch.utils._python_dispatch import TorchDispatchMode

import klpen

G = torch.Generator().manual_seed(0)
B, T, V, H = 2, 5, 40, 6


def leaf(*shape: int, scale: float = 1.0) -> Tensor:
    return (torch.randn(*shape, generator=G) * scale).requires_grad_()


LOGITS = leaf(B, T, V, scale=3.0)
REF = torch.randn(B, T, V, generator=G) * 3.0
TOKENS = torch.randint(0, V, (B, T), generator=G)
MASK = torch.ones(B, T, dtype=torch.bool)
MASK[1, 3:] = False
LOGP = leaf(B, T)
REF_LOGP = torch.randn(B, T, generator=G)
HIDDEN = leaf(B, T, H)
WEIGHT = leaf(V, H)
REWARD = torch.randn(B, generator=G)


def sum_of(out: object) -> Tensor:
    if isinstance(out, Tensor):
        return out.float().sum()
    if isinstance(out, dict):
        return sum(sum_of(v) for v in out.values() if isinstance(v, Tensor))  # type: ignore[return-value]
    return sum(sum_of(o) for o in out if isinstance(o, Tensor))  # type: ignore[union-attr, return-value]


LEAVES = (LOGITS, LOGP, HIDDEN, WEIGHT)


# compute_rlhf_objective is left out: contract section 1 makes it return Python floats
# (mean_reward, mean_kl, ...), one read each by definition.
POSITIONS = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3, 4]])

CASES: list[tuple[str, Callable[[], object]]] = [
    ("get_logprobs_for_tokens", lambda: klpen.get_logprobs_for_tokens(LOGITS, TOKENS)),
    (
        "get_logprobs_for_tokens-T",
        lambda: klpen.get_logprobs_for_tokens(LOGITS, TOKENS, temperature=0.7),
    ),
    ("next_token_logprobs", lambda: klpen.next_token_logprobs(LOGITS, TOKENS)),
    ("token_entropy", lambda: klpen.token_entropy(LOGITS, temperature=1.3)),
    ("logprobs_and_entropy", lambda: klpen.logprobs_and_entropy(LOGITS, TOKENS)),
    ("full_kl", lambda: klpen.full_kl(LOGITS, REF, temperature=0.9)),
    (
        "kl_penalized_reward",
        lambda: klpen.kl_penalized_reward(LOGITS, REF, torch.zeros(B, T), beta=0.1),
    ),
    (
        "calculate_kl_penalty",
        lambda: klpen.calculate_kl_penalty(
            LOGITS.log_softmax(-1), REF.log_softmax(-1), TOKENS, 0.1
        ),
    ),
    ("linear_logprobs", lambda: klpen.linear_logprobs(HIDDEN, WEIGHT, TOKENS)),
    (
        # a frozen output layer (LoRA): the forward keeps the rows' gradients
        "linear_logprobs-frozen-head",
        lambda: klpen.linear_logprobs(HIDDEN, WEIGHT.detach(), TOKENS, temperature=0.9),
    ),
    (
        "linear_logprobs-entropy",
        lambda: klpen.linear_logprobs(HIDDEN, WEIGHT, TOKENS, return_entropy=True, temperature=0.8),
    ),
    (
        "linear_full_kl",
        lambda: klpen.linear_full_kl(HIDDEN, WEIGHT, HIDDEN.detach() + 0.1, WEIGHT.detach()),
    ),
    ("estimate_kl", lambda: klpen.estimate_kl(LOGP, REF_LOGP, "k3")),
    ("compute_token_kl", lambda: klpen.compute_token_kl(LOGP, REF_LOGP, MASK)),
    ("masked_sum", lambda: klpen.masked_sum(LOGP, MASK)),
    ("masked_mean", lambda: klpen.masked_mean(LOGP, MASK, dim=-1)),
    ("aggregate", lambda: klpen.aggregate(LOGP, MASK, "seq-mean-token-mean")),
    ("shape_rewards", lambda: klpen.shape_rewards(REWARD, LOGP, MASK, 0.1)),
    (
        "next_token_logprobs-packed",
        lambda: klpen.next_token_logprobs(
            LOGITS.reshape(1, -1, LOGITS.shape[-1])[:, :10],
            TOKENS.reshape(1, -1)[:, :10],
            position_ids=POSITIONS,
        ),
    ),
    (
        "next_token_logprobs-entropy-packed",
        lambda: klpen.next_token_logprobs(
            LOGITS.reshape(1, -1, LOGITS.shape[-1])[:, :10],
            TOKENS.reshape(1, -1)[:, :10],
            position_ids=POSITIONS,
            return_entropy=True,
        ),
    ),
    ("sequence_ids", lambda: klpen.sequence_ids(position_ids=POSITIONS)),
    (
        "mismatch_metrics-tensors",
        lambda: klpen.mismatch_metrics(LOGP, REF_LOGP, MASK, as_tensors=True),
    ),
    (
        "sampler_logprobs",
        lambda: klpen.sampler_logprobs(LOGITS, TOKENS, temperature=0.8, top_k=10, top_p=0.9),
    ),
    ("importance_weights", lambda: klpen.importance_weights(LOGP, REF_LOGP, MASK)),
    ("response_mask", lambda: klpen.response_mask(TOKENS, 3)),
]


class ThroughKlpenOps(TorchDispatchMode):
    """A dispatch mode that sees every op, also those inside klpen's custom operators.

    A mode is switched off while it handles an op, so the kernels inside a ``klpen::``
    operator would run unseen: :meth:`run` runs such an operator's Python implementation
    with this mode re-entered. Subclasses define ``see(func)``, or override
    ``__torch_dispatch__`` and call :meth:`run`.
    """

    def see(self, func: Any) -> None:
        raise NotImplementedError

    @staticmethod
    def is_klpen_op(func: Any) -> bool:
        return bool(func.namespace == "klpen")

    def run(self, func: Any, args: Any, kwargs: Any) -> Any:
        kwargs = kwargs or {}
        if self.is_klpen_op(func):
            with self:
                return _maybe_get_opdef(func)._init_fn(*args, **kwargs)  # type: ignore[union-attr]
        return func(*args, **kwargs)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.see(func)
        return self.run(func, args, kwargs)
