"""A decayed running mean, shared by the gateway's controller and the hybrid drafter."""

from __future__ import annotations


class Ewma:
    """Exponentially decayed mean (weights sum, so early values are not biased towards 0)."""

    def __init__(self, decay: float):
        self.decay, self.total, self.weight = decay, 0.0, 0.0

    def add(self, value: float, weight: float = 1.0) -> None:
        self.total = self.total * self.decay + value * weight
        self.weight = self.weight * self.decay + weight

    @property
    def value(self) -> float | None:
        return self.total / self.weight if self.weight > 1e-9 else None
