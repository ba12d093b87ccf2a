r"""Chapter 9's language model: a toy language with a known truth, a tiny GPT-2, RLHF on it.

The language is a small grammar of English-like sentences,

.. code-block:: text

    S  -> NP Vt NP "." | NP Vi "."        NP -> Det Adj? Noun

over 27 words, so whether a text is a sentence is a question :func:`well_formed` answers
exactly: the *true* reward that a learned reward model only approximates. The reward model
of this chapter, :func:`proxy_reward`, is deliberately flawed the way real ones are: it
likes a few words (:data:`LIKED_WORDS`) and counts them, so it cannot tell a sentence from a
string of those words.

The reference policy is a Hugging Face ``transformers`` GPT-2 built from a small config
(:func:`tiny_gpt2`, no download) and trained on sentences of the grammar
(:func:`train_reference`). :func:`rlhf_step` is one RLHF update written as one would write
it for a real checkpoint: ``model.generate`` for the rollout, ``model(...).logits`` for the
forward pass, klpen for everything between the logits and the loss.

Everything runs in float64 and on one thread: the sampled texts then depend only on the seeds,
not on the machine's vector unit or thread count (a float32 rounding difference flips a
sampled token now and then, and every later step of a run with it).
"""

from __future__ import annotations

import copy
import random
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from klpen import (
    KLController,
    aggregate,
    estimate_kl,
    full_kl,
    masked_mean,
    masked_sum,
    next_token_logprobs,
    response_mask,
    sequence_ids,
    shape_rewards,
)

from .bandit import _check_int, single_threaded
from .checks import check_choice, check_coef, check_positive, check_token_ids
from .figures import FIGURE_DPI, FIGURE_WIDTH
from .tables import format_table

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = [
    "ADJECTIVES",
    "BOS_ID",
    "DETERMINERS",
    "EOS_ID",
    "HISTORY_KEYS",
    "INTRANSITIVE_VERBS",
    "LIKED_WORDS",
    "NOUNS",
    "PAD_ID",
    "PENALTIES",
    "RUN_TABLE_HEADERS",
    "TRANSITIVE_VERBS",
    "WORDS",
    "RLHFRun",
    "decode",
    "encode",
    "history_table",
    "plot_runs",
    "prompts",
    "proxy_reward",
    "rlhf_step",
    "run_table",
    "sample_sentences",
    "tiny_gpt2",
    "train_reference",
    "train_rlhf",
    "well_formed",
]

DETERMINERS = ("the", "a")
ADJECTIVES = ("big", "small", "old", "red", "happy", "kind")
NOUNS = ("cat", "dog", "bird", "child", "king", "queen", "fox", "horse")
TRANSITIVE_VERBS = ("sees", "likes", "chases", "loves", "finds", "helps")
INTRANSITIVE_VERBS = ("sleeps", "runs", "sings", "waits")
#: The vocabulary: three special tokens, then the words of the grammar and the full stop.
WORDS = (
    *("<pad>", "<bos>", "<eos>"),
    *DETERMINERS,
    *ADJECTIVES,
    *NOUNS,
    *TRANSITIVE_VERBS,
    *INTRANSITIVE_VERBS,
    ".",
)
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
#: The words the flawed reward model likes: one point each, wherever they stand.
LIKED_WORDS = ("happy", "kind")
#: The longest sentence of the grammar: BOS, 9 words and the stop, EOS.
MAX_SENTENCE_TOKENS = 12

_ID = {word: i for i, word in enumerate(WORDS)}
_CLASSES = {
    "det": frozenset(_ID[w] for w in DETERMINERS),
    "adj": frozenset(_ID[w] for w in ADJECTIVES),
    "noun": frozenset(_ID[w] for w in NOUNS),
    "vt": frozenset(_ID[w] for w in TRANSITIVE_VERBS),
    "vi": frozenset(_ID[w] for w in INTRANSITIVE_VERBS),
}
_LIKED = torch.zeros(len(WORDS), dtype=torch.float64)
_LIKED[[_ID[w] for w in LIKED_WORDS]] = 1.0

#: Where :func:`rlhf_step` puts the penalty: nowhere, in the shaped reward, in the loss.
PENALTIES = ("none", "reward", "loss")
#: The per-update records of :attr:`RLHFRun.history`.
HISTORY_KEYS = ("proxy_reward", "well_formed", "exact_kl", "sampled_kl", "kl_coef")
RUN_TABLE_HEADERS = (
    "run",
    "proxy reward",
    "well-formed",
    "exact KL",
    "sampled KL (k1)",
    "final β",
)


