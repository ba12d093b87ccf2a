"""Controllers of the KL coefficient β: fixed, Ziegler's proportional rule, the doubling rule.

Chapter 5 of the book. Every controller follows one protocol, so a trainer can swap them:
``kl_coef``, ``get_coef()``, ``update(current_kl, n_steps=1)`` returning the new coefficient,
``kl_history``/``coef_history`` (one entry per update), and ``state_dict()`` /
``load_state_dict()`` with plain Python numbers and lists, so that a run can be checkpointed
with ``json`` or ``torch.save`` and resumed exactly.

Names: :class:`AdaptiveKLController` is Ziegler et al.'s proportional rule, under the name and
signature that TRL, verl, OpenRLHF and torchrl give it. The RLHF handbook's class of that name
is the multiplicative doubling rule: here it is :class:`DoublingKLController`. klpen 0.1 had
them the other way round (``AdaptiveKLController`` doubling, ``ProportionalKLController``
proportional); state dicts saved by those classes are refused with a message saying which class
to use now.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, ClassVar

from ._validation import _as_real, check_positive

__all__ = [
    "AdaptiveKLController",
    "DoublingKLController",
    "FixedKLController",
    "KLController",
]

# What klpen 0.1's classes were, keyed by the "type" their state dicts carry (they had no
# "rule" key): the advice given when such a state is loaded.
_FORMER = {
    "AdaptiveKLController": (
        "klpen 0.1's AdaptiveKLController, the doubling rule, which is now "
        "DoublingKLController (AdaptiveKLController is now Ziegler's proportional rule); "
        "continue with DoublingKLController(init_kl_coef=state['kl_coef'], "
        "target_kl=state['target_kl'])"
    ),
    "ProportionalKLController": (
        "klpen 0.1's ProportionalKLController, which is now AdaptiveKLController; continue "
        "with AdaptiveKLController(init_kl_coef=state['kl_coef'], "
        "target_kl=state['target_kl'], horizon=state['horizon'])"
    ),
}


def _real_list(key: str, values: object) -> list[float]:
    """A state's history: a list of finite Python reals (what ``json`` round-trips)."""
    if not isinstance(values, list | tuple):
        raise TypeError(f"state[{key!r}] must be a list, got {type(values).__name__}")
    out = []
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, numbers.Real):
            raise TypeError(f"state[{key!r}][{i}] must be a Python number, got {v!r}")
        x = _as_real(f"state[{key!r}][{i}]", v)
        if not math.isfinite(x):
            raise ValueError(f"state[{key!r}][{i}] must be finite, got {x}")
        out.append(x)
    return out


