"""Exponentially decayed sums: what the heatmap (dispatcher/heatmap.py) and the reader racks'
fetch records (dispatcher/reader_racks.py) keep per node, block and rack."""

from __future__ import annotations

import math


class DecayedSums:
    """Decayed sums of several quantities, all at one timestamp."""

    __slots__ = ("values", "at")

    def __init__(self, n: int, now: float):
        self.values = [0.0] * n
        self.at = now

    def advance(self, now: float, half_life: float) -> None:
        if now > self.at:
            factor = math.exp2(-(now - self.at) / half_life)
            self.values = [v * factor for v in self.values]
            self.at = now

    def add(self, now: float, half_life: float, amounts) -> None:
        self.advance(now, half_life)
        self.values = [v + a for v, a in zip(self.values, amounts)]
