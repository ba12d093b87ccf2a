"""Contract section 3: every public function rejects bad input with a readable error.

Each case asserts the exception type and a message that names the argument and what was
received (its shape, dtype or value). A final fuzz test feeds each function random junk and
accepts only success, ``TypeError`` or ``ValueError``: never a bare ``RuntimeError`` or
``IndexError`` from inside torch.
"""

from __future__ import annotations

import math
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import klpen
from klpen import (
    aggregate,
    calculate_kl_penalty,
    compute_rlhf_objective,
    compute_token_kl,
    estimate_kl,
    full_kl,
    get_logprobs_for_tokens,
    kl_penalized_reward,
    kl_penalty,
    logprobs_and_entropy,
    masked_mean,
    masked_sum,
    next_token_logprobs,
    shape_rewards,
    token_entropy,
)

NAN, INF = math.nan, math.inf

# valid arguments, (B, T, V) = (2, 3, 5)
LOGITS = torch.zeros(2, 3, 5)
LOGP = torch.log_softmax(torch.arange(30.0).reshape(2, 3, 5), -1)
TOKENS = torch.tensor([[0, 1, 4], [2, 3, 0]])
LP = torch.full((2, 3), -1.0)
MASK = torch.tensor([[1, 1, 0], [1, 0, 0]])
SCORES = torch.ones(2)
META = torch.device("meta")

Case = tuple[str, Callable[[], object], type[Exception], str]


def bad_coefs(name: str, call: Callable[[object], object]) -> list[Case]:
    """The coefficient cases shared by every function with a beta / kl_coef."""
    return [
        (f"{name}-negative", lambda: call(-0.1), ValueError, rf"{name} must be .*got -0\.1"),
        (f"{name}-nan", lambda: call(NAN), ValueError, rf"{name} must be finite.*got nan"),
        (f"{name}-inf", lambda: call(INF), ValueError, rf"{name} must be finite.*got inf"),
        (f"{name}-minus-inf", lambda: call(-INF), ValueError, rf"{name} .*got -inf"),
        (f"{name}-bool", lambda: call(True), TypeError, rf"{name} must be a real number.*bool"),
        (f"{name}-str", lambda: call("0.1"), TypeError, rf"{name} must be a real number.*str"),
        (
            f"{name}-tensor-of-two",
            lambda: call(torch.tensor([0.1, 0.2])),
            ValueError,
            rf"{name} must be a number, got a tensor of shape \(2,\)",
        ),
        (f"{name}-nan-tensor", lambda: call(torch.tensor(NAN)), ValueError, rf"{name} .*got nan"),
    ]


