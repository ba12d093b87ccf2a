"""Chapter 9's language model: the grammar, the reward model, the shift and one RLHF update.

References are independent of the code under test: a regular expression for the grammar,
Python counting for the reward model, ``torch.log_softmax`` + ``gather`` and the model's own
``transformers`` loss for the shift, ``torch.distributions`` for the exact KL.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from klpen import next_token_logprobs
from klpen_book import language as lm

_ALT = {
    "D": lm.DETERMINERS,
    "A": lm.ADJECTIVES,
    "N": lm.NOUNS,
    "T": lm.TRANSITIVE_VERBS,
    "I": lm.INTRANSITIVE_VERBS,
}
_NP = r"(?:{D} (?:{A} )?{N})"
_SENTENCE = re.compile(
    ("^" + _NP + r" (?:{T} " + _NP + r"|{I}) \.$").format(
        **{k: "(?:" + "|".join(v) + ")" for k, v in _ALT.items()}
    )
)


def _regex_well_formed(row: list[int]) -> bool:
    """The grammar as a regular expression over the words between <bos> and the first <eos>."""
    if not row or row[0] != lm.BOS_ID or lm.EOS_ID not in row:
        return False
    words = row[1 : row.index(lm.EOS_ID)]
    if any(i in (lm.PAD_ID, lm.BOS_ID) for i in words):
        return False
    return bool(_SENTENCE.match(" ".join(lm.WORDS[i] for i in words)))


@pytest.fixture(scope="module")
def reference() -> object:
    model = lm.tiny_gpt2(seed=0)
    lm.train_reference(model, lm.sample_sentences(512, seed=0), steps=20, seed=0)
    return model


# --- the language -------------------------------------------------------------------------


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 10_000))
def test_grammar_samples_are_sentences(seed: int) -> None:
    batch = lm.sample_sentences(16, seed=seed)
    assert lm.well_formed(batch).all()
    assert all(_regex_well_formed(row) for row in batch.tolist())


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.integers(3, len(lm.WORDS) - 1), min_size=0, max_size=10),
    st.booleans(),
    st.lists(st.integers(0, len(lm.WORDS) - 1), max_size=3),
)
def test_well_formed_matches_regex(words: list[int], ends: bool, tail: list[int]) -> None:
    row = [lm.BOS_ID, *words] + ([lm.EOS_ID] if ends else []) + tail
    assert bool(lm.well_formed(torch.tensor([row]))[0]) == _regex_well_formed(row)


def test_well_formed_rejects_near_misses() -> None:
    for text in [
        "the cat sleeps",  # no full stop
        "the happy happy cat sleeps .",  # two adjectives
        "the cat sees .",  # transitive verb without object
        "cat sleeps .",  # no determiner
        "the cat sleeps a dog .",  # intransitive verb with object
        "happy kind happy .",
    ]:
        assert not lm.well_formed(torch.tensor([lm.encode(text)])).item(), text
    no_eos = torch.tensor([lm.encode("the cat sleeps .")[:-1]])
    assert not lm.well_formed(no_eos).item()


@settings(max_examples=100, deadline=None)
@given(st.lists(st.lists(st.integers(0, len(lm.WORDS) - 1), min_size=6, max_size=6), min_size=1))
def test_proxy_reward_counts_liked_words(rows: list[list[int]]) -> None:
    tokens = torch.tensor(rows)
    mask = torch.tensor([[j % 3 != 0 for j in range(6)]] * len(rows))
    expected = [
        sum(lm.WORDS[t] in lm.LIKED_WORDS for t, m in zip(row, keep, strict=True) if m)
        for row, keep in zip(rows, mask.tolist(), strict=True)
    ]
    assert lm.proxy_reward(tokens, mask).tolist() == [float(e) for e in expected]


def test_encode_decode_round_trip() -> None:
    text = "a small fox chases the red bird ."
    assert lm.decode(lm.encode(text)) == text
    assert lm.decode(torch.tensor([*lm.encode(text), lm.PAD_ID, 5])) == text


# --- the trainer helpers -------------------------------------------------------------------


def test_next_token_logprobs_is_the_shift(reference: object) -> None:
    ids = lm.sample_sentences(8, seed=3)
    with torch.no_grad():
        logits = reference(ids).logits  # type: ignore[operator]
    got = next_token_logprobs(logits, ids)
    want = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
    torch.testing.assert_close(got, want)
    # The model's own causal-LM loss (computed in fp32) is the mean negative of the same.
    with torch.no_grad():
        loss = reference(ids, labels=ids).loss  # type: ignore[operator]
    torch.testing.assert_close(-got.mean(), loss.double(), rtol=1e-5, atol=1e-6)  # fp32 loss


# --- one RLHF update -----------------------------------------------------------------------


def _frozen_step(reference: object, penalty: str) -> tuple[object, dict[str, torch.Tensor]]:
    policy = copy.deepcopy(reference)
    with torch.no_grad():  # move the policy away from the reference
        for p in policy.parameters():  # type: ignore[attr-defined]
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    optimizer = torch.optim.SGD(policy.parameters(), lr=0.0)  # type: ignore[attr-defined]
    out = lm.rlhf_step(
        policy, reference, optimizer, lm.prompts(8), penalty=penalty, kl_coef=0.5, seed=4
    )
    return policy, out


@pytest.mark.parametrize("penalty", lm.PENALTIES)
def test_rlhf_step_exact_and_sampled_kl(reference: object, penalty: str) -> None:
    policy, out = _frozen_step(reference, penalty)
    seqs, mask = out["sequences"], out["mask"]
    with torch.no_grad():
        p_logits = policy(seqs).logits[:, 1:-1]  # type: ignore[operator]
        r_logits = reference(seqs).logits[:, 1:-1]  # type: ignore[operator]
    p = torch.distributions.Categorical(logits=p_logits)
    r = torch.distributions.Categorical(logits=r_logits)
    per_token = torch.distributions.kl_divergence(p, r)
    torch.testing.assert_close(out["exact_kl"], (per_token * mask).sum(-1))
    tokens = seqs[:, 2:]
    ratio = p.log_prob(tokens) - r.log_prob(tokens)
    torch.testing.assert_close(out["sampled_kl"], (ratio * mask).sum(-1))
    assert out["exact_kl"].min() > 0
    assert out["well_formed"].tolist() == [_regex_well_formed(row) for row in seqs.tolist()]
    torch.testing.assert_close(out["proxy_reward"], lm.proxy_reward(tokens, mask))


def test_rlhf_step_at_the_reference_has_zero_kl(reference: object) -> None:
    policy = copy.deepcopy(reference)
    optimizer = torch.optim.SGD(policy.parameters(), lr=0.0)  # type: ignore[attr-defined]
    out = lm.rlhf_step(policy, reference, optimizer, lm.prompts(4), penalty="reward", kl_coef=1.0)
    assert out["exact_kl"].abs().max() == 0
    assert out["sampled_kl"].abs().max() == 0


def test_rlhf_step_moves_the_policy_towards_the_proxy(reference: object) -> None:
    """One step with a large learning rate raises the log-prob of high-scoring responses."""
    policy = copy.deepcopy(reference)
    optimizer = torch.optim.SGD(policy.parameters(), lr=0.5)  # type: ignore[attr-defined]
    out = lm.rlhf_step(policy, reference, optimizer, lm.prompts(32), penalty="none", kl_coef=0)
    seqs, mask = out["sequences"], out["mask"]
    with torch.no_grad():
        before = next_token_logprobs(reference(seqs).logits, seqs)[:, 1:]  # type: ignore[operator]
        after = next_token_logprobs(policy(seqs).logits, seqs)[:, 1:]  # type: ignore[operator]
    gain = ((after - before) * mask).sum(-1)
    scores = out["proxy_reward"]
    assert scores.max() > scores.min()
    assert gain[scores > scores.mean()].mean() > gain[scores < scores.mean()].mean()


def test_train_rlhf_is_deterministic(reference: object) -> None:
    a = lm.train_rlhf(reference, penalty="reward", kl_coef=0.5, steps=2, batch_size=8, seed=3)
    b = lm.train_rlhf(reference, penalty="reward", kl_coef=0.5, steps=2, batch_size=8, seed=3)
    assert a.history == b.history
    assert a.samples_after == b.samples_after
    assert a.history["kl_coef"] == [0.5, 0.5]


# --- bad input -----------------------------------------------------------------------------


def test_bad_input_is_refused_by_name(reference: object) -> None:
    with pytest.raises(TypeError, match="text"):
        lm.encode(3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="vocabulary"):
        lm.encode("the unicorn sleeps .")
    with pytest.raises(TypeError, match="tokens"):
        lm.well_formed(torch.zeros(2, 3))
    with pytest.raises(ValueError, match="tokens"):
        lm.proxy_reward(torch.full((1, 3), 99), torch.ones(1, 3))
    with pytest.raises(ValueError, match="penalty"):
        lm.train_rlhf(reference, penalty="kl", steps=1)
    with pytest.raises(ValueError, match="batch_size"):
        lm.train_rlhf(reference, penalty="none", steps=1, batch_size=5)
    with pytest.raises(ValueError, match="kl_coef"):
        lm.train_rlhf(reference, penalty="reward", kl_coef=-1.0, steps=1)
    with pytest.raises(ValueError, match="ids"):
        lm.decode([1, 99])


def test_plot_runs_follows_the_book_figure_rules() -> None:
    from klpen_book.figures import layout_problems

    history = {key: [0.0, 1.0, 0.5] for key in lm.HISTORY_KEYS}
    runs = {"a": lm.RLHFRun(None, history), "b": lm.RLHFRun(None, dict(history))}
    fig = lm.plot_runs(runs)
    assert layout_problems(fig) == []
    assert len(fig.axes) == 3
    assert [text.get_text() for text in fig.legends[0].get_texts()] == ["a", "b"]


def test_chapter_9_excerpts_are_the_code_that_runs() -> None:
    from klpen_book.source import show_source

    for obj, name, line in (
        (lm.proxy_reward, "formula", "return masked_sum(_LIKED[ids], mask, dim=-1)"),
        (lm.train_reference, "step", "optimizer.step()"),
        (lm.rlhf_step, "update", 'loss = aggregate(per_token_loss, mask, "seq-mean-token-mean")'),
    ):
        listing = show_source(obj, excerpt=name)
        assert line in listing.source.splitlines()
        assert "raise" not in listing.source and '"""' not in listing.source


# torch.compile (2.13) reads .grad of its non-leaf inputs (the model's logits) while tracing
@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf")
def test_packed_compiled_k3_equals_the_padded_batch(reference: object) -> None:
    policy = lm.tiny_gpt2(seed=1)
    check = lm.packed_against_padded(policy, reference, ["the cat sleeps .", "a kind dog ."])
    assert check.packed > 0
    assert abs(check.packed - check.padded) < 1e-10
    assert check.gradient_gap < 1e-8
