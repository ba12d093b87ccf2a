"""klpen_book.distillation_study: the machinery of chapter 10, against independent references."""

from __future__ import annotations

import pytest
import torch

from klpen import generalized_jsd, linear_generalized_jsd
from klpen_book import distillation_study as ds
from klpen_book import language as lm

F64 = torch.float64


@pytest.fixture(scope="module")
def pair() -> tuple[object, object]:
    """An untrained teacher (width 64) and student (width 8): fast, and enough for shapes."""
    return lm.tiny_gpt2(seed=0), ds.tiny_student(seed=1)


def test_rollout_hidden_states_give_the_logits(pair: tuple[object, object]) -> None:
    teacher, student = pair
    batch = ds.rollout(student, teacher, lm.prompts(4), seed=3)
    n = batch.mask.shape[1]
    assert batch.sequences.shape == (4, 2 + n)
    assert batch.student_logits.shape == (4, n, len(lm.WORDS))
    assert batch.student_hidden.shape[-1] == 8 and batch.teacher_hidden.shape[-1] == 64
    # the last hidden state is what the output layer reads: the logits are h @ W.T
    torch.testing.assert_close(
        batch.student_hidden @ student.lm_head.weight.T,  # type: ignore[attr-defined]
        batch.student_logits,
    )
    from_hidden = linear_generalized_jsd(
        batch.student_hidden,
        student.lm_head.weight,  # type: ignore[attr-defined]
        batch.teacher_hidden,
        teacher.lm_head.weight,  # type: ignore[attr-defined]
        beta=0.5,
    )
    torch.testing.assert_close(
        from_hidden, generalized_jsd(batch.student_logits, batch.teacher_logits, beta=0.5)
    )


def test_rollout_is_seeded(pair: tuple[object, object]) -> None:
    teacher, student = pair
    a = ds.rollout(student, teacher, lm.prompts(4), seed=5)
    b = ds.rollout(student, teacher, lm.prompts(4), seed=5)
    assert torch.equal(a.sequences, b.sequences)


def test_teacher_samples_have_the_layout_of_the_grammar(pair: tuple[object, object]) -> None:
    rows = ds.teacher_samples(pair[0], 5, seed=2)
    assert rows.shape == (5, lm.MAX_SENTENCE_TOKENS) and bool((rows[:, 0] == lm.BOS_ID).all())
    assert torch.equal(rows, ds.teacher_samples(pair[0], 5, seed=2))


@pytest.mark.parametrize("method", ds.METHODS)
def test_distill_runs_are_deterministic(pair: tuple[object, object], method: str) -> None:
    teacher = pair[0]
    data = lm.sample_sentences(16, seed=0)
    runs = [ds.distill(teacher, method, data=data, steps=2, batch_size=4, seed=1) for _ in range(2)]
    assert runs[0].history == runs[1].history
    assert sorted(runs[0].history) == sorted(ds.DISTILL_KEYS)
    assert all(len(v) == 2 for v in runs[0].history.values())
    assert runs[0].student.config.n_embd == 8


def test_distill_rejects_bad_arguments(pair: tuple[object, object]) -> None:
    teacher = pair[0]
    with pytest.raises(ValueError, match="method must be one of"):
        ds.distill(teacher, "kl", steps=1)
    with pytest.raises(ValueError, match="needs data="):
        ds.distill(teacher, "sft", steps=1)
    with pytest.raises(ValueError, match="beta must lie in"):
        ds.distill(teacher, "jsd", beta=1.5, steps=1)


def test_next_token_distributions_are_the_models_softmax(pair: tuple[object, object]) -> None:
    teacher = pair[0]
    probs = ds.next_token_distributions(teacher, ["the cat"])
    ids = torch.tensor([lm.encode("the cat")[:-1]])
    with torch.no_grad():
        expected = teacher(ids).logits[0, -1].softmax(-1)  # type: ignore[operator]
    torch.testing.assert_close(probs[0], expected)


def test_tail_mass_against_a_loop() -> None:
    gen = torch.Generator().manual_seed(0)
    p = torch.rand(3, 10, generator=gen, dtype=F64).softmax(-1)
    q = (torch.randn(3, 10, generator=gen, dtype=F64) * 3).softmax(-1)
    expected = [sum(float(p[r, v]) for v in range(10) if q[r, v] < 0.05) for r in range(3)]
    torch.testing.assert_close(ds.tail_mass(p, q, below=0.05), torch.tensor(expected, dtype=F64))
    with pytest.raises(ValueError, match="one shape"):
        ds.tail_mass(p, q[:, :5])


def test_topk_rows_contain_the_exact_value_and_close_at_k_equal_v() -> None:
    gen = torch.Generator().manual_seed(1)
    z = torch.randn(2, 6, 30, generator=gen, dtype=F64) * 2
    w = torch.randn(2, 6, 30, generator=gen, dtype=F64) * 3
    mask = torch.ones(2, 6, dtype=torch.bool)
    mask[1, 4:] = False
    rows = ds.topk_rows(z, w, mask, [1, 5, 20, 30])
    exact = float(generalized_jsd(z, w, beta=0.0)[mask].mean())
    for k, estimate, lower, upper, width, value, inside in rows:
        assert value == pytest.approx(exact) and inside == 1.0, k
        assert estimate == lower and lower <= exact + 1e-12 <= upper + 2e-12
        assert width == pytest.approx(upper - lower)
    widths = [row[4] for row in rows]
    assert widths == sorted(widths, reverse=True) and widths[-1] == pytest.approx(0.0, abs=1e-12)


def test_distill_table_and_figures() -> None:
    run = ds.DistillRun(None, {k: [2.0, 1.0] for k in ds.DISTILL_KEYS}, ["a", "b", "a"])
    table = ds.distill_table({"x": run}, last=2)
    assert "1.500" in table and table.splitlines()[-1].endswith("2")
    fig = ds.plot_kl_curves({"x": run})
    assert [ax.get_yscale() for ax in fig.axes] == ["log", "log"]
    t = torch.full((6, 4), 0.25, dtype=F64)
    assert len(ds.plot_next_token(t, {"x": t}).axes) == 2
    with pytest.raises(ValueError, match="one row per context"):
        ds.plot_next_token(t[:2], {"x": t[:2]})
