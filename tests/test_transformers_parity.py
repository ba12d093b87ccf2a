"""sampler_logprobs against Hugging Face transformers: its own warpers and ``generate``.

The reference is transformers' code itself (TemperatureLogitsWarper, TopKLogitsWarper,
TopPLogitsWarper, and the processed scores that ``generate`` returns), on random logits with
ties and on a small causal LM built from a config (no download).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from klpen import sampler_logprobs

transformers = pytest.importorskip("transformers")
from transformers.generation.logits_process import (  # noqa: E402
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

SETTINGS = [
    (1.0, None, None),
    (0.6, None, None),
    (1.7, None, None),
    (0.7, 10, None),
    (1.0, 1, None),
    (1.0, None, 0.8),
    (0.6, None, 0.95),
    (0.6, 20, 0.9),
    (1.3, 5, 0.3),
    (1.0, 3, 1.0),
]


def hf_logprobs(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
) -> torch.Tensor:
    """What generate samples from: its warpers in its order, then log_softmax, gathered."""
    scores = logits.reshape(-1, logits.shape[-1]).float()
    if temperature != 1.0:
        scores = TemperatureLogitsWarper(temperature)(None, scores)
    if top_k is not None:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p is not None and top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(None, scores)
    logp = scores.log_softmax(-1).gather(-1, tokens.reshape(-1, 1))
    return logp.view(tokens.shape)


def assert_same(ours: torch.Tensor, ref: torch.Tensor) -> None:
    # Same kept set (the same tokens are -inf), values equal to fp32 rounding.
    assert torch.equal(torch.isinf(ours), torch.isinf(ref))
    finite = torch.isfinite(ref)
    torch.testing.assert_close(ours[finite], ref[finite], rtol=1e-6, atol=2e-6)


def tied_logits(seed: int, shape: tuple[int, ...], vocab: int) -> torch.Tensor:
    """Logits rounded to a coarse grid: many exact ties, also at the top-k / top-p boundary."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, vocab, generator=g) * 2).round() / 2


@pytest.mark.parametrize(("temperature", "top_k", "top_p"), SETTINGS)
def test_matches_transformers_warpers_every_token(
    temperature: float, top_k: int | None, top_p: float | None
) -> None:
    # Every token of every row: the whole sampled distribution, not only a few entries.
    vocab = 40
    for logits in (
        torch.randn(6, vocab, generator=torch.Generator().manual_seed(1)) * 3,
        tied_logits(2, (6,), vocab),
    ):
        tokens = torch.arange(vocab).repeat(6, 1)
        wide = logits[:, None, :].expand(6, vocab, vocab)  # row i, position j scores token j
        ours, _ = sampler_logprobs(wide, tokens, temperature=temperature, top_k=top_k, top_p=top_p)
        assert_same(ours, hf_logprobs(wide, tokens, temperature, top_k, top_p))


@given(
    seed=st.integers(0, 2**31 - 1),
    temperature=st.sampled_from([0.3, 0.6, 1.0, 1.5]),
    top_k=st.one_of(st.none(), st.integers(1, 70)),
    top_p=st.one_of(st.none(), st.floats(0.05, 1.0)),
    ties=st.booleans(),
)
def test_matches_transformers_warpers_random(
    seed: int, temperature: float, top_k: int | None, top_p: float | None, ties: bool
) -> None:
    vocab = 64
    g = torch.Generator().manual_seed(seed)
    logits = tied_logits(seed, (3, 5), vocab) if ties else torch.randn(3, 5, vocab, generator=g)
    tokens = torch.randint(0, vocab, (3, 5), generator=g)
    ours, log_kept = sampler_logprobs(
        logits, tokens, temperature=temperature, top_k=top_k, top_p=top_p
    )
    assert_same(ours, hf_logprobs(logits, tokens, temperature, top_k, top_p))
    # log S against an independent float64 sum of the full softmax over the HF kept set.
    flat = logits.reshape(-1, vocab)
    scores = flat / temperature if temperature != 1.0 else flat
    if top_k is not None:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p is not None and top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(None, scores)
    probs = torch.softmax(flat.double() / temperature, -1)
    kept_mass = torch.where(torch.isfinite(scores), probs, 0.0).sum(-1)
    torch.testing.assert_close(log_kept.double().reshape(-1), kept_mass.log(), rtol=0, atol=1e-5)


