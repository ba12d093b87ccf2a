"""KL-coefficient controllers: the shared protocol, the two update rules, checkpoints.

The rules are re-derived here from their sources (the RLHF handbook's doubling rule, Ziegler et
al. 2019's proportional rule) as small pure-Python functions, and the controllers are run
against them over hypothesis-generated KL sequences.
"""

from __future__ import annotations

import io
import json
import math
from collections.abc import Callable

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from klpen import (
    AdaptiveKLController,
    DoublingKLController,
    FixedKLController,
    KLController,
)

FACTORIES: dict[str, Callable[[], KLController]] = {
    "fixed": lambda: FixedKLController(0.05),
    "doubling": lambda: DoublingKLController(init_kl_coef=0.2, target_kl=6.0),
    "adaptive": lambda: AdaptiveKLController(0.2, target_kl=6.0, horizon=50),
}

kls = st.lists(st.floats(-5.0, 40.0, allow_nan=False), min_size=0, max_size=30)


def handbook_rule(coef: float, kl: float, target: float) -> float:
    """The RLHF handbook's multiplicative rule, as written there."""
    if kl > 1.5 * target:
        coef = coef * 2
    elif kl < target / 1.5:
        coef = coef / 2
    return min(max(coef, 0.001), 10.0)


def ziegler_rule(coef: float, kl: float, target: float, n_steps: int, horizon: float) -> float:
    """Ziegler et al. (2019): proportional error clipped to ±0.2."""
    error = min(max(kl / target - 1, -0.2), 0.2)
    return coef * (1 + error * n_steps / horizon)


# ---------------------------------------------------------------- shared protocol


@pytest.mark.parametrize("kind", FACTORIES)
@given(values=kls)
def test_protocol_histories_and_return_value(kind: str, values: list[float]) -> None:
    ctl = FACTORIES[kind]()
    first = ctl.kl_coef
    assert ctl.get_coef() == first and ctl.kl_history == [] and ctl.coef_history == []
    returned = [ctl.update(kl) for kl in values]
    assert ctl.kl_history == values
    assert ctl.coef_history == returned
    assert ctl.get_coef() == ctl.kl_coef == (returned[-1] if returned else first)
    assert all(type(c) is float and c > 0 for c in returned)


@pytest.mark.parametrize("kind", FACTORIES)
def test_update_accepts_one_element_tensors_and_numpy_numbers(kind: str) -> None:
    import numpy as np

    ctl = FACTORIES[kind]()
    ctl.update(torch.tensor(7.0))
    ctl.update(torch.tensor([2.0], requires_grad=True))
    ctl.update(np.float32(3.5))
    ctl.update(4)
    assert ctl.kl_history == [7.0, 2.0, 3.5, 4.0]
    assert all(type(v) is float for v in ctl.kl_history)


@pytest.mark.parametrize("kind", FACTORIES)
@pytest.mark.parametrize(
    "bad", [math.nan, math.inf, -math.inf, torch.tensor(math.nan), torch.tensor(math.inf)]
)
def test_non_finite_kl_raises_and_leaves_the_state_unchanged(kind: str, bad: object) -> None:
    ctl = FACTORIES[kind]()
    for kl in (1.0, 20.0, 6.0):
        ctl.update(kl)
    before = ctl.state_dict()
    with pytest.raises(ValueError, match=r"current_kl must be finite, got (nan|inf|-inf)"):
        ctl.update(bad)  # type: ignore[arg-type]
    assert ctl.state_dict() == before


@pytest.mark.parametrize("kind", FACTORIES)
@pytest.mark.parametrize("bad", ["3.0", None, True, [1.0], torch.tensor([1.0, 2.0])])
def test_non_number_kl_raises_and_leaves_the_state_unchanged(kind: str, bad: object) -> None:
    ctl = FACTORIES[kind]()
    ctl.update(3.0)
    before = ctl.state_dict()
    with pytest.raises((TypeError, ValueError), match="current_kl"):
        ctl.update(bad)  # type: ignore[arg-type]
    assert ctl.state_dict() == before