CASES: list[Case] = [
    # ------------------------------------------------------------ kl_penalty
    *bad_coefs("beta", lambda b: kl_penalty([-1.0], [-2.0], b)),  # type: ignore[arg-type]
    (
        "kl_penalty-2d",
        lambda: kl_penalty([[-1.0, -2.0]], [[-1.0, -2.0]], 0.1),  # type: ignore[list-item]
        ValueError,
        r"logp_policy must have shape \(T,\).*got shape \(1, 2\)",
    ),
    ("kl_penalty-empty", lambda: kl_penalty([], [], 0.1), ValueError, r"logp_policy .*\(0,\)"),
    (
        "kl_penalty-lengths",
        lambda: kl_penalty([-1.0, -2.0], [-1.0, -2.0, -3.0], 0.1),
        ValueError,
        r"logp_reference must have the shape of logp_policy \(2,\), got \(3,\)",
    ),
    (
        "kl_penalty-strings",
        lambda: kl_penalty(["-1.0"], [-1.0], 0.1),  # type: ignore[list-item]
        TypeError,
        r"logp_policy must be a list or array of real numbers, got dtype <U4",
    ),
    (
        "kl_penalty-none",
        lambda: kl_penalty([-1.0], None, 0.1),  # type: ignore[arg-type]
        TypeError,
        r"logp_reference must be a list or array of real numbers.*None",
    ),
    (
        "kl_penalty-ragged",
        lambda: kl_penalty([[-1.0], [-1.0, -2.0]], [-1.0], 0.1),  # type: ignore[list-item]
        TypeError,
        r"logp_policy must be a list or array of numbers",
    ),
    (
        "kl_penalty-nan",
        lambda: kl_penalty([-1.0, NAN], [-1.0, -2.0], 0.1),
        ValueError,
        r"logp_policy must be finite, got \[-1.0, nan\]",
    ),
    # ------------------------------------------------------------ estimate_kl
    (
        "estimate_kl-list",
        lambda: estimate_kl([-1.0], LP),  # type: ignore[arg-type]
        TypeError,
        r"policy_logprobs must be a torch.Tensor, got list",
    ),
    (
        "estimate_kl-int",
        lambda: estimate_kl(LP, torch.zeros(2, 3, dtype=torch.long)),
        TypeError,
        r"reference_logprobs must be a floating-point tensor, got dtype torch.int64",
    ),
    (
        "estimate_kl-shape",
        lambda: estimate_kl(LP, torch.zeros(3, 2)),
        ValueError,
        r"reference_logprobs must have shape \(2, 3\).*got \(3, 2\)",
    ),
    (
        "estimate_kl-device",
        lambda: estimate_kl(LP, torch.zeros(2, 3, device=META)),
        TypeError,
        r"reference_logprobs must hold data, got a meta tensor",
    ),
    (
        "estimate_kl-unknown",
        lambda: estimate_kl(LP, LP, "k4"),
        ValueError,
        r"estimator must be one of 'k1', 'k2', 'k3', 'abs'.*; got 'k4'",
    ),
    (
        "estimate_kl-not-a-name",
        lambda: estimate_kl(LP, LP, None),  # type: ignore[arg-type]
        ValueError,
        r"estimator must be one of .*got None",
    ),
    # ------------------------------------------------------------ compute_token_kl
    (
        "compute_token_kl-1d",
        lambda: compute_token_kl(LP[0], LP[0]),
        ValueError,
        r"policy_logprobs must have shape \(B, T\), got \(3,\)",
    ),
    (
        "compute_token_kl-shape",
        lambda: compute_token_kl(LP, LP[:, :2]),
        ValueError,
        r"reference_logprobs must have shape \(2, 3\).*got \(2, 2\)",
    ),
    (
        "compute_token_kl-mask-shape",
        lambda: compute_token_kl(LP, LP, MASK[:, :2]),
        ValueError,
        r"attention_mask must have shape \(2, 3\).*got \(2, 2\)",
    ),
    (
        "compute_token_kl-mask-values",
        lambda: compute_token_kl(LP, LP, MASK * 2),
        ValueError,
        r"attention_mask must contain only 0 and 1, got a value 2",
    ),
    (
        "compute_token_kl-mask-nan",
        lambda: compute_token_kl(LP, LP, torch.full((2, 3), NAN)),
        ValueError,
        r"attention_mask must contain only 0 and 1, got a value nan",
    ),
    (
        "compute_token_kl-mask-list",
        lambda: compute_token_kl(LP, LP, [[1, 1, 1], [1, 1, 1]]),  # type: ignore[arg-type]
        TypeError,
        r"attention_mask must be a torch.Tensor, got list",
    ),
    (
        "compute_token_kl-mask-complex",
        lambda: compute_token_kl(LP, LP, torch.ones(2, 3, dtype=torch.complex64)),
        TypeError,
        r"attention_mask must be bool, integer or floating 0/1, got dtype torch.complex64",
    ),
    (
        "compute_token_kl-mask-device",
        lambda: compute_token_kl(LP, LP, torch.ones(2, 3, device=META)),
        TypeError,
        r"attention_mask must hold data, got a meta tensor",
    ),
    # ------------------------------------------------------------ get_logprobs_for_tokens
    (
        "logprobs-int-logits",
        lambda: get_logprobs_for_tokens(torch.zeros(2, 3, 5, dtype=torch.long), TOKENS),
        TypeError,
        r"logits must be a floating-point tensor, got dtype torch.int64",
    ),
    (
        "logprobs-list-logits",
        lambda: get_logprobs_for_tokens([[0.0, 1.0]], TOKENS),  # type: ignore[arg-type]
        TypeError,
        r"logits must be a torch.Tensor, got list",
    ),
    (
        "logprobs-0d-logits",
        lambda: get_logprobs_for_tokens(torch.tensor(1.0), torch.tensor(0)),
        ValueError,
        r"logits must have at least 1 dimension\(s\), got shape \(\)",
    ),
    (
        "logprobs-empty-vocab",
        lambda: get_logprobs_for_tokens(torch.zeros(2, 3, 0), TOKENS),
        ValueError,
        r"logits must have a non-empty last \(vocabulary\) axis, got \(2, 3, 0\)",
    ),
    (
        "logprobs-float-tokens",
        lambda: get_logprobs_for_tokens(LOGITS, TOKENS.float()),
        TypeError,
        r"tokens must hold integer token ids, got dtype torch.float32",
    ),
    (
        "logprobs-bool-tokens",
        lambda: get_logprobs_for_tokens(LOGITS, TOKENS > 0),
        TypeError,
        r"tokens must hold integer token ids, got dtype torch.bool",
    ),
    (
        "logprobs-list-tokens",
        lambda: get_logprobs_for_tokens(LOGITS, [[0, 1, 2], [0, 1, 2]]),  # type: ignore[arg-type]
        TypeError,
        r"tokens must be a torch.Tensor of token ids, got list",
    ),
    (
        "logprobs-tokens-shape",
        lambda: get_logprobs_for_tokens(LOGITS, TOKENS[:, :2]),
        ValueError,
        r"tokens must have shape \(2, 3\).*got \(2, 2\)",
    ),
    (
        "logprobs-tokens-too-large",
        lambda: get_logprobs_for_tokens(LOGITS, TOKENS + 1),
        ValueError,
        r"tokens must lie in \[0, 5\).*got a token id 5",
    ),
    (
        "logprobs-tokens-negative",
        lambda: get_logprobs_for_tokens(LOGITS, TOKENS - 1),
        ValueError,
        r"tokens must lie in \[0, 5\).*got a token id -1",
    ),
    (
        "logprobs-tokens-device",
        lambda: get_logprobs_for_tokens(LOGITS, TOKENS.to(META)),
        TypeError,
        r"tokens must hold data, got a meta tensor",
    ),
    (
        "logprobs-nan-logits",
        lambda: get_logprobs_for_tokens(torch.full((2, 3, 5), NAN), TOKENS),
        ValueError,
        r"logits contain NaN",
    ),
    # ------------------------------------------------------------ temperature, entropy, shift
    *[
        (
            f"{fn}-temperature-{label}",
            lambda call=call, t=t: call(t),
            exc,
            match,
        )
        for fn, call in (
            ("logprobs", lambda t: get_logprobs_for_tokens(LOGITS, TOKENS, temperature=t)),
            ("full_kl", lambda t: full_kl(LOGITS, LOGITS, temperature=t)),
            ("token_entropy", lambda t: token_entropy(LOGITS, temperature=t)),
            ("logprobs_and_entropy", lambda t: logprobs_and_entropy(LOGITS, TOKENS, temperature=t)),
            ("next_token_logprobs", lambda t: next_token_logprobs(LOGITS, TOKENS, temperature=t)),
        )
        for label, t, exc, match in (
            ("zero", 0.0, ValueError, r"temperature must be finite and positive, got 0\.0"),
            ("negative", -1.0, ValueError, r"temperature must be finite and positive, got -1"),
            ("nan", NAN, ValueError, r"temperature must be finite and positive, got nan"),
            ("inf", INF, ValueError, r"temperature must be finite and positive, got inf"),
            ("subnormal", 1e-320, ValueError, r"temperature .*finite inverse, got 1e-320"),
            ("str", "1", TypeError, r"temperature must be a real number, got str"),
        )
    ],
    (
        "token_entropy-int",
        lambda: token_entropy(torch.zeros(2, 3, dtype=torch.long)),
        TypeError,
        r"logits must be a floating-point tensor, got dtype torch.int64",
    ),
    (
        "token_entropy-empty-vocab",
        lambda: token_entropy(torch.zeros(2, 0)),
        ValueError,
        r"logits must have a non-empty last \(vocabulary\) axis, got \(2, 0\)",
    ),
    (
        "token_entropy-nan",
        lambda: token_entropy(torch.full((2, 5), NAN)),
        ValueError,
        r"logits contain NaN",
    ),
    (
        "logprobs_and_entropy-tokens-shape",
        lambda: logprobs_and_entropy(LOGITS, TOKENS[:, :2]),
        ValueError,
        r"tokens must have shape \(2, 3\).*got \(2, 2\)",
    ),
    (
        "logprobs_and_entropy-plus-inf",
        lambda: logprobs_and_entropy(torch.tensor([[0.0, INF]]), torch.tensor([0])),
        ValueError,
        r"logits contain NaN or \+inf",
    ),
    (
        "next_token_logprobs-1d",
        lambda: next_token_logprobs(torch.zeros(5), torch.tensor(0)),
        ValueError,
        r"logits must have at least 2 dimension\(s\), got shape \(5,\)",
    ),
    (
        "next_token_logprobs-ids-shape",
        lambda: next_token_logprobs(LOGITS, TOKENS[:, 1:]),
        ValueError,
        r"input_ids must have shape \(2, 3\).*got \(2, 2\)",
    ),
    (
        "next_token_logprobs-ids-range",
        lambda: next_token_logprobs(LOGITS, TOKENS + 1),
        ValueError,
        r"input_ids must lie in \[0, 5\).*got a token id 5",
    ),
    (
        "next_token_logprobs-float-ids",
        lambda: next_token_logprobs(LOGITS, TOKENS.float()),
        TypeError,
        r"input_ids must hold integer token ids, got dtype torch.float32",
    ),
    # ------------------------------------------------------------ calculate_kl_penalty
    *bad_coefs("beta", lambda b: calculate_kl_penalty(LOGP, LOGP, TOKENS, b)),  # type: ignore[arg-type]
    (
        "calc-2d",
        lambda: calculate_kl_penalty(LP, LP, TOKENS, 0.1),
        ValueError,
        r"log_probs_rl must have at least 3 dimension\(s\), got shape \(2, 3\)",
    ),
    (
        "calc-4d",
        lambda: calculate_kl_penalty(LOGP[None], LOGP[None], TOKENS, 0.1),
        ValueError,
        r"log_probs_rl must have shape \(B, T, V\), got \(1, 2, 3, 5\)",
    ),
    (
        "calc-sft-shape",
        lambda: calculate_kl_penalty(LOGP, LOGP[..., :4], TOKENS, 0.1),
        ValueError,
        r"log_probs_sft must have the shape of log_probs_rl \(2, 3, 5\), got \(2, 3, 4\)",
    ),
    (
        "calc-int",
        lambda: calculate_kl_penalty(LOGP, LOGP.long(), TOKENS, 0.1),
        TypeError,
        r"log_probs_sft must be a floating-point tensor, got dtype torch.int64",
    ),
    (
        "calc-float-actions",
        lambda: calculate_kl_penalty(LOGP, LOGP, TOKENS.double(), 0.1),
        TypeError,
        r"actions must hold integer token ids, got dtype torch.float64",
    ),
    (
        "calc-bool-actions",
        lambda: calculate_kl_penalty(LOGP, LOGP, TOKENS > 1, 0.1),
        TypeError,
        r"actions must hold integer token ids, got dtype torch.bool",
    ),
    (
        "calc-actions-range",
        lambda: calculate_kl_penalty(LOGP, LOGP, TOKENS + 3, 0.1),
        ValueError,
        r"actions must lie in \[0, 5\).*got a token id 7",
    ),
    (
        "calc-actions-shape",
        lambda: calculate_kl_penalty(LOGP, LOGP, TOKENS[0], 0.1),
        ValueError,
        r"actions must have shape \(2, 3\).*got \(3,\)",
    ),
    (
        "calc-actions-ndarray",
        lambda: calculate_kl_penalty(LOGP, LOGP, TOKENS.numpy(), 0.1),  # type: ignore[arg-type]
        TypeError,
        r"actions must be a torch.Tensor of token ids, got ndarray",
    ),
    # ------------------------------------------------------------ full_kl
    (
        "full_kl-int",
        lambda: full_kl(LOGITS.long(), LOGITS),
        TypeError,
        r"policy_logits must be a floating-point tensor, got dtype torch.int64",
    ),
    (
        "full_kl-none",
        lambda: full_kl(LOGITS, None),  # type: ignore[arg-type]
        TypeError,
        r"reference_logits must be a torch.Tensor, got NoneType",
    ),
    (
        "full_kl-shape",
        lambda: full_kl(LOGITS, LOGITS[..., :4]),
        ValueError,
        r"reference_logits must have shape \(2, 3, 5\).*got \(2, 3, 4\)",
    ),
    (
        "full_kl-0d",
        lambda: full_kl(torch.tensor(0.0), torch.tensor(0.0)),
        ValueError,
        r"policy_logits must have at least 1 dimension\(s\), got shape \(\)",
    ),
    (
        "full_kl-empty-vocab",
        lambda: full_kl(torch.zeros(2, 0), torch.zeros(2, 0)),
        ValueError,
        r"policy_logits must have a non-empty last \(vocabulary\) axis, got \(2, 0\)",
    ),
    (
        "full_kl-device",
        lambda: full_kl(LOGITS, LOGITS.to(META)),
        TypeError,
        r"reference_logits must hold data, got a meta tensor",
    ),
    (
        "full_kl-nan-reference",
        lambda: full_kl(LOGITS, torch.full((2, 3, 5), NAN)),
        ValueError,
        r"contain NaN",
    ),
    # ------------------------------------------------------------ kl_penalized_reward
    *bad_coefs("beta", lambda b: kl_penalized_reward(LOGITS, LOGITS, LP, b)),  # type: ignore[arg-type]
    (
        "penalized-reward-shape",
        lambda: kl_penalized_reward(LOGITS, LOGITS, SCORES),
        ValueError,
        r"reward must have shape \(2, 3\) \(the leading shape of policy_logits\), got \(2,\)",
    ),
    (
        "penalized-reward-int",
        lambda: kl_penalized_reward(LOGITS, LOGITS, torch.zeros(2, 3, dtype=torch.long)),
        TypeError,
        r"reward must be a floating-point tensor, got dtype torch.int64",
    ),
    (
        "penalized-policy-list",
        lambda: kl_penalized_reward([0.0], LOGITS, LP),  # type: ignore[arg-type]
        TypeError,
        r"policy_logits must be a torch.Tensor, got list",
    ),
    # ------------------------------------------------------------ masked_sum / masked_mean
    *[
        case
        for fn in (masked_sum, masked_mean)
        for case in [
            (
                f"{fn.__name__}-int-values",
                lambda fn=fn: fn(MASK, MASK),
                TypeError,
                r"values must be a floating-point tensor, got dtype torch.int64",
            ),
            (
                f"{fn.__name__}-array-values",
                lambda fn=fn: fn(np.zeros((2, 3)), MASK),
                TypeError,
                r"values must be a torch.Tensor, got ndarray",
            ),
            (
                f"{fn.__name__}-mask-shape",
                lambda fn=fn: fn(LP, MASK.t()),
                ValueError,
                r"mask must have shape \(2, 3\).*got \(3, 2\)",
            ),
            (
                f"{fn.__name__}-mask-values",
                lambda fn=fn: fn(LP, MASK - 1),
                ValueError,
                r"mask must contain only 0 and 1, got a value -1",
            ),
            (
                f"{fn.__name__}-mask-none",
                lambda fn=fn: fn(LP, None),
                TypeError,
                r"mask must be a torch.Tensor, got NoneType",
            ),
            (
                f"{fn.__name__}-dim-range",
                lambda fn=fn: fn(LP, MASK, dim=2),
                ValueError,
                r"dim must lie in \[-2, 1\] for a tensor of 2 dimension\(s\), got 2",
            ),
            (
                f"{fn.__name__}-dim-negative-range",
                lambda fn=fn: fn(LP, MASK, dim=(0, -3)),
                ValueError,
                r"dim must lie in \[-2, 1\].*got \(0, -3\)",
            ),
            (
                f"{fn.__name__}-dim-twice",
                lambda fn=fn: fn(LP, MASK, dim=(1, -1)),
                ValueError,
                r"dim must not name a dimension twice, got \(1, -1\)",
            ),
            (
                f"{fn.__name__}-dim-str",
                lambda fn=fn: fn(LP, MASK, dim="T"),
                TypeError,
                r"dim must be None, an int or a non-empty tuple of ints, got 'T'",
            ),
            (
                f"{fn.__name__}-dim-empty",
                lambda fn=fn: fn(LP, MASK, dim=()),
                TypeError,
                r"dim must be None, an int or a non-empty tuple of ints, got \(\)",
            ),
            (
                f"{fn.__name__}-dim-bool",
                lambda fn=fn: fn(LP, MASK, dim=True),
                TypeError,
                r"dim must be None, an int or a non-empty tuple of ints, got True",
            ),
            (
                f"{fn.__name__}-dim-float",
                lambda fn=fn: fn(LP, MASK, dim=1.0),
                TypeError,
                r"dim must be .*got 1.0",
            ),
        ]
    ],
    # ------------------------------------------------------------ aggregate
    (
        "aggregate-mode",
        lambda: aggregate(LP, MASK, "mean"),
        ValueError,
        r"mode must be one of 'token-mean', 'token-sum', 'seq-mean-token-mean', "
        r"'seq-mean-token-sum', .*'seq-mean-token-sum-norm'; got 'mean'",
    ),
    (
        "aggregate-sequence_ids-shape",
        lambda: aggregate(LP, MASK, "token-mean", sequence_ids=torch.zeros(1, 3, dtype=torch.long)),
        ValueError,
        r"sequence_ids must have the shape of values \(2, 3\), got \(1, 3\)",
    ),
    # ------------------------------------------------------------ sequence_ids
    (
        "sequence_ids-neither",
        lambda: klpen.sequence_ids(),
        ValueError,
        r"pass exactly one of position_ids and cu_seqlens, got neither",
    ),
    (
        "sequence_ids-total-missing",
        lambda: klpen.sequence_ids(cu_seqlens=torch.tensor([0, 2])),
        ValueError,
        r"total \(the packed length.*is required with cu_seqlens",
    ),
    (
        "sequence_ids-position_ids-float",
        lambda: klpen.sequence_ids(position_ids=torch.zeros(1, 3)),
        TypeError,
        r"position_ids must be an int64, .* got dtype torch.float32",
    ),
    (
        "aggregate-3d",
        lambda: aggregate(LOGITS, torch.ones(2, 3, 5), "token-mean"),
        ValueError,
        r"values must have shape \(B, T\), got \(2, 3, 5\)",
    ),
    (
        "aggregate-mask-shape",
        lambda: aggregate(LP, MASK[0], "token-mean"),
        ValueError,
        r"mask must have shape \(2, 3\).*got \(3,\)",
    ),
    (
        "aggregate-mask-values",
        lambda: aggregate(LP, MASK * 0.5, "token-sum"),
        ValueError,
        r"mask must contain only 0 and 1, got a value 0.5",
    ),
    # ------------------------------------------------------------ shape_rewards
    *bad_coefs("kl_coef", lambda c: shape_rewards(SCORES, LP, MASK, c)),  # type: ignore[arg-type]
    (
        "shape_rewards-scores-shape",
        lambda: shape_rewards(SCORES[:, None], LP, MASK, 0.1),
        ValueError,
        r"scores must have shape \(2,\) \(one score per row of per_token_kl\), got \(2, 1\)",
    ),
    (
        "shape_rewards-scores-int",
        lambda: shape_rewards(SCORES.long(), LP, MASK, 0.1),
        TypeError,
        r"scores must be a floating-point tensor, got dtype torch.int64",
    ),
    (
        "shape_rewards-kl-1d",
        lambda: shape_rewards(SCORES, LP[0], MASK[0], 0.1),
        ValueError,
        r"per_token_kl must have shape \(B, T\), got \(3,\)",
    ),
    (
        "shape_rewards-mask-values",
        lambda: shape_rewards(SCORES, LP, MASK * 0.5, 0.1),
        ValueError,
        r"mask must contain only 0 and 1, got a value 0.5",
    ),
    (
        "shape_rewards-mask-shape",
        lambda: shape_rewards(SCORES, LP, MASK[:, :1], 0.1),
        ValueError,
        r"mask must have shape \(2, 3\).*got \(2, 1\)",
    ),
    (
        "shape_rewards-scores-device",
        lambda: shape_rewards(SCORES.to(META), LP, MASK, 0.1),
        TypeError,
        r"scores must hold data, got a meta tensor",
    ),
    # ------------------------------------------------------------ compute_rlhf_objective
    *bad_coefs(
        "kl_coef",
        lambda c: compute_rlhf_objective(LOGITS, LOGITS, TOKENS, SCORES, MASK, c),  # type: ignore[arg-type]
    ),
    (
        "objective-2d",
        lambda: compute_rlhf_objective(LP, LP, TOKENS, SCORES, MASK, 0.1),
        ValueError,
        r"policy_logits must have at least 3 dimension\(s\), got shape \(2, 3\)",
    ),
    (
        "objective-4d",
        lambda: compute_rlhf_objective(LOGITS[None], LOGITS[None], TOKENS, SCORES, MASK, 0.1),
        ValueError,
        r"policy_logits must have shape \(B, T, V\), got \(1, 2, 3, 5\)",
    ),
    (
        "objective-int-logits",
        lambda: compute_rlhf_objective(LOGITS.long(), LOGITS, TOKENS, SCORES, MASK, 0.1),
        TypeError,
        r"policy_logits must be a floating-point tensor, got dtype torch.int64",
    ),
    (
        "objective-reference-shape",
        lambda: compute_rlhf_objective(LOGITS, LOGITS[:1], TOKENS, SCORES, MASK, 0.1),
        ValueError,
        r"reference_logits must have shape \(2, 3, 5\).*got \(1, 3, 5\)",
    ),
    (
        "objective-reference-device",
        lambda: compute_rlhf_objective(LOGITS, LOGITS.to(META), TOKENS, SCORES, MASK, 0.1),
        TypeError,
        r"reference_logits must hold data, got a meta tensor",
    ),
    (
        "objective-tokens-range",
        lambda: compute_rlhf_objective(LOGITS, LOGITS, TOKENS + 3, SCORES, MASK, 0.1),
        ValueError,
        r"response_tokens must lie in \[0, 5\).*got a token id 7",
    ),
    (
        "objective-tokens-negative",
        lambda: compute_rlhf_objective(LOGITS, LOGITS, -TOKENS - 1, SCORES, MASK, 0.1),
        ValueError,
        r"response_tokens must lie in \[0, 5\).*got a token id -5",
    ),
    (
        "objective-tokens-float",
        lambda: compute_rlhf_objective(LOGITS, LOGITS, TOKENS.float(), SCORES, MASK, 0.1),
        TypeError,
        r"response_tokens must hold integer token ids, got dtype torch.float32",
    ),
    (
        "objective-tokens-shape",
        lambda: compute_rlhf_objective(LOGITS, LOGITS, TOKENS.t(), SCORES, MASK, 0.1),
        ValueError,
        r"response_tokens must have shape \(2, 3\).*got \(3, 2\)",
    ),
    (
        "objective-tokens-list",
        lambda: compute_rlhf_objective(LOGITS, LOGITS, [[0]], SCORES, MASK, 0.1),  # type: ignore[arg-type]
        TypeError,
        r"response_tokens must be a torch.Tensor of token ids, got list",
    ),
    (
        "objective-rewards-shape",
        lambda: compute_rlhf_objective(LOGITS, LOGITS, TOKENS, LP, MASK, 0.1),
        ValueError,
        r"rewards must have shape \(2,\) \(one reward per row of policy_logits\), got \(2, 3\)",
    ),
    (
        "objective-rewards-int",
        lambda: compute_rlhf_objective(LOGITS, LOGITS, TOKENS, SCORES.long(), MASK, 0.1),
        TypeError,
        r"rewards must be a floating-point tensor, got dtype torch.int64",
    ),
    (
        "objective-mask-shape",
        lambda: compute_rlhf_objective(LOGITS, LOGITS, TOKENS, SCORES, MASK[:, :2], 0.1),
        ValueError,
        r"attention_mask must have shape \(2, 3\).*got \(2, 2\)",
    ),
    (
        "objective-mask-values",
        lambda: compute_rlhf_objective(LOGITS, LOGITS, TOKENS, SCORES, MASK + 1, 0.1),
        ValueError,
        r"attention_mask must contain only 0 and 1, got a value 2",
    ),
    (
        "objective-nan-policy",
        lambda: compute_rlhf_objective(
            torch.full((2, 3, 5), NAN), LOGITS, TOKENS, SCORES, MASK, 0.1
        ),
        ValueError,
        r"policy_logits: .*NaN",
    ),
    (
        "objective-nan-reference",
        lambda: compute_rlhf_objective(
            LOGITS, torch.full((2, 3, 5), NAN), TOKENS, SCORES, MASK, 0.1
        ),
        ValueError,
        r"reference_logits: .*NaN",
    ),
]


