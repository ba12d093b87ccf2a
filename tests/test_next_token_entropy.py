"""``next_token_logprobs(..., return_entropy=True)``: the shifted log-probs and entropies from
one read of the logits, padded and packed, against float64 ``log_softmax`` on the sequences
one by one."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

import klpen

G = torch.Generator().manual_seed(3)


def _reference(logits: Tensor, ids: Tensor) -> tuple[Tensor, Tensor]:
    """float64: log-probs of ids[1:] under logits[:-1] and the entropies, for one sequence."""
    logq = logits[:-1].double().log_softmax(-1)
    logp = logq.gather(-1, ids[1:, None])[:, 0]
    ent = -(logq.exp() * logq).sum(-1)
    return logp, ent


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_padded_equals_float64_values_and_gradients(temperature: float) -> None:
    logits = (torch.randn(3, 6, 17, generator=G) * 3).requires_grad_()
    ids = torch.randint(0, 17, (3, 6), generator=G)
    logp, ent = klpen.next_token_logprobs(logits, ids, temperature=temperature, return_entropy=True)
    assert logp.shape == ent.shape == (3, 5)
    w = torch.randn(2, 3, 5, generator=G)
    got = torch.autograd.grad((w[0] * logp + w[1] * ent).sum(), logits)[0]
    scaled = logits / temperature
    pairs = [_reference(scaled[b], ids[b]) for b in range(3)]
    ref_logp, ref_ent = (torch.stack(x) for x in zip(*pairs, strict=True))
    torch.testing.assert_close(logp.double(), ref_logp, rtol=1e-5, atol=1e-6)
    # An fp32 entropy is log s - E[y] for exponents y of up to about |z / T| ~ 15 here: it
    # cancels to about eps (|log s| + |E y|), a few 1e-6 (worst of 300 such draws: 5.7e-6 with
    # exp, 5.1e-6 with exp2, both exponentials of blocks.exp_).
    torch.testing.assert_close(ent.double(), ref_ent, rtol=1e-5, atol=1e-5)
    want = torch.autograd.grad((w[0] * ref_logp + w[1] * ref_ent).sum(), logits)[0]
    torch.testing.assert_close(got, want.float(), rtol=1e-4, atol=1e-6)
    assert torch.equal(got[:, -1], torch.zeros(3, 17))  # the last position predicts nothing


@pytest.mark.parametrize("lengths", [[4, 1, 6], [1, 1], [7], [2, 5, 3, 1]])
def test_packed_equals_each_sequence_alone(lengths: list[int]) -> None:
    total, vocab = sum(lengths), 11
    logits = torch.randn(1, total, vocab, generator=G, dtype=torch.float64)
    ids = torch.randint(0, vocab, (1, total), generator=G)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    for end in cu[1:-1].tolist():  # the boundary rows hold garbage: it must reach nothing
        logits[0, end - 1] = torch.nan
    logits.requires_grad_()
    w = torch.randn(2, 1, total - 1, generator=G, dtype=torch.float64)
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    for packed in ({"cu_seqlens": cu}, {"position_ids": positions}):
        logp, ent = klpen.next_token_logprobs(logits, ids, return_entropy=True, **packed)
        (grad,) = torch.autograd.grad((w[0] * logp + w[1] * ent).sum(), logits)
        assert torch.isfinite(logp).all() and torch.isfinite(ent).all()
        assert torch.isfinite(grad).all()
        for s, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)):
            if b - a > 1:
                ref_logp, ref_ent = _reference(logits[0, a:b].detach(), ids[0, a:b])
                torch.testing.assert_close(logp[0, a : b - 1], ref_logp)
                torch.testing.assert_close(ent[0, a : b - 1], ref_ent)
            if s + 1 < len(lengths):  # the entry whose next token starts sequence s + 1
                assert logp[0, b - 1] == 0 and ent[0, b - 1] == 0
                assert torch.equal(grad[0, b - 1], torch.zeros(vocab, dtype=grad.dtype))