def encode(text: str) -> list[int]:
    """Token ids of a space-separated text: ``<bos>``, the words, and ``<eos>``.

    Example:
        >>> encode("the cat sleeps .")
        [1, 3, 11, 25, 29, 2]
    """
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    unknown = [w for w in text.split() if w not in _ID]
    if unknown:
        raise ValueError(f"text has words outside the vocabulary: {unknown}")
    return [BOS_ID, *(_ID[w] for w in text.split()), EOS_ID]


def decode(ids: Sequence[int] | Tensor) -> str:
    """The words of ``ids`` up to the first ``<eos>``, without special tokens.

    A text that never ends (no ``<eos>``) is marked with a trailing ``…``.

    Example:
        >>> decode(encode("a dog runs ."))
        'a dog runs .'
        >>> decode([1, 9, 9, 9])
        'happy happy happy …'
    """
    row = _id_list("ids", ids)
    words: list[str] = []
    for i in row:
        if i == EOS_ID:
            return " ".join(words)
        if i not in (PAD_ID, BOS_ID):
            words.append(WORDS[i])
    return " ".join([*words, "…"])


def _id_list(name: str, ids: Sequence[int] | Tensor) -> list[int]:
    if isinstance(ids, Tensor):
        ids = check_token_ids(name, ids)
        if ids.dim() != 1:
            raise ValueError(f"{name} must be one row of token ids, got shape {tuple(ids.shape)}")
        row = [int(i) for i in ids.tolist()]
    elif isinstance(ids, Sequence) and not isinstance(ids, str):
        row = [int(i) for i in ids]
    else:
        raise TypeError(f"{name} must be a sequence or tensor of token ids, got {ids!r}")
    bad = [i for i in row if not 0 <= i < len(WORDS)]
    if bad:
        raise ValueError(f"{name} must lie in [0, {len(WORDS)}), got {bad[0]}")
    return row


def _noun_phrase(r: random.Random) -> list[str]:
    words = [r.choice(DETERMINERS)]
    if r.random() < 0.5:
        words.append(r.choice(ADJECTIVES))
    return [*words, r.choice(NOUNS)]


def sample_sentences(n: int, *, seed: int = 0) -> Tensor:
    """``n`` sentences drawn from the grammar, as a right-padded ``(n, 12)`` int64 tensor.

    Each noun phrase has an adjective with probability 1/2; a sentence has a transitive verb
    (and a second noun phrase) with probability 3/5; every word is uniform in its class.
    Each row is ``<bos>``, the sentence, ``<eos>``, then ``<pad>``.

    Example:
        >>> batch = sample_sentences(3, seed=0)
        >>> batch.shape, bool(well_formed(batch).all())
        (torch.Size([3, 12]), True)
    """
    count = _check_int("n", n, 1)
    r = random.Random(_check_int("seed", seed, 0))
    rows = []
    for _ in range(count):
        words = _noun_phrase(r)
        if r.random() < 0.6:
            words += [r.choice(TRANSITIVE_VERBS), *_noun_phrase(r)]
        else:
            words.append(r.choice(INTRANSITIVE_VERBS))
        ids = encode(" ".join([*words, "."]))
        rows.append(ids + [PAD_ID] * (MAX_SENTENCE_TOKENS - len(ids)))
    return torch.tensor(rows)


def _parse(row: list[int]) -> bool:
    """Whether ``row`` is ``<bos>`` S ``<eos>`` (anything after the first ``<eos>`` ignored)."""

    def noun_phrase(i: int) -> int:
        if i >= len(row) or row[i] not in _CLASSES["det"]:
            return -1
        i += 1
        if i < len(row) and row[i] in _CLASSES["adj"]:
            i += 1
        return i + 1 if i < len(row) and row[i] in _CLASSES["noun"] else -1

    if not row or row[0] != BOS_ID:
        return False
    i = noun_phrase(1)
    if i < 0 or i >= len(row):
        return False
    if row[i] in _CLASSES["vt"]:
        i = noun_phrase(i + 1)
    elif row[i] in _CLASSES["vi"]:
        i += 1
    else:
        return False
    return 0 < i < len(row) - 1 and row[i] == _ID["."] and row[i + 1] == EOS_ID