CASES.append(
    (
        "response_mask-eos",
        lambda: klpen.response_mask(TOKENS, 2.0),  # type: ignore[arg-type]
        TypeError,
        r"eos_token_id must be a Python int",
    )
)

# linear_logprobs / linear_full_kl (more in tests/test_linear.py)
_H, _W = torch.ones(2, 3), torch.ones(4, 3)
CASES += [
    (
        "linear_logprobs-weight-shape",
        lambda: klpen.linear_logprobs(_H, torch.ones(4, 5), torch.tensor([0, 1])),
        ValueError,
        r"weight must have shape \(V, H\) with H = 3",
    ),
    (
        "linear_logprobs-token-range",
        lambda: klpen.linear_logprobs(_H, _W, torch.tensor([0, 4])),
        ValueError,
        r"tokens must lie in \[0, 4\)",
    ),
    (
        "linear_full_kl-ref-shape",
        lambda: klpen.linear_full_kl(_H, _W, torch.ones(3, 3), _W),
        ValueError,
        r"ref_hidden must have shape \(2, 3\)",
    ),
    (
        "linear_full_kl-temperature",
        lambda: klpen.linear_full_kl(_H, _W, _H, _W, temperature=-1.0),
        ValueError,
        r"temperature must be finite and positive",
    ),
]