class KLController:
    """Shared protocol of the KL-coefficient controllers; subclasses define ``_next_coef``.

    Attributes:
        kl_coef: the current coefficient β.
        kl_history: every ``current_kl`` passed to :meth:`update`, in order.
        coef_history: the coefficient returned by each :meth:`update`, in order.
    """

    #: names of the constructor's parameters that ``state_dict`` records
    _params: ClassVar[tuple[str, ...]] = ()
    #: the rule's name, stored in the state dict next to the class name
    rule: ClassVar[str] = ""

    def __init__(self, kl_coef: float, name: str = "init_kl_coef") -> None:
        self.kl_coef = check_positive(name, kl_coef)
        self.kl_history: list[float] = []
        self.coef_history: list[float] = []

    def get_coef(self) -> float:
        """The current coefficient β."""
        return self.kl_coef

    def _next_coef(self, current_kl: float, n_steps: int) -> float:
        raise NotImplementedError

    def _check_step(
        self, previous: float | None, current_kl: float, coef: float, index: int
    ) -> None:
        """Raise ``ValueError`` unless ``update`` can go from ``previous`` (``None``: the
        unknown initial β) to ``coef`` when shown ``current_kl``."""

    def update(self, current_kl: float, n_steps: int = 1) -> float:
        """Record ``current_kl`` (the measured KL of the latest batch) and adapt β.

        Args:
            current_kl: a finite real number (a Python number or a one-element tensor).
            n_steps: how many samples or steps the measurement covers (used by the
                proportional rule; the others ignore it). A positive integer that fits a
                float (below 1.8e308).

        Returns:
            The new coefficient. A non-finite ``current_kl`` raises ``ValueError`` and leaves
            the controller unchanged, as does a step that would make the coefficient
            non-positive (the proportional rule with ``n_steps > 5 * horizon``).
        """
        kl = _as_real("current_kl", current_kl)
        if not math.isfinite(kl):
            raise ValueError(f"current_kl must be finite, got {kl}")
        if isinstance(n_steps, bool) or not isinstance(n_steps, numbers.Integral) or n_steps < 1:
            raise ValueError(f"n_steps must be a positive integer, got {n_steps!r}")
        # The rule computes in floats: an integer beyond float64's range would raise a bare
        # OverflowError there (10**400), so it is refused here, by name.
        _as_real("n_steps", n_steps)
        coef = self._next_coef(kl, int(n_steps))
        # The proportional rule multiplies by 1 + e * n_steps / horizon, which is <= 0 once
        # n_steps > 5 * horizon with e = -0.2: refuse rather than hold a β that the state dict
        # (and every function taking a kl_coef) rejects.
        if not (math.isfinite(coef) and coef > 0):
            raise ValueError(
                f"update(current_kl={kl}, n_steps={n_steps}) would set kl_coef to {coef}; "
                "it must stay finite and positive (is n_steps large against horizon?)"
            )
        self.kl_coef = coef
        self.kl_history.append(kl)
        self.coef_history.append(self.kl_coef)
        return self.kl_coef

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume: plain numbers and lists (``json``/``torch.save`` safe).

        Carries the class name (``"type"``) and the rule (``"rule"``), so that a state is
        only ever loaded into the controller that produced it.
        """
        state: dict[str, Any] = {
            "type": type(self).__name__,
            "rule": self.rule,
            "kl_coef": self.kl_coef,
        }
        state.update({name: getattr(self, name) for name in self._params})
        state["kl_history"] = list(self.kl_history)
        state["coef_history"] = list(self.coef_history)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (from this class), validating it first.

        Only a state that :meth:`update` could have produced is accepted: the class and rule
        of this controller, finite positive parameters, finite histories of equal length whose
        coefficients are positive, the last of them the current ``kl_coef``, each step one
        that this rule can take, and no key that :meth:`state_dict` does not write. Nothing is
        changed unless the whole state is valid.

        Raises:
            TypeError, ValueError: anything else, including states saved by klpen 0.1's
                ``AdaptiveKLController`` (the doubling rule, now
                :class:`~klpen.DoublingKLController`) and ``ProportionalKLController`` (now
                :class:`~klpen.AdaptiveKLController`).
        """
        if not isinstance(state, dict):
            raise TypeError(f"state must be a dict from state_dict(), got {type(state).__name__}")
        kind, rule = state.get("type"), state.get("rule")
        if "rule" not in state and isinstance(kind, str) and kind in _FORMER:
            raise ValueError(f"state was saved by {_FORMER[kind]}")
        expected = type(self).__name__
        if kind != expected or rule != self.rule:
            raise ValueError(
                f"state is for {kind!r} (rule {rule!r}), not {expected!r} (rule {self.rule!r})"
            )
        keys = ("kl_coef", *self._params, "kl_history", "coef_history")
        missing = [k for k in keys if k not in state]
        if missing:
            raise ValueError(f"state is missing the keys {missing}")
        # A key state_dict never writes (a horizon in a doubling controller's state) is a
        # state from somewhere else: refused, not ignored.
        unknown = sorted(repr(k) for k in state if k not in ("type", "rule", *keys))
        if unknown:
            raise ValueError(
                f"state has keys that {expected}.state_dict() never writes: {', '.join(unknown)} "
                f"(it writes {['type', 'rule', *keys]})"
            )
        coef = check_positive("state['kl_coef']", state["kl_coef"])
        params = {name: check_positive(f"state[{name!r}]", state[name]) for name in self._params}
        kls = _real_list("kl_history", state["kl_history"])
        coefs = _real_list("coef_history", state["coef_history"])
        if len(kls) != len(coefs):
            raise ValueError(
                "state['kl_history'] and state['coef_history'] must have one entry per update, "
                f"got {len(kls)} and {len(coefs)}"
            )
        if any(c <= 0 for c in coefs):
            raise ValueError(f"state['coef_history'] must be positive, got {coefs}")
        if coefs and coefs[-1] != coef:
            raise ValueError(
                f"state['kl_coef'] ({coef}) must be the last entry of state['coef_history'] "
                f"({coefs[-1]}): update returns the coefficient it sets"
            )
        # Check the steps on a scratch copy, so that a bad state changes nothing.
        probe = type(self).__new__(type(self))
        probe.__dict__.update(self.__dict__)
        probe.__dict__.update(params)
        for i, (kl, c) in enumerate(zip(kls, coefs, strict=True)):
            probe._check_step(coefs[i - 1] if i else None, kl, c, i)
        self.kl_coef = coef
        for name, value in params.items():
            setattr(self, name, value)
        self.kl_history = kls
        self.coef_history = coefs

    def __repr__(self) -> str:
        params = ", ".join(f"{name}={getattr(self, name)!r}" for name in self._params)
        sep = ", " if params else ""
        return f"{type(self).__name__}(kl_coef={self.kl_coef!r}{sep}{params})"


def _impossible(index: int, previous: float | None, kl: float, coef: float, why: str) -> ValueError:
    return ValueError(
        f"state['coef_history'][{index}] = {coef} cannot follow {previous} after "
        f"current_kl = {kl}: {why}"
    )


class FixedKLController(KLController):
    """A constant β: ``update`` records the KL and returns the coefficient unchanged.

    Example:
        >>> ctl = FixedKLController(0.05)
        >>> ctl.update(12.0), ctl.get_coef()
        (0.05, 0.05)
    """

    rule = "fixed"

    def __init__(self, kl_coef: float) -> None:
        super().__init__(kl_coef, "kl_coef")

    def _next_coef(self, current_kl: float, n_steps: int) -> float:
        return self.kl_coef

    def _check_step(
        self, previous: float | None, current_kl: float, coef: float, index: int
    ) -> None:
        if previous is not None and coef != previous:
            raise _impossible(index, previous, current_kl, coef, "a fixed β never changes")