@pytest.mark.parametrize("kind", FACTORIES)
@pytest.mark.parametrize("bad", [0, -3, 1.5, True, "2"])
def test_bad_n_steps_raises_and_leaves_the_state_unchanged(kind: str, bad: object) -> None:
    ctl = FACTORIES[kind]()
    before = ctl.state_dict()
    with pytest.raises(ValueError, match=r"n_steps must be a positive integer, got"):
        ctl.update(3.0, n_steps=bad)  # type: ignore[arg-type]
    assert ctl.state_dict() == before


# ---------------------------------------------------------------- checkpoints


@pytest.mark.parametrize("kind", FACTORIES)
@given(before=kls, after=kls)
def test_state_dict_round_trips_through_json_and_resumes_identically(
    kind: str, before: list[float], after: list[float]
) -> None:
    ctl = FACTORIES[kind]()
    for kl in before:
        ctl.update(kl)
    state = ctl.state_dict()
    restored = FACTORIES[kind]()
    restored.load_state_dict(json.loads(json.dumps(state)))
    assert restored.state_dict() == state
    assert [restored.update(kl) for kl in after] == [ctl.update(kl) for kl in after]
    assert restored.state_dict() == ctl.state_dict()


@pytest.mark.parametrize("kind", FACTORIES)
@pytest.mark.parametrize("weights_only", [True, False])
def test_state_dict_round_trips_through_torch_save(kind: str, weights_only: bool) -> None:
    ctl = FACTORIES[kind]()
    for kl in (1.0, 15.0, 6.5, 0.2):
        ctl.update(kl)
    buffer = io.BytesIO()
    torch.save(ctl.state_dict(), buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=weights_only)
    restored = FACTORIES[kind]()
    restored.load_state_dict(loaded)
    assert restored.state_dict() == ctl.state_dict()
    for kl in (30.0, 0.5, 6.0):
        assert restored.update(kl) == ctl.update(kl)


@pytest.mark.parametrize("kind", FACTORIES)
def test_state_dict_holds_only_plain_python_values(kind: str) -> None:
    ctl = FACTORIES[kind]()
    ctl.update(torch.tensor(3.0))
    state = ctl.state_dict()
    assert type(state) is dict

    def plain(x: object) -> bool:
        if isinstance(x, list):
            return all(plain(v) for v in x)
        return type(x) in (str, int, float)

    assert all(type(k) is str and plain(v) for k, v in state.items())
    # a copy, not the live lists: a later update does not change a saved state
    ctl.update(1.0)
    assert len(state["kl_history"]) == 1


@pytest.mark.parametrize("source", FACTORIES)
@pytest.mark.parametrize("target", FACTORIES)
def test_state_of_one_kind_is_refused_by_another(source: str, target: str) -> None:
    if source == target:
        return
    state = FACTORIES[source]().state_dict()
    ctl = FACTORIES[target]()
    with pytest.raises(ValueError, match=rf"{type(ctl).__name__}"):
        ctl.load_state_dict(state)


@pytest.mark.parametrize("kind", FACTORIES)
def test_corrupt_states_are_refused_and_leave_the_controller_unchanged(kind: str) -> None:
    ctl = FACTORIES[kind]()
    ctl.update(2.0)
    good = ctl.state_dict()
    snapshot = dict(good)
    corrupt: list[tuple[dict[str, object] | object, type[Exception], str]] = [
        ({k: v for k, v in good.items() if k != "kl_history"}, ValueError, "missing"),
        ({**good, "kl_coef": -1.0}, ValueError, r"state\['kl_coef'\].*-1.0"),
        ({**good, "kl_coef": math.nan}, ValueError, r"state\['kl_coef'\]"),
        ({**good, "coef_history": "abc"}, TypeError, r"state\['coef_history'\] must be a list"),
        ({**good, "kl_history": [1.0, "x"]}, TypeError, r"state\['kl_history'\]"),
        ([1, 2], TypeError, "state must be a dict"),
    ]
    for state, exc, match in corrupt:
        with pytest.raises(exc, match=match):
            ctl.load_state_dict(state)  # type: ignore[arg-type]
        assert ctl.state_dict() == snapshot