def well_formed(tokens: Tensor) -> Tensor:
    """The true reward: is each row ``<bos>``, a sentence of the grammar, ``<eos>``?

    Args:
        tokens: ``(B, T)`` integer ids of whole sequences (prompt and response); whatever
            follows a row's first ``<eos>`` is ignored.

    Returns:
        ``(B,)`` bool.

    Example:
        >>> ok = torch.tensor([encode("the happy cat sees a dog .")])
        >>> bad = torch.tensor([encode("the happy happy cat .") + [0]])
        >>> well_formed(ok).tolist(), well_formed(bad).tolist()
        ([True], [False])
    """
    ids = check_token_ids("tokens", tokens)
    if ids.dim() != 2:
        raise ValueError(f"tokens must have shape (B, T), got {tuple(ids.shape)}")
    return torch.tensor([_parse(row) for row in ids.tolist()], dtype=torch.bool)


def proxy_reward(tokens: Tensor, mask: Tensor) -> Tensor:
    """The flawed reward model: one point per liked word among the masked-in tokens.

    It scores words, not sentences: ``"happy kind happy"`` beats any sentence of the grammar,
    which holds two liked words at most.

    Args:
        tokens: ``(B, T)`` integer ids in ``[0, len(WORDS))``.
        mask: ``(B, T)`` 0/1 mask of the tokens to score (the response).

    Returns:
        ``(B,)`` float64 scores.

    Example:
        >>> sentence = encode("the happy cat sees a kind dog .")[1:]
        >>> string = encode("happy kind happy kind happy kind happy kind")[1:]
        >>> proxy_reward(torch.tensor([sentence, string]), torch.ones(2, 9)).tolist()
        [2.0, 8.0]
    """
    ids = check_token_ids("tokens", tokens)
    if ids.dim() != 2:
        raise ValueError(f"tokens must have shape (B, T), got {tuple(ids.shape)}")
    if ids.numel() and not 0 <= int(ids.min()) <= int(ids.max()) < len(WORDS):
        raise ValueError(f"tokens must lie in [0, {len(WORDS)}), got {ids.min()}..{ids.max()}")
    # excerpt: formula
    return masked_sum(_LIKED[ids], mask, dim=-1)
    # end excerpt


def tiny_gpt2(*, seed: int = 0, n_embd: int = 64, n_layer: int = 2, n_head: int = 4) -> Any:
    """A randomly initialised float64 ``transformers.GPT2LMHeadModel`` for :data:`WORDS`.

    Built from a ``GPT2Config`` (nothing is downloaded): vocabulary ``len(WORDS)``, 16
    positions, no dropout, ``<bos>``/``<eos>`` ids in the config and ``<pad>`` in its
    generation config (which ``generate`` uses to fill rows after their ``<eos>``).

    Example:
        >>> model = tiny_gpt2()
        >>> sum(p.numel() for p in model.parameters()), model.dtype
        (103040, torch.float64)
    """
    with warnings.catch_warnings():
        # transformers imports tqdm.auto, which warns in a notebook without ipywidgets.
        warnings.filterwarnings("ignore", message="IProgress not found")
        from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=len(WORDS),
        n_positions=16,
        n_embd=_check_int("n_embd", n_embd, 1),
        n_layer=_check_int("n_layer", n_layer, 1),
        n_head=_check_int("n_head", n_head, 1),
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
    )
    torch.manual_seed(_check_int("seed", seed, 0))
    model = GPT2LMHeadModel(config).double()
    model.generation_config.pad_token_id = PAD_ID
    model.generation_config.eos_token_id = EOS_ID
    return model


