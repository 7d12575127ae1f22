"""What the device's KV slots hold, in the four parts of the paper's Figure 2.

Every slot of the device pool (blocks x block size) is in exactly one part:
- token states: it holds the key and value of a token;
- reservation: it is set aside for a token its request will still produce;
- internal fragmentation: it is set aside but will never be used (a reservation beyond the
  request's true final length, power-of-two rounding, the unfilled tail of a paged last block);
- external fragmentation and free: nobody holds it.
The block manager of each memory policy counts them (`slot_breakdown`); the scheduler averages
them over the steps of a run.
"""

from __future__ import annotations

from dataclasses import dataclass

PARTS = ("token_states", "reservation", "internal_fragmentation", "external_fragmentation_free")


@dataclass(slots=True)
class KVBreakdown:
    """Slots of the device pool in each part; the four add up to the pool."""

    token_states: int = 0
    reservation: int = 0
    internal_fragmentation: int = 0
    external_fragmentation_free: int = 0

    @property
    def num_slots(self) -> int:
        return self.token_states + self.reservation + self.internal_fragmentation + self.external_fragmentation_free

    def fractions(self) -> dict[str, float]:
        total = self.num_slots
        return {part: (getattr(self, part) / total if total else 0.0) for part in PARTS}


class KVBreakdownAverage:
    """The breakdown summed over steps: `fractions()` is the run's average share of each part."""

    def __init__(self) -> None:
        self.num_steps = 0
        self._sums = dict.fromkeys(PARTS, 0)

    def add(self, breakdown: KVBreakdown) -> None:
        self.num_steps += 1
        for part in PARTS:
            self._sums[part] += getattr(breakdown, part)

    def fractions(self) -> dict[str, float]:
        total = sum(self._sums.values())
        return {part: (value / total if total else 0.0) for part, value in self._sums.items()}