# chapter 8: sampler log-probs, importance weights, mismatch metrics (more in test_sampling.py)
CASES.extend(
    [
        (
            "sampler_logprobs-temperature",
            lambda: klpen.sampler_logprobs(LOGITS, TOKENS, temperature=0.0),
            ValueError,
            r"temperature must be finite and positive, got 0.0",
        ),
        (
            "sampler_logprobs-top_p",
            lambda: klpen.sampler_logprobs(LOGITS, TOKENS, top_p=1.5),
            ValueError,
            r"top_p must lie in \(0, 1\], got 1.5",
        ),
        (
            "sampler_logprobs-top_k",
            lambda: klpen.sampler_logprobs(LOGITS, TOKENS, top_k=0),
            ValueError,
            r"top_k must be None or an int >= 1, got 0",
        ),
        (
            "importance_weights-behavior-inf",
            lambda: klpen.importance_weights(LP, torch.full_like(LP, INF), MASK),
            ValueError,
            r"behavior_logprobs must not be NaN or \+inf at a valid position",
        ),
        (
            "mismatch_metrics-band",
            lambda: klpen.mismatch_metrics(LP, LP, MASK, band=(1.25, 0.8)),
            ValueError,
            r"band must satisfy lo < hi",
        ),
    ]
)


# the process-wide switches of contract section 7 (available_backends takes no argument)
CASES += [
    (
        "use_backend-unknown",
        lambda: klpen.use_backend("cuda").__enter__(),
        ValueError,
        r"backend must be one of 'auto', 'torch'.*got 'cuda'",
    ),
    (
        "validation-not-bool",
        lambda: klpen.validation("no").__enter__(),  # type: ignore[arg-type]
        TypeError,
        r"enabled must be True or False, got str 'no'",
    ),
    (
        "set_validation-not-bool",
        lambda: klpen.set_validation(0),  # type: ignore[arg-type]
        TypeError,
        r"enabled must be True or False, got int 0",
    ),
]


