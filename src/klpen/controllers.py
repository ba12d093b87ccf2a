"""Controllers of the KL coefficient β: fixed, the doubling rule, the proportional rule.

Chapter 5 of the book. Every controller follows one protocol, so a trainer can swap them:
``kl_coef``, ``get_coef()``, ``update(current_kl, n_steps=1)`` returning the new coefficient,
``kl_history``/``coef_history`` (one entry per update), and ``state_dict()`` /
``load_state_dict()`` with plain Python numbers and lists, so that a run can be checkpointed
with ``json`` or ``torch.save`` and resumed exactly.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, ClassVar

from ._validation import _as_real, check_positive

__all__ = [
    "AdaptiveKLController",
    "FixedKLController",
    "KLController",
    "ProportionalKLController",
]


class KLController:
    """Shared protocol of the KL-coefficient controllers; subclasses define ``_next_coef``.

    Attributes:
        kl_coef: the current coefficient β.
        kl_history: every ``current_kl`` passed to :meth:`update`, in order.
        coef_history: the coefficient returned by each :meth:`update`, in order.
    """

    #: names of the constructor's parameters that ``state_dict`` records
    _params: ClassVar[tuple[str, ...]] = ()

    def __init__(self, kl_coef: float) -> None:
        self.kl_coef = check_positive("init_kl_coef", kl_coef)
        self.kl_history: list[float] = []
        self.coef_history: list[float] = []

    def get_coef(self) -> float:
        """The current coefficient β."""
        return self.kl_coef

    def _next_coef(self, current_kl: float, n_steps: int) -> float:
        raise NotImplementedError

    def update(self, current_kl: float, n_steps: int = 1) -> float:
        """Record ``current_kl`` (the measured KL of the latest batch) and adapt β.

        Args:
            current_kl: a finite real number (a Python number or a one-element tensor).
            n_steps: how many samples or steps the measurement covers (used by the
                proportional rule; the others ignore it). A positive integer.

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
        """Everything needed to resume: plain numbers and lists (``json``/``torch.save`` safe)."""
        state: dict[str, Any] = {"type": type(self).__name__, "kl_coef": self.kl_coef}
        state.update({name: getattr(self, name) for name in self._params})
        state["kl_history"] = list(self.kl_history)
        state["coef_history"] = list(self.coef_history)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (from this class), validating it first."""
        if not isinstance(state, dict):
            raise TypeError(f"state must be a dict from state_dict(), got {type(state).__name__}")
        expected = type(self).__name__
        if state.get("type") != expected:
            raise ValueError(f"state is for {state.get('type')!r}, not {expected!r}")
        keys = ("kl_coef", *self._params, "kl_history", "coef_history")
        missing = [k for k in keys if k not in state]
        if missing:
            raise ValueError(f"state is missing the keys {missing}")
        coef = check_positive("state['kl_coef']", state["kl_coef"])
        params = {name: check_positive(f"state[{name!r}]", state[name]) for name in self._params}
        histories = {}
        for key in ("kl_history", "coef_history"):
            values = state[key]
            if not isinstance(values, list | tuple):
                raise TypeError(f"state[{key!r}] must be a list, got {type(values).__name__}")
            histories[key] = [_as_real(f"state[{key!r}]", v) for v in values]
        self.kl_coef = coef
        for name, value in params.items():
            setattr(self, name, value)
        self.kl_history = histories["kl_history"]
        self.coef_history = histories["coef_history"]

    def __repr__(self) -> str:
        params = ", ".join(f"{name}={getattr(self, name)!r}" for name in self._params)
        sep = ", " if params else ""
        return f"{type(self).__name__}(kl_coef={self.kl_coef!r}{sep}{params})"


class FixedKLController(KLController):
    """A constant β: ``update`` records the KL and returns the coefficient unchanged.

    Example:
        >>> ctl = FixedKLController(0.05)
        >>> ctl.update(12.0), ctl.get_coef()
        (0.05, 0.05)
    """

    def __init__(self, kl_coef: float) -> None:
        super().__init__(check_positive("kl_coef", kl_coef))

    def _next_coef(self, current_kl: float, n_steps: int) -> float:
        return self.kl_coef


class AdaptiveKLController(KLController):
    r"""The multiplicative ("doubling") rule of the RLHF handbook.

    .. math::
        \beta \leftarrow \operatorname{clip}\Big(\beta \cdot
        \begin{cases} 2 & \mathrm{KL} > 1.5\,\mathrm{KL}_\mathrm{target} \\
        1/2 & \mathrm{KL} < \mathrm{KL}_\mathrm{target}/1.5 \\ 1 & \text{otherwise}
        \end{cases},\ 0.001,\ 10\Big)

    Args:
        init_kl_coef: initial β, finite and positive.
        target_kl: the KL the run aims for, finite and positive.
        horizon: kept for the handbook's signature (the proportional rule uses it); finite
            and positive.

    Example:
        >>> ctl = AdaptiveKLController(init_kl_coef=0.1, target_kl=6.0)
        >>> [ctl.update(kl) for kl in (20.0, 6.0, 1.0)]
        [0.2, 0.2, 0.1]
    """

    _params = ("target_kl", "horizon")
    #: β never leaves this range
    MIN_COEF: ClassVar[float] = 0.001
    MAX_COEF: ClassVar[float] = 10.0

    def __init__(
        self, init_kl_coef: float = 0.1, target_kl: float = 6.0, horizon: float = 10000
    ) -> None:
        super().__init__(init_kl_coef)
        self.target_kl = check_positive("target_kl", target_kl)
        self.horizon = check_positive("horizon", horizon)

    def _next_coef(self, current_kl: float, n_steps: int) -> float:
        coef = self.kl_coef
        if current_kl > 1.5 * self.target_kl:
            coef *= 2.0
        elif current_kl < self.target_kl / 1.5:
            coef *= 0.5
        return min(max(coef, self.MIN_COEF), self.MAX_COEF)


class ProportionalKLController(KLController):
    r"""The proportional rule of Ziegler et al. (2019).

    .. math::
        e = \operatorname{clip}\Big(\frac{\mathrm{KL}}{\mathrm{KL}_\mathrm{target}} - 1,
        -0.2, 0.2\Big), \qquad \beta \leftarrow \beta\,\Big(1 + e\,\frac{n_\mathrm{steps}}{H}\Big)

    Args:
        init_kl_coef: initial β, finite and positive.
        target_kl: the KL the run aims for, finite and positive.
        horizon: ``H``, how many samples the correction is spread over; finite and positive.

    Example:
        >>> ctl = ProportionalKLController(init_kl_coef=0.1, target_kl=6.0, horizon=10)
        >>> round(ctl.update(12.0, n_steps=1), 6)   # error clipped to +0.2
        0.102
    """

    _params = ("target_kl", "horizon")

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: float) -> None:
        super().__init__(init_kl_coef)
        self.target_kl = check_positive("target_kl", target_kl)
        self.horizon = check_positive("horizon", horizon)

    def _next_coef(self, current_kl: float, n_steps: int) -> float:
        error = min(max(current_kl / self.target_kl - 1.0, -0.2), 0.2)
        return self.kl_coef * (1.0 + error * n_steps / self.horizon)
