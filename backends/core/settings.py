"""Bounds of a method's settings, declared once on the field: the dataclass checks them when it is
made (a bad value from the command line, a saved session or the window is refused with the field's
name), and front ends read the same bounds (a spin box offers only what would be accepted).

Example: ``max_nodes: int = bounded(16, 1, 64)``; ``Settings(max_nodes=0)`` raises
``ValueError("max_nodes must be in 1..64, got 0")``.
"""

from __future__ import annotations

from dataclasses import field, fields
from typing import Any

RANGE = "range"  # field metadata key: (low, high, low_open, high_open)


def bounded(default: Any, low: float, high: float, *, low_open: bool = False, high_open: bool = False) -> Any:
    """A dataclass field whose value must lie between ``low`` and ``high`` (inclusive unless open)."""
    return field(default=default, metadata={RANGE: (low, high, low_open, high_open)})


def describe(bounds: tuple[float, float, bool, bool]) -> str:
    """``1..64`` for a closed range of integers, else interval notation such as ``[0, 1)``."""
    low, high, low_open, high_open = bounds
    if isinstance(low, int) and isinstance(high, int) and not (low_open or high_open):
        return f"{low}..{high}"
    return f"{'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"


def check_ranges(settings: Any) -> None:
    """Raise ``ValueError`` naming the first field of ``settings`` outside its declared bounds."""
    for f in fields(settings):
        if RANGE not in f.metadata:
            continue
        low, high, low_open, high_open = f.metadata[RANGE]
        value = getattr(settings, f.name)
        if value < low or value > high or (low_open and value == low) or (high_open and value == high):
            raise ValueError(f"{f.name} must be in {describe(f.metadata[RANGE])}, got {value}")


class Settings:
    """Base of the settings dataclasses: construction checks every ``bounded`` field. A subclass
    with rules between fields extends ``__post_init__`` and calls this one first."""

    def __post_init__(self) -> None:
        check_ranges(self)
