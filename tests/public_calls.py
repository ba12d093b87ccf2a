"""One call of every public tensor function, on small shared inputs: the table that the
sync-count test (tests/test_syncs.py) and the compilation test (tests/test_compile.py) run.

``CASES`` holds ``(id, call)``: ``call()`` returns what the public function returns, and
``call(s)`` the same with ``s``, a Python float (default 1.0), passed on to a float argument of
the function (a temperature, a coefficient, a bound, as a multiple of its default case's value)
or, where the function has none, multiplying a tensor argument or the result: the compilation
test calls each case with a different float each time (1, 1.25, 1.5; a case must accept them).
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

CASES: list[tuple[str, Callable[..., object]]] = [
    (
        "get_logprobs_for_tokens",
        lambda s=1.0: klpen.get_logprobs_for_tokens(LOGITS, TOKENS, temperature=s),
    ),
    (
        "get_logprobs_for_tokens-T",
        lambda s=1.0: klpen.get_logprobs_for_tokens(LOGITS, TOKENS, temperature=0.7 * s),
    ),
    ("next_token_logprobs", lambda s=1.0: klpen.next_token_logprobs(LOGITS, TOKENS, temperature=s)),
    ("token_entropy", lambda s=1.0: klpen.token_entropy(LOGITS, temperature=1.3 * s)),
    (
        "logprobs_and_entropy",
        lambda s=1.0: klpen.logprobs_and_entropy(LOGITS, TOKENS, temperature=s),
    ),
    ("full_kl", lambda s=1.0: klpen.full_kl(LOGITS, REF, temperature=0.9 * s)),
    (
        "kl_penalized_reward",
        lambda s=1.0: klpen.kl_penalized_reward(LOGITS, REF, torch.zeros(B, T), beta=0.1 * s),
    ),
    (
        "calculate_kl_penalty",
        lambda s=1.0: klpen.calculate_kl_penalty(
            LOGITS.log_softmax(-1), REF.log_softmax(-1), TOKENS, 0.1 * s
        ),
    ),
    ("linear_logprobs", lambda s=1.0: klpen.linear_logprobs(HIDDEN, WEIGHT, TOKENS, temperature=s)),
    (
        # a frozen output layer (LoRA): the forward keeps the rows' gradients
        "linear_logprobs-frozen-head",
        lambda s=1.0: klpen.linear_logprobs(HIDDEN, WEIGHT.detach(), TOKENS, temperature=0.9 * s),
    ),
    (
        "linear_logprobs-entropy",
        lambda s=1.0: klpen.linear_logprobs(
            HIDDEN, WEIGHT, TOKENS, return_entropy=True, temperature=0.8 * s
        ),
    ),
    (
        "linear_full_kl",
        lambda s=1.0: klpen.linear_full_kl(
            HIDDEN, WEIGHT, HIDDEN.detach() + 0.1, WEIGHT.detach(), temperature=s
        ),
    ),
    ("estimate_kl", lambda s=1.0: klpen.estimate_kl(LOGP, REF_LOGP, "k3", clamp=20.0 * s)),
    # no float argument: the float scales a tensor argument
    ("compute_token_kl", lambda s=1.0: klpen.compute_token_kl(LOGP * s, REF_LOGP, MASK)),
    ("masked_sum", lambda s=1.0: klpen.masked_sum(LOGP * s, MASK)),
    ("masked_mean", lambda s=1.0: klpen.masked_mean(LOGP * s, MASK, dim=-1)),
    ("aggregate", lambda s=1.0: klpen.aggregate(LOGP * s, MASK, "seq-mean-token-mean")),
    (
        # max_length: a whole number of tokens for each s of the compile test (1, 1.25, 1.5)
        "aggregate-dr_grpo",
        lambda s=1.0: klpen.aggregate(LOGP, MASK, "dr_grpo", max_length=8.0 * s),
    ),
    ("shape_rewards", lambda s=1.0: klpen.shape_rewards(REWARD, LOGP, MASK, 0.1 * s)),
    (
        "next_token_logprobs-packed",
        lambda s=1.0: klpen.next_token_logprobs(
            LOGITS.reshape(1, -1, LOGITS.shape[-1])[:, :10],
            TOKENS.reshape(1, -1)[:, :10],
            position_ids=POSITIONS,
            temperature=s,
        ),
    ),
    (
        "next_token_logprobs-entropy-packed",
        lambda s=1.0: klpen.next_token_logprobs(
            LOGITS.reshape(1, -1, LOGITS.shape[-1])[:, :10],
            TOKENS.reshape(1, -1)[:, :10],
            position_ids=POSITIONS,
            return_entropy=True,
            temperature=1.1 * s,
        ),
    ),
    # no float argument and no float input: the float scales the result
    ("sequence_ids", lambda s=1.0: klpen.sequence_ids(position_ids=POSITIONS) * s),
    (
        "mismatch_metrics-tensors",
        lambda s=1.0: klpen.mismatch_metrics(
            LOGP, REF_LOGP, MASK, band=(0.8, 1.25 * s), as_tensors=True
        ),
    ),
    (
        "sampler_logprobs",
        lambda s=1.0: klpen.sampler_logprobs(
            LOGITS, TOKENS, temperature=0.8 * s, top_k=10, top_p=0.6 * s
        ),
    ),
    (
        "importance_weights",
        lambda s=1.0: klpen.importance_weights(LOGP, REF_LOGP, MASK, cap=2.0 * s),
    ),
    ("response_mask", lambda s=1.0: klpen.response_mask(TOKENS, 3) * s),
    (
        "generalized_jsd",
        lambda s=1.0: klpen.generalized_jsd(LOGITS, REF, beta=0.4 * s, temperature=0.9 * s),
    ),
    (
        # a teacher of another hidden size (H + 3)
        "linear_generalized_jsd",
        lambda s=1.0: klpen.linear_generalized_jsd(
            HIDDEN, WEIGHT, REF[..., : H + 3], REF[0, :, : H + 3].repeat(8, 1), beta=0.5 * s
        ),
    ),
    (
        # the aggregated form, its gradients taken in the forward pass, packed
        "linear_generalized_jsd-aggregated",
        lambda s=1.0: klpen.linear_generalized_jsd(
            HIDDEN,
            WEIGHT,
            REF[..., : H + 3],
            REF[0, :, : H + 3].repeat(8, 1),
            beta=0.5 * s,
            aggregation="seq-mean-token-mean",
            mask=MASK,
            sequence_ids=torch.tensor([[0, 0, 1, 1, 1], [0, 1, 1, 2, 2]]),
        ),
    ),
    (
        "topk_kl",
        lambda s=1.0: klpen.topk_kl(
            LOGITS,
            REF.topk(4, dim=-1).indices,
            REF.log_softmax(-1).topk(4, dim=-1).values,
            temperature=0.9 * s,
        ),
    ),
    (
        "distillation_rewards",
        lambda s=1.0: klpen.distillation_rewards(LOGP, REF_LOGP, MASK, kl_coef=0.5 * s),
    ),
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