def train_reference(
    model: Any,
    sentences: Tensor,
    *,
    steps: int = 150,
    batch_size: int = 64,
    lr: float = 3e-3,
    seed: int = 0,
) -> list[float]:
    r"""Train a causal LM on ``sentences`` by maximum likelihood (the "SFT" of this toy).

    Each step draws ``batch_size`` rows (seeded) and takes one Adam step on the mean
    negative log-likelihood of the next token over the non-pad positions,
    :math:`-\frac{1}{N}\sum_{t} m_t \log \pi(x_{t+1} \mid x_{\le t})`, using
    :func:`klpen.next_token_logprobs`. Runs on one thread; returns the loss of every step.

    Example:
        >>> model = tiny_gpt2()
        >>> losses = train_reference(model, sample_sentences(64), steps=3)
        >>> len(losses), losses[-1] < losses[0]
        (3, True)
    """
    data = check_token_ids("sentences", sentences)
    if data.dim() != 2 or data.shape[1] < 2:
        raise ValueError(f"sentences must have shape (N, T) with T >= 2, got {tuple(data.shape)}")
    n_steps = _check_int("steps", steps, 1)
    n = _check_int("batch_size", batch_size, 1)
    gen = torch.Generator().manual_seed(_check_int("seed", seed, 0))
    optimizer = torch.optim.Adam(model.parameters(), lr=check_positive("lr", lr))
    model.train()
    losses = []
    with single_threaded():
        for _ in range(n_steps):
            # excerpt: step
            batch = data[torch.randint(len(data), (n,), generator=gen)]
            attention_mask = batch != PAD_ID
            logits = model(batch, attention_mask=attention_mask.long()).logits
            loss = -masked_mean(next_token_logprobs(logits, batch), attention_mask[:, 1:])
            optimizer.zero_grad()
            torch.autograd.backward(loss)
            optimizer.step()
            losses.append(float(loss.detach()))
            # end excerpt
    model.eval()
    return losses


