"""aggregate's peer aliases against the peers' formulas, written out here from their sources.

TRL 1.16 (``trl/trainer/grpo_trainer.py``, the ``loss_type`` branches of the GRPO loss) and verl
(``verl/trainer/ppo/core_algos.py``, ``agg_loss``, at commit
``b178a3cd56f58b2d502255daba591e92833930a7``), each re-typed in float64 on the padded batch
(TRL's gradient-accumulation divisor left out: it is the trainer's). Random batches include
rows with no valid token, where ``grpo`` and ``dr_grpo`` count the row and klpen's own
``seq-mean`` modes do not.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

from klpen import aggregate, sequence_ids
from klpen.masking import AGGREGATION_ALIASES, AGGREGATION_MODES


def trl_grpo(loss: Tensor, mask: Tensor) -> Tensor:
    return ((loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()


def trl_bnpo(loss: Tensor, mask: Tensor) -> Tensor:
    return (loss * mask).sum() / mask.sum().clamp(min=1.0)


def trl_dr_grpo(loss: Tensor, mask: Tensor, max_completion_length: int) -> Tensor:
    return (loss * mask).sum() / (loss.size(0) * max_completion_length)


def trl_dapo(loss: Tensor, mask: Tensor) -> Tensor:
    # num_items_in_batch: the valid tokens of the whole batch (one process, no accumulation)
    num_items_in_batch = mask.sum()
    return (loss * mask).sum() / num_items_in_batch.clamp(min=1.0)


def verl_seq_mean_token_sum_norm(
    loss: Tensor, mask: Tensor, loss_scale_factor: float | None = None
) -> Tensor:
    seq_losses = torch.sum(loss * mask, dim=-1)
    if loss_scale_factor is None:
        loss_scale_factor = mask.shape[-1]
    return torch.sum(seq_losses) / loss_scale_factor


PEERS = {
    "grpo": lambda x, m, L: trl_grpo(x, m),
    "bnpo": lambda x, m, L: trl_bnpo(x, m),
    "dr_grpo": lambda x, m, L: trl_dr_grpo(x, m, L),
    "dapo": lambda x, m, L: trl_dapo(x, m),
    "seq-mean-token-sum-norm": lambda x, m, L: verl_seq_mean_token_sum_norm(x, m, L),
}


def batch(seed: int, b: int, t: int, empty_rows: int) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    values = torch.randn(b, t, generator=g, dtype=torch.float64)
    mask = torch.rand(b, t, generator=g) < 0.6
    mask[:, 0] = True
    mask[:empty_rows] = False
    return values, mask


SHAPES = [(1, 1, 0), (4, 7, 0), (4, 7, 1), (6, 3, 2), (3, 16, 3)]


@pytest.mark.parametrize("alias", list(AGGREGATION_ALIASES))
@pytest.mark.parametrize(("b", "t", "empty"), SHAPES)
@pytest.mark.parametrize("seed", [0, 1])
def test_alias_equals_the_peers_formula(alias: str, b: int, t: int, empty: int, seed: int) -> None:
    values, mask = batch(seed, b, t, empty)
    length = 20 if alias in ("dr_grpo", "seq-mean-token-sum-norm") else None
    kwargs = {} if length is None else {"max_length": length}
    x = values.clone().requires_grad_()
    got = aggregate(torch.where(mask, x, math.nan), mask, alias, **kwargs)  # NaN at padding
    y = values.clone().requires_grad_()
    want = PEERS[alias](y, mask.double(), length)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    (gx,) = torch.autograd.grad(got, x)
    (gy,) = torch.autograd.grad(want, y)
    torch.testing.assert_close(gx, gy, rtol=1e-12, atol=1e-12)


def test_verl_norm_defaults_to_the_padded_length_as_verl_does() -> None:
    values, mask = batch(3, 4, 9, 1)
    got = aggregate(values, mask, "seq-mean-token-sum-norm")
    torch.testing.assert_close(got, verl_seq_mean_token_sum_norm(values, mask.double()))


@pytest.mark.parametrize("alias", ["bnpo", "dapo"])
def test_token_mean_aliases_are_token_mean(alias: str) -> None:
    values, mask = batch(4, 5, 6, 2)
    assert torch.equal(aggregate(values, mask, alias), aggregate(values, mask, "token-mean"))


def test_grpo_and_dr_grpo_equal_klpens_modes_when_every_row_has_a_token() -> None:
    values, mask = batch(5, 5, 6, 0)
    torch.testing.assert_close(
        aggregate(values, mask, "grpo"), aggregate(values, mask, "seq-mean-token-mean")
    )
    torch.testing.assert_close(
        aggregate(values, mask, "dr_grpo", max_length=6),
        aggregate(values, mask, "seq-mean-token-sum") / 6,
    )
    values, mask = batch(5, 5, 6, 2)  # and differ, by the empty rows' share, when some have none
    torch.testing.assert_close(
        aggregate(values, mask, "grpo"), aggregate(values, mask, "seq-mean-token-mean") * 3 / 5
    )


@pytest.mark.parametrize("alias", list(AGGREGATION_ALIASES))
def test_packed_alias_equals_padded(alias: str) -> None:
    lengths = [3, 1, 4]
    values, mask = batch(6, 3, 4, 1)
    kwargs = {"max_length": 4} if alias in ("dr_grpo", "seq-mean-token-sum-norm") else {}
    for r, n in enumerate(lengths):
        mask[r, n:] = False
    packed_v = torch.cat([values[r, :n] for r, n in enumerate(lengths)])[None]
    packed_m = torch.cat([mask[r, :n] for r, n in enumerate(lengths)])[None]
    ids = sequence_ids(position_ids=torch.cat([torch.arange(n) for n in lengths])[None])
    torch.testing.assert_close(
        aggregate(packed_v, packed_m, alias, sequence_ids=ids, **kwargs),
        aggregate(values, mask, alias, **kwargs),
    )


BAD = [
    ("dr_grpo", {}, "mode 'dr_grpo' needs max_length="),
    ("token-mean", {"max_length": 4}, "max_length is used only by the modes"),
    ("grpo", {"max_length": 4}, "max_length is used only by the modes"),
    ("dr_grpo", {"max_length": 0}, "max_length must be finite and positive"),
    ("dr_grpo", {"max_length": math.inf}, "max_length must be finite and positive"),
    ("seq-mean-token-sum-norm", {"max_length": -1.0}, "max_length must be finite and positive"),
    ("dr_grpo", {"max_length": 10**400}, "max_length must fit a float"),
    ("luspo", {}, "mode must be one of"),
]


@pytest.mark.parametrize(("mode", "kwargs", "match"), BAD)
def test_bad_alias_arguments_are_refused_by_name(
    mode: str, kwargs: dict[str, object], match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        aggregate(torch.zeros(2, 3), torch.ones(2, 3), mode, **kwargs)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="max_length must be a real number"):
        aggregate(torch.zeros(2, 3), torch.ones(2, 3), "dr_grpo", max_length="8")  # type: ignore[arg-type]


def test_the_mode_list_names_every_alias() -> None:
    with pytest.raises(ValueError, match=r"'grpo'.*'seq-mean-token-sum-norm'"):
        aggregate(torch.zeros(1, 1), torch.ones(1, 1), "nope")
    assert set(AGGREGATION_ALIASES.values()) <= set(AGGREGATION_MODES)
