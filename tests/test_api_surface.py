"""The public surface: every contract name importable from ``klpen``, typed, and light."""

from __future__ import annotations

import importlib.resources
import inspect
import subprocess
import sys
from pathlib import Path

import pytest

import klpen

# CONTRACT.md sections 1 and 2, by name (klpen.distributed is a submodule, checked below)
CONTRACT_NAMES = [
    "kl_penalty",
    "compute_token_kl",
    "get_logprobs_for_tokens",
    "AdaptiveKLController",
    "compute_rlhf_objective",
    "kl_penalized_reward",
    "calculate_kl_penalty",
    "estimate_kl",
    "full_kl",
    "masked_sum",
    "masked_mean",
    "aggregate",
    "FixedKLController",
    "DoublingKLController",
    "shape_rewards",
    "response_mask",
    # section 10
    "generalized_jsd",
    "linear_generalized_jsd",
    "topk_kl",
    "TopKKL",
    "distillation_rewards",
]

# the seed-compatible signatures: names and order of the arguments a reader calls them with
SIGNATURES = {
    "kl_penalty": ["logp_policy", "logp_reference", "beta"],
    "compute_token_kl": ["policy_logprobs", "reference_logprobs", "attention_mask"],
    "get_logprobs_for_tokens": ["logits", "tokens", "temperature"],
    "AdaptiveKLController": ["init_kl_coef", "target_kl", "horizon"],
    "DoublingKLController": ["init_kl_coef", "target_kl"],
    "compute_rlhf_objective": [
        "policy_logits",
        "reference_logits",
        "response_tokens",
        "rewards",
        "attention_mask",
        "kl_coef",
    ],
    "kl_penalized_reward": ["policy_logits", "ref_logits", "reward", "beta"],
    "calculate_kl_penalty": ["log_probs_rl", "log_probs_sft", "actions", "beta"],
    "estimate_kl": [
        "policy_logprobs",
        "reference_logprobs",
        "estimator",
        "clamp",
        "mask",
        "behavior_logprobs",
    ],
    "full_kl": ["policy_logits", "reference_logits", "temperature"],
    "masked_sum": ["values", "mask", "dim"],
    "masked_mean": ["values", "mask", "dim"],
    "aggregate": ["values", "mask", "mode", "sequence_ids", "max_length", "num_sequences"],
    "FixedKLController": ["kl_coef"],
    "shape_rewards": ["scores", "per_token_kl", "mask", "kl_coef", "sequence_ids"],
    "response_mask": ["tokens", "eos_token_id", "include_eos", "position_ids", "cu_seqlens"],
    "generalized_jsd": ["student_logits", "teacher_logits", "beta", "temperature", "vocab_size"],
    "linear_generalized_jsd": [
        "student_hidden",
        "student_weight",
        "teacher_hidden",
        "teacher_weight",
        "beta",
        "temperature",
        "student_bias",
        "teacher_bias",
        "vocab_size",
        "aggregation",
        "mask",
        "sequence_ids",
    ],
    "topk_kl": [
        "student_logits",
        "teacher_topk_ids",
        "teacher_topk_logprobs",
        "direction",
        "temperature",
    ],
    "distillation_rewards": [
        "student_logprobs",
        "teacher_logprobs",
        "mask",
        "kl_coef",
        "sequence_ids",
    ],
}

# arguments that must be passed by keyword (everything after the contract's positional ones)
KEYWORD_ONLY = {
    "get_logprobs_for_tokens": {"temperature"},
    "full_kl": {"temperature"},
    "estimate_kl": {"clamp", "mask", "behavior_logprobs"},
    "response_mask": {"include_eos", "position_ids", "cu_seqlens"},
    "aggregate": {"sequence_ids", "max_length", "num_sequences"},
    "shape_rewards": {"sequence_ids"},
    "generalized_jsd": {"beta", "temperature", "vocab_size"},
    "linear_generalized_jsd": {
        "beta",
        "temperature",
        "student_bias",
        "teacher_bias",
        "vocab_size",
        "aggregation",
        "mask",
        "sequence_ids",
    },
    "topk_kl": {"direction", "temperature"},
    "distillation_rewards": {"kl_coef", "sequence_ids"},
}