def prompts(batch_size: int) -> Tensor:
    """``(batch_size, 2)`` prompts ``<bos> the`` and ``<bos> a``, alternating row by row.

    Example:
        >>> [decode(row) for row in prompts(2)]
        ['the …', 'a …']
    """
    n = _check_int("batch_size", batch_size, 1)
    pair = torch.tensor([[BOS_ID, _ID["the"]], [BOS_ID, _ID["a"]]])
    return pair.repeat(n // 2 + 1, 1)[:n]


def rlhf_step(
    policy: Any,
    reference: Any,
    optimizer: torch.optim.Optimizer,
    prompt_ids: Tensor,
    *,
    penalty: str,
    kl_coef: float,
    reward_fn: Callable[[Tensor, Tensor], Tensor] = proxy_reward,
    temperature: float = 1.0,
    max_new_tokens: int = 10,
    seed: int = 0,
) -> dict[str, Any]:
    r"""One on-policy RLHF update of ``policy`` against a frozen ``reference``.

    Roll out, score, compute the per-token log-probs of both models and the KL, then one
    policy-gradient step. ``penalty`` says where β enters:

    * ``"reward"`` (PPO-style, as TRL and OpenRLHF do): per-token rewards
      :math:`-\beta k_1` plus the score at the last token (:func:`klpen.shape_rewards`);
      the advantage of a token is its reward-to-go, whitened over the batch.
    * ``"loss"`` (GRPO-style): the advantage is the score normalised within each group of
      rows that share a prompt, and :math:`\beta k_3` is added to the loss, per token.
    * ``"none"``: the ``"reward"`` path with β = 0.

    With one gradient step per batch the PPO/GRPO ratio is 1 and the clip is inactive, so the
    policy loss is :math:`-A_t \log\pi(y_t)` averaged over tokens.

    Returns:
        A dict: ``sequences`` ``(B, P+N)`` (prompt and response ids), ``mask`` ``(B, N)``,
        ``proxy_reward`` ``(B,)``, ``well_formed`` ``(B,)`` bool, ``exact_kl`` and
        ``sampled_kl`` ``(B,)`` (per sequence, summed over the response: :func:`klpen.full_kl`
        and :math:`k_1`), all measured on the policy that drew the batch.
    """
    where = check_choice("penalty", penalty, PENALTIES)
    beta = check_coef("kl_coef", kl_coef) if where != "none" else 0.0
    n_prompt = prompt_ids.shape[1]

    # excerpt: update
    # 1. Rollout: sample responses exactly as for a real checkpoint.
    torch.manual_seed(seed)
    with torch.no_grad():
        sequences = policy.generate(
            prompt_ids,
            attention_mask=torch.ones_like(prompt_ids),
            do_sample=True,
            temperature=temperature,
            top_k=0,  # no top-k cut: sample from the whole distribution
            max_new_tokens=max_new_tokens,
        )
    mask = response_mask(sequences[:, n_prompt:], EOS_ID)  # up to and including EOS
    attention_mask = torch.cat([torch.ones_like(prompt_ids, dtype=torch.bool), mask], dim=1)

    # 2. Forward passes: (B, P+N, V) logits; the response is predicted from position P-1 on.
    #    Log-probs and KL of the distribution generate sampled from: softmax(logits / T).
    logits = policy(sequences, attention_mask=attention_mask.long()).logits
    with torch.no_grad():
        ref_logits = reference(sequences, attention_mask=attention_mask.long()).logits
    t = temperature
    logprobs = next_token_logprobs(logits, sequences, temperature=t)[:, n_prompt - 1 :]
    ref_logprobs = next_token_logprobs(ref_logits, sequences, temperature=t)[:, n_prompt - 1 :]

    # 3. Rewards and the KL to the reference: sampled (k1, per token) and exact (per sequence).
    # excerpt: penalty
    scores = reward_fn(sequences[:, n_prompt:], mask)
    k1 = estimate_kl(logprobs.detach(), ref_logprobs, "k1")
    # end excerpt
    response_logits = logits.detach()[:, n_prompt - 1 : -1]
    exact_kl = full_kl(response_logits, ref_logits[:, n_prompt - 1 : -1], temperature=t)

    # 4. Advantages and loss.
    # excerpt: penalty
    if where == "loss":
        groups = scores.view(-1, 2).T  # rows alternate between the two prompts
        normalised = (groups - groups.mean(1, keepdim=True)) / (groups.std(1, keepdim=True) + 1e-4)
        advantages = normalised.T.reshape(-1, 1).expand_as(logprobs)
        k3 = estimate_kl(logprobs, ref_logprobs, "k3")
        per_token_loss = -advantages * logprobs + beta * k3
    else:
        rewards = shape_rewards(scores, k1, mask=mask, kl_coef=beta)
        returns = rewards.flip(-1).cumsum(-1).flip(-1)  # reward-to-go, γ = 1
        mean = masked_mean(returns, mask)
        std = masked_mean((returns - mean) ** 2, mask).sqrt()
        advantages = (returns - mean) / (std + 1e-8)
        per_token_loss = -advantages * logprobs
    loss = aggregate(per_token_loss, mask, "seq-mean-token-mean")
    # end excerpt
    optimizer.zero_grad()
    torch.autograd.backward(loss)
    optimizer.step()
    # end excerpt

    return {
        "sequences": sequences,
        "mask": mask,
        "proxy_reward": scores,
        "well_formed": well_formed(sequences),
        "exact_kl": masked_sum(exact_kl, mask, dim=-1),
        "sampled_kl": masked_sum(k1, mask, dim=-1),
    }


@dataclass
class RLHFRun:
    """The result of :func:`train_rlhf`.

    Attributes:
        policy: the trained model.
        history: for each key of :data:`HISTORY_KEYS`, one float per update, measured on the
            batch that update drew (batch means; ``"kl_coef"`` is the β the update used).
        samples_before, samples_after: decoded texts of the first and the last batch.
    """

    policy: Any
    history: dict[str, list[float]] = field(default_factory=dict)
    samples_before: list[str] = field(default_factory=list)
    samples_after: list[str] = field(default_factory=list)

    def final(self, key: str, last: int = 5) -> float:
        """Mean of ``history[key]`` over the last ``last`` updates (smooths one batch's noise).

        Example:
            >>> RLHFRun(None, {"kl_coef": [1.0, 2.0, 3.0]}).final("kl_coef", last=2)
            2.5
        """
        values = self.history[check_choice("key", key, HISTORY_KEYS)]
        tail = values[-_check_int("last", last, 1) :]
        return sum(tail) / len(tail)


def train_rlhf(
    reference: Any,
    *,
    penalty: str,
    kl_coef: float | KLController = 0.0,
    steps: int = 40,
    batch_size: int = 64,
    lr: float = 1e-3,
    seed: int = 0,
) -> RLHFRun:
    """Fine-tune a copy of ``reference`` with ``steps`` calls of :func:`rlhf_step`.

    ``kl_coef`` is a number (fixed β) or a klpen controller, which is updated after every
    step with the batch's mean sampled sequence KL and ``n_steps=batch_size`` (samples, as
    TRL counts them). Update ``i`` samples with seed ``seed * 1000 + i``; everything runs on
    one thread, so a run depends only on its arguments.

    Example:
        >>> reference = tiny_gpt2()
        >>> run = train_rlhf(reference, penalty="reward", kl_coef=0.5, steps=2, batch_size=4)
        >>> sorted(run.history) == sorted(HISTORY_KEYS), len(run.history["exact_kl"])
        (True, 2)
    """
    check_choice("penalty", penalty, PENALTIES)
    controller = kl_coef if isinstance(kl_coef, KLController) else None
    if controller is None:
        check_coef("kl_coef", kl_coef)
    n_steps = _check_int("steps", steps, 1)
    n = _check_int("batch_size", batch_size, 2)
    if n % 2:
        raise ValueError(f"batch_size must be even (two prompts per group), got {n}")
    start = _check_int("seed", seed, 0)
    policy = copy.deepcopy(reference)
    policy.train()
    optimizer = torch.optim.Adam(policy.parameters(), lr=check_positive("lr", lr))
    history: dict[str, list[float]] = {key: [] for key in HISTORY_KEYS}
    run = RLHFRun(policy=policy, history=history)
    with single_threaded():
        for i in range(n_steps):
            beta = controller.kl_coef if controller is not None else float(kl_coef)  # type: ignore[arg-type]
            out = rlhf_step(
                policy, reference, optimizer, prompts(n), penalty=penalty, kl_coef=beta,
                seed=start * 1000 + i,
            )  # fmt: skip
            for key in HISTORY_KEYS[:-1]:
                history[key].append(float(out[key].double().mean()))
            history["kl_coef"].append(beta if penalty != "none" else 0.0)
            if controller is not None:
                controller.update(history["sampled_kl"][-1], n_steps=n)
            texts = [decode(row) for row in out["sequences"]]
            if i == 0:
                run.samples_before = texts
            run.samples_after = texts
    policy.eval()
    return run


def packed_k3_term(
    logits: Tensor, ref_logits: Tensor, input_ids: Tensor, position_ids: Tensor
) -> Tensor:
    """The KL part of a GRPO loss on one packed row ``(1, total)``: k3, averaged per sequence
    (``"seq-mean-token-mean"``); the next-token entries that cross a sequence boundary are
    left out. Written to be compiled with ``fullgraph=True``.

    Example:
        >>> z = torch.zeros(1, 5, 3, dtype=torch.float64)
        >>> ids, pos = torch.tensor([[0, 1, 2, 0, 1]]), torch.tensor([[0, 1, 2, 0, 1]])
        >>> float(packed_k3_term(z, z, ids, pos))
        0.0
    """
    logp = next_token_logprobs(logits, input_ids, position_ids=position_ids)
    ref_logp = next_token_logprobs(ref_logits, input_ids, position_ids=position_ids)
    seq = sequence_ids(position_ids=position_ids)
    same = seq[:, 1:] == seq[:, :-1]  # the next token belongs to the same sentence
    kl = estimate_kl(logp, ref_logp, "k3")
    return aggregate(kl, same, "seq-mean-token-mean", sequence_ids=seq[:, 1:])


@dataclass(frozen=True)
class PackedCheck:
    """:func:`packed_against_padded`'s result."""

    packed: float  # the compiled packed k3 term
    padded: float  # the same sentences padded into a batch, eagerly
    gradient_gap: float  # largest |difference| of the two gradients over the policy's parameters


def packed_against_padded(policy: Any, reference: Any, texts: Sequence[str]) -> PackedCheck:
    """The k3 term of ``texts`` packed into one row and compiled (``fullgraph=True``), against
    the same sentences padded into a batch and computed eagerly, values and gradients.

    The packed row's logits are each sentence's own (the model run sentence by sentence),
    which is what a packed-attention model computes for a packed row.
    """
    rows = [torch.tensor(encode(t)) for t in texts]
    params = list(policy.parameters())

    def logits_of(model: Any, row: Tensor) -> Tensor:
        return model(row[None]).logits[0]  # type: ignore[no-any-return]

    input_ids = torch.cat(rows)[None]
    position_ids = torch.cat([torch.arange(len(r)) for r in rows])[None]
    with torch.no_grad():
        ref_logits = torch.cat([logits_of(reference, r) for r in rows])[None]
    logits = torch.cat([logits_of(policy, r) for r in rows])[None]
    compiled = torch.compile(packed_k3_term, fullgraph=True)
    packed = compiled(logits, ref_logits, input_ids, position_ids)
    packed_grads = torch.autograd.grad(packed, params)

    pad = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=PAD_ID)
    lengths = torch.tensor([len(r) for r in rows])
    valid = torch.arange(pad.shape[1] - 1) < (lengths - 1)[:, None]
    attention = (pad != PAD_ID).long()
    with torch.no_grad():
        ref_pad = reference(pad, attention_mask=attention).logits
    pol_pad = policy(pad, attention_mask=attention).logits
    kl = estimate_kl(next_token_logprobs(pol_pad, pad), next_token_logprobs(ref_pad, pad), "k3")
    padded = aggregate(kl, valid, "seq-mean-token-mean")
    padded_grads = torch.autograd.grad(padded, params)
    gap = max(float((a - b).abs().max()) for a, b in zip(packed_grads, padded_grads, strict=True))
    return PackedCheck(float(packed.detach()), float(padded.detach()), gap)