class AdaptiveKLController(KLController):
    r"""The proportional rule of Ziegler et al. (2019), as TRL, verl, OpenRLHF and torchrl name it.

    .. math::
        \begin{aligned}
        e &= \operatorname{clip}\Big(\frac{\mathrm{KL}}{\mathrm{KL}_\mathrm{target}} - 1,
        -0.2, 0.2\Big), \\
        \beta &\leftarrow \beta\,\Big(1 + e\,\frac{n_\mathrm{steps}}{H}\Big)
        \end{aligned}

    ``update(current_kl, n_steps=1)``: ``n_steps`` is how many samples (or steps) the
    measurement covers, in the unit of ``horizon``.

    Args:
        init_kl_coef: initial β, finite and positive.
        target_kl: the KL the run aims for, finite and positive.
        horizon: ``H``, how many samples the correction is spread over; finite and positive.

    Example:
        >>> ctl = AdaptiveKLController(init_kl_coef=0.1, target_kl=6.0, horizon=10)
        >>> round(ctl.update(12.0, n_steps=1), 6)   # error clipped to +0.2
        0.102
    """

    rule = "proportional"
    _params = ("target_kl", "horizon")

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: float) -> None:
        super().__init__(init_kl_coef)
        self.target_kl = check_positive("target_kl", target_kl)
        self.horizon = check_positive("horizon", horizon)

    def _next_coef(self, current_kl: float, n_steps: int) -> float:
        error = min(max(current_kl / self.target_kl - 1.0, -0.2), 0.2)
        return self.kl_coef * (1.0 + error * n_steps / self.horizon)

    def _check_step(
        self, previous: float | None, current_kl: float, coef: float, index: int
    ) -> None:
        # n_steps is not recorded, so only the direction of the step is known: β grows when
        # the KL is above target, shrinks below it, stays on it.
        if previous is None:
            return
        error = current_kl - self.target_kl
        if (error > 0 and coef < previous) or (error < 0 and coef > previous):
            raise _impossible(
                index, previous, current_kl, coef, f"β moves toward the target {self.target_kl}"
            )
        if error == 0 and coef != previous:
            raise _impossible(index, previous, current_kl, coef, "the KL is on target")


class DoublingKLController(KLController):
    r"""The multiplicative ("doubling") rule of the RLHF handbook (its ``AdaptiveKLController``).

    .. math::
        \begin{aligned}
        \beta &\leftarrow \operatorname{clip}(\beta \cdot f,\ 0.001,\ 10), \\
        f &= \begin{cases} 2 & \mathrm{KL} > 1.5\,\mathrm{KL}_\mathrm{target} \\
        1/2 & \mathrm{KL} < \mathrm{KL}_\mathrm{target}/1.5 \\ 1 & \text{otherwise}
        \end{cases}
        \end{aligned}

    It has no ``horizon``: the rule has no use for one, and an argument that is accepted and
    ignored is a trap. ``update(current_kl)`` also takes ``n_steps`` for the common protocol,
    and ignores it.

    Args:
        init_kl_coef: initial β, finite and positive.
        target_kl: the KL the run aims for, finite and positive.

    Example:
        >>> ctl = DoublingKLController(init_kl_coef=0.1, target_kl=6.0)
        >>> [ctl.update(kl) for kl in (20.0, 6.0, 1.0)]
        [0.2, 0.2, 0.1]
    """

    rule = "doubling"
    _params = ("target_kl",)
    #: β never leaves this range
    MIN_COEF: ClassVar[float] = 0.001
    MAX_COEF: ClassVar[float] = 10.0

    def __init__(self, init_kl_coef: float = 0.1, target_kl: float = 6.0) -> None:
        super().__init__(init_kl_coef)
        self.target_kl = check_positive("target_kl", target_kl)

    def _next_coef(self, current_kl: float, n_steps: int) -> float:
        coef = self.kl_coef
        if current_kl > 1.5 * self.target_kl:
            coef *= 2.0
        elif current_kl < self.target_kl / 1.5:
            coef *= 0.5
        return min(max(coef, self.MIN_COEF), self.MAX_COEF)

    def _check_step(
        self, previous: float | None, current_kl: float, coef: float, index: int
    ) -> None:
        if previous is None:  # the initial β is unknown, but every update clips
            if not self.MIN_COEF <= coef <= self.MAX_COEF:
                raise ValueError(
                    f"state['coef_history'][{index}] must lie in [{self.MIN_COEF}, "
                    f"{self.MAX_COEF}] (update clips β to it), got {coef}"
                )
            return
        # Doubling, halving and clipping are exact in floating point: the step is determined.
        self.kl_coef = previous
        expected = self._next_coef(current_kl, 1)
        if coef != expected:
            raise _impossible(
                index, previous, current_kl, coef, f"the doubling rule gives {expected}"
            )