# ---------------------------------------------------------------- constructors


@pytest.mark.parametrize(
    ("make", "name"),
    [
        (lambda v: FixedKLController(v), "kl_coef"),
        (lambda v: DoublingKLController(init_kl_coef=v), "init_kl_coef"),
        (lambda v: DoublingKLController(target_kl=v), "target_kl"),
        (lambda v: AdaptiveKLController(v, 6.0, 100), "init_kl_coef"),
        (lambda v: AdaptiveKLController(0.1, v, 100), "target_kl"),
        (lambda v: AdaptiveKLController(0.1, 6.0, v), "horizon"),
    ],
)
@pytest.mark.parametrize(
    ("bad", "exc"),
    [
        (0.0, ValueError),
        (-0.1, ValueError),
        (math.nan, ValueError),
        (math.inf, ValueError),
        (-math.inf, ValueError),
        (True, TypeError),
        ("0.1", TypeError),
        (None, TypeError),
    ],
)
def test_constructors_reject_bad_values(
    make: Callable[[object], KLController], name: str, bad: object, exc: type[Exception]
) -> None:
    with pytest.raises(exc, match=rf"^{name} must be .*got .*{bad}"):
        make(bad)


def test_doubling_defaults_are_the_handbooks_and_it_takes_no_horizon() -> None:
    ctl = DoublingKLController()
    assert (ctl.kl_coef, ctl.target_kl) == (0.1, 6.0)
    assert not hasattr(ctl, "horizon")
    with pytest.raises(TypeError):
        DoublingKLController(0.1, 6.0, 100)  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        DoublingKLController(horizon=100)  # type: ignore[call-arg]


def test_adaptive_is_ziegler_and_requires_its_three_arguments() -> None:
    with pytest.raises(TypeError):
        AdaptiveKLController()  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        AdaptiveKLController(0.1, 6.0)  # type: ignore[call-arg]
    ctl = AdaptiveKLController(init_kl_coef=0.1, target_kl=6.0, horizon=10)
    # the handbook's doubling rule would give 0.2 here; Ziegler's rule moves 2%
    assert ctl.update(20.0) == pytest.approx(0.102, rel=1e-15)
    assert "proportional" in (AdaptiveKLController.__doc__ or "")


def test_repr_names_the_parameters() -> None:
    text = repr(AdaptiveKLController(0.1, 6.0, 100))
    assert text == "AdaptiveKLController(kl_coef=0.1, target_kl=6.0, horizon=100.0)"


# ---------------------------------------------------------------- the three rules


@given(values=kls, coef=st.floats(1e-4, 20.0))
def test_fixed_never_changes(values: list[float], coef: float) -> None:
    ctl = FixedKLController(coef)
    assert all(ctl.update(kl) == coef for kl in values)
    assert ctl.coef_history == [coef] * len(values)


@given(
    values=kls,
    init=st.floats(1e-4, 20.0),
    target=st.floats(0.1, 20.0),
)
def test_doubling_follows_the_handbook_rule(
    values: list[float], init: float, target: float
) -> None:
    ctl = DoublingKLController(init_kl_coef=init, target_kl=target)
    coef = init
    for kl in values:
        coef = handbook_rule(coef, kl, target)
        assert ctl.update(kl) == coef


def test_doubling_docstring_and_boundaries() -> None:
    ctl = DoublingKLController(init_kl_coef=0.1, target_kl=6.0)
    assert [ctl.update(kl) for kl in (20.0, 6.0, 1.0)] == [0.2, 0.2, 0.1]
    # exactly on the thresholds nothing changes: the comparisons are strict
    ctl = DoublingKLController(init_kl_coef=0.1, target_kl=6.0)
    assert ctl.update(9.0) == 0.1 and ctl.update(4.0) == 0.1
    assert ctl.update(9.000001) == 0.2 and ctl.update(3.999999) == 0.1