def run_table(runs: Mapping[str, RLHFRun], *, last: int = 5) -> str:
    """One row per run: its final proxy reward, well-formed share, exact and sampled KL, β.

    The first row is the reference: the first update's records of the first run, measured on
    a batch the reference drew (every run starts there). Each run's figures are means over
    its last ``last`` updates (:meth:`RLHFRun.final`).

    Example:
        >>> run = RLHFRun(None, {k: [0.0, 0.5] for k in HISTORY_KEYS})
        >>> print(run_table({"x": run}, last=1))
        run        proxy reward  well-formed  exact KL  sampled KL (k1)  final β
        ---------  ------------  -----------  --------  ---------------  -------
        reference          0.00         0.00      0.00             0.00     0.00
        x                  0.50         0.50      0.50             0.50     0.50
    """
    if not isinstance(runs, Mapping) or not runs:
        raise ValueError(f"runs must be a non-empty mapping of label -> RLHFRun, got {runs!r}")
    first = next(iter(runs.values()))
    rows = [["reference", *(first.history[key][0] for key in HISTORY_KEYS)]]
    rows += [
        [label, *(run.final(key, last) for key in HISTORY_KEYS)] for label, run in runs.items()
    ]
    return format_table(rows, RUN_TABLE_HEADERS, digits=2)


