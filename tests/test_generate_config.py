"""sampler_logprobs(generation_config=...) against ``generate(do_sample=True)`` itself.

The reference is the processed scores that ``generate(..., output_scores=True)`` returns for a
tiny Llama built from a config (no download): log_softmax of them at the sampled tokens is the
log-prob of the distribution generate sampled from. One row of the table per field and per
combination; the table's measured differences are printed (``-s``) for the report.
"""

from __future__ import annotations

import math

import pytest
import torch

from klpen import sampler_logprobs
from klpen.sampling import GENERATE_DEFAULTS, UNSUPPORTED_FIELDS

transformers = pytest.importorskip("transformers")

VOCAB = 64

CONFIGS: dict[str, dict[str, object]] = {
    "defaults (top_k 50)": {},
    "temperature": {"temperature": 0.7},
    "top_k": {"top_k": 7},
    "top_k 0 (off)": {"top_k": 0},
    "top_p": {"top_p": 0.8},
    "min_p": {"min_p": 0.2},
    "typical_p": {"typical_p": 0.6},
    "epsilon_cutoff": {"epsilon_cutoff": 0.02},
    "eta_cutoff": {"eta_cutoff": 0.05},
    "repetition_penalty": {"repetition_penalty": 1.8},
    "temperature+top_p (top_k 50)": {"temperature": 1.3, "top_p": 0.9},
    "top_k+top_p+temperature": {"temperature": 0.6, "top_k": 20, "top_p": 0.9},
    "min_p+typical_p": {"min_p": 0.05, "typical_p": 0.9, "top_k": 0},
    "eps+eta+temperature": {"epsilon_cutoff": 0.01, "eta_cutoff": 0.02, "temperature": 1.5},
    "everything": {
        "temperature": 0.8,
        "top_k": 30,
        "top_p": 0.95,
        "min_p": 0.02,
        "typical_p": 0.97,
        "epsilon_cutoff": 0.001,
        "eta_cutoff": 0.002,
        "repetition_penalty": 1.3,
    },
}

RESULTS: dict[str, float] = {}


def tiny_llama() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=None,
    )
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # sharper logits than the init's, so that every cut binds
        model.lm_head.weight.mul_(40.0)
    return model


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return tiny_llama()


def generate(model: torch.nn.Module, fields: dict[str, object], left_pad: bool = False) -> tuple:
    prompt = torch.randint(2, VOCAB, (3, 5), generator=torch.Generator().manual_seed(3))
    attention = torch.ones_like(prompt)
    if left_pad:
        prompt[0, :2] = 0
        attention[0, :2] = 0
    config = transformers.GenerationConfig(do_sample=True, max_new_tokens=14, **fields)
    torch.manual_seed(11)
    out = model.generate(
        prompt,
        attention_mask=attention,
        generation_config=config,
        output_scores=True,
        output_logits=True,
        return_dict_in_generate=True,
    )
    new = out.sequences[:, prompt.shape[1] :]
    raw = torch.stack(out.logits, dim=1)
    scores = torch.stack(out.scores, dim=1)
    reference = scores.log_softmax(-1).gather(-1, new[..., None]).squeeze(-1)
    full_mask = torch.cat([attention, torch.ones_like(new)], dim=1)
    return config, out.sequences, new, raw, scores, reference, full_mask


@pytest.mark.parametrize("label", list(CONFIGS))
def test_equals_generate_for_each_field_and_combination(model: torch.nn.Module, label: str) -> None:
    fields = CONFIGS[label]
    config, sequences, new, raw, scores, reference, full_mask = generate(model, fields)
    ours, log_kept = sampler_logprobs(
        raw, new, generation_config=config, input_ids=sequences, mask=full_mask
    )
    assert bool(torch.isfinite(reference).all())
    diff = float((ours - reference).abs().max())
    RESULTS[label] = diff
    print(f"\n{label:32s} max |Δ| = {diff:.2e}")
    assert diff < 1e-6
    # The kept mass: the share of softmax(processed / T) generate left finite, against
    # generate's own scores (a dict of the same fields gives the same numbers).
    assert torch.equal(
        ours,
        sampler_logprobs(
            raw, new, generation_config=dict(fields), input_ids=sequences, mask=full_mask
        )[0],
    )
    assert bool((log_kept <= 1e-6).all())
    kept_set = torch.isfinite(scores)
    # kept_mask = the set generate used: the same log-probs, whatever the cut fields say.
    from_mask, _ = sampler_logprobs(
        raw,
        new,
        generation_config=config,
        input_ids=sequences,
        mask=full_mask,
        kept_mask=kept_set,
    )
    assert float((from_mask - reference).abs().max()) < 1e-6


def test_every_field_is_a_real_cut(model: torch.nn.Module) -> None:
    # A row that cut nothing could not tell a wrong cut from a right one.
    for label in ("top_k", "top_p", "min_p", "typical_p", "epsilon_cutoff", "eta_cutoff"):
        *_, scores, _, _ = generate(model, CONFIGS[label])
        assert bool((~torch.isfinite(scores)).any()), label


def test_repetition_penalty_sees_left_padding_as_generate_does(model: torch.nn.Module) -> None:
    fields = {"repetition_penalty": 2.5, "top_k": 0}
    config, sequences, new, raw, _, reference, full_mask = generate(model, fields, left_pad=True)
    ours, _ = sampler_logprobs(
        raw, new, generation_config=config, input_ids=sequences, mask=full_mask
    )
    assert float((ours - reference).abs().max()) < 1e-6
    # Without the mask, the pad id 0 of row 0 counts as context: a different distribution.
    unmasked, _ = sampler_logprobs(raw, new, generation_config=config, input_ids=sequences)
    assert torch.equal(unmasked[1:], ours[1:])