# ------------------------------------------------------------ distillation (contract section 10)
TEACHER_IDS = torch.tensor([[[0, 1], [2, 3], [4, 0]], [[1, 2], [3, 4], [0, 1]]])
TEACHER_LP = torch.full((2, 3, 2), math.log(0.3))
CASES += [
    *bad_coefs("kl_coef", lambda c: klpen.distillation_rewards(LP, LP, MASK, kl_coef=c)),  # type: ignore[arg-type]
    (
        "distillation_rewards-mask-shape",
        lambda: klpen.distillation_rewards(LP, LP, MASK[:, :2]),
        ValueError,
        r"mask must have shape \(2, 3\)",
    ),
    (
        "generalized_jsd-beta-above-1",
        lambda: klpen.generalized_jsd(LOGITS, LOGP, beta=1.5),
        ValueError,
        r"beta .*1\.5",
    ),
    (
        "generalized_jsd-shapes",
        lambda: klpen.generalized_jsd(LOGITS, LOGP[..., :4]),
        ValueError,
        r"teacher_logits has 4",
    ),
    (
        "linear_generalized_jsd-vocabularies",
        lambda: klpen.linear_generalized_jsd(
            torch.zeros(3, 4), torch.zeros(5, 4), torch.zeros(3, 2), torch.zeros(6, 2)
        ),
        ValueError,
        r"teacher_weight",
    ),
    *(
        (
            f"linear_generalized_jsd-{case}",
            lambda kw=kw, lead=lead: klpen.linear_generalized_jsd(
                torch.zeros(*lead, 4),
                torch.zeros(5, 4),
                torch.zeros(*lead, 2),
                torch.zeros(5, 2),
                **kw,
            ),
            ValueError,
            match,
        )
        for case, lead, kw, match in (
            ("mask-without-aggregation", (2, 3), {"mask": MASK}, "mask selects what aggregation"),
            ("aggregation-mode", (2, 3), {"aggregation": "dapo"}, "aggregation must be one of"),
            (
                "aggregation-positions",
                (3,),
                {"aggregation": "token-mean"},
                r"student_hidden must have shape \(B, T, H\)",
            ),
            (
                "aggregation-mask-shape",
                (2, 3),
                {"aggregation": "token-mean", "mask": MASK[:, :2]},
                r"mask must have shape \(2, 3\)",
            ),
            (
                "aggregation-sequence-ids",
                (2, 3),
                {
                    "aggregation": "seq-mean-token-mean",
                    "sequence_ids": torch.tensor([[0, 1, 0], [0, 0, 1]]),
                },
                "sequence_ids must be non-decreasing",
            ),
        )
    ),
    (
        "topk_kl-repeated-ids",
        lambda: klpen.topk_kl(LOGITS, torch.zeros_like(TEACHER_IDS), TEACHER_LP),
        ValueError,
        r"teacher_topk_ids",
    ),
    (
        "topk_kl-mass-above-1",
        lambda: klpen.topk_kl(LOGITS, TEACHER_IDS, torch.full((2, 3, 2), math.log(0.6))),
        ValueError,
        r"teacher_topk_logprobs",
    ),
    (
        "topk_kl-direction",
        lambda: klpen.topk_kl(LOGITS, TEACHER_IDS, TEACHER_LP, direction="both"),
        ValueError,
        r"direction must be one of",
    ),
]