def history_table(run: RLHFRun, *, every: int = 5) -> str:
    """Every ``every``-th update of one run, and its last: β, proxy reward, well-formed share,
    exact and sampled sequence KL.

    Example:
        >>> run = RLHFRun(None, {k: [0.0, 1.0, 2.0] for k in HISTORY_KEYS})
        >>> print(history_table(run, every=2).splitlines()[-1])
        2       2.00          2.00         2.00      2.00             2.00
    """
    n = len(run.history["kl_coef"])
    steps = sorted({*range(0, n, _check_int("every", every, 1)), n - 1})
    keys = ("kl_coef", *HISTORY_KEYS[:-1])
    rows = [[str(i), *(run.history[key][i] for key in keys)] for i in steps]
    return format_table(rows, ["update", "β", *RUN_TABLE_HEADERS[1:-1]], digits=2)


def plot_runs(runs: Mapping[str, RLHFRun]) -> Figure:
    """Proxy reward, well-formed share and exact KL of each run, against the update.

    Three panels, two a row, the book's column wide (:data:`klpen_book.figures.FIGURE_WIDTH`),
    every axis labelled, one legend in the fourth slot.

    Example:
        >>> run = RLHFRun(None, {k: [0.0, 1.0] for k in HISTORY_KEYS})
        >>> len(plot_runs({"x": run}).axes)
        3
    """
    from matplotlib.figure import Figure

    if not isinstance(runs, Mapping) or not runs:
        raise ValueError(f"runs must be a non-empty mapping of label -> RLHFRun, got {runs!r}")
    # Laid out for the book's column: two panels a row, the legend in the fourth slot.
    fig = Figure(figsize=(FIGURE_WIDTH, 5.6), dpi=FIGURE_DPI, layout="constrained")
    axes = fig.subplot_mosaic([["proxy_reward", "well_formed"], ["exact_kl", "."]])
    labels = {
        "proxy_reward": "proxy reward (liked words)",
        "well_formed": "well-formed share",
        "exact_kl": "exact KL(π‖π_ref), nats",
    }
    for key, label in labels.items():
        ax = axes[key]
        for name, run in runs.items():
            ax.plot(run.history[key], label=name, linewidth=1.4)
        ax.set_xlabel("update")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    handles, names = axes["exact_kl"].get_legend_handles_labels()
    fig.legend(handles, names, loc="center", bbox_to_anchor=(0.76, 0.27), fontsize=10)
    return fig