DEFAULTS = {
    ("compute_token_kl", "attention_mask"): None,
    ("DoublingKLController", "init_kl_coef"): 0.1,
    ("DoublingKLController", "target_kl"): 6.0,
    ("AdaptiveKLController", "init_kl_coef"): inspect.Parameter.empty,
    ("AdaptiveKLController", "target_kl"): inspect.Parameter.empty,
    ("AdaptiveKLController", "horizon"): inspect.Parameter.empty,
    ("kl_penalized_reward", "beta"): 0.1,
    ("estimate_kl", "estimator"): "k1",
    ("estimate_kl", "clamp"): None,
    ("estimate_kl", "behavior_logprobs"): None,
    ("response_mask", "include_eos"): True,
    ("response_mask", "position_ids"): None,
    ("response_mask", "cu_seqlens"): None,
    ("aggregate", "sequence_ids"): None,
    ("aggregate", "max_length"): None,
    ("aggregate", "num_sequences"): None,
    ("shape_rewards", "sequence_ids"): None,
    ("get_logprobs_for_tokens", "temperature"): 1.0,
    ("full_kl", "temperature"): 1.0,
    ("masked_sum", "dim"): None,
    ("masked_mean", "dim"): None,
    ("generalized_jsd", "beta"): 0.5,
    ("generalized_jsd", "temperature"): 1.0,
    ("generalized_jsd", "vocab_size"): None,
    ("linear_generalized_jsd", "beta"): 0.5,
    ("linear_generalized_jsd", "student_bias"): None,
    ("linear_generalized_jsd", "aggregation"): None,
    ("linear_generalized_jsd", "mask"): None,
    ("linear_generalized_jsd", "sequence_ids"): None,
    ("topk_kl", "direction"): "forward",
    ("distillation_rewards", "kl_coef"): 1.0,
}


@pytest.mark.parametrize("name", CONTRACT_NAMES)
def test_contract_name_is_exported(name: str) -> None:
    assert name in klpen.__all__
    obj = getattr(klpen, name)
    assert callable(obj)
    assert inspect.getdoc(obj), f"{name} has no docstring"


@pytest.mark.parametrize("name", SIGNATURES)
def test_seed_compatible_signature(name: str) -> None:
    params = inspect.signature(getattr(klpen, name)).parameters
    assert list(params) == SIGNATURES[name]
    for (fn, arg), default in DEFAULTS.items():
        if fn == name:
            assert params[arg].default == default
    for arg, param in params.items():
        keyword_only = param.kind is inspect.Parameter.KEYWORD_ONLY
        assert keyword_only == (arg in KEYWORD_ONLY.get(name, set())), (name, arg)


def test_removed_names_are_gone() -> None:
    # one rule, one name: the proportional rule is AdaptiveKLController
    assert not hasattr(klpen, "ProportionalKLController")
    assert "ProportionalKLController" not in klpen.__all__


NAMING_EXCEPTIONS = {
    # contract section 1 keeps the seeds' own argument names
    "kl_penalty",
    "compute_token_kl",
    "get_logprobs_for_tokens",
    "compute_rlhf_objective",
    "kl_penalized_reward",
    "calculate_kl_penalty",
    # contract section 10: `beta` is GKD's (TRL's) mixture weight, not a penalty coefficient
    "generalized_jsd",
    "linear_generalized_jsd",
}


@pytest.mark.parametrize("name", sorted(set(klpen.__all__) - NAMING_EXCEPTIONS - {"__version__"}))
def test_argument_names_follow_the_naming_rule(name: str) -> None:
    # outside section 1: a mask is `mask`, a coefficient `kl_coef` (or `init_kl_coef`)
    params = inspect.signature(getattr(klpen, name)).parameters
    for arg in params:
        assert arg not in {"attention_mask", "response_mask", "loss_mask", "beta"}, (name, arg)


def test_all_lists_only_real_attributes() -> None:
    for name in klpen.__all__:
        assert hasattr(klpen, name), name
    assert len(set(klpen.__all__)) == len(klpen.__all__), "a name listed twice"


def test_version_is_a_string() -> None:
    assert isinstance(klpen.__version__, str)
    parts = klpen.__version__.split(".")
    assert len(parts) >= 2 and all(p.isdigit() for p in parts[:2])


def test_py_typed_is_shipped() -> None:
    marker = importlib.resources.files("klpen") / "py.typed"
    assert marker.is_file()
    # and the build includes it in the wheel
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
    config = tomllib.loads(pyproject.read_text())
    assert "py.typed" in config["tool"]["setuptools"]["package-data"]["klpen"]


def test_distributed_submodule_has_its_contract_names() -> None:
    # A plain import: an import failure fails this test (it used to be turned into a skip).
    import klpen.distributed as distributed

    assert callable(distributed.vocab_parallel_logprobs)
    assert callable(distributed.vocab_parallel_full_kl)


def test_import_klpen_does_not_import_matplotlib() -> None:
    # A fresh interpreter: the test process itself may already have imported matplotlib.
    code = (
        "import sys, klpen\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in "
        "{'matplotlib', 'IPython', 'pandas', 'scipy'})\n"
        "print(','.join(heavy))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "", f"import klpen imported {result.stdout.strip()}"
    assert result.stderr == "", result.stderr  # and no warning on the way