def test_doubling_clamps_to_the_handbook_range() -> None:
    up = DoublingKLController(init_kl_coef=3.0, target_kl=1.0)
    assert [up.update(100.0) for _ in range(4)] == [6.0, 10.0, 10.0, 10.0]
    down = DoublingKLController(init_kl_coef=0.004, target_kl=1.0)
    assert [down.update(0.0) for _ in range(4)] == [0.002, 0.001, 0.001, 0.001]
    outside = DoublingKLController(init_kl_coef=50.0, target_kl=1.0)
    assert outside.update(1.0) == 10.0  # the first update brings it into range


@given(
    steps=st.lists(
        st.tuples(st.floats(-5.0, 40.0, allow_nan=False), st.integers(1, 8)), max_size=30
    ),
    init=st.floats(1e-3, 5.0),
    target=st.floats(0.1, 20.0),
    horizon=st.floats(40.0, 1e5),
)
def test_adaptive_follows_ziegler(
    steps: list[tuple[float, int]], init: float, target: float, horizon: float
) -> None:
    ctl = AdaptiveKLController(init, target, horizon)
    coef = init
    for kl, n in steps:
        coef = ziegler_rule(coef, kl, target, n, horizon)
        assert ctl.update(kl, n_steps=n) == pytest.approx(coef, rel=1e-13)


def test_adaptive_docstring_and_clip() -> None:
    ctl = AdaptiveKLController(init_kl_coef=0.1, target_kl=6.0, horizon=10)
    assert ctl.update(12.0, n_steps=1) == pytest.approx(0.102, rel=1e-15)  # +0.2, clipped
    ctl = AdaptiveKLController(init_kl_coef=0.1, target_kl=6.0, horizon=10)
    assert ctl.update(6.6) == pytest.approx(0.1 * (1 + 0.1 / 10), rel=1e-15)  # inside the clip
    assert AdaptiveKLController(1.0, 6.0, 10).update(0.0, 5) == pytest.approx(0.9)


def test_adaptive_refuses_a_step_that_would_make_the_coefficient_non_positive() -> None:
    ctl = AdaptiveKLController(0.1, target_kl=6.0, horizon=1.0)
    ctl.update(0.0)  # 0.1 * (1 - 0.2) = 0.08
    before = ctl.state_dict()
    with pytest.raises(ValueError, match=r"kl_coef to -?[0-9.e-]+.*finite and positive"):
        ctl.update(0.0, n_steps=5)  # 1 - 0.2 * 5 = 0
    with pytest.raises(ValueError, match="n_steps"):
        ctl.update(0.0, n_steps=10)
    assert ctl.state_dict() == before


# ---------------------------------------------------------------- states from klpen 0.1


def test_states_saved_by_the_former_classes_are_refused_with_what_to_use() -> None:
    # Exactly what klpen 0.1's state_dict() produced (no "rule" key).
    old_doubling = {
        "type": "AdaptiveKLController",
        "kl_coef": 0.2,
        "target_kl": 6.0,
        "horizon": 10000.0,
        "kl_history": [20.0],
        "coef_history": [0.2],
    }
    old_proportional = {**old_doubling, "type": "ProportionalKLController", "coef_history": [0.2]}
    for ctl in (AdaptiveKLController(0.1, 6.0, 100), DoublingKLController(), FixedKLController(1)):
        before = ctl.state_dict()
        with pytest.raises(ValueError, match=r"doubling rule.*now DoublingKLController"):
            ctl.load_state_dict(old_doubling)
        with pytest.raises(ValueError, match=r"ProportionalKLController.*now AdaptiveKLController"):
            ctl.load_state_dict(old_proportional)
        assert ctl.state_dict() == before


def test_state_dict_records_class_and_rule() -> None:
    assert FACTORIES["doubling"]().state_dict()["type"] == "DoublingKLController"
    assert [FACTORIES[k]().state_dict()["rule"] for k in ("fixed", "doubling", "adaptive")] == [
        "fixed",
        "doubling",
        "proportional",
    ]
    # a state of the new AdaptiveKLController with its rule changed is not loadable
    state = FACTORIES["adaptive"]().state_dict()
    with pytest.raises(ValueError, match="rule"):
        FACTORIES["adaptive"]().load_state_dict({**state, "rule": "doubling"})


# ---------------------------------------------------------------- impossible states


