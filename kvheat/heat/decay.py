"""Time-decay functions (SPEC §2.2): weight of an access `t` seconds old.

All three take scalars or numpy arrays and return the same shape. The seed's logarithmic
form grows with age; kvheat's decreases: `1 / (1 + ln(1 + a·t))`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import overload

import numpy as np
from numpy.typing import NDArray

Array = NDArray[np.float64]


def _check_age(t: float | Array) -> None:
    if np.any(np.asarray(t) < 0):
        raise ValueError("decay age must be >= 0")


@dataclass(slots=True, frozen=True)
class Decay:
    """One interface: `kind` is 'exp' (rate λ), 'hyperbolic' (α) or 'log' (a)."""

    kind: str = "exp"
    rate: float = 0.2

    def __post_init__(self) -> None:
        if self.kind not in ("exp", "hyperbolic", "log"):
            raise ValueError(f"unknown decay {self.kind!r}; use exp, hyperbolic or log")
        if not (self.rate > 0 and math.isfinite(self.rate)):
            raise ValueError("decay rate must be a positive finite number")

    @overload
    def __call__(self, t: float) -> float: ...
    @overload
    def __call__(self, t: Array) -> Array: ...

    def __call__(self, t):  # type: ignore[no-untyped-def]
        _check_age(t)
        if isinstance(t, np.ndarray):
            if self.kind == "exp":
                return np.exp(-self.rate * t)
            if self.kind == "hyperbolic":
                return 1.0 / (1.0 + self.rate * t)
            return 1.0 / (1.0 + np.log1p(self.rate * t))
        t = float(t)
        if self.kind == "exp":
            return math.exp(-self.rate * t)
        if self.kind == "hyperbolic":
            return 1.0 / (1.0 + self.rate * t)
        return 1.0 / (1.0 + math.log1p(self.rate * t))

    def half_life(self) -> float:
        """Age at which the weight is 1/2."""
        if self.kind == "exp":
            return math.log(2) / self.rate
        if self.kind == "hyperbolic":
            return 1.0 / self.rate
        return math.expm1(1.0) / self.rate


def exponential(t: float | Array, lam: float = 0.2) -> float | Array:
    return Decay("exp", lam)(t)


def hyperbolic(t: float | Array, alpha: float = 0.2) -> float | Array:
    return Decay("hyperbolic", alpha)(t)


def logarithmic(t: float | Array, a: float = 0.2) -> float | Array:
    return Decay("log", a)(t)


def rate_for_half_life(half_life_s: float) -> float:
    """Exponential rate λ whose weight halves every `half_life_s` seconds."""
    if half_life_s <= 0:
        raise ValueError("half-life must be positive")
    return math.log(2) / half_life_s


def log_add_exp(a: float, b: float) -> float:
    """ln(e^a + e^b) without overflow: adding an access to a log-space decayed count."""
    if a < b:
        a, b = b, a
    return a + math.log1p(math.exp(b - a))