@pytest.mark.parametrize(
    ("call", "exc", "match"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_bad_input_raises_a_readable_error(
    call: Callable[[], object], exc: type[Exception], match: str
) -> None:
    with pytest.raises(exc, match=match):
        call()


def test_every_public_function_has_bad_input_cases() -> None:
    covered = " ".join(c[0] for c in CASES)
    prefixes = {
        "kl_penalty": "kl_penalty-",
        "estimate_kl": "estimate_kl-",
        "compute_token_kl": "compute_token_kl-",
        "get_logprobs_for_tokens": "logprobs-",
        "calculate_kl_penalty": "calc-",
        "full_kl": "full_kl-",
        "kl_penalized_reward": "penalized-",
        "masked_sum": "masked_sum-",
        "masked_mean": "masked_mean-",
        "aggregate": "aggregate-",
        "sequence_ids": "sequence_ids-",
        "shape_rewards": "shape_rewards-",
        "compute_rlhf_objective": "objective-",
        "response_mask": "response_mask-",
        "sampler_logprobs": "sampler_logprobs-",
        "importance_weights": "importance_weights-",
        "mismatch_metrics": "mismatch_metrics-",
        "token_entropy": "token_entropy-",
        "logprobs_and_entropy": "logprobs_and_entropy-",
        "next_token_logprobs": "next_token_logprobs-",
        "linear_logprobs": "linear_logprobs-",
        "linear_full_kl": "linear_full_kl-",
        "use_backend": "use_backend-",
        "validation": "validation-",
        "set_validation": "set_validation-",
        "generalized_jsd": "generalized_jsd-",
        "linear_generalized_jsd": "linear_generalized_jsd-",
        "topk_kl": "topk_kl-",
        "distillation_rewards": "distillation_rewards-",
    }
    functions = {
        name
        for name in klpen.__all__
        if callable(getattr(klpen, name))
        and not isinstance(getattr(klpen, name), type)
        and name != "available_backends"  # takes no argument
    }
    # the controllers' constructors and update() are covered in test_controllers.py
    assert functions == set(prefixes)
    for prefix in prefixes.values():
        assert prefix in covered


# ---------------------------------------------------------------- kl_penalized_reward's ref_logits


def test_kl_penalized_reward_names_ref_logits_on_a_shape_mismatch() -> None:
    with pytest.raises(ValueError, match=r"\bref_logits must have shape \(2, 3, 5\)"):
        kl_penalized_reward(LOGITS, LOGITS[..., :4], LP)


def test_kl_penalized_reward_names_ref_logits_on_a_wrong_type() -> None:
    with pytest.raises(TypeError, match=r"\bref_logits must be a torch.Tensor, got list"):
        kl_penalized_reward(LOGITS, [[0.0]], LP)  # type: ignore[arg-type]


def test_kl_penalized_reward_rejects_bad_ref_logits() -> None:
    # whatever the name, the error is a readable ValueError/TypeError about the reference
    with pytest.raises(ValueError, match=r"ref.*logits must have shape \(2, 3, 5\).*\(2, 3, 4\)"):
        kl_penalized_reward(LOGITS, LOGITS[..., :4], LP)
    with pytest.raises(TypeError, match=r"ref.*logits must be a torch.Tensor, got list"):
        kl_penalized_reward(LOGITS, [[0.0]], LP)  # type: ignore[arg-type]


# ---------------------------------------------------------------- valid edge cases


def test_valid_edge_cases_give_finite_documented_results() -> None:
    empty3, empty2 = torch.zeros(0, 3, 5), torch.zeros(0, 3)
    no_tokens = torch.zeros(0, 3, dtype=torch.int32)
    assert get_logprobs_for_tokens(empty3, no_tokens).shape == (0, 3)
    assert full_kl(empty3, empty3).shape == (0, 3)
    assert kl_penalized_reward(empty3, empty3, empty2).shape == (0, 3)
    assert calculate_kl_penalty(empty3, empty3, no_tokens, 0.1).shape == (0, 3)
    assert estimate_kl(empty2, empty2, "k3").shape == (0, 3)
    assert compute_token_kl(empty2, empty2, empty2)[1].shape == (0,)
    assert masked_mean(empty2, empty2, dim=-1).shape == (0,)
    assert shape_rewards(torch.zeros(0), empty2, empty2, 0.1).shape == (0, 3)
    all_masked = torch.zeros(2, 3, dtype=torch.bool)
    for value in (
        masked_mean(LP, all_masked).item(),
        aggregate(LP, all_masked, "seq-mean-token-mean").item(),
        compute_rlhf_objective(LOGITS, LOGITS, TOKENS, SCORES, all_masked, 0.1)["mean_kl"],
    ):
        assert value == 0.0
    # coefficients of exactly 0 are valid and give the unpenalised quantity
    assert kl_penalty([-1.0], [-3.0], 0) == 0.0
    assert torch.equal(calculate_kl_penalty(LOGP, LOGP.flip(-1), TOKENS, 0.0), torch.zeros(2, 3))


# ---------------------------------------------------------------- fuzz: never a bare torch error


def junk() -> st.SearchStrategy[Any]:
    return st.sampled_from(
        [
            None,
            0.5,
            -1,
            "x",
            [1.0, 2.0],
            np.zeros(3),
            torch.tensor(1.0),
            torch.tensor([1.0]),
            torch.zeros(2, 3),
            torch.zeros(3, 2),
            torch.zeros(2, 3, 5),
            torch.zeros(2, 3, 4),
            torch.zeros(2, 3, dtype=torch.long),
            torch.full((2, 3), 7, dtype=torch.long),
            torch.ones(2, 3, dtype=torch.bool),
            torch.full((2, 3), NAN),
            torch.zeros(0, 3),
            torch.zeros(2),
            torch.zeros(2, 3, 5, dtype=torch.long),
            torch.zeros(2, 3, dtype=torch.complex64),
            torch.zeros(2, 3, 0),
        ]
    )


VALID_ARGS: dict[str, tuple[Callable[..., object], tuple[object, ...]]] = {
    "kl_penalty": (kl_penalty, ([-1.0, -2.0, -3.0], [-1.0, -1.0, -1.0], 0.1)),
    "estimate_kl": (estimate_kl, (LP, LP, "k3")),
    "compute_token_kl": (compute_token_kl, (LP, LP, MASK)),
    "get_logprobs_for_tokens": (get_logprobs_for_tokens, (LOGITS, TOKENS)),
    "calculate_kl_penalty": (calculate_kl_penalty, (LOGP, LOGP, TOKENS, 0.1)),
    "full_kl": (full_kl, (LOGITS, LOGITS)),
    "kl_penalized_reward": (kl_penalized_reward, (LOGITS, LOGITS, LP, 0.1)),
    "masked_sum": (masked_sum, (LP, MASK, -1)),
    "masked_mean": (masked_mean, (LP, MASK, 0)),
    "aggregate": (aggregate, (LP, MASK, "token-mean")),
    "shape_rewards": (shape_rewards, (SCORES, LP, MASK, 0.1)),
    "compute_rlhf_objective": (compute_rlhf_objective, (LOGITS, LOGITS, TOKENS, SCORES, MASK, 0.1)),
    "response_mask": (klpen.response_mask, (TOKENS, 2)),
    "token_entropy": (token_entropy, (LOGITS,)),
    "logprobs_and_entropy": (logprobs_and_entropy, (LOGITS, TOKENS)),
    "next_token_logprobs": (next_token_logprobs, (LOGITS, TOKENS)),
}


@pytest.mark.parametrize("name", VALID_ARGS)
@given(data=st.data())
def test_junk_arguments_raise_only_type_or_value_errors(name: str, data: st.DataObject) -> None:
    fn, valid = VALID_ARGS[name]
    args = list(valid)
    # replace one or two arguments with junk, keep the rest valid
    for i in data.draw(st.sets(st.integers(0, len(args) - 1), min_size=1, max_size=2)):
        args[i] = data.draw(junk())
    try:
        fn(*args)
    except (TypeError, ValueError) as err:
        assert str(err), "an error with an empty message"
        assert type(err) in (TypeError, ValueError), f"a {type(err).__name__}: {err}"


# ================================================================ the matrix
#
# Every public function × each of its arguments × every tensor kind klpen does not compute
# with, and every extreme value: the expected exception type and a message fragment that names
# the argument. Rows are generated from one table of valid calls, so a new argument or function
# is covered by adding it there.

LP2 = torch.full((2, 3), -2.0)
SPEC_MASK = MASK.bool()


@dataclass(frozen=True)
class Spec:
    """A valid call and the role of each argument that the matrix varies."""

    call: Callable[..., object]
    valid: dict[str, object]
    roles: dict[str, str]  # float | ids | mask | coef | number | array | int
    masked: tuple[str, ...] = ()  # float arguments covered by the mask (poison allowed there)


def _ctor(cls: type, **fixed: object) -> Callable[..., object]:
    return lambda **kw: cls(**fixed, **kw)


def _update(make: Callable[[], klpen.KLController]) -> Callable[..., object]:
    return lambda current_kl: make().update(current_kl)


SPECS: dict[str, Spec] = {
    "kl_penalty": Spec(
        kl_penalty,
        {"logp_policy": [-1.0, -2.0], "logp_reference": [-1.5, -2.5], "beta": 0.1},
        {"logp_policy": "array", "logp_reference": "array", "beta": "coef"},
    ),
    "estimate_kl": Spec(
        estimate_kl,
        {
            "policy_logprobs": LP,
            "reference_logprobs": LP2,
            "estimator": "k3",
            "mask": SPEC_MASK,
            "behavior_logprobs": LP,
        },
        {
            "policy_logprobs": "float",
            "reference_logprobs": "float",
            "mask": "mask",
            "behavior_logprobs": "float",
            "clamp": "coef",
        },
        masked=("policy_logprobs", "reference_logprobs", "behavior_logprobs"),
    ),
    "compute_token_kl": Spec(
        compute_token_kl,
        {"policy_logprobs": LP, "reference_logprobs": LP2, "attention_mask": SPEC_MASK},
        {"policy_logprobs": "float", "reference_logprobs": "float", "attention_mask": "mask"},
        masked=("policy_logprobs", "reference_logprobs"),
    ),
    "get_logprobs_for_tokens": Spec(
        get_logprobs_for_tokens,
        {"logits": LOGITS, "tokens": TOKENS},
        {"logits": "float", "tokens": "ids"},
    ),
    "calculate_kl_penalty": Spec(
        calculate_kl_penalty,
        {"log_probs_rl": LOGP, "log_probs_sft": LOGP.flip(-1), "actions": TOKENS, "beta": 0.1},
        {"log_probs_rl": "float", "log_probs_sft": "float", "actions": "ids", "beta": "coef"},
    ),
    "full_kl": Spec(
        full_kl,
        {"policy_logits": LOGITS, "reference_logits": LOGP},
        {"policy_logits": "float", "reference_logits": "float"},
    ),
    "kl_penalized_reward": Spec(
        kl_penalized_reward,
        {"policy_logits": LOGITS, "ref_logits": LOGP, "reward": LP, "beta": 0.1},
        {"policy_logits": "float", "ref_logits": "float", "reward": "float", "beta": "coef"},
    ),
    "masked_sum": Spec(
        masked_sum,
        {"values": LP, "mask": SPEC_MASK},
        {"values": "float", "mask": "mask"},
        masked=("values",),
    ),
    "masked_mean": Spec(
        masked_mean,
        {"values": LP, "mask": SPEC_MASK, "dim": -1},
        {"values": "float", "mask": "mask"},
        masked=("values",),
    ),
    "aggregate": Spec(
        aggregate,
        {"values": LP, "mask": SPEC_MASK, "mode": "seq-mean-token-mean"},
        {"values": "float", "mask": "mask"},
        masked=("values",),
    ),
    "shape_rewards": Spec(
        shape_rewards,
        {"scores": SCORES, "per_token_kl": LP, "mask": SPEC_MASK, "kl_coef": 0.1},
        {"scores": "float", "per_token_kl": "float", "mask": "mask", "kl_coef": "coef"},
        masked=("per_token_kl",),
    ),
    "compute_rlhf_objective": Spec(
        compute_rlhf_objective,
        {
            "policy_logits": LOGITS,
            "reference_logits": LOGP,
            "response_tokens": TOKENS,
            "rewards": SCORES,
            "attention_mask": SPEC_MASK,
            "kl_coef": 0.1,
        },
        {
            "policy_logits": "float",
            "reference_logits": "float",
            "response_tokens": "ids",
            "rewards": "float",
            "attention_mask": "mask",
            "kl_coef": "coef",
        },
    ),
    "response_mask": Spec(
        klpen.response_mask,
        {"tokens": TOKENS, "eos_token_id": 2},
        {"tokens": "ids", "eos_token_id": "int"},
    ),
    "generalized_jsd": Spec(
        klpen.generalized_jsd,
        {"student_logits": LOGITS, "teacher_logits": LOGP, "beta": 0.3},
        {"student_logits": "float", "teacher_logits": "float", "beta": "coef"},
    ),
    "linear_generalized_jsd": Spec(
        klpen.linear_generalized_jsd,
        {
            "student_hidden": torch.ones(2, 3, 4),
            "student_weight": torch.eye(5, 4),
            "teacher_hidden": torch.zeros(2, 3, 2),
            "teacher_weight": torch.ones(5, 2),
        },
        {
            "student_hidden": "float",
            "student_weight": "float",
            "teacher_hidden": "float",
            "teacher_weight": "float",
        },
    ),
    "linear_generalized_jsd-aggregated": Spec(
        lambda **kw: klpen.linear_generalized_jsd(**kw, aggregation="token-mean"),
        {
            "student_hidden": torch.ones(2, 3, 4),
            "student_weight": torch.eye(5, 4),
            "teacher_hidden": torch.zeros(2, 3, 2),
            "teacher_weight": torch.ones(5, 2),
            "mask": SPEC_MASK,
        },
        {
            "student_hidden": "float",
            "student_weight": "float",
            "teacher_hidden": "float",
            "teacher_weight": "float",
            "mask": "mask",
        },
        masked=("student_hidden", "teacher_hidden"),
    ),
    "topk_kl": Spec(
        lambda **kw: klpen.topk_kl(**kw).estimate,
        {
            "student_logits": LOGITS,
            "teacher_topk_ids": TEACHER_IDS,
            "teacher_topk_logprobs": TEACHER_LP,
        },
        {"student_logits": "float", "teacher_topk_ids": "ids", "teacher_topk_logprobs": "float"},
    ),
    "distillation_rewards": Spec(
        klpen.distillation_rewards,
        {"student_logprobs": LP, "teacher_logprobs": LP2, "mask": SPEC_MASK, "kl_coef": 0.5},
        {
            "student_logprobs": "float",
            "teacher_logprobs": "float",
            "mask": "mask",
            "kl_coef": "coef",
        },
        masked=("student_logprobs", "teacher_logprobs"),
    ),
    "FixedKLController": Spec(
        _ctor(klpen.FixedKLController), {"kl_coef": 0.1}, {"kl_coef": "coef"}
    ),
    "DoublingKLController": Spec(
        _ctor(klpen.DoublingKLController),
        {"init_kl_coef": 0.1, "target_kl": 6.0},
        {"init_kl_coef": "coef", "target_kl": "coef"},
    ),
    "AdaptiveKLController": Spec(
        _ctor(klpen.AdaptiveKLController),
        {"init_kl_coef": 0.1, "target_kl": 6.0, "horizon": 100},
        {"init_kl_coef": "coef", "target_kl": "coef", "horizon": "coef"},
    ),
    **{
        f"{cls.__name__}.update": Spec(_update(make), {"current_kl": 3.0}, {"current_kl": "number"})
        for cls, make in (
            (klpen.FixedKLController, lambda: klpen.FixedKLController(0.1)),
            (klpen.DoublingKLController, klpen.DoublingKLController),
            (klpen.AdaptiveKLController, lambda: klpen.AdaptiveKLController(0.1, 6.0, 100)),
        )
    },
}


def _nested(t: torch.Tensor) -> torch.Tensor:
    return torch.nested.nested_tensor(list(t))


#: kind -> (make it from a valid tensor, message fragment, applies to (tensor, role))
KINDS: dict[str, tuple[Callable[[torch.Tensor], object], str, Callable[[torch.Tensor, str], bool]]]
KINDS = {
    "meta": (lambda t: t.to("meta"), "meta", lambda t, r: True),
    "sparse_coo": (lambda t: t.to_sparse(), "sparse", lambda t, r: t.dim() >= 1),
    "sparse_csr": (lambda t: t.to_sparse_csr(), "sparse_csr", lambda t, r: t.dim() == 2),
    "mkldnn": (
        lambda t: t.float().to_mkldnn(),
        "mkldnn",
        lambda t, r: r == "float" and torch.backends.mkldnn.is_available(),
    ),
    "nested": (_nested, "nested", lambda t, r: t.dim() >= 2),
    "complex": (lambda t: t.to(torch.complex64), "complex", lambda t, r: True),
    "float8": (lambda t: t.to(torch.float8_e4m3fn), "float8", lambda t, r: True),
    "uint16": (lambda t: t.to(torch.uint16), "uint16", lambda t, r: r != "array"),
    "uint32": (lambda t: t.to(torch.uint32), "uint32", lambda t, r: r == "ids"),
    "uint64": (lambda t: t.to(torch.uint64), "uint64", lambda t, r: r == "ids"),
    "list": (lambda t: t.tolist(), "list", lambda t, r: r != "array"),
}


def _as_tensor(value: object) -> torch.Tensor:
    return value if isinstance(value, torch.Tensor) else torch.tensor(value)


KIND_ROWS = [
    (fn, arg, kind)
    for fn, spec in SPECS.items()
    for arg, role in spec.roles.items()
    if role in ("float", "ids", "mask", "array") and arg in spec.valid
    for kind, (_, _, applies) in KINDS.items()
    if applies(_as_tensor(spec.valid[arg]), role)
] + [
    # numbers given as tensors of a kind klpen cannot read
    (fn, arg, kind)
    for fn, spec in SPECS.items()
    for arg, role in spec.roles.items()
    if role in ("coef", "number") and arg in spec.valid
    for kind in ("meta", "complex", "sparse_coo")
]


def _call(spec: Spec, **override: object) -> object:
    return spec.call(**{**spec.valid, **override})


@pytest.mark.parametrize(("fn", "arg", "kind"), KIND_ROWS, ids=["-".join(r) for r in KIND_ROWS])
def test_matrix_unsupported_tensor_kinds_are_refused_by_name(fn: str, arg: str, kind: str) -> None:
    spec = SPECS[fn]
    make, fragment, _ = KINDS[kind]
    base = spec.valid[arg]
    tensor = torch.tensor(float(base)) if isinstance(base, int | float) else _as_tensor(base)
    with warnings.catch_warnings():  # constructing nested / CSR tensors warns (beta APIs)
        warnings.simplefilter("ignore")
        bad = make(tensor)
    with pytest.raises(TypeError, match=rf"\b{re.escape(arg)}\b.*{fragment}"):
        _call(spec, **{arg: bad})


def _at(value: object, index: tuple[int, ...], x: float) -> torch.Tensor:
    t = _as_tensor(value).clone()
    t[index] = x
    return t


def _first(value: object, valid: bool) -> tuple[int, ...]:
    """Index of the first valid (or masked-out) position, trailing vocabulary axis at 0."""
    t = _as_tensor(value)
    where = SPEC_MASK if valid else ~SPEC_MASK
    lead = tuple(int(i) for i in where.nonzero()[0])
    return (lead + (0,) * t.dim())[: t.dim()] if t.dim() >= 2 else lead[1:2] or (0,)


FLOAT_ROWS = [
    (fn, arg)
    for fn, spec in SPECS.items()
    for arg, role in spec.roles.items()
    if role == "float" and arg in spec.valid
]


@pytest.mark.parametrize(("fn", "arg"), FLOAT_ROWS)
def test_matrix_nan_at_a_valid_position_raises_naming_the_argument(fn: str, arg: str) -> None:
    spec = SPECS[fn]
    index = _first(spec.valid[arg], valid=True)
    with pytest.raises(ValueError, match=rf"\b{re.escape(arg)}\b.*NaN|NaN.*\b{re.escape(arg)}\b"):
        _call(spec, **{arg: _at(spec.valid[arg], index, NAN)})


MASKED_ROWS = [
    (fn, arg, x)
    for fn, spec in SPECS.items()
    for arg in spec.masked
    for x in (NAN, INF, -INF, 1e30, -1e30)
]


@pytest.mark.parametrize(
    ("fn", "arg", "x"), MASKED_ROWS, ids=[f"{f}-{a}-{x}" for f, a, x in MASKED_ROWS]
)
def test_matrix_anything_at_a_masked_position_is_ignored(fn: str, arg: str, x: float) -> None:
    spec = SPECS[fn]
    index = _first(spec.valid[arg], valid=False)
    clean = _call(spec)
    dirty = _call(spec, **{arg: _at(spec.valid[arg], index, x)})
    if isinstance(clean, tuple):
        assert all(torch.equal(a, b) for a, b in zip(dirty, clean, strict=True))  # type: ignore[arg-type]
    else:
        assert torch.equal(dirty, clean)  # type: ignore[arg-type]


# (topk_kl's teacher_topk_logprobs at -1e30: a probability 0 among the top k, which leaves the
# rest of the teacher's mass nowhere to go: a contradiction, refused by name, not a NaN)
HUGE_ROWS = [r for r in FLOAT_ROWS if r != ("topk_kl", "teacher_topk_logprobs")] + [
    (fn, arg)
    for fn, spec in SPECS.items()
    for arg, role in spec.roles.items()
    if role in ("number", "array")
]


@pytest.mark.parametrize(("fn", "arg"), HUGE_ROWS, ids=["-".join(r) for r in HUGE_ROWS])
def test_matrix_1e30_at_a_valid_position_never_gives_nan(fn: str, arg: str) -> None:
    spec = SPECS[fn]
    value = spec.valid[arg]
    role = spec.roles[arg]
    if role == "number":
        bad: object = 1e30
    elif role == "array":
        bad = [-1e30, *list(value)[1:]]  # type: ignore[call-overload]
    else:
        bad = _at(value, _first(value, valid=True), -1e30)
    out = _call(spec, **{arg: bad})
    values = out.values() if isinstance(out, dict) else out if isinstance(out, tuple) else [out]
    for v in values:
        if isinstance(v, torch.Tensor):
            assert not v.isnan().any()
        elif isinstance(v, float):
            assert not math.isnan(v)


BIG_INT_ROWS = [
    (fn, arg)
    for fn, spec in SPECS.items()
    for arg, role in spec.roles.items()
    if role in ("coef", "number", "array", "int")
]


@pytest.mark.parametrize(("fn", "arg"), BIG_INT_ROWS, ids=["-".join(r) for r in BIG_INT_ROWS])
def test_matrix_numbers_that_do_not_fit_are_refused_by_name(fn: str, arg: str) -> None:
    spec = SPECS[fn]
    role = spec.roles[arg]
    bad: object = [10**400, -1.0] if role == "array" else 10**400
    with pytest.raises(ValueError, match=rf"\b{re.escape(arg)}\b.*(fit|int64)"):
        _call(spec, **{arg: bad})