def test_repetition_penalty_gradient_against_autograd_of_the_processor(
    model: torch.nn.Module,
) -> None:
    from transformers.generation.logits_process import (
        RepetitionPenaltyLogitsProcessor,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
    )

    config, sequences, new, raw, *_ = generate(
        model, {"repetition_penalty": 1.7, "top_k": 9, "temperature": 0.9}
    )
    z = raw.double().requires_grad_()
    ours, log_kept = sampler_logprobs(z, new, generation_config=config, input_ids=sequences)
    (ours.sum() + 0.3 * log_kept.sum()).backward()
    prompt = sequences.shape[1] - new.shape[1]
    zr = raw.double().requires_grad_()
    total = torch.zeros((), dtype=torch.float64)
    for t in range(new.shape[1]):
        s = RepetitionPenaltyLogitsProcessor(1.7)(sequences[:, : prompt + t], zr[:, t])
        s = TemperatureLogitsWarper(0.9)(None, s)
        kept = TopKLogitsWarper(9)(None, s)
        lp = kept.log_softmax(-1).gather(-1, new[:, t, None]).squeeze(-1)
        ls = kept.logsumexp(-1) - s.logsumexp(-1)
        total = total + lp.sum() + 0.3 * ls.sum()
    total.backward()
    torch.testing.assert_close(z.grad, zr.grad, rtol=1e-9, atol=1e-12)


def test_defaults_are_generates() -> None:
    defaults = transformers.GenerationConfig._get_default_generation_params()
    for name, value in GENERATE_DEFAULTS.items():
        assert defaults[name] == value, name
    # A field the table calls unsupported is inactive at generate's default.
    for name, inactive in UNSUPPORTED_FIELDS.items():
        assert inactive(defaults.get(name)), name


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"no_repeat_ngram_size": 2}, "no_repeat_ngram_size"),
        ({"bad_words_ids": [[3]]}, "bad_words_ids"),
        ({"suppress_tokens": [4]}, "suppress_tokens"),
        ({"begin_suppress_tokens": [4]}, "begin_suppress_tokens"),
        ({"min_new_tokens": 3}, "min_new_tokens"),
        ({"num_beams": 2}, "num_beams"),
        ({"sequence_bias": {(3,): 1.0}}, "sequence_bias"),
        ({"logits_processor": [object()]}, "logits_processor"),
        ({"top_h": 0.5}, "top_h"),
    ],
)
def test_unsupported_fields_raise_naming_them(fields: dict[str, object], named: str) -> None:
    z, tok = torch.randn(2, 3, VOCAB), torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match=named):
        sampler_logprobs(z, tok, generation_config=fields)
    if named not in ("logits_processor", "sequence_bias"):
        with pytest.raises(ValueError, match=named):
            sampler_logprobs(z, tok, generation_config=transformers.GenerationConfig(**fields))


def test_bad_combinations_raise() -> None:
    z, tok = torch.randn(2, 3, VOCAB), torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="not both"):
        sampler_logprobs(z, tok, top_p=0.9, generation_config={})
    with pytest.raises(ValueError, match="not both"):
        sampler_logprobs(z, tok, temperature=0.5, generation_config={})
    with pytest.raises(ValueError, match="input_ids"):
        sampler_logprobs(z, tok, generation_config={"repetition_penalty": 1.2})
    with pytest.raises(ValueError, match="input_ids must have shape"):
        sampler_logprobs(
            z, tok, generation_config={}, input_ids=torch.zeros(2, 2, dtype=torch.long)
        )
    with pytest.raises(ValueError, match="input_ids must lie in"):
        sampler_logprobs(z, tok, generation_config={}, input_ids=torch.full((2, 4), VOCAB))
    with pytest.raises(ValueError, match="kept_mask replaces"):
        sampler_logprobs(z, tok, top_k=3, kept_mask=torch.ones(2, 3, VOCAB, dtype=torch.bool))
    with pytest.raises(TypeError, match="kept_mask must be a bool"):
        sampler_logprobs(z, tok, kept_mask=torch.ones(2, 3, VOCAB))
    with pytest.raises(ValueError, match="kept_mask must have shape"):
        sampler_logprobs(z, tok, kept_mask=torch.ones(2, 3, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match="kept set is empty"):
        sampler_logprobs(z, tok, kept_mask=torch.zeros(2, 3, VOCAB, dtype=torch.bool))
    with pytest.raises(TypeError, match="generation_config must be"):
        sampler_logprobs(z, tok, generation_config=3)
    with pytest.raises(ValueError, match="top_k=0 as no cut"):
        sampler_logprobs(z, tok, top_k=0)


def test_keyword_form_misses_generates_top_k_default(model: torch.nn.Module) -> None:
    # The issue-20 failure: generate(top_p=0.9) also cut to top_k=50; the keywords do not.
    _, _, new, raw, scores, reference, _ = generate(model, {"top_p": 0.99})
    assert bool((~torch.isfinite(scores)).any())
    keywords, _ = sampler_logprobs(raw, new, top_p=0.99)
    with_default, _ = sampler_logprobs(raw, new, top_p=0.99, top_k=50)
    assert float((with_default - reference).abs().max()) < 1e-6
    assert float((keywords - reference).abs().max()) > 1e-4
    assert math.isfinite(float(keywords.sum()))