def _updated(kind: str) -> KLController:
    ctl = FACTORIES[kind]()
    for kl in (20.0, 1.0, 3.0):
        ctl.update(kl)
    return ctl


@pytest.mark.parametrize("kind", FACTORIES)
@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda s: {**s, "kl_history": [*s["kl_history"][:-1], math.nan]}, r"kl_history.*finite"),
        (lambda s: {**s, "kl_history": [*s["kl_history"][:-1], math.inf]}, r"kl_history.*finite"),
        (lambda s: {**s, "coef_history": [math.inf, *s["coef_history"][1:]]}, "coef_history"),
        (lambda s: {**s, "coef_history": [-1.0, *s["coef_history"][1:]]}, "coef_history"),
        (lambda s: {**s, "kl_history": s["kl_history"][:-1]}, "one entry per update"),
        (lambda s: {**s, "kl_coef": s["kl_coef"] * 3}, "last entry"),
        (lambda s: {**s, "kl_coef": 10**400}, "fit a float"),
        (lambda s: {**s, "kl_history": [*s["kl_history"][:-1], 10**400]}, "fit a float"),
        (lambda s: {**s, "kl_history": [*s["kl_history"][:-1], torch.tensor(3.0)]}, "Python"),
        (lambda s: {**s, "kl_history": [*s["kl_history"][:-1], True]}, "Python"),
    ],
)
def test_impossible_states_are_refused_and_change_nothing(
    kind: str, edit: Callable[[dict[str, object]], dict[str, object]], match: str
) -> None:
    ctl = _updated(kind)
    before = ctl.state_dict()
    fresh = FACTORIES[kind]()
    with pytest.raises((TypeError, ValueError), match=match):
        fresh.load_state_dict(edit(ctl.state_dict()))
    with pytest.raises((TypeError, ValueError), match=match):
        ctl.load_state_dict(edit(ctl.state_dict()))
    assert ctl.state_dict() == before
    json.dumps(ctl.state_dict(), allow_nan=False)


def test_steps_the_rule_cannot_take_are_refused() -> None:
    doubling = _updated("doubling")  # coefs 0.4, 0.2, 0.1 after KLs 20, 1, 3
    state = doubling.state_dict()
    assert state["coef_history"] == [0.4, 0.2, 0.1]
    bad = {**state, "coef_history": [0.4, 0.8, 0.1], "kl_coef": 0.1}
    with pytest.raises(ValueError, match=r"coef_history'\]\[1\].*doubling rule gives 0.2"):
        DoublingKLController().load_state_dict(bad)
    with pytest.raises(ValueError, match=r"\[0.001, 10.0\]"):
        DoublingKLController().load_state_dict(
            {**state, "coef_history": [40.0], "kl_history": [20.0], "kl_coef": 40.0}
        )
    fixed = _updated("fixed").state_dict()
    with pytest.raises(ValueError, match="fixed β never changes"):
        FixedKLController(1.0).load_state_dict({**fixed, "coef_history": [0.05, 0.06, 0.05]})
    adaptive = _updated("adaptive").state_dict()  # KL 1.0 < target: β must not grow there
    grown = list(adaptive["coef_history"])
    grown[1] = grown[0] * 1.5
    with pytest.raises(ValueError, match="toward the target"):
        AdaptiveKLController(1, 1, 1).load_state_dict({**adaptive, "coef_history": grown})


@pytest.mark.parametrize("kind", FACTORIES)
def test_numbers_that_do_not_fit_a_float_are_refused_by_name(kind: str) -> None:
    ctl = FACTORIES[kind]()
    before = ctl.state_dict()
    with pytest.raises(ValueError, match=r"current_kl must fit a float"):
        ctl.update(10**400)
    assert ctl.state_dict() == before
    with pytest.raises(ValueError, match=r"kl_coef must fit a float"):
        FixedKLController(10**400)
    with pytest.raises(ValueError, match=r"init_kl_coef must fit a float"):
        DoublingKLController(-(10**400))
    with pytest.raises(ValueError, match=r"horizon must fit a float"):
        AdaptiveKLController(0.1, 6.0, 10**400)