def tiny_lm() -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=1,
        n_embd=32,
        n_head=2,
        vocab_size=50,
        n_positions=64,
        bos_token_id=0,
        eos_token_id=None,
        pad_token_id=0,
    )
    return transformers.GPT2LMHeadModel(config).eval()


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"),
    [(0.6, None, None), (0.7, 10, None), (1.0, None, 0.8), (0.5, 8, 0.9)],
)
def test_matches_generate_scores(
    temperature: float, top_k: int | None, top_p: float | None
) -> None:
    model = tiny_lm()
    prompt = torch.randint(1, 50, (3, 4), generator=torch.Generator().manual_seed(3))
    torch.manual_seed(7)
    kwargs = {"top_k": top_k, "top_p": top_p}
    out = model.generate(
        prompt,
        do_sample=True,
        temperature=temperature,
        max_new_tokens=12,
        output_scores=True,
        output_logits=True,
        return_dict_in_generate=True,
        **{k: v for k, v in kwargs.items() if v is not None},
    )
    new = out.sequences[:, prompt.shape[1] :]
    raw = torch.stack(out.logits, dim=1)  # (B, 12, V): the model's logits at each step
    scores = torch.stack(out.scores, dim=1)  # what generate sampled from
    reference = scores.log_softmax(-1).gather(-1, new[..., None]).squeeze(-1)
    ours, log_kept = sampler_logprobs(raw, new, temperature=temperature, top_k=top_k, top_p=top_p)
    assert bool(torch.isfinite(reference).all())  # every sampled token was in the kept set
    torch.testing.assert_close(ours, reference, rtol=1e-6, atol=2e-6)
    # The kept mass is the share of softmax(z/T) that generate left finite.
    full = torch.softmax(raw.double() / temperature, -1)
    kept = torch.where(torch.isfinite(scores), full, 0.0).sum(-1)
    torch.testing.assert_close(log_kept.double(), kept.log(), rtol=0, atol=1e-5)
    # The trainer's recomputation (one forward over the whole sequence, no cache) agrees with
    # the sampler up to the kernels' rounding, and log softmax(z/T) - log S is the same number.
    logits = model(out.sequences).logits[:, prompt.shape[1] - 1 : -1]
    trainer, trainer_log_kept = sampler_logprobs(
        logits, new, temperature=temperature, top_k=top_k, top_p=top_p
    )
    torch.testing.assert_close(trainer, reference, rtol=1e-4, atol=1e-4)
    plain = torch.log_softmax(logits / temperature, -1).gather(-1, new[..., None]).squeeze(-1)
    torch.testing.assert_close(trainer, plain - trainer_log_kept, rtol=1e-5, atol=1e-5)


def test_generate_forgotten_temperature_is_wrong() -> None:
    # The failure chapter 9 reproduces: softmax(z) is not what generate sampled from at T != 1.
    model = tiny_lm()
    prompt = torch.randint(1, 50, (4, 3), generator=torch.Generator().manual_seed(4))
    torch.manual_seed(1)
    out = model.generate(
        prompt,
        do_sample=True,
        temperature=0.6,
        max_new_tokens=10,
        output_scores=True,
        output_logits=True,
        return_dict_in_generate=True,
    )
    new = out.sequences[:, prompt.shape[1] :]
    raw = torch.stack(out.logits, dim=1)
    reference = torch.stack(out.scores, 1).log_softmax(-1).gather(-1, new[..., None]).squeeze(-1)
    forgot, _ = sampler_logprobs(raw, new)
    right, _ = sampler_logprobs(raw, new, temperature=0.6)
    assert (forgot - reference).abs().max() > 1e-2
    assert (right - reference).abs().max() < 1e-5
    assert math.isfinite(float(right.sum()))


@pytest.mark.parametrize("position", [3, 10, 25])
def test_top_p_boundary_exactly_on_the_cumulative_mass(position: int) -> None:
    # top_p chosen so that 1 - top_p equals a cumulative sum of the ascending softmax exactly:
    # transformers removes that token (<=), and so must klpen.
    logits = torch.randn(1, 32, generator=torch.Generator().manual_seed(position))
    ordered, _ = torch.sort(logits, descending=False)
    cumulative = ordered.softmax(-1).cumsum(-1)
    top_p = 1.0 - float(cumulative[0, position])
    assert float(torch.tensor(1 - top_p, dtype=torch.float32)) == float(cumulative[0, position])
    tokens = torch.arange(32)[None, :]
    wide = logits[:, None, :].expand(1, 32, 32)
    ours, _ = sampler_logprobs(wide, tokens, top_p=top_p)
    reference = hf_logprobs(wide, tokens, 1.0, None, top_p)
    assert_same(ours, reference)
    assert int(torch.isfinite(reference).sum()) == 32 - position - 1
